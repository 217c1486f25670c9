"""Per-step runtime metadata: which slot each new token goes to and which pages each sequence reads.

`PagedAttentionMetadata` keeps EasyDeL's five fields (one prefill sequence, or a batch of decodes)
and adds a mixed form for continuous batching: a ragged batch of prefill chunks and decodes in
one step, described by a slot per new token plus a page table and a length per sequence.

Arrays are built on the host with numpy (small int32 arrays) and validated there, so a bad page
id or an over-long sequence is reported before anything reaches the device. Inside jit the write
path still drops, and counts, any slot outside the pool: it never clips into another page.

Conventions (all int32):
  * a *slot* is ``page_id * page_size + offset``; ``PAD_SLOT`` (-1) marks a padding token;
  * a page table entry of ``PAD_PAGE`` (-1) is an unassigned page;
  * a position is the token's index inside its sequence; -1 marks padding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from easykv.validation import non_negative_int
if TYPE_CHECKING:
    from easykv.metadata import PagedAttentionCacheMetaData

PAD_SLOT = -1
PAD_PAGE = -1
PAD_POSITION = -1


def _absent() -> np.ndarray:
    # EasyDeL marks a mode as absent with a shape-() array; we keep that convention.
    return np.zeros((), np.int32)


def _present(x: Any) -> bool:
    return np.ndim(x) > 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedAttentionMetadata:
    """The device-side description of one engine step.

    EasyDeL fields (absent parts are shape-() arrays):
      prefill_length:     () real tokens in the prefill chunk.
      prefill_position:   (padded_prefill_len,) position of each chunk token; -1 for padding.
      prefill_page_table: (num_pages_for_prefill,) physical pages of the prefill sequence.
      decodes_position:   (batch,) position of the new token of each sequence; -1 for padding.
      decodes_page_table: (batch, num_pages_per_sequence) physical pages per sequence.

    Mixed form (continuous batching; absent parts are shape-() arrays):
      slot_mapping:    (num_tokens,) slot of each new token; -1 for padding.
      positions:       (num_tokens,) position of each new token in its sequence; -1 for padding.
      query_start_loc: (num_seqs + 1,) offsets of each sequence's new tokens in the token axis.
      page_table:      (num_seqs, num_pages_per_sequence) physical pages per sequence.
      context_lens:    (num_seqs,) tokens cached per sequence after this step's writes.
      num_seqs:        () real sequences (the rest of the padded batch has no tokens).
    """

    prefill_length: jax.Array | np.ndarray = dataclasses.field(default_factory=_absent)
    prefill_position: jax.Array | np.ndarray = dataclasses.field(default_factory=_absent)
    prefill_page_table: jax.Array | np.ndarray = dataclasses.field(default_factory=_absent)
    decodes_position: jax.Array | np.ndarray = dataclasses.field(default_factory=_absent)
    decodes_page_table: jax.Array | np.ndarray = dataclasses.field(default_factory=_absent)
    slot_mapping: jax.Array | np.ndarray = dataclasses.field(default_factory=_absent)
    positions: jax.Array | np.ndarray = dataclasses.field(default_factory=_absent)
    query_start_loc: jax.Array | np.ndarray = dataclasses.field(default_factory=_absent)
    page_table: jax.Array | np.ndarray = dataclasses.field(default_factory=_absent)
    context_lens: jax.Array | np.ndarray = dataclasses.field(default_factory=_absent)
    num_seqs: jax.Array | np.ndarray = dataclasses.field(default_factory=_absent)

    # ---- EasyDeL's API -------------------------------------------------------------------
    @classmethod
    def init_empty(cls) -> PagedAttentionMetadata:
        """A placeholder with every mode absent."""
        return cls()

    def is_prefill_mode(self) -> bool:
        return (
            _present(self.prefill_page_table)
            and not _present(self.decodes_page_table)
            and not _present(self.slot_mapping)
        )

    def is_decode_mode(self) -> bool:
        return (
            _present(self.decodes_page_table)
            and not _present(self.prefill_page_table)
            and not _present(self.slot_mapping)
        )

    def is_mixed_mode(self) -> bool:
        return _present(self.slot_mapping)

    def replace(self, **changes: Any) -> PagedAttentionMetadata:
        return dataclasses.replace(self, **changes)

    @property
    def num_tokens(self) -> int:
        """Static number of token rows a write with this metadata expects."""
        if self.is_mixed_mode():
            return int(np.shape(self.slot_mapping)[0])
        if self.is_decode_mode():
            return int(np.shape(self.decodes_position)[0])
        if self.is_prefill_mode():
            return int(np.shape(self.prefill_position)[0])
        raise ValueError("this PagedAttentionMetadata is empty (init_empty); it names no tokens")

    # ---- host-side constructors (validated) ---------------------------------------------
    @classmethod
    def for_prefill(
        cls,
        page_table_row: Sequence[int] | np.ndarray,
        length: int,
        *,
        cache_metadata: PagedAttentionCacheMetaData,
        start: int = 0,
        padded_length: int | None = None,
    ) -> PagedAttentionMetadata:
        """One sequence's prefill chunk: tokens ``start .. start + length - 1``.

        ``padded_length`` (default ``length``) fixes the token axis so that jit sees few shapes.
        """
        row = _as_int32("page_table_row", page_table_row, ndim=1)
        length = non_negative_int("length", length)
        start = non_negative_int("start", start)
        padded = length if padded_length is None else non_negative_int("padded_length", padded_length)
        if padded < length:
            raise ValueError(f"padded_length={padded} is shorter than length={length}; pass >= length")
        _check_page_ids("page_table_row", row, cache_metadata)
        _check_extent(start + length, cache_metadata, what=f"prefill up to start + length = {start + length}")
        positions = np.full(padded, PAD_POSITION, np.int32)
        positions[:length] = np.arange(start, start + length, dtype=np.int32)
        _check_pages_assigned(row[None, :], positions[None, :length], cache_metadata.page_size)
        return cls(
            prefill_length=np.asarray(length, np.int32),
            prefill_position=positions,
            prefill_page_table=row,
        )

    @classmethod
    def for_decode(
        cls,
        page_table: Sequence[Sequence[int]] | np.ndarray,
        positions: Sequence[int] | np.ndarray,
        *,
        cache_metadata: PagedAttentionCacheMetaData,
    ) -> PagedAttentionMetadata:
        """A batch of decodes: sequence ``b`` writes one token at ``positions[b]`` (-1: padding)."""
        table = _as_int32("page_table", page_table, ndim=2)
        pos = _as_int32("positions", positions, ndim=1)
        if table.shape[0] != pos.shape[0]:
            raise ValueError(
                f"page_table has {table.shape[0]} rows but positions has {pos.shape[0]} entries; "
                "give one position per sequence (-1 for padding rows)"
            )
        _check_page_ids("page_table", table, cache_metadata)
        if np.any(pos < PAD_POSITION):
            raise ValueError(f"positions {pos.tolist()} contain values below -1 (the padding marker)")
        _check_extent(int(pos.max(initial=-1)) + 1, cache_metadata, what="decode position + 1")
        _check_pages_assigned(table, pos[:, None], cache_metadata.page_size)
        return cls(decodes_position=pos, decodes_page_table=table)

    @classmethod
    def for_mixed(
        cls,
        page_table: Sequence[Sequence[int]] | np.ndarray,
        cached_lens: Sequence[int] | np.ndarray,
        new_lens: Sequence[int] | np.ndarray,
        *,
        cache_metadata: PagedAttentionCacheMetaData,
        pad_tokens_to: int | None = None,
        pad_seqs_to: int | None = None,
    ) -> PagedAttentionMetadata:
        """A ragged batch: sequence ``b`` has ``cached_lens[b]`` tokens cached and appends
        ``new_lens[b]`` (a prefill chunk when > 1, a decode when 1)."""
        table = _as_int32("page_table", page_table, ndim=2)
        cached = _as_int32("cached_lens", cached_lens, ndim=1)
        new = _as_int32("new_lens", new_lens, ndim=1)
        if not table.shape[0] == cached.shape[0] == new.shape[0]:
            raise ValueError(
                f"page_table rows ({table.shape[0]}), cached_lens ({cached.shape[0]}) and new_lens "
                f"({new.shape[0]}) must agree: one entry per sequence"
            )
        for name, arr in (("cached_lens", cached), ("new_lens", new)):
            if np.any(arr < 0):
                raise ValueError(f"{name} {arr.tolist()} has negative entries; lengths are >= 0")
        _check_page_ids("page_table", table, cache_metadata)
        ends = cached.astype(np.int64) + new
        worst = int(np.argmax(ends)) if ends.size else 0
        _check_extent(int(ends.max(initial=0)), cache_metadata, what=f"sequence {worst}: cached + new")
        needed = -(-ends // cache_metadata.page_size) * (new > 0)
        if np.any(needed > table.shape[1]):
            b = int(np.argmax(needed > table.shape[1]))
            raise ValueError(
                f"sequence {b} reaches {int(ends[b])} tokens, which needs {int(needed[b])} pages, but "
                f"the page table has only {table.shape[1]} columns; widen the table"
            )
        meta = build_mixed(
            table, cached, new, page_size=cache_metadata.page_size,
            pad_tokens_to=pad_tokens_to, pad_seqs_to=pad_seqs_to,
        )
        real = meta.slot_mapping != PAD_SLOT
        rows = np.repeat(np.arange(table.shape[0]), new)
        _check_pages_assigned(table[rows], meta.positions[real][:, None], cache_metadata.page_size, rows)
        return meta


def build_mixed(
    page_table: np.ndarray,
    cached_lens: np.ndarray,
    new_lens: np.ndarray,
    *,
    page_size: int,
    pad_tokens_to: int | None = None,
    pad_seqs_to: int | None = None,
) -> PagedAttentionMetadata:
    """Vectorized, unvalidated construction of the mixed form (the page manager's hot path).

    Callers guarantee int32 inputs with pages assigned for every new token; `for_mixed` is the
    validated public entry point.
    """
    num_seqs = page_table.shape[0]
    total = int(new_lens.sum())
    tokens = total if pad_tokens_to is None else int(pad_tokens_to)
    seqs = num_seqs if pad_seqs_to is None else int(pad_seqs_to)
    if tokens < total:
        raise ValueError(f"pad_tokens_to={tokens} is below the {total} new tokens of this step")
    if seqs < num_seqs:
        raise ValueError(f"pad_seqs_to={seqs} is below the {num_seqs} sequences of this step")

    starts = np.zeros(seqs + 1, np.int32)
    np.cumsum(new_lens, out=starts[1 : num_seqs + 1])
    starts[num_seqs + 1 :] = total
    owner = np.repeat(np.arange(num_seqs, dtype=np.int32), new_lens)
    pos = cached_lens[owner] + (np.arange(total, dtype=np.int32) - starts[owner])
    pages = page_table[owner, pos // page_size]

    slot_mapping = np.full(tokens, PAD_SLOT, np.int32)
    slot_mapping[:total] = pages * page_size + pos % page_size
    positions = np.full(tokens, PAD_POSITION, np.int32)
    positions[:total] = pos
    table = np.full((seqs, page_table.shape[1]), PAD_PAGE, np.int32)
    table[:num_seqs] = page_table
    context = np.zeros(seqs, np.int32)
    context[:num_seqs] = cached_lens + new_lens
    return PagedAttentionMetadata(
        slot_mapping=slot_mapping,
        positions=positions,
        query_start_loc=starts,
        page_table=table,
        context_lens=context,
        num_seqs=np.asarray(num_seqs, np.int32),
    )


def increment_cache_lengths(metadata: PagedAttentionMetadata, *, page_size: int) -> PagedAttentionMetadata:
    """The next decode step from a decode-only mixed-form step: every real token moves one
    position on, its slot is read from the (already reserved) page table, context lengths grow
    by one. Works on numpy and jax arrays alike, inside jit too, so a multi-step loop runs
    without a host round trip [MAX: increment_cache_lengths]. Pages the table lacks give
    slot -1 (dropped by the write), never another sequence's slot."""
    xp = _xp(metadata.positions)
    pos = metadata.positions
    table = metadata.page_table
    if pos.shape[0] > table.shape[0]:
        raise ValueError(f"{pos.shape[0]} tokens for {table.shape[0]} sequences: increment_cache_lengths "
                         "takes decode-only metadata (one token per sequence)")
    nxt = pos + 1
    col = xp.clip(nxt // page_size, 0, table.shape[1] - 1)
    page = table[: pos.shape[0]][xp.arange(pos.shape[0]), col]
    real = pos >= 0
    ok = real & (page >= 0) & (nxt // page_size < table.shape[1])
    return metadata.replace(
        positions=(real * (nxt + 1) - 1).astype(np.int32),
        slot_mapping=(ok * (page * page_size + nxt % page_size + 1) - 1).astype(np.int32),
        context_lens=(metadata.context_lens + (metadata.context_lens > 0)).astype(np.int32),
    )


_MIXED_FIELDS = ("slot_mapping", "positions", "query_start_loc", "page_table", "context_lens", "num_seqs")


def stack_metadata(steps: Sequence[PagedAttentionMetadata]) -> PagedAttentionMetadata:
    """One metadata whose mixed-form fields gain a leading step axis (absent fields stay absent)."""
    return steps[0].replace(**{f: np.stack([np.asarray(getattr(m, f)) for m in steps]) for f in _MIXED_FIELDS})


def _xp(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return np
    import jax.numpy as jnp  # only when handed device arrays

    return jnp


# ---- validation helpers ----------------------------------------------------------------------
def _as_int32(name: str, value: Any, *, ndim: int) -> np.ndarray:
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{name} is a traced value; build PagedAttentionMetadata on the host, outside jit")
    arr = np.asarray(value)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{name} has values outside int32: min {arr.min()}, max {arr.max()}")
    return arr.astype(np.int32, copy=True)


def _check_page_ids(name: str, table: np.ndarray, meta: PagedAttentionCacheMetaData) -> None:
    if table.shape[-1] > meta.num_pages_per_sequence:
        raise ValueError(
            f"{name} has {table.shape[-1]} pages per sequence but the cache allows "
            f"num_pages_per_sequence={meta.num_pages_per_sequence}; trim the table"
        )
    bad = (table < PAD_PAGE) | (table >= meta.num_pages_per_layer)
    if np.any(bad):
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name}{list(where)} = {int(table[where])} names a page outside the pool of "
            f"{meta.num_pages_per_layer} pages (valid ids 0..{meta.num_pages_per_layer - 1}, -1 unassigned)"
        )


def _check_extent(end: int, meta: PagedAttentionCacheMetaData, *, what: str) -> None:
    limit = meta.num_pages_per_sequence * meta.page_size
    if end > limit:
        raise ValueError(
            f"{what} reaches {end} tokens, beyond num_pages_per_sequence * page_size = {limit}; "
            "raise max_sequences in the cache metadata or shorten the sequence"
        )


def _check_pages_assigned(
    table: np.ndarray, positions: np.ndarray, page_size: int, row_ids: np.ndarray | None = None
) -> None:
    """Every real token (position >= 0) must land on an assigned page of its row.

    ``row_ids`` names, for the error message, the sequence each row of ``table`` belongs to
    (default: the row index)."""
    real = positions >= 0
    if not np.any(real):
        return
    logical = np.where(real, positions // page_size, 0)
    if np.any(logical >= table.shape[1]):
        row, col = (int(i) for i in np.argwhere(real & (logical >= table.shape[1]))[0])
        seq = row if row_ids is None else int(row_ids[row])
        raise ValueError(
            f"position {int(positions[row, col])} of row {seq} needs logical page {int(logical[row, col])} "
            f"but the page table has only {table.shape[1]} columns; widen the table"
        )
    pages = np.take_along_axis(table, logical, axis=1)
    missing = real & (pages == PAD_PAGE)
    if np.any(missing):
        row, col = (int(i) for i in np.argwhere(missing)[0])
        seq = row if row_ids is None else int(row_ids[row])
        raise ValueError(
            f"position {int(positions[row, col])} of row {seq} falls on logical page "
            f"{int(logical[row, col])}, which is unassigned (-1) in the page table; allocate it first"
        )
