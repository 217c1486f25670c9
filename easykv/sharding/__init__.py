"""Meshes and logical-axis -> mesh-axis sharding rules: ``mesh`` (``create_mesh``), ``axes``
(the logical axis names and ``PartitionAxis``) and ``manager`` (``PartitionManager``, logical axes
to mesh axes). They are one unit because they describe devices and axes only: they know nothing
of caches, and this package imports nothing else of easykv.
"""

from easykv.sharding.axes import (
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
from easykv.sharding.manager import PartitionManager, ShardingAdjustedWarning, shard_count
from easykv.sharding.mesh import create_mesh, mesh_axis_size

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
