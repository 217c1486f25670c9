"""The tiny model and engine loop behind `easykv demo` (see run.py)."""
