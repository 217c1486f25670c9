"""The dense reference of paged attention (``paged_attention_reference`` in ``api.py``): every
sequence's whole page-table row gathered into contiguous keys and values, then masked softmax
attention in float32. For tests, not for serving.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from easykv.attention.checks import Config, Pages
from easykv.step.checks import Array
from easykv.step.ragged import RaggedStep
from easykv.storage.pages import Layer, read_pages


@partial(jax.jit, static_argnames=("cfg",))
def dense_reference(q: Array, key_pages: Pages, value_pages: Pages | None, md: RaggedStep,
                    sinks: Array | None = None, layer: Layer = 0, *, cfg: Config) -> jax.Array:
    """Dense masked softmax attention over ``md`` (the ragged form) on layer ``layer`` of stacked
    pages, written independently of the fast path's row layout; a sink is one more softmax
    column with no value."""
    q = jnp.asarray(q)
    tokens, q_heads, head_dim = q.shape
    every = jnp.arange(cfg.num_pages)
    k_all = read_pages(jax.tree.map(jnp.asarray, key_pages), every, cfg.dtype, layer).astype(jnp.float32)
    if cfg.latent_value_dim is not None:  # a latent cache: a value is its key's first dims
        v_all = k_all[..., : cfg.latent_value_dim]
    else:
        v_all = read_pages(jax.tree.map(jnp.asarray, value_pages), every, cfg.dtype, layer).astype(jnp.float32)
    kv_heads, num_pages, page_size, _ = k_all.shape
    t = jnp.arange(tokens)
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
        return jnp.transpose(picked, (1, 0, 2, 3, 4)).reshape(ids.shape[0], kv_heads, seq_len, pages.shape[-1])

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
    if cfg.chunk is not None:
        mask &= j >= p_ - p_ % cfg.chunk
    group = q_heads // kv_heads
    sink = jnp.full((kv_heads, group), -jnp.inf) if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(
        kv_heads, group)
    s = jnp.concatenate([jnp.where(mask[:, None, None, :], s, -jnp.inf),
                         jnp.broadcast_to(sink[None, :, :, None], (tokens, kv_heads, group, 1))], axis=-1)
    seen = jnp.concatenate([jnp.broadcast_to(mask[:, None, None, :], s.shape[:3] + (seq_len,)),
                            jnp.broadcast_to(jnp.isfinite(sink)[None, :, :, None], s.shape[:3] + (1,))], axis=-1)
    w = jax.nn.softmax(s, axis=-1, where=seen)
    w = jnp.where(seen, w, 0.0)[..., :seq_len]  # a row that sees nothing (padding) gets zeros
    out = jnp.einsum("thgl,thld->thgd", w, values)
    return out.reshape(tokens, q_heads, values.shape[-1]).astype(q.dtype)
