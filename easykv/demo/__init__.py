"""The tiny model and engine loop behind `easykv demo` (see run.py): the model (model.py), its
trained weights (weights/, loaded and checked by weights.py), the engine (engine.py) and the
requests it serves (workload.py)."""
