"""Caches on disk and between hosts: ``checkpointer`` (``save_cache``, ``restore_cache``,
``CacheCheckpointer``, ``list_steps``), ``format`` (the on-disk layout and reading it back),
``integrity`` (fingerprints of every persisted byte), ``record`` (the sealed JSON record and the
saved manager state), ``reshard`` (retargeting saved pages onto another mesh, platform, dtype or
quantizer), ``writer`` (the one-writer lock and write errors), ``transfer`` (one sequence's pages
and page-manager entry exported from one cache and imported into another) and ``inspect`` (a
report on a checkpoint without restoring it). They are one unit because they sit on top of
everything else, joining a cache's pages with its manager's state, and they bring orbax, which
``import easykv`` loads only on first use; nothing is imported here.
"""
