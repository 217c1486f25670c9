"""Page storage: where a layer group's pages live on the mesh, in which dtype, and page-wise copies.

The pages of a layer group are stacked along a leading layer axis: one array per K and V of
logical shape ``(layers_in_group, num_kv_heads, num_pages, page_size, head_dim)``. A layer is the
slice ``[layer]``, the layout JAX's Pallas paged attention takes. Every operation here takes the
stacked array and a layer index (or writes every layer at once) rather than slicing a layer out:
inside a loop XLA hoists such a slice and copies the layer's whole pool (measured: a 64-page read
from a sliced 4096-page layer costs 20x the same read indexed on the stack).

Storage dtype: XLA:CPU lowers a scatter into a bf16, f16 or fp8 buffer as a rewrite of the whole
buffer (measured: a 32-token write into a 2048-page bf16 pool costs 20x the same write into a
256-page pool), while a scatter into unsigned integers of the same width is done in place. On CPU
such pages are therefore stored as their raw bits (uint16 / uint8) and bitcast at the edges; the
bits are identical, so nothing is lost. GPU and TPU store the dtype itself.

Every page operation runs inside ``shard_map`` over the page layout, so a device only touches
its own shard: a write into head-sharded pages needs no cross-device traffic, and with the page
axis split over data-parallel replicas each replica translates global page ids to its slice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import TypeAlias, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from easykv.quantization import QuantizedPages, Quantizer, is_compressing, scale_dtype, scales_per_page
from easykv.spec.groups import LayerGroup
from easykv.spec.metadata import PagedAttentionCacheMetaData, known_dtype

#: One stacked page array's template (shapes and storage dtypes): a ShapeDtypeStruct, or a
#: QuantizedPages of them (values and scales).
PageTemplate: TypeAlias = jax.ShapeDtypeStruct | QuantizedPages[jax.ShapeDtypeStruct]
#: One stacked page array (K or V) as stored: the dtype itself or its raw bits (CPU), or a
#: QuantizedPages of values and scales.
StoredPages: TypeAlias = jax.Array | QuantizedPages[jax.Array]
#: A layer of stacked pages: an int, an integer scalar, or a traced index.
Layer: TypeAlias = int | np.integer | jax.Array | np.ndarray
#: A pytree of stacked page arrays (a group's K and V, ...): what a shard-local page operation
#: takes and returns in the same structure.
PageTree = TypeVar("PageTree")


def storage_dtype(dtype: DTypeLike, platform: str) -> np.dtype:
    """The dtype pages of logical ``dtype`` are stored in on ``platform`` (see module doc)."""
    dt = np.dtype(dtype)
    if platform == "cpu" and jnp.issubdtype(dt, jnp.floating) and dt.itemsize < 4:
        return np.dtype(f"uint{8 * dt.itemsize}")
    return dt


def to_storage(x: jax.Array, stored: np.dtype) -> jax.Array:
    """Reinterpret new values (logical dtype) as the stored dtype: a bitcast, never a cast."""
    return x if x.dtype == stored else jax.lax.bitcast_convert_type(x, stored)


def from_storage(x: jax.Array, dtype: np.dtype) -> jax.Array:
    """Reinterpret stored pages as their logical dtype."""
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


@dataclasses.dataclass(frozen=True)
class PageLayout:
    """Static placement of a group's stacked pages: the mesh and the mesh axes of the kv-head and
    page dimensions (empty tuples: not split); the layer axis is never split. Hashable, so it
    can be pytree aux data."""

    mesh: Mesh
    head_axes: tuple[str, ...] = ()
    page_axes: tuple[str, ...] = ()

    @property
    def spec(self) -> PartitionSpec:
        """Spec of a stacked page array ``(layers, heads, pages, page_size, head_dim)``."""
        return self.spec_for(5)

    @property
    def sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec)

    @property
    def layer_sharding(self) -> NamedSharding:
        """Sharding of one layer's pages ``(heads, pages, page_size, head_dim)`` on their own
        (what ``paged_attention`` takes without ``layer=``)."""
        return self.layer_sharding_for(4)

    def layer_sharding_for(self, ndim: int) -> NamedSharding:
        """Sharding of one layer's page array of rank ``ndim`` (heads first: scales are rank 3+)."""
        spec = PartitionSpec(_entry(self.head_axes), _entry(self.page_axes), *([None] * (ndim - 2)))
        return NamedSharding(self.mesh, spec)

    def spec_for(self, ndim: int) -> PartitionSpec:
        """Spec of a stacked page array of rank ``ndim`` (pages are rank 5, quantization scales
        4+): layers whole, then kv heads, then pages."""
        return PartitionSpec(None, _entry(self.head_axes), _entry(self.page_axes), *([None] * (ndim - 3)))

    def sharding_for(self, ndim: int) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec_for(ndim))

    @property
    def page_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.page_axes)

    def local_page_offset(self, pages_per_shard: int) -> jax.Array | int:
        """First global page id of this device's page slice; call inside `run_local` only."""
        if self.page_shards == 1:
            return 0
        return jax.lax.axis_index(self.page_axes) * pages_per_shard


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def run_local(
    fn: Callable[..., PageTree],
    layout: PageLayout | None,
    pages: PageTree,
    per_head: object = (),
    replicated: tuple[jax.Array, ...] = (),
    *,
    head_axis: int = 0,
) -> PageTree:
    """Apply ``fn(pages, per_head, *replicated)`` to each device's shard of ``pages``.

    ``pages`` is a pytree of stacked page arrays laid out as ``layout`` (the result keeps that
    layout); ``per_head`` is a pytree of arrays split by kv head like the pages, their heads on
    axis ``head_axis`` (new tokens ``(layers, tokens, heads, dim)``: 2; one layer's ``(tokens,
    heads, dim)``: 1); ``replicated`` arrays (slots, page ids, a layer index) are seen whole by
    every device.
    """
    if layout is None or layout.mesh.size == 1:
        return fn(pages, per_head, *replicated)
    head_spec = PartitionSpec(*([None] * head_axis), _entry(layout.head_axes))
    page_specs = jax.tree.map(lambda leaf: layout.spec_for(leaf.ndim), pages)
    in_specs = (
        page_specs,
        jax.tree.map(lambda _: head_spec, per_head),
        *(PartitionSpec() for _ in replicated),
    )
    mapped = jax.shard_map(fn, mesh=layout.mesh, in_specs=in_specs, out_specs=page_specs)
    return mapped(pages, per_head, *replicated)


def page_template(
    shape: tuple[int, ...], dtype: DTypeLike, quantizer: Quantizer, platform: str
) -> PageTemplate:
    """Shapes and storage dtypes of one stacked page array (K or V) of logical ``shape``
    ``(layers, heads, pages, page_size, head_dim)`` (or one layer's, as checkpoint formats 1-2
    hold it) and ``dtype``: a ShapeDtypeStruct, or a QuantizedPages of them (values + compact
    scales)."""
    if not is_compressing(quantizer):
        return jax.ShapeDtypeStruct(shape, storage_dtype(dtype, platform))
    *lead, head_dim = shape
    value_tail, value_dtype = quantizer.value_shape(head_dim)
    scale_lead = lead[:-1] if scales_per_page(quantizer) else lead  # per page: no page_size axis
    return QuantizedPages(
        values=jax.ShapeDtypeStruct((*lead, *value_tail), storage_dtype(value_dtype, platform)),
        scales=jax.ShapeDtypeStruct((*scale_lead, *quantizer.scale_shape(head_dim)), scale_dtype(quantizer)),
        quantizer=quantizer,
    )


def group_page_templates(meta: PagedAttentionCacheMetaData, group: LayerGroup, platform: str
                         ) -> tuple[PageTemplate, PageTemplate | None]:
    """(key, value) templates of layer group ``group``'s stacked pages of ``meta`` on
    ``platform``, in the group's geometry and format (value None for a latent group, which
    stores none)."""
    dtype, quantizer = known_dtype(meta.group_dtype(group)), meta.group_quantizer(group)
    key = page_template(meta.group_pages_shape(group), dtype, quantizer, platform)
    value_shape = meta.group_pages_shape(group, values=True)  # None: a latent group
    return key, None if value_shape is None else page_template(value_shape, dtype, quantizer, platform)


def group_templates(meta: PagedAttentionCacheMetaData, platform: str) -> list[tuple[PageTemplate, PageTemplate | None]]:
    """`group_page_templates` of every layer group of ``meta``, in group order."""
    return [group_page_templates(meta, g, platform) for g in meta.groups]


def allocate_pages(templates: tuple[PageTemplate, PageTemplate | None], layout: PageLayout
                   ) -> tuple[StoredPages, StoredPages | None]:
    """Zero-filled (key, value) page arrays of a group's templates (`group_page_templates`; None
    for a latent group's values), created by the devices themselves: each device (and each host)
    materializes only its own shard; nothing of pool size passes through host memory."""
    make = jax.jit(
        lambda: jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), templates),
        out_shardings=jax.tree.map(lambda t: layout.sharding_for(len(t.shape)), templates),
    )
    pages: tuple[StoredPages, StoredPages | None] = make()
    return pages


def encode_tokens(new: jax.Array, pages: StoredPages | PageTemplate) -> StoredPages:
    """New tokens (..., head_dim) in the logical dtype -> what ``pages`` stores for token rows:
    quantized values + scales, or the raw bits of the values. Pages with a scale per page
    (``int4-ch``) take the tokens themselves: their write quantizes against the pages' scales
    (``writes.scatter_encoded``)."""
    if isinstance(pages, QuantizedPages):
        if scales_per_page(pages.quantizer):
            return new
        q = pages.quantizer.quantize(new)
        return QuantizedPages(to_storage(q.values, pages.values.dtype), q.scales.astype(pages.scales.dtype),
                              q.quantizer)
    return to_storage(new, pages.dtype)


def encode_pages(x: jax.Array, pages: StoredPages | PageTemplate) -> StoredPages:
    """Whole pages ``(..., page_size, head_dim)`` in the logical dtype -> what ``pages`` (a
    template or stored pages) stores for them; unlike ``encode_tokens``, a format with a scale
    per page quantizes each page against its own tokens."""
    if isinstance(pages, QuantizedPages) and scales_per_page(pages.quantizer):
        q = pages.quantizer.quantize(x)
        return QuantizedPages(to_storage(q.values, pages.values.dtype), q.scales.astype(pages.scales.dtype),
                              q.quantizer)
    return encode_tokens(x, pages)


def take_pages(x: jax.Array, ids: jax.Array, layer: Layer = 0) -> jax.Array:
    """``x[layer][:, ids]`` of a stacked array ``x`` ``(layers, heads, pages, ...)``, gathered
    from the stack itself (no slice of the layer is ever formed), as ``(heads, len(ids), ...)``.
    An id outside ``0 .. pages - 1`` reads zeros. Never another page: ``jnp.take`` would read
    page -1 as the last page of the pool."""
    n = x.shape[2]
    ids = jnp.where((ids >= 0) & (ids < n), ids, n)
    picked = x.at[layer, :, ids].get(mode="fill", fill_value=0)  # (len(ids), heads, ...)
    return jnp.moveaxis(picked, 0, 1)


def read_pages(pages: StoredPages, ids: jax.Array, dtype: DTypeLike, layer: Layer = 0, *,
               rotated: bool = False) -> jax.Array:
    """Pages ``ids`` of layer ``layer`` of one stacked page array as (heads, len(ids),
    page_size, head_dim) in the logical ``dtype``; only those pages are read (and dequantized);
    ids outside the array read as zeros. ``rotated``: a rotating quantizer's values stay in its
    rotated basis (`QuantizedPages.dequantize`)."""
    if isinstance(pages, QuantizedPages):
        picked = QuantizedPages(take_pages(pages.values, ids, layer), take_pages(pages.scales, ids, layer),
                                pages.quantizer)
        return decode_pages(picked, dtype, rotated=rotated)
    return decode_pages(take_pages(pages, ids, layer), dtype)


def decode_pages(pages: StoredPages, dtype: DTypeLike, *, rotated: bool = False) -> jax.Array:
    """Stored pages (an array or QuantizedPages, as ``pages`` holds them) as values in ``dtype``:
    quantized ones dequantized into it, raw bits reinterpreted as it (`read_pages`)."""
    if isinstance(pages, QuantizedPages):
        value_dtype = pages.quantizer.value_shape(2)[1]
        stored = QuantizedPages(from_storage(pages.values, value_dtype), pages.scales, pages.quantizer)
        return stored.dequantize(dtype, rotated=rotated)
    return from_storage(pages, np.dtype(dtype))


def _local_page_ids(ids: jax.Array, layout: PageLayout | None, pages_per_shard: int) -> jax.Array:
    """Global page ids -> ids of this device's slice; ids elsewhere become out of range."""
    local = ids - (layout.local_page_offset(pages_per_shard) if layout is not None else 0)
    return jnp.where((ids >= 0) & (local >= 0) & (local < pages_per_shard), local, pages_per_shard)


def copy_pages_local(
    pages: PageTree, _: object, src: jax.Array, dst: jax.Array, *, layout: PageLayout | None
) -> PageTree:
    """Copy page ``src[i]`` onto page ``dst[i]`` in every layer of every stacked array of
    ``pages`` (one shard).

    All sources are read before any destination is written. A pair is applied only when both
    pages lie in this device's slice; pairs with an id of -1 are padding.
    """

    def one(leaf: jax.Array) -> jax.Array:
        n = leaf.shape[2]
        s = _local_page_ids(src, layout, n)
        d = _local_page_ids(dst, layout, n)
        d = jnp.where(s < n, d, n)
        return leaf.at[:, :, d].set(leaf[:, :, jnp.minimum(s, n - 1)], mode="drop")

    copied: PageTree = jax.tree.map(one, pages)
    return copied


def zero_pages_local(pages: PageTree, _: object, ids: jax.Array, *, layout: PageLayout | None) -> PageTree:
    """Zero the pages ``ids`` (global ids, -1 padding) in every layer of every stacked array of
    ``pages`` (one shard)."""

    def one(leaf: jax.Array) -> jax.Array:
        local = _local_page_ids(ids, layout, leaf.shape[2])
        return leaf.at[:, :, local].set(jnp.zeros((), leaf.dtype), mode="drop")

    zeroed: PageTree = jax.tree.map(one, pages)
    return zeroed


def page_op(layout: PageLayout | None, op: Callable[..., PageTree]) -> Callable[..., PageTree]:
    """Bind ``op(pages, *ids, layout=)`` to run shard-locally under ``layout``."""
    return lambda pages, *ids: run_local(partial(op, layout=layout), layout, pages, (), ids)
