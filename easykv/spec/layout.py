"""How a cache's kv-head and page axes map onto a mesh (`plan_layout`): the mesh axes each is
split over, the shard counts, and every adjustment the partition rules had to make (an axis the
mesh lacks, heads that do not divide), so that sizing counts what each device really stores.
Works on a `Mesh` or an `AbstractMesh`: planning needs axis names and sizes, never devices.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from easykv.sharding import KV_HEAD, PAGE, PartitionAxis, PartitionManager, ShardingAdjustedWarning
from easykv.validation import positive_int, show

if TYPE_CHECKING:
    from jax.sharding import AbstractMesh, Mesh


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """How the kv-head and page axes of the pages map onto a mesh."""

    kv_head_mesh_axes: tuple[str, ...]
    kv_head_shards: int
    page_mesh_axes: tuple[str, ...]
    page_shards: int
    adjustments: tuple[str, ...]


def plan_layout(
    mesh: Mesh | AbstractMesh,
    *,
    num_kv_heads: int,
    partition_manager: PartitionManager | None,
    emit_warnings: bool,
) -> LayoutPlan:
    """Resolve the kv-head and page axes against ``mesh``, reporting every adjustment."""
    positive_int("num_kv_heads", num_kv_heads)
    if not isinstance(getattr(mesh, "shape", None), Mapping):  # Mesh and AbstractMesh map axis -> size
        raise ValueError(f"mesh must be a jax.sharding.Mesh or AbstractMesh, got {show(mesh)}; for one device "
                         "use easykv.sharding.create_mesh({'tp': 1}, devices=jax.devices()[:1])")
    if partition_manager is not None and not isinstance(partition_manager, PartitionManager):
        hint = ""
        if type(partition_manager).__module__.startswith(("eformer", "easydel")):
            hint = (" (an eformer/EasyDeL one converts with easykv.integrations.easydel."
                    "partition_manager_from_easydel(pm, mesh=mesh))")
        raise ValueError(f"partition_manager must be an easykv.sharding.PartitionManager or None, got "
                         f"{type(partition_manager).__name__}{hint}")
    pm = partition_manager if partition_manager is not None else PartitionManager(PartitionAxis())
    page_axes = pm.rules.mesh_axes(PAGE)
    # The page axis length is chosen by sizing, always as a multiple of its shard count, so
    # only axes missing from the mesh can be dropped there.
    page_dim = math.prod(mesh.shape.get(a, 1) for a in page_axes)
    spec, report = pm.resolve_with_report((KV_HEAD, PAGE), (num_kv_heads, page_dim), mesh=mesh)
    if emit_warnings:
        for message in report:
            warnings.warn(message, ShardingAdjustedWarning, stacklevel=3)
    head_axes, page_axes_kept = (_entry_axes(e) for e in spec)
    return LayoutPlan(
        kv_head_mesh_axes=head_axes,
        kv_head_shards=math.prod(mesh.shape[a] for a in head_axes),
        page_mesh_axes=page_axes_kept,
        page_shards=math.prod(mesh.shape[a] for a in page_axes_kept),
        adjustments=tuple(report),
    )


def _entry_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


__all__ = ["LayoutPlan", "plan_layout"]
