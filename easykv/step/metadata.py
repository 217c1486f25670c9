"""EasyDeL's step metadata at the edge: `PagedAttentionMetadata` and the one conversion of its forms
to the ragged form the core knows (`RaggedStep`, in ``ragged.py``).

`PagedAttentionMetadata` keeps EasyDeL's five fields (one prefill sequence, or a batch of decodes)
with EasyDeL's conventions (an absent form is a shape-() array; ``is_prefill_mode`` /
``is_decode_mode``, ``init_empty``, the dict and JSON forms), and adds a mixed form (the ragged
form's six fields) and validated host constructors (``for_prefill``, ``for_decode``,
``for_mixed``). Arrays are built on the host with numpy (small int32 arrays) and validated there,
so a bad page id or an over-long sequence is reported before anything reaches the device.

Host checks (the ``for_*`` constructors, rules in `easykv.step.checks`): every id and length
is bounded exactly before any arithmetic, a table row never names one physical page twice, and no
two real tokens of a step share a slot (a write would keep one of them, silently). What they
proved is the result's declared proof (``proof=``, read back as ``checked``), so the write and
attention do not check it again (but for the pages a step reads: see `checks`).

One internal form: `as_mixed` is the one conversion, run where a step enters a write or attention
(`token_slots`, attention's `prepare`): a `RaggedStep` passes as it is, EasyDeL's mixed form
becomes one over the same arrays, its decode and prefill forms are derived (slots read through
the table, bounded); `step_form` is the one place the forms are told apart. The core names of
``ragged.py`` are re-exported here, where the page manager and older code import them from.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, TypeAlias

import jax
import numpy as np

from easykv.spec.serialization import Serializable
from easykv.step import checks
from easykv.step.checks import Array, CarriesProof, HostChecked, check_distinct_slots, check_padding, mark_checked
from easykv.step.ragged import (  # re-exported: the core's names, imported from here before the split
    INVALID_SLOT,
    PAD_PAGE,
    PAD_POSITION,
    PAD_SLOT,
    RAGGED_FIELDS,
    RAGGED_NAMES,
    Form,
    RaggedStep,
    StepEntry,
    array_module,
    build_mixed,
    increment_cache_lengths,
    on_host,
    slots_from_table,
    stack_metadata,
)
from easykv.validation import integer, integer_array, optional_int

if TYPE_CHECKING:
    from easykv.spec.metadata import PagedAttentionCacheMetaData


def _absent() -> np.ndarray:
    # EasyDeL marks a mode as absent with a shape-() array; we keep that convention. One shared,
    # read-only array: nothing writes an absent field, and a proof rests on it without a copy.
    return _ABSENT


_ABSENT = np.zeros((), np.int32)
_ABSENT.flags.writeable = False


def _present(x: Array) -> bool:
    return np.ndim(x) > 0


def _array_field() -> Array:  # a dataclasses.field, typed as the value it defaults to so it fits the annotation
    field: Array = dataclasses.field(default_factory=_absent, metadata={"codec": "array"})
    return field


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedAttentionMetadata(CarriesProof, Serializable):
    """EasyDeL's description of one engine step: its prefill (``prefill_*``) or decode
    (``decodes_*``) form, or the mixed form (continuous batching, the six fields of a
    `RaggedStep`). Absent parts are shape-() arrays. A write or attention converts it once, where
    it enters, to a `RaggedStep` (`as_mixed`); ``from_ragged`` goes the other way.

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

    prefill_length: Array = _array_field()
    prefill_position: Array = _array_field()
    prefill_page_table: Array = _array_field()
    decodes_position: Array = _array_field()
    decodes_page_table: Array = _array_field()
    slot_mapping: Array = _array_field()
    positions: Array = _array_field()
    query_start_loc: Array = _array_field()
    page_table: Array = _array_field()
    context_lens: Array = _array_field()
    num_seqs: Array = _array_field()
    # Reads None on every instance (the class default), so dataclasses.replace passes None on.
    proof: dataclasses.InitVar[HostChecked | checks.Issue | None] = None

    def __post_init__(self, proof: HostChecked | checks.Issue | None) -> None:
        self._bind_proof(proof, _ARRAY_FIELDS)

    @functools.cached_property
    def _entries(self) -> dict[tuple[int, int | None, int | None], StepEntry]:
        """The ragged form of this proved step per pool (`as_mixed`): a memo of one instance,
        dropped with the proof by a ``replace``, JSON, ``jax.tree.map`` or jit."""
        return {}

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
        entry = as_mixed(on_host(self), page_size=meta.page_size, num_pages=meta.num_pages_per_layer,
                         pages_per_sequence=meta.num_pages_per_sequence)
        entry.check_values(meta, sliding_window=sliding_window, chunk_size=chunk_size)

    @classmethod
    def from_ragged(cls, step: RaggedStep) -> PagedAttentionMetadata:
        """``step`` (the page manager's ``plan.metadata`` item) as EasyDeL's class, in the mixed
        form, over the same arrays, its proof kept: for code that wants this class's API
        (``is_mixed_mode``, ``to_json``, ...). The write and attention take either.

        Args:
          step: a `RaggedStep` (ValueError for anything else)."""
        if not isinstance(step, RaggedStep):
            raise ValueError(f"from_ragged takes a RaggedStep (the page manager's plan.metadata item), got "
                             f"{type(step).__name__}")
        proof = checks.host_checked(step)
        return cls(**{f: getattr(step, f) for f in RAGGED_FIELDS},
                   proof=None if proof is None else checks.Issue(proof))  # the same arrays: nothing copied

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
        ragged = build_mixed(table, cached, new, page_size=cache_metadata.page_size, pad_tokens_to=pad_tokens_to,
                             pad_seqs_to=pad_seqs_to)
        step_meta = cls(**{f: getattr(ragged, f) for f in RAGGED_FIELDS})
        rows = np.repeat(np.arange(table.shape[0]), new)  # the real tokens lead the token axis
        positions, slots = np.asarray(ragged.positions), np.asarray(ragged.slot_mapping)  # build_mixed's: numpy
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


# ---- the edge: EasyDeL's forms, told apart and converted once ---------------------------------------
#: What a write or attention takes for one layer group: the core's `RaggedStep` (the page manager's
#: plans), or EasyDeL's `PagedAttentionMetadata` in any of its forms (converted where it enters).
StepInput: TypeAlias = RaggedStep | PagedAttentionMetadata

# Each form by the fields a message names: the one whose length is the step's token rows, the
# positions and the page table. `step_form` is the one place the three forms are told apart.
FORM_FIELDS: dict[str, dict[str, str]] = {
    "mixed": RAGGED_NAMES,
    "decode": {"tokens": "decodes_position", "positions": "decodes_position", "page_table": "decodes_page_table"},
    "prefill": {"tokens": "prefill_position", "positions": "prefill_position", "page_table": "prefill_page_table"},
}


def group_runtime(metadata: StepInput | Sequence[StepInput], num_groups: int, group: int) -> StepInput:
    """The step metadata of layer group ``group`` of a cache of ``num_groups`` groups: the one
    ``metadata`` every group shares, or item ``group`` of a tuple holding one per group (groups
    of their own pools have their own page tables and slots)."""
    if isinstance(metadata, (tuple, list)):
        if len(metadata) != num_groups:
            raise ValueError(f"the step metadata holds {len(metadata)} item(s) but the cache has {num_groups} layer "
                             "group(s); give one step per group (the plan's plan.metadata), in the metadata's group "
                             "order")
        metadata = metadata[group]
    if not isinstance(metadata, (RaggedStep, PagedAttentionMetadata)):
        raise ValueError(f"step metadata must be a RaggedStep or a PagedAttentionMetadata (or one per layer group), "
                         f"got {type(metadata).__name__}")
    return metadata


def step_form(metadata: object) -> Form:
    """``"mixed"`` (a `RaggedStep`, or EasyDeL's class with ``slot_mapping``), ``"decode"`` or
    ``"prefill"``; anything else is refused by name."""
    if isinstance(metadata, RaggedStep):
        return "mixed"
    if not isinstance(metadata, PagedAttentionMetadata):
        raise ValueError(f"the step metadata must be a RaggedStep or a PagedAttentionMetadata, got "
                         f"{type(metadata).__name__}")
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


def as_mixed(metadata: StepInput, *, page_size: int, num_pages: int | None = None,
             pages_per_sequence: int | None = None) -> StepEntry:
    """``metadata`` in the ragged form, as a write or attention takes it: a `RaggedStep` as it
    is; EasyDeL's mixed form as a `RaggedStep` over the same arrays; its decode form as ``B``
    one-token sequences, its prefill form as one sequence of ``prefill_length`` tokens (rows
    past it are padding).

    Works on numpy arrays (host results stay numpy and keep their dtype, so value checks see
    what the caller passed) and on jax arrays, inside jit too. Slots of the converted forms come
    from `slots_from_table` against ``num_pages`` and ``pages_per_sequence``: a token past the
    table or on a page outside the pool gets ``INVALID_SLOT``. The static structure of EasyDeL's
    fields (integer arrays, shapes that agree) is checked here, always; a host
    ``prefill_length`` must lie in ``0 .. padded length``. A validated constructor's proof
    carries over to the result.
    """
    if isinstance(metadata, RaggedStep):
        return metadata.entry()
    proof = checks.host_checked(metadata)
    pool = (page_size, num_pages, pages_per_sequence)
    if proof is not None and pool in metadata._entries:  # converted for this pool already, from the same arrays
        return metadata._entries[pool]
    form = step_form(metadata)
    entry = _converted(metadata, form, proof, page_size=page_size, num_pages=num_pages,
                       pages_per_sequence=pages_per_sequence)
    if proof is not None and all(isinstance(getattr(entry.step_meta, f), np.ndarray) for f in RAGGED_FIELDS):
        # A proved step's arrays are read-only (`host_checked` says so on every call), so its
        # conversion holds for every layer of the step: converted once, not once per layer.
        metadata._entries[pool] = entry
    return entry


def _converted(metadata: PagedAttentionMetadata, form: Form, proof: HostChecked | None, *, page_size: int,
               num_pages: int | None, pages_per_sequence: int | None) -> StepEntry:
    """`as_mixed` of EasyDeL's class in ``form``, its proof carried (the new arrays rest on the
    fields it checked) and its memo of the reads checked against it shared."""
    names = FORM_FIELDS[form]
    issue = None if proof is None else checks.Issue(proof)
    vouched = None if proof is None else metadata._reads_vouched
    if form == "mixed":
        ragged = RaggedStep(**{f: getattr(metadata, f) for f in RAGGED_FIELDS}, proof=issue)
        return StepEntry(ragged, False, names, form, proof, vouched)
    pos, table, owner_table, qsl, context = (_decode_rows if form == "decode" else _prefill_rows)(metadata)
    slots = slots_from_table(owner_table, pos, page_size=page_size, num_pages=num_pages,
                             pages_per_sequence=pages_per_sequence)
    num = np.asarray(table.shape[0], np.int32)
    if proof is not None:
        checks.sealed(slots, qsl, context, num, pos)  # built here, or the caller's already read-only arrays
    ragged = RaggedStep(slot_mapping=slots, positions=pos, query_start_loc=qsl, page_table=table, context_lens=context,
                        num_seqs=num, proof=issue)
    return StepEntry(ragged, form == "decode", names, form, proof, vouched)


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


MixedStep = StepEntry  # its name before the ragged form had a class of its own (easykv.runtime re-exports it)

__all__ = [
    "FORM_FIELDS", "INVALID_SLOT", "PAD_PAGE", "PAD_POSITION", "PAD_SLOT", "MixedStep", "PagedAttentionMetadata",
    "RaggedStep", "StepEntry", "StepInput", "array_module", "as_mixed", "build_mixed", "group_runtime",
    "increment_cache_lengths", "slots_from_table", "stack_metadata", "step_form",
]
