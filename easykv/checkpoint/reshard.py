"""Retargeting a saved cache onto another mesh, storage platform, dtype or quantizer.

Two pieces, both used by `easykv.checkpoint.checkpointer.restore_cache` (the page manager
follows the pages with `PageManager.reshard`: the manager owns its state format):

* `target_metadata`: the saved metadata with the layout fields of the target mesh (kv-head and
  page axes and shard counts) and, with ``convert=True``, another dtype or quantizer. The pool
  (``num_pages_per_layer``) never changes, so page ids in the manager stay valid.
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
from easykv.storage.pages import PageLayout, encode_tokens, from_storage, page_template
from easykv.quantization import QuantizedPages, get_quantizer

# Fields that describe the model and the pool: a restore never changes them.
SHAPE_FIELDS = ("num_hidden_layers", "num_kv_heads", "kv_head_dim_size", "page_size", "num_pages_per_layer",
                "max_sequences", "batch_size")


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
        if _geometry(saved) != _geometry(expected):
            diff.append(f"layer groups: checkpoint {_geometry(saved)}, target {_geometry(expected)}")
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
    return [tuple(None if shape is None else page_template(shape, meta.dtype, meta.quantizer, platform)
                  for shape in (meta.group_pages_shape(g), meta.group_pages_shape(g, values=True)))
            for g in meta.groups]


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
    want_dtype = saved.dtype if dtype is None else canonical_dtype(dtype)
    want_q = saved.quantization if quantizer is None else get_quantizer(quantizer).name
    if (want_dtype, want_q) != (saved.dtype, saved.quantization) and not convert:
        raise CheckpointMismatchError(
            f"the checkpoint holds {saved.dtype.name} pages with quantizer {saved.quantization!r}, but "
            f"{want_dtype.name} with quantizer {want_q!r} was asked for; restore without dtype/quantizer to get "
            "the saved format bit-exact, or pass convert=True to dequantize and re-encode every page "
            "(lossy when the target is coarser)")
    return want_dtype, want_q


__all__ = [
    "SHAPE_FIELDS", "check_format", "convert_pages", "group_templates", "stored_template",
    "target_metadata", "to_storage_dtypes",
]
