"""Meshes and logical-axis -> mesh-axis sharding rules. Knows nothing of caches."""

from sharding.axes import (
    BATCH,
    HEAD,
    HEAD_DIM,
    HIDDEN,
    KV_HEAD,
    PAGE,
    PAGE_SIZE,
    SEQUENCE,
    PartitionAxis,
)
from sharding.manager import PartitionManager, ShardingAdjustedWarning, shard_count
from sharding.mesh import create_mesh, mesh_axis_size

__all__ = [
    "BATCH",
    "HEAD",
    "HEAD_DIM",
    "HIDDEN",
    "KV_HEAD",
    "PAGE",
    "PAGE_SIZE",
    "SEQUENCE",
    "PartitionAxis",
    "PartitionManager",
    "ShardingAdjustedWarning",
    "create_mesh",
    "mesh_axis_size",
    "shard_count",
]
