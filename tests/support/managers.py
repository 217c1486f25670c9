"""Page managers on tiny pools for the host-side tests: page_size 4, a handful of pages, two
layers, so exact page ids can be asserted; and the small moves an engine makes with them."""

from __future__ import annotations

from easykv.manager.manager import PageManager
from easykv.spec.metadata import PagedAttentionCacheMetaData

PS = 4


def make_meta(batch=4, pages=10, max_len=16, shards=1, page_size=PS):
    return PagedAttentionCacheMetaData(
        batch_size=batch, num_hidden_layers=2, num_pages_per_layer=pages,
        num_pages_per_sequence=-(-max_len // page_size), max_sequences=max_len, page_size=page_size,
        num_kv_heads=2, kv_head_dim_size=8, hbm_utilization=0.9, page_shards=shards)


def make(**kw):
    opts = {k: kw.pop(k) for k in ("enable_prefix_caching", "scrub_released") if k in kw}
    return PageManager(make_meta(**kw), **opts)


def prefill(pm, seq, tokens, salt=None):
    """Admit ``tokens`` for ``seq`` the way an engine would; returns the cached prefix length."""
    done = pm.match_prefix(seq, tokens, salt=salt)
    pm.commit(pm.schedule([seq], [len(tokens) - done]), [list(tokens[done:])])
    return done


def cached_ids(pm):
    """The cached pages in eviction order (replica 0's LRU of group 0's pool), as the state lists them."""
    pool = pm.state_dict(host_tier=True)["pool"]  # host_tier: readable while sequences are swapped out
    return (pool[0] if isinstance(pool, list) else pool)["lru"][0]
