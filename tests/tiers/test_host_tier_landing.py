"""Offloaded pages land in the host pages in one pass over their bytes (issue 44: the host tier's
page copies against a plain copy of the same bytes), and a scrub of a page still in flight drops
that page's landing only."""

from __future__ import annotations

import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np

import easykv
from easykv.sharding import PartitionAxis, PartitionManager
from tests.tiers.test_host_tier_calls import numbered

PAGES = 32  # device and host pages per layer


def tiered(mesh):
    """A pool of 32 pages of 16 KiB per device and leaf (4 layers, 8 kv heads over tp=8, pages of
    16 tokens, head_dim 128, bf16), every element numbered, with 32 host pages."""
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp"))
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 4, 4, 64, 16, 8, 128, 0.5, jnp.bfloat16, partition_manager=pm, num_pages_per_layer=PAGES,
    ).replace(host_pages_per_layer=PAGES)
    cache = numbered(easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm))
    return cache, easykv.HostTier(cache)


def host_pages(tier) -> list[np.ndarray]:
    """Each leaf's host pages over all heads, ``(layers, heads, host pages, ...)`` as the pool."""
    store = tier._groups[0]
    out = []
    for shards in store.shards:
        blocks = sorted(shards.items(), key=lambda item: item[0][1][0])  # by first kv head
        out.append(np.moveaxis(np.concatenate([a for _, a in blocks], axis=2), 0, 2))
    return out


def device_pages(cache) -> list[np.ndarray]:
    return [np.asarray(a).copy() for a in jax.tree.leaves((cache.key_pages[0], cache.value_pages[0]))]


def test_landing_an_offload_writes_its_pages_without_a_temporary_copy(tp8):
    """The offloaded pages go from the staged device buffers into the host pages directly:
    landing 16 pages (256 KiB per device and leaf) allocates less than one page's worth of host
    memory. Fails on a landing that first copies the staged pages out (a boolean-masked copy of
    them, then the write: two passes over the bytes, a copy of 16 pages per shard)."""
    cache, tier = tiered(tp8)
    src = np.arange(16, dtype=np.int32) * 2
    dst = np.arange(16, dtype=np.int32) + 8
    empty = np.zeros(0, np.int32)
    before = device_pages(cache)
    cache = tier.apply(cache, ((src, dst, empty, empty, empty),))
    jax.block_until_ready(jax.tree.leaves(cache))
    tracemalloc.start()
    try:
        tier.flush()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    page_of_one_device = 4 * 1 * 16 * 128 * 2  # layers x heads of a device x tokens x head_dim x bf16
    assert peak < page_of_one_device, f"landing allocated {peak} bytes"
    for got, want in zip(host_pages(tier), before):
        np.testing.assert_array_equal(got[:, :, dst], want[:, :, src])


def test_a_scrub_drops_only_the_landings_into_its_own_pages(tp8):
    """Four pages offloaded, one of their host pages scrubbed while they are in flight: that
    page stays zero, the other three land bit for bit, and other host pages stay untouched."""
    cache, tier = tiered(tp8)
    src = np.array([3, 9, 17, 30], np.int32)
    dst = np.array([0, 5, 6, 20], np.int32)
    empty = np.zeros(0, np.int32)
    before = device_pages(cache)
    cache = tier.apply(cache, ((src, dst, empty, empty, empty),))
    tier.scrub((np.array([5], np.int32),))
    tier.flush()
    kept = np.array([0, 6, 20])
    others = np.setdiff1d(np.arange(PAGES), kept)
    for got, want in zip(host_pages(tier), before):
        np.testing.assert_array_equal(got[:, :, kept], want[:, :, src[[0, 2, 3]]])
        assert not got[:, :, others].any()
