"""The shared prefix store: a tier below the host-memory tier that every cache of the same model and
format shares, in any process, on any mesh, across restarts (`PrefixStore`, used through
``easykv.Runner(..., store=store)``).

- ``backend``: what a storage engine must do (`StoreBackend`); ``tensorstore_kv`` (tensorstore's
  kvstore: ``file://``, ``memory://``, ``gs://``, ``s3://``) and ``redis_kv`` (Redis / Valkey) are
  the engines; ``url`` opens one from a URL (`open_backend`); ``key_syntax`` is the one check of
  key and prefix syntax every backend applies.
- ``namespace``: the keys (`StoreNamespace`: the page digest inside a namespace of the model and the
  page format); ``codec``: the values (header, raw stored bits, checksum; never unpickled).
- ``prefix_store``: the store tier (`PrefixStore`, its policies and `StoreMetrics`); ``store_io``: its
  background writer and fetcher; ``device_pages``: the device pages gathered for ``write_through``.

Sits on the host tier (``easykv.tiers.host``), the manager and storage; never imports ``checkpoint``
or the runner.
"""

from easykv.tiers.store.backend import GcResult, StoreBackend, StoreStats
from easykv.tiers.store.namespace import StoreNamespace
from easykv.tiers.store.prefix_store import READ_POLICIES, WRITE_POLICIES, PrefixStore, StoreMetrics
from easykv.tiers.store.url import open_backend

__all__ = ["READ_POLICIES", "WRITE_POLICIES", "GcResult", "PrefixStore", "StoreBackend", "StoreMetrics",
           "StoreNamespace", "StoreStats", "open_backend"]
