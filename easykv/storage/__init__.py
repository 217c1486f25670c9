"""The cache's pages on devices: ``pages`` (storage dtypes, placement over the mesh, page reads
and copies), ``placement`` (each layer group's placement, the metadata completed for a mesh,
and whether the pages fit), ``writes`` (the one scatter every write of new tokens goes through,
and its checks), ``view`` (one layer's view, EasyDeL's ``PagedAttentionCacheView``, and
``cache.views``), ``cache`` (``PagedAttentionCache``, its functional writes and copies, and
``gather_kv``), ``cache_json`` (their dict and JSON forms) and ``convert`` (page arrays bitcast
between platforms' storage, or re-encoded into another dtype or quantizer).

They are one unit because they are the only code that allocates, places, writes and reads page
arrays; what to write where comes from the runtime metadata, never from the page manager,
which this package does not import. Inside, imports point one way: the cache knows its views,
a view knows the JSON forms, and those know the placement rules and the pages, never back.
This package never imports ``attention``, ``checkpoint`` or ``tiers``; nothing is imported here.
"""
