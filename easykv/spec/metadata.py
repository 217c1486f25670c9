"""The static description of a paged cache: `PagedAttentionCacheMetaData`, its checks and the
figures that follow from it.

`PagedAttentionCacheMetaData` keeps EasyDeL's field names so that EasyDeL users can switch by
changing imports, and adds what a sharded pool needs: the cache dtype, the quantizer, and how
kv heads and pages are split over the mesh. The per-device figures follow from those fields, so
they are properties, never stored twice. Sizing the pool from device memory (`create`) lives in
``create.py``, the mesh plan (`plan_layout`, re-exported here) in ``layout.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast, overload

import numpy as np
from numpy.typing import DTypeLike

from easykv.errors import SerializationError
from easykv.quantization import Quantizer, get_quantizer, page_head_bytes
from easykv.sharding import PartitionManager
from easykv.spec.create import create_metadata
from easykv.spec.dtypes import SUPPORTED_DTYPES, canonical_dtype
from easykv.spec.groups import LayerGroup, check_groups, known_size
from easykv.spec.layout import LayoutPlan, plan_layout  # re-exported: the metadata's public companions
from easykv.spec.memory import MemoryBudget  # re-exported
from easykv.spec.serialization import Serializable
from easykv.validation import INT32_MAX, INT64_MAX, positive_int, real, show

if TYPE_CHECKING:
    from jax.sharding import AbstractMesh, Mesh

_EASYDEL_FIELDS = (
    "batch_size", "num_hidden_layers", "num_pages_per_layer", "num_pages_per_sequence",
    "max_sequences", "page_size", "num_kv_heads", "kv_head_dim_size", "hbm_utilization",
)  # fmt: skip


#: The logical shape of a group's stacked pages:
#: ``(layers_in_group, num_kv_heads, num_pages, page_size, head_dim)``.
PagesShape = tuple[int, int, int, int, int]


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

    Attributes:
      batch_size: the most sequences one step holds.
      num_hidden_layers: the model's layers.
      num_pages_per_layer: pages of one layer's pool, over all replicas (grouped: the largest pool).
      num_pages_per_sequence: ``ceil(max_sequences / page_size)``, a page table row's width.
      max_sequences: the most tokens one sequence holds (EasyDeL's name).
      page_size: tokens per page.
      num_kv_heads: kv heads per layer (grouped: the most of any group).
      kv_head_dim_size: head dim of keys and values (grouped: the largest key head dim).
      hbm_utilization: the fraction of device memory the pool was sized for, in ``(0, 1]``.
      dtype: the pages' logical dtype, float32 / bfloat16 / float16; None: left to ``init_cache``.
      quantization: the quantizer's name (default ``"none"``).
      kv_head_mesh_axes: mesh axes the kv heads are split over; None: left to ``init_cache``.
      kv_head_shards: slices of the kv heads (None with ``kv_head_mesh_axes``).
      page_mesh_axes: mesh axes the page axis is split over (default none).
      page_shards: slices of the page axis, one per data-parallel replica (default 1).
      memory_bytes_per_device: the budget the pool was sized from (None: not recorded).
      layer_groups: the `LayerGroup`s; None: one full-attention group of every layer.
      host_pages_per_layer: pages per layer of the host-memory tier, over all replicas (None: no
        tier).
    """

    SCHEMA: ClassVar[str] = "easykv.PagedAttentionCacheMetaData"
    SCHEMA_VERSION: ClassVar[int] = 3  # 2: layer_groups (absent: one full-attention group); 3: host tier

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
    layer_groups: tuple[LayerGroup, ...] | None = dataclasses.field(
        default=None, metadata={"codec": "serializables", "type": LayerGroup, "since": 2})
    # Pages per layer of the host-memory tier (None: no tier); groups scale it (`group_host_pages`).
    host_pages_per_layer: int | None = dataclasses.field(default=None, metadata={"since": 3})

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
        if self.layer_groups is None and self.pages_per_shard < self.num_pages_per_sequence:
            raise ValueError(
                f"the pool cannot hold one full sequence: {self.pages_per_shard} pages per "
                f"{'replica' if self.page_shards > 1 else 'pool'} < num_pages_per_sequence="
                f"{self.num_pages_per_sequence} (max_sequences={self.max_sequences}, page_size="
                f"{self.page_size}); give the cache more memory or lower max_sequences"
            )
        if self.num_pages_per_layer * self.page_size > INT32_MAX:
            raise ValueError(
                f"num_pages_per_layer * page_size = {self.num_pages_per_layer * self.page_size} "
                "slots exceeds int32 slot ids; use fewer pages per layer"
            )
        if self.layer_groups is not None:
            self._check_layer_groups()
        if self.host_pages_per_layer is not None:
            self._check_host_tier()
        # The budget is what the pool was sized from: a pool that does not fit it is a
        # hand-edited or damaged description, never one `create` made.
        if self.memory_bytes_per_device is not None and self.bytes_per_device > self.memory_bytes_per_device:
            raise ValueError(
                f"the pool needs {self.bytes_per_device} bytes per device ({self._cost_detail()}) but "
                f"memory_bytes_per_device={self.memory_bytes_per_device}; size it with create(), or fix the page counts"
            )

    def _check_layer_groups(self) -> None:
        """A grouped description: every layer in one group, each group sized and fitting its
        quantizer and mesh split; the EasyDeL fields give the largest group's figures."""
        raw = self.layer_groups
        if isinstance(raw, LayerGroup) or not isinstance(raw, (tuple, list)) or not raw:
            raise ValueError(f"layer_groups must be a non-empty sequence of LayerGroup, got {show(raw)}")
        groups = tuple(g.filled(num_kv_heads=self.num_kv_heads, head_dim=self.kv_head_dim_size).own_format(
            dtype=self.dtype, quantization=self.quantization) if isinstance(g, LayerGroup) else g for g in raw)
        check_groups(groups, num_layers=self.num_hidden_layers, page_size=self.page_size)
        object.__setattr__(self, "layer_groups", groups)
        for i, g in enumerate(groups):
            where = f"layer_groups[{i}] (layers {g.span})"
            if g.num_pages is None:
                raise ValueError(f"{where} has no num_pages; size the groups with PagedAttentionCacheMetaData.create("
                                 "..., layer_groups=...) or give each group its num_pages")
            if g.num_pages % self.page_shards:
                raise ValueError(f"{where}: num_pages={g.num_pages} is not divisible by page_shards={self.page_shards}")
            need = g.pages_per_sequence(self.max_sequences, self.page_size)
            if g.num_pages // self.page_shards < need:
                raise ValueError(f"{where} holds {g.num_pages // self.page_shards} pages per "
                                 f"{'replica' if self.page_shards > 1 else 'pool'} but one sequence needs {need} in "
                                 "it; give the cache more memory or lower max_sequences")
            if known_size(g.num_kv_heads) % self._group_head_shards(g):
                raise ValueError(f"{where}: num_kv_heads={g.num_kv_heads} is not divisible by kv_head_shards="
                                 f"{g.kv_head_shards}")
            for dim in {known_size(g.key_head_dim), known_size(g.value_head_dim if g.has_values else g.key_head_dim)}:
                self.group_quantizer(g).validate(dim, self.group_sizing_dtype(g))
        largest = {"num_pages_per_layer": max(known_size(g.num_pages) for g in groups),
                   "num_kv_heads": max(known_size(g.num_kv_heads) for g in groups),
                   "kv_head_dim_size": max(known_size(g.key_head_dim) for g in groups)}
        off = {k: v for k, v in largest.items() if getattr(self, k) != v}
        if off:
            raise ValueError(
                f"with layer_groups the EasyDeL fields give the largest group's figures: {off} (got "
                f"{ {k: getattr(self, k) for k in off} }); create() fills them")
        # One full group of the cache's own geometry and layout is the uniform cache: one form
        # for it, however it was built (equal metadata, version-1 JSON, accepted everywhere).
        if groups == (self._uniform_group(),):
            object.__setattr__(self, "layer_groups", None)

    def _check_host_tier(self) -> None:
        """A host tier gives every group at least one host page per data-parallel replica."""
        n = positive_int("host_pages_per_layer", self.host_pages_per_layer, hi=INT32_MAX // self.page_size,
                         hint="pages of the host-memory tier (None: no tier)")
        object.__setattr__(self, "host_pages_per_layer", n)
        if n % self.page_shards:
            raise ValueError(f"host_pages_per_layer={n} is not divisible by page_shards={self.page_shards}; use a "
                             f"multiple of {self.page_shards} (each data-parallel replica has its slice)")
        for i, g in enumerate(self.groups):
            if self.group_host_pages(g) < self.page_shards:
                raise ValueError(
                    f"host_pages_per_layer={n} gives layer group {i} (layers {g.span}, {g.num_pages} device pages of "
                    f"the {self.num_pages_per_layer} of the largest group) no host page per replica; give the host "
                    "tier more pages or leave it out (None)")

    # ---- derived figures -----------------------------------------------------------------
    @property
    def has_host_tier(self) -> bool:
        """Whether evicted prefix pages and swapped sequences go to a host-memory tier."""
        return self.host_pages_per_layer is not None

    def group_host_pages(self, group: LayerGroup) -> int:
        """Host-tier pages of ``group`` (0 without a tier): ``host_pages_per_layer`` scaled by
        the group's share of the largest pool, rounded down to whole replica slices, so every
        group keeps as many sequences' worth of pages on the host as the largest.

        Args:
          group: one of ``metadata.groups``."""
        if self.host_pages_per_layer is None:
            return 0
        scaled = known_size(group.num_pages) * self.host_pages_per_layer // self.num_pages_per_layer
        return scaled // self.page_shards * self.page_shards

    @property
    def host_bytes_per_device(self) -> int:
        """Host-memory bytes the tier holds for one device's shard (all groups, all layers)."""
        return sum(self.group_page_bytes(g) * (self.group_host_pages(g) // self.page_shards) * g.num_layers
                   for g in self.groups)

    def with_host_memory(self, host_memory_bytes: int, devices_per_host: int) -> PagedAttentionCacheMetaData:
        """This metadata with a host tier of as many pages as ``host_memory_bytes`` of each
        host's memory holds for its ``devices_per_host`` devices (each stores the host pages of
        its own shard). ValueError when that is not one page per replica in every group.

        Args:
          host_memory_bytes: bytes of each host's memory for the tier, a positive int.
          devices_per_host: mesh devices on each host, a positive int."""
        budget = positive_int("host_memory_bytes", host_memory_bytes, hi=INT64_MAX,
                              hint="bytes of host memory per host for the tier (leave it None for no tier)")
        local = positive_int("devices_per_host", devices_per_host)
        probe = self.replace(host_pages_per_layer=None)
        # Bytes per device of one host page per layer of the largest pool, every group scaled alike.
        unit = sum(self.group_page_bytes(g) * g.num_layers * known_size(g.num_pages)
                   for g in self.groups) / self.num_pages_per_layer
        per_replica = int(budget // local / unit) // self.page_shards  # pages of the largest pool, per replica slice
        per_replica = min(per_replica, INT32_MAX // self.page_size // self.page_shards)
        smallest = min(known_size(g.num_pages) for g in self.groups)
        need = -(-self.num_pages_per_layer // smallest)  # one page per replica in the smallest group
        if per_replica < need:
            raise ValueError(
                f"host_memory_bytes={budget} over {local} device(s) per host holds {per_replica} host page(s) per "
                f"replica slice ({unit:.0f} bytes per page per device across every layer); the tier needs {need} "
                "(one page of every layer group); give it more memory or leave host_memory_bytes None")
        return probe.replace(host_pages_per_layer=per_replica * self.page_shards)

    @property
    def quantizer(self) -> Quantizer:
        """The cache's quantizer object (of ``quantization``)."""
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
        """``num_kv_heads // head_shards``: kv heads one device stores."""
        return self.num_kv_heads // self.head_shards

    @property
    def pages_per_shard(self) -> int:
        """Pages of one layer held by one device (one data-parallel replica's slice)."""
        return self.num_pages_per_layer // self.page_shards

    @property
    def bytes_per_token_head(self) -> int:
        """The quantizer's bytes of one token of one kv head (codes and per-token scales; scales
        kept per page, as ``int4-ch``'s, are counted in ``page_bytes_per_device``)."""
        return self.quantizer.bytes_per_token_head(self.kv_head_dim_size, self.sizing_dtype)

    @property
    def page_bytes_per_device(self) -> int:
        """Bytes one device stores for one page of one layer, K and V together (of a uniform
        cache; a grouped one has `group_page_bytes` per group)."""
        return 2 * self.kv_heads_per_device * page_head_bytes(self.quantizer, self.page_size, self.kv_head_dim_size,
                                                              self.sizing_dtype)

    # ---- layer groups -----------------------------------------------------------------------
    @property
    def is_uniform(self) -> bool:
        """One full-attention group of every layer: today's EasyDeL cache."""
        return self.layer_groups is None

    @functools.cached_property
    def groups(self) -> tuple[LayerGroup, ...]:
        """The layer groups; a uniform cache is the one full-attention group of its fields."""
        return (self._uniform_group(),) if self.layer_groups is None else self.layer_groups

    def _uniform_group(self) -> LayerGroup:
        return LayerGroup(layers=tuple(range(self.num_hidden_layers)), num_kv_heads=self.num_kv_heads,
                          key_head_dim=self.kv_head_dim_size, value_head_dim=self.kv_head_dim_size,
                          num_pages=self.num_pages_per_layer, kv_head_mesh_axes=self.kv_head_mesh_axes,
                          kv_head_shards=self.kv_head_shards)

    @property
    def is_single_geometry(self) -> bool:
        """One group of every layer in the cache-wide geometry (any attention kind): its pages
        are those of a uniform cache; only which of them a sequence keeps differs."""
        (g, *rest) = self.groups
        return not rest and not g.latent and self.has_one_format and (
            g.num_kv_heads, g.key_head_dim, g.value_head_dim) == (self.num_kv_heads, self.kv_head_dim_size,
                                                                   self.kv_head_dim_size)

    def require_uniform(self, what: str, *, windows: bool = False) -> None:
        """Refuse (NotImplementedError) a grouped description where ``what`` handles one group only.

        Args:
          what: the caller, named in the message.
          windows: also accept one group of any attention kind in the cache-wide geometry and
            format (`is_single_geometry`); default: full attention only."""
        if not (self.is_uniform or (windows and self.is_single_geometry)):
            kinds = ", ".join(f"layers {g.span}: {g.attention}" for g in self.groups)
            raise NotImplementedError(
                f"{what} holds uniform caches (every layer full attention, one geometry){' or one window' * windows}, "
                f"but this metadata has layer groups ({kinds})")

    def group_of(self, layer: int) -> tuple[int, int]:
        """``(group, index in the group)`` of a model layer.

        Args:
          layer: the model layer, an int in ``0 .. num_hidden_layers - 1``."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise AssertionError(f"layer {layer} is in no layer group of a checked metadata: a bug in easykv")

    @overload
    def group_pages_shape(self, group: LayerGroup, *, values: Literal[False] = False) -> PagesShape: ...

    @overload
    def group_pages_shape(self, group: LayerGroup, *, values: bool) -> PagesShape | None: ...

    def group_pages_shape(self, group: LayerGroup, *, values: bool = False) -> PagesShape | None:
        """Logical shape of ``group``'s stacked key (or value) pages, ``(layers_in_group,
        num_kv_heads, num_pages, page_size, head_dim)``; None for the values of a latent group,
        which stores none.

        Args:
          group: one of ``metadata.groups``.
          values: the value pages' shape (their head dim) instead of the keys'."""
        if values and not group.has_values:
            return None
        dim = group.value_head_dim if values else group.key_head_dim
        return (group.num_layers, known_size(group.num_kv_heads), known_size(group.num_pages), self.page_size,
                known_size(dim))

    def _group_head_shards(self, group: LayerGroup) -> int:
        return 1 if group.kv_head_shards is None else group.kv_head_shards

    def group_dtype(self, group: LayerGroup) -> np.dtype | None:
        """The logical dtype of ``group``'s pages: its own, else the cache's (None while the
        cache's is left to ``init_cache``).

        Args:
          group: one of ``metadata.groups``."""
        return self.dtype if group.dtype is None else group.dtype

    def group_sizing_dtype(self, group: LayerGroup) -> np.dtype:
        """`group_dtype`, or bfloat16 while it is left open (as `sizing_dtype`).

        Args:
          group: one of ``metadata.groups``."""
        return self.sizing_dtype if group.dtype is None else group.dtype

    def group_quantizer(self, group: LayerGroup) -> Quantizer:
        """The quantizer of ``group``'s pages: its own, else the cache's.

        Args:
          group: one of ``metadata.groups``."""
        return get_quantizer(self.quantization if group.quantization is None else group.quantization)

    @property
    def has_one_format(self) -> bool:
        """Every group stores the cache's dtype and quantizer (no group chose its own)."""
        return all(g.dtype is None and g.quantization is None for g in self.groups)

    @property
    def group_formats(self) -> tuple[tuple[np.dtype | None, str], ...]:
        """Each group's ``(dtype, quantizer name)``, in group order."""
        return tuple((self.group_dtype(g), self.group_quantizer(g).name) for g in self.groups)

    def with_formats(self, formats: Sequence[tuple[np.dtype | None, str | Quantizer | None]], *,
                     dtype: DTypeLike | None, quantization: str | Quantizer | None) -> PagedAttentionCacheMetaData:
        """This metadata with group ``i`` storing ``formats[i]``, and the cache's own format (that
        of groups that do not choose theirs). A uniform cache has one group: its format is the
        cache's (``dtype`` / ``quantization`` are then unused).

        Args:
          formats: one ``(dtype, quantizer)`` per group, in group order (ValueError otherwise).
          dtype: the cache's dtype.
          quantization: the cache's quantizer name or object."""
        if len(formats) != len(self.groups):
            raise ValueError(f"formats gives {len(formats)} (dtype, quantizer) pairs for {len(self.groups)} groups")
        if self.layer_groups is None:
            ((dtype, quantization),) = formats
            return self.replace(dtype=dtype, quantization=get_quantizer(quantization).name)
        groups = tuple(dataclasses.replace(g, dtype=d, quantization=get_quantizer(q).name)
                       for g, (d, q) in zip(self.layer_groups, formats))
        return self.replace(dtype=dtype, quantization=get_quantizer(quantization).name, layer_groups=groups)

    def group_page_head_bytes(self, group: LayerGroup) -> int:
        """Stored bytes of one page of one kv head of ``group``: K and V, or the latent, with
        their scales (per token or per page).

        Args:
          group: one of ``metadata.groups``."""
        quantizer, dtype = self.group_quantizer(group), self.group_sizing_dtype(group)
        per_head = page_head_bytes(quantizer, self.page_size, known_size(group.key_head_dim), dtype)
        if group.has_values:
            per_head += page_head_bytes(quantizer, self.page_size, known_size(group.value_head_dim), dtype)
        return per_head

    def group_page_bytes(self, group: LayerGroup) -> int:
        """Bytes one device stores for one page of one layer of ``group`` (K and V, or the latent).

        Args:
          group: one of ``metadata.groups``."""
        return known_size(group.num_kv_heads) // self._group_head_shards(group) * self.group_page_head_bytes(group)

    def _cost_detail(self) -> str:
        return "; ".join(f"layers {g.span}: {known_size(g.num_pages) // self.page_shards} pages x {g.num_layers} "
                         f"layers x {self.group_page_bytes(g)} bytes" for g in self.groups)

    @property
    def bytes_per_device(self) -> int:
        """Bytes of the whole pool (all groups, all layers) on one device."""
        return sum(self.group_page_bytes(g) * (known_size(g.num_pages) // self.page_shards) * g.num_layers
                   for g in self.groups)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one cached token over all layers and kv heads, each head counted once
        (replicated heads cost this again on every device that holds a copy); in a windowed
        group a token costs this only while it is inside the window."""
        per_page = sum(known_size(g.num_kv_heads) * self.group_page_head_bytes(g) * g.num_layers for g in self.groups)
        return -(-per_page // self.page_size)  # per-page scales spread over the page's tokens, rounded up

    def bytes_per_sequence(self, tokens: int) -> int:
        """Bytes per device one sequence of ``tokens`` tokens holds once the pages that left
        its windows are released (whole pages, every group).

        Args:
          tokens: the sequence's length, a positive int."""
        tokens = positive_int("tokens", tokens, hi=None)
        return sum(self.group_page_bytes(g) * g.pages_per_sequence(tokens, self.page_size) * g.num_layers
                   for g in self.groups)

    @property
    def tokens_per_layer(self) -> int:
        """Slots of one layer's pool: ``num_pages_per_layer * page_size``."""
        return self.num_pages_per_layer * self.page_size

    @property
    def max_full_sequences(self) -> int:
        """Sequences of max_sequences tokens the pool holds at once (in every group)."""
        return self.page_shards * min(known_size(g.num_pages) // self.page_shards
                                      // g.pages_per_sequence(self.max_sequences, self.page_size) for g in self.groups)

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        mesh: Mesh | AbstractMesh,
        batch_size: int,
        num_hidden_layers: int,
        max_sequences: int,
        page_size: int,
        num_kv_heads: int,
        kv_head_dim_size: int,
        hbm_utilization: float,
        dtype: DTypeLike = np.dtype("bfloat16"),
        *,
        partition_manager: PartitionManager | None = None,
        quantizer: str | Quantizer | None = None,
        memory_bytes_per_device: int | None = None,
        num_pages_per_layer: int | None = None,
        layer_groups: Sequence[LayerGroup] | None = None,
        host_memory_bytes: int | None = None,
    ) -> PagedAttentionCacheMetaData:
        """Size the pool from device memory (EasyDeL's positional order, extras keyword-only).

        The budget per device (``memory.device_memory_budget``: memory_stats, the host rule on
        CPU, or ``memory_bytes_per_device``) is divided by what one page costs that device in
        all layers: K and V, the kv heads it really stores after sharding or replication, the
        storage dtype and the quantizer's scales. With the page axis sharded over a
        data-parallel mesh axis every replica holds that many pages, so the pool grows with it.

        Args:
          mesh: the `Mesh` of the pages (an ``AbstractMesh`` will do when memory is not read);
            with ``partition_manager`` it decides the kv-head and page splits.
          batch_size: the most sequences one step holds.
          num_hidden_layers: the model's layers.
          max_sequences: the most tokens one sequence holds (EasyDeL's name).
          page_size: tokens per page.
          num_kv_heads: kv heads per layer.
          kv_head_dim_size: head dim of keys and values.
          hbm_utilization: the fraction of each device's memory the pool may take, in ``(0, 1]``.
          dtype: the pages' logical dtype: float32, bfloat16 (default) or float16.
          partition_manager: the `PartitionManager` (None: the default rules); adjustments to
            the mesh warn `ShardingAdjustedWarning`.
          quantizer: a quantizer name or object (None: ``"none"``).
          memory_bytes_per_device: the budget per device itself (``hbm_utilization`` not applied).
          num_pages_per_layer: fixes the pool size instead (memory is then not consulted).
          layer_groups: the model's `LayerGroup`s (heads and head dims they leave open are
            ``num_kv_heads`` / ``kv_head_dim_size``). Each group gets its own pool, sized so that
            all groups hold the same number of ``max_sequences``-token sequences once pages that
            left a window are released; groups that all give ``num_pages`` fix the pools instead.
            One full-attention group of the default geometry is the uniform cache (None).
          host_memory_bytes: bytes of each host's memory for a host-memory tier (evicted prefix
            pages and swapped-out sequences; see `PageManager`), shared by the mesh devices of
            that host; None (the default): no tier. Too little for one page is an error."""
        meta: PagedAttentionCacheMetaData = create_metadata(
            cls, mesh, batch_size=batch_size, num_hidden_layers=num_hidden_layers, max_sequences=max_sequences,
            page_size=page_size, num_kv_heads=num_kv_heads, kv_head_dim_size=kv_head_dim_size,
            hbm_utilization=hbm_utilization, dtype=dtype, partition_manager=partition_manager, quantizer=quantizer,
            memory_bytes_per_device=memory_bytes_per_device, num_pages_per_layer=num_pages_per_layer,
            layer_groups=layer_groups, host_memory_bytes=host_memory_bytes, stacklevel=3)
        return meta

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


def known_dtype(dtype: np.dtype | None) -> np.dtype:
    """``dtype`` (``metadata.dtype`` or ``metadata.group_dtype(g)``) of a complete metadata, typed
    as the dtype it is there. A metadata may leave its dtype to ``init_cache`` (None), but `create`
    sets it, and every cache's, view's and checkpoint's metadata was completed before a page
    existed (see ``storage.placement.checked_layout``). Nothing is checked here."""
    # cast: "complete" is an invariant of the metadata a cache holds that the field type cannot carry.
    return cast(np.dtype, dtype)


__all__ = [
    "LayerGroup",
    "MemoryBudget",
    "PagedAttentionCacheMetaData",
    "PagesShape",
    "LayoutPlan",
    "SUPPORTED_DTYPES",
    "canonical_dtype",
    "known_dtype",
    "plan_layout",
]
