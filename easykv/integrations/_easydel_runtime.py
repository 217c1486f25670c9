"""EasyDeL 0.3's per-step ``RaggedPagesMetadata`` <-> easykv's mixed-form ``PagedAttentionMetadata``.

EasyDeL (vLLM-style) describes a step by sequence: a page table row, the tokens cached after the
step (``context_lens``), where each sequence's new tokens start in the token axis
(``query_start_loc``) and how many sequences are real (``num_seqs``); v2 adds a slot mapping in
page-contiguous slices, v3 a request distribution. easykv's mixed form adds what a write needs
per token: its position and its slot. `runtime_from_easydel` derives them on the device, inside
jit, without a host round trip; `easydel_fields_from_easykv` goes the other way on the host (to
drive an EasyDeL model from easykv's PageManager).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from easykv.runtime import PAD_POSITION, PagedAttentionMetadata, slots_from_table


def ragged_fields(metadata: Any) -> Any:
    """The RaggedPagesMetadata inside EasyDeL's OperationsMetadata (or the object itself)."""
    inner = getattr(metadata, "ragged", None) if type(metadata).__name__ == "OperationsMetadata" else metadata
    missing = [f for f in ("pages_tables", "context_lens", "query_start_loc", "num_seqs") if not hasattr(inner, f)]
    if inner is None or missing:
        raise ValueError(f"an easykv view needs EasyDeL's RaggedPagesMetadata (pages_tables, context_lens, "
                        f"query_start_loc, num_seqs); got {type(metadata).__name__}")
    return inner


def runtime_from_easydel(metadata: Any, *, num_tokens: int, page_size: int, num_pages: int,
                         pages_per_sequence: int | None = None) -> PagedAttentionMetadata:
    """easykv's mixed form of an EasyDeL step, traceable (no host sync).

    Token ``t`` belongs to sequence ``b`` when ``query_start_loc[b] <= t < query_start_loc[b+1]``
    and ``b < num_seqs`` (a step whose ``query_start_loc`` decreases among its real sequences
    is all padding); its position is ``context_lens[b] - (query_start_loc[b+1] - t)`` (the
    new tokens are the last of the sequence) and its slot comes from row ``b`` of the page table,
    bounded: a page outside the pool or the row gives an invalid slot that the write drops and
    counts, never another sequence's page. Tokens past the real ones are padding (position -1).
    ``slot_mapping`` and ``request_distribution`` of v2/v3 are not needed: both are derivable.
    """
    md = ragged_fields(metadata)
    i32 = jnp.int32
    ctx = jnp.asarray(md.context_lens, i32).reshape(-1)
    qsl = jnp.asarray(md.query_start_loc, i32).reshape(-1)
    table = jnp.asarray(md.pages_tables, i32)
    if table.ndim == 1:  # v3 kernels take the table flattened
        table = table.reshape(ctx.shape[0], -1)
    seqs = min(ctx.shape[0], qsl.shape[0] - 1, table.shape[0])
    ctx, qsl, table = ctx[:seqs], jnp.clip(qsl[: seqs + 1], 0, num_tokens), table[:seqs]
    num = jnp.clip(jnp.asarray(md.num_seqs, i32).reshape(-1)[0], 0, seqs)
    t = jnp.arange(num_tokens, dtype=i32)
    # Entries past the real sequences are not ordered (EasyDeL pads them freely): search real ones.
    bounds = jnp.where(jnp.arange(seqs) < num, qsl[1:], qsl[num])
    owner = jnp.minimum(jnp.searchsorted(bounds, t, side="right").astype(i32), seqs - 1)
    pos = ctx[owner] - (qsl[owner + 1] - t)
    # query_start_loc out of order would make ranges overlap and searchsorted name a sequence
    # that does not hold the token: such a step writes nothing (every token dropped) rather
    # than into another sequence's pages.
    ordered = jnp.all((qsl[1:] >= qsl[:-1]) | (jnp.arange(seqs) >= num))
    real = ordered & (t < qsl[num]) & (owner < num) & (pos >= 0)
    positions = jnp.where(real, pos, PAD_POSITION).astype(i32)
    slots = slots_from_table(table[owner], positions, page_size=page_size, num_pages=num_pages,
                             pages_per_sequence=pages_per_sequence)
    return PagedAttentionMetadata(
        slot_mapping=slots, positions=positions, query_start_loc=qsl, page_table=table,
        context_lens=jnp.where(jnp.arange(seqs) < num, ctx, 0).astype(i32), num_seqs=num,
    )  # fmt: skip


def easydel_fields_from_easykv(rt: PagedAttentionMetadata, *, page_size: int, version: str = "v3",
                               padded_num_slices: int | None = None) -> dict[str, Any]:
    """RaggedPagesMetadata's fields for a host-side easykv mixed-form step (numpy in, numpy out).

    Unassigned page-table entries (-1) become 0, as EasyDeL's engine leaves them; padding
    positions become 0. v3 gets ``request_distribution`` = [decodes, decodes + prefills,
    sequences] (a decode: one new token after at least one cached); v2 gets ``slot_mapping`` as
    EasyDeL's page-contiguous slices ``[cache start, token start, length]`` padded to
    ``padded_num_slices`` (default: one per token) and ``num_kv_update_slices``.
    """
    if not rt.is_mixed_mode():
        raise ValueError("easydel metadata is built from easykv's mixed form (PagedAttentionMetadata.for_mixed or "
                         "PageManager.build_step_metadata)")
    if version not in ("v2", "v3"):
        raise ValueError(f"version {version!r}: EasyDeL 0.3 ragged-page metadata is 'v2' or 'v3'")
    qsl = np.asarray(rt.query_start_loc, np.int32)
    ctx = np.asarray(rt.context_lens, np.int32)
    num = int(np.asarray(rt.num_seqs))
    positions = np.asarray(rt.positions, np.int32)
    fields: dict[str, Any] = {
        "pages_tables": np.maximum(np.asarray(rt.page_table, np.int32), 0), "context_lens": ctx,
        "query_start_loc": qsl, "num_seqs": np.asarray([num], np.int32), "position_ids": np.maximum(positions, 0),
        "page_size": int(page_size), "version": version,
    }  # fmt: skip
    new = qsl[1 : num + 1] - qsl[:num]
    if version == "v3":
        decode = int(np.sum((new == 1) & (ctx[:num] > 1)))
        prefill = int(np.sum(new > 0)) - decode
        fields["request_distribution"] = np.asarray([decode, decode + prefill, num], np.int32)
        return fields
    slots = np.asarray(rt.slot_mapping, np.int64)
    starts, token_starts, lengths = [], [], []
    for t in np.flatnonzero(slots >= 0):  # split runs of consecutive slots at page ends
        s = int(slots[t])
        if lengths and s == starts[-1] + lengths[-1] and s % page_size and t == token_starts[-1] + lengths[-1]:
            lengths[-1] += 1
        else:
            starts.append(s), token_starts.append(int(t)), lengths.append(1)
    width = positions.shape[0] if padded_num_slices is None else int(padded_num_slices)
    if len(starts) > width:
        raise ValueError(f"{len(starts)} slices do not fit padded_num_slices={width}")
    mapping = np.zeros((3, width), np.int32)
    mapping[:, : len(starts)] = [starts, token_starts, lengths]
    fields["slot_mapping"] = mapping
    fields["num_kv_update_slices"] = np.asarray([len(starts)], np.int32)
    return fields
