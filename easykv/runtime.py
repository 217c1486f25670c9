"""Per-step runtime metadata: which slot each new token goes to and which pages each sequence reads.

`PagedAttentionMetadata` keeps EasyDeL's five fields (one prefill sequence, or a batch of decodes)
and adds a mixed form for continuous batching: a ragged batch of prefill chunks and decodes in
one step, described by a slot per new token plus a page table and a length per sequence.

Arrays are built on the host with numpy (small int32 arrays) and validated there, so a bad page
id or an over-long sequence is reported before anything reaches the device. Inside jit the write
path still drops, and counts, any slot outside the pool: it never clips into another page.

Conventions (all int32):
  * a *slot* is ``page_id * page_size + offset``; ``PAD_SLOT`` (-1) marks a padding token and
    ``INVALID_SLOT`` (-2) a real token with no valid destination (dropped and counted);
  * a page table entry of ``PAD_PAGE`` (-1) is an unassigned page;
  * a position is the token's index inside its sequence; -1 marks padding.

Host checks (the ``for_*`` constructors): every id and length is bounded exactly before any
arithmetic (`easykv.validation`), a table row never names one physical page twice, and no two
real tokens of a step share a slot (a write would keep one of them, silently). Device side,
`slots_from_table` bounds every page id before multiplying it by the page size, so no page id,
however large, can wrap around int32 into another page.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import numpy as np

from easykv.spec.serialization import Serializable
from easykv.validation import INT32_MAX, integer, integer_array, optional_int

if TYPE_CHECKING:
    from easykv.spec.metadata import PagedAttentionCacheMetaData

PAD_SLOT = -1
INVALID_SLOT = -2
PAD_PAGE = -1
PAD_POSITION = -1


def _absent() -> np.ndarray:
    # EasyDeL marks a mode as absent with a shape-() array; we keep that convention.
    return np.zeros((), np.int32)


def _present(x: Any) -> bool:
    return np.ndim(x) > 0


def _array_field() -> Any:
    return dataclasses.field(default_factory=_absent, metadata={"codec": "array"})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedAttentionMetadata(Serializable):
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

    ``to_dict`` / ``to_json`` write every array exactly (dtype, shape, bytes); ``from_dict`` /
    ``from_json`` give numpy arrays back.
    """

    SCHEMA: ClassVar[str] = "easykv.PagedAttentionMetadata"
    SCHEMA_VERSION: ClassVar[int] = 1

    prefill_length: jax.Array | np.ndarray = _array_field()
    prefill_position: jax.Array | np.ndarray = _array_field()
    prefill_page_table: jax.Array | np.ndarray = _array_field()
    decodes_position: jax.Array | np.ndarray = _array_field()
    decodes_page_table: jax.Array | np.ndarray = _array_field()
    slot_mapping: jax.Array | np.ndarray = _array_field()
    positions: jax.Array | np.ndarray = _array_field()
    query_start_loc: jax.Array | np.ndarray = _array_field()
    page_table: jax.Array | np.ndarray = _array_field()
    context_lens: jax.Array | np.ndarray = _array_field()
    num_seqs: jax.Array | np.ndarray = _array_field()

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
        row = _page_ids("page_table_row", page_table_row, cache_metadata, ndim=1)
        limit = _max_tokens(cache_metadata)
        hint = f"a sequence holds at most num_pages_per_sequence * page_size = {limit} tokens"
        length = integer("length", length, lo=0, hi=limit, hint=hint)
        start = integer("start", start, lo=0, hi=limit, hint=hint)
        padded = optional_int("padded_length", padded_length, lo=0, hi=limit, hint=hint)
        padded = length if padded is None else padded
        if padded < length:
            raise ValueError(f"padded_length={padded} is shorter than length={length}; pass >= length")
        _check_extent(start + length, cache_metadata, what=f"prefill up to start + length = {start + length}")
        positions = np.full(padded, PAD_POSITION, np.int32)
        positions[:length] = np.arange(start, start + length, dtype=np.int32)
        _check_pages_assigned(row[None, :], positions[None, :length], cache_metadata.page_size)
        check_distinct_slots(_host_slots(row[None, :], positions[None, :length], cache_metadata.page_size), "prefill")
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
        table = _page_ids("page_table", page_table, cache_metadata, ndim=2)
        pos = integer_array("positions", positions, ndim=1, lo=PAD_POSITION, hi=_max_tokens(cache_metadata) - 1,
                            hint="a token's index in its sequence, -1 for padding")
        if table.shape[0] != pos.shape[0]:
            raise ValueError(
                f"page_table has {table.shape[0]} rows but positions has {pos.shape[0]} entries; "
                "give one position per sequence (-1 for padding rows)"
            )
        _check_pages_assigned(table, pos[:, None], cache_metadata.page_size)
        check_distinct_slots(_host_slots(table, pos[:, None], cache_metadata.page_size), "decode")
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
        table = _page_ids("page_table", page_table, cache_metadata, ndim=2)
        limit = _max_tokens(cache_metadata)
        hint = f"a sequence holds at most num_pages_per_sequence * page_size = {limit} tokens"
        cached = integer_array("cached_lens", cached_lens, ndim=1, lo=0, hi=limit, hint=hint)
        new = integer_array("new_lens", new_lens, ndim=1, lo=0, hi=limit, hint=hint)
        pad_tokens_to, pad_seqs_to = check_padding(cache_metadata, int(new.sum(dtype=np.int64)), table.shape[0],
                                                   pad_tokens_to, pad_seqs_to)
        if not table.shape[0] == cached.shape[0] == new.shape[0]:
            raise ValueError(
                f"page_table rows ({table.shape[0]}), cached_lens ({cached.shape[0]}) and new_lens "
                f"({new.shape[0]}) must agree: one entry per sequence"
            )
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
        rows = np.repeat(np.arange(table.shape[0]), new)  # the real tokens lead the token axis
        _check_pages_assigned(table[rows], meta.positions[: rows.size, None], cache_metadata.page_size, rows)
        check_distinct_slots(meta.slot_mapping, "mixed")
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

    Callers guarantee int32 inputs with pages assigned for every new token and paddings
    checked by `check_padding`; `for_mixed` is the validated public entry point.
    """
    num_seqs = page_table.shape[0]
    total = int(new_lens.sum())
    tokens = total if pad_tokens_to is None else pad_tokens_to
    seqs = num_seqs if pad_seqs_to is None else pad_seqs_to

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


def slots_from_table(table: Any, positions: Any, *, page_size: int, num_pages: int | None,
                     pages_per_sequence: int | None = None) -> Any:
    """Slots of tokens at ``positions`` (-1: padding) read through per-token table rows, on the
    host (numpy) or the device (jax, inside jit too).

    A real token whose logical page lies past the table (or past ``pages_per_sequence``), or
    whose page is unassigned or outside the pool, gets ``INVALID_SLOT``: dropped and counted by
    the write, never clipped or wrapped onto another page. With ``num_pages=None`` the pool size
    is unknown here: pages whose slots would not fit int32 are invalid, larger ones the write
    drops against the pool it knows."""
    xp = array_module(table, positions)
    logical = positions // page_size
    width = table.shape[-1] if pages_per_sequence is None else min(table.shape[-1], pages_per_sequence)
    in_table = (positions >= 0) & (logical < width)
    page = xp.take_along_axis(table, xp.where(in_table, logical, 0)[..., None], axis=-1)[..., 0]
    last = (INT32_MAX + 1) // page_size - 1  # the last page whose every slot fits int32
    ok = in_table & (page >= 0) & (page <= (last if num_pages is None else min(num_pages - 1, last)))
    slot = xp.where(ok, xp.where(ok, page, 0) * page_size + positions % page_size, INVALID_SLOT)
    return xp.where(positions == PAD_POSITION, PAD_SLOT, slot).astype(np.int32)


def increment_cache_lengths(metadata: PagedAttentionMetadata, *, page_size: int,
                            num_pages: int | None = None) -> PagedAttentionMetadata:
    """The next decode step from a decode-only mixed-form step: every real token moves one
    position on, its slot is read from the (already reserved) page table, context lengths grow
    by one. Works on numpy and jax arrays alike, inside jit too, so a multi-step loop runs
    without a host round trip [MAX: increment_cache_lengths]. A token whose next page the
    table lacks, or names outside the pool (``num_pages``), gets ``INVALID_SLOT``: the write
    drops and counts it, never writes another sequence's page."""
    if not isinstance(metadata, PagedAttentionMetadata) or not metadata.is_mixed_mode():
        raise ValueError(f"increment_cache_lengths takes mixed-form decode metadata (build_decode_metadata, "
                         f"for_mixed), got {type(metadata).__name__}")
    page_size = integer("page_size", page_size, lo=1)
    num_pages = optional_int("num_pages", num_pages, lo=1)
    xp = array_module(metadata.positions)
    pos = metadata.positions
    table = metadata.page_table
    if pos.shape[0] > table.shape[0]:
        raise ValueError(f"{pos.shape[0]} tokens for {table.shape[0]} sequences: increment_cache_lengths "
                         "takes decode-only metadata (one token per sequence)")
    real = (pos >= 0) & (pos < INT32_MAX)  # the last position cannot move on without wrapping
    nxt = xp.where(real, pos + 1, PAD_POSITION)
    slots = slots_from_table(table[: pos.shape[0]], nxt, page_size=page_size, num_pages=num_pages)
    return metadata.replace(
        positions=nxt.astype(np.int32),
        slot_mapping=xp.where(pos >= 0, xp.where(real, slots, INVALID_SLOT), PAD_SLOT).astype(np.int32),
        context_lens=(metadata.context_lens + (metadata.context_lens > 0)).astype(np.int32),
    )


_MIXED_FIELDS = ("slot_mapping", "positions", "query_start_loc", "page_table", "context_lens", "num_seqs")


def stack_metadata(steps: Sequence[PagedAttentionMetadata]) -> PagedAttentionMetadata:
    """One metadata whose mixed-form fields gain a leading step axis (absent fields stay absent)."""
    return steps[0].replace(**{f: np.stack([np.asarray(getattr(m, f)) for m in steps]) for f in _MIXED_FIELDS})


def array_module(*arrays: Any) -> Any:
    """numpy when every array is numpy (host work stays on the host), else jax.numpy."""
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np
    import jax.numpy as jnp  # only when handed device arrays

    return jnp


# ---- validation helpers ----------------------------------------------------------------------
def _max_tokens(meta: PagedAttentionCacheMetaData) -> int:
    return meta.num_pages_per_sequence * meta.page_size


def _page_ids(name: str, value: Any, meta: PagedAttentionCacheMetaData, *, ndim: int) -> np.ndarray:
    """A page table (or row): ids in ``-1 .. num_pages - 1``, at most ``num_pages_per_sequence``
    columns, no physical page twice in one row (the sequence would read or write it twice)."""
    table = integer_array(name, value, ndim=ndim, lo=PAD_PAGE, hi=meta.num_pages_per_layer - 1,
                          hint=f"page ids of a pool of {meta.num_pages_per_layer} pages, -1 unassigned")
    if table.shape[-1] > meta.num_pages_per_sequence:
        raise ValueError(
            f"{name} has {table.shape[-1]} pages per sequence but the cache allows "
            f"num_pages_per_sequence={meta.num_pages_per_sequence}; trim the table"
        )
    rows = table.reshape(-1, table.shape[-1])
    if rows.shape[1] > 1:
        ordered = np.sort(rows, axis=1)
        twice = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        if twice.any():
            r = int(np.argmax(twice.any(axis=1)))
            page = int(ordered[r, 1:][twice[r]][0])
            where = f"{name}[{r}]" if ndim == 2 else name
            raise ValueError(f"{where} names page {page} twice; a sequence's pages must be distinct (one "
                             "physical page cannot hold two of its logical pages)")
    return table


def check_padding(meta: PagedAttentionCacheMetaData, tokens: int, seqs: int, pad_tokens_to: Any,
                  pad_seqs_to: Any) -> tuple[int | None, int | None]:
    """Padded token and sequence counts of a step: at least its real ones, at most what one
    step of this cache can hold (``batch_size`` sequences of ``max_sequences`` tokens)."""
    most_seqs = max(meta.batch_size, seqs)
    most_tokens = max(meta.batch_size * _max_tokens(meta), tokens)
    out = []
    for name, pad, real, most, what in (("pad_tokens_to", pad_tokens_to, tokens, most_tokens, "tokens"),
                                        ("pad_seqs_to", pad_seqs_to, seqs, most_seqs, "sequences")):
        pad = optional_int(name, pad, lo=0, hi=most, hint=f"one step holds at most {most} {what} of this cache")
        if pad is not None and pad < real:
            raise ValueError(f"{name}={pad} is below the {real} {'new tokens' if what == 'tokens' else what} of "
                             f"this step; pass at least {real}")
        out.append(pad)
    return out[0], out[1]


def _host_slots(table: np.ndarray, positions: np.ndarray, page_size: int) -> np.ndarray:
    """Slots of real tokens given per-row positions (host; pages already checked assigned)."""
    real = positions >= 0
    logical = np.where(real, positions // page_size, 0)
    pages = np.take_along_axis(table, logical, axis=1)
    return np.where(real, pages.astype(np.int64) * page_size + positions % page_size, PAD_SLOT)


def check_distinct_slots(slots: np.ndarray, what: str) -> None:
    """No two real tokens of one step share a slot: the scatter would keep one and lose the
    other (two sequences sharing a page they both write, or a crafted table)."""
    real = np.asarray(slots).reshape(-1)
    real = real[real >= 0]
    if real.size > 1:
        ordered = np.sort(real)
        twice = ordered[1:] == ordered[:-1]
        if twice.any():
            slot = int(ordered[1:][twice][0])
            raise ValueError(f"two tokens of this {what} step write the same slot {slot}; each token needs its own "
                             "slot (sequences may share pages they read, never a page they write: copy-on-write "
                             "first)")


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
