"""Retargeting a saved cache onto another mesh, storage platform, dtype or quantizer.

Two pieces, both used by `easykv.checkpoint.checkpointer.restore_cache` (the page manager
follows the pages with `PageManager.reshard`: the manager owns its state format):

* `check_format` and `target_metadata`: the saved metadata in the target's format (with
  ``convert=True`` another dtype or quantizer, per layer group), then with the layout fields of the
  target mesh (kv-head and page axes and shard counts). The pools never change, so page ids in
  the manager stay valid.
* `to_storage_dtype` / `convert_pages`: bitcasts between a platform's raw-bits storage (bf16 as
  uint16 on CPU) and native storage, and the explicit, lossy dtype/quantizer conversion.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from easykv.errors import CheckpointMismatchError
from easykv.spec.metadata import PagedAttentionCacheMetaData, canonical_dtype, plan_layout
from easykv.storage.pages import PageLayout, encode_pages, from_storage, group_page_templates, page_template
from easykv.quantization import QuantizedPages, get_quantizer

# Fields that describe the model and the pool: a restore never changes them.
SHAPE_FIELDS = ("num_hidden_layers", "num_kv_heads", "kv_head_dim_size", "page_size", "num_pages_per_layer",
                "max_sequences", "batch_size")


def target_metadata(
    saved: PagedAttentionCacheMetaData,
    mesh: Any,
    partition_manager: Any,
) -> PagedAttentionCacheMetaData:
    """The saved metadata (in the target's format, `check_format`) laid out for ``mesh`` (see the
    module doc); CheckpointMismatchError when the pool cannot be split that way."""
    plan = plan_layout(mesh, num_kv_heads=saved.num_kv_heads, partition_manager=partition_manager,
                       emit_warnings=False)
    changes = dict(kv_head_mesh_axes=plan.kv_head_mesh_axes, kv_head_shards=plan.kv_head_shards,
                   page_mesh_axes=plan.page_mesh_axes, page_shards=plan.page_shards)
    for g in saved.groups:
        if g.num_pages % plan.page_shards:
            pool = ("num_pages_per_layer" if saved.is_uniform else f"layers {g.span}: num_pages") + f"={g.num_pages}"
            raise CheckpointMismatchError(
                f"the target mesh splits pages over {plan.page_mesh_axes} into {plan.page_shards} slices, but the "
                f"checkpoint's pool has {pool}, not a multiple of {plan.page_shards}; restore onto a mesh whose "
                f"page axes have a size dividing {g.num_pages} (or leave the page axis unsharded)")
    if not saved.is_uniform:  # each group's kv heads split on their own over the target mesh
        groups = []
        for g in saved.groups:
            own = plan_layout(mesh, num_kv_heads=g.num_kv_heads, partition_manager=partition_manager,
                              emit_warnings=False)
            groups.append(dataclasses.replace(g, kv_head_mesh_axes=own.kv_head_mesh_axes,
                                              kv_head_shards=own.kv_head_shards))
        changes["layer_groups"] = tuple(groups)
    try:
        target = saved.replace(**changes, memory_bytes_per_device=None)
        # The budget the pool was sized from stays on record where the target still fits it
        # (another dtype or fewer kv-head shards make each device hold more).
        budget = saved.memory_bytes_per_device
        return target if budget is None or target.bytes_per_device > budget else target.replace(
            memory_bytes_per_device=budget)
    except ValueError as err:
        raise CheckpointMismatchError(
            f"the checkpoint's pool cannot be laid out on the target mesh {dict(mesh.shape)}: {err}") from err


def check_same_cache(saved: PagedAttentionCacheMetaData, expected: PagedAttentionCacheMetaData) -> None:
    """CheckpointMismatchError unless ``expected`` (a restore's target metadata) describes the
    saved model and pool: only layout and format may differ."""
    diff = [f"{f}: checkpoint {getattr(saved, f)!r}, target {getattr(expected, f)!r}"
            for f in SHAPE_FIELDS if getattr(saved, f) != getattr(expected, f)]
    if _geometry(saved) != _geometry(expected):
        diff.append(f"layer groups: checkpoint {_geometry(saved)}, target {_geometry(expected)}")
    if diff:
        raise CheckpointMismatchError(
            "the checkpoint's cache does not match the target metadata (" + "; ".join(diff) + "); "
            "restore with metadata=None to get the saved shape, or create the target metadata with "
            "the saved values (pool contents cannot be re-paged; export_sequence/import_sequence "
            "moves single sequences between caches of different shapes)")


def _geometry(meta: PagedAttentionCacheMetaData) -> list[tuple[Any, ...]]:
    """What each layer group's pages hold (not where they lie): a restore keeps it."""
    return [(g.layers, g.attention, g.window, g.num_kv_heads, g.key_head_dim, g.value_head_dim, g.latent, g.num_pages)
            for g in meta.groups]


# ---- storage dtypes and conversion ---------------------------------------------------------------
def stored_template(meta: PagedAttentionCacheMetaData, platform: str, *, layers: int | None = None) -> Any:
    """Shapes and storage dtypes of one page array (K or V) of ``meta`` on ``platform``: a
    stack of ``layers`` layers, or (None) one layer's pages as checkpoint formats 1-2 hold them."""
    shape = (meta.num_kv_heads, meta.num_pages_per_layer, meta.page_size, meta.kv_head_dim_size)
    return page_template(shape if layers is None else (layers, *shape), meta.dtype, meta.quantizer, platform)


def group_templates(meta: PagedAttentionCacheMetaData, platform: str) -> list[tuple[Any, Any]]:
    """Shapes and storage dtypes of each layer group's stacked (K pages, V pages) of ``meta`` on
    ``platform``, in the group's own geometry (V None for a latent group, which stores none)."""
    return [group_page_templates(meta, g, platform) for g in meta.groups]


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


def _decode(pages: Any, dtype: np.dtype) -> jax.Array:
    """Stored pages of logical ``dtype`` (array or QuantizedPages) -> float32 values."""
    if isinstance(pages, QuantizedPages):
        value_dtype = pages.quantizer.value_shape(2)[1]
        q = QuantizedPages(from_storage(pages.values, value_dtype), pages.scales, pages.quantizer)
        return q.dequantize(jnp.float32)
    return from_storage(pages, dtype).astype(jnp.float32)


def convert_pages(pages: Any, src_dtype: np.dtype, dst_dtype: np.dtype, dst_template: Any,
                  layout: PageLayout) -> Any:
    """One page array of logical ``src_dtype`` re-encoded as ``dst_template`` of ``dst_dtype``
    (dequantize, cast, quantize); lossy where the target is coarser. Runs as one jit with the
    target shardings."""
    out_shardings = jax.tree.map(lambda t: layout.sharding_for(len(t.shape)), dst_template)

    def run(p: Any) -> Any:
        return encode_pages(_decode(p, src_dtype).astype(dst_dtype), dst_template)

    return jax.jit(run, out_shardings=out_shardings)(pages)


def check_format(saved: PagedAttentionCacheMetaData, dtype: Any, quantizer: Any, convert: bool, *,
                 like: PagedAttentionCacheMetaData | None) -> PagedAttentionCacheMetaData:
    """``saved`` in the format a restore asks for: each layer group's dtype and quantizer as in
    ``like`` (the target metadata; None: as saved), then ``dtype`` / ``quantizer`` for every group
    where given. A change of any group's format is refused unless ``convert``. ``like`` has the
    saved groups (`check_same_cache`)."""
    base = saved if like is None else like
    want_dtype = None if dtype is None else canonical_dtype(dtype)
    want_q = None if quantizer is None else get_quantizer(quantizer).name
    def first(*choices: Any) -> Any:  # the first given (not None) of the choices
        return next(c for c in choices if c is not None)

    formats = [(first(want_dtype, base.group_dtype(b), saved.group_dtype(s)),
                first(want_q, base.group_quantizer(b).name)) for s, b in zip(saved.groups, base.groups)]
    want = saved.with_formats(formats, dtype=first(want_dtype, base.dtype, saved.dtype),
                              quantization=first(want_q, base.quantization))
    changed = [(g, a, b) for g, a, b in zip(saved.groups, saved.group_formats, want.group_formats) if a != b]
    if changed and not convert:
        what = "; ".join(("" if saved.is_uniform else f"layers {g.span}: ") + f"the checkpoint holds {a[0].name} pages "
                         f"with quantizer {a[1]!r}, but {b[0].name} with quantizer {b[1]!r} was asked for"
                         for g, a, b in changed)
        raise CheckpointMismatchError(
            f"{what}; restore without dtype/quantizer to get the saved format bit-exact, or pass convert=True to "
            "dequantize and re-encode every page (lossy when the target is coarser)")
    return want


__all__ = [
    "SHAPE_FIELDS", "check_format", "check_same_cache", "convert_pages", "group_templates", "stored_template",
    "target_metadata", "to_storage_dtypes",
]
