"""Paged attention: queries attend to keys and values read through page tables.

One entry point serves the three forms of :class:`~easykv.runtime.PagedAttentionMetadata`:

* **decode** (EasyDeL's decode form): ``q`` is ``(batch, num_q_heads, head_dim)``, one query per
  sequence; sequence ``b`` sees keys ``0 .. decodes_position[b]`` (its new token already written).
* **chunked prefill** (EasyDeL's prefill form): ``q`` is ``(padded_len, num_q_heads, head_dim)``;
  query ``t`` at ``prefill_position[t]`` sees keys ``0 .. prefill_position[t]`` (the cached prefix
  and the chunk itself, causally). Rows ``>= prefill_length`` are padding.
* **mixed** (continuous batching): ``q`` is ``(num_tokens, num_q_heads, head_dim)``; token ``t`` of
  sequence ``b`` (``query_start_loc[b] <= t < query_start_loc[b + 1]``, ``b < num_seqs``) sees keys
  ``0 .. positions[t]`` of sequence ``b``.

Padding rows (position -1, or outside every sequence) come back as zeros. Options: grouped-query
attention (q heads a multiple of kv heads; q head ``i`` reads kv head ``i // group``), a sliding
window (a query at ``p`` sees keys in ``(p - window, p]``), a logit soft cap
(``cap * tanh(s / cap)``) and the softmax scale (default ``head_dim ** -0.5``). Scores, softmax and
the weighted sum are float32; the output has q's dtype.

The XLA path (every backend)
----------------------------
Cost follows the tokens actually cached, not ``batch x max length``: a loop over sequences runs,
for each query block of a sequence, a ``while_loop`` over blocks of ``pages_per_block`` pages
whose trip count is that block's own need (``ceil((max position + 1) / block_tokens)``, starting
at the window's first block), with an online (flash-decoding) softmax across blocks. Only the
pages a sequence really uses are gathered, so a batch with lengths uniform in ``[1, L]`` costs
about half the batch all at ``L``.

Placement: the computation runs in ``shard_map`` over the page layout. Each device holds some kv
heads and the matching q heads (split in the same contiguous groups), so head-sharded pages need
no cross-device traffic at all. With the page axis split over data-parallel replicas each
sequence's pages live in one replica's slice (checked on the host): the replica holding the page
of a query block's last key computes that block, the others skip it (zero trips), and one
all-reduce of the *output* (tokens x q heads x head_dim, never pages) over the page axes combines
them. Inside jit, page ids outside the pool (or outside this replica's slice) are never read: their
keys are masked out, never clipped onto another page.

Pallas TPU path
---------------
On TPU, decode without a sliding window, on pages stored in their own dtype (bf16/f32) with
``head_dim % 128 == 0`` and an unsplit page axis, goes to JAX's Pallas ``paged_attention`` kernel
(whose page layout is ours), called per device inside the same ``shard_map``.
:func:`paged_attention_implementation` says which path a call takes; ``implementation=`` forces
one.

Pages are read through one function, :func:`_load_pages`, which turns stored pages (raw bits on
CPU, see ``pages.py``) into float32 values; quantized pages will be dequantized there.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from easykv.attention.checks import IMPLEMENTATIONS, _Config, _prepare, _stored, _view_pages
from easykv.storage.pages import PageLayout, read_pages
from easykv.runtime import PagedAttentionMetadata


# ---- public API ---------------------------------------------------------------------------------
def paged_attention(
    q: Any,
    key_pages: Any,
    value_pages: Any,
    metadata: PagedAttentionMetadata,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    layout: PageLayout | None = None,
    dtype: Any = None,
    implementation: str = "auto",
    pages_per_block: int | None = None,
    query_block: int | None = None,
) -> jax.Array:
    """Attention of ``q`` over the cached keys/values named by ``metadata``'s page tables.

    Args:
      q: decode ``(batch, num_q_heads, head_dim)``; prefill ``(padded_len, num_q_heads,
        head_dim)``; mixed ``(num_tokens, num_q_heads, head_dim)``. float32/bfloat16/float16.
      key_pages, value_pages: ``(num_kv_heads, num_pages, page_size, head_dim)`` in the logical
        dtype or its storage dtype (raw uint bits on CPU).
      metadata: a decode, prefill or mixed :class:`PagedAttentionMetadata`. Host (numpy) values
        are checked against the pool before anything runs.
      scale: softmax scale, default ``head_dim ** -0.5``.
      sliding_window: a query at position ``p`` sees keys in ``(p - sliding_window, p]``.
      logit_soft_cap: scores become ``cap * tanh(score / cap)`` (after scaling).
      layout: how the pages are split over the mesh. ``None``: taken from the pages' own
        ``NamedSharding`` when they are concrete arrays, else one device. Inside an outer ``jit``
        pass it (or use :func:`view_attention`) so the computation stays shard-local.
      dtype: logical dtype of the pages; needed when they are stored as raw bits (uint16/uint8).
      implementation: ``"auto"``, ``"xla"`` or ``"pallas_tpu"`` (see
        :func:`paged_attention_implementation`).
      pages_per_block: pages per key/value block of the XLA path (default: 256 tokens' worth).
      query_block: query rows per block for prefill and mixed batches (default 32); a
        sequence's last block is masked past its end, except that fewer than 4 rows left (a
        decode) go row by row.

    Returns:
      ``q.shape`` in ``q.dtype``; padding rows are zeros.
    """
    cfg = _prepare(
        q, key_pages, value_pages, metadata, scale=scale, sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap, layout=layout, dtype=dtype, implementation=implementation,
        pages_per_block=pages_per_block, query_block=query_block,
    )  # fmt: skip
    return _run(q, key_pages, value_pages, metadata, cfg=cfg)


def view_attention(q: Any, view: Any, metadata: PagedAttentionMetadata, **options: Any) -> jax.Array:
    """:func:`paged_attention` over one layer's :class:`~easykv.storage.cache.PagedAttentionCacheView`:
    its pages, its layout and its logical dtype (``options`` are paged_attention's keywords but
    ``layout`` and ``dtype``)."""
    for key in ("layout", "dtype"):
        if key in options:
            raise ValueError(f"view_attention takes {key} from the view; do not pass {key}=")
    keys, values = _view_pages(view)
    return paged_attention(
        q, keys, values, metadata, layout=view.layout, dtype=view.dtype, **options
    )


def paged_attention_implementation(
    q: Any,
    key_pages: Any,
    value_pages: Any,
    metadata: PagedAttentionMetadata,
    **options: Any,
) -> str:
    """The implementation ``paged_attention`` (same arguments) would run: ``"xla"`` or
    ``"pallas_tpu"``. Raises what ``paged_attention`` would raise for bad input."""
    cfg = _prepare(q, key_pages, value_pages, metadata, **options)
    return cfg.implementation


def paged_attention_reference(
    q: Any,
    key_pages: Any,
    value_pages: Any,
    metadata: PagedAttentionMetadata,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    dtype: Any = None,
) -> jax.Array:
    """Dense reference: gather every sequence's whole page-table row into contiguous keys and
    values, then masked softmax attention in float32 for every query row. Memory and time grow
    with ``num_tokens x pages_per_sequence x page_size``: for tests, not for serving."""
    cfg = _prepare(
        q, key_pages, value_pages, metadata, scale=scale, sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap, layout=None, dtype=dtype, implementation="xla",
        pages_per_block=None, query_block=None, infer_layout=False,
    )  # fmt: skip
    return _reference(q, key_pages, value_pages, metadata, cfg=cfg)


# ---- the computation ----------------------------------------------------------------------------
@partial(jax.jit, static_argnames=("cfg",))
def _run(q: Any, key_pages: Any, value_pages: Any, metadata: PagedAttentionMetadata, *, cfg: _Config) -> jax.Array:
    q = jnp.asarray(q)
    # Pages may become pytrees (quantized values + scales): every leaf is split like the pages
    # on its leading (kv head, page) axes.
    kp, vp = jax.tree.map(jnp.asarray, key_pages), jax.tree.map(jnp.asarray, value_pages)
    rows = _rows(metadata, cfg.mode, q.shape[0])
    layout = cfg.layout
    if cfg.implementation == "pallas_tpu":
        local = partial(_pallas_decode_local, cfg=cfg)
    else:
        local = partial(_attend_local, cfg=cfg)
    if layout is None:
        return local(q, kp, vp, *rows)
    heads = layout.spec[0]
    q_spec = PartitionSpec(None, heads, None)
    def page_specs(pages: Any) -> Any:
        return jax.tree.map(lambda leaf: PartitionSpec(*tuple(layout.spec)[: leaf.ndim]), pages)

    mapped = jax.shard_map(
        local,
        mesh=layout.mesh,
        in_specs=(q_spec, page_specs(kp), page_specs(vp)) + tuple(PartitionSpec() for _ in rows),
        out_specs=q_spec,
        # The loops' carries start replicated and become head-/replica-varying: skip the
        # varying-axes type check rather than cast every carry.
        check_vma=False,
    )
    return mapped(q, kp, vp, *rows)


def _rows(md: PagedAttentionMetadata, mode: str, tokens: int) -> tuple[jax.Array, ...]:
    """Every mode as sequences of query rows: (positions (T,) with -1 for padding, first row
    (S,), row count (S,), page table (S, P), number of real sequences ())."""
    i32 = jnp.int32
    if mode == "decode":
        pos = jnp.asarray(md.decodes_position, i32)
        table = jnp.asarray(md.decodes_page_table, i32)
        starts = jnp.arange(tokens, dtype=i32)
        return pos, starts, jnp.ones(tokens, i32), table, jnp.asarray(tokens, i32)
    if mode == "prefill":
        length = jnp.asarray(md.prefill_length, i32)
        pos = jnp.where(jnp.arange(tokens) < length, jnp.asarray(md.prefill_position, i32), -1)
        table = jnp.asarray(md.prefill_page_table, i32)[None]
        return pos, jnp.zeros(1, i32), jnp.minimum(length, tokens)[None], table, jnp.asarray(1, i32)
    qsl = jnp.asarray(md.query_start_loc, i32)
    num = jnp.asarray(md.num_seqs, i32)
    seqs = qsl.shape[0] - 1
    real_end = qsl[jnp.clip(num, 0, seqs)]
    pos = jnp.where(jnp.arange(tokens) < real_end, jnp.asarray(md.positions, i32), -1)
    starts = jnp.clip(qsl[:-1], 0, tokens)
    counts = jnp.clip(qsl[1:], 0, tokens) - starts
    return pos, starts, jnp.maximum(counts, 0), jnp.asarray(md.page_table, i32), jnp.clip(num, 0, seqs)


def _load_pages(pages: Any, ids: jax.Array, dtype: np.dtype) -> tuple[jax.Array, jax.Array]:
    """The one way pages are read: pages ``ids`` (local ids; out of range -> absent) of every
    local kv head as float32 tokens ``(heads, len(ids) * page_size, head_dim)``, and whether each
    token lies on a present page. Plain pages (raw bits too) and quantized pages (values +
    scales, dequantized here, only for the pages read) go through `pages.read_pages`."""
    heads, count, page_size = _stored(pages).shape[:3]
    present = (ids >= 0) & (ids < count)
    values = read_pages(pages, jnp.clip(ids, 0, count - 1), dtype).astype(jnp.float32)
    return values.reshape(heads, -1, values.shape[-1]), jnp.repeat(present, page_size)


def _page_offset(cfg: _Config, local_pages: int) -> jax.Array | int:
    return 0 if cfg.layout is None else cfg.layout.local_page_offset(local_pages)


# What is left of a sequence after its full query blocks goes row by row below this many rows
# (a decode: one row), in one masked block of query_block rows from there on.
_SINGLE_ROWS_BELOW = 4


def _attend_local(
    q: jax.Array,
    kp: Any,
    vp: Any,
    positions: jax.Array,
    starts: jax.Array,
    counts: jax.Array,
    table: jax.Array,
    num_seqs: jax.Array,
    *,
    cfg: _Config,
) -> jax.Array:
    """The XLA path on one device's shard (or the whole pool without a mesh)."""
    heads, local_pages, page_size = _stored(kp).shape[:3]
    tokens, q_heads, head_dim = q.shape
    group = q_heads // heads
    qb = 1 if cfg.mode == "decode" else min(cfg.query_block, max(tokens, 1))
    pb = min(cfg.block_pages, table.shape[1])  # never gather more columns than the table has
    blk = pb * page_size
    f32 = jnp.float32

    offset = _page_offset(cfg, local_pages)
    split_pages = cfg.layout is not None and cfg.layout.page_shards > 1
    qpad = jnp.pad(q.astype(f32) * cfg.scale, ((0, qb), (0, 0), (0, 0))).reshape(tokens + qb, heads, group, head_dim)
    pospad = jnp.pad(positions, (0, qb), constant_values=-1)
    # Extra -1 columns so a block's dynamic slice never runs off the table (and is never clipped
    # back onto real pages).
    table = jnp.pad(table, ((0, 0), (0, pb)), constant_values=-1)
    window = cfg.window
    big = jnp.iinfo(jnp.int32).max

    def attend_block(qblk: jax.Array, pos: jax.Array, row: jax.Array) -> jax.Array:
        """Query rows ``qblk`` (rows, heads, group, dim) at ``pos`` (rows,; -1 invalid) over one
        sequence's pages ``row``: (rows, heads, group, dim) float32, zeros for invalid rows."""
        rows = qblk.shape[0]
        valid = pos >= 0
        hi = jnp.max(jnp.where(valid, pos, -1)) + 1  # keys [lo, hi) can be seen by some row
        lo = 0
        if window is not None:
            lo = jnp.maximum(jnp.min(jnp.where(valid, pos, big)) - window + 1, 0)
        first, last = lo // blk, (hi + blk - 1) // blk
        if split_pages:
            # The replica holding the page of the last key computes this block; others skip it.
            tail = row[jnp.maximum(hi - 1, 0) // page_size] - offset
            last = jnp.where((hi > 0) & (tail >= 0) & (tail < local_pages), last, first)
        qm = jnp.transpose(qblk, (1, 0, 2, 3)).reshape(heads, rows * group, head_dim)
        pm = jnp.repeat(pos, group)  # (rows * group,)
        m0 = jnp.full((heads, rows * group), -jnp.inf, f32)
        l0 = jnp.zeros((heads, rows * group), f32)
        a0 = jnp.zeros((heads, rows * group, head_dim), f32)

        def body(i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
            m, l, acc = carry
            ids = jax.lax.dynamic_slice_in_dim(row, i * pb, pb) - offset
            k, present = _load_pages(kp, ids, cfg.dtype)
            v, _ = _load_pages(vp, ids, cfg.dtype)
            kpos = i * blk + jnp.arange(blk)
            usable = present & (kpos < hi) & (kpos >= lo)
            v = jnp.where(usable[None, :, None], v, 0.0)  # never let garbage past the end leak in
            s = jnp.einsum("hmd,hkd->hmk", qm, k, preferred_element_type=f32)
            if cfg.cap is not None:
                s = cfg.cap * jnp.tanh(s / cfg.cap)
            seen = usable[None, :] & (kpos[None, :] <= pm[:, None])
            if window is not None:
                seen &= kpos[None, :] > pm[:, None] - window
            s = jnp.where(seen[None], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            alpha = jnp.exp(m - m_use)
            p = jnp.exp(s - m_use[..., None])
            l = l * alpha + jnp.sum(p, axis=-1)
            acc = acc * alpha[..., None] + jnp.einsum("hmk,hkd->hmd", p, v, preferred_element_type=f32)
            return m_new, l, acc

        _, l, acc = jax.lax.fori_loop(first, last, body, (m0, l0, a0))
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]
        return jnp.transpose(out.reshape(heads, rows, group, head_dim), (1, 0, 2, 3))

    out0 = jnp.zeros((tokens + qb, heads, group, head_dim), f32)

    if cfg.mode == "decode":
        # One query row per sequence, row b: no query-block loop.
        def seq_body(b: jax.Array, out: jax.Array) -> jax.Array:
            row = table[b]
            pos = jax.lax.dynamic_slice_in_dim(pospad, b, 1)
            res = attend_block(jax.lax.dynamic_slice_in_dim(qpad, b, 1), pos, row)
            return jax.lax.dynamic_update_slice_in_dim(out, res, b, axis=0)

    else:
        # A sequence's rows go in blocks of qb, the last one masked past the sequence's end; a
        # remainder shorter than _SINGLE_ROWS_BELOW (a decode inside a mixed batch) goes row by
        # row instead, so a decode costs one row, not qb. Only two block shapes are traced: each
        # costs compile time, under every layer.
        rows_t = jnp.arange(qb)

        def run_block(size: int, r0: jax.Array, end: jax.Array, row: jax.Array, out: jax.Array) -> jax.Array:
            mine = rows_t[:size] < end - r0  # rows of this sequence (the others belong to the next)
            pos = jnp.where(mine, jax.lax.dynamic_slice_in_dim(pospad, r0, size), -1)
            res = attend_block(jax.lax.dynamic_slice_in_dim(qpad, r0, size), pos, row)
            res = jnp.where(mine[:, None, None, None], res, jax.lax.dynamic_slice_in_dim(out, r0, size))
            return jax.lax.dynamic_update_slice_in_dim(out, res, r0, axis=0)

        def seq_body(b: jax.Array, out: jax.Array) -> jax.Array:
            row, start, count = table[b], starts[b], counts[b]
            end = start + count
            rest = count % qb
            singles = jnp.where(rest < _SINGLE_ROWS_BELOW, rest, 0)
            blocks = count // qb + (rest > singles)
            out = jax.lax.fori_loop(0, blocks, lambda j, o: run_block(qb, start + j * qb, end, row, o), out)
            if qb == 1:
                return out
            first = end - singles
            return jax.lax.fori_loop(0, singles, lambda j, o: run_block(1, first + j, end, row, o), out)

    out = jax.lax.fori_loop(0, num_seqs, seq_body, out0)
    out = out[:tokens].reshape(tokens, q_heads, head_dim).astype(q.dtype)
    if split_pages:
        # Each sequence was computed by the one replica holding its pages; the others hold zeros.
        out = jax.lax.psum(out, cfg.layout.page_axes)
    return out


def _pallas_decode_local(
    q: jax.Array,
    kp: jax.Array,
    vp: jax.Array,
    positions: jax.Array,
    starts: jax.Array,
    counts: jax.Array,
    table: jax.Array,
    num_seqs: jax.Array,
    *,
    cfg: _Config,
) -> jax.Array:
    """Decode through JAX's Pallas TPU kernel (pages in its layout, one device's heads)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as pallas_paged

    del starts, counts, num_seqs
    width = table.shape[1]
    block = next(b for b in (16, 8, 4, 2, 1) if width % b == 0)
    lengths = jnp.where(positions >= 0, positions + 1, 0).astype(jnp.int32)
    out = pallas_paged(
        (q.astype(jnp.float32) * cfg.scale).astype(q.dtype),
        kp, vp, lengths, jnp.maximum(table, 0),
        attn_logits_soft_cap=cfg.cap, pages_per_compute_block=block,
    )  # fmt: skip
    return jnp.where((positions >= 0)[:, None, None], out, 0).astype(q.dtype)


@partial(jax.jit, static_argnames=("cfg",))
def _reference(q: Any, key_pages: Any, value_pages: Any, md: PagedAttentionMetadata, *, cfg: _Config) -> jax.Array:
    """Dense masked softmax attention, written independently of the fast path's row layout."""
    q = jnp.asarray(q)
    tokens, q_heads, head_dim = q.shape
    every = jnp.arange(cfg.num_pages)
    k_all = read_pages(jax.tree.map(jnp.asarray, key_pages), every, cfg.dtype).astype(jnp.float32)
    v_all = read_pages(jax.tree.map(jnp.asarray, value_pages), every, cfg.dtype).astype(jnp.float32)
    kv_heads, num_pages, page_size, _ = k_all.shape
    t = jnp.arange(tokens)
    if cfg.mode == "decode":
        seq = t
        pos = jnp.asarray(md.decodes_position)
        table = jnp.asarray(md.decodes_page_table)
    elif cfg.mode == "prefill":
        seq = jnp.zeros(tokens, jnp.int32)
        pos = jnp.where(t < md.prefill_length, jnp.asarray(md.prefill_position), -1)
        table = jnp.asarray(md.prefill_page_table)[None]
    else:
        qsl = jnp.asarray(md.query_start_loc)
        seq = jnp.searchsorted(qsl, t, side="right") - 1  # qsl[seq] <= t < qsl[seq + 1]
        real = t < qsl[md.num_seqs]
        seq = jnp.clip(seq, 0, md.page_table.shape[0] - 1)
        pos = jnp.where(real, jnp.asarray(md.positions), -1)
        table = jnp.asarray(md.page_table)
    ids = jnp.clip(table, 0, num_pages - 1)  # (S, P); pages past a sequence's length are masked
    seq_len = ids.shape[1] * page_size

    def dense(pages: jax.Array) -> jax.Array:  # (S, kv_heads, P * page_size, dim)
        picked = pages[:, ids]  # (kv_heads, S, P, page_size, dim)
        return jnp.transpose(picked, (1, 0, 2, 3, 4)).reshape(ids.shape[0], kv_heads, seq_len, head_dim)

    keys, values = dense(k_all)[seq], dense(v_all)[seq]  # (T, kv_heads, L, dim)
    qg = q.astype(jnp.float32).reshape(tokens, kv_heads, q_heads // kv_heads, head_dim)
    s = jnp.einsum("thgd,thld->thgl", qg, keys) * cfg.scale
    if cfg.cap is not None:
        s = cfg.cap * jnp.tanh(s / cfg.cap)
    j = jnp.arange(seq_len)[None, :]
    p_ = pos[:, None]
    mask = (p_ >= 0) & (j <= p_)
    if cfg.window is not None:
        mask &= j > p_ - cfg.window
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1, where=mask[:, None, None, :])
    w = jnp.where(mask[:, None, None, :], w, 0.0)
    out = jnp.einsum("thgl,thld->thgd", w, values)
    return out.reshape(tokens, q_heads, head_dim).astype(q.dtype)


__all__ = [
    "IMPLEMENTATIONS",
    "paged_attention",
    "paged_attention_implementation",
    "paged_attention_reference",
    "view_attention",
]
