"""The Tunix engine's shared prefix store: the host-memory tier the store's pages land in, and the weight version
the store's keys carry (the ``store=`` argument itself, a `PrefixStore` or a URL with the model's id, is checked by
`easykv.tiers.store.arguments`).

Why the weight version is the weights' content: the page digest (the store's key) holds the manager's weight
version, and a store outlives every engine that writes it. An engine's own count of weight changes would make a
rollout worker restarted with the weights of RL step 40 (its version 0) read the pages another worker wrote
with the initial weights (also its version 0), and two training runs of one model name would share pages at
equal step counts: wrong tokens, silently. A fingerprint of the parameters' bits (computed on the devices, one
pass over the weights, no copy to the host) is the same for the same weights in every process and across
restarts, and differs when any parameter changes, so pages of old weights are never served and a restarted
worker with the pushed weights reads what the others wrote under them.

Private to the Tunix integration.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from easykv.integrations._tunix_qwix import qwix_signature
from easykv.spec.metadata import PagedAttentionCacheMetaData


def with_store_host_tier(meta: PagedAttentionCacheMetaData) -> PagedAttentionCacheMetaData:
    """``meta`` with the host tier a store's pages land in, when it has none: as many host pages per layer as one
    `generate` can hold (``batch_size`` sequences of ``max_sequences`` tokens), at most the device pool, rounded
    up to the data-parallel replicas. Every prompt page a call reads from the store fits, and pages the device
    evicts stay in host memory until then.

    Args:
      meta: the engine's metadata."""
    if meta.has_host_tier:
        return meta
    per_sequence = -(-meta.max_sequences // meta.page_size)
    pages = min(meta.num_pages_per_layer, meta.batch_size * per_sequence)
    shards = meta.page_shards
    return meta.replace(host_pages_per_layer=-(-pages // shards) * shards)


class WeightsFingerprint:
    """The weight version of a model's parameters (see the module doc): ``"params-sha256:<hex>"`` of every
    parameter's path, shape, dtype and a 64-bit fingerprint of its bits, and of a qwix model's LoRA or
    quantization options (`qwix_signature`), equal on every process. Each array's
    fingerprint is kept while the array lives, so a new version costs a pass over the arrays that changed only
    (a LoRA run's adapters, not its frozen base)."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref[Any], bytes]] = {}  # id(array) -> (the array, its two lanes)

    def __call__(self, model: Any) -> str:
        flat, _ = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))
        leaves = [a for _, a in flat]
        new = [a for a in leaves if self._lanes(a) is None]
        if new:
            sums = np.asarray(jax.device_get(_fingerprints(new)), np.uint32)  # (new leaves, 2), replicated
            for a, lanes in zip(new, sums):
                self._known[id(a)] = (weakref.ref(a, self._forget(id(a))), lanes.tobytes())
        h = hashlib.sha256(qwix_signature(model).encode())  # a LoRA's alpha, rank, ...: not in the arrays
        for (path, a) in flat:
            h.update(f"{jax.tree_util.keystr(path)}|{tuple(a.shape)}|{jnp.dtype(a.dtype).name}|".encode())
            h.update(self._lanes(a) or b"")
        return "params-sha256:" + h.hexdigest()

    def _lanes(self, a: Any) -> bytes | None:
        known = self._known.get(id(a))
        return known[1] if known is not None and known[0]() is a else None

    def _forget(self, key: int) -> Any:
        known = self._known

        def forget(ref: weakref.ref[Any]) -> None:
            if key in known and known[key][0] is ref:
                del known[key]

        return forget


@jax.jit
def _fingerprints(leaves: list[jax.Array]) -> jax.Array:
    """Two 32-bit sums of mixed (bits, position) per leaf, ``(leaves, 2)``: any changed bit or moved value changes
    them (collisions by chance ~2**-64). Elementwise in each leaf's own shape, so a sharded leaf stays sharded."""
    out = []
    for a in leaves:
        bits = _bits(a)
        position = jnp.zeros(bits.shape, jnp.uint32)
        for axis in range(bits.ndim):  # the row-major position, wrapping at 2**32 like the sums
            stride = int(np.prod(bits.shape[axis + 1:], dtype=np.uint64) % (1 << 32))
            position = position + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * jnp.uint32(stride)
        first = _mix(bits ^ (position * jnp.uint32(0x9E3779B9)))
        second = _mix(bits + position * jnp.uint32(0x85EBCA6B) + jnp.uint32(0x27D4EB2F))
        out.append(jnp.stack([jnp.sum(first, dtype=jnp.uint32), jnp.sum(second, dtype=jnp.uint32)]))
    return jnp.stack(out)


def _bits(a: jax.Array) -> jax.Array:
    """``a``'s raw bits as uint32 (8-byte items as two words; sub-byte and bool items widened exactly)."""
    dtype = jnp.dtype(a.dtype)
    if dtype == jnp.bool_ or dtype.itemsize not in (1, 2, 4, 8) or dtype.name in ("int4", "uint4", "int2", "uint2"):
        return jax.lax.bitcast_convert_type(a.astype(jnp.int32), jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[dtype.itemsize]
    return jax.lax.bitcast_convert_type(a, unsigned).astype(jnp.uint32)


def _mix(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: every input bit moves every output bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


__all__ = ["WeightsFingerprint", "with_store_host_tier"]
