"""Retargeting a saved cache onto another mesh, storage platform, dtype or quantizer.

Three pieces, all used by `easykv.checkpoint.restore_cache`:

* `target_metadata`: the saved metadata with the layout fields of the target mesh (kv-head and
  page axes and shard counts) and, with ``convert=True``, another dtype or quantizer. The pool
  (``num_pages_per_layer``) never changes, so page ids in the manager stay valid.
* `reshard_manager_state`: a `PageManager.state_dict` for another number of data-parallel page
  slices. Each replica owns the slice ``[r * n, (r + 1) * n)`` of page ids; a sequence's pages
  (and a pending copy-on-write pair) must lie in one slice of the target, or the restore is
  refused. Free and cached pages move to the slice that now holds them.
* `to_storage_dtype` / `convert_pages`: bitcasts between a platform's raw-bits storage (bf16 as
  uint16 on CPU) and native storage, and the explicit, lossy dtype/quantizer conversion.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from easykv.checkpoint_integrity import CheckpointMismatchError
from easykv.metadata import PagedAttentionCacheMetaData, plan_layout
from easykv.pages import PageLayout, encode_tokens, from_storage, page_template
from easykv.quantization import QuantizedPages, get_quantizer

# Fields that describe the model and the pool: a restore never changes them.
SHAPE_FIELDS = ("num_hidden_layers", "num_kv_heads", "kv_head_dim_size", "page_size", "num_pages_per_layer",
                "max_sequences", "batch_size")
LAYOUT_FIELDS = ("kv_head_mesh_axes", "kv_head_shards", "page_mesh_axes", "page_shards")
_PAGE_MANAGER_FORMAT = "easykv.PageManager/1"


def target_metadata(
    saved: PagedAttentionCacheMetaData,
    mesh: Any,
    partition_manager: Any,
    *,
    dtype: Any,
    quantization: str,
    expected: PagedAttentionCacheMetaData | None,
) -> PagedAttentionCacheMetaData:
    """The saved metadata laid out for ``mesh`` (see the module doc); CheckpointMismatchError
    when the pool cannot be split that way or ``expected`` describes another model/pool."""
    if expected is not None:
        diff = [f"{f}: checkpoint {getattr(saved, f)!r}, target {getattr(expected, f)!r}"
                for f in SHAPE_FIELDS if getattr(saved, f) != getattr(expected, f)]
        if diff:
            raise CheckpointMismatchError(
                "the checkpoint's cache does not match the target metadata (" + "; ".join(diff) + "); "
                "restore with metadata=None to get the saved shape, or create the target metadata with "
                "the saved values (pool contents cannot be re-paged; export_sequence/import_sequence "
                "moves single sequences between caches of different shapes)")
    plan = plan_layout(mesh, num_kv_heads=saved.num_kv_heads, partition_manager=partition_manager,
                       emit_warnings=False)
    changes = dict(kv_head_mesh_axes=plan.kv_head_mesh_axes, kv_head_shards=plan.kv_head_shards,
                   page_mesh_axes=plan.page_mesh_axes, page_shards=plan.page_shards,
                   dtype=np.dtype(dtype), quantization=quantization)
    if saved.num_pages_per_layer % plan.page_shards:
        raise CheckpointMismatchError(
            f"the target mesh splits pages over {plan.page_mesh_axes} into {plan.page_shards} slices, but the "
            f"checkpoint's pool has num_pages_per_layer={saved.num_pages_per_layer}, not a multiple of "
            f"{plan.page_shards}; restore onto a mesh whose page axes have a size dividing "
            f"{saved.num_pages_per_layer} (or leave the page axis unsharded)")
    try:
        return saved.replace(**changes)
    except ValueError as err:
        raise CheckpointMismatchError(
            f"the checkpoint's pool cannot be laid out on the target mesh {dict(mesh.shape)}: {err}") from err


# ---- manager state ---------------------------------------------------------------------------
def reshard_manager_state(state: Mapping[str, Any], old_shards: int, new_shards: int,
                          num_pages: int) -> dict[str, Any]:
    """A PageManager state_dict for ``new_shards`` page slices instead of ``old_shards``."""
    state = copy.deepcopy(dict(state))
    if old_shards == new_shards:
        return state
    if state.get("format") != _PAGE_MANAGER_FORMAT:
        raise CheckpointMismatchError(
            f"the saved page-manager state has format {state.get('format')!r}; only {_PAGE_MANAGER_FORMAT!r} "
            f"can be re-split from {old_shards} to {new_shards} data-parallel page slices; restore onto a mesh "
            f"with page_shards={old_shards} or with restore_manager=False")
    per = num_pages // new_shards

    def replica(page: int) -> int:
        return int(page) // per

    what = (f"the target mesh splits the pool of {num_pages} pages into {new_shards} data-parallel slices of "
            f"{per} pages (saved with {old_shards})")
    for seq in state["sequences"]:
        reps = sorted({replica(p) for p in seq["pages"]})
        if len(reps) > 1:
            raise CheckpointMismatchError(
                f"{what}, which would put sequence {seq['id']}'s pages {seq['pages']} in replicas {reps}; a "
                "sequence's pages must stay in one replica's slice. Restore onto a mesh with "
                f"page_shards={old_shards} (or a divisor of it), or release/export that sequence first")
        seq["replica"] = reps[0] if reps else -1
    for src, dst in state.get("copies", []):
        if replica(src) != replica(dst):
            raise CheckpointMismatchError(
                f"{what}, which would split the pending copy-on-write of page {src} -> {dst} across "
                f"replicas; apply the manager's pending copies (take_copies) before saving, or keep "
                f"page_shards={old_shards}")
    pool = state["pool"]
    refcount = np.zeros(num_pages, np.int64)
    for seq in state["sequences"]:
        np.add.at(refcount, np.asarray(seq["pages"], np.int64), 1)
    digest_of = {int(p): d for p, d in pool["digests"]}
    free = sorted(int(p) for h in pool["free"] for p in h)
    lru_all = [int(p) for q in pool["lru"] for p in q]  # slice order, then each slice's LRU order
    # Two old slices may hold the same prefix; one slice keeps one page per digest: the lowest
    # used page, else the least recently released cached one. The others lose their digest
    # (a cached one becomes free, a used one stays private until released).
    keep: dict[tuple[int, str], int] = {}
    lru_rank = {p: i for i, p in enumerate(lru_all)}
    for page in sorted(digest_of, key=lambda p: (refcount[p] == 0, lru_rank.get(p, -1), p)):
        keep.setdefault((replica(page), digest_of[page]), page)
    kept = set(keep.values())
    dropped = [p for p in digest_of if p not in kept]
    lru = [p for p in lru_all if p in kept]
    freed = [p for p in lru_all if p not in kept]
    free = sorted(free + freed)
    scrub = [int(p) for p in pool.get("scrub", [])]
    if state["config"].get("scrub_released") and freed:  # like an eviction: zero before reuse
        known = set(scrub)
        scrub += [p for p in freed if p not in known]
    pool["free"] = [[p for p in free if replica(p) == r] for r in range(new_shards)]
    pool["lru"] = [[p for p in lru if replica(p) == r] for r in range(new_shards)]
    dropped_set = set(dropped)
    pool["digests"] = [[p, d] for p, d in sorted(digest_of.items()) if p not in dropped_set]
    pool["scrub"] = scrub
    state["config"]["page_shards"] = new_shards
    return state


# ---- storage dtypes and conversion ---------------------------------------------------------------
def stored_template(meta: PagedAttentionCacheMetaData, platform: str) -> Any:
    """Shapes and storage dtypes of one page array (K or V) of ``meta`` on ``platform``."""
    shape = (meta.num_kv_heads, meta.num_pages_per_layer, meta.page_size, meta.kv_head_dim_size)
    return page_template(shape, meta.dtype, meta.quantizer, platform)


def _bitcast_leaf(x: jax.Array, dtype: np.dtype) -> jax.Array:
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


_BITCAST = jax.jit(lambda tree, dtypes: jax.tree.map(_bitcast_leaf, tree, dtypes), static_argnums=1,
                   donate_argnums=0)


def to_storage_dtypes(arrays: list[jax.Array], dtypes: list[np.dtype]) -> list[jax.Array]:
    """Bitcast each array to its target storage dtype (same width; a no-op where equal)."""
    if all(np.dtype(a.dtype) == np.dtype(d) for a, d in zip(arrays, dtypes)):
        return arrays
    for a, d in zip(arrays, dtypes):
        if np.dtype(a.dtype).itemsize != np.dtype(d).itemsize:
            raise CheckpointMismatchError(
                f"saved storage dtype {np.dtype(a.dtype).name} and target storage dtype {np.dtype(d).name} "
                "differ in width; the checkpoint does not hold this cache's format")
    return list(_BITCAST(tuple(arrays), tuple(np.dtype(d) for d in dtypes)))


def _decode(pages: Any, meta: PagedAttentionCacheMetaData) -> jax.Array:
    """Stored pages of ``meta`` (array or QuantizedPages) -> float32 values."""
    if isinstance(pages, QuantizedPages):
        value_dtype = pages.quantizer.value_shape(2)[1]
        q = QuantizedPages(from_storage(pages.values, value_dtype), pages.scales, pages.quantizer)
        return q.dequantize(jnp.float32)
    return from_storage(pages, meta.dtype).astype(jnp.float32)


def convert_pages(pages: Any, src: PagedAttentionCacheMetaData, dst: PagedAttentionCacheMetaData,
                  dst_template: Any, layout: PageLayout) -> Any:
    """One page array of ``src``'s format re-encoded in ``dst``'s (dequantize, cast, quantize);
    lossy where ``dst`` is coarser. Runs as one jit with the target shardings."""
    out_shardings = jax.tree.map(lambda t: layout.sharding_for(len(t.shape)), dst_template)

    def run(p: Any) -> Any:
        values = _decode(p, src).astype(dst.dtype)
        return encode_tokens(values, dst_template)

    return jax.jit(run, out_shardings=out_shardings)(pages)


def check_format(saved: PagedAttentionCacheMetaData, dtype: Any, quantizer: Any, convert: bool) -> tuple[np.dtype, str]:
    """(target dtype, target quantizer name), refusing a change of format unless ``convert``."""
    want_dtype = saved.dtype if dtype is None else np.dtype(dtype)
    want_q = saved.quantization if quantizer is None else get_quantizer(quantizer).name
    if (want_dtype, want_q) != (saved.dtype, saved.quantization) and not convert:
        raise CheckpointMismatchError(
            f"the checkpoint holds {saved.dtype.name} pages with quantizer {saved.quantization!r}, but "
            f"{want_dtype.name} with quantizer {want_q!r} was asked for; restore without dtype/quantizer to get "
            "the saved format bit-exact, or pass convert=True to dequantize and re-encode every page "
            "(lossy when the target is coarser)")
    return want_dtype, want_q


__all__ = [
    "LAYOUT_FIELDS", "SHAPE_FIELDS", "check_format", "convert_pages", "reshard_manager_state", "stored_template",
    "target_metadata", "to_storage_dtypes",
]
