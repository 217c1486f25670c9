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
from easykv.spec.metadata import PagedAttentionCacheMetaData, canonical_dtype, plan_layout
from easykv.storage.pages import (
    PageLayout,
    allocate_pages,
    encode_tokens,
    page_template,
    read_pages,
    copy_pages_local,
    page_op,
    zero_pages_local,
)
from easykv.quantization import Quantizer, get_quantizer
from easykv.runtime import PagedAttentionMetadata
from easykv.storage.writes import (
    check_new_tokens,
    check_slots_on_host,
    count_dropped,
    scatter_encoded,
    scatter_kv,
    token_slots,
)
from easykv.validation import integer, page_ids
from sharding import PartitionManager, ShardingAdjustedWarning


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
    meta_fields=["metadata", "layer_index", "layout"],
)
@dataclasses.dataclass(eq=False)
class PagedAttentionCacheView(_EasyDeLForms):
    """One layer of a layer group's stacked pages.

    group_key_pages, group_value_pages: the group's pages, ``(layers_in_group, num_kv_heads,
    num_pages_per_layer, page_size, kv_head_dim_size)`` in the storage dtype of the platform;
    ``layer`` is this layer's index in the group (an int, or a traced index when a model scans
    over the group's layers: see :meth:`at_layer`); ``layer_index`` the layer's index in the
    model (None for a view whose ``layer`` is traced). ``key_pages`` / ``value_pages`` are the
    layer's slice ``(num_kv_heads, num_pages_per_layer, page_size, kv_head_dim_size)``, as in
    EasyDeL; writes and attention index the stack instead, so they never copy a layer's pool.
    ``layout`` says how the pages are split over the mesh (None: one device, no shard_map).

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

    def __post_init__(self) -> None:
        # The stacks this view was taken from: writing it, or putting it back, into a cache whose
        # arrays have moved on since (another layer written) would lose that write: refused.
        self._base = (self.group_key_pages, self.group_value_pages)
        # The cache (and group) this view was taken from with cache[i]: its writes go through to it.
        self._owner: tuple[PagedAttentionCache, int] | None = None

    @property
    def dtype(self) -> np.dtype:
        """Logical dtype of the cached keys and values."""
        return self.metadata.dtype

    @property
    def key_pages(self) -> Any:
        """This layer's key pages ``(num_kv_heads, num_pages, page_size, head_dim)`` (storage
        dtype): a slice of the stack (outside jit, a copy; attention reads the stack itself)."""
        return jax.tree.map(lambda a: a[self.layer], self.group_key_pages)

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
        index = None
        if self.layer_index is not None and not isinstance(self.layer, jax.core.Tracer):
            index = self.layer_index - int(self.layer) + i  # a group of consecutive layers (one group today)
        return dataclasses.replace(self, layer=i, layer_index=index)

    @classmethod
    def init(cls, mesh: Mesh, dtype: Any, metadata: PagedAttentionCacheMetaData, layer_index: int,
             partition_manager: PartitionManager | None = None,
             quantizer: str | Quantizer | None = None) -> PagedAttentionCacheView:
        """Allocate one layer's pages (a group of one layer) directly on the devices of ``mesh``."""
        if not isinstance(metadata, PagedAttentionCacheMetaData):
            raise ValueError(f"metadata must be a PagedAttentionCacheMetaData, got {type(metadata).__name__}")
        layer_index = integer("layer_index", layer_index, lo=0, hi=metadata.num_hidden_layers - 1)
        metadata, layout, make_template = _checked_layout(mesh, dtype, metadata, partition_manager, quantizer)
        _check_fits(mesh, metadata, layers=1)
        template = make_template(1)
        k, v = allocate_pages((template, template), layout)
        return cls(metadata=metadata, layer_index=layer_index, group_key_pages=k, group_value_pages=v,
                   layer=0, layout=layout)

    def concatenate_to_cache(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "a paged cache has no contiguous buffer to concatenate into; use "
            "write_prefill_to_cache / write_decodes_to_cache / write_tokens"
        )

    # ---- writes (EasyDeL's: they update this view and return it) -------------------------------
    def write_tokens(self, key: Any, value: Any, slots: Any) -> PagedAttentionCacheView:
        """Write token rows (num_tokens, num_kv_heads, head_dim) at ``slots`` (-1: padding)."""
        return self._write(key, value, check_slots_on_host(slots, self.metadata.tokens_per_layer))

    def write_prefill_to_cache(self, key: Any, value: Any, metadata: PagedAttentionMetadata) -> PagedAttentionCacheView:
        """key, value: (padded_prefill_len, num_kv_heads, head_dim) at metadata.prefill_position."""
        if not metadata.is_prefill_mode():
            raise ValueError("write_prefill_to_cache needs prefill metadata (PagedAttentionMetadata.for_prefill)")
        return self._write(key, value, token_slots(metadata, self.metadata))

    def write_decodes_to_cache(self, key: Any, value: Any, metadata: PagedAttentionMetadata) -> PagedAttentionCacheView:
        """key, value: (batch, num_kv_heads, head_dim), one token per sequence at decodes_position."""
        if not metadata.is_decode_mode():
            raise ValueError("write_decodes_to_cache needs decode metadata (PagedAttentionMetadata.for_decode)")
        return self._write(key, value, token_slots(metadata, self.metadata))

    def write_mixed_to_cache(self, key: Any, value: Any, metadata: PagedAttentionMetadata) -> PagedAttentionCacheView:
        """key, value: (num_tokens, num_kv_heads, head_dim) at metadata.slot_mapping."""
        if not metadata.is_mixed_mode():
            raise ValueError("write_mixed_to_cache needs mixed metadata (PagedAttentionMetadata.for_mixed)")
        return self._write(key, value, token_slots(metadata, self.metadata))

    def _write(self, key: Any, value: Any, slots: Any) -> PagedAttentionCacheView:
        """``write_tokens`` on slots already checked (host) or bounded in the scatter (device)."""
        if np.ndim(slots) != 1:
            raise ValueError(f"slots must be 1-D (one per token), got shape {np.shape(slots)}")
        check_new_tokens(key, value, metadata=self.metadata, num_tokens=int(np.shape(slots)[0]))
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

    key_pages, value_pages: one array per layer group, ``(layers_in_group, num_kv_heads,
    num_pages_per_layer, page_size, kv_head_dim_size)`` in the storage dtype (``QuantizedPages``
    when quantized). This easykv stores one group holding every layer (uniform caches, and
    caches whose one group is sliding or chunked). ``cache[i]`` / ``cache.views[i]`` is layer
    ``i``'s view; ``cache[i] = view`` puts a written view back.
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
            want = (group.num_layers, meta.num_kv_heads, meta.num_pages_per_layer, meta.page_size)
            for name, x in (("key_pages", k), ("value_pages", v)):
                got = tuple(np.shape(jax.tree.leaves(x)[0]))[:4]
                if got != want:
                    raise ValueError(f"{name}[{g}] has shape {got} (leading dims) but layer group {g} (layers "
                                     f"{group.span}) needs (layers, kv heads, pages, page_size) = {want}")

    @property
    def views(self) -> CacheViews:
        return CacheViews(self)

    def __len__(self) -> int:
        return self.metadata.num_hidden_layers

    def _locate(self, layer: Any) -> tuple[int, int, int]:
        n = self.metadata.num_hidden_layers
        i = integer("layer", layer, lo=-n, hi=n - 1, hint=f"the cache has {n} layers") % n
        for g, group in enumerate(self.metadata.groups):
            if i in group.layers:
                return i, g, group.layers.index(i)
        raise AssertionError(f"layer {i} is in no layer group of a checked metadata: a bug in easykv")

    def __getitem__(self, layer: int) -> PagedAttentionCacheView:
        i, g, j = self._locate(layer)
        view = PagedAttentionCacheView(self.metadata, i, self.key_pages[g], self.value_pages[g], j, self.layout)
        view._owner = (self, g)
        return view

    def __setitem__(self, layer: int, view: Any) -> None:
        i, g, j = self._locate(layer)
        if not isinstance(view, PagedAttentionCacheView):
            raise ValueError(f"cache.views[{i}] must be a PagedAttentionCacheView, got {type(view).__name__}")
        differs = [name for name, a, b in (("layer_index", view.layer_index, i), ("metadata", view.metadata,
                                                                                 self.metadata),
                                           ("layout", view.layout, self.layout)) if a != b]
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
        view = PagedAttentionCacheView(self.metadata, None, self.key_pages[g], self.value_pages[g], 0, self.layout)
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
        if view.metadata != self.metadata or view.layout != self.layout:
            raise ValueError("update takes a view of this cache, but the view's metadata or layout differs from it")
        size = int(np.shape(jax.tree.leaves(view.group_key_pages)[0])[0])
        g = next((g for g, k in enumerate(self.key_pages) if np.shape(jax.tree.leaves(k)[0])[0] == size), None)
        if g is None:
            raise ValueError(f"the view's group holds {size} layers; no layer group of this cache does")
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
        own shard."""
        metadata, layout, make_template = _checked_layout(mesh, dtype, metadata, partition_manager, quantizer)
        _check_fits(mesh, metadata, layers=metadata.num_hidden_layers)
        templates = tuple(make_template(g.num_layers) for g in metadata.groups)
        keys, values = allocate_pages((templates, templates), layout)
        return cls(metadata, keys, values, layout)

    @classmethod
    def from_views(cls, views: Any) -> PagedAttentionCache:
        """A cache of per-layer views (layers 0..n-1 of one metadata and layout, each its own
        one-layer group, as ``PagedAttentionCacheView.init`` or the JSON form makes them),
        stacked into the cache's groups: a copy of every page. For small caches and tests."""
        views = list(views)
        if not views or not all(isinstance(v, PagedAttentionCacheView) for v in views):
            raise ValueError("from_views takes a non-empty list of PagedAttentionCacheView")
        meta, layout = views[0].metadata, views[0].layout
        for i, view in enumerate(views):
            if view.layer_index != i or view.metadata != meta or view.layout != layout:
                raise ValueError(f"views[{i}] has layer_index={view.layer_index} and "
                                 f"{'the same' if view.metadata == meta else 'different'} metadata; views must be "
                                 "layers 0..n-1 of one cache")
        if len(views) != meta.num_hidden_layers:
            raise ValueError(f"{len(views)} views for metadata with num_hidden_layers={meta.num_hidden_layers}")
        stack = jax.jit(lambda pages: jax.tree.map(lambda *xs: jnp.stack(xs), *pages),
                        out_shardings=None if layout is None else jax.tree.map(
                            lambda t: layout.sharding_for(t.ndim + 1), views[0].key_pages))
        keys, values = [], []
        for group in meta.groups:
            keys.append(stack([views[i].key_pages for i in group.layers]))
            values.append(stack([views[i].value_pages for i in group.layers]))
        return cls(meta, keys, values, layout)

    # ---- all layers in one jit -----------------------------------------------------------
    def write(self, keys: Any, values: Any, metadata: PagedAttentionMetadata) -> tuple[PagedAttentionCache, jax.Array]:
        """Write every layer's new tokens in one jitted, donating call: one scatter per device
        and layer group.

        keys, values: (num_layers, num_tokens, num_kv_heads, head_dim) or a sequence of
        per-layer (num_tokens, num_kv_heads, head_dim). Returns the updated cache (this cache's
        buffers are donated: do not use it afterwards) and the number of real tokens dropped
        because their slot lay outside the pool (0 when metadata came from the validated
        constructors).
        """
        meta = self.metadata
        slots = token_slots(metadata, meta)
        if np.ndim(slots) != 1:
            raise ValueError(f"metadata.slot_mapping must be 1-D (one per token), got shape {np.shape(slots)}")
        num_tokens = int(np.shape(slots)[0])
        keys = _per_layer(keys, "keys", meta, num_tokens)
        values = _per_layer(values, "values", meta, num_tokens)
        return write_all(self, keys, values, slots)

    def copy_pages(self, src: Any, dst: Any) -> PagedAttentionCache:
        """Copy pages ``src[i] -> dst[i]`` in every layer (copy-on-write); -1 pairs are padding.
        One jitted, donating call; sources are read before destinations are written."""
        meta = self.metadata
        src, dst = _page_ids(src, "src", meta), _page_ids(dst, "dst", meta)
        if src.shape != dst.shape:
            raise ValueError(f"src has shape {src.shape} but dst has shape {dst.shape}; pair them 1:1")
        if meta.page_shards > 1 and isinstance(src, np.ndarray) and isinstance(dst, np.ndarray):
            # Each data-parallel replica owns a slice of the pool; a copy cannot cross slices.
            real = (src >= 0) & (dst >= 0)
            cross = real & (src // meta.pages_per_shard != dst // meta.pages_per_shard)
            if np.any(cross):
                i = int(np.argmax(cross))
                raise ValueError(
                    f"copy {int(src[i])} -> {int(dst[i])} crosses data-parallel replicas: pages are "
                    f"split into {meta.page_shards} slices of {meta.pages_per_shard}; copy within a "
                    "replica's slice"
                )
        return _copy_all(self, src, dst)

    def zero_pages(self, pages: Any) -> PagedAttentionCache:
        """Zero ``pages`` in every layer (scrubbing released pages); -1 entries are padding."""
        return _zero_all(self, _page_ids(pages, "pages", self.metadata))


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
def write_all(cache: PagedAttentionCache, keys: Any, values: Any, slots: Any) -> tuple[PagedAttentionCache, jax.Array]:
    # Every group's K and V in one shard_map: one scatter per array and device for the step.
    def rows(x: Any, layers: tuple[int, ...]) -> jax.Array:
        if isinstance(x, tuple):
            return jnp.stack([jnp.asarray(x[i]) for i in layers])
        x = jnp.asarray(x)
        return x if layers == tuple(range(x.shape[0])) else x[np.asarray(layers)]

    pages = tuple(zip(cache.key_pages, cache.value_pages))
    new = tuple((encode_tokens(rows(keys, g.layers), kp), encode_tokens(rows(values, g.layers), vp))
                for g, (kp, vp) in zip(cache.metadata.groups, pages))
    out = scatter_encoded(pages, new, slots, layout=cache.layout)
    return (PagedAttentionCache(cache.metadata, tuple(k for k, _ in out), tuple(v for _, v in out), cache.layout),
            count_dropped(jnp.asarray(slots), cache.metadata.tokens_per_layer))


def _apply_page_op(cache: PagedAttentionCache, *ids: jax.Array, op: Any) -> PagedAttentionCache:
    keys, values = page_op(cache.layout, op)((cache.key_pages, cache.value_pages), *ids)
    return PagedAttentionCache(cache.metadata, keys, values, cache.layout)


_copy_all = jax.jit(partial(_apply_page_op, op=copy_pages_local), donate_argnums=0)
_zero_all = jax.jit(partial(_apply_page_op, op=zero_pages_local), donate_argnums=0)


def gather_kv(
    cache: PagedAttentionCache | PagedAttentionCacheView,
    layer: int,
    page_table_row: Any,
    length: int,
) -> tuple[jax.Array, jax.Array]:
    """The contiguous keys and values of one sequence, each (length, num_kv_heads, head_dim)
    in the logical dtype. Reads only the ``ceil(length / page_size)`` pages it needs."""
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
        row = page_ids("page_table_row", row, num_pages=meta.num_pages_per_layer, ndim=1, pad="unassigned")
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
    meta = view.metadata

    def read(pages: Any) -> jax.Array:
        picked = read_pages(pages, ids, meta.dtype, view.layer)  # (heads, n, page_size, head_dim)
        tokens = jnp.transpose(picked, (1, 2, 0, 3)).reshape(-1, meta.num_kv_heads, meta.kv_head_dim_size)
        return tokens[:length]

    return read(view.group_key_pages), read(view.group_value_pages)


# ---- helpers ------------------------------------------------------------------------------
def _page_shape(meta: PagedAttentionCacheMetaData, layers: int) -> tuple[int, int, int, int, int]:
    return (layers, meta.num_kv_heads, meta.num_pages_per_layer, meta.page_size, meta.kv_head_dim_size)


def _checked_layout(
    mesh: Mesh,
    dtype: Any,
    metadata: PagedAttentionCacheMetaData,
    partition_manager: PartitionManager | None,
    quantizer: str | Quantizer | None,
) -> tuple[PagedAttentionCacheMetaData, PageLayout, Any]:
    """The metadata completed for ``mesh`` (dtype and kv-head layout where it leaves them
    open), the placement, and the page template of a stack of ``n`` layers (``template(n)``:
    shapes, storage dtypes). Anything the
    metadata does fix must agree: a different dtype, quantizer or split would change the bytes
    per device the pool was sized for. Mesh axes of size 1 split nothing and are ignored."""
    if not isinstance(metadata, PagedAttentionCacheMetaData):
        raise ValueError(f"metadata must be a PagedAttentionCacheMetaData, got {type(metadata).__name__}")
    metadata.require_uniform("the page storage", windows=True)
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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ShardingAdjustedWarning)
        plan = plan_layout(
            mesh, num_kv_heads=metadata.num_kv_heads, partition_manager=partition_manager, emit_warnings=True
        )
    for w in caught:
        warnings.warn(str(w.message), ShardingAdjustedWarning, stacklevel=4)

    def splitting(axes: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(a for a in axes if mesh.shape.get(a, 1) > 1)

    head_axes, page_axes = splitting(plan.kv_head_mesh_axes), splitting(plan.page_mesh_axes)
    got = (head_axes, plan.kv_head_shards, page_axes, plan.page_shards)
    want = (splitting(metadata.kv_head_mesh_axes) if metadata.kv_head_mesh_axes is not None else head_axes,
            metadata.kv_head_shards if metadata.kv_head_shards is not None else plan.kv_head_shards,
            splitting(metadata.page_mesh_axes), metadata.page_shards)
    if got != want:
        raise ValueError(
            "the mesh and partition manager split the pages as (kv_head axes, shards, page axes, "
            f"shards) = {got}, but the metadata was sized for {want}; create the metadata with this "
            "mesh and partition manager"
        )
    if metadata.kv_head_mesh_axes is None:
        metadata = metadata.replace(kv_head_mesh_axes=plan.kv_head_mesh_axes, kv_head_shards=plan.kv_head_shards)
    resolved = metadata.replace(dtype=dt)
    layout = PageLayout(mesh=mesh, head_axes=resolved.kv_head_mesh_axes, page_axes=resolved.page_mesh_axes)
    platform = mesh.devices.flat[0].platform
    return resolved, layout, lambda layers: page_template(_page_shape(resolved, layers), resolved.dtype, q, platform)


def _check_fits(mesh: Mesh, metadata: PagedAttentionCacheMetaData, *, layers: int) -> None:
    """Refuse, before allocating, pages that cannot fit the devices' free memory (a metadata
    written for a bigger machine, or hand-edited): a precise error instead of an allocator
    failure or, on CPU, the kernel's OOM killer."""
    need = metadata.page_bytes_per_device * metadata.pages_per_shard * layers
    try:
        budget = device_memory_budget(list(mesh.devices.flat), 1.0)
    except MemoryUnavailableError:
        return  # the devices do not say; then only the allocation itself can tell
    if need > budget.per_device_bytes:
        raise ValueError(
            f"the pages need {need} bytes per device ({layers} layer(s) of {metadata.pages_per_shard} pages x "
            f"{metadata.page_bytes_per_device} bytes) but the devices have {budget.per_device_bytes} free "
            f"({budget.detail}); create the metadata for this machine (PagedAttentionCacheMetaData.create) or "
            "give it fewer pages")


def _per_layer(x: Any, name: str, meta: PagedAttentionCacheMetaData, num_tokens: int) -> Any:
    """Check per-layer new tokens without slicing them on the host: a stacked array stays one
    array (sliced inside the jit, checked once), a sequence stays a tuple (checked per layer)."""
    if isinstance(x, (list, tuple)):
        count, layers = len(x), tuple(x)
    elif np.ndim(x) == 4:
        count, layers = int(np.shape(x)[0]), (jax.ShapeDtypeStruct(tuple(np.shape(x))[1:], x.dtype),)
    else:
        raise ValueError(
            f"{name} must be (num_layers, num_tokens, num_kv_heads, head_dim) or a sequence of "
            f"per-layer arrays, got shape {np.shape(x)}"
        )
    if count != meta.num_hidden_layers:
        raise ValueError(
            f"{name} holds {count} layers but the cache has num_hidden_layers={meta.num_hidden_layers}"
        )
    for layer in layers:
        check_new_tokens(layer, layer, metadata=meta, num_tokens=num_tokens, name=name)
    return tuple(x) if isinstance(x, (list, tuple)) else x


def _page_ids(ids: Any, name: str, meta: PagedAttentionCacheMetaData) -> Any:
    """Host page ids checked (-1 padding); device ids are bounded inside the copy/zeroing."""
    if isinstance(ids, jax.Array):
        if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name} must be a 1-D array of integer page ids, got {ids.dtype} of shape {ids.shape}")
        return ids.astype(jnp.int32)
    return page_ids(name, ids, num_pages=meta.num_pages_per_layer, ndim=1)


__all__ = ["PagedAttentionCache", "PagedAttentionCacheView", "gather_kv"]
