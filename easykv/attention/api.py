"""Paged attention: queries attend to keys and values read through page tables.

One entry point serves a :class:`~easykv.step.ragged.RaggedStep` (the page manager's steps) and the
three forms of EasyDeL's :class:`~easykv.step.metadata.PagedAttentionMetadata`, each converted once to
the ragged form where it enters (``checks.prepare``):

* **decode** (EasyDeL's decode form): ``q`` is ``(batch, num_q_heads, head_dim)``, one query per
  sequence; sequence ``b`` sees keys ``0 .. decodes_position[b]`` (its new token already written).
* **chunked prefill** (EasyDeL's prefill form): ``q`` is ``(padded_len, num_q_heads, head_dim)``;
  query ``t`` at ``prefill_position[t]`` sees keys ``0 .. prefill_position[t]`` (the cached prefix
  and the chunk itself, causally). Rows ``>= prefill_length`` are padding.
* **mixed** (continuous batching; a `RaggedStep`): ``q`` is ``(num_tokens, num_q_heads,
  head_dim)``; token ``t`` of sequence ``b`` (``query_start_loc[b] <= t < query_start_loc[b + 1]``,
  ``b < num_seqs``) sees keys ``0 .. positions[t]`` of sequence ``b``.

Padding rows (position -1, or outside every sequence) come back as zeros. Options: grouped-query
attention (q heads a multiple of kv heads; q head ``i`` reads kv head ``i // group``), a sliding
window (a query at ``p`` sees keys in ``(p - window, p]``), a logit soft cap
(``cap * tanh(s / cap)``) and the softmax scale (default ``head_dim ** -0.5``). Scores, softmax and
the weighted sum are float32; the output has q's dtype.

The entry points and the jitted dispatch live here: :func:`run` places the computation in
``shard_map`` over the page layout and calls, per device, the XLA path (``xla.py``) or a
Pallas kernel, TPU or GPU (``pallas.py``); :func:`paged_attention_reference` runs the dense reference
(``reference.py``). Every argument is checked first, in ``checks.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Unpack, cast

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from numpy.typing import DTypeLike

from easykv.attention.checks import Config, Pages, prepare, view_pages
from easykv.attention.options import (
    IMPLEMENTATIONS,
    AttentionKeywords,
    AttentionOptions,
    ReferenceKeywords,
    ViewKeywords,
)
from easykv.attention.pallas import pallas_decode_local, pallas_gpu_decode_local
from easykv.attention.reference import dense_reference
from easykv.attention.rows import query_rows
from easykv.attention.xla import attend_local
from easykv.quantization import Rotation
from easykv.spec.groups import AttentionKind, LayerGroup
from easykv.step.checks import Array
from easykv.step.metadata import StepInput, group_runtime
from easykv.step.ragged import RaggedStep
from easykv.storage.pages import Layer, PageLayout

if TYPE_CHECKING:
    from easykv.storage.view import PagedAttentionCacheView


class ImplementationKeywords(AttentionKeywords, total=False):
    """`paged_attention_implementation`'s ``**options``: paged_attention's keywords, ``sinks`` and
    ``layer`` included."""

    sinks: Array | None
    layer: Layer | None


# ---- public API ---------------------------------------------------------------------------------
def paged_attention(
    q: Array,
    key_pages: Pages,
    value_pages: Pages | None,
    metadata: StepInput,
    sinks: Array | None = None,
    layer: Layer | None = None,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    value_head_dim: int | None = None,
    logit_soft_cap: float | None = None,
    layout: PageLayout | None = None,
    dtype: DTypeLike | None = None,
    implementation: str = "auto",
    pages_per_block: int | None = None,
    query_block: int | None = None,
) -> jax.Array:
    """Attention of ``q`` over the cached keys/values named by ``metadata``'s page tables.

    Args:
      q: decode ``(batch, num_q_heads, head_dim)``; prefill ``(padded_len, num_q_heads,
        head_dim)``; mixed ``(num_tokens, num_q_heads, head_dim)``. float32/bfloat16/float16.
      key_pages: ``(num_kv_heads, num_pages, page_size, head_dim)`` in the logical dtype or its
        storage dtype (raw uint bits on CPU), or `QuantizedPages` of a quantizer.
      value_pages: as ``key_pages``; plain value pages may have another head dim than the keys,
        ``v_head_dim``; the output then has it. ``None``: a latent cache (DeepSeek's MLA stores
        one vector per token, no separate values): the values are the first ``value_head_dim``
        dims of each key, read with it, never stored twice.
      metadata: the step: a :class:`RaggedStep` (an item of the page manager's ``plan.metadata``) or a
        decode, prefill or mixed :class:`PagedAttentionMetadata`. Host (numpy) values are checked
        against the pool before anything runs (but for what the step's builder proved).
      layer: the pages are a layer group's stack ``(layers, num_kv_heads, num_pages, page_size,
        head_dim)`` (as a cache stores them) and layer ``layer`` is read: an int, or a traced
        index inside a ``lax.scan`` over the layers. Only that layer's pages named by the page
        table are read; the layer is never sliced out of the stack.
      sinks: ``(num_q_heads,)`` float logits, one per q head, that join every query's softmax
        as an extra key with no value (attention sinks, as gpt-oss): the weights of the real
        keys then sum to less than one. Not scaled, not capped.
      scale: softmax scale, default ``head_dim ** -0.5``.
      sliding_window: a query at position ``p`` sees keys in ``(p - sliding_window, p]``.
      chunk_size: chunked-local attention (Llama 4): a query at position ``p`` sees only the
        keys of its own chunk, ``[p - p % chunk_size, p]``. With ``sliding_window`` too, both
        apply.
      value_head_dim: with ``value_pages=None`` only: how many leading dims of a key are its
        value (MLA: 512 of the 576 latent dims; the other 64 carry the rotary part).
      logit_soft_cap: scores become ``cap * tanh(score / cap)`` (after scaling).
      layout: how the pages are split over the mesh. ``None``: taken from the pages' own
        ``NamedSharding`` when they are concrete arrays, else one device. Inside an outer ``jit``
        pass it (or use :func:`view_attention`) so the computation stays shard-local.
      dtype: logical dtype of the pages; needed when they are stored as raw bits (uint16/uint8).
      implementation: ``"auto"``, ``"xla"``, ``"pallas_tpu"``, ``"pallas_gpu"`` or
        ``"pallas_gpu_interpret"`` (the GPU kernel in Pallas interpret mode, on any platform; see
        ``pallas.py`` and :func:`paged_attention_implementation`).
      pages_per_block: pages per key/value block of the XLA path (default: 256 tokens' worth).
      query_block: query rows per block for prefill and mixed batches (default 32); a
        sequence's last block is masked past its end, except that fewer than 4 rows left (a
        decode) go row by row.

    Returns:
      ``(tokens, num_q_heads, v_head_dim)`` in ``q.dtype``; padding rows are zeros.
    """
    options = AttentionOptions.from_arguments(locals())  # first statement: locals() holds the arguments only
    cfg, step_meta = prepare(q, key_pages, value_pages, metadata, options, sinks=sinks, layer=layer)
    out: jax.Array = run(q, key_pages, value_pages, step_meta, sinks, layer, cfg=cfg)
    return out


def view_attention(q: Array, view: PagedAttentionCacheView,
                   metadata: StepInput | Sequence[StepInput],
                   **options: Unpack[ViewKeywords]) -> jax.Array:
    """:func:`paged_attention` over one layer's :class:`~easykv.storage.cache.PagedAttentionCacheView`:
    its group's stacked pages read at its layer, its layout and its logical dtype. The view's
    layer group decides how the layer attends: a sliding or chunked group's window and a latent
    group's ``value_head_dim`` are passed on, and an option that says otherwise is refused.

    Args:
      q: ``(num_tokens, num_q_heads, head_dim)`` float32 / bfloat16 / float16, as in
        `paged_attention` (decode ``(batch, ...)``, prefill ``(padded_len, ...)``).
      view: the layer's `PagedAttentionCacheView` (``cache[i]``, or ``view.at_layer(i)`` in a
        scan over a group's layers).
      metadata: one step for every layer group (a `RaggedStep`, or a decode, prefill or mixed
        `PagedAttentionMetadata`), or a sequence of one per layer group of the view's cache (the
        plan's ``plan.metadata``; the view's group's is used).
      **options: `paged_attention`'s keywords but ``layer``, ``layout`` and ``dtype`` (taken from
        the view; passing one is a ValueError).

    Returns:
      ``(num_tokens, num_q_heads, v_head_dim)`` in ``q.dtype``; padding rows are zeros.
    """
    for key in ("layer", "layout", "dtype"):
        if key in options:
            raise ValueError(f"view_attention takes {key} from the view; do not pass {key}=")
    keys, values, layer = view_pages(view)
    group = getattr(view, "layer_group", None)
    if group is not None:
        metadata = group_runtime(metadata, len(view.metadata.groups), view.group)
        options = cast(ViewKeywords, {**options, **_group_options(group, options)})
    # A view of no layer group (duck-typed) passes its metadata on as it is: paged_attention
    # refuses anything but one step by name.
    return paged_attention(q, keys, values, cast(StepInput, metadata), layer=layer, layout=view.layout,
                           dtype=view.dtype, **options)


def _group_options(group: LayerGroup, options: Mapping[str, object]) -> dict[str, int]:
    """The attention a layer group declares (its window or chunk, a latent's value dims): the
    view's layer attends that way, and an option that says otherwise is refused (a full group
    keeps every page, so any window may be read from it)."""
    kind = group.attention
    implied: dict[str, int | None] = {
        "sliding_window": group.window if kind is AttentionKind.SLIDING else None,
        "chunk_size": group.window if kind is AttentionKind.CHUNKED else None,
        "value_head_dim": group.value_head_dim if group.latent else None}
    implied = {k: v for k, v in implied.items() if v is not None}
    if kind.windowed:  # the other of window and chunk: none
        implied.setdefault("chunk_size" if kind is AttentionKind.SLIDING else "sliding_window", None)
    for key, value in implied.items():
        given = options.get(key)
        if given is not None and given != value:
            what = f"{kind}" + (f" (window {group.window})" if group.window else "") + (
                ", latent" if group.latent else "")
            raise ValueError(f"view_attention: the view's layer group (layers {group.span}) is {what}, so {key}="
                             f"{value}; got {key}={given!r}. The group's metadata decides how its layers attend")
    return {k: v for k, v in implied.items() if v is not None}


def paged_attention_implementation(
    q: Array,
    key_pages: Pages,
    value_pages: Pages | None,
    metadata: StepInput,
    **options: Unpack[ImplementationKeywords],
) -> str:
    """The implementation ``paged_attention`` (same arguments) would run: ``"xla"`` or
    one of the Pallas kernels (``"pallas_tpu"``, ``"pallas_gpu"``, ``"pallas_gpu_interpret"``).
    Raises what ``paged_attention`` would raise for bad input.

    Args:
      q: as in `paged_attention`.
      key_pages: as in `paged_attention`.
      value_pages: as in `paged_attention` (``None``: a latent cache).
      metadata: as in `paged_attention`.
      **options: `paged_attention`'s keywords, ``sinks`` and ``layer`` included.
    """
    given: dict[str, Any] = dict(options)  # the options, checked as AttentionOptions builds them
    sinks, layer = given.pop("sinks", None), given.pop("layer", None)
    return prepare(q, key_pages, value_pages, metadata, AttentionOptions(**given), sinks=sinks,
                   layer=layer)[0].implementation


def paged_attention_reference(
    q: Array, key_pages: Pages, value_pages: Pages | None, metadata: StepInput,
    sinks: Array | None = None, layer: Layer | None = None, **options: Unpack[ReferenceKeywords]
) -> jax.Array:
    """Dense reference: gather every sequence's whole page-table row into contiguous keys and
    values, then masked softmax attention in float32 for every query row. Memory and time grow
    with ``num_tokens x pages_per_sequence x page_size``: for tests, not for serving.

    Args:
      q: ``(num_tokens, num_q_heads, head_dim)`` float32 / bfloat16 / float16, as in
        `paged_attention`.
      key_pages: ``(num_kv_heads, num_pages, page_size, head_dim)`` (or a layer group's stack
        ``(layers, ...)`` with ``layer``), as in `paged_attention`.
      value_pages: as ``key_pages``; ``None`` for a latent cache (with ``value_head_dim``).
      metadata: a `RaggedStep`, or a decode, prefill or mixed `PagedAttentionMetadata`.
      sinks: ``(num_q_heads,)`` float sink logits, or ``None``; as in `paged_attention`.
      layer: the layer of stacked pages to read (``None``: one layer's pages).
      **options: ``scale``, ``sliding_window``, ``chunk_size``, ``value_head_dim``,
        ``logit_soft_cap`` and ``dtype``, as in `paged_attention`. The reference runs unsplit and
        unblocked, with no kernel choice, so the other options are refused (ValueError).

    Returns:
      ``(num_tokens, num_q_heads, v_head_dim)`` in ``q.dtype``; padding rows are zeros.
    """
    unknown = sorted(set(options) - set(REFERENCE_OPTIONS))
    if unknown:
        raise ValueError(f"paged_attention_reference takes the options {', '.join(REFERENCE_OPTIONS)}; got "
                         f"{', '.join(unknown)}")
    given: dict[str, Any] = dict(options)  # the options, checked as AttentionOptions builds them
    cfg, step_meta = prepare(q, key_pages, value_pages, metadata, AttentionOptions(**given, implementation="xla"),
                      sinks=sinks, layer=layer, infer_layout=False)
    if layer is None:
        key_pages = jax.tree.map(lambda a: jnp.asarray(a)[None], key_pages)
        value_pages = jax.tree.map(lambda a: jnp.asarray(a)[None], value_pages)
    out: jax.Array = dense_reference(q, key_pages, value_pages, step_meta, sinks, 0 if layer is None else layer,
                                     cfg=cfg)
    return out


REFERENCE_OPTIONS = tuple(ReferenceKeywords.__annotations__)  # in order: what its message lists


# ---- the computation ----------------------------------------------------------------------------
def _local_path(cfg: Config) -> Callable[..., jax.Array]:
    """The per-device computation of ``cfg``: ``(q, kp, vp, rows, sinks, layer) -> out``.

    Pages of a rotating quantizer are read in its rotated basis: ``q . k = (R q) . (R k)``, so
    the query is rotated once, and the weighted sum of rotated values is rotated back once (a
    latent cache's values are the leading dims of its keys: the whole rotated key is summed and
    only those dims are taken back). No page is ever rotated."""
    paths: dict[str, Callable[..., jax.Array]] = {
        "pallas_tpu": pallas_decode_local, "pallas_gpu": pallas_gpu_decode_local,
        "pallas_gpu_interpret": partial(pallas_gpu_decode_local, interpret=True)}
    path = paths.get(cfg.implementation, attend_local)
    rotation = cfg.rotation
    if rotation is None:
        return partial(path, cfg=cfg)
    latent_dim, value_rotation = cfg.latent_value_dim, cfg.value_rotation
    inner = partial(path, cfg=cfg if latent_dim is None else dataclasses.replace(cfg, latent_value_dim=rotation.dim))

    def rotated(q: jax.Array, kp: Any, vp: Any, rows: Any, sinks: jax.Array, layer: jax.Array) -> jax.Array:
        out = inner(rotation.apply(q), kp, vp, rows, sinks, layer)
        if latent_dim is not None:
            back = rotation.undo_leading(out, latent_dim)
        else:  # plain value pages of the keys' quantizer: it rotated them too
            back = cast(Rotation, value_rotation).undo(out)
        return back.astype(q.dtype)

    return rotated


@partial(jax.jit, static_argnames=("cfg",))
def run(q: Array, key_pages: Pages, value_pages: Pages | None, step_meta: RaggedStep,
        sinks: Array | None = None,
        layer: Layer | None = None, *, cfg: Config) -> jax.Array:
    """The checked call: ``step_meta`` in the ragged form, ``sinks`` None or checked, ``layer`` None
    (one layer's pages) or the layer of stacked pages, ``cfg`` from `checks.prepare`."""
    q = jnp.asarray(q)
    # Pages may be pytrees (quantized values + scales): every leaf is split like the pages on
    # its (kv head, page) axes. One layer's pages become a stack of one (a reshape, no copy),
    # so every path reads a stack at a layer.
    kp, vp = jax.tree.map(jnp.asarray, key_pages), jax.tree.map(jnp.asarray, value_pages)
    if layer is None:
        kp, vp, layer = jax.tree.map(lambda a: a[None], kp), jax.tree.map(lambda a: a[None], vp), 0
    layer = jnp.asarray(layer, jnp.int32)
    rows = query_rows(step_meta, q.shape[0])
    # No sinks: a sink of -inf adds nothing to any softmax (the one path serves both).
    sinks = jnp.full(q.shape[1], -jnp.inf, jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32)
    layout = cfg.layout
    local = _local_path(cfg)
    if layout is None:
        return local(q, kp, vp, rows, sinks, layer)
    heads = layout.spec[1]
    q_spec = PartitionSpec(None, heads, None)

    def page_specs(pages: Any) -> Any:
        return jax.tree.map(lambda leaf: layout.spec_for(leaf.ndim), pages)

    mapped = jax.shard_map(
        local,
        mesh=layout.mesh,
        # rows, layer: replicated; sinks: split like the q heads
        in_specs=(q_spec, page_specs(kp), page_specs(vp), PartitionSpec(), PartitionSpec(heads), PartitionSpec()),
        out_specs=q_spec,
        # The loops' carries start replicated and become head-/replica-varying: skip the
        # varying-axes type check rather than cast every carry.
        check_vma=False,
    )
    return mapped(q, kp, vp, rows, sinks, layer)


__all__ = [
    "IMPLEMENTATIONS",
    "REFERENCE_OPTIONS",
    "paged_attention",
    "paged_attention_implementation",
    "paged_attention_reference",
    "view_attention",
]
