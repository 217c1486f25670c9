"""The static description of a cache, before any page array exists: ``metadata`` (the model's
shape, page size, dtype, quantizer and partitioning: ``PagedAttentionCacheMetaData``),
``create`` (its pool sized from a memory budget, ``PagedAttentionCacheMetaData.create``),
``groups`` (layer groups and the attention kind), ``layout`` (how kv heads and pages map onto a
mesh), ``relayout`` (a metadata laid out for another mesh), ``memory`` (device memory budgets),
``sizing`` (pages and batch sizes from a budget, Modular MAX's estimate helpers), ``dtypes``,
``presets`` (open models' cache shapes) and ``serialization`` (the exact JSON form these
descriptions take).

They are one unit because everything else (pages, the manager, checkpoints) is built from these
values and they change only when the model or the deployment does. This package imports no
array code of ``storage`` (nor anything above it); nothing is imported here.
"""
