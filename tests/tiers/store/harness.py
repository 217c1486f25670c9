"""Replicas for the shared prefix store's tests: a cache, its manager, host tier and runner on one of three
meshes (tp=8, dp=2 x tp=4, one device), filled with K/V that are a deterministic function of the token, its
position, the layer, the head and the dim, so any sequence's pages can be checked against its own tokens; a
reference replica without the store gives the bits a run computes by itself."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import easykv
from easykv import LayerGroup, PageManager
from easykv.sharding import PartitionAxis, PartitionManager, ShardingAdjustedWarning, create_mesh
from easykv.tiers.store import PrefixStore, StoreBackend
from easykv.tiers.store.backend import GcResult, StoreStats

PS = 4
HEADS, DIM = 8, 8
LAYOUTS = ("tp8", "dp2tp4", "one")
# a sliding group of 4 heads and a full group of 8 whose values are narrower than its keys
TWO_GROUPS = (LayerGroup((0, 2), "sliding", 6, num_kv_heads=4, key_head_dim=8, value_head_dim=8, num_pages=16),
              LayerGroup((1,), "full", num_kv_heads=8, key_head_dim=16, value_head_dim=8, num_pages=16))


def mesh_of(layout: str):
    if layout == "tp8":
        return create_mesh({"dp": 1, "tp": 8}), PartitionManager(PartitionAxis(kv_head_axis="tp"))
    if layout == "dp2tp4":
        return create_mesh({"dp": 2, "tp": 4}), PartitionManager(PartitionAxis(kv_head_axis="tp", page_axis="dp"))
    assert layout == "one"
    mesh = create_mesh({"dp": 1, "tp": 1}, devices=np.array(jax.devices()[:1]))
    return mesh, PartitionManager(PartitionAxis(kv_head_axis="tp"))


def kv_of(tokens: Sequence[int], start: int, layer: int, heads: int, dim: int) -> np.ndarray:
    """K of ``tokens`` at positions ``start..``, of ``layer``: exact in float32 (V is its negation)."""
    n = len(tokens)
    base = np.asarray(tokens, np.float32)[:, None, None] * 16 + (start + np.arange(n, dtype=np.float32))[:, None, None]
    k = base + np.arange(dim, dtype=np.float32) / 64 + np.arange(heads, dtype=np.float32)[:, None] * 1000
    return (k + layer * 10000).astype(np.float32)


class Replica:
    """One cache on ``layout`` with its runner (and ``store``, or none: the reference)."""

    def __init__(self, layout: str, store: PrefixStore | None = None, *, pages: int = 16, host_pages: int = 16,
                 groups: tuple[LayerGroup, ...] | None = None, quantizer: str | None = None,
                 dtype: str = "float32", layers: int = 2, page_size: int = PS, host: bool = True, max_len: int = 32):
        mesh, rule = mesh_of(layout)
        self.layers = 3 if groups is not None else layers
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ShardingAdjustedWarning)
            meta = easykv.PagedAttentionCacheMetaData.create(
                mesh, 4, self.layers, max_len, page_size, HEADS, DIM, 0.5, dtype, partition_manager=rule,
                quantizer=quantizer, num_pages_per_layer=None if groups else pages, layer_groups=groups)
            if host:
                meta = meta.replace(host_pages_per_layer=host_pages)
            cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.dtype(dtype), meta, rule, quantizer=quantizer)
        self.dtype = jnp.dtype(dtype)
        self.manager = PageManager(cache.metadata)
        self.host = easykv.HostTier(cache) if host else None
        self.store = store
        self.runner = easykv.Runner(self.manager, cache, host=self.host, store=store)
        self.tokens: dict[int, list[int]] = {}
        meta = cache.metadata
        self.shapes = []  # per layer: (heads, key dim, value dim or None)
        for layer in range(self.layers):
            g = meta.groups[meta.group_of(layer)[0]]
            self.shapes.append((g.num_kv_heads or HEADS, g.key_head_dim or DIM,
                                (g.value_head_dim or DIM) if g.has_values else None))

    @property
    def cache(self):
        return self.runner.cache

    def _step(self, tokens: Sequence[Sequence[int]], starts: Sequence[int]):
        ks, vs = [], []
        for layer, (heads, kdim, vdim) in enumerate(self.shapes):
            ks.append(jnp.asarray(np.concatenate([kv_of(t, s, layer, heads, kdim) for t, s in zip(tokens, starts)]),
                                  self.dtype))
            vs.append(None if vdim is None else jnp.asarray(
                np.concatenate([-kv_of(t, s, layer, heads, vdim) for t, s in zip(tokens, starts)]), self.dtype))

        def step(cache, plan):
            cache, _ = cache.write(ks, vs, plan.metadata)
            return cache, None

        return step

    def prefill(self, prompt: Sequence[int], *, salt=None) -> tuple[int, int]:
        """A new sequence of ``prompt`` (its cached prefix found through the runner); returns (seq, found)."""
        [seq] = self.manager.claim(1)
        found = self.runner.match_prefix(seq, prompt, salt=salt)
        rest = list(prompt[found:])
        plan = self.manager.schedule([seq], [len(rest)])
        self.runner.run(plan, self._step([rest], [found]), token_ids=[rest])
        self.tokens[seq] = list(prompt)
        return seq, found

    def decode(self, seq: int, token: int) -> None:
        plan = self.manager.schedule([seq], [1])
        self.runner.run(plan, self._step([[token]], [len(self.tokens[seq])]), token_ids=[[token]])
        self.tokens[seq].append(token)

    def release(self, seq: int) -> None:
        self.manager.release(seq)
        del self.tokens[seq]

    def read(self, seq: int) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Per layer, the K and V the sequence's pages hold at the positions its group keeps."""
        meta, out = self.cache.metadata, []
        for layer in range(self.layers):
            g, _ = meta.group_of(layer)
            first = self.manager.sequence(seq).first_kept[g]
            pages = np.asarray(self.manager.pages(seq, group=g))
            k, v = easykv.gather_kv(self.cache, layer, np.where(pages < 0, 0, pages), self.manager.length(seq))
            out.append((np.asarray(k)[first:], None if v is None else np.asarray(v)[first:]))
        return out

    def check_own_tokens(self, seq: int) -> None:
        """The sequence's pages hold exactly its own tokens' K/V (float32, unquantized replicas)."""
        tokens = self.tokens[seq]
        for layer, (k, v) in enumerate(self.read(seq)):
            heads, kdim, vdim = self.shapes[layer]
            first = len(tokens) - k.shape[0]
            np.testing.assert_array_equal(k, kv_of(tokens[first:], first, layer, heads, kdim), f"layer {layer} K")
            if vdim is not None:
                np.testing.assert_array_equal(v, -kv_of(tokens[first:], first, layer, heads, vdim), f"layer {layer} V")

    def page_leaves(self, seq: int, group: int = 0) -> list[list[np.ndarray]]:
        """Per full page of the sequence in ``group``, every leaf's bits (K, V, scales) of that page."""
        cache = self.cache
        leaves = jax.tree.leaves((cache.key_pages[group], cache.value_pages[group]))
        host = [np.asarray(a) for a in leaves]
        pages = [p for p in self.manager.pages(seq, group=group)][: len(self.tokens[seq]) // PS]
        return [[a[:, :, p].view(np.uint8) for a in host] for p in pages]


def same_reads(a, b) -> None:
    for layer, ((k1, v1), (k2, v2)) in enumerate(zip(a, b)):
        assert k1.dtype == k2.dtype
        np.testing.assert_array_equal(k1.view(np.uint8), k2.view(np.uint8), f"layer {layer} K")
        if v1 is not None or v2 is not None:
            np.testing.assert_array_equal(v1.view(np.uint8), v2.view(np.uint8), f"layer {layer} V")


class GatedBackend(StoreBackend):
    """A real backend whose ``get_many`` waits on ``gate`` (a slow store); everything else passes through."""

    def __init__(self, inner: StoreBackend):
        self.inner = inner
        self.url = inner.url
        self.gate = threading.Event()
        self.gets = 0

    def exists_many(self, keys):
        return self.inner.exists_many(keys)

    def get_many(self, keys):
        self.gets += 1
        self.gate.wait()
        return self.inner.get_many(keys)

    def put_if_absent(self, items):
        return self.inner.put_if_absent(items)

    def delete_many(self, keys):
        return self.inner.delete_many(keys)

    def list_keys(self, prefix: str = "") -> list[str]:
        return self.inner.list_keys(prefix)

    def stats(self, prefix: str = "") -> StoreStats:
        return self.inner.stats(prefix)

    def gc(self, max_bytes: int, prefix: str = "") -> GcResult:
        return self.inner.gc(max_bytes, prefix)

    def close(self) -> None:
        self.inner.close()


__all__ = ["LAYOUTS", "PS", "TWO_GROUPS", "GatedBackend", "Replica", "kv_of", "mesh_of", "same_reads"]
