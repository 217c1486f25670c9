"""A small engine run to checkpoint: a cache (any layout, any quantizer) driven by a PageManager
with live sequences, a shared prompt prefix, a fork (resolved by copy-on-write) and a released
sequence whose full pages stay cached. Deterministic, so a subprocess and the test build the same state.

Pools are those of cache_helpers: 2 layers, 24 pages of 4 tokens, head_dim 8, bf16 logical.
"""

from __future__ import annotations

import functools
import warnings

import jax
import numpy as np

from cache_helpers import HEAD_DIM, LAYERS, LAYOUTS, MAX_LEN, PAGE_SIZE, PAGES, mesh_for, random_tokens
from easykv import PagedAttentionCache, PagedAttentionCacheMetaData
from easykv.manager import PageManager
from sharding import PartitionManager, ShardingAdjustedWarning


@functools.lru_cache(maxsize=None)
def qsetup(layout: str, quantizer: str = "none", pages: int = PAGES, page_size: int = PAGE_SIZE):
    """(mesh, partition manager, metadata) for a layout and quantizer."""
    _, paxis, heads = LAYOUTS[layout]
    mesh, pm = mesh_for(layout), PartitionManager(paxis)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        meta = PagedAttentionCacheMetaData.create(
            mesh, 4, LAYERS, MAX_LEN, page_size, heads, HEAD_DIM, 0.9, "bfloat16",
            partition_manager=pm, quantizer=quantizer, num_pages_per_layer=pages,
        )  # fmt: skip
    return mesh, pm, meta


def new_qcache(layout: str, quantizer: str = "none", **kw) -> PagedAttentionCache:
    mesh, pm, meta = qsetup(layout, quantizer, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        return PagedAttentionCache.init_cache(mesh, meta.dtype, meta, pm, quantizer)


def write_step(cache, manager, seqs, counts, tokens, rng):
    """One engine step: reserve, apply copies/scrubs, write random K/V, commit ``tokens``."""
    meta = manager.build_step_metadata(seqs, counts, pad_tokens_to=16)
    cache, _ = manager.apply_pending(cache)
    heads = cache.metadata.num_kv_heads
    keys = random_tokens(rng, (LAYERS, 16, heads, HEAD_DIM))
    values = random_tokens(rng, (LAYERS, 16, heads, HEAD_DIM))
    cache, dropped = cache.write(keys, values, meta)
    assert int(dropped) == 0
    manager.step(seqs, tokens)
    return cache


def engine_run(layout: str = "heads", quantizer: str = "none", seed: int = 0):
    """(cache, manager, rng) mid-run: a, b share a prompt prefix, c forks a (its shared
    partial page is copied on its first write), d was released (its full pages are cached)."""
    rng = np.random.default_rng(seed)
    cache = new_qcache(layout, quantizer)
    manager = PageManager(qsetup(layout, quantizer)[2])
    prompt = list(range(10))
    a, b = manager.claim(2)
    cache = write_step(cache, manager, [a], [10], [prompt], rng)
    done = manager.match_prefix(b, prompt)
    assert done == 8
    cache = write_step(cache, manager, [b], [2], [prompt[done:]], rng)
    c = manager.fork(a)
    cache = write_step(cache, manager, [c, a], [1, 1], [[40], [41]], rng)
    [d] = manager.claim(1)
    cache = write_step(cache, manager, [d], [9], [list(range(100, 109))], rng)
    manager.release(d)
    manager.check_invariants()
    return cache, manager, rng


def raw_leaves(cache) -> list[np.ndarray]:
    """Every page array (values and scales) as raw bits, host copies."""
    out = []
    for leaf in jax.tree.leaves(cache):
        a = np.asarray(leaf)
        out.append(a.view(f"u{a.dtype.itemsize}").copy())
    return out


def assert_same_bits(a, b) -> None:
    la, lb = raw_leaves(a), raw_leaves(b)
    assert len(la) == len(lb)
    for i, (x, y) in enumerate(zip(la, lb)):
        assert x.shape == y.shape and np.array_equal(x, y), f"leaf {i} differs"
