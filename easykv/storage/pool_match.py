"""Whether a cache is a live cache of a given pool: the check every caller that takes a cache
for a manager's pages makes (the runner, sleep, sequence export and import), written once.

A manager schedules exactly one pool: the same page size, pages, page split, sequences and layer
groups. A cache whose buffers were donated to an earlier call holds deleted arrays: applying work
to it would fail inside XLA, after the manager had handed the work over. Imports ``spec`` and the
cache.
"""

from __future__ import annotations

import jax

from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.storage.cache import PagedAttentionCache

# The fields that say which pool a cache is: a manager schedules exactly one.
POOL_FIELDS = ("page_size", "num_pages_per_layer", "page_shards", "batch_size", "max_sequences",
               "num_pages_per_sequence")


def check_cache_of(cache: object, metadata: PagedAttentionCacheMetaData,
                   what: str = "the cache") -> PagedAttentionCacheMetaData:
    """The metadata of ``cache`` once it is a live cache of ``metadata``'s pool; ValueError naming
    the difference otherwise.

    Args:
      cache: the cache to check (any object: a wrong one gets the error).
      metadata: the pool's metadata (a manager's).
      what: how the error message names the cache.
    """
    if not isinstance(cache, PagedAttentionCache):
        raise ValueError(f"{what} must be the PagedAttentionCache of this manager's pool, got {type(cache).__name__}")
    meta = cache.metadata
    diff = [f"{k}: cache {getattr(meta, k)}, manager {getattr(metadata, k)}" for k in POOL_FIELDS
            if getattr(meta, k) != getattr(metadata, k)]
    pools = [(g.attention, g.window, g.num_pages) for g in meta.groups]
    theirs = [(g.attention, g.window, g.num_pages) for g in metadata.groups]
    if pools != theirs:
        diff.append(f"layer groups (attention, window, pages): cache {pools}, manager {theirs}")
    if diff:
        raise ValueError(f"{what} is a cache of another pool than this manager's (" + "; ".join(diff) + "); pass "
                         "the cache of the metadata the PageManager was created with")
    if any(leaf.is_deleted() for leaf in jax.tree.leaves(cache) if isinstance(leaf, jax.Array)):
        raise ValueError(f"{what} holds deleted arrays: it was donated to an earlier call (cache.write, a runner's "
                         "step, import_sequence, sleep, ...); pass the cache that call returned")
    return meta


__all__ = ["POOL_FIELDS", "check_cache_of"]
