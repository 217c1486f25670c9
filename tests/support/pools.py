"""Shared fixtures for the cache tests: small pools on each page layout, and a numpy model of
the pool that writes tokens by slot (computed independently of easykv), to compare bitwise.

Every pool: 2 layers, 24 pages of 4 tokens, sequences of at most 16 tokens (4 pages),
head_dim 8, bfloat16 unless stated.
"""

from __future__ import annotations

import functools
import warnings

import jax
import ml_dtypes
import numpy as np

from easykv import PagedAttentionCache, PagedAttentionCacheMetaData, gather_kv
from easykv.sharding import PartitionAxis, PartitionManager, ShardingAdjustedWarning, create_mesh

LAYERS, PAGES, PAGE_SIZE, HEAD_DIM, MAX_LEN = 2, 24, 4, 8, 16
PAGES_PER_SEQ = MAX_LEN // PAGE_SIZE
SLOTS = PAGES * PAGE_SIZE

# name -> (mesh axes, PartitionAxis, kv heads)
LAYOUTS = {
    "single": ({"tp": 1}, PartitionAxis(), 8),
    "heads": ({"dp": 1, "tp": 8}, PartitionAxis(), 8),
    "replicated": ({"dp": 1, "tp": 8}, PartitionAxis(), 4),
    "dp": ({"dp": 2, "tp": 4}, PartitionAxis(page_axis="dp"), 8),
}


@functools.cache
def mesh_for(name: str):
    dims = LAYOUTS[name][0]
    devices = jax.devices()[:1] if name == "single" else None
    return create_mesh(dims, devices=devices)


@functools.cache
def setup(name: str, dtype: str = "bfloat16"):
    """(mesh, partition manager, cache metadata) for a layout."""
    _, paxis, heads = LAYOUTS[name]
    mesh, pm = mesh_for(name), PartitionManager(paxis)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        meta = PagedAttentionCacheMetaData.create(
            mesh, 4, LAYERS, MAX_LEN, PAGE_SIZE, heads, HEAD_DIM, 0.9, dtype,
            partition_manager=pm, num_pages_per_layer=PAGES,
        )  # fmt: skip
    return mesh, pm, meta


def new_cache(name: str, dtype: str = "bfloat16") -> PagedAttentionCache:
    mesh, pm, meta = setup(name, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        return PagedAttentionCache.init_cache(mesh, meta.dtype, meta, pm)


def random_tokens(rng, shape, dtype="bfloat16") -> np.ndarray:
    """Random values with every bit pattern of sign/exponent in play (never all-zero)."""
    x = rng.standard_normal(shape) * 4 + 0.25
    return x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))


def bits(x) -> np.ndarray:
    """The raw bits of an array, for bitwise comparison."""
    x = np.asarray(x)
    return x.view(f"uint{8 * x.dtype.itemsize}")


def snapshot(cache) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.asarray(v.key_pages).copy(), np.asarray(v.value_pages).copy()) for v in cache]


def assert_unchanged(cache, before) -> None:
    """The cache's buffers are alive (not donated) and bit-identical to ``before``."""
    for view, (k, v) in zip(cache, before):
        assert not view.key_pages.is_deleted() and not view.value_pages.is_deleted()
        assert np.array_equal(np.asarray(view.key_pages), k)
        assert np.array_equal(np.asarray(view.value_pages), v)


def slot(row, pos: int) -> int:
    """Reference slot of position ``pos`` through a page-table row."""
    return int(row[pos // PAGE_SIZE]) * PAGE_SIZE + pos % PAGE_SIZE


class PoolModel:
    """A numpy pool per layer, (heads, pages, page_size, head_dim) of raw bits, plus each
    sequence's tokens by position, updated by the tests from page tables and positions."""

    def __init__(self, meta: PagedAttentionCacheMetaData):
        itemsize = np.dtype(meta.dtype).itemsize
        shape = (meta.num_hidden_layers, meta.num_kv_heads, meta.num_pages_per_layer, meta.page_size,
                 meta.kv_head_dim_size)  # fmt: skip
        self.k = np.zeros(shape, f"uint{8 * itemsize}")
        self.v = np.zeros_like(self.k)
        self.seq_k: dict[str, dict[int, np.ndarray]] = {}
        self.seq_v: dict[str, dict[int, np.ndarray]] = {}

    def put(self, keys, values, t: int, slot_id: int, seq: str | None = None, pos: int | None = None):
        """Token row ``t`` of per-layer keys/values (layers, tokens, heads, dim) -> ``slot_id``."""
        page, off = divmod(slot_id, PAGE_SIZE)
        self.k[:, :, page, off] = bits(keys)[:, t]
        self.v[:, :, page, off] = bits(values)[:, t]
        if seq is not None:
            self.seq_k.setdefault(seq, {})[pos] = bits(keys)[:, t]
            self.seq_v.setdefault(seq, {})[pos] = bits(values)[:, t]

    def copy(self, src, dst):
        pairs = [(s, d) for s, d in zip(src, dst) if s >= 0 and d >= 0]
        if pairs:
            s, d = (list(x) for x in zip(*pairs))
            self.k[:, :, d] = self.k[:, :, s]
            self.v[:, :, d] = self.v[:, :, s]

    def zero(self, ids):
        ids = [i for i in ids if i >= 0]
        self.k[:, :, ids] = 0
        self.v[:, :, ids] = 0

    def check_pool(self, cache, layers=None) -> None:
        """Every page of every layer equals the model: written tokens and untouched zeros."""
        for i in range(len(cache)) if layers is None else layers:
            k, v = np.asarray(cache[i].key_pages), np.asarray(cache[i].value_pages)
            assert k.shape == self.k[i].shape
            assert np.array_equal(bits(k), self.k[i]), f"key pages of layer {i} differ"
            assert np.array_equal(bits(v), self.v[i]), f"value pages of layer {i} differ"

    def check_gather(self, cache, layer: int, seq: str, row) -> None:
        n = len(self.seq_k[seq])
        assert sorted(self.seq_k[seq]) == list(range(n)), "test bug: sequence has holes"
        want_k = np.stack([self.seq_k[seq][p][layer] for p in range(n)])
        want_v = np.stack([self.seq_v[seq][p][layer] for p in range(n)])
        k, v = gather_kv(cache, layer, np.asarray(row, np.int32), n)
        assert k.shape == v.shape == (n, want_k.shape[1], HEAD_DIM)
        assert np.dtype(k.dtype) == cache.metadata.dtype
        assert np.array_equal(bits(k), want_k) and np.array_equal(bits(v), want_v)
