"""Host checks of a step's runtime metadata: each rule once, for the constructors, the write and
attention alike.

Two kinds, as in JAX's ragged paged attention (``static_validate_inputs`` /
``dynamic_validate_inputs``): *static* checks read shapes and dtypes only, cost nothing and run on
every call, traced or not; *value* checks read host (numpy) arrays and run where the values are
known before anything is written or read. Device values are not pulled to the host on the way
(inside jit a bad slot is dropped and counted and a page outside the pool reads nothing); the
opt-in ``PagedAttentionMetadata.check_values`` pulls them and runs the same rules.

A validated constructor (``for_mixed``, ``for_decode``, ``for_prefill``) or the page manager
marks what it proved with :class:`HostChecked`, and the write and attention then skip the value
checks already made: a decode step's table is checked once, not once more per layer. The mark
lives beside the pytree, not in it (a ``replace``, a JSON round trip or a trip through jit drops
it), and the marked arrays are made read-only so that the mark cannot go stale.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from easykv.validation import integer_array, optional_int, page_ids

if TYPE_CHECKING:
    from easykv.spec.metadata import PagedAttentionCacheMetaData

PAD_SLOT = -1
PAD_PAGE = -1


# ---- static: shapes and dtypes ------------------------------------------------------------------
def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in np.shape(x))


def dtype_of(x: Any) -> np.dtype:
    dt = getattr(x, "dtype", None)  # arrays and tracers: never pull values to the host
    return np.dtype(dt) if dt is not None else np.asarray(x).dtype


def is_host(*xs: Any) -> bool:
    """Values known on the host (numpy): their value checks run before anything does."""
    return all(isinstance(x, (np.ndarray, np.generic, int)) for x in xs)


def int_field(name: str, x: Any, *, shape: tuple[int, ...] | None = None, ndim: int | None = None) -> None:
    """Field ``name`` of the runtime metadata holds integers of this shape (or rank)."""
    s = shape_of(x)
    if shape is not None and s != shape:
        raise ValueError(f"metadata.{name} must have shape {shape}, got {s}")
    if ndim is not None and len(s) != ndim:
        raise ValueError(f"metadata.{name} must have {ndim} dimension(s), got shape {s}")
    dt = dtype_of(x)
    if not np.issubdtype(dt, np.integer):
        raise ValueError(f"metadata.{name} must hold integers, got dtype {dt.name}")


# ---- values: what the constructors check --------------------------------------------------------
def max_tokens(meta: PagedAttentionCacheMetaData) -> int:
    return meta.num_pages_per_sequence * meta.page_size


def page_table(name: str, value: Any, meta: PagedAttentionCacheMetaData, *, ndim: int,
               num_pages: int | None = None) -> np.ndarray:
    """A page table (or row): ids in ``-1 .. num_pages - 1`` (default: the largest pool),
    at most ``num_pages_per_sequence`` columns, no physical page twice in one row (the sequence
    would read or write it twice)."""
    pool = meta.num_pages_per_layer if num_pages is None else num_pages
    table = page_ids(name, value, num_pages=pool, ndim=ndim, pad="unassigned")
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
    most_tokens = max(meta.batch_size * max_tokens(meta), tokens)
    out = []
    for name, pad, real, most, what in (("pad_tokens_to", pad_tokens_to, tokens, most_tokens, "tokens"),
                                        ("pad_seqs_to", pad_seqs_to, seqs, most_seqs, "sequences")):
        pad = optional_int(name, pad, lo=0, hi=most, hint=f"one step holds at most {most} {what} of this cache")
        if pad is not None and pad < real:
            raise ValueError(f"{name}={pad} is below the {real} {'new tokens' if what == 'tokens' else what} of "
                             f"this step; pass at least {real}")
        out.append(pad)
    return out[0], out[1]


def check_extent(end: int, meta: PagedAttentionCacheMetaData, *, what: str) -> None:
    limit = max_tokens(meta)
    if end > limit:
        raise ValueError(
            f"{what} reaches {end} tokens, beyond num_pages_per_sequence * page_size = {limit}; "
            "raise max_sequences in the cache metadata or shorten the sequence"
        )


def host_slots(table: np.ndarray, positions: np.ndarray, page_size: int) -> np.ndarray:
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


def check_slots(slots: Any, capacity: int) -> np.ndarray:
    """Host slots of a write: integers, each a slot of the pool or padding, no slot twice.
    Returned as int32."""
    slots = integer_array("slots", slots, ndim=1, lo=None, hi=None, dtype=np.int64)
    bad = (slots != PAD_SLOT) & ((slots < 0) | (slots >= capacity))
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(
            f"token {i} would be written to slot {int(slots[i])}, outside the pool's {capacity} "
            "slots (its page is unassigned, outside the pool, or past the page table); "
            "nothing was written — assign pages before writing"
        )
    check_distinct_slots(slots, "write")
    return slots.astype(np.int32)


def check_pages_assigned(
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


def check_positions(name: str, pos: np.ndarray) -> None:
    if np.any(pos < -1):
        i = int(np.argmax(pos < -1))
        raise ValueError(f"metadata.{name}[{i}] = {int(pos[i])}; positions are >= 0, or -1 for padding")


# ---- the pages a step reads ---------------------------------------------------------------------
def reads_assigned(table: np.ndarray, end_pages: np.ndarray) -> bool:
    """Whether every row ``b`` of ``table`` (ids already checked in ``-1 .. num_pages - 1``) has
    its first ``end_pages[b]`` pages assigned, i.e. its first -1 (if any) lies past them: a
    comparison and two row reductions, no per-column broadcast (the constructors' hot path)."""
    if np.any(end_pages > table.shape[1]):
        return False
    unassigned = table < 0
    if not unassigned.any():
        return True
    first_gap = np.where(unassigned.any(axis=1), unassigned.argmax(axis=1), table.shape[1])
    return bool(np.all(first_gap >= end_pages))


def bad_read(name: str, table: np.ndarray, first: np.ndarray, end: np.ndarray, hi: np.ndarray, *,
             num_pages: int, page_size: int, page_shards: int) -> str:
    """Why row ``b`` of ``table`` cannot be read over its pages ``first[b] .. end[b] - 1`` (the
    keys up to position ``hi[b]``), '' when every row can: each page read must be a page of the
    pool and, with the pool split over ``page_shards`` data-parallel replicas, of one slice."""
    width = table.shape[1]
    if np.any(end > width):
        b = int(np.argmax(end > width))
        return (f"row {b} of metadata.{name} must cover {int(hi[b]) + 1} tokens ({int(end[b])} pages of {page_size}) "
                f"but the table has only {width} columns")
    cols = np.arange(width)[None, :]
    used = (cols >= first[:, None]) & (cols < end[:, None])
    bad = used & ((table < 0) | (table >= num_pages))
    if np.any(bad):
        b, c = (int(i) for i in np.argwhere(bad)[0])
        if table[b, c] < 0:
            return (f"metadata.{name}[{b}, {c}] = {int(table[b, c])} is no page (never assigned, or released when it "
                    f"left a sliding or chunked window) but row {b} reads it (keys {c * page_size}.. up to position "
                    f"{int(hi[b])}); read with the window or chunk the pages were kept for (sliding_window=, "
                    f"chunk_size= of the cache's layer group)")
        return (f"metadata.{name}[{b}, {c}] = {int(table[b, c])} is not a page of the pool (0..{num_pages - 1}) "
                f"but row {b} reads it (keys up to position {int(hi[b])})")
    if page_shards > 1:
        per = num_pages // page_shards
        replica = np.where(used, table // per, -1)
        home = replica.max(axis=1, keepdims=True)
        split = used & (replica != home)
        if np.any(split):
            b, c = (int(i) for i in np.argwhere(split)[0])
            other = int(np.argmax(replica[b] == home[b, 0]))
            return (f"row {b} of metadata.{name} uses pages of two data-parallel replicas (page "
                    f"{int(table[b, c])} in slice {int(replica[b, c])}, page {int(table[b, other])} in slice "
                    f"{int(home[b, 0])}; {per} pages per slice); a sequence's pages must stay in one slice")
    return ""


# ---- a whole step -------------------------------------------------------------------------------
def check_step(rt: Any, names: dict[str, str], *, num_pages: int, page_size: int, page_shards: int = 1,
               window: int | None = None, chunk: int | None = None, tokens: int | None = None) -> None:
    """A mixed-form step (``runtime.as_mixed``) against a pool of ``num_pages`` pages of
    ``page_size`` (split over ``page_shards`` replicas), read with a sliding ``window`` and in
    ``chunk``-sized chunks (None: from the first key) by ``tokens`` query rows (None: any).

    Shapes always. Host (numpy) values unless a mark (`HostChecked`) proves them for this pool:
    sequence offsets in order, positions >= -1 and cached, and every page a query reads in the
    pool (and in one replica's slice). ``names`` maps positions and page_table to the caller's
    own field names for the messages."""
    pos_name, table_name = names["positions"], names["page_table"]
    int_field(pos_name, rt.positions, ndim=1)
    int_field("query_start_loc", rt.query_start_loc, ndim=1)
    int_field(table_name, rt.page_table, ndim=2)
    int_field("context_lens", rt.context_lens, ndim=1)
    int_field("num_seqs", rt.num_seqs, shape=())
    n_tok = shape_of(rt.positions)[0]
    if tokens is not None and n_tok != tokens:
        raise ValueError(f"q has {tokens} rows but metadata.{pos_name} has {n_tok}; give one query row per token")
    seqs = shape_of(rt.page_table)[0]
    if shape_of(rt.query_start_loc)[0] != seqs + 1 or shape_of(rt.context_lens)[0] != seqs:
        raise ValueError(
            f"metadata.page_table has {seqs} rows, so query_start_loc needs {seqs + 1} entries and "
            f"context_lens {seqs}; got {shape_of(rt.query_start_loc)[0]} and {shape_of(rt.context_lens)[0]}"
        )
    arrays = (rt.positions, rt.query_start_loc, rt.page_table, rt.context_lens, rt.num_seqs)
    mark = host_checked(rt)
    if not is_host(*arrays) or (mark is not None and mark.reads and (mark.num_pages, mark.page_size) ==
                                (num_pages, page_size) and page_shards in (1, mark.page_shards)
                                and mark.covers(window, chunk)):
        return
    pos, qsl, table, ctx = (integer_array(name, a, lo=None, hi=None, dtype=np.int64)
                            for name, a in zip((pos_name, "query_start_loc", table_name, "context_lens"), arrays))
    n = int(rt.num_seqs)
    if not 0 <= n <= seqs:
        raise ValueError(f"metadata.num_seqs={n} is outside 0..{seqs} (the rows of page_table)")
    if qsl[0] != 0 or np.any(np.diff(qsl) < 0) or qsl[-1] > n_tok:
        raise ValueError(
            f"metadata.query_start_loc {qsl.tolist()} must start at 0, never decrease and end "
            f"at most at the {n_tok} tokens"
        )
    real = int(qsl[n])
    pos = pos[:real]  # tokens past the real sequences are padding
    check_positions(pos_name, pos)
    owner = np.searchsorted(qsl[1:], np.arange(real), side="right")
    last = np.full(seqs, -1, np.int64)
    np.maximum.at(last, owner, pos)
    over = last >= ctx
    if np.any(over):
        b = int(np.argmax(over))
        raise ValueError(
            f"sequence {b} has a query at position {int(last[b])} but context_lens[{b}] = "
            f"{int(ctx[b])}; a query sees keys up to its own position, which must be cached"
        )
    # Row b reads keys lo[b] .. last[b]: from its earliest query's first visible key to its last query.
    seen = pos >= 0
    owner, pos = owner[seen], pos[seen]
    start = np.zeros_like(pos)  # each query's first visible key
    if window is not None:
        start = np.maximum(start, pos - window + 1)
    if chunk is not None:
        start = np.maximum(start, pos - pos % chunk)
    lo = np.full(seqs, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(lo, owner, start)
    why = bad_read(table_name, table, lo // page_size, (last + page_size) // page_size, last,
                   num_pages=num_pages, page_size=page_size, page_shards=page_shards)
    if why:
        raise ValueError(why)


# ---- what a constructor proved ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HostChecked:
    """The value checks a step's host arrays passed, against a pool of ``num_pages`` pages of
    ``page_size`` tokens: every slot is padding or a distinct slot of the pool (the write's
    checks); with ``reads``, every page a query reads is a page of the pool and, for
    ``page_shards`` > 1, of one replica's slice, for queries that read no further back than
    ``attention`` with ``window`` allows (a sliding or chunked manager releases the pages
    before: its table has holes there; "full": from the first key)."""

    num_pages: int
    page_size: int
    reads: bool
    page_shards: int
    attention: str = "full"
    window: int | None = None

    def covers(self, window: int | None, chunk: int | None) -> bool:
        """Whether a read with a sliding ``window`` and ``chunk`` (None: unbounded) starts no
        earlier than this table reaches, for every query position."""
        if self.attention == "sliding":
            return window is not None and window <= self.window
        if self.attention == "chunked":
            return chunk is not None and self.window % chunk == 0
        return True


_MARK = "_easykv_host_checked"


def _leaves(rt: Any) -> list[Any]:
    return [getattr(rt, f.name) for f in dataclasses.fields(rt)]


def mark_checked(rt: Any, mark: HostChecked) -> Any:
    """Record ``mark`` on ``rt`` (whose arrays are then read-only) and return it."""
    for leaf in _leaves(rt):
        if isinstance(leaf, np.ndarray):
            leaf.flags.writeable = False
    object.__setattr__(rt, _MARK, mark)
    return rt


def host_checked(rt: Any) -> HostChecked | None:
    """The mark of a validated step, None if it has none or an array became writable again."""
    mark = getattr(rt, "__dict__", {}).get(_MARK)
    if mark is None:
        return None
    if any(isinstance(leaf, np.ndarray) and leaf.flags.writeable for leaf in _leaves(rt)):
        return None
    return mark


def carry_mark(src: Any, dst: Any) -> Any:
    """``dst`` (built from ``src``'s arrays) inherits ``src``'s mark when it has one."""
    mark = host_checked(src)
    return dst if mark is None else mark_checked(dst, mark)


__all__ = [
    "HostChecked", "bad_read", "carry_mark", "check_distinct_slots", "check_extent", "check_padding",
    "check_pages_assigned", "check_positions", "check_slots", "check_step", "dtype_of", "host_checked", "host_slots",
    "int_field", "is_host", "mark_checked", "max_tokens", "page_table", "reads_assigned", "shape_of",
]
