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

Host checks (the ``for_*`` constructors, rules in `easykv.step.checks`): every id and length
is bounded exactly before any arithmetic, a table row never names one physical page twice, and no
two real tokens of a step share a slot (a write would keep one of them, silently). What they
proved is the result's declared proof (``proof=``, read back as ``checked``), so the write and
attention do not check it again (but for the pages a step reads: see `checks`). Device side,
`slots_from_table` bounds every page id before multiplying it by the page size, so no page id,
however large, can wrap around int32 into another page.

One internal form: `as_mixed` turns EasyDeL's prefill and decode forms into the mixed form at the
entry of every write and attention call; `step_form` is the one place the forms are told apart.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple

import jax
import numpy as np

from easykv.spec.serialization import Serializable
from easykv.step import checks
from easykv.step.checks import Array, HostChecked, check_distinct_slots, check_padding, mark_checked
from easykv.validation import INT32_MAX, integer, integer_array, optional_int

if TYPE_CHECKING:
    from easykv.spec.metadata import PagedAttentionCacheMetaData

Form = Literal["mixed", "decode", "prefill"]

PAD_SLOT = checks.PAD_SLOT
INVALID_SLOT = -2
PAD_PAGE = checks.PAD_PAGE
PAD_POSITION = -1


def _absent() -> np.ndarray:
    # EasyDeL marks a mode as absent with a shape-() array; we keep that convention. One shared,
    # read-only array: nothing writes an absent field, and a proof rests on it without a copy.
    return _ABSENT


_ABSENT = np.zeros((), np.int32)
_ABSENT.flags.writeable = False


def _present(x: Array) -> bool:
    return np.ndim(x) > 0


def _array_field() -> Any:  # a dataclasses.field, typed Any by dataclasses itself so it fits any annotation
    return dataclasses.field(default_factory=_absent, metadata={"codec": "array"})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedAttentionMetadata(Serializable):
    """The device-side description of one engine step: EasyDeL's prefill (``prefill_*``) or decode
    (``decodes_*``) form, or the mixed form (continuous batching). Absent parts are shape-() arrays.

    ``to_dict`` / ``to_json`` write every array exactly (dtype, shape, bytes); ``from_dict`` /
    ``from_json`` give numpy arrays back.

    Attributes:
      prefill_length: ``()`` real tokens in the prefill chunk.
      prefill_position: ``(padded_prefill_len,)`` position of each chunk token; -1 for padding.
      prefill_page_table: ``(num_pages_for_prefill,)`` physical pages of the prefill sequence.
      decodes_position: ``(batch,)`` position of the new token of each sequence; -1 for padding.
      decodes_page_table: ``(batch, num_pages_per_sequence)`` physical pages per sequence.
      slot_mapping: ``(num_tokens,)`` slot of each new token; -1 for padding.
      positions: ``(num_tokens,)`` position of each new token in its sequence; -1 for padding.
      query_start_loc: ``(seqs + 1,)`` offsets of each sequence's new tokens in the token axis.
      page_table: ``(seqs, num_pages_per_sequence)`` physical pages per sequence.
      context_lens: ``(seqs,)`` tokens cached per sequence after this step's writes.
      num_seqs: ``()`` real sequences, the first of the ``seqs`` rows (the rest have no tokens).

    Args:
      proof: what the host checks proved of these arrays (a `HostChecked`, read back as ``checked``; the
        write and attention skip what it covers), issued for them by a validated constructor or the page
        manager (`mark_checked`); ``proof=`` carries one only over the very arrays it was issued for
        (ValueError otherwise). An init-only value, not a field: no pytree leaf, not in JSON; ``replace``,
        JSON, ``jax.tree.map`` and jit build the metadata without it. Its arrays are read-only and the
        metadata's own (a caller's writable array is copied)."""

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
    # Reads None on every instance (the class default), so dataclasses.replace passes None on.
    proof: dataclasses.InitVar[HostChecked | checks.Issue | None] = None

    def __post_init__(self, proof: HostChecked | checks.Issue | None) -> None:
        if proof is None:
            return
        if isinstance(proof, checks.Issue):  # issued now, by the code that made the checks
            held = tuple(checks.held(getattr(self, name)) for name in _ARRAY_FIELDS)
            for name, array in zip(_ARRAY_FIELDS, held):
                object.__setattr__(self, name, array)
            proof = dataclasses.replace(proof.mark, arrays=held)
        elif not isinstance(proof, HostChecked):
            raise ValueError(f"proof must be a HostChecked (what a validated constructor proved), got "
                             f"{type(proof).__name__}")
        elif proof.arrays is None or any(mine is not getattr(self, name)
                                         for name, mine in zip(_ARRAY_FIELDS, proof.arrays)):
            raise ValueError("proof= carries the proof of another step's arrays (or of none): a proof is issued by "
                             "a validated constructor (for_mixed, for_decode, for_prefill) or the PageManager for "
                             "the arrays it checked, and only a step of those very arrays carries it; build this "
                             "step with a constructor instead")
        object.__setattr__(self, "_checked", proof)

    @property
    def checked(self) -> HostChecked | None:
        """The proof this step was built with, None without one (`checks.host_checked` also
        says whether its arrays are still read-only)."""
        return self.__dict__.get("_checked")

    @functools.cached_property
    def _reads_vouched(self) -> set[checks.ReadKey]:
        """The reads (pool, page size, replicas, window, chunk) whose pages have been checked
        against this step's proof (`checks.check_vouched_reads`): a step attended layer after
        layer has its pages read checked once. A memo of one instance: a ``replace``, a copy
        through jit or JSON starts without it (and without the proof)."""
        return set()

    # ---- EasyDeL's API -------------------------------------------------------------------
    @classmethod
    def init_empty(cls) -> PagedAttentionMetadata:
        """A placeholder with every mode absent."""
        return cls()

    def is_prefill_mode(self) -> bool:
        """Whether this is EasyDeL's prefill form (a prefill page table, no decodes, no slots)."""
        return (
            _present(self.prefill_page_table)
            and not _present(self.decodes_page_table)
            and not _present(self.slot_mapping)
        )

    def is_decode_mode(self) -> bool:
        """Whether this is EasyDeL's decode form (a decodes page table, no prefill, no slots)."""
        return (
            _present(self.decodes_page_table)
            and not _present(self.prefill_page_table)
            and not _present(self.slot_mapping)
        )

    def is_mixed_mode(self) -> bool:
        """Whether this is the mixed form (``slot_mapping`` present)."""
        return _present(self.slot_mapping)

    @property
    def num_tokens(self) -> int:
        """Static number of token rows a write with this metadata expects."""
        return int(np.shape(getattr(self, FORM_FIELDS[step_form(self)]["tokens"]))[0])

    def check_values(self, cache_metadata: PagedAttentionCacheMetaData, *, sliding_window: int | None = None,
                     chunk_size: int | None = None) -> None:
        """Opt-in value checks of this step, device arrays included, against the pool of
        ``cache_metadata``: every slot padding or a distinct slot of the pool, sequence offsets in
        order, positions cached, every page a query reads (with ``sliding_window`` or
        ``chunk_size``: what it can see) a page of the pool and of one replica's slice. Raises
        the ValueError the write or attention would raise on host arrays.

        Device values are pulled to the host, a sync: for debugging and tests, not for a step
        (as JAX's ``dynamic_validate_inputs``). Inside jit the write drops and counts a bad slot
        and attention reads nothing of a page outside the pool; this says which value it was.

        Args:
          cache_metadata: the `PagedAttentionCacheMetaData` of the pool the step is for.
          sliding_window: check only the pages a query with this window reads (None: no window).
          chunk_size: as ``sliding_window``, for chunked-local attention of this chunk size."""
        meta = cache_metadata
        window = optional_int("sliding_window", sliding_window, lo=1)
        chunk = optional_int("chunk_size", chunk_size, lo=1)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(self)):
            raise ValueError("check_values reads the step's values: call it outside jit (inside, its arrays are "
                             "traced and have none yet)")
        host = jax.tree.map(np.asarray, jax.device_get(self))
        step = as_mixed(host, page_size=meta.page_size, num_pages=meta.num_pages_per_layer,
                        pages_per_sequence=meta.num_pages_per_sequence)
        checks.check_slots(step.step_meta.slot_mapping, meta.tokens_per_layer)
        if step.form != "mixed" or checks.shape_of(host.positions) != ():  # a slots-only step reads nothing
            step.check_reads(num_pages=meta.num_pages_per_layer, page_size=meta.page_size,
                             page_shards=meta.page_shards, window=window, chunk=chunk)

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
        group: int | None = None,
    ) -> PagedAttentionMetadata:
        """One sequence's prefill chunk: tokens ``start .. start + length - 1``.

        Args:
          page_table_row: ``(pages_per_row,)`` int page ids (-1: unassigned, but not for a page the chunk
            writes), at most ``num_pages_per_sequence`` of them, no page twice.
          length: real tokens of the chunk.
          cache_metadata: the cache's `PagedAttentionCacheMetaData`.
          start: the chunk's first position: tokens of the sequence already cached (default 0).
          padded_length: the token axis' length, ``>= length`` (default ``length``), so that jit sees few shapes.
          group: the layer group whose pool the page ids name (default: any pool; the write checks them
            against its group's then)."""
        pool = _group_pool(cache_metadata, group)
        row = checks.page_table("page_table_row", page_table_row, cache_metadata, ndim=1, num_pages=pool)
        limit = checks.max_tokens(cache_metadata)
        hint = f"a sequence holds at most num_pages_per_sequence * page_size = {limit} tokens"
        length = integer("length", length, lo=0, hi=limit, hint=hint)
        start = integer("start", start, lo=0, hi=limit, hint=hint)
        padded = optional_int("padded_length", padded_length, lo=0, hi=limit, hint=hint)
        padded = length if padded is None else padded
        if padded < length:
            raise ValueError(f"padded_length={padded} is shorter than length={length}; pass >= length")
        checks.check_extent(start + length, cache_metadata, what=f"prefill up to start + length = {start + length}")
        positions = np.full(padded, PAD_POSITION, np.int32)
        positions[:length] = np.arange(start, start + length, dtype=np.int32)
        end_pages = np.asarray([-(-(start + length) // cache_metadata.page_size) if length else 0])
        prefill_length = np.asarray(length, np.int32)
        checks.sealed(row, positions, prefill_length)  # all three built here (integer_array copies)
        step_meta = cls(prefill_length=prefill_length, prefill_position=positions, prefill_page_table=row)
        return _checked(step_meta, row[None, :], positions[None, :length], end_pages, cache_metadata, "prefill",
                        pool=pool)

    @classmethod
    def for_decode(
        cls,
        page_table: Sequence[Sequence[int]] | np.ndarray,
        positions: Sequence[int] | np.ndarray,
        *,
        cache_metadata: PagedAttentionCacheMetaData,
        group: int | None = None,
    ) -> PagedAttentionMetadata:
        """A batch of decodes: sequence ``b`` writes one token at ``positions[b]``.

        Args:
          page_table: ``(batch, pages_per_row)`` int page ids per sequence, each row as in `for_prefill`.
          positions: ``(batch,)`` position of each sequence's new token; -1 for a padding row.
          cache_metadata: the cache's `PagedAttentionCacheMetaData`.
          group: as in `for_prefill`."""
        pool = _group_pool(cache_metadata, group)
        table = checks.page_table("page_table", page_table, cache_metadata, ndim=2, num_pages=pool)
        pos = integer_array("positions", positions, ndim=1, lo=PAD_POSITION, hi=checks.max_tokens(cache_metadata) - 1,
                            hint="a token's index in its sequence, -1 for padding")
        if table.shape[0] != pos.shape[0]:
            raise ValueError(
                f"page_table has {table.shape[0]} rows but positions has {pos.shape[0]} entries; "
                "give one position per sequence (-1 for padding rows)"
            )
        end_pages = (pos + cache_metadata.page_size) // cache_metadata.page_size  # 0 for padding (-1)
        checks.sealed(pos, table)  # built here (integer_array copies)
        step_meta = cls(decodes_position=pos, decodes_page_table=table)
        return _checked(step_meta, table, pos[:, None], end_pages, cache_metadata, "decode", pool=pool)

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
        group: int | None = None,
    ) -> PagedAttentionMetadata:
        """A ragged batch: sequence ``b`` has ``cached_lens[b]`` tokens cached and appends
        ``new_lens[b]`` (a prefill chunk when > 1, a decode when 1).

        Args:
          page_table: ``(num_seqs, pages_per_row)`` int page ids per sequence, each row as in `for_prefill`.
          cached_lens: ``(num_seqs,)`` tokens each sequence has cached.
          new_lens: ``(num_seqs,)`` tokens each sequence appends in this step.
          cache_metadata: the cache's `PagedAttentionCacheMetaData`.
          pad_tokens_to: the token axis' length, at least the new tokens (default: their number).
          pad_seqs_to: the sequence rows, at least ``num_seqs`` (default ``num_seqs``).
          group: as in `for_prefill`."""
        pool = _group_pool(cache_metadata, group)
        table = checks.page_table("page_table", page_table, cache_metadata, ndim=2, num_pages=pool)
        limit = checks.max_tokens(cache_metadata)
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
        checks.check_extent(int(ends.max(initial=0)), cache_metadata, what=f"sequence {worst}: cached + new")
        needed = -(-ends // cache_metadata.page_size) * (new > 0)
        if np.any(needed > table.shape[1]):
            b = int(np.argmax(needed > table.shape[1]))
            raise ValueError(
                f"sequence {b} reaches {int(ends[b])} tokens, which needs {int(needed[b])} pages, but "
                f"the page table has only {table.shape[1]} columns; widen the table"
            )
        step_meta = build_mixed(
            table, cached, new, page_size=cache_metadata.page_size,
            pad_tokens_to=pad_tokens_to, pad_seqs_to=pad_seqs_to,
        )
        rows = np.repeat(np.arange(table.shape[0]), new)  # the real tokens lead the token axis
        positions, slots = np.asarray(step_meta.positions), np.asarray(step_meta.slot_mapping)  # build_mixed's: numpy
        return _checked(step_meta, table, positions[: rows.size, None], needed, cache_metadata, "mixed", rows,
                        slots=slots,
                        pool=pool)


_ARRAY_FIELDS = tuple(f.name for f in dataclasses.fields(PagedAttentionMetadata))


def _group_pool(meta: PagedAttentionCacheMetaData, group: int | None) -> int:
    """The pages of layer group ``group``'s pool (None: the largest pool, any group's ids)."""
    if group is None:
        return meta.num_pages_per_layer
    n = len(meta.groups)
    index = integer("group", group, lo=0, hi=n - 1, hint=f"a layer group of the {n} in the metadata")
    pages = meta.groups[index].num_pages
    return meta.num_pages_per_layer if pages is None else pages  # None: a group not sized apart from the cache


def _checked(step_meta: PagedAttentionMetadata, table: np.ndarray, positions: np.ndarray, end_pages: np.ndarray,
             meta: PagedAttentionCacheMetaData, what: str, row_ids: np.ndarray | None = None, *,
             slots: np.ndarray | None = None, pool: int) -> PagedAttentionMetadata:
    """The constructors' last checks, then ``step_meta`` marked with what they proved.

    ``table`` (rows of in-pool page ids, each row's ``positions`` of new tokens, its sequence
    ``row_ids``) is read by row ``b`` over its first ``end_pages[b]`` pages. When all of them are
    assigned the reads are proved (for attention with or without a window) and so is every new
    token's page; otherwise each new token's page must be assigned (a windowed caller may have
    released older ones) and attention checks the reads against its window.
    """
    reads = checks.reads_assigned(table, end_pages)
    if reads and meta.page_shards > 1:
        reads = not checks.bad_read("page_table", table, np.zeros_like(end_pages), end_pages,
                                    end_pages * meta.page_size - 1, num_pages=pool,
                                    page_size=meta.page_size, page_shards=meta.page_shards)
    if not reads:
        checks.check_pages_assigned(table if row_ids is None else table[row_ids], positions, meta.page_size, row_ids)
    if slots is None:
        slots = checks.host_slots(table, positions, meta.page_size)
    check_distinct_slots(slots, what)
    return mark_checked(step_meta, HostChecked(num_pages=pool, page_size=meta.page_size, reads=reads,
                                        page_shards=meta.page_shards))


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
    checked by `check_padding`; `for_mixed` is the validated public entry point. The arrays are
    new and read-only (a step is a value), so a proof can rest on them without a copy: the page
    manager's table is the largest array of a step.
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
    count = np.asarray(num_seqs, np.int32)
    checks.sealed(slot_mapping, positions, starts, table, context, count)
    return PagedAttentionMetadata(slot_mapping=slot_mapping, positions=positions, query_start_loc=starts,
                                  page_table=table, context_lens=context, num_seqs=count)


# ---- the one internal form ---------------------------------------------------------------------
# Each form by the fields a message names: the one whose length is the step's token rows, the
# positions and the page table. `step_form` is the one place the three forms are told apart.
FORM_FIELDS: dict[str, dict[str, str]] = {
    "mixed": {"tokens": "slot_mapping", "positions": "positions", "page_table": "page_table"},
    "decode": {"tokens": "decodes_position", "positions": "decodes_position", "page_table": "decodes_page_table"},
    "prefill": {"tokens": "prefill_position", "positions": "prefill_position", "page_table": "prefill_page_table"},
}


def group_runtime(metadata: PagedAttentionMetadata | Sequence[PagedAttentionMetadata], num_groups: int,
                  group: int) -> PagedAttentionMetadata:
    """The step metadata of layer group ``group`` of a cache of ``num_groups`` groups: the one
    ``metadata`` every group shares, or item ``group`` of a tuple holding one per group (groups
    of their own pools have their own page tables and slots)."""
    if isinstance(metadata, (tuple, list)):
        if len(metadata) != num_groups:
            raise ValueError(f"the step metadata holds {len(metadata)} item(s) but the cache has {num_groups} layer "
                             "group(s); give one PagedAttentionMetadata per group, in the metadata's group order")
        metadata = metadata[group]
    if not isinstance(metadata, PagedAttentionMetadata):
        raise ValueError(f"step metadata must be a PagedAttentionMetadata (or one per layer group), got "
                         f"{type(metadata).__name__}")
    return metadata


def step_form(metadata: object) -> Form:
    """``"mixed"``, ``"decode"`` or ``"prefill"``; anything else is refused by name."""
    if not isinstance(metadata, PagedAttentionMetadata):
        raise ValueError(f"the runtime metadata must be a PagedAttentionMetadata, got {type(metadata).__name__}")
    if metadata.is_mixed_mode():
        return "mixed"
    if metadata.is_decode_mode():
        return "decode"
    if metadata.is_prefill_mode():
        return "prefill"
    raise ValueError(
        "metadata names no step: it is empty (init_empty), or holds both decodes_page_table and "
        "prefill_page_table; give it one form, slot_mapping (mixed), decodes_page_table (decode) or "
        "prefill_page_table (prefill), with PagedAttentionMetadata.for_mixed / for_decode / for_prefill"
    )


class MixedStep(NamedTuple):
    """A step in the one form the write and attention read (see `as_mixed`)."""

    step_meta: PagedAttentionMetadata  # the mixed form
    decode_only: bool  # EasyDeL's decode form: query row b is sequence b's one token (a static hint)
    names: dict[str, str]  # the caller's names of the token, position and page-table fields
    form: Form  # the caller's form
    proof: HostChecked | None  # the caller's proof, verified once (`checks.host_checked`); ``step_meta`` carries it
    source: PagedAttentionMetadata  # what the caller passed (``step_meta`` itself for the mixed form)

    def check_reads(self, *, num_pages: int, page_size: int, page_shards: int = 1, window: int | None = None,
                    chunk: int | None = None, tokens: int | None = None) -> None:
        """`checks.check_step` of this step read by ``tokens`` query rows: its fields' shapes
        unless `as_mixed` derived them from fields it checked, its values unless its proof
        covers them (then the pages read, once per step and read: the memo is the caller's
        metadata's, the converted form being new on every call)."""
        step_meta = self.step_meta
        reads = checks.StepReads(step_meta.positions, step_meta.query_start_loc, step_meta.page_table,
                                 step_meta.context_lens, step_meta.num_seqs)
        checks.check_step(reads, self.names, num_pages=num_pages, page_size=page_size, page_shards=page_shards,
                          window=window, chunk=chunk, tokens=tokens, proof=self.proof,
                          shapes_checked=self.form != "mixed",
                          vouched=None if self.proof is None else self.source._reads_vouched)


def as_mixed(metadata: PagedAttentionMetadata, *, page_size: int, num_pages: int | None = None,
             pages_per_sequence: int | None = None) -> MixedStep:
    """``metadata`` in the mixed form: EasyDeL's decode form as ``B`` one-token sequences, its
    prefill form as one sequence of ``prefill_length`` tokens (rows past it are padding).

    Works on numpy arrays (host results stay numpy and keep their dtype, so value checks see
    what the caller passed) and on jax arrays, inside jit too. Slots of the converted forms come
    from `slots_from_table` against ``num_pages`` and ``pages_per_sequence``: a token past the
    table or on a page outside the pool gets ``INVALID_SLOT``. The static structure of EasyDeL's
    fields (integer arrays, shapes that agree) is checked here, always; a host
    ``prefill_length`` must lie in ``0 .. padded length``. A validated constructor's proof
    carries over to the result.
    """
    form = step_form(metadata)
    names = FORM_FIELDS[form]
    proof = checks.host_checked(metadata)
    if form == "mixed":
        return MixedStep(metadata, False, names, form, proof, metadata)
    pos, table, owner_table, qsl, context = (_decode_rows if form == "decode" else _prefill_rows)(metadata)
    slots = slots_from_table(owner_table, pos, page_size=page_size, num_pages=num_pages,
                             pages_per_sequence=pages_per_sequence)
    num = np.asarray(table.shape[0], np.int32)
    if proof is not None:
        checks.sealed(slots, qsl, context, num, pos)  # built here, or the caller's already read-only arrays
    step_meta = PagedAttentionMetadata(slot_mapping=slots, positions=pos, query_start_loc=qsl, page_table=table,
                                context_lens=context, num_seqs=num,
                                proof=None if proof is None else checks.Issue(proof))  # derived from checked fields
    return MixedStep(step_meta, form == "decode", names, form, proof, metadata)


_Rows = tuple[Array, Array, Array, Array, Array]  # positions, table, each token's table row, offsets, lengths


def _decode_rows(md: PagedAttentionMetadata) -> _Rows:
    """EasyDeL's decode form as ``B`` one-token sequences (`as_mixed`)."""
    pos, table = md.decodes_position, md.decodes_page_table
    batch = checks.check_decode_fields(pos, table)
    xp = array_module(pos, table)
    pos, table = xp.asarray(pos), xp.asarray(table)
    return pos, table, table, xp.arange(batch + 1, dtype=np.int32), xp.where(pos >= 0, pos + 1, 0)


def _prefill_rows(md: PagedAttentionMetadata) -> _Rows:
    """EasyDeL's prefill form as one sequence of ``prefill_length`` tokens (`as_mixed`)."""
    padded = checks.check_prefill_fields(md.prefill_length, md.prefill_position, md.prefill_page_table)
    xp = array_module(md.prefill_length, md.prefill_position, md.prefill_page_table)
    length = xp.clip(xp.asarray(md.prefill_length), 0, padded)
    pos = xp.where(xp.arange(padded) < length, xp.asarray(md.prefill_position), PAD_POSITION)
    table = xp.asarray(md.prefill_page_table)[None]
    qsl = xp.stack([xp.zeros((), length.dtype), length]).astype(np.int32)
    context = (xp.max(pos, initial=PAD_POSITION) + 1)[None]
    return pos, table, xp.broadcast_to(table, (padded, table.shape[1])), qsl, context


def slots_from_table(table: Array, positions: Array, *, page_size: int, num_pages: int | None,
                     pages_per_sequence: int | None = None) -> Array:
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
    slots: Array = xp.where(positions == PAD_POSITION, PAD_SLOT, slot).astype(np.int32)
    return slots


def increment_cache_lengths(metadata: PagedAttentionMetadata, *, page_size: int,
                            num_pages: int | None = None) -> PagedAttentionMetadata:
    """The next decode step from a decode-only mixed-form step: every real token moves one
    position on, its slot is read from the (already reserved) page table, context lengths above 0 grow
    by one (padding rows stay 0). Works on numpy and jax arrays alike, inside jit too, so a multi-step loop runs
    without a host round trip [MAX: increment_cache_lengths]. A token whose next page the
    table lacks, or names outside the pool (``num_pages``), gets ``INVALID_SLOT``: the write
    drops and counts it, never writes another sequence's page.

    Args:
      metadata: mixed-form decode metadata, one token per sequence (``build_decode_metadata``).
      page_size: tokens per page.
      num_pages: the pool's pages (None: only slots past int32 are invalid).
    """
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


def array_module(*arrays: object) -> ModuleType:
    """numpy when every array is numpy (host work stays on the host), else jax.numpy."""
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np
    import jax.numpy as jnp  # only when handed device arrays

    return jnp


