"""Host checks of a step's runtime metadata: each rule once, for the constructors, the write and
attention alike.

Two kinds, as in JAX's ragged paged attention (``static_validate_inputs`` /
``dynamic_validate_inputs``): *static* checks read shapes and dtypes only, cost nothing and run on
every call, traced or not; *value* checks read host (numpy) arrays and run where the values are
known before anything is written or read. Device values are not pulled to the host on the way
(inside jit a bad slot is dropped and counted and a page outside the pool reads nothing); the
opt-in ``check_values`` of a step pulls them and runs the same rules.

What the page manager or a validated constructor (``for_mixed``, ``for_decode``, ``for_prefill``)
proved is a :class:`HostChecked`, declared on the step (`CarriesProof`: a ``RaggedStep``, or
EasyDeL's ``PagedAttentionMetadata``): `mark_checked` issues it for the step's arrays,
``.checked`` reads it, and ``proof=`` carries it only over those very arrays (a proof written by
hand, or moved onto other arrays, is refused). The write and attention then skip the value
checks it covers: a decode step's table is checked once, not once more per layer.
The proof is neither a pytree leaf nor a dataclass field, so a ``replace``, a JSON round trip,
``jax.tree.map`` or a trip through jit builds the metadata anew without it. The arrays it rests on
are the metadata's own and read-only (a caller's writable array is copied, never frozen); one made
writable again voids it (`host_checked`).

What a proof says of the pages a step reads is still checked on host tables, on every call, by a
scan of the pages read (`check_vouched_reads`): a bug in whatever issued the proof (a window page
released one step early) raises, rather than attention silently reading a hole.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import jax
import numpy as np
from numpy.typing import ArrayLike

from easykv.spec.groups import AttentionKind
from easykv.spec.windows import first_seen, read_rules
from easykv.validation import integer_array, optional_int, page_ids

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from easykv.spec.metadata import PagedAttentionCacheMetaData

PAD_SLOT = -1
PAD_PAGE = -1

Array = jax.Array | np.ndarray  # a step's fields: numpy on the host, jax on the device (or traced)
Shaped = ArrayLike | jax.ShapeDtypeStruct  # what has a shape: arrays, tracers, shape structs, lists


class StepReads(NamedTuple):
    """The fields of a mixed-form step that say what it reads (`check_step`)."""

    positions: Array
    query_start_loc: Array
    page_table: Array
    context_lens: Array
    num_seqs: Array


_Step = TypeVar("_Step", bound="DataclassInstance")
_NEVER = np.iinfo(np.int64).max  # a first page past every column: the sequence reads nothing
ReadKey = tuple[int, int, int, int | None, int | None]  # a read: pool, page size, replicas, window, chunk


# ---- static: shapes and dtypes ------------------------------------------------------------------
def shape_of(x: Shaped) -> tuple[int, ...]:
    if isinstance(x, np.ndarray):  # the host's hot path: already a tuple of ints
        shape: tuple[int, ...] = x.shape
        return shape
    return tuple(int(d) for d in np.shape(x))


def dtype_of(x: object) -> np.dtype:
    dt = getattr(x, "dtype", None)  # arrays and tracers: never pull values to the host
    return np.dtype(dt) if dt is not None else np.asarray(x).dtype


def is_host(*xs: object) -> bool:
    """Values known on the host (numpy): their value checks run before anything does."""
    return all(isinstance(x, (np.ndarray, np.generic, int)) for x in xs)


def int_field(name: str, x: Shaped, *, shape: tuple[int, ...] | None = None, ndim: int | None = None) -> None:
    """Field ``name`` of the runtime metadata holds integers of this shape (or rank)."""
    s = shape_of(x)
    if shape is not None and s != shape:
        raise ValueError(f"metadata.{name} must have shape {shape}, got {s}")
    if ndim is not None and len(s) != ndim:
        raise ValueError(f"metadata.{name} must have {ndim} dimension(s), got shape {s}")
    dt = dtype_of(x)
    if dt.kind not in "iu" and not np.issubdtype(dt, np.integer):  # kinds first: issubdtype is slow
        raise ValueError(f"metadata.{name} must hold integers, got dtype {dt.name}")


def check_decode_fields(positions: Shaped, table: Shaped) -> int:
    """EasyDeL's decode form: ``decodes_position`` (batch,) and ``decodes_page_table`` (batch,
    pages) integers. Returns the batch."""
    int_field("decodes_position", positions, ndim=1)
    int_field("decodes_page_table", table, ndim=2)
    batch = shape_of(positions)[0]
    if shape_of(table)[0] != batch:
        raise ValueError(f"metadata.decodes_page_table has {shape_of(table)[0]} rows but "
                         f"decodes_position has {batch} entries")
    return batch


def check_prefill_fields(length: Shaped, positions: Shaped, table: Shaped) -> int:
    """EasyDeL's prefill form: ``prefill_length`` () within the padded chunk (when known on the
    host), ``prefill_position`` (padded,) and ``prefill_page_table`` (pages,) integers. Returns
    the padded length."""
    int_field("prefill_length", length, shape=())
    int_field("prefill_position", positions, ndim=1)
    int_field("prefill_page_table", table, ndim=1)
    padded = shape_of(positions)[0]
    if is_host(length):
        n = int(np.asarray(length))
        if not 0 <= n <= padded:
            raise ValueError(f"metadata.prefill_length={n} is outside 0..{padded} (the padded chunk)")
    return padded


# ---- values: what the constructors check --------------------------------------------------------
def max_tokens(meta: PagedAttentionCacheMetaData) -> int:
    return meta.num_pages_per_sequence * meta.page_size


def page_table(name: str, value: object, meta: PagedAttentionCacheMetaData, *, ndim: int,
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


def check_padding(meta: PagedAttentionCacheMetaData, tokens: int, seqs: int, pad_tokens_to: object,
                  pad_seqs_to: object) -> tuple[int | None, int | None]:
    """Padded token and sequence counts of a step: at least its real ones, at most what one
    step of this cache can hold (``batch_size`` sequences of ``num_pages_per_sequence * page_size``
    tokens: ``max_sequences`` rounded up to whole pages)."""
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


def check_slots(slots: object, capacity: int) -> np.ndarray:
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


def read_spans(pos: np.ndarray, qsl: np.ndarray, num_seqs: int, *, page_size: int, window: int | None,
               chunk: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What each sequence of a mixed-form step reads, ``(first, end, last)``: its pages
    ``first[b] .. end[b] - 1``, from its earliest query's first visible key (with a sliding
    ``window`` or in ``chunk``-sized chunks; else its first key) up to its last query's position
    ``last[b]`` (-1: no query, and then no page). ``qsl`` must be in order, from 0 to at most
    ``len(pos)``; tokens past ``qsl[num_seqs]`` are padding. Per-sequence reductions over the
    tokens: O(tokens + sequences)."""
    seqs = qsl.shape[0] - 1
    bounds = qsl[: num_seqs + 1]
    last = np.full(seqs, -1, np.int64)
    rules = read_rules(window, chunk)
    # Without a window or chunk every row reads from its first key; one without a query has
    # end = 0, so it reads nothing all the same.
    lo = np.full(seqs, _NEVER, np.int64) if rules else np.zeros(seqs, np.int64)
    if num_seqs and bounds[-1] > 0:
        counts = np.diff(bounds)
        # Reduce per segment of tokens; a sequence without tokens must not open one (reduceat
        # would read the next sequence's first token for it).
        rows: slice | np.ndarray = slice(0, num_seqs) if counts.min() > 0 else np.flatnonzero(counts > 0)
        at = bounds[:-1][rows]
        pos = pos[: bounds[-1]]
        last[rows] = np.maximum.reduceat(pos, at)
        if rules:
            pos = pos.astype(np.int64)
            start = first_seen(pos, rules, np)  # each query's first visible key
            lo[rows] = np.minimum.reduceat(np.where(pos >= 0, start, _NEVER), at)
    return lo // page_size, (last + page_size) // page_size, last


def bad_read(name: str, table: np.ndarray, first: np.ndarray, end: np.ndarray, hi: np.ndarray, *,
             num_pages: int, page_size: int, page_shards: int, vouched: bool = False) -> str:
    """Why row ``b`` of ``table`` cannot be read over its pages ``first[b] .. end[b] - 1`` (the
    keys up to position ``hi[b]``), '' when every row can: each page read must be a page of the
    pool and, with the pool split over ``page_shards`` data-parallel replicas, of one slice.
    ``vouched``: a proof said they could (the message blames its issuer, not the reader)."""
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
        if vouched:
            return (f"metadata.{name}[{b}, {c}] = {int(table[b, c])} is not a page of the pool (0..{num_pages - 1}) "
                    f"but sequence {b} of the step reads it (keys {c * page_size}.. up to position {int(hi[b])}), "
                    "and the step is marked as checked: whatever built it (the page manager, or a validated "
                    "constructor) released or never assigned a page that is still read. Nothing was computed")
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


def any_unreadable(table: np.ndarray, first: np.ndarray, end: np.ndarray, num_pages: int) -> bool:
    """Whether some row ``b`` reads, among its pages ``first[b] .. end[b] - 1``, an id that is no
    page of the pool (or lies past the table), with no message (`bad_read` says which). Reads
    the table only, never the pool: the pages read themselves when they are few (windows), else
    one pass of C-speed reductions, a segment per row's pages read and one per gap to the next
    row's (cheaper than gathering when rows read most of their columns)."""
    width = table.shape[1]
    if end.max(initial=0) > width:  # as `bad_read`: a row's span past the table, even an empty one
        return True
    rows = np.flatnonzero(end > first)
    if not rows.size:
        return False
    flat = table.reshape(-1)
    if flat.dtype.kind == "i":  # as unsigned, -1 (any negative id) is larger than every page: one bound
        flat = flat.view(np.dtype(f"u{flat.dtype.itemsize}"))
    starts, spans = rows * width + first[rows], end[rows] - first[rows]
    total = int(spans.sum())
    if 4 * total < flat.size:
        read = flat[np.repeat(starts - (np.cumsum(spans) - spans), spans) + np.arange(total)]
        return bool(read.max() >= num_pages)
    at = np.empty(2 * rows.size, np.intp)
    at[0::2], at[1::2] = starts, starts + spans
    highest = np.maximum.reduceat(flat, at if at[-1] < flat.size else at[:-1])
    return bool(highest[0::2].max() >= num_pages)


# ---- a whole step -------------------------------------------------------------------------------
def check_step(step_meta: StepReads, names: Mapping[str, str], *, num_pages: int, page_size: int, page_shards: int = 1,
               window: int | None = None, chunk: int | None = None, tokens: int | None = None,
               proof: HostChecked | None = None, shapes_checked: bool = False,
               vouched: set[ReadKey] | None = None) -> None:
    """A mixed-form step (``metadata.as_mixed``) read against a pool of ``num_pages`` pages of
    ``page_size`` (split over ``page_shards`` replicas), with a sliding ``window`` and in
    ``chunk``-sized chunks (None: from the first key) by ``tokens`` query rows (None: any).

    Every rule once: shapes (unless ``shapes_checked``: ``as_mixed`` derived these fields from
    EasyDeL's, whose shapes it checked), then host (numpy) values. Values a ``proof`` (the step's
    verified `HostChecked`) covers for this pool and read are not checked again but for the pages
    read (`check_vouched_reads`, skipped for a read already in ``vouched``, the step's memo of
    them); else every value is: sequence offsets in order, positions >= -1 and cached, every page
    a query reads in the pool (and in one replica's slice). ``names`` maps positions and
    page_table to the caller's own field names for the messages."""
    pos_name, table_name = names["positions"], names["page_table"]
    if shapes_checked:
        _check_tokens(step_meta, pos_name, tokens)
    else:
        _check_shapes(step_meta, pos_name, table_name, tokens)
    if not is_host(*step_meta):
        return
    if proof is not None and proof.vouches_for(num_pages, page_size, page_shards, window, chunk):
        read = (num_pages, page_size, page_shards, window, chunk)
        if vouched is None or read not in vouched:
            check_vouched_reads(step_meta, table_name, num_pages=num_pages, page_size=page_size,
                                page_shards=page_shards,
                                window=window, chunk=chunk)
            if vouched is not None:
                vouched.add(read)
        return
    _check_values(step_meta, pos_name, table_name, num_pages=num_pages, page_size=page_size, page_shards=page_shards,
                  window=window, chunk=chunk)


def _check_tokens(step_meta: StepReads, pos_name: str, tokens: int | None) -> None:
    n_tok = shape_of(step_meta.positions)[0]
    if tokens is not None and n_tok != tokens:
        raise ValueError(f"q has {tokens} rows but metadata.{pos_name} has {n_tok}; give one query row per token")


def _check_shapes(step_meta: StepReads, pos_name: str, table_name: str, tokens: int | None) -> None:
    int_field(pos_name, step_meta.positions, ndim=1)
    int_field("query_start_loc", step_meta.query_start_loc, ndim=1)
    int_field(table_name, step_meta.page_table, ndim=2)
    int_field("context_lens", step_meta.context_lens, ndim=1)
    int_field("num_seqs", step_meta.num_seqs, shape=())
    _check_tokens(step_meta, pos_name, tokens)
    seqs = shape_of(step_meta.page_table)[0]
    if shape_of(step_meta.query_start_loc)[0] != seqs + 1 or shape_of(step_meta.context_lens)[0] != seqs:
        raise ValueError(
            f"metadata.page_table has {seqs} rows, so query_start_loc needs {seqs + 1} entries and "
            f"context_lens {seqs}; got {shape_of(step_meta.query_start_loc)[0]} and "
            f"{shape_of(step_meta.context_lens)[0]}"
        )


def _check_values(step_meta: StepReads, pos_name: str, table_name: str, *, num_pages: int, page_size: int,
                  page_shards: int, window: int | None, chunk: int | None) -> None:
    pos, qsl, table, ctx = (integer_array(name, a, lo=None, hi=None, dtype=np.int64) for name, a in zip(
        (pos_name, "query_start_loc", table_name, "context_lens"),
        (step_meta.positions, step_meta.query_start_loc, step_meta.page_table, step_meta.context_lens)))
    n_tok, seqs = pos.shape[0], table.shape[0]
    n = int(step_meta.num_seqs)
    if not 0 <= n <= seqs:
        raise ValueError(f"metadata.num_seqs={n} is outside 0..{seqs} (the rows of page_table)")
    if qsl[0] != 0 or np.any(np.diff(qsl) < 0) or qsl[-1] > n_tok:
        raise ValueError(
            f"metadata.query_start_loc {qsl.tolist()} must start at 0, never decrease and end "
            f"at most at the {n_tok} tokens"
        )
    check_positions(pos_name, pos[: qsl[n]])  # tokens past the real sequences are padding
    first, end, last = read_spans(pos, qsl, n, page_size=page_size, window=window, chunk=chunk)
    over = last >= ctx
    if np.any(over):
        b = int(np.argmax(over))
        raise ValueError(
            f"sequence {b} has a query at position {int(last[b])} but context_lens[{b}] = "
            f"{int(ctx[b])}; a query sees keys up to its own position, which must be cached"
        )
    why = bad_read(table_name, table, first, end, last, num_pages=num_pages, page_size=page_size,
                   page_shards=page_shards)
    if why:
        raise ValueError(why)


def check_vouched_reads(step_meta: StepReads, table_name: str, *, num_pages: int, page_size: int, page_shards: int,
                        window: int | None, chunk: int | None) -> None:
    """What a proof says of the pages ``step_meta`` reads, checked anyway (it runs on every call on
    host tables, so it must stay cheap: O(tokens + sequences + the table up to the pages read),
    never O(pool)): every page a query reads, within its window or chunk, is a page of the pool.
    Raises the ValueError of `bad_read`, naming the sequence and column, before anything runs."""
    table = np.asarray(step_meta.page_table)  # host arrays (the caller checked): no copy
    first, end, last = read_spans(np.asarray(step_meta.positions), np.asarray(step_meta.query_start_loc),
                                  int(step_meta.num_seqs),
                                  page_size=page_size, window=window, chunk=chunk)
    if any_unreadable(table, first, end, num_pages):
        raise ValueError(bad_read(table_name, table, first, end, last, num_pages=num_pages, page_size=page_size,
                                  page_shards=page_shards, vouched=True))


# ---- what a constructor proved ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HostChecked:
    """The value checks a step's host arrays passed, against a pool of ``num_pages`` pages of
    ``page_size`` tokens: every slot is padding or a distinct slot of the pool (the write's
    checks); with ``reads``, every page a query reads is a page of the pool and, for
    ``page_shards`` > 1, of one replica's slice, for queries that read no further back than
    ``attention`` with ``window`` allows (a sliding or chunked manager releases the pages
    before: its table has holes there; full attention: from the first key)."""

    num_pages: int
    page_size: int
    reads: bool
    page_shards: int
    attention: AttentionKind = AttentionKind.FULL  # a name ("sliding") is taken and converted
    window: int | None = None
    # The arrays this proof was issued for (`mark_checked`), in field order; None until issued. A
    # step carries the proof only over these very arrays (read-only, its own), so a proof can be
    # neither written by hand nor moved onto other arrays through ``proof=``.
    arrays: tuple[object, ...] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", AttentionKind(self.attention))

    def covers(self, window: int | None, chunk: int | None) -> bool:
        """Whether a read with a sliding ``window`` and ``chunk`` (None: unbounded) starts no
        earlier than this table reaches, for every query position (`AttentionRule.covers` of
        ``attention`` with ``window``)."""
        return self.attention.rule(self.window).covers(window, chunk)

    def vouches_for(self, num_pages: int, page_size: int, page_shards: int, window: int | None,
                    chunk: int | None) -> bool:
        """Whether it proves the reads of a step against this pool, read with this window and chunk."""
        return (self.reads and (self.num_pages, self.page_size) == (num_pages, page_size)
                and page_shards in (1, self.page_shards) and self.covers(window, chunk))


def sealed(*arrays: Array) -> None:
    """Arrays this module has just allocated, made read-only: a proof rests on them as they are
    (`held` copies nothing). Never a caller's array."""
    for a in arrays:
        if isinstance(a, np.ndarray):
            a.flags.writeable = False


def held(a: Array) -> Array:
    """``a`` as a proof may rest on it: itself when it is read-only and owns its memory (nobody
    can change it under another name), else a read-only copy. A caller's array is never frozen:
    the step keeps its own."""
    if not isinstance(a, np.ndarray) or (not a.flags.writeable and a.base is None):
        return a
    own = a.copy()
    own.flags.writeable = False
    return own


class Issue:
    """A proof being issued by the code that made its checks (`mark_checked`, the conversion
    to the mixed form): the new metadata binds it to its own arrays (`HostChecked.arrays`)."""

    __slots__ = ("mark",)

    def __init__(self, mark: HostChecked):
        self.mark = mark


class CarriesProof:
    """The proof half of a step class (`RaggedStep`, and EasyDeL's `PagedAttentionMetadata` at the
    edge), written once for both: the ``proof=`` init value bound to the step's own arrays, read
    back as ``checked``, and the memo of the reads whose pages were checked against it."""

    def _bind_proof(self, proof: HostChecked | Issue | None, fields: tuple[str, ...]) -> None:
        """Carry ``proof`` over the arrays of ``fields`` (the class's ``__post_init__`` calls it):
        an `Issue` is bound to them now (a caller's writable array is first replaced by a
        read-only copy of its own); a `HostChecked` only when issued for these very arrays."""
        if proof is None:
            return
        if isinstance(proof, Issue):  # issued now, by the code that made the checks
            own = tuple(held(getattr(self, name)) for name in fields)
            for name, array in zip(fields, own):
                object.__setattr__(self, name, array)
            proof = dataclasses.replace(proof.mark, arrays=own)
        elif not isinstance(proof, HostChecked):
            raise ValueError(f"proof must be a HostChecked (what a validated constructor proved), got "
                             f"{type(proof).__name__}")
        elif proof.arrays is None or len(proof.arrays) != len(fields) or any(
                mine is not getattr(self, name) for name, mine in zip(fields, proof.arrays)):
            raise ValueError("proof= carries the proof of another step's arrays (or of none): a proof is issued by "
                             "a validated constructor (for_mixed, for_decode, for_prefill) or the PageManager for "
                             "the arrays it checked, and only a step of those very arrays carries it; build this "
                             "step with a constructor instead")
        object.__setattr__(self, "_checked", proof)

    @property
    def checked(self) -> HostChecked | None:
        """The proof this step was built with, None without one (`host_checked` also says
        whether its arrays are still read-only)."""
        mark: HostChecked | None = self.__dict__.get("_checked")
        return mark

    @functools.cached_property
    def _reads_vouched(self) -> set[ReadKey]:
        """The reads (pool, page size, replicas, window, chunk) whose pages have been checked
        against this step's proof (`check_vouched_reads`): a step attended layer after layer
        has its pages read checked once. A memo of one instance: a ``replace``, a copy through
        jit or JSON starts without it (and without the proof)."""
        return set()


def mark_checked(step_meta: _Step, mark: HostChecked) -> _Step:
    """``step_meta`` with ``mark`` as its proof, issued by the caller (a validated constructor, the page
    manager), who made the checks it states: a new metadata over read-only arrays of its own;
    ``step_meta`` and its arrays are left as they were."""
    return dataclasses.replace(step_meta, proof=Issue(mark))  # ``proof``: an InitVar of the metadata


def host_checked(step_meta: object) -> HostChecked | None:
    """The proof of a validated step, None if it has none or an array became writable again."""
    mark = getattr(step_meta, "checked", None)
    if not isinstance(mark, HostChecked) or any(isinstance(a, np.ndarray) and a.flags.writeable
                                                 for a in vars(step_meta).values()):
        return None
    return mark


__all__ = [
    "Array", "CarriesProof", "HostChecked", "ReadKey", "Shaped", "StepReads", "any_unreadable", "bad_read",
    "check_decode_fields", "check_distinct_slots", "check_extent", "check_padding", "check_pages_assigned",
    "check_positions", "check_prefill_fields", "check_slots", "check_step", "check_vouched_reads", "dtype_of",
    "held", "host_checked", "host_slots", "int_field", "is_host", "mark_checked", "max_tokens", "page_table",
    "read_spans", "reads_assigned", "sealed", "shape_of",
]
