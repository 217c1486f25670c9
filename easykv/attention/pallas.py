"""The Pallas TPU path of paged attention (``api.py`` holds the entry points).

Pallas TPU path
---------------
On TPU, decode without a sliding window, on pages stored in their own dtype (bf16/f32) with
``head_dim % 128 == 0`` and an unsplit page axis, goes to JAX's Pallas ``paged_attention`` kernel
(whose page layout is ours), called per device inside the same ``shard_map``.
:func:`paged_attention_implementation` says which path a call takes; ``implementation=`` forces
one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from easykv.attention.checks import Config
from easykv.attention.rows import Rows


def pallas_decode_local(
    q: jax.Array,
    kp: jax.Array,
    vp: jax.Array,
    rows: Rows,
    sinks: jax.Array,
    layer: jax.Array,
    *,
    cfg: Config,
) -> jax.Array:
    """Decode through JAX's Pallas TPU kernel (one layer's pages in its layout, one device's
    heads): ``q`` ``(batch, local q heads, head_dim)``; one query row per sequence, so only the
    rows' positions and page table are read. ``sinks`` are all -inf here: calls with sinks go to
    the XLA path. The kernel takes one layer's pages, so a stack of several layers is sliced at
    ``layer`` first: XLA may copy that layer (a stack of one is a reshape)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as pallas_paged

    positions, table = rows.positions, rows.table
    width = table.shape[1]
    block = next(b for b in (16, 8, 4, 2, 1) if width % b == 0)
    lengths = jnp.where(positions >= 0, positions + 1, 0).astype(jnp.int32)
    out = pallas_paged(
        (q.astype(jnp.float32) * cfg.scale).astype(q.dtype),
        kp[layer], vp[layer], lengths, jnp.maximum(table, 0),
        attn_logits_soft_cap=cfg.cap, pages_per_compute_block=block,
    )  # fmt: skip
    return jnp.where((positions >= 0)[:, None, None], out, 0).astype(q.dtype)
