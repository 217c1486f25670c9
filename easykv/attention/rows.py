"""The ragged form of a step (`RaggedStep`: every form becomes it, ``step.metadata.as_mixed``) as
sequences of query rows. ``api.run`` builds :class:`Rows` inside jit and hands them, replicated, to
the per-device paths (``xla.attend_local``, ``pallas.pallas_decode_local``), which so share one
signature.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from easykv.step.ragged import RaggedStep


class Rows(NamedTuple):
    """The query rows of a call, as sequences (a pytree: it passes through jit and shard_map)."""

    positions: jax.Array  # (T,) int32: each query row's position; -1 for padding
    starts: jax.Array  # (S,) int32: each sequence's first query row
    counts: jax.Array  # (S,) int32: each sequence's number of query rows
    table: jax.Array  # (S, P) int32: each sequence's page-table row (global page ids)
    num_seqs: jax.Array  # () int32: how many of the S sequences are real


def query_rows(md: RaggedStep, tokens: int) -> Rows:
    """``md`` (the ragged form, with ``tokens`` query rows) as :class:`Rows`."""
    i32 = jnp.int32
    qsl = jnp.asarray(md.query_start_loc, i32)
    num = jnp.asarray(md.num_seqs, i32)
    seqs = qsl.shape[0] - 1
    real_end = qsl[jnp.clip(num, 0, seqs)]
    pos = jnp.where(jnp.arange(tokens) < real_end, jnp.asarray(md.positions, i32), -1)
    starts = jnp.clip(qsl[:-1], 0, tokens)
    counts = jnp.clip(qsl[1:], 0, tokens) - starts
    return Rows(pos, starts, jnp.maximum(counts, 0), jnp.asarray(md.page_table, i32), jnp.clip(num, 0, seqs))
