"""The paged cache: every layer's pages, stacked per layer group, behind EasyDeL's API.

``PagedAttentionCache`` keeps EasyDeL's names and methods (``init_cache``, ``views``, ``cache[i]``,
the dict and JSON forms) and adds the functional, donating calls engines use: ``write`` (every
layer's new tokens in one jit), ``copy_pages`` and ``zero_pages``. It is a pytree whose only
leaves are the page arrays (metadata and placement are static), so jit can take and return it
and donation reuses its buffers. ``gather_kv`` reads one sequence's tokens back.

The per-layer view (`PagedAttentionCacheView`) lives in ``view.py`` and is re-exported here,
where EasyDeL code imports it from; where pages go (and whether they fit) is ``placement.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any, SupportsIndex

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.typing import DTypeLike
from numpy.typing import ArrayLike

from easykv.quantization import Quantizer
from easykv.sharding import PartitionManager
from easykv.spec.groups import known_size
from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.step.checks import Array
from easykv.step.metadata import group_runtime
from easykv.storage.cache_json import EasyDeLForms, cache_to_dict, cache_view_dicts
from easykv.storage.page_work import padded_ids, page_work_local, work_bucket
from easykv.storage.pages import PageLayout, StoredPages, allocate_pages, encode_tokens, page_op, read_pages
from easykv.storage.placement import cache_layout, check_fits, checked_layout, group_layouts
from easykv.storage.view import CacheViews, PagedAttentionCacheView
from easykv.storage.writes import (
    LayerRows,
    WriteMetadata,
    check_layer_rows,
    count_dropped,
    scatter_encoded,
    token_slots,
)
from easykv.validation import integer, page_ids


@partial(jax.tree_util.register_dataclass, data_fields=["key_pages", "value_pages"],
         meta_fields=["metadata", "layout"])
@dataclasses.dataclass(frozen=True, eq=False)
class PagedAttentionCache(EasyDeLForms):
    """Every layer's pages, stacked per layer group.

    ``cache[i]`` / ``cache.views[i]`` is layer ``i``'s view; ``cache[i] = view`` puts a written
    view back. Made by `init_cache`; the constructor checks one stack per group, of the group's
    leading shape (ValueError otherwise).

    Attributes:
      metadata: the cache's `PagedAttentionCacheMetaData`.
      key_pages: one stack per layer group ``g`` of ``metadata.groups``, ``(layers_in_group,
        num_kv_heads, num_pages, page_size, head_dim)`` in the group's geometry and storage
        dtype (`QuantizedPages` when quantized).
      value_pages: as ``key_pages``, with the group's value head dim; None for a latent group.
      layout: the cache-wide placement (`PageLayout`; None: one device); ``layout_of(g)`` is
        group ``g``'s (its kv heads may be split over other mesh axes).
    """

    metadata: PagedAttentionCacheMetaData
    key_pages: tuple[StoredPages, ...]
    value_pages: tuple[StoredPages | None, ...]
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
        """EasyDeL's list of per-layer views (`CacheViews`), each made on access."""
        return CacheViews(self)

    def __len__(self) -> int:
        return self.metadata.num_hidden_layers

    def layout_of(self, group: int) -> PageLayout | None:
        """Placement of layer group ``group``'s pages: the cache's mesh and page split, the
        group's own kv-head split.

        Args:
          group: index of the layer group in ``metadata.groups``.

        Returns:
          The group's `PageLayout`; None for a cache on one device.
        """
        return group_layouts(self.metadata, self.layout)[group]

    def _locate(self, layer: SupportsIndex) -> tuple[int, int, int]:
        n = self.metadata.num_hidden_layers
        i = integer("layer", layer, lo=-n, hi=n - 1, hint=f"the cache has {n} layers") % n
        return (i, *self.metadata.group_of(i))

    def __getitem__(self, layer: SupportsIndex) -> PagedAttentionCacheView:
        i, g, j = self._locate(layer)
        view = PagedAttentionCacheView(self.metadata, i, self.key_pages[g], self.value_pages[g], j, self.layout_of(g),
                                       g)
        view._owner = (self, g)
        return view

    def __setitem__(self, layer: SupportsIndex, view: PagedAttentionCacheView) -> None:
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
        before and after every iteration.

        Args:
          group: index of the layer group in ``metadata.groups`` (default 0); ValueError when out
            of range.
        """
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
        view it returns): put back only what was computed from this cache's arrays.

        Args:
          view: a `PagedAttentionCacheView` of this cache's metadata and group layout that holds
            its group's whole stack (``cache.group_view(g)`` or ``cache[i]``, written).

        Raises:
          ValueError: ``view`` is no view of this cache, or holds another number of layers.
        """
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
                "view = cache.views[i]; view = view.write_...(...); cache.views[i] = view. A view jax returns "
                "(lax.scan over the group's layers, a jitted function given the cache's current arrays) goes back "
                "with cache.update(view)")

    def _put_group(self, g: int, view: PagedAttentionCacheView) -> None:
        object.__setattr__(self, "key_pages", _replaced(self.key_pages, g, view.group_key_pages))
        object.__setattr__(self, "value_pages", _replaced(self.value_pages, g, view.group_value_pages))

    def __iter__(self) -> Iterator[PagedAttentionCacheView]:
        return (self[i] for i in range(len(self)))

    def to_dict(self) -> dict[str, Any]:
        """EasyDeL's dict form (JSON is this dict): the dict of each layer's view."""
        return cache_to_dict(self)

    @classmethod
    def from_dict(cls, data: object, *, mesh: Mesh | None = None,
                  partition_manager: PartitionManager | None = None) -> PagedAttentionCache:
        """Rebuilt on ``mesh`` (laid out as the metadata says), or on one device without one.

        Args:
          data: the dict `to_dict` wrote (``SerializationError`` for anything else).
          mesh: the `Mesh` to place the pages on; None: the first of ``jax.devices()``.
          partition_manager: the `PartitionManager` that lays the pages out on ``mesh`` (None:
            the default rules; unused without a mesh).
        """
        return cls.from_views([PagedAttentionCacheView.from_dict(v, mesh=mesh, partition_manager=partition_manager)
                               for v in cache_view_dicts(data)])

    @classmethod
    def init_empty(cls, *args: object, **kwargs: object) -> None:
        """EasyDeL's placeholder: a paged cache is only made by init_cache. Returns None.

        Args:
          *args: ignored.
          **kwargs: ignored.
        """
        return None

    @classmethod
    def init_cache(
        cls,
        mesh: Mesh,
        dtype: DTypeLike,
        metadata: PagedAttentionCacheMetaData,
        partition_manager: PartitionManager | None = None,
        quantizer: str | Quantizer | None = None,
    ) -> PagedAttentionCache:
        """Allocate every layer group's stacked pages in one call; each device creates only its
        own shard. A layer group with a format of its own (`LayerGroup.dtype` /
        ``quantization``) is allocated in it.

        Args:
          mesh: the `Mesh` whose devices hold the pages.
          dtype: the cache's logical dtype (float32, bfloat16 or float16); must equal
            ``metadata.dtype`` when the metadata sets one.
          metadata: the `PagedAttentionCacheMetaData` (from `create`, or EasyDeL's nine fields);
            its dtype and kv-head layout are completed for ``mesh`` where it leaves them open.
          partition_manager: the `PartitionManager` whose rules split kv heads and pages over
            ``mesh`` (None: the defaults); must split them as the metadata was sized for.
          quantizer: a quantizer name or object (None: ``"none"``); must be
            ``metadata.quantization``.

        Raises:
          ValueError: a dtype, quantizer or split other than the metadata's, or pages that do
            not fit the devices' free memory.
        """
        metadata, layout, templates = checked_layout(mesh, dtype, metadata, partition_manager, quantizer)
        check_fits(mesh, metadata, metadata.bytes_per_device, f"{metadata.num_hidden_layers} layers")
        layouts = group_layouts(metadata, layout)
        pages = [allocate_pages(templates(g), layouts[g]) for g in range(len(metadata.groups))]
        return cls(metadata, tuple(k for k, _ in pages), tuple(v for _, v in pages), layout)

    @classmethod
    def from_views(cls, views: Iterable[PagedAttentionCacheView]) -> PagedAttentionCache:
        """A cache of per-layer views (layers 0..n-1 of one metadata and layout, each its own
        one-layer group, as ``PagedAttentionCacheView.init`` or the JSON form makes them),
        stacked into the cache's groups: a copy of every page. For small caches and tests.

        Args:
          views: an iterable of one `PagedAttentionCacheView` per layer, layers ``0 .. n-1`` in
            order (ValueError otherwise).
        """
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
        layout = None if first is None else cache_layout(first.mesh, meta)
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
        return cls(meta, tuple(keys), tuple(values), layout)

    # ---- all layers in one jit -----------------------------------------------------------
    def write(self, keys: LayerRows, values: LayerRows | None, metadata: WriteMetadata
              ) -> tuple[PagedAttentionCache, jax.Array]:
        """Write every layer's new tokens in one jitted, donating call: one scatter per device
        and layer group.

        Args:
          keys: ``(num_layers, num_tokens, num_kv_heads, head_dim)``, or a sequence of one
            ``(num_tokens, num_kv_heads, head_dim)`` per layer in its group's geometry; in the
            layer's logical dtype.
          values: as ``keys`` with the value head dim; None in a latent layer's place (None for
            all when every group is latent).
          metadata: the step, one for every group or a tuple of one per group (a plan's
            ``plan.metadata``): each a `RaggedStep`, or EasyDeL's `PagedAttentionMetadata` in any
            form (converted here, once); its slots give ``num_tokens``.

        Returns:
          The updated cache (this cache's buffers are donated: do not use it afterwards) and the
          number of real tokens dropped because their slot lay outside the pool (of a grouped
          cache, the most in any one group; 0 when metadata came from the validated
          constructors), an int32 scalar.
        """
        meta = self.metadata
        n = len(meta.groups)
        slots = tuple(token_slots(group_runtime(metadata, n, g), meta, g) for g in range(n))
        counts = {np.shape(s) for s in slots}
        if len(counts) != 1 or len(next(iter(counts))) != 1:
            raise ValueError(f"metadata.slot_mapping must be 1-D (one per token) and the same length for every "
                             f"layer group, got shapes {[np.shape(s) for s in slots]}")
        num_tokens = int(np.shape(slots[0])[0])
        checked_keys = check_layer_rows(keys, "keys", meta, num_tokens, values=False)
        checked_values = check_layer_rows(values, "values", meta, num_tokens, values=True)
        written: tuple[PagedAttentionCache, jax.Array] = write_all(self, checked_keys, checked_values,
                                                                   slots)  # jit: typed here
        return written

    def copy_pages(self, src: ArrayLike, dst: ArrayLike) -> PagedAttentionCache:
        """Copy pages ``src[i] -> dst[i]`` in every layer (copy-on-write); -1 pairs are padding.
        One jitted, donating call; sources are read before destinations are written. Host ids
        are padded with -1 to a power of two (at most the pool's pages; `easykv.storage.page_work`),
        the program `zero_pages` runs too, so a server compiles a few shapes of it, not one per
        count; device (jax) ids run in the length given.

        Args:
          src: ``(num_copies,)`` int page ids, one array for every layer group or a tuple of one
            per group (groups have their own pools); host ids are checked against the pool.
          dst: as ``src``, the same shape; with a sharded page axis a copy may not cross
            data-parallel replicas' slices (ValueError).

        Returns:
          The updated cache (this cache's buffers are donated); this cache itself when the ids are empty.
        """
        meta = self.metadata
        srcs, dsts = _group_page_ids(src, "src", meta), _group_page_ids(dst, "dst", meta)
        for g, (src, dst) in enumerate(zip(srcs, dsts)):
            where = "" if len(srcs) == 1 else f" of layer group {g}"
            if src.shape != dst.shape:
                raise ValueError(f"src{where} has shape {src.shape} but dst has shape {dst.shape}; pair them 1:1")
            per_shard = known_size(meta.groups[g].num_pages) // meta.page_shards
            if meta.page_shards > 1 and isinstance(src, np.ndarray) and isinstance(dst, np.ndarray):
                # Each data-parallel replica owns a slice of the pool; a copy cannot cross slices.
                real = (src >= 0) & (dst >= 0)
                cross = real & (src // per_shard != dst // per_shard)
                if np.any(cross):
                    i = int(np.argmax(cross))
                    raise ValueError(
                        f"copy {int(src[i])} -> {int(dst[i])}{where} crosses data-parallel replicas: pages are "
                        f"split into {meta.page_shards} slices of {per_shard}; copy within a replica's slice")
        return _run_page_work(self, srcs, dsts, None)

    def zero_pages(self, pages: ArrayLike) -> PagedAttentionCache:
        """Zero ``pages`` in every layer (scrubbing released pages); -1 entries are padding. Padded
        and compiled as `copy_pages` (one program for both).

        Args:
          pages: ``(num_pages_to_zero,)`` int page ids, one array for every layer group or a
            tuple of one per group (groups have their own pools).

        Returns:
          The updated cache (this cache's buffers are donated); this cache itself when the ids are empty.
        """
        return _run_page_work(self, None, None, _group_page_ids(pages, "pages", self.metadata))


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


@partial(jax.jit, donate_argnums=0)  # public for the write benchmark and tests: cache.write without host checks
def write_all(cache: PagedAttentionCache, keys: Array | tuple[Array | None, ...] | None,
              values: Array | tuple[Array | None, ...] | None, slots: tuple[Array, ...]
              ) -> tuple[PagedAttentionCache, jax.Array]:
    """Every group's new K and V (``slots``: one array per group) in one jit: one shard_map and
    one scatter per stacked array and device."""
    def rows(x: Any, layers: tuple[int, ...]) -> jax.Array:
        if isinstance(x, tuple):
            return jnp.stack([jnp.asarray(x[i]) for i in layers])
        stacked = jnp.asarray(x)
        return stacked if layers == tuple(range(stacked.shape[0])) else stacked[np.asarray(layers)]

    meta = cache.metadata
    keys_out, values_out, dropped = [], [], []
    for g, group in enumerate(meta.groups):
        kp, vp = cache.key_pages[g], cache.value_pages[g]
        new_k = encode_tokens(rows(keys, group.layers), kp)
        new_v = None if vp is None else encode_tokens(rows(values, group.layers), vp)
        k, v = scatter_encoded((kp, vp), (new_k, new_v), slots[g], layout=cache.layout_of(g))
        keys_out.append(k)
        values_out.append(v)
        dropped.append(count_dropped(jnp.asarray(slots[g]), known_size(group.num_pages) * meta.page_size))
    return PagedAttentionCache(meta, tuple(keys_out), tuple(values_out), cache.layout), jnp.max(jnp.stack(dropped))


def _apply_page_op(cache: PagedAttentionCache, *ids: tuple[Array, ...],
                   op: Callable[..., tuple[StoredPages, StoredPages | None]]) -> PagedAttentionCache:
    keys, values = [], []
    for g in range(len(cache.metadata.groups)):
        k, v = page_op(cache.layout_of(g), op)((cache.key_pages[g], cache.value_pages[g]), *(i[g] for i in ids))
        keys.append(k)
        values.append(v)
    return PagedAttentionCache(cache.metadata, tuple(keys), tuple(values), cache.layout)


@partial(jax.jit, donate_argnums=0)  # its name is what compile counters see (tests, bench_load)
def page_work(cache: PagedAttentionCache, srcs: tuple[Array, ...], dsts: tuple[Array, ...], scrubs: tuple[Array, ...]
              ) -> PagedAttentionCache:
    """Every group's copies, then its scrubs (one id array of each per group, all of one
    length), in one program (`page_work_local`): `copy_pages` and `zero_pages` run it."""
    return _apply_page_op(cache, srcs, dsts, scrubs, op=page_work_local)


def _run_page_work(cache: PagedAttentionCache, srcs: tuple[Array, ...] | None, dsts: tuple[Array, ...] | None,
                   scrubs: tuple[Array, ...] | None) -> PagedAttentionCache:
    """`page_work` on checked ids, one array per group (None: no copies, or no scrubs). Host ids
    are padded with -1 to one bucket (`work_bucket`) for every array of every group; device ids
    are not read back to pad them: they run in the length given."""
    given = (srcs if srcs is not None else scrubs) or ()
    if any(isinstance(a, jax.Array) for a in (*(srcs or ()), *(dsts or ()), *(scrubs or ()))):
        sizes = [int(np.shape(a)[0]) for a in given]
    else:
        most = max(known_size(g.num_pages) for g in cache.metadata.groups)
        size = work_bucket(max((int(np.shape(a)[0]) for a in given), default=0), most)
        if size == 0:
            return cache  # nothing to copy or zero: no program (nor its compile)
        sizes = [size] * len(given)

    def padded(ids: tuple[Array, ...] | None) -> tuple[Array, ...]:
        if ids is None:  # the other half: all padding, skipped on the device
            return tuple(np.full(n, -1, np.int32) for n in sizes)
        return tuple(a if isinstance(a, jax.Array) else padded_ids(a, n) for a, n in zip(ids, sizes))

    done: PagedAttentionCache = page_work(cache, padded(srcs), padded(dsts), padded(scrubs))  # jit: typed here
    return done


def _stacker(layout: PageLayout | None) -> Any:
    """A jitted stack of per-layer page pytrees into one stack laid out as ``layout``."""
    def stack(pages: list[Any]) -> Any:
        shardings = None if layout is None else jax.tree.map(lambda t: layout.sharding_for(t.ndim + 1), pages[0])
        return jax.jit(lambda ps: jax.tree.map(lambda *xs: jnp.stack(xs), *ps), out_shardings=shardings)(pages)
    return stack



def gather_kv(
    cache: PagedAttentionCache | PagedAttentionCacheView,
    layer: int,
    page_table_row: ArrayLike,
    length: int,
) -> tuple[jax.Array, jax.Array | None]:
    """The contiguous keys and values of one sequence. Reads only the ``ceil(length /
    page_size)`` pages it needs.

    Args:
      cache: a `PagedAttentionCache`, or one layer's `PagedAttentionCacheView` (then ``layer`` is
        not read: the view's layer is).
      layer: the model layer to read from a cache.
      page_table_row: ``(pages_per_sequence,)`` int page ids of the sequence in its layer
        group's pool; host ids are checked (the first ``ceil(length / page_size)`` assigned),
        device ids are bounded in the read (a page outside the pool reads zeros).
      length: tokens to read, a static int in ``0 .. num_pages_per_sequence * page_size``.

    Returns:
      keys and values, each ``(length, num_kv_heads, head_dim)`` of the layer's group in the
      logical dtype; values None for a latent group.
    """
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
        row = page_ids("page_table_row", row, num_pages=known_size(view.layer_group.num_pages), ndim=1,
                       pad="unassigned")
    if np.ndim(row) != 1:
        raise ValueError(f"page_table_row must be 1-D, got shape {np.shape(row)}")
    needed = math.ceil(length / meta.page_size)
    if needed > np.shape(row)[0]:
        raise ValueError(f"length={length} needs {needed} pages but page_table_row has {np.shape(row)[0]}")
    if isinstance(row, np.ndarray) and np.any(row[:needed] < 0):
        i = int(np.argmax(row[:needed] < 0))
        raise ValueError(f"page_table_row[{i}] = -1 is unassigned but is needed for length={length}")
    # A traced or device row is bounded inside the read: a page outside the pool reads zeros.
    gathered: tuple[jax.Array, jax.Array | None] = _gather(view, jnp.asarray(row, jnp.int32)[:needed], length)
    return gathered


@partial(jax.jit, static_argnums=2)
def _gather(view: PagedAttentionCacheView, ids: jax.Array, length: int) -> tuple[jax.Array, jax.Array | None]:
    def read(pages: Any) -> jax.Array:
        picked = read_pages(pages, ids, view.dtype, view.layer)  # (heads, n, page_size, head_dim)
        heads, dim = picked.shape[0], picked.shape[-1]
        return jnp.transpose(picked, (1, 2, 0, 3)).reshape(-1, heads, dim)[:length]

    return read(view.group_key_pages), None if view.group_value_pages is None else read(view.group_value_pages)


def _group_page_ids(ids: ArrayLike, name: str, meta: PagedAttentionCacheMetaData) -> tuple[Array, ...]:
    """Page ids for every layer group: one array for all (checked against every group's
    pool), or a tuple of one per group. Host ids checked (-1 padding); device ids are bounded
    inside the copy/zeroing."""
    n = len(meta.groups)
    if isinstance(ids, tuple):
        if len(ids) != n:
            raise ValueError(f"{name} holds {len(ids)} arrays of page ids but the cache has {n} layer group(s); "
                             "give one array for all groups or one per group")
        return tuple(_page_ids(x, name if n == 1 else f"{name}[{g}]", known_size(meta.groups[g].num_pages))
                     for g, x in enumerate(ids))
    return tuple(_page_ids(ids, name, known_size(g.num_pages)) for g in meta.groups)


def _page_ids(ids: ArrayLike, name: str, num_pages: int) -> Array:
    if isinstance(ids, jax.Array):
        if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name} must be a 1-D array of integer page ids, got {ids.dtype} of shape {ids.shape}")
        return ids.astype(jnp.int32)
    return page_ids(name, ids, num_pages=num_pages, ndim=1)


__all__ = ["PagedAttentionCache", "PagedAttentionCacheView", "gather_kv", "write_all"]
