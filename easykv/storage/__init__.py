"""The cache's pages on devices: ``pages`` (storage dtypes, placement over the mesh, page reads
and copies), ``writes`` (the one scatter every write of new tokens goes through), ``cache`` (the
per-layer views, the cache that holds them, and gather) and ``cache_json`` (their dict and JSON
forms). They are one unit because they are the only code that allocates, places, writes and
reads page arrays; what to write where comes from the runtime metadata, never from the page
manager, which this package does not import; nothing is imported here.
"""
