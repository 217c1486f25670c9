"""EasyDeL 0.3's per-step ``RaggedPagesMetadata`` <-> easykv's ragged form (``RaggedStep``).

EasyDeL (vLLM-style) describes a step by sequence: a page table row, the tokens cached after the
step (``context_lens``), where each sequence's new tokens start in the token axis
(``query_start_loc``) and how many sequences are real (``num_seqs``); v2 adds a slot mapping in
page-contiguous slices, v3 a request distribution. easykv's mixed form adds what a write needs
per token: its position and its slot. `runtime_from_easydel` derives them on the device, inside
jit, without a host round trip; `easydel_fields_from_easykv` goes the other way on the host (to
drive an EasyDeL model from easykv's PageManager).
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from easykv.step.checks import is_host
from easykv.step.metadata import StepInput
from easykv.step.ragged import PAD_POSITION, RaggedStep, is_ragged, slots_from_table


class RaggedPagesFields(Protocol):
    """What easykv reads of EasyDeL's ``RaggedPagesMetadata`` (v2 or v3; EasyDeL ships no types)."""

    @property
    def pages_tables(self) -> ArrayLike: ...
    @property
    def context_lens(self) -> ArrayLike: ...
    @property
    def query_start_loc(self) -> ArrayLike: ...
    @property
    def num_seqs(self) -> ArrayLike: ...


def ragged_fields(metadata: object) -> RaggedPagesFields:
    """The RaggedPagesMetadata inside EasyDeL's OperationsMetadata (or the object itself)."""
    inner = getattr(metadata, "ragged", None) if type(metadata).__name__ == "OperationsMetadata" else metadata
    missing = [f for f in ("pages_tables", "context_lens", "query_start_loc", "num_seqs") if not hasattr(inner, f)]
    if inner is None or missing:
        raise ValueError(f"an easykv view needs EasyDeL's RaggedPagesMetadata (pages_tables, context_lens, "
                        f"query_start_loc, num_seqs); got {type(metadata).__name__}")
    return cast(RaggedPagesFields, inner)  # its four fields were checked just above


def runtime_from_easydel(metadata: object, *, num_tokens: int, page_size: int, num_pages: int,
                         pages_per_sequence: int | None = None) -> RaggedStep:
    """easykv's ragged form of an EasyDeL step, traceable (no host sync).

    Token ``t`` belongs to sequence ``b`` when ``query_start_loc[b] <= t < query_start_loc[b+1]``
    and ``b < num_seqs``; its position is ``context_lens[b] - (query_start_loc[b+1] - t)`` (the
    new tokens are the last of the sequence) and its slot comes from row ``b`` of the page table,
    bounded: a page outside the pool or the row gives an invalid slot that the write drops and
    counts, never another sequence's page. Every other token (before ``query_start_loc[0]``, at
    or past ``query_start_loc[num_seqs]``) is padding: position -1, slot -1, in no sequence.
    Sequences from ``num_seqs`` on are empty in the result (their ``query_start_loc`` entries,
    which EasyDeL pads freely, become ``query_start_loc[num_seqs]``; their lengths 0).

    The real sequences' ``query_start_loc[0 .. num_seqs]`` must lie in ``0 .. num_tokens`` and
    never decrease. Host (numpy) values that break this are refused with a ValueError; traced
    ones cannot be, so such a step is all padding (``num_seqs`` 0, nothing written) rather than
    tokens written at positions or into pages that the metadata gives to other tokens.
    ``slot_mapping`` and ``request_distribution`` of v2/v3 are not needed: both are derivable.

    Args:
      metadata: EasyDeL's ``RaggedPagesMetadata`` (v2 or v3), or an ``OperationsMetadata``
        holding it, numpy or jax: ``pages_tables`` ``(seqs, pages_per_row)`` int (v3 may pass it
        flattened), ``context_lens`` ``(seqs,)``, ``query_start_loc`` ``(seqs + 1,)``,
        ``num_seqs`` ``(1,)`` or a scalar.
      num_tokens: the step's token axis, a static int: the length of the result's per-token
        fields.
      page_size: tokens per page.
      num_pages: pages in the pool; a page id outside ``0 .. num_pages - 1`` gives an invalid slot.
      pages_per_sequence: logical pages a sequence may use; None (default): the table's width.

    Returns:
      the `RaggedStep`: ``slot_mapping`` and ``positions``
      ``(num_tokens,)`` int32, ``query_start_loc`` ``(seqs + 1,)``, ``page_table``
      ``(seqs, pages_per_row)``, ``context_lens`` ``(seqs,)`` and ``num_seqs``.
    """
    md = ragged_fields(metadata)
    i32 = jnp.int32
    ctx = jnp.asarray(md.context_lens, i32).reshape(-1)
    qsl = jnp.asarray(md.query_start_loc, i32).reshape(-1)
    table = jnp.asarray(md.pages_tables, i32)
    if table.ndim == 1:  # v3 kernels take the table flattened
        table = table.reshape(ctx.shape[0], -1)
    seqs = min(ctx.shape[0], qsl.shape[0] - 1, table.shape[0])
    if is_host(md.query_start_loc, md.num_seqs):
        _check_host_starts(np.asarray(md.query_start_loc).reshape(-1)[: seqs + 1],
                          np.asarray(md.num_seqs).reshape(-1)[0], num_tokens)
    ctx, table = ctx[:seqs], table[:seqs]
    qsl, num = _real_starts(qsl[: seqs + 1], jnp.asarray(md.num_seqs, i32).reshape(-1)[0], num_tokens)
    t = jnp.arange(num_tokens, dtype=i32)
    # qsl is non-decreasing now, so the search names the sequence whose range holds t; t outside
    # qsl[0] .. qsl[num] gets a neighbour's index, which `real` keeps from reaching any field.
    owner = jnp.minimum(jnp.searchsorted(qsl[1:], t, side="right").astype(i32), seqs - 1)
    pos = ctx[owner] - (qsl[owner + 1] - t)
    real = (t >= qsl[0]) & (t < qsl[num]) & (pos >= 0)
    positions = jnp.where(real, pos, PAD_POSITION).astype(i32)
    slots = slots_from_table(table[owner], positions, page_size=page_size, num_pages=num_pages,
                             pages_per_sequence=pages_per_sequence)
    return RaggedStep(
        slot_mapping=slots, positions=positions, query_start_loc=qsl, page_table=table,
        context_lens=jnp.where(jnp.arange(seqs) < num, ctx, 0).astype(i32), num_seqs=num,
    )  # fmt: skip


def _real_starts(qsl: jax.Array, num_seqs: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(query_start_loc, num_seqs) with the padding sequences empty at the real tokens' end, and
    0 real sequences when the real starts leave the token axis or decrease (traced: the step
    is then all padding, as `runtime_from_easydel` documents)."""
    seqs = qsl.shape[0] - 1
    num = jnp.clip(num_seqs, 0, seqs)
    lo, hi = qsl[:-1], qsl[1:]
    # Clipping a start instead would shift the positions of the sequence's tokens onto others'.
    ok = (lo >= 0) & (hi >= lo) & (hi <= num_tokens)
    num = jnp.where(jnp.all(ok | (jnp.arange(seqs) >= num)), num, 0)
    qsl = jnp.clip(qsl, 0, num_tokens)  # changes no real start; keeps a padding one on the axis
    return jnp.where(jnp.arange(seqs + 1) <= num, qsl, qsl[num]), num


def _check_host_starts(qsl: np.ndarray, num_seqs: Any, num_tokens: int) -> None:
    """Host values of an EasyDeL step: ``num_seqs`` in ``0 .. len(query_start_loc) - 1`` and the
    real sequences' starts ``query_start_loc[0 .. num_seqs]`` in ``0 .. num_tokens``, never
    decreasing; the entry that breaks a rule is named."""
    seqs, num = qsl.shape[0] - 1, int(num_seqs)
    if not 0 <= num <= seqs:
        raise ValueError(f"num_seqs={num} is outside 0..{seqs} (the sequences query_start_loc, context_lens and "
                         "pages_tables describe)")
    real = qsl[: num + 1].astype(np.int64) if num else qsl[:0]
    for b, start in enumerate(real.tolist()):
        if not 0 <= start <= num_tokens:
            raise ValueError(f"query_start_loc[{b}]={start} is outside 0..{num_tokens} (the step's tokens); the "
                             f"starts of the {num} real sequences index the token axis")
        if b and start < real[b - 1]:
            raise ValueError(f"query_start_loc[{b}]={start} is below query_start_loc[{b - 1}]={int(real[b - 1])}; "
                             "the starts of the real sequences never decrease")


def easydel_fields_from_easykv(step_meta: StepInput, *, page_size: int, version: str = "v3",
                               padded_num_slices: int | None = None) -> dict[str, np.ndarray | int | str]:
    """RaggedPagesMetadata's fields for a host-side easykv step in the ragged form (a `RaggedStep`,
    or the mixed form of `PagedAttentionMetadata`; numpy in, numpy out).

    Unassigned page-table entries (-1) become 0, as EasyDeL's engine leaves them; padding
    positions become 0. v3 gets ``request_distribution`` = [decodes, decodes + prefills,
    sequences] (a decode: one new token after at least one cached); v2 gets ``slot_mapping`` as
    EasyDeL's page-contiguous slices ``[cache start, token start, length]`` padded to
    ``padded_num_slices`` (default: one per token) and ``num_kv_update_slices``.
    """
    if not is_ragged(step_meta):
        raise ValueError("easydel metadata is built from easykv's ragged form (a RaggedStep, the page manager's "
                         "plan.metadata item, or PagedAttentionMetadata.for_mixed)")
    if version not in ("v2", "v3"):
        raise ValueError(f"version {version!r}: EasyDeL 0.3 ragged-page metadata is 'v2' or 'v3'")
    qsl = np.asarray(step_meta.query_start_loc, np.int32)
    ctx = np.asarray(step_meta.context_lens, np.int32)
    num = int(np.asarray(step_meta.num_seqs))
    positions = np.asarray(step_meta.positions, np.int32)
    fields: dict[str, np.ndarray | int | str] = {
        "pages_tables": np.maximum(np.asarray(step_meta.page_table, np.int32), 0), "context_lens": ctx,
        "query_start_loc": qsl, "num_seqs": np.asarray([num], np.int32), "position_ids": np.maximum(positions, 0),
        "page_size": int(page_size), "version": version,
    }  # fmt: skip
    new = qsl[1 : num + 1] - qsl[:num]
    if version == "v3":
        decode = int(np.sum((new == 1) & (ctx[:num] > 1)))
        prefill = int(np.sum(new > 0)) - decode
        fields["request_distribution"] = np.asarray([decode, decode + prefill, num], np.int32)
        return fields
    slots = np.asarray(step_meta.slot_mapping, np.int64)
    starts: list[int] = []
    token_starts: list[int] = []
    lengths: list[int] = []
    for t in np.flatnonzero(slots >= 0):  # split runs of consecutive slots at page ends
        s = int(slots[t])
        if lengths and s == starts[-1] + lengths[-1] and s % page_size and t == token_starts[-1] + lengths[-1]:
            lengths[-1] += 1
        else:
            starts.append(s)
            token_starts.append(int(t))
            lengths.append(1)
    width = positions.shape[0] if padded_num_slices is None else int(padded_num_slices)
    if len(starts) > width:
        raise ValueError(f"{len(starts)} slices do not fit padded_num_slices={width}")
    mapping = np.zeros((3, width), np.int32)
    mapping[:, : len(starts)] = [starts, token_starts, lengths]
    fields["slot_mapping"] = mapping
    fields["num_kv_update_slices"] = np.asarray([len(starts)], np.int32)
    return fields
