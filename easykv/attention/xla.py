"""The XLA path of paged attention, on one device's shard of the pages (``api.py`` holds the
entry points, the three metadata forms and the ``shard_map`` placement).

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

Pages are read through one function, :func:`_load_pages`, which turns stored pages (raw bits on
CPU, see ``storage/pages.py``) into float32 values; quantized pages are dequantized there (a
rotating quantizer's stay in its rotated basis: ``api.run`` rotates the query and the output).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from easykv.attention.checks import Config, stored_pages
from easykv.attention.rows import Rows
from easykv.quantization import QuantizedPages
from easykv.spec.windows import first_seen, read_rules
from easykv.storage.pages import read_pages


def _load_pages(pages: Any, ids: jax.Array, dtype: np.dtype, layer: jax.Array,
                rotated: bool) -> tuple[jax.Array, jax.Array]:
    """The one way pages are read: pages ``ids`` (local ids; out of range -> absent) of layer
    ``layer`` of the stack, every local kv head, as float32 tokens ``(heads, len(ids) *
    page_size, head_dim)``, and whether each token lies on a present page. Plain pages (raw
    bits too) and quantized pages (values + scales, dequantized here, only for the pages read)
    go through `pages.read_pages`, which gathers from the stack itself: a layer sliced out
    before the loop would be copied whole. ``rotated``: a rotating quantizer's pages stay in its
    rotated basis (``api.run`` rotates the query and the output)."""
    heads, count, page_size = stored_pages(pages).shape[1:4]
    present = (ids >= 0) & (ids < count)
    values = read_pages(pages, jnp.clip(ids, 0, count - 1), dtype, layer, rotated=rotated).astype(jnp.float32)
    return values.reshape(heads, -1, values.shape[-1]), jnp.repeat(present, page_size)


def _value_dim(vp: Any) -> int:
    """The value pages' head dim (quantized: the dim their stored shapes encode)."""
    return vp.head_dim if isinstance(vp, QuantizedPages) else vp.shape[4]


def _page_offset(cfg: Config, local_pages: int) -> jax.Array | int:
    return 0 if cfg.layout is None else cfg.layout.local_page_offset(local_pages)


# What is left of a sequence after its full query blocks goes row by row below this many rows
# (a decode: one row), in one masked block of query_block rows from there on.
_SINGLE_ROWS_BELOW = 4
_BIG = jnp.iinfo(jnp.int32).max


class _Shard(NamedTuple):
    """What every query block of one call on one shard shares (`attend_local`)."""

    cfg: Config
    kp: Any  # stacked key pages (plain or quantized; traced)
    vp: Any  # stacked value pages; None for a latent cache
    layer: jax.Array
    heads: int  # local kv heads
    group: int  # q heads per kv head
    head_dim: int
    v_dim: int
    page_size: int
    local_pages: int
    pb: int  # pages per key/value block
    offset: jax.Array | int  # the global id of this shard's first page
    sink: jax.Array  # (heads, group) float32 sink logits; -inf: none

    @property
    def split_pages(self) -> bool:
        return self.cfg.layout is not None and self.cfg.layout.page_shards > 1


def attend_local(q: jax.Array, kp: Any, vp: Any, rows: Rows, sinks: jax.Array, layer: jax.Array, *,
                 cfg: Config) -> jax.Array:
    """The XLA path on one device's shard (or the whole pool without a mesh): ``q`` ``(tokens,
    local q heads, head_dim)`` over layer ``layer`` of the stacked ``kp`` ``(layers, local kv
    heads, local pages, page_size, head_dim)`` and ``vp`` (the same with ``v_head_dim``; or
    quantized pages; None for a latent cache, whose values are the keys' first dims, read once
    with them), with one sink logit per local q head (-inf: none); returns ``(tokens, local q
    heads, v_head_dim)`` in ``q``'s dtype."""
    positions, starts, counts, table, num_seqs = rows
    heads, local_pages, page_size = stored_pages(kp).shape[1:4]
    tokens, q_heads, head_dim = q.shape
    # No value pages (a latent cache): a value is its key's first v_dim dims.
    v_dim = cfg.latent_value_dim if cfg.latent_value_dim is not None else _value_dim(vp)
    group = q_heads // heads
    qb = 1 if cfg.decode_only else min(cfg.query_block, max(tokens, 1))
    pb = min(cfg.block_pages, table.shape[1])  # never gather more columns than the table has
    f32 = jnp.float32
    shard = _Shard(cfg, kp, vp, layer, heads, group, head_dim, v_dim, page_size, local_pages, pb,
                   _page_offset(cfg, local_pages), sinks.astype(f32).reshape(heads, group))
    qpad = jnp.pad(q.astype(f32) * cfg.scale, ((0, qb), (0, 0), (0, 0))).reshape(tokens + qb, heads, group, head_dim)
    pospad = jnp.pad(positions, (0, qb), constant_values=-1)
    # Extra -1 columns so a block's dynamic slice never runs off the table (and is never clipped
    # back onto real pages).
    table = jnp.pad(table, ((0, 0), (0, pb)), constant_values=-1)
    if cfg.decode_only:
        seq_body = _decode_rows(shard, qpad, pospad, table)
    else:
        seq_body = _query_blocks(shard, qpad, pospad, table, starts, counts, qb)
    out: jax.Array = jax.lax.fori_loop(0, num_seqs, seq_body, jnp.zeros((tokens + qb, heads, group, v_dim), f32))
    out = out[:tokens].reshape(tokens, q_heads, v_dim).astype(q.dtype)
    if shard.split_pages and cfg.layout is not None:
        # Each sequence was computed by the one replica holding its pages; the others hold zeros.
        out = jax.lax.psum(out, cfg.layout.page_axes)
    return out


def _attend_block(sh: _Shard, qblk: jax.Array, pos: jax.Array, row: jax.Array) -> jax.Array:
    """Query rows ``qblk`` (rows, heads, group, dim) at ``pos`` (rows,; -1 invalid) over one
    sequence's pages ``row``: (rows, heads, group, dim) float32, zeros for invalid rows."""
    cfg, heads, group, page_size = sh.cfg, sh.heads, sh.group, sh.page_size
    rules, f32 = read_rules(cfg.window, cfg.chunk), jnp.float32  # a query at p reads first_seen(p) .. p
    latent, rotated = cfg.latent_value_dim is not None, cfg.rotation is not None
    blk = sh.pb * page_size
    rows = qblk.shape[0]
    valid = pos >= 0
    hi = jnp.max(jnp.where(valid, pos, -1)) + 1  # keys [lo, hi) can be seen by some row
    lo: jax.Array | int = 0
    if rules:
        lo = jnp.min(jnp.where(valid, first_seen(pos, rules, jnp), _BIG))
    first, last = lo // blk, (hi + blk - 1) // blk
    if sh.split_pages:
        # The replica holding the page of the last key computes this block; others skip it.
        tail = row[jnp.maximum(hi - 1, 0) // page_size] - sh.offset
        last = jnp.where((hi > 0) & (tail >= 0) & (tail < sh.local_pages), last, first)
    qm = jnp.transpose(qblk, (1, 0, 2, 3)).reshape(heads, rows * group, sh.head_dim)
    pm = jnp.repeat(pos, group)  # (rows * group,)
    # The sink is a key every query sees first, with no value: the softmax starts from it.
    m0 = jnp.tile(sh.sink, (1, rows))  # (heads, rows * group): entry r * group + g is q head (h, g)
    denom0 = jnp.where(jnp.isfinite(m0), 1.0, 0.0)  # the softmax's running denominator
    a0 = jnp.zeros((heads, rows * group, sh.v_dim), f32)

    def body(i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        m, denom, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(row, i * sh.pb, sh.pb) - sh.offset
        k, present = _load_pages(sh.kp, ids, cfg.dtype, sh.layer, rotated)
        v = k[..., : sh.v_dim] if latent else _load_pages(sh.vp, ids, cfg.dtype, sh.layer, rotated)[0]
        kpos = i * blk + jnp.arange(blk)
        usable = present & (kpos < hi) & (kpos >= lo)
        v = jnp.where(usable[None, :, None], v, 0.0)  # never let garbage past the end leak in
        s = jnp.einsum("hmd,hkd->hmk", qm, k, preferred_element_type=f32)
        if cfg.cap is not None:
            s = cfg.cap * jnp.tanh(s / cfg.cap)
        seen = usable[None, :] & (kpos[None, :] <= pm[:, None])
        if rules:
            seen &= kpos[None, :] >= first_seen(pm, rules, jnp)[:, None]
        s = jnp.where(seen[None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - m_use)
        p = jnp.exp(s - m_use[..., None])
        denom = denom * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("hmk,hkd->hmd", p, v, preferred_element_type=f32)
        return m_new, denom, acc

    _, denom, acc = jax.lax.fori_loop(first, last, body, (m0, denom0, a0))
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return jnp.transpose(out.reshape(heads, rows, group, sh.v_dim), (1, 0, 2, 3))


SeqBody = Callable[[jax.Array, jax.Array], jax.Array]  # (sequence b, output) -> output


def _decode_rows(sh: _Shard, qpad: jax.Array, pospad: jax.Array, table: jax.Array) -> SeqBody:
    """One query row per sequence, row b: no query-block loop."""

    def seq_body(b: jax.Array, out: jax.Array) -> jax.Array:
        row = table[b]
        pos = jax.lax.dynamic_slice_in_dim(pospad, b, 1)
        res = _attend_block(sh, jax.lax.dynamic_slice_in_dim(qpad, b, 1), pos, row)
        return jax.lax.dynamic_update_slice_in_dim(out, res, b, axis=0)

    return seq_body


def _query_blocks(sh: _Shard, qpad: jax.Array, pospad: jax.Array, table: jax.Array, starts: jax.Array,
                  counts: jax.Array, qb: int) -> SeqBody:
    """A sequence's rows go in blocks of ``qb``, the last one masked past the sequence's end; a
    remainder shorter than _SINGLE_ROWS_BELOW (a decode inside a mixed batch) goes row by row
    instead, so a decode costs one row, not ``qb``. Only two block shapes are traced: each costs
    compile time, under every layer."""
    rows_t = jnp.arange(qb)

    def run_block(size: int, r0: jax.Array, end: jax.Array, row: jax.Array, out: jax.Array) -> jax.Array:
        mine = rows_t[:size] < end - r0  # rows of this sequence (the others belong to the next)
        pos = jnp.where(mine, jax.lax.dynamic_slice_in_dim(pospad, r0, size), -1)
        res = _attend_block(sh, jax.lax.dynamic_slice_in_dim(qpad, r0, size), pos, row)
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
        done: jax.Array = jax.lax.fori_loop(0, singles, lambda j, o: run_block(1, first + j, end, row, o), out)
        return done

    return seq_body
