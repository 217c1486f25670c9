"""The one write primitive: scatter new K/V tokens into pages by slot.

A slot is ``page_id * page_size + offset``. ``PAD_SLOT`` (-1) marks padding and is dropped
without notice; any other slot outside the pool is dropped and counted, never clipped into a
neighbouring page. Prefill, decode and mixed writes only differ in how they derive the slots.
Pages with a scale per page (``int4-ch``) are written by a read-modify-write of the pages the
tokens land in (``scatter_page_scaled_local``); every other format is a plain scatter of rows.

A write reads a step in the ragged form (`RaggedStep`); EasyDeL's forms are converted once where they
enter (`token_slots`, through ``step.metadata.as_mixed``). Values of host-side (numpy) metadata are
checked before anything is written; inside jit, where values are unknown until run time, the count
of dropped tokens is returned instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from easykv.quantization import QuantizedPages, scales_per_page
from easykv.spec.groups import known_size
from easykv.spec.metadata import PagedAttentionCacheMetaData, known_dtype
from easykv.step.checks import Array, check_slots
from easykv.step.metadata import StepInput, as_mixed
from easykv.step.ragged import PAD_SLOT, array_module
from easykv.storage.pages import Layer, PageLayout, PageTree, StoredPages, encode_tokens, run_local

#: New keys (or values) of every layer: one ``(num_layers, num_tokens, num_kv_heads, head_dim)``
#: array, or one ``(num_tokens, num_kv_heads, head_dim)`` array per layer (None: a latent layer's values).
LayerRows: TypeAlias = Array | list[Array | None] | tuple[Array | None, ...]
#: The step metadata a write takes: one for every layer group, or a sequence of one per group (a plan's
#: ``plan.metadata``); each a `RaggedStep` or EasyDeL's `PagedAttentionMetadata`.
WriteMetadata: TypeAlias = StepInput | Sequence[StepInput]


def token_slots(metadata: StepInput, meta: PagedAttentionCacheMetaData, group: int = 0) -> Array:
    """The slot of every token row a write with ``metadata`` into layer group ``group``'s pool
    receives, shape (num_tokens,), checked on the host (numpy) unless the step's builder (the
    page manager, a validated constructor) already checked them against this pool; device slots
    pass through (their bad ones are dropped and counted in the write). The write's entry: an
    EasyDeL form is converted here, once (`as_mixed`)."""
    pages = known_size(meta.groups[group].num_pages)
    entry = as_mixed(metadata, page_size=meta.page_size, num_pages=pages,
                     pages_per_sequence=meta.num_pages_per_sequence)
    slots = entry.step_meta.slot_mapping
    mark = entry.proof
    if mark is not None and (mark.num_pages, mark.page_size) == (pages, meta.page_size):
        return slots
    return check_slots_on_host(slots, pages * meta.page_size)


def count_dropped(slots: Array, capacity: int) -> Array:
    """Real tokens (not padding) whose slot lies outside ``[0, capacity)``."""
    xp = array_module(slots)
    dropped: Array = xp.sum((slots != PAD_SLOT) & ((slots < 0) | (slots >= capacity))).astype(np.int32)
    return dropped


def check_slots_on_host(slots: ArrayLike, capacity: int) -> Array:
    """Host slots (a list or numpy array) checked before anything is written (see
    `step.checks.check_slots`) and returned as int32; device arrays pass through."""
    return slots if isinstance(slots, jax.Array) else check_slots(slots, capacity)


def check_new_tokens(key: Array, value: Array | None, *, metadata: PagedAttentionCacheMetaData, num_tokens: int,
                     group: int = 0) -> None:
    """New K/V of one layer of group ``group``: see :func:`check_token_rows`."""
    check_token_rows(key, metadata=metadata, num_tokens=num_tokens, group=group, values=False, name="key")
    check_token_rows(value, metadata=metadata, num_tokens=num_tokens, group=group, values=True, name="value")


def check_token_rows(x: Array | jax.ShapeDtypeStruct | None, *, metadata: PagedAttentionCacheMetaData,
                     num_tokens: int, group: int, values: bool, name: str) -> None:
    """New keys (or values) of a layer of group ``group`` must be (num_tokens, num_kv_heads,
    head_dim) of the group in the cache dtype; a latent group takes no values (None)."""
    g = metadata.groups[group]
    where = "" if metadata.is_uniform else f" (layers {g.span}: {g.num_kv_heads} kv heads of {g.key_head_dim}" + (
        f" / {g.value_head_dim} dims)" if g.has_values else " dims, latent)")
    if values and not g.has_values:
        if x is not None:
            raise ValueError(f"{name} must be None for a latent layer group{where}: it stores one vector per token "
                             "(the values are its first value_head_dim dims); write the latent as the key")
        return
    want = (num_tokens, g.num_kv_heads, g.value_head_dim if values else g.key_head_dim)
    if x is None:
        raise ValueError(f"{name} has None, expected (num_tokens, num_kv_heads, head_dim) = {want}{where}")
    shape, dtype = tuple(np.shape(x)), getattr(x, "dtype", None)
    if shape != want:
        raise ValueError(f"{name} has shape {shape}, expected (num_tokens, num_kv_heads, head_dim) = {want}{where}")
    stores = known_dtype(metadata.group_dtype(g))
    if dtype is None or np.dtype(dtype) != stores:
        raise ValueError(
            f"{name} has dtype {dtype}, but the cache stores {stores.name}{where}; "
            f"cast with .astype({stores.name}) first (a silent cast would hide a model bug)"
        )


def check_layer_rows(x: LayerRows | None, name: str, meta: PagedAttentionCacheMetaData, num_tokens: int, *,
                     values: bool) -> Array | tuple[Array | None, ...] | None:
    """Check the new keys (or values) of every layer (`PagedAttentionCache.write`) without
    slicing them on the host: a stacked array stays one array (sliced inside the jit, checked
    once per group), a sequence stays a tuple (checked per layer). Latent groups take no values:
    None in their layers' places, or None for all when every group is latent."""
    latent_only = values and not any(g.has_values for g in meta.groups)
    if x is None and latent_only:
        return None
    items: tuple[Array | None, ...] | None = None
    whole: Array | None = None  # one array for every layer
    if isinstance(x, (list, tuple)):
        count, items = len(x), tuple(x)
    elif x is not None and np.ndim(x) == 4:
        count, whole = int(np.shape(x)[0]), x
    else:
        got = () if x is None else np.shape(x)
        raise ValueError(
            f"{name} must be (num_layers, num_tokens, num_kv_heads, head_dim) or a sequence of "
            f"per-layer arrays{' (None for latent layers)' if values else ''}, got shape {got}")
    if count != meta.num_hidden_layers:
        raise ValueError(
            f"{name} holds {count} layers but the cache has num_hidden_layers={meta.num_hidden_layers}"
        )
    checks: list[tuple[int, Array | jax.ShapeDtypeStruct | None, str]]
    if whole is not None:  # one array for every layer: every group must take its shape
        if values and any(not g.has_values for g in meta.groups):
            raise ValueError(f"{name} is one array for every layer, but layers "
                             f"{[g.span for g in meta.groups if not g.has_values]} are latent and take no values; "
                             "give a sequence of per-layer arrays with None for latent layers")
        one = jax.ShapeDtypeStruct(tuple(np.shape(whole))[1:], whole.dtype)
        checks = [(g, one, name) for g in range(len(meta.groups))]
    else:
        checks = [(meta.group_of(i)[0], item, f"{name}[{i}]") for i, item in enumerate(items or ())]
    for g, item, label in checks:
        check_token_rows(item, metadata=meta, num_tokens=num_tokens, group=g, values=values, name=label)
    return items if items is not None else whole


def scatter_encoded_local(pages: PageTree, new: object, slots: jax.Array, layer: Layer | None = None, *,
                          layout: PageLayout | None) -> PageTree:
    """One shard: put token rows ``new`` at ``slots`` (local slots only) into stacked ``pages``
    ``(layers, heads, pages, page_size, ...)``: rows ``(layers, tokens, heads, ...)`` into every
    layer when ``layer`` is None, else rows ``(tokens, heads, ...)`` into layer ``layer`` (an int
    or a traced index; one outside the stack drops the rows). One scatter per array either way;
    the stack is updated in place, never sliced."""

    def one(leaf: jax.Array, upd: jax.Array) -> jax.Array:
        p, s = leaf.shape[2:4]
        offset = layout.local_page_offset(p) * s if layout is not None else 0
        local = slots - offset
        # A slot of another shard, or padding, gets page p: outside the shard, dropped.
        page = jnp.where((slots >= 0) & (local >= 0) & (local < p * s), local // s, p)
        at = [page, local % s]
        # Indexed by (page, offset) on the stack as stored: a reshape to flat slots would make
        # XLA copy the whole stack when it lays out a scan's carry differently. Updates stay
        # token-major: their window dims map onto the layer, head and trailing dims.
        window: tuple[int, ...]
        inserted: tuple[int, ...]
        if layer is None:  # (layers, tokens, heads, ...)
            window, inserted = (0, *range(2, upd.ndim)), (2, 3)
        else:  # (tokens, heads, ...)
            window, inserted = tuple(range(1, upd.ndim)), (0, 2, 3)
            at.insert(0, jnp.broadcast_to(jnp.asarray(layer, jnp.int32), page.shape))
        dims = jax.lax.ScatterDimensionNumbers(update_window_dims=window, inserted_window_dims=inserted,
                                               scatter_dims_to_operand_dims=inserted)
        return jax.lax.scatter(leaf, jnp.stack(at, axis=1), upd, dims, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)

    def entry(p: Any, upd: Any) -> Any:
        if isinstance(p, QuantizedPages) and scales_per_page(p.quantizer):
            return scatter_page_scaled_local(p, upd, slots, layer, layout=layout)
        return jax.tree.map(one, p, upd)

    written: PageTree = jax.tree.map(entry, pages, new, is_leaf=lambda x: isinstance(x, QuantizedPages))
    return written


# Pages whose earlier tokens are requantized per pass of the write's loop (see below).
_REQUANT_CHUNK = 256


def scatter_page_scaled_local(pages: QuantizedPages[jax.Array], rows: jax.Array, slots: jax.Array,
                              layer: Layer | None = None, *, layout: PageLayout | None) -> QuantizedPages[jax.Array]:
    """One shard: write token rows (floats in the logical dtype) into pages whose scales are
    per page and channel (``int4-ch``): a read-modify-write of the pages touched.

    A page entered at its first slot starts over (its scales belonged to an earlier owner). Every
    other page touched keeps its tokens: its scale becomes the larger of its own and what the new
    tokens need, its earlier codes are requantized to the grown step, then the new tokens are
    written under it. Tokens are grouped by page with a sort, so each page's scale is set once
    and each page is requantized once, whatever the order of the slots; cost grows with the
    tokens written (and the pages they land in), never with the pool.
    """
    q = pages.quantizer
    if not scales_per_page(q):
        raise ValueError(f"{q.name} pages keep their scales per token; write them with scatter_encoded_local")
    t = slots.shape[0]
    if t == 0:
        return pages
    values, scales = pages.values, pages.scales  # (L, H, P, S, d/2), (L, H, P, d)
    num_layers, _, p, s = values.shape[:4]
    base = layout.local_page_offset(p) * s if layout is not None else 0
    local = slots - base
    ok = (slots >= 0) & (local >= 0) & (local < p * s)
    page = jnp.where(ok, local // s, p)  # p: outside the shard, dropped
    offset = jnp.where(ok, local % s, 0)
    if layer is None:  # rows (L, T, H, d) into every layer
        layers = jnp.arange(num_layers, dtype=jnp.int32)
    else:  # rows (T, H, d) into layer ``layer``; one outside the stack drops them
        layer = jnp.asarray(layer, jnp.int32)
        # .at[] would read a negative index from the end: every index outside the stack -> L
        layers, rows = jnp.where((layer >= 0) & (layer < num_layers), layer, num_layers)[None], rows[None]
    li = layers[:, None]

    # Group the tokens by page: sorted order, a segment per page.
    order = jnp.argsort(page, stable=True)
    sorted_page = page[order]
    first = jnp.concatenate([jnp.ones((1,), bool), sorted_page[1:] != sorted_page[:-1]])
    segment = jnp.cumsum(first) - 1  # (T,)
    need = jnp.moveaxis(q.needed_codes(rows)[:, order], 1, 0)  # (T, n, H, d), sorted
    page_need = jax.ops.segment_max(need, segment, num_segments=t, indices_are_sorted=True)
    fresh = jax.ops.segment_max((ok & (offset == 0)).astype(jnp.int32)[order], segment, num_segments=t,
                                indices_are_sorted=True) > 0

    # The page's scale before the write (0 for a page that starts over) and after it.
    at = sorted_page[None, :]
    old = jnp.where(fresh[segment][None, :, None, None], 0, scales.at[li, :, at].get(mode="fill", fill_value=0))
    new = jnp.maximum(old, jnp.moveaxis(page_need[segment], 0, 1))  # (n, T, H, d), sorted
    own = jnp.where(first, sorted_page, p)[None, :]  # one writer per page
    scales = scales.at[li, :, own].set(new, mode="drop")

    # Requantize the earlier codes of every page that keeps them, a chunk of pages at a time.
    keeps = first & (sorted_page < p) & ~fresh[segment]
    rank = jnp.cumsum(keeps) - 1
    chunk = min(t, _REQUANT_CHUNK)

    def requantize(c: Any, vals: jax.Array) -> jax.Array:
        (idx,) = jnp.nonzero(keeps & (rank // chunk == c), size=chunk, fill_value=t)
        pick = jnp.minimum(idx, t - 1)
        where = jnp.where(idx < t, sorted_page[pick], p)[None, :]
        held = vals.at[li, :, where].get(mode="fill", fill_value=0)  # (n, chunk, H, S, d/2)
        redone = q.requantize(held, old[:, pick][..., None, :], new[:, pick][..., None, :])
        return vals.at[li, :, where].set(redone.astype(vals.dtype), mode="drop")

    values = jax.lax.fori_loop(0, (jnp.sum(keeps) + chunk - 1) // chunk, requantize, values)

    # The new tokens under their page's new scale, scattered by (page, offset).
    scale_of = jnp.zeros_like(new).at[:, order].set(new)  # back to the tokens' order
    codes = q.encode(rows, scale_of).astype(values.dtype)  # (n, T, H, d/2)
    values = values.at[li, :, page[None, :], offset[None, :]].set(codes, mode="drop")
    return QuantizedPages(values, scales, q)


def scatter_kv(
    key_pages: StoredPages,
    value_pages: StoredPages | None,
    key: Array,
    value: Array | None,
    slots: Array,
    layer: Layer | None = None,
    *,
    layout: PageLayout | None,
) -> tuple[StoredPages, StoredPages | None]:
    """Write token rows ``key[..., t, :, :]``/``value[..., t, :, :]`` at ``slots[t]`` into
    stacked pages: ``(layers, tokens, heads, head_dim)`` into every layer (``layer=None``) or
    ``(tokens, heads, head_dim)`` into layer ``layer``.

    Each device writes only into its own shard: the new tokens are split by kv head like the
    pages, and each page slice keeps the slots that fall inside it.
    """
    new_k = encode_tokens(jnp.asarray(key), key_pages)
    new_v = None if value_pages is None else encode_tokens(jnp.asarray(value), value_pages)  # None: a latent group
    written = scatter_encoded((key_pages, value_pages), (new_k, new_v), slots, layer, layout=layout)
    return written


def scatter_encoded(pages: PageTree, new: object, slots: Array, layer: Layer | None = None, *,
                    layout: PageLayout | None) -> PageTree:
    """Token rows ``new`` already in the pages' storage form (``encode_tokens``, or a quantized
    sequence's raw codes and scales) written at ``slots`` into ``pages``, a pytree of stacked
    page arrays matched leaf for leaf by ``new`` (every layer's rows, or layer ``layer``'s): one
    ``shard_map`` for all of them, each device writing into its own shard."""
    slots = jnp.asarray(slots, jnp.int32)
    if layer is None:
        return run_local(lambda p, upd, s: scatter_encoded_local(p, upd, s, layout=layout),
                         layout, pages, new, (slots,), head_axis=2)
    return run_local(lambda p, upd, s, i: scatter_encoded_local(p, upd, s, i, layout=layout),
                     layout, pages, new, (slots, jnp.asarray(layer, jnp.int32)), head_axis=1)
