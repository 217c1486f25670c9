"""One layer's pages, as EasyDeL's models see them: `PagedAttentionCacheView`, and
``cache.views`` (`CacheViews`), the list of them over a cache's stacked arrays.

A view is a pytree whose only leaves are its group's page arrays (metadata, layer index and
placement are static), so jit can take and return it and donation reuses its buffers. Pages are
``(num_kv_heads, num_pages_per_layer, page_size, head_dim)`` per layer; on CPU the bf16/f16
pages are stored as raw bits (see ``pages.py``): ``view.dtype`` is the logical dtype.

A view written through ``cache[i]`` writes through to the cache it was taken from; it knows that
cache only by the two calls it makes on it (``_check_current``, ``_put_group``), so this module
never imports the cache's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any, NoReturn, Protocol, SupportsIndex, cast, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.typing import DTypeLike
from numpy.typing import ArrayLike

from easykv.quantization import Quantizer
from easykv.sharding import PartitionManager
from easykv.spec.groups import LayerGroup, known_size
from easykv.spec.metadata import PagedAttentionCacheMetaData, known_dtype
from easykv.step.checks import Array
from easykv.step.metadata import group_runtime, step_form
from easykv.storage.cache_json import EasyDeLForms, view_from_dict, view_to_dict
from easykv.storage.pages import Layer, PageLayout, StoredPages, allocate_pages
from easykv.storage.placement import check_fits, checked_layout, group_layouts
from easykv.storage.writes import WriteMetadata, check_new_tokens, check_slots_on_host, scatter_kv, token_slots
from easykv.validation import integer


class _Cache(Protocol):
    """What a view (and `CacheViews`) needs of the cache it was taken from: this module never
    imports the cache's (`PagedAttentionCache` has all of it)."""

    @property
    def metadata(self) -> PagedAttentionCacheMetaData: ...

    # ``layer``: anything int-like; the cache checks it (`validation.integer`).
    def __getitem__(self, layer: SupportsIndex) -> PagedAttentionCacheView: ...

    def __setitem__(self, layer: SupportsIndex, view: PagedAttentionCacheView) -> None: ...

    def _check_current(self, g: int, view: PagedAttentionCacheView, name: str) -> None: ...

    def _put_group(self, g: int, view: PagedAttentionCacheView) -> None: ...


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["group_key_pages", "group_value_pages", "layer"],
    meta_fields=["metadata", "layer_index", "layout", "group"],
)
@dataclasses.dataclass(eq=False)
class PagedAttentionCacheView(EasyDeLForms):
    """One layer of a layer group's stacked pages.

    ``key_pages`` / ``value_pages`` are the layer's slice ``(num_kv_heads, num_pages, page_size,
    head_dim)``, as in EasyDeL (a latent group's ``value_pages`` are None); writes and attention
    index the stack instead, so they never copy a layer's pool.

    Attributes:
      metadata: the cache's `PagedAttentionCacheMetaData`.
      layer_index: the layer's index in the model (None for a view whose ``layer`` is traced).
      group_key_pages: the group's key pages, ``(layers_in_group, num_kv_heads, num_pages,
        page_size, head_dim)`` in the storage dtype of the platform (`QuantizedPages` when
        quantized).
      group_value_pages: as ``group_key_pages``, with the value head dim; None for a latent group.
      layer: this layer's index in the group: an int, or a traced index when a model scans over
        the group's layers (see :meth:`at_layer`).
      layout: how the pages are split over the mesh (`PageLayout`; None: one device, no
        shard_map).
      group: the layer group's index in the metadata (its geometry: ``metadata.groups[group]``).

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
    group_key_pages: StoredPages
    group_value_pages: StoredPages | None
    layer: Layer = 0
    layout: PageLayout | None = None
    group: int = 0

    def __post_init__(self) -> None:
        # The stacks this view was taken from: writing it, or putting it back, into a cache whose
        # arrays have moved on since (another layer written) would lose that write: refused.
        self._base = (self.group_key_pages, self.group_value_pages)
        # The cache (and group) this view was taken from with cache[i]: its writes go through to it.
        self._owner: tuple[_Cache, int] | None = None

    @property
    def dtype(self) -> np.dtype:
        """Logical dtype of the cached keys and values (this layer's group's)."""
        return known_dtype(self.metadata.group_dtype(self.layer_group))

    @property
    def key_pages(self) -> StoredPages:
        """This layer's key pages ``(num_kv_heads, num_pages, page_size, head_dim)`` (storage
        dtype): a slice of the stack (outside jit, a copy; attention reads the stack itself)."""
        pages: StoredPages = jax.tree.map(lambda a: a[self.layer], self.group_key_pages)
        return pages

    @property
    def layer_group(self) -> LayerGroup:
        """The layer group this view's layer belongs to: its attention kind and geometry."""
        return self.metadata.groups[self.group]

    @property
    def value_pages(self) -> StoredPages | None:
        """This layer's value pages, as ``key_pages``; None for a latent group (it stores none)."""
        pages: StoredPages | None = jax.tree.map(lambda a: a[self.layer], self.group_value_pages)
        return pages

    def at_layer(self, layer: SupportsIndex | jax.Array) -> PagedAttentionCacheView:
        """The view of layer ``layer`` (index in the group) of the same group arrays: an int, or
        a traced index for a model that runs the group's layers under ``lax.scan`` (carry
        ``cache.group_view(g)``, call ``view.at_layer(i)`` each iteration, write and attend,
        then ``cache.update(view)``; see docs/pages.md, "Scanned models").

        Args:
          layer: the layer's index in the group: an int in range, or a traced integer scalar.
        """
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
    def init(cls, mesh: Mesh, dtype: DTypeLike, metadata: PagedAttentionCacheMetaData, layer_index: int,
             partition_manager: PartitionManager | None = None,
             quantizer: str | Quantizer | None = None) -> PagedAttentionCacheView:
        """Allocate one layer's pages (a stack of one layer, in its group's geometry) directly on
        the devices of ``mesh``.

        Args:
          mesh: the `Mesh` whose devices hold the pages.
          dtype: the cache's logical dtype, as in `PagedAttentionCache.init_cache`.
          metadata: the cache's `PagedAttentionCacheMetaData`, completed for ``mesh`` as in
            `PagedAttentionCache.init_cache`.
          layer_index: the layer's index in the model, ``0 .. num_hidden_layers - 1``.
          partition_manager: the `PartitionManager` for ``mesh`` (None: the default rules).
          quantizer: a quantizer name or object (None: ``"none"``); must be
            ``metadata.quantization``.
        """
        if not isinstance(metadata, PagedAttentionCacheMetaData):
            raise ValueError(f"metadata must be a PagedAttentionCacheMetaData, got {type(metadata).__name__}")
        layer_index = integer("layer_index", layer_index, lo=0, hi=metadata.num_hidden_layers - 1)
        metadata, layout, templates = checked_layout(mesh, dtype, metadata, partition_manager, quantizer)
        layouts = group_layouts(metadata, layout)
        g, _ = metadata.group_of(layer_index)
        group = metadata.groups[g]
        need = metadata.group_page_bytes(group) * known_size(group.num_pages) // metadata.page_shards
        check_fits(mesh, metadata, need, f"1 layer of layers {group.span}")
        k, v = allocate_pages(templates(g, layers=1), layouts[g])
        return cls(metadata=metadata, layer_index=layer_index, group_key_pages=k, group_value_pages=v,
                   layer=0, layout=layouts[g], group=g)

    def to_dict(self) -> dict[str, Any]:
        """EasyDeL's dict form (JSON is this dict): the metadata, the layer index and this
        layer's pages."""
        return view_to_dict(self)

    @classmethod
    def from_dict(cls, data: object, *, mesh: Mesh | None = None,
                  partition_manager: PartitionManager | None = None) -> PagedAttentionCacheView:
        """Rebuilt on ``mesh`` (laid out as the metadata says), or on one device without one.

        Args:
          data: the dict `to_dict` wrote (``SerializationError`` for anything else).
          mesh: the `Mesh` to place the pages on; None: the first of ``jax.devices()``.
          partition_manager: the `PartitionManager` that lays the pages out on ``mesh`` (None:
            the default rules; unused without a mesh).
        """
        view: PagedAttentionCacheView = view_from_dict(cls, data, mesh, partition_manager)
        return view

    def concatenate_to_cache(self, *args: object, **kwargs: object) -> None:
        """EasyDeL's contiguous-cache write: always raises NotImplementedError (a paged cache has
        no contiguous buffer); use the ``write_*`` methods.

        Args:
          *args: ignored.
          **kwargs: ignored.
        """
        raise NotImplementedError(
            "a paged cache has no contiguous buffer to concatenate into; use "
            "write_prefill_to_cache / write_decodes_to_cache / write_tokens"
        )

    # ---- writes (EasyDeL's: they update this view and return it) -------------------------------
    def write_tokens(self, key: Array, value: Array | None, slots: ArrayLike) -> PagedAttentionCacheView:
        """Write token rows at ``slots`` into this layer; returns this view, updated.

        Args:
          key: ``(num_tokens, num_kv_heads, head_dim)`` of the group, in its logical dtype.
          value: as ``key`` with the value head dim; None for a latent group.
          slots: ``(num_tokens,)`` int slots ``page_id * page_size + offset`` of the group's pool
            (-1: padding); host slots are checked, device slots bounded in the scatter.
        """
        capacity = known_size(self.layer_group.num_pages) * self.metadata.page_size
        return self._write(key, value, check_slots_on_host(slots, capacity))

    def write_prefill_to_cache(self, key: Array, value: Array | None, metadata: WriteMetadata
                               ) -> PagedAttentionCacheView:
        """Write a prefill chunk into this layer; returns this view, updated.

        Args:
          key: ``(padded_prefill_len, num_kv_heads, head_dim)`` of the group, in its logical
            dtype, written at ``metadata.prefill_position``.
          value: as ``key`` with the value head dim; None for a latent group.
          metadata: prefill `PagedAttentionMetadata` (`PagedAttentionMetadata.for_prefill`), or a
            tuple of one per layer group (this view's is used).
        """
        return self._write_mode(key, value, metadata, "prefill", "for_prefill")

    def write_decodes_to_cache(self, key: Array, value: Array | None, metadata: WriteMetadata
                               ) -> PagedAttentionCacheView:
        """Write one token per sequence into this layer; returns this view, updated.

        Args:
          key: ``(batch, num_kv_heads, head_dim)`` of the group, in its logical dtype, written at
            ``metadata.decodes_position``.
          value: as ``key`` with the value head dim; None for a latent group.
          metadata: decode `PagedAttentionMetadata` (`PagedAttentionMetadata.for_decode`), or a
            tuple of one per layer group (this view's is used).
        """
        return self._write_mode(key, value, metadata, "decode", "for_decode")

    def write_mixed_to_cache(self, key: Array, value: Array | None, metadata: WriteMetadata
                             ) -> PagedAttentionCacheView:
        """Write a mixed step's new tokens into this layer; returns this view, updated.

        Args:
          key: ``(num_tokens, num_kv_heads, head_dim)`` of the group, in its logical dtype,
            written at ``metadata.slot_mapping``.
          value: as ``key`` with the value head dim; None for a latent group.
          metadata: a `RaggedStep` (the page manager's step) or mixed `PagedAttentionMetadata`
            (`PagedAttentionMetadata.for_mixed`), or a tuple of one per layer group (this view's is used).
        """
        return self._write_mode(key, value, metadata, "mixed", "for_mixed")

    def _write_mode(self, key: Array, value: Array | None, metadata: WriteMetadata, mode: str, maker: str
                    ) -> PagedAttentionCacheView:
        step_meta = group_runtime(metadata, len(self.metadata.groups), self.group)
        if step_form(step_meta) != mode:
            name = "decodes" if mode == "decode" else mode
            raise ValueError(f"write_{name}_to_cache needs {mode} metadata (PagedAttentionMetadata.{maker})")
        return self._write(key, value, token_slots(step_meta, self.metadata, self.group))

    def _write(self, key: Array, value: Array | None, slots: Array) -> PagedAttentionCacheView:
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


class CacheViews(list[PagedAttentionCacheView]):
    """``cache.views``: EasyDeL's list of per-layer views, over the cache's stacked arrays (a
    list, as EasyDeL's, whose items are made on access: it stores none of them).
    ``views[i]`` is layer ``i``'s view of the arrays the cache holds now; ``views[i] = view``
    checks that ``view`` is layer ``i`` of a cache with this metadata and layout, then takes
    its arrays when it was written from the arrays the cache holds now, and otherwise copies
    its layer's pages into layer ``i`` (the group's other layers keep theirs). Its length is
    the number of layers: appending, inserting or deleting views is refused."""

    def __init__(self, cache: _Cache) -> None:
        super().__init__()
        self._cache = cache

    def __bool__(self) -> bool:
        return len(self) > 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheViews) and other._cache is self._cache

    __hash__ = None

    def __len__(self) -> int:
        return self._cache.metadata.num_hidden_layers

    @overload
    def __getitem__(self, index: SupportsIndex) -> PagedAttentionCacheView: ...

    @overload
    def __getitem__(self, index: slice) -> list[PagedAttentionCacheView]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> PagedAttentionCacheView | list[PagedAttentionCacheView]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        return self._cache[index]

    @overload
    def __setitem__(self, index: SupportsIndex, view: PagedAttentionCacheView) -> None: ...

    @overload
    def __setitem__(self, index: slice, view: Iterable[PagedAttentionCacheView]) -> None: ...

    def __setitem__(self, index: SupportsIndex | slice, view: object) -> None:
        if isinstance(index, slice):
            raise ValueError("assign views one at a time: cache.views[i] = view")
        # cast, not a check: the cache checks that ``view`` is a view of its layer and names a wrong one.
        self._cache[index] = cast(PagedAttentionCacheView, view)

    def __iter__(self) -> Iterator[PagedAttentionCacheView]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"CacheViews({len(self)} layers)"

    def _fixed(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError("a cache holds exactly one view per layer; replace one with cache.views[i] = view")

    append = extend = insert = pop = remove = clear = sort = reverse = __delitem__ = __iadd__ = __imul__ = _fixed
    copy = index = count = __contains__ = __add__ = __mul__ = __rmul__ = __reversed__ = _fixed

# One compiled scatter per layout and shape: run eagerly, shard_map costs seconds per call.
_scatter = jax.jit(scatter_kv, static_argnames=("layout",))
_scatter_in_place = jax.jit(scatter_kv, static_argnames=("layout",), donate_argnums=(0, 1))


__all__ = ["CacheViews", "PagedAttentionCacheView"]
