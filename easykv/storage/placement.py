"""Where a cache's pages go and whether they fit: each layer group's placement on the mesh, the
metadata completed (and checked) for a mesh before anything is allocated, and the refusal of
pages the devices cannot hold.

`init_cache`, `PagedAttentionCacheView.init` and the JSON forms (``cache_json``) all allocate
through `checked_layout`, so a cache is laid out by one rule however it is made.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import cast, overload

import numpy as np
from jax.sharding import Mesh
from jax.typing import DTypeLike

from easykv.errors import MemoryUnavailableError
from easykv.quantization import Quantizer, get_quantizer
from easykv.sharding import PartitionManager, ShardingAdjustedWarning
from easykv.spec.dtypes import canonical_dtype
from easykv.spec.groups import known_size
from easykv.spec.layout import LayoutPlan, plan_layout
from easykv.spec.memory import device_memory_budget
from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.storage.pages import PageLayout, PageTemplate, group_page_templates

#: ``templates(g, layers=None)``: the key and value page templates of group ``g``'s stack (`checked_layout`).
Templates = Callable[..., tuple[PageTemplate, PageTemplate | None]]


@overload
def group_layouts(meta: PagedAttentionCacheMetaData, layout: PageLayout) -> tuple[PageLayout, ...]: ...


@overload
def group_layouts(meta: PagedAttentionCacheMetaData, layout: PageLayout | None) -> tuple[PageLayout | None, ...]: ...


def group_layouts(meta: PagedAttentionCacheMetaData, layout: PageLayout | None) -> tuple[PageLayout | None, ...]:
    """Each layer group's placement: the cache's mesh and page split, the group's kv-head split."""
    if layout is None:
        return (None,) * len(meta.groups)
    return tuple(layout if g.kv_head_mesh_axes is None else dataclasses.replace(layout, head_axes=g.kv_head_mesh_axes)
                 for g in meta.groups)


def checked_layout(
    mesh: Mesh,
    dtype: DTypeLike,
    metadata: PagedAttentionCacheMetaData,
    partition_manager: PartitionManager | None,
    quantizer: str | Quantizer | None,
) -> tuple[PagedAttentionCacheMetaData, PageLayout, Templates]:
    """The metadata completed for ``mesh`` (dtype and kv-head layouts where it leaves them
    open), the cache-wide placement, and ``templates(g, layers=None)``: the key and value page
    templates (shapes, storage dtypes; None for a latent group's values) of group ``g``'s stack
    (of ``layers`` layers, default the group's). Anything the metadata does fix must agree: a
    different dtype, quantizer or split would change the bytes per device the pool was sized
    for. Mesh axes of size 1 split nothing and are ignored."""
    if not isinstance(metadata, PagedAttentionCacheMetaData):
        raise ValueError(f"metadata must be a PagedAttentionCacheMetaData, got {type(metadata).__name__}")
    dt = _checked_format(metadata, dtype, quantizer)

    def planned(num_kv_heads: int) -> LayoutPlan:
        # The plan's adjustments are re-raised so that they point at the code that made the cache.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ShardingAdjustedWarning)
            plan = plan_layout(mesh, num_kv_heads=num_kv_heads, partition_manager=partition_manager,
                               emit_warnings=True)
        for w in caught:
            warnings.warn(str(w.message), ShardingAdjustedWarning, stacklevel=5)
        return plan

    plan = planned(metadata.num_kv_heads)
    _check_split(mesh, metadata, "the pages", plan, metadata.kv_head_mesh_axes, metadata.kv_head_shards)
    if metadata.kv_head_mesh_axes is None:
        metadata = metadata.replace(kv_head_mesh_axes=plan.kv_head_mesh_axes, kv_head_shards=plan.kv_head_shards)
    if not metadata.is_uniform:
        groups = []
        for g in metadata.groups:
            group_plan = plan if g.num_kv_heads == metadata.num_kv_heads else planned(known_size(g.num_kv_heads))
            _check_split(mesh, metadata, f"the pages of layers {g.span}", group_plan, g.kv_head_mesh_axes,
                         g.kv_head_shards)
            if g.kv_head_mesh_axes is None:
                g = dataclasses.replace(g, kv_head_mesh_axes=group_plan.kv_head_mesh_axes,
                                        kv_head_shards=group_plan.kv_head_shards)
            groups.append(g)
        metadata = metadata.replace(layer_groups=tuple(groups))
    resolved = metadata.replace(dtype=dt)
    layout = cache_layout(mesh, resolved)
    platform = mesh.devices.flat[0].platform

    def templates(g: int, layers: int | None = None) -> tuple[PageTemplate, PageTemplate | None]:
        group = resolved.groups[g]
        if layers is not None:
            group = dataclasses.replace(group, layers=tuple(range(layers)))
        return group_page_templates(resolved, group, platform)

    return resolved, layout, templates


def cache_layout(mesh: Mesh, meta: PagedAttentionCacheMetaData) -> PageLayout:
    """The cache-wide placement on ``mesh`` of the pages of ``meta``, a cache's (complete) metadata:
    its kv heads split over ``kv_head_mesh_axes``, its pages over ``page_mesh_axes``."""
    # cast: `checked_layout` set the head split of every cache's metadata; the field type keeps the
    # None of a metadata that leaves it to init_cache.
    head_axes = cast("tuple[str, ...]", meta.kv_head_mesh_axes)
    return PageLayout(mesh=mesh, head_axes=head_axes, page_axes=meta.page_mesh_axes)


def _checked_format(metadata: PagedAttentionCacheMetaData, dtype: DTypeLike, quantizer: str | Quantizer | None
                    ) -> np.dtype:
    """``dtype`` as a cache dtype, once it and ``quantizer`` are the format the pool was sized for."""
    dt = canonical_dtype(dtype)
    if metadata.dtype is not None and dt != metadata.dtype:
        raise ValueError(
            f"dtype {dt.name} differs from metadata.dtype {metadata.dtype.name} that the pool was "
            "sized for; pass metadata.dtype or create the metadata with this dtype"
        )
    q = get_quantizer(quantizer)
    if q.name != metadata.quantization:
        raise ValueError(
            f"quantizer {q.name!r} differs from metadata.quantization {metadata.quantization!r}; "
            "create the metadata with the same quantizer"
        )
    return dt


def _check_split(mesh: Mesh, metadata: PagedAttentionCacheMetaData, what: str, plan: LayoutPlan,
                 head_axes: tuple[str, ...] | None, head_shards: int | None) -> None:
    """Refuse a mesh that splits ``what`` otherwise than the metadata was sized for (``head_axes``
    / ``head_shards`` None: the metadata leaves the head split to the mesh)."""
    def splitting(axes: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(a for a in axes if mesh.shape.get(a, 1) > 1)

    got = (splitting(plan.kv_head_mesh_axes), plan.kv_head_shards, splitting(plan.page_mesh_axes), plan.page_shards)
    want = (splitting(head_axes) if head_axes is not None else got[0],
            head_shards if head_shards is not None else plan.kv_head_shards,
            splitting(metadata.page_mesh_axes), metadata.page_shards)
    if got != want:
        raise ValueError(
            f"the mesh and partition manager split {what} as (kv_head axes, shards, page axes, shards) = "
            f"{got}, but the metadata was sized for {want}; create the metadata with this mesh and partition "
            "manager")


def check_fits(mesh: Mesh, metadata: PagedAttentionCacheMetaData, need: int, what: str) -> None:
    """Refuse, before allocating, pages that cannot fit the devices' free memory (a metadata
    written for a bigger machine, or hand-edited): a precise error instead of an allocator
    failure or, on CPU, the kernel's OOM killer. ``need``: bytes per device of ``what``."""
    try:
        budget = device_memory_budget(list(mesh.devices.flat), 1.0)
    except MemoryUnavailableError:
        return  # the devices do not say; then only the allocation itself can tell
    if need > budget.per_device_bytes:
        raise ValueError(
            f"the pages need {need} bytes per device ({what}: {metadata._cost_detail()}) but the devices have "
            f"{budget.per_device_bytes} free ({budget.detail}); create the metadata for this machine "
            "(PagedAttentionCacheMetaData.create) or give it fewer pages")


__all__ = ["Templates", "cache_layout", "check_fits", "checked_layout", "group_layouts"]
