"""The static description of a cache, before any page array exists: ``metadata`` (the model's
shape, page size, dtype, quantizer and partitioning, and the pool sized from a memory budget),
``memory`` (device memory budgets), ``sizing`` (pages and batch sizes from a budget, Modular
MAX's estimate helpers) and ``serialization`` (the exact JSON form these descriptions take).
They are one unit because everything else (pages, the manager, checkpoints) is built from these
values and they change only when the model or the deployment does; nothing is imported here.
"""
