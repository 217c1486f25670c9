"""A metadata laid out for another mesh: the same model, pools and format, with the kv-head and
page axes (and shard counts) the target mesh and partition rule give. Restoring a checkpoint
and waking a sleeping cache on another mesh both start here; the pools never change, so page
ids (and the page manager's state) stay valid.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from easykv.errors import CheckpointMismatchError
from easykv.spec.groups import known_size
from easykv.spec.layout import plan_layout
from easykv.spec.metadata import PagedAttentionCacheMetaData

if TYPE_CHECKING:
    from jax.sharding import AbstractMesh, Mesh

    from easykv.sharding import PartitionManager


def target_metadata(
    saved: PagedAttentionCacheMetaData,
    mesh: Mesh | AbstractMesh,
    partition_manager: PartitionManager | None,
) -> PagedAttentionCacheMetaData:
    """``saved`` laid out for ``mesh`` (see the module doc); CheckpointMismatchError when the
    pool cannot be split that way."""
    plan = plan_layout(mesh, num_kv_heads=saved.num_kv_heads, partition_manager=partition_manager,
                       emit_warnings=False)
    changes = dict(kv_head_mesh_axes=plan.kv_head_mesh_axes, kv_head_shards=plan.kv_head_shards,
                   page_mesh_axes=plan.page_mesh_axes, page_shards=plan.page_shards)
    for g in saved.groups:
        if known_size(g.num_pages) % plan.page_shards:
            pool = ("num_pages_per_layer" if saved.is_uniform else f"layers {g.span}: num_pages") + f"={g.num_pages}"
            raise CheckpointMismatchError(
                f"the target mesh splits pages over {plan.page_mesh_axes} into {plan.page_shards} slices, but the "
                f"checkpoint's pool has {pool}, not a multiple of {plan.page_shards}; restore onto a mesh whose "
                f"page axes have a size dividing {g.num_pages} (or leave the page axis unsharded)")
    if not saved.is_uniform:  # each group's kv heads split on their own over the target mesh
        groups = []
        for g in saved.groups:
            own = plan_layout(mesh, num_kv_heads=known_size(g.num_kv_heads), partition_manager=partition_manager,
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


__all__ = ["target_metadata"]
