"""The static description of a paged cache, and the sizing of its pool from device memory.

`PagedAttentionCacheMetaData` keeps EasyDeL's field names so that EasyDeL users can switch by
changing imports, and adds what a sharded pool needs: the cache dtype, the quantizer, and how
kv heads and pages are split over the mesh. The per-device figures follow from those fields, so
they are properties, never stored twice.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from easykv.spec.memory import MemoryBudget, device_memory_budget
from easykv.quantization import Quantizer, get_quantizer
from easykv.errors import SerializationError
from easykv.spec.serialization import Serializable
from easykv.validation import INT64_MAX, as_dtype, positive_int, real, show
from sharding import KV_HEAD, PAGE, PartitionAxis, PartitionManager

# Logical cache dtypes. Compressed formats (int8, fp8, int4) are quantizers, not cache dtypes.
SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
_INT32_MAX = 2**31 - 1

_EASYDEL_FIELDS = (
    "batch_size", "num_hidden_layers", "num_pages_per_layer", "num_pages_per_sequence",
    "max_sequences", "page_size", "num_kv_heads", "kv_head_dim_size", "hbm_utilization",
)  # fmt: skip


def canonical_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype for a user's dtype argument, or a ValueError naming the choices."""
    choices = f"{', '.join(SUPPORTED_DTYPES)} (int8/fp8/int4 storage is chosen with quantizer=...)"
    dt = as_dtype("dtype", dtype, choices=choices)
    if not dt.isnative:  # '>f4' names float32 in another byte order: bits would be misread
        raise ValueError(f"dtype {dt.str} is {dt.name} in a byte order other than this machine's; use {dt.name}")
    if dt.name not in SUPPORTED_DTYPES:
        raise ValueError(
            f"dtype {dt.name} is not a cache dtype; use one of {', '.join(SUPPORTED_DTYPES)} "
            "(int8/fp8/int4 storage is chosen with quantizer=...)"
        )
    return dt


@dataclasses.dataclass(frozen=True)
class PagedAttentionCacheMetaData(Serializable):
    """Static configuration of a paged KV cache (hashable: usable as a static jit argument).

    Pages of every layer have the logical shape
    ``(num_kv_heads, num_pages_per_layer, page_size, kv_head_dim_size)``; the kv-head axis is
    split into ``kv_head_shards`` over the mesh axes ``kv_head_mesh_axes`` and the page axis into
    ``page_shards`` over ``page_mesh_axes`` (one slice of the pool per data-parallel replica).

    ``create`` fills every field. A metadata built from EasyDeL's nine fields alone leaves
    ``dtype`` and the kv-head layout as None: ``init_cache`` then takes the dtype it is given and
    the head layout of its mesh and partition manager, and the cache's views carry the
    completed metadata (per-device figures of an incomplete one assume bfloat16 and
    unsharded heads, an upper bound).
    """

    SCHEMA: ClassVar[str] = "easykv.PagedAttentionCacheMetaData"
    SCHEMA_VERSION: ClassVar[int] = 1

    batch_size: int
    num_hidden_layers: int
    num_pages_per_layer: int
    num_pages_per_sequence: int
    max_sequences: int
    page_size: int
    num_kv_heads: int
    kv_head_dim_size: int
    hbm_utilization: float
    dtype: np.dtype | None = dataclasses.field(default=None, metadata={"codec": "dtype"})
    quantization: str = "none"
    kv_head_mesh_axes: tuple[str, ...] | None = dataclasses.field(default=None, metadata={"codec": "tuple"})
    kv_head_shards: int | None = None
    page_mesh_axes: tuple[str, ...] = dataclasses.field(default=(), metadata={"codec": "tuple"})
    page_shards: int = 1
    memory_bytes_per_device: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "batch_size", "num_hidden_layers", "num_pages_per_layer", "num_pages_per_sequence",
            "max_sequences", "page_size", "num_kv_heads", "kv_head_dim_size", "page_shards",
        ):  # fmt: skip
            object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        object.__setattr__(self, "hbm_utilization", real("hbm_utilization", self.hbm_utilization, lo=0, hi=1,
                                                         lo_open=True))
        if self.dtype is not None:
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        quantizer = get_quantizer(self.quantization)
        quantizer.validate(self.kv_head_dim_size, self.sizing_dtype)
        object.__setattr__(self, "quantization", quantizer.name)
        if (self.kv_head_mesh_axes is None) != (self.kv_head_shards is None):
            raise ValueError(
                f"kv_head_mesh_axes={show(self.kv_head_mesh_axes)} and kv_head_shards={show(self.kv_head_shards)}: "
                "give both (the head layout) or neither (init_cache derives it from the mesh)")
        if self.kv_head_shards is not None:
            object.__setattr__(self, "kv_head_shards", positive_int("kv_head_shards", self.kv_head_shards))
        for name in ("kv_head_mesh_axes", "page_mesh_axes"):
            raw = getattr(self, name)
            if raw is None:
                continue
            # One name is one axis (never its characters); lists come from JSON.
            axes = (raw,) if isinstance(raw, str) else tuple(raw) if isinstance(raw, (tuple, list)) else None
            if axes is None or not all(isinstance(a, str) and a for a in axes):
                raise ValueError(f"{name} must be a tuple of mesh axis names, got {show(raw)}")
            object.__setattr__(self, name, axes)
        if self.memory_bytes_per_device is not None:
            object.__setattr__(self, "memory_bytes_per_device",
                               positive_int("memory_bytes_per_device", self.memory_bytes_per_device, hi=INT64_MAX))

        expected = math.ceil(self.max_sequences / self.page_size)
        if self.num_pages_per_sequence != expected:
            raise ValueError(
                f"num_pages_per_sequence={self.num_pages_per_sequence} does not match "
                f"ceil(max_sequences / page_size) = ceil({self.max_sequences} / {self.page_size}) = {expected}"
            )
        if self.num_kv_heads % self.head_shards:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} is not divisible by kv_head_shards={self.kv_head_shards}"
            )
        if self.num_pages_per_layer % self.page_shards:
            raise ValueError(
                f"num_pages_per_layer={self.num_pages_per_layer} is not divisible by "
                f"page_shards={self.page_shards}; use a multiple of {self.page_shards}"
            )
        if self.pages_per_shard < self.num_pages_per_sequence:
            raise ValueError(
                f"the pool cannot hold one full sequence: {self.pages_per_shard} pages per "
                f"{'replica' if self.page_shards > 1 else 'pool'} < num_pages_per_sequence="
                f"{self.num_pages_per_sequence} (max_sequences={self.max_sequences}, page_size="
                f"{self.page_size}); give the cache more memory or lower max_sequences"
            )
        if self.num_pages_per_layer * self.page_size > _INT32_MAX:
            raise ValueError(
                f"num_pages_per_layer * page_size = {self.num_pages_per_layer * self.page_size} "
                "slots exceeds int32 slot ids; use fewer pages per layer"
            )
        # The budget is what the pool was sized from: a pool that does not fit it is a
        # hand-edited or damaged description, never one `create` made.
        if self.memory_bytes_per_device is not None and self.bytes_per_device > self.memory_bytes_per_device:
            raise ValueError(
                f"the pool needs {self.bytes_per_device} bytes per device ({self.pages_per_shard} pages x "
                f"{self.num_hidden_layers} layers x {self.page_bytes_per_device} bytes) but memory_bytes_per_device="
                f"{self.memory_bytes_per_device}; size it with create(), or fix num_pages_per_layer"
            )

    # ---- derived figures -----------------------------------------------------------------
    @property
    def quantizer(self) -> Quantizer:
        return get_quantizer(self.quantization)

    @property
    def sizing_dtype(self) -> np.dtype:
        """``dtype``, or bfloat16 (EasyDeL's default) while the dtype is left to ``init_cache``."""
        return np.dtype("bfloat16") if self.dtype is None else self.dtype

    @property
    def head_shards(self) -> int:
        """``kv_head_shards``; 1 (every device holds every head) while the layout is left to
        ``init_cache``, so per-device figures are an upper bound then."""
        return 1 if self.kv_head_shards is None else self.kv_head_shards

    @property
    def kv_heads_per_device(self) -> int:
        return self.num_kv_heads // self.head_shards

    @property
    def pages_per_shard(self) -> int:
        """Pages of one layer held by one device (one data-parallel replica's slice)."""
        return self.num_pages_per_layer // self.page_shards

    @property
    def bytes_per_token_head(self) -> int:
        return self.quantizer.bytes_per_token_head(self.kv_head_dim_size, self.sizing_dtype)

    @property
    def page_bytes_per_device(self) -> int:
        """Bytes one device stores for one page of one layer, K and V together."""
        return 2 * self.kv_heads_per_device * self.page_size * self.bytes_per_token_head

    @property
    def bytes_per_device(self) -> int:
        """Bytes of the whole pool (all layers) on one device."""
        return self.page_bytes_per_device * self.pages_per_shard * self.num_hidden_layers

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one cached token over all layers and kv heads, each head counted once
        (replicated heads cost this again on every device that holds a copy)."""
        return 2 * self.num_kv_heads * self.bytes_per_token_head * self.num_hidden_layers

    @property
    def tokens_per_layer(self) -> int:
        return self.num_pages_per_layer * self.page_size

    @property
    def max_full_sequences(self) -> int:
        """Sequences of max_sequences tokens the pool holds at once."""
        return self.page_shards * (self.pages_per_shard // self.num_pages_per_sequence)

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        mesh: Any,
        batch_size: int,
        num_hidden_layers: int,
        max_sequences: int,
        page_size: int,
        num_kv_heads: int,
        kv_head_dim_size: int,
        hbm_utilization: float,
        dtype: Any = np.dtype("bfloat16"),
        *,
        partition_manager: PartitionManager | None = None,
        quantizer: str | Quantizer | None = None,
        memory_bytes_per_device: int | None = None,
        num_pages_per_layer: int | None = None,
    ) -> PagedAttentionCacheMetaData:
        """Size the pool from device memory (EasyDeL's positional order, extras keyword-only).

        The budget per device (``memory.device_memory_budget``: memory_stats, the host rule on
        CPU, or ``memory_bytes_per_device``) is divided by what one page costs that device in
        all layers: K and V, the kv heads it really stores after sharding or replication, the
        storage dtype and the quantizer's scales. With the page axis sharded over a
        data-parallel mesh axis every replica holds that many pages, so the pool grows with it.
        ``num_pages_per_layer`` fixes the pool size instead (memory is then not consulted).
        """
        plan = plan_layout(
            mesh, num_kv_heads=num_kv_heads, partition_manager=partition_manager, emit_warnings=True
        )
        model = (batch_size, num_hidden_layers, max_sequences, page_size, num_kv_heads, kv_head_dim_size)
        base = dict(zip(("batch_size", "num_hidden_layers", "max_sequences", "page_size", "num_kv_heads",
                         "kv_head_dim_size"), model))
        base.update(hbm_utilization=hbm_utilization, dtype=dtype, quantization=get_quantizer(quantizer).name,
                    **{f: getattr(plan, f) for f in ("kv_head_mesh_axes", "kv_head_shards", "page_mesh_axes",
                                                      "page_shards")})
        for name in ("max_sequences", "page_size"):
            positive_int(name, base[name])
        pages_per_sequence = math.ceil(max_sequences / page_size)
        if num_pages_per_layer is not None:
            return cls(**base, num_pages_per_sequence=pages_per_sequence,
                       num_pages_per_layer=positive_int("num_pages_per_layer", num_pages_per_layer))
        # Validate every field with a one-page pool before asking the devices for memory.
        probe = cls(**base, num_pages_per_sequence=pages_per_sequence,
                    num_pages_per_layer=plan.page_shards * pages_per_sequence)
        # An explicit budget needs no devices, so an AbstractMesh can plan a pod from a laptop.
        devices = () if memory_bytes_per_device is not None else tuple(mesh.devices.flat)
        budget = device_memory_budget(
            devices, probe.hbm_utilization, memory_bytes_per_device=memory_bytes_per_device
        )
        per_page_all_layers = probe.page_bytes_per_device * probe.num_hidden_layers
        pages_per_shard = budget.per_device_bytes // per_page_all_layers
        # Slot ids are int32: a budget larger than that can address is capped, not an error.
        pages_per_shard = min(pages_per_shard, _INT32_MAX // page_size // plan.page_shards)
        if pages_per_shard < pages_per_sequence:
            raise ValueError(
                f"the memory budget holds {pages_per_shard} pages per device but one sequence of "
                f"max_sequences={max_sequences} tokens needs {pages_per_sequence} "
                f"({per_page_all_layers} bytes per page across {num_hidden_layers} layers; budget "
                f"{budget.detail}); raise hbm_utilization or memory_bytes_per_device, or lower max_sequences"
            )
        return cls(**base, num_pages_per_sequence=pages_per_sequence,
                   num_pages_per_layer=pages_per_shard * plan.page_shards,
                   memory_bytes_per_device=budget.per_device_bytes)

    @classmethod
    def _upgrade(cls, data: dict[str, Any]) -> dict[str, Any]:
        if "__schema__" in data:
            return data
        # EasyDeL's PagedAttentionCacheMetaData.to_json writes its nine fields and no dtype.
        unknown = sorted(set(data) - set(_EASYDEL_FIELDS))
        if unknown:
            raise SerializationError(
                f"JSON without '__schema__' is read as EasyDeL's PagedAttentionCacheMetaData, but it "
                f"has fields EasyDeL does not write: {unknown}; this is not cache metadata we can read"
            )
        missing = [f for f in _EASYDEL_FIELDS if f not in data]
        if missing:
            raise SerializationError(f"EasyDeL cache metadata JSON is missing fields {missing}")
        return {**data, "__schema__": cls.SCHEMA, "__version__": cls.SCHEMA_VERSION}


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """How the kv-head and page axes of the pages map onto a mesh."""

    kv_head_mesh_axes: tuple[str, ...]
    kv_head_shards: int
    page_mesh_axes: tuple[str, ...]
    page_shards: int
    adjustments: tuple[str, ...]


def plan_layout(
    mesh: Any,
    *,
    num_kv_heads: int,
    partition_manager: PartitionManager | None,
    emit_warnings: bool,
) -> LayoutPlan:
    """Resolve the kv-head and page axes against ``mesh``, reporting every adjustment."""
    positive_int("num_kv_heads", num_kv_heads)
    if not isinstance(getattr(mesh, "shape", None), Mapping):  # Mesh and AbstractMesh map axis -> size
        raise ValueError(f"mesh must be a jax.sharding.Mesh or AbstractMesh, got {show(mesh)}; for one device "
                         "use sharding.create_mesh({'tp': 1}, devices=jax.devices()[:1])")
    if partition_manager is not None and not isinstance(partition_manager, PartitionManager):
        hint = ""
        if type(partition_manager).__module__.startswith(("eformer", "easydel")):
            hint = (" (an eformer/EasyDeL one converts with easykv.integrations.easydel."
                    "partition_manager_from_easydel(pm, mesh=mesh))")
        raise ValueError(f"partition_manager must be a sharding.PartitionManager or None, got "
                         f"{type(partition_manager).__name__}{hint}")
    pm = partition_manager if partition_manager is not None else PartitionManager(PartitionAxis())
    page_axes = pm.paxis.mesh_axes(PAGE)
    # The page axis length is chosen by sizing, always as a multiple of its shard count, so
    # only axes missing from the mesh can be dropped there.
    page_dim = math.prod(mesh.shape.get(a, 1) for a in page_axes)
    spec, report = pm.resolve_with_report((KV_HEAD, PAGE), (num_kv_heads, page_dim), mesh=mesh)
    if emit_warnings:
        from sharding import ShardingAdjustedWarning

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


__all__ = [
    "MemoryBudget",
    "PagedAttentionCacheMetaData",
    "LayoutPlan",
    "SUPPORTED_DTYPES",
    "canonical_dtype",
    "plan_layout",
]
