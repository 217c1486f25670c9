"""The paged cache: one view per layer holding that layer's key and value pages.

``PagedAttentionCacheView`` and ``PagedAttentionCache`` keep EasyDeL's names and methods. Both
are pytrees whose only leaves are the page arrays (metadata, layer index and placement are
static), so jit can take and return them and donation reuses their buffers.

Pages are ``(num_kv_heads, num_pages_per_layer, page_size, head_dim)``; on CPU the bf16/f16
pages are stored as raw bits (see ``pages.py``) — use ``view.dtype`` for the logical dtype and
``gather_kv`` to read tokens back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from functools import partial
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from easykv.storage import cache_json
from easykv.errors import MemoryUnavailableError
from easykv.spec.memory import device_memory_budget
from easykv.spec.groups import LayerGroup
from easykv.spec.metadata import PagedAttentionCacheMetaData, canonical_dtype, plan_layout
from easykv.storage.pages import (
    PageLayout,
    allocate_pages,
    encode_tokens,
    group_page_templates,
    read_pages,
    copy_pages_local,
    page_op,
    zero_pages_local,
)
from easykv.quantization import Quantizer, get_quantizer
from easykv.step.metadata import PagedAttentionMetadata, group_runtime
from easykv.storage.writes import (
    check_new_tokens,
    check_slots_on_host,
    check_token_rows,
    count_dropped,
    scatter_encoded,
    scatter_kv,
    token_slots,
)
from easykv.validation import integer, page_ids
from easykv.sharding import PartitionManager, ShardingAdjustedWarning


class _EasyDeLForms:
    """EasyDeL's ``replace`` and dict / JSON forms of the view and the cache (small caches and
    debugging; the formats are in cache_json.py)."""

    _to_dict: ClassVar[Any]
    _from_dict: ClassVar[Any]

    def replace(self, **changes: Any) -> Any:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return type(self)._to_dict(self)

    def to_json(self, **json_kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **json_kwargs)

    @classmethod
    def from_dict(cls, data: Any, *, mesh: Mesh | None = None, partition_manager: PartitionManager | None = None) -> Any:
        """Rebuilt on ``mesh`` (laid out as the metadata says), or on one device without one."""
        return cls._from_dict(cls, data, mesh, partition_manager)

    @classmethod
    def from_json(cls, text: str | bytes, *, mesh: Mesh | None = None,
                  partition_manager: PartitionManager | None = None) -> Any:
        return cls.from_dict(cache_json.loads(text, f"the JSON of a {cls.__name__}"), mesh=mesh,
                             partition_manager=partition_manager)


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["group_key_pages", "group_value_pages", "layer"],
    meta_fields=["metadata", "layer_index", "layout", "group"],
)
@dataclasses.dataclass(eq=False)
class PagedAttentionCacheView(_EasyDeLForms):
    """One layer of a layer group's stacked pages.

    group_key_pages, group_value_pages: the group's pages, ``(layers_in_group, num_kv_heads,
    num_pages_per_layer, page_size, kv_head_dim_size)`` in the storage dtype of the platform;
    ``layer`` is this layer's index in the group (an int, or a traced index when a model scans
    over the group's layers: see :meth:`at_layer`); ``layer_index`` the layer's index in the
    model (None for a view whose ``layer`` is traced); ``group`` the layer group's index in the
    metadata (its geometry: ``metadata.groups[group]``). ``key_pages`` / ``value_pages`` are the
    layer's slice ``(num_kv_heads, num_pages, page_size, head_dim)``, as in EasyDeL (a latent
    group's ``value_pages`` are None); writes and attention index the stack instead, so they
    never copy a layer's pool. ``layout`` says how the pages are split over the mesh (None: one
    device, no shard_map).

    As in EasyDeL, the ``write_*`` methods update this view and return it, and the cache the
    view was taken from (``cache.views[i]`` / ``cache[i]``) sees the write: the group's new
    arrays go through to it, and ``cache.views[i] = view`` (EasyDeL's models do it) accepts the
    written view. ``cache.views[i] = view`` with a view of other arrays (another cache of the
    same metadata and layout) copies that view's layer into layer ``i``, as a list would. A view
    taken before another layer of its group was written is stale: writing it is refused (it
    would undo that write); putting it back copies only its own layer. Inside jit the view holds
    traced pages; outside jit the group's page buffers are donated to the write, so a write
    costs what it writes, not the size of the pool. Engines that keep old pages use the
    functional ``PagedAttentionCache.write``.
    """

    metadata: PagedAttentionCacheMetaData
    layer_index: int | None
    group_key_pages: Any
    group_value_pages: Any
    layer: Any = 0
    layout: PageLayout | None = None
    group: int = 0

    def __post_init__(self) -> None:
        # The stacks this view was taken from: writing it, or putting it back, into a cache whose
        # arrays have moved on since (another layer written) would lose that write: refused.
        self._base = (self.group_key_pages, self.group_value_pages)
        # The cache (and group) this view was taken from with cache[i]: its writes go through to it.
        self._owner: tuple[PagedAttentionCache, int] | None = None

    @property
    def dtype(self) -> np.dtype:
        """Logical dtype of the cached keys and values (this layer's group's)."""
        return self.metadata.group_dtype(self.layer_group)

    @property
    def key_pages(self) -> Any:
        """This layer's key pages ``(num_kv_heads, num_pages, page_size, head_dim)`` (storage
        dtype): a slice of the stack (outside jit, a copy; attention reads the stack itself)."""
        return jax.tree.map(lambda a: a[self.layer], self.group_key_pages)

    @property
    def layer_group(self) -> LayerGroup:
        """The layer group this view's layer belongs to: its attention kind and geometry."""
        return self.metadata.groups[self.group]

    @property
    def value_pages(self) -> Any:
        return jax.tree.map(lambda a: a[self.layer], self.group_value_pages)

    def at_layer(self, layer: Any) -> PagedAttentionCacheView:
        """The view of layer ``layer`` (index in the group) of the same group arrays: an int, or
        a traced index for a model that runs the group's layers under ``lax.scan`` (carry
        ``cache.group_view(g)``, call ``view.at_layer(i)`` each iteration, write and attend,
        then ``cache.update(view)``; see the README)."""
        if isinstance(layer, jax.core.Tracer):
            if np.shape(layer) != () or not jnp.issubdtype(layer.dtype, jnp.integer):
                raise ValueError(f"layer must be an integer scalar, got {layer.dtype} of shape {np.shape(layer)}")
            return dataclasses.replace(self, layer=layer, layer_index=None)
        n = int(np.shape(jax.tree.leaves(self.group_key_pages)[0])[0])
        i = integer("layer", layer, lo=0, hi=n - 1, hint=f"the view's group holds {n} layers")
        group = self.layer_group
        # A view of its group's whole stack knows every layer's index; a stack of one (a view made
        # by PagedAttentionCacheView.init) keeps its own.
        index = group.layers[i] if n == group.num_layers else self.layer_index
        return dataclasses.replace(self, layer=i, layer_index=index)

    @classmethod
    def init(cls, mesh: Mesh, dtype: Any, metadata: PagedAttentionCacheMetaData, layer_index: int,
             partition_manager: PartitionManager | None = None,
             quantizer: str | Quantizer | None = None) -> PagedAttentionCacheView:
        """Allocate one layer's pages (a stack of one layer, in its group's geometry) directly on
        the devices of ``mesh``."""
        if not isinstance(metadata, PagedAttentionCacheMetaData):
            raise ValueError(f"metadata must be a PagedAttentionCacheMetaData, got {type(metadata).__name__}")
        layer_index = integer("layer_index", layer_index, lo=0, hi=metadata.num_hidden_layers - 1)
        metadata, layout, templates = _checked_layout(mesh, dtype, metadata, partition_manager, quantizer)
        layouts = group_layouts(metadata, layout)
        g, _ = metadata.group_of(layer_index)
        check_fits(mesh, metadata, metadata.group_page_bytes(metadata.groups[g]) * metadata.groups[g].num_pages
                    // metadata.page_shards, f"1 layer of layers {metadata.groups[g].span}")
        k, v = allocate_pages(templates(g, layers=1), layouts[g])
        return cls(metadata=metadata, layer_index=layer_index, group_key_pages=k, group_value_pages=v,
                   layer=0, layout=layouts[g], group=g)

    def concatenate_to_cache(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "a paged cache has no contiguous buffer to concatenate into; use "
            "write_prefill_to_cache / write_decodes_to_cache / write_tokens"
        )

    # ---- writes (EasyDeL's: they update this view and return it) -------------------------------
    def write_tokens(self, key: Any, value: Any, slots: Any) -> PagedAttentionCacheView:
        """Write token rows (num_tokens, num_kv_heads, head_dim) at ``slots`` (-1: padding)."""
        return self._write(key, value, check_slots_on_host(slots, self.layer_group.num_pages * self.metadata.page_size))

    def write_prefill_to_cache(self, key: Any, value: Any, metadata: PagedAttentionMetadata) -> PagedAttentionCacheView:
        """key, value: (padded_prefill_len, num_kv_heads, head_dim) at metadata.prefill_position.
        ``metadata`` may also be one runtime metadata per layer group (a tuple): this view's is used."""
        return self._write_mode(key, value, metadata, "prefill", "for_prefill")

    def write_decodes_to_cache(self, key: Any, value: Any, metadata: PagedAttentionMetadata) -> PagedAttentionCacheView:
        """key, value: (batch, num_kv_heads, head_dim), one token per sequence at decodes_position."""
        return self._write_mode(key, value, metadata, "decode", "for_decode")

    def write_mixed_to_cache(self, key: Any, value: Any, metadata: PagedAttentionMetadata) -> PagedAttentionCacheView:
        """key, value: (num_tokens, num_kv_heads, head_dim) at metadata.slot_mapping."""
        return self._write_mode(key, value, metadata, "mixed", "for_mixed")

    def _write_mode(self, key: Any, value: Any, metadata: Any, mode: str, maker: str) -> PagedAttentionCacheView:
        rt = group_runtime(metadata, len(self.metadata.groups), self.group)
        if not getattr(rt, f"is_{mode}_mode")():
            name = "decodes" if mode == "decode" else mode
            raise ValueError(f"write_{name}_to_cache needs {mode} metadata (PagedAttentionMetadata.{maker})")
        return self._write(key, value, token_slots(rt, self.metadata, self.group))

    def _write(self, key: Any, value: Any, slots: Any) -> PagedAttentionCacheView:
        """``write_tokens`` on slots already checked (host) or bounded in the scatter (device)."""
        if np.ndim(slots) != 1:
            raise ValueError(f"slots must be 1-D (one per token), got shape {np.shape(slots)}")
        check_new_tokens(key, value, metadata=self.metadata, num_tokens=int(np.shape(slots)[0]), group=self.group)
        if self._owner is not None:
            self._owner[0]._check_current(self._owner[1], self, f"the view of layer {self.layer_index}")
        pages = (self.group_key_pages, self.group_value_pages)
        traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((pages, self.layer)))
        scatter = _scatter if traced else _scatter_in_place  # under a trace, donation means nothing
        self.group_key_pages, self.group_value_pages = scatter(*pages, key, value, slots, self.layer,
                                                               layout=self.layout)
        if self._owner is not None:
            self._owner[0]._put_group(self._owner[1], self)
        self._base = (self.group_key_pages, self.group_value_pages)
        return self


PagedAttentionCacheView._to_dict = staticmethod(cache_json.view_to_dict)
PagedAttentionCacheView._from_dict = staticmethod(cache_json.view_from_dict)


class CacheViews(list):
    """``cache.views``: EasyDeL's list of per-layer views, over the cache's stacked arrays (a
    list, as EasyDeL's, whose items are made on access: it stores none of them).
    ``views[i]`` is layer ``i``'s view of the arrays the cache holds now; ``views[i] = view``
    checks that ``view`` is layer ``i`` of a cache with this metadata and layout, then takes
    its arrays when it was written from the arrays the cache holds now, and otherwise copies
    its layer's pages into layer ``i`` (the group's other layers keep theirs). Its length is
    the number of layers: appending, inserting or deleting views is refused."""

    def __init__(self, cache: PagedAttentionCache) -> None:
        super().__init__()
        self._cache = cache

    def __bool__(self) -> bool:
        return len(self) > 0

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, CacheViews) and other._cache is self._cache

    __hash__ = None  # type: ignore[assignment]

    def __len__(self) -> int:
        return self._cache.metadata.num_hidden_layers

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        return self._cache[index]

    def __setitem__(self, index: Any, view: Any) -> None:
        if isinstance(index, slice):
            raise ValueError("assign views one at a time: cache.views[i] = view")
        self._cache[index] = view

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"CacheViews({len(self)} layers)"

    def _fixed(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("a cache holds exactly one view per layer; replace one with cache.views[i] = view")

    append = extend = insert = pop = remove = clear = sort = reverse = __delitem__ = __iadd__ = __imul__ = _fixed
    copy = index = count = __contains__ = __add__ = __mul__ = __rmul__ = __reversed__ = _fixed


@partial(jax.tree_util.register_dataclass, data_fields=["key_pages", "value_pages"],
         meta_fields=["metadata", "layout"])
@dataclasses.dataclass(frozen=True, eq=False)
class PagedAttentionCache(_EasyDeLForms):
    """Every layer's pages, stacked per layer group.

    key_pages, value_pages: one array per layer group ``g`` of ``metadata.groups``,
    ``(layers_in_group, num_kv_heads, num_pages, page_size, head_dim)`` in the group's geometry
    and the storage dtype (``QuantizedPages`` when quantized); a latent group's value entry is
    None. ``layout`` is the cache-wide placement; ``layout_of(g)`` is group ``g``'s (its kv heads
    may be split over other mesh axes). ``cache[i]`` / ``cache.views[i]`` is layer ``i``'s view;
    ``cache[i] = view`` puts a written view back.
    """

    metadata: PagedAttentionCacheMetaData
    key_pages: tuple[Any, ...]
    value_pages: tuple[Any, ...]
    layout: PageLayout | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_pages", tuple(self.key_pages))
        object.__setattr__(self, "value_pages", tuple(self.value_pages))
        meta = self.metadata
        if not isinstance(meta, PagedAttentionCacheMetaData):
            raise ValueError(f"metadata must be a PagedAttentionCacheMetaData, got {type(meta).__name__}")
        if not all(hasattr(leaf, "shape") for leaf in jax.tree.leaves((self.key_pages, self.value_pages))):
            return  # jax rebuilds pytrees with placeholder leaves; nothing to check then
        groups = meta.groups
        if len(self.key_pages) != len(groups) or len(self.value_pages) != len(groups):
            raise ValueError(f"{len(self.key_pages)} key and {len(self.value_pages)} value page arrays for "
                             f"{len(groups)} layer group(s); give one stacked array per group")
        for g, (group, k, v) in enumerate(zip(groups, self.key_pages, self.value_pages)):
            want = (group.num_layers, group.num_kv_heads, group.num_pages, meta.page_size)
            if (v is None) == group.has_values:
                raise ValueError(f"value_pages[{g}] is {'None' if v is None else 'given'} but layer group {g} (layers "
                                 f"{group.span}) {'stores values' if group.has_values else 'is latent: no values'}")
            for name, x in (("key_pages", k), ("value_pages", v)):
                if x is None:
                    continue
                got = tuple(np.shape(jax.tree.leaves(x)[0]))[:4]
                if got != want:
                    raise ValueError(f"{name}[{g}] has shape {got} (leading dims) but layer group {g} (layers "
                                     f"{group.span}) needs (layers, kv heads, pages, page_size) = {want}")

    @property
    def views(self) -> CacheViews:
        return CacheViews(self)

    def __len__(self) -> int:
        return self.metadata.num_hidden_layers

    def layout_of(self, group: int) -> PageLayout | None:
        """Placement of layer group ``group``'s pages: the cache's mesh and page split, the
        group's own kv-head split."""
        return group_layouts(self.metadata, self.layout)[group]

    def _locate(self, layer: Any) -> tuple[int, int, int]:
        n = self.metadata.num_hidden_layers
        i = integer("layer", layer, lo=-n, hi=n - 1, hint=f"the cache has {n} layers") % n
        return (i, *self.metadata.group_of(i))

    def __getitem__(self, layer: int) -> PagedAttentionCacheView:
        i, g, j = self._locate(layer)
        view = PagedAttentionCacheView(self.metadata, i, self.key_pages[g], self.value_pages[g], j, self.layout_of(g),
                                       g)
        view._owner = (self, g)
        return view

    def __setitem__(self, layer: int, view: Any) -> None:
        i, g, j = self._locate(layer)
        if not isinstance(view, PagedAttentionCacheView):
            raise ValueError(f"cache.views[{i}] must be a PagedAttentionCacheView, got {type(view).__name__}")
        differs = [name for name, a, b in (("layer_index", view.layer_index, i), ("group", view.group, g),
                                           ("metadata", view.metadata, self.metadata),
                                           ("layout", view.layout, self.layout_of(g))) if a != b]
        if differs:
            raise ValueError(f"cache.views[{i}] must be layer {i} of this cache, but the view's "
                             f"{' and '.join(differs)} differ{'s' if len(differs) == 1 else ''} from it")
        if view._base[0] is self.key_pages[g] and view._base[1] is self.value_pages[g]:
            self._put_group(g, view)  # the view was written from the arrays held now: take its arrays
            return
        # A view of other arrays (another cache, or one taken before a later write): list semantics,
        # its layer's pages replace layer i's; the other layers of the group stay as they are.
        _refuse_donated(view, f"cache.views[{i}]")
        k, v = _set_layer(self.key_pages[g], self.value_pages[g], view.group_key_pages, view.group_value_pages,
                          view.layer, j)
        object.__setattr__(self, "key_pages", _replaced(self.key_pages, g, k))
        object.__setattr__(self, "value_pages", _replaced(self.value_pages, g, v))

    def group_view(self, group: int = 0) -> PagedAttentionCacheView:
        """A view of layer group ``group``'s stacks for a scan over its layers: ``layer_index``
        None (the layer is given per iteration by ``at_layer``), so it is the same pytree
        before and after every iteration."""
        n = len(self.key_pages)
        g = integer("group", group, lo=0, hi=n - 1, hint=f"the cache has {n} layer group(s)")
        view = PagedAttentionCacheView(self.metadata, None, self.key_pages[g], self.value_pages[g], 0,
                                       self.layout_of(g), g)
        view._owner = (self, g)
        return view

    def update(self, view: PagedAttentionCacheView) -> None:
        """Put back the group arrays of ``view``, a view of any layer of this cache whose arrays
        are the group's latest: the view a ``lax.scan`` over the group's layers returns, or one a
        jitted function returns for the cache's current arrays. Unlike ``cache[i] = view`` this
        cannot tell whether another layer of the group was written meanwhile (jax rebuilds the
        view it returns): put back only what was computed from this cache's arrays."""
        if not isinstance(view, PagedAttentionCacheView):
            raise ValueError(f"update takes a PagedAttentionCacheView, got {type(view).__name__}")
        g = view.group
        if view.metadata != self.metadata or view.layout != self.layout_of(g):
            raise ValueError("update takes a view of this cache, but the view's metadata or layout differs from it")
        size = int(np.shape(jax.tree.leaves(view.group_key_pages)[0])[0])
        if size != self.metadata.groups[g].num_layers:
            raise ValueError(f"the view's stack holds {size} layer(s) but layer group {g} holds "
                             f"{self.metadata.groups[g].num_layers}; update takes a view of a whole group's stack "
                             "(cache.group_view(g), or cache[i]); put one layer's view back with cache[i] = view")
        self._put_group(g, view)

    def _check_current(self, g: int, view: PagedAttentionCacheView, name: str) -> None:
        """Refuse ``view`` unless it was taken from (or has written through to) the arrays group
        ``g`` holds now."""
        base_k, base_v = view._base
        if base_k is not self.key_pages[g] or base_v is not self.value_pages[g]:
            raise ValueError(
                f"{name} was taken from other page arrays than this cache holds now (taken before another layer "
                "of its group was written, or rebuilt by jax from its leaves): writing it or putting it back could "
                "undo another write; nothing was changed. Take each layer's view right before writing it: "
                "view = cache.views[i]; view = view.write_...(...); cache.views[i] = view. A view jax returns (lax.scan over the group's "
                "layers, a jitted function given the cache's current arrays) goes back with cache.update(view)")

    def _put_group(self, g: int, view: PagedAttentionCacheView) -> None:
        object.__setattr__(self, "key_pages", _replaced(self.key_pages, g, view.group_key_pages))
        object.__setattr__(self, "value_pages", _replaced(self.value_pages, g, view.group_value_pages))

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @classmethod
    def init_empty(cls, *args: Any, **kwargs: Any) -> None:
        """EasyDeL's placeholder: a paged cache is only made by init_cache."""
        return None

    @classmethod
    def init_cache(
        cls,
        mesh: Mesh,
        dtype: Any,
        metadata: PagedAttentionCacheMetaData,
        partition_manager: PartitionManager | None = None,
        quantizer: str | Quantizer | None = None,
    ) -> PagedAttentionCache:
        """Allocate every layer group's stacked pages in one call; each device creates only its
        own shard. ``dtype`` and ``quantizer`` are the metadata's (the cache's); a layer group
        with a format of its own (`LayerGroup.dtype` / ``quantization``) is allocated in it."""
        metadata, layout, templates = _checked_layout(mesh, dtype, metadata, partition_manager, quantizer)
        check_fits(mesh, metadata, metadata.bytes_per_device, f"{metadata.num_hidden_layers} layers")
        layouts = group_layouts(metadata, layout)
        pages = [allocate_pages(templates(g), layouts[g]) for g in range(len(metadata.groups))]
        return cls(metadata, tuple(k for k, _ in pages), tuple(v for _, v in pages), layout)

    @classmethod
    def from_views(cls, views: Any) -> PagedAttentionCache:
        """A cache of per-layer views (layers 0..n-1 of one metadata and layout, each its own
        one-layer group, as ``PagedAttentionCacheView.init`` or the JSON form makes them),
        stacked into the cache's groups: a copy of every page. For small caches and tests."""
        views = list(views)
        if not views or not all(isinstance(v, PagedAttentionCacheView) for v in views):
            raise ValueError("from_views takes a non-empty list of PagedAttentionCacheView")
        meta = views[0].metadata
        for i, view in enumerate(views):
            if view.layer_index != i or view.metadata != meta:
                raise ValueError(f"views[{i}] has layer_index={view.layer_index} and "
                                 f"{'the same' if view.metadata == meta else 'different'} metadata; views must be "
                                 "layers 0..n-1 of one cache")
        if len(views) != meta.num_hidden_layers:
            raise ValueError(f"{len(views)} views for metadata with num_hidden_layers={meta.num_hidden_layers}")
        first = views[0].layout
        layout = None if first is None else PageLayout(first.mesh, meta.kv_head_mesh_axes, meta.page_mesh_axes)
        keys, values = [], []
        for group, group_layout in zip(meta.groups, group_layouts(meta, layout)):
            members = [views[i] for i in group.layers]
            odd = next((v.layer_index for v in members if v.layout != group_layout), None)
            if odd is not None:
                raise ValueError(f"views[{odd}] is laid out as {views[odd].layout}, but its layer group (layers "
                                 f"{group.span}) is laid out as {group_layout}; views must be layers of one cache")
            stack = _stacker(group_layout)
            keys.append(stack([v.key_pages for v in members]))
            values.append(stack([v.value_pages for v in members]) if group.has_values else None)
        return cls(meta, keys, values, layout)

    # ---- all layers in one jit -----------------------------------------------------------
    def write(self, keys: Any, values: Any, metadata: PagedAttentionMetadata) -> tuple[PagedAttentionCache, jax.Array]:
        """Write every layer's new tokens in one jitted, donating call: one scatter per device
        and layer group.

        keys, values: (num_layers, num_tokens, num_kv_heads, head_dim) or a sequence of
        per-layer (num_tokens, num_kv_heads, head_dim) in each layer's group geometry (None for
        a latent layer's values). ``metadata``: one for every group, or a tuple of one per group.
        Returns the updated cache (this cache's buffers are donated: do not use it afterwards)
        and the number of real tokens dropped because their slot lay outside the pool (of a
        grouped cache, the most in any one group; 0 when metadata came from the validated
        constructors).
        """
        meta = self.metadata
        n = len(meta.groups)
        slots = tuple(token_slots(group_runtime(metadata, n, g), meta, g) for g in range(n))
        counts = {np.shape(s) for s in slots}
        if len(counts) != 1 or len(next(iter(counts))) != 1:
            raise ValueError(f"metadata.slot_mapping must be 1-D (one per token) and the same length for every "
                             f"layer group, got shapes {[np.shape(s) for s in slots]}")
        num_tokens = int(np.shape(slots[0])[0])
        keys = _per_layer(keys, "keys", meta, num_tokens, values=False)
        values = _per_layer(values, "values", meta, num_tokens, values=True)
        return write_all(self, keys, values, slots)

    def copy_pages(self, src: Any, dst: Any) -> PagedAttentionCache:
        """Copy pages ``src[i] -> dst[i]`` in every layer (copy-on-write); -1 pairs are padding.
        One jitted, donating call; sources are read before destinations are written."""
        meta = self.metadata
        srcs, dsts = _group_page_ids(src, "src", meta), _group_page_ids(dst, "dst", meta)
        for g, (src, dst) in enumerate(zip(srcs, dsts)):
            where = "" if len(srcs) == 1 else f" of layer group {g}"
            if src.shape != dst.shape:
                raise ValueError(f"src{where} has shape {src.shape} but dst has shape {dst.shape}; pair them 1:1")
            per_shard = meta.groups[g].num_pages // meta.page_shards
            if meta.page_shards > 1 and isinstance(src, np.ndarray) and isinstance(dst, np.ndarray):
                # Each data-parallel replica owns a slice of the pool; a copy cannot cross slices.
                real = (src >= 0) & (dst >= 0)
                cross = real & (src // per_shard != dst // per_shard)
                if np.any(cross):
                    i = int(np.argmax(cross))
                    raise ValueError(
                        f"copy {int(src[i])} -> {int(dst[i])}{where} crosses data-parallel replicas: pages are "
                        f"split into {meta.page_shards} slices of {per_shard}; copy within a replica's slice")
        return _copy_all(self, srcs, dsts)

    def zero_pages(self, pages: Any) -> PagedAttentionCache:
        """Zero ``pages`` in every layer (scrubbing released pages); -1 entries are padding.
        ``pages`` (and ``copy_pages``' ``src`` / ``dst``): one array of ids for every layer group,
        or a tuple of one per group (groups have their own pools)."""
        return _zero_all(self, _group_page_ids(pages, "pages", self.metadata))


PagedAttentionCache._to_dict = staticmethod(cache_json.cache_to_dict)
PagedAttentionCache._from_dict = staticmethod(cache_json.cache_from_dict)


def _replaced(items: tuple[Any, ...], g: int, value: Any) -> tuple[Any, ...]:
    return items[:g] + (value,) + items[g + 1:]


def _refuse_donated(view: PagedAttentionCacheView, name: str) -> None:
    if any(not isinstance(a, jax.core.Tracer) and a.is_deleted()
           for a in jax.tree.leaves((view.group_key_pages, view.group_value_pages))):
        raise ValueError(
            f"{name}: the view's page arrays were given to a later write (taken before another write to its "
            "group, which donated them); nothing was changed. Take each layer's view right before writing it: "
            "view = cache.views[i]; view = view.write_...(...); cache.views[i] = view")


def _set_layer_pages(k: Any, v: Any, src_k: Any, src_v: Any, src_layer: Any, dst_layer: int) -> tuple[Any, Any]:
    def put(stack: jax.Array, src: jax.Array) -> jax.Array:
        return stack.at[dst_layer].set(src[src_layer])
    return jax.tree.map(put, k, src_k), jax.tree.map(put, v, src_v)


# Copies one layer (a layer's pool, both arrays) into the group's stacks in place.
_set_layer = jax.jit(_set_layer_pages, static_argnums=5, donate_argnums=(0, 1))


# One compiled scatter per layout and shape: run eagerly, shard_map costs seconds per call.
_scatter = jax.jit(scatter_kv, static_argnames=("layout",))
_scatter_in_place = jax.jit(scatter_kv, static_argnames=("layout",), donate_argnums=(0, 1))


@partial(jax.jit, donate_argnums=0)  # public for the write benchmark and tests: cache.write without host checks
def write_all(cache: PagedAttentionCache, keys: Any, values: Any, slots: tuple[Any, ...]
              ) -> tuple[PagedAttentionCache, jax.Array]:
    """Every group's new K and V (``slots``: one array per group) in one jit: one shard_map and
    one scatter per stacked array and device."""
    def rows(x: Any, layers: tuple[int, ...]) -> jax.Array:
        if isinstance(x, tuple):
            return jnp.stack([jnp.asarray(x[i]) for i in layers])
        x = jnp.asarray(x)
        return x if layers == tuple(range(x.shape[0])) else x[np.asarray(layers)]

    meta = cache.metadata
    keys_out, values_out, dropped = [], [], []
    for g, group in enumerate(meta.groups):
        kp, vp = cache.key_pages[g], cache.value_pages[g]
        new_k = encode_tokens(rows(keys, group.layers), kp)
        new_v = None if vp is None else encode_tokens(rows(values, group.layers), vp)
        k, v = scatter_encoded((kp, vp), (new_k, new_v), slots[g], layout=cache.layout_of(g))
        keys_out.append(k)
        values_out.append(v)
        dropped.append(count_dropped(jnp.asarray(slots[g]), group.num_pages * meta.page_size))
    return PagedAttentionCache(meta, tuple(keys_out), tuple(values_out), cache.layout), jnp.max(jnp.stack(dropped))


def _apply_page_op(cache: PagedAttentionCache, *ids: tuple[jax.Array, ...], op: Any) -> PagedAttentionCache:
    keys, values = [], []
    for g in range(len(cache.metadata.groups)):
        k, v = page_op(cache.layout_of(g), op)((cache.key_pages[g], cache.value_pages[g]), *(i[g] for i in ids))
        keys.append(k)
        values.append(v)
    return PagedAttentionCache(cache.metadata, tuple(keys), tuple(values), cache.layout)


_copy_all = jax.jit(partial(_apply_page_op, op=copy_pages_local), donate_argnums=0)
_zero_all = jax.jit(partial(_apply_page_op, op=zero_pages_local), donate_argnums=0)


def _stacker(layout: PageLayout | None) -> Any:
    """A jitted stack of per-layer page pytrees into one stack laid out as ``layout``."""
    def stack(pages: list[Any]) -> Any:
        shardings = None if layout is None else jax.tree.map(lambda t: layout.sharding_for(t.ndim + 1), pages[0])
        return jax.jit(lambda ps: jax.tree.map(lambda *xs: jnp.stack(xs), *ps), out_shardings=shardings)(pages)
    return stack


def gather_kv(
    cache: PagedAttentionCache | PagedAttentionCacheView,
    layer: int,
    page_table_row: Any,
    length: int,
) -> tuple[jax.Array, jax.Array]:
    """The contiguous keys and values of one sequence, each (length, num_kv_heads, head_dim)
    of the layer's group in the logical dtype (values None for a latent group). Reads only the
    ``ceil(length / page_size)`` pages it needs."""
    if isinstance(cache, PagedAttentionCacheView):
        view = cache
    elif isinstance(cache, PagedAttentionCache):
        view = cache[layer]
    else:
        raise ValueError(f"cache must be a PagedAttentionCache or PagedAttentionCacheView, got {type(cache).__name__}")
    meta = view.metadata
    limit = meta.num_pages_per_sequence * meta.page_size
    length = integer("length", length, lo=0, hi=limit, hint=f"static; a sequence holds at most {limit} tokens")
    row = page_table_row
    if not isinstance(row, jax.Array):  # host data: every page it needs checked here
        row = page_ids("page_table_row", row, num_pages=view.layer_group.num_pages, ndim=1, pad="unassigned")
    if np.ndim(row) != 1:
        raise ValueError(f"page_table_row must be 1-D, got shape {np.shape(row)}")
    needed = math.ceil(length / meta.page_size)
    if needed > np.shape(row)[0]:
        raise ValueError(f"length={length} needs {needed} pages but page_table_row has {np.shape(row)[0]}")
    if isinstance(row, np.ndarray) and np.any(row[:needed] < 0):
        i = int(np.argmax(row[:needed] < 0))
        raise ValueError(f"page_table_row[{i}] = -1 is unassigned but is needed for length={length}")
    # A traced or device row is bounded inside the read: a page outside the pool reads zeros.
    return _gather(view, jnp.asarray(row, jnp.int32)[:needed], length)


@partial(jax.jit, static_argnums=2)
def _gather(view: PagedAttentionCacheView, ids: jax.Array, length: int) -> tuple[jax.Array, jax.Array]:
    def read(pages: Any) -> jax.Array | None:
        if pages is None:
            return None
        picked = read_pages(pages, ids, view.dtype, view.layer)  # (heads, n, page_size, head_dim)
        heads, dim = picked.shape[0], picked.shape[-1]
        return jnp.transpose(picked, (1, 2, 0, 3)).reshape(-1, heads, dim)[:length]

    return read(view.group_key_pages), read(view.group_value_pages)


# ---- helpers ------------------------------------------------------------------------------
def group_layouts(meta: PagedAttentionCacheMetaData, layout: PageLayout | None) -> tuple[PageLayout | None, ...]:
    """Each layer group's placement: the cache's mesh and page split, the group's kv-head split."""
    if layout is None:
        return (None,) * len(meta.groups)
    return tuple(layout if g.kv_head_mesh_axes is None else dataclasses.replace(layout, head_axes=g.kv_head_mesh_axes)
                 for g in meta.groups)


def _checked_layout(
    mesh: Mesh,
    dtype: Any,
    metadata: PagedAttentionCacheMetaData,
    partition_manager: PartitionManager | None,
    quantizer: str | Quantizer | None,
) -> tuple[PagedAttentionCacheMetaData, PageLayout, Any]:
    """The metadata completed for ``mesh`` (dtype and kv-head layouts where it leaves them
    open), the cache-wide placement, and ``templates(g, layers=None)``: the key and value page
    templates (shapes, storage dtypes; None for a latent group's values) of group ``g``'s stack
    (of ``layers`` layers, default the group's). Anything the metadata does fix must agree: a
    different dtype, quantizer or split would change the bytes per device the pool was sized
    for. Mesh axes of size 1 split nothing and are ignored."""
    if not isinstance(metadata, PagedAttentionCacheMetaData):
        raise ValueError(f"metadata must be a PagedAttentionCacheMetaData, got {type(metadata).__name__}")
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

    def planned(num_kv_heads: int) -> Any:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ShardingAdjustedWarning)
            plan = plan_layout(mesh, num_kv_heads=num_kv_heads, partition_manager=partition_manager,
                               emit_warnings=True)
        for w in caught:
            warnings.warn(str(w.message), ShardingAdjustedWarning, stacklevel=5)
        return plan

    def splitting(axes: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(a for a in axes if mesh.shape.get(a, 1) > 1)

    def check(what: str, plan: Any, head_axes: Any, head_shards: Any) -> None:
        got = (splitting(plan.kv_head_mesh_axes), plan.kv_head_shards, splitting(plan.page_mesh_axes),
               plan.page_shards)
        want = (splitting(head_axes) if head_axes is not None else got[0],
                head_shards if head_shards is not None else plan.kv_head_shards,
                splitting(metadata.page_mesh_axes), metadata.page_shards)
        if got != want:
            raise ValueError(
                f"the mesh and partition manager split {what} as (kv_head axes, shards, page axes, shards) = "
                f"{got}, but the metadata was sized for {want}; create the metadata with this mesh and partition "
                "manager")

    plan = planned(metadata.num_kv_heads)
    check("the pages", plan, metadata.kv_head_mesh_axes, metadata.kv_head_shards)
    if metadata.kv_head_mesh_axes is None:
        metadata = metadata.replace(kv_head_mesh_axes=plan.kv_head_mesh_axes, kv_head_shards=plan.kv_head_shards)
    if not metadata.is_uniform:
        groups = []
        for g in metadata.groups:
            group_plan = plan if g.num_kv_heads == metadata.num_kv_heads else planned(g.num_kv_heads)
            check(f"the pages of layers {g.span}", group_plan, g.kv_head_mesh_axes, g.kv_head_shards)
            if g.kv_head_mesh_axes is None:
                g = dataclasses.replace(g, kv_head_mesh_axes=group_plan.kv_head_mesh_axes,
                                        kv_head_shards=group_plan.kv_head_shards)
            groups.append(g)
        metadata = metadata.replace(layer_groups=tuple(groups))
    resolved = metadata.replace(dtype=dt)
    layout = PageLayout(mesh=mesh, head_axes=resolved.kv_head_mesh_axes, page_axes=resolved.page_mesh_axes)
    platform = mesh.devices.flat[0].platform

    def templates(g: int, layers: int | None = None) -> tuple[Any, Any]:
        group = resolved.groups[g]
        if layers is not None:
            group = dataclasses.replace(group, layers=tuple(range(layers)))
        return group_page_templates(resolved, group, platform)

    return resolved, layout, templates


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


def _per_layer(x: Any, name: str, meta: PagedAttentionCacheMetaData, num_tokens: int, *, values: bool) -> Any:
    """Check per-layer new keys (or values) without slicing them on the host: a stacked array
    stays one array (sliced inside the jit, checked once per group), a sequence stays a tuple
    (checked per layer). Latent groups take no values: None in their layers' places, or None
    for all when every group is latent."""
    latent_only = values and not any(g.has_values for g in meta.groups)
    if x is None and latent_only:
        return None
    if isinstance(x, (list, tuple)):
        count, items = len(x), tuple(x)
    elif np.ndim(x) == 4:
        count, items = int(np.shape(x)[0]), None
    else:
        raise ValueError(
            f"{name} must be (num_layers, num_tokens, num_kv_heads, head_dim) or a sequence of "
            f"per-layer arrays{' (None for latent layers)' if values else ''}, got shape {np.shape(x)}")
    if count != meta.num_hidden_layers:
        raise ValueError(
            f"{name} holds {count} layers but the cache has num_hidden_layers={meta.num_hidden_layers}"
        )
    if items is None:  # one array for every layer: every group must take its shape
        if values and any(not g.has_values for g in meta.groups):
            raise ValueError(f"{name} is one array for every layer, but layers "
                             f"{[g.span for g in meta.groups if not g.has_values]} are latent and take no values; "
                             "give a sequence of per-layer arrays with None for latent layers")
        one = jax.ShapeDtypeStruct(tuple(np.shape(x))[1:], x.dtype)
        checks = [(g, one, name) for g in range(len(meta.groups))]
    else:
        checks = [(meta.group_of(i)[0], item, f"{name}[{i}]") for i, item in enumerate(items)]
    for g, item, label in checks:
        check_token_rows(item, metadata=meta, num_tokens=num_tokens, group=g, values=values, name=label)
    return items if items is not None else x


def _group_page_ids(ids: Any, name: str, meta: PagedAttentionCacheMetaData) -> tuple[Any, ...]:
    """Page ids for every layer group: one array for all (checked against every group's
    pool), or a tuple of one per group. Host ids checked (-1 padding); device ids are bounded
    inside the copy/zeroing."""
    n = len(meta.groups)
    if isinstance(ids, tuple):
        if len(ids) != n:
            raise ValueError(f"{name} holds {len(ids)} arrays of page ids but the cache has {n} layer group(s); "
                             "give one array for all groups or one per group")
        return tuple(_page_ids(x, name if n == 1 else f"{name}[{g}]", meta.groups[g].num_pages)
                     for g, x in enumerate(ids))
    return tuple(_page_ids(ids, name, g.num_pages) for g in meta.groups)


def _page_ids(ids: Any, name: str, num_pages: int) -> Any:
    if isinstance(ids, jax.Array):
        if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name} must be a 1-D array of integer page ids, got {ids.dtype} of shape {ids.shape}")
        return ids.astype(jnp.int32)
    return page_ids(name, ids, num_pages=num_pages, ndim=1)


__all__ = ["PagedAttentionCache", "PagedAttentionCacheView", "gather_kv"]
