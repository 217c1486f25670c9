"""The one step form the core knows: `RaggedStep`, a ragged batch of new tokens (prefill chunks and
decodes alike) described by a slot per token, a page table and a length per sequence.

The page manager builds it (`build_mixed`, unvalidated, on its hot path), the multi-step loop
derives each next decode step from the last (`increment_cache_lengths`), and the write and
attention read it. EasyDeL's ``PagedAttentionMetadata`` (``metadata.py``) is the edge: its
prefill, decode and mixed forms become a `RaggedStep` where they enter a write or attention
(`metadata.as_mixed`), so nothing past that point knows three forms or "absent" fields.

Conventions (all int32):
  * a *slot* is ``page_id * page_size + offset``; ``PAD_SLOT`` (-1) marks a padding token and
    ``INVALID_SLOT`` (-2) a real token with no valid destination (dropped and counted);
  * a page table entry of ``PAD_PAGE`` (-1) is an unassigned page;
  * a position is the token's index inside its sequence; ``PAD_POSITION`` (-1) marks padding.

A step's proof (`checks.HostChecked`: what its builder checked) is declared on it and skipped by
the write and attention; see `checks`. Device side, `slots_from_table` bounds every page id
before multiplying it by the page size, so no page id, however large, can wrap around int32 into
another page.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, TypeVar

import jax
import numpy as np

from easykv.step import checks
from easykv.step.checks import Array, CarriesProof, HostChecked, ReadKey
from easykv.validation import INT32_MAX, integer, optional_int

if TYPE_CHECKING:
    from typing import Self

    from easykv.spec.metadata import PagedAttentionCacheMetaData

PAD_SLOT = checks.PAD_SLOT
INVALID_SLOT = -2
PAD_PAGE = checks.PAD_PAGE
PAD_POSITION = -1

Form = Literal["mixed", "decode", "prefill"]  # the forms a step may enter in (EasyDeL's two, and this one)
RAGGED_FIELDS = ("slot_mapping", "positions", "query_start_loc", "page_table", "context_lens", "num_seqs")
# The fields a message names: the one whose length is the step's token rows, the positions and the page table.
RAGGED_NAMES = {"tokens": "slot_mapping", "positions": "positions", "page_table": "page_table"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedStep(CarriesProof):
    """One engine step of one layer group in the ragged form: ``num_tokens`` new tokens of up to
    ``seqs`` sequences, each sequence's tokens contiguous in the token axis. A frozen pytree of
    six small int32 arrays (numpy on the host, jax on the device or traced): jit takes it,
    `increment_cache_lengths` derives the next decode step from it inside jit.

    The page manager's plans hold one per layer group (``plan.metadata``); the write
    (``PagedAttentionCache.write``, the views' ``write_mixed_to_cache``) and attention
    (``paged_attention``, ``view_attention``) take it as it is. EasyDeL's
    ``PagedAttentionMetadata.from_ragged`` gives the same step in EasyDeL's class.

    Attributes:
      slot_mapping: ``(num_tokens,)`` slot of each new token; -1 for padding, -2 for a real token
        with no valid page (dropped and counted by the write).
      positions: ``(num_tokens,)`` position of each new token in its sequence; -1 for padding.
      query_start_loc: ``(seqs + 1,)`` offsets of each sequence's new tokens in the token axis.
      page_table: ``(seqs, pages_per_sequence)`` physical pages per sequence; -1 unassigned.
      context_lens: ``(seqs,)`` tokens cached per sequence after this step's writes.
      num_seqs: ``()`` real sequences, the first of the ``seqs`` rows (the rest have no tokens).

    Args:
      proof: what its builder's host checks proved of these arrays (a `checks.HostChecked`, read back
        as ``checked``; the write and attention skip what it covers), issued for them by the page
        manager or a validated constructor (`checks.mark_checked`); ``proof=`` carries one only over
        the very arrays it was issued for (ValueError otherwise). An init-only value, not a field: no
        pytree leaf; ``replace``, ``jax.tree.map`` and jit build the step without it."""

    slot_mapping: Array
    positions: Array
    query_start_loc: Array
    page_table: Array
    context_lens: Array
    num_seqs: Array
    # Reads None on every instance (the class default), so dataclasses.replace passes None on.
    proof: dataclasses.InitVar[HostChecked | checks.Issue | None] = None

    def __post_init__(self, proof: HostChecked | checks.Issue | None) -> None:
        self._bind_proof(proof, RAGGED_FIELDS)

    def replace(self, **changes: Array) -> RaggedStep:
        """This step with ``changes`` (field name -> array) applied; without its proof.

        Args:
          **changes: new arrays for some of the six fields.
        """
        # The plugin types replace()'s keywords field by field (proof too); these are arrays by the signature.
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def num_tokens(self) -> int:
        """Static number of token rows a write with this step expects."""
        return int(np.shape(self.slot_mapping)[0])

    def entry(self) -> StepEntry:
        """This step as the write and attention take it (no conversion: it is the ragged form)."""
        proof = checks.host_checked(self)
        return StepEntry(self, False, RAGGED_NAMES, "mixed", proof, None if proof is None else self._reads_vouched)

    def check_values(self, cache_metadata: PagedAttentionCacheMetaData, *, sliding_window: int | None = None,
                     chunk_size: int | None = None) -> None:
        """Opt-in value checks of this step, device arrays included, against the pool of
        ``cache_metadata`` (`StepEntry.check_values`). Device values are pulled to the host, a
        sync: for debugging and tests, not for a step.

        Args:
          cache_metadata: the `PagedAttentionCacheMetaData` of the pool the step is for.
          sliding_window: check only the pages a query with this window reads (None: no window).
          chunk_size: as ``sliding_window``, for chunked-local attention of this chunk size."""
        on_host(self).entry().check_values(cache_metadata, sliding_window=sliding_window, chunk_size=chunk_size)


class StepEntry(NamedTuple):
    """A step as a write or attention received it, in the ragged form (`RaggedStep.entry`, or
    EasyDeL's forms through `metadata.as_mixed`), with what the caller's form tells them."""

    step_meta: RaggedStep  # the ragged form
    decode_only: bool  # EasyDeL's decode form: query row b is sequence b's one token (a static hint)
    names: dict[str, str]  # the caller's names of the token, position and page-table fields
    form: Form  # the caller's form
    proof: HostChecked | None  # the caller's proof, verified once (`checks.host_checked`); ``step_meta`` carries it
    vouched: set[ReadKey] | None  # the memo of the reads checked against the proof: the caller's step's

    def check_reads(self, *, num_pages: int, page_size: int, page_shards: int = 1, window: int | None = None,
                    chunk: int | None = None, tokens: int | None = None) -> None:
        """`checks.check_step` of this step read by ``tokens`` query rows: its fields' shapes
        unless they were derived from EasyDeL's fields, checked then; its values unless its proof
        covers them (then the pages read, once per step and read: the memo is the caller's
        step's, a converted form being new on every call)."""
        step_meta = self.step_meta
        reads = checks.StepReads(step_meta.positions, step_meta.query_start_loc, step_meta.page_table,
                                 step_meta.context_lens, step_meta.num_seqs)
        checks.check_step(reads, self.names, num_pages=num_pages, page_size=page_size, page_shards=page_shards,
                          window=window, chunk=chunk, tokens=tokens, proof=self.proof,
                          shapes_checked=self.form != "mixed", vouched=self.vouched)

    def check_values(self, cache_metadata: PagedAttentionCacheMetaData, *, sliding_window: int | None = None,
                     chunk_size: int | None = None) -> None:
        """The value checks of a host step against the pool of ``cache_metadata``: every slot
        padding or a distinct slot of the pool, sequence offsets in order, positions cached,
        every page a query reads (with ``sliding_window`` or ``chunk_size``: what it can see) a
        page of the pool and of one replica's slice. Raises the ValueError the write or
        attention would raise on host arrays."""
        meta = cache_metadata
        window = optional_int("sliding_window", sliding_window, lo=1)
        chunk = optional_int("chunk_size", chunk_size, lo=1)
        checks.check_slots(self.step_meta.slot_mapping, meta.tokens_per_layer)
        if checks.shape_of(self.step_meta.positions) != ():  # a step of slots alone (EasyDeL's class) reads nothing
            self.check_reads(num_pages=meta.num_pages_per_layer, page_size=meta.page_size,
                             page_shards=meta.page_shards, window=window, chunk=chunk)


_Step = TypeVar("_Step", bound=CarriesProof)


def on_host(step_meta: _Step) -> _Step:
    """``step_meta`` with every array pulled to the host as numpy (a sync), for the opt-in value
    checks; refused inside jit, where its arrays have no values yet."""
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(step_meta)):
        raise ValueError("check_values reads the step's values: call it outside jit (inside, its arrays are "
                         "traced and have none yet)")
    host: _Step = jax.tree.map(np.asarray, jax.device_get(step_meta))
    return host


def build_mixed(
    page_table: np.ndarray,
    cached_lens: np.ndarray,
    new_lens: np.ndarray,
    *,
    page_size: int,
    pad_tokens_to: int | None = None,
    pad_seqs_to: int | None = None,
    proof: HostChecked | None = None,
) -> RaggedStep:
    """Vectorized, unvalidated construction of a `RaggedStep` (the page manager's hot path);
    ``proof``: what the caller vouches for (`checks.mark_checked`'s mark), issued at construction
    (one object built, not a copy marked afterwards).

    Callers guarantee int32 inputs with pages assigned for every new token and paddings
    checked by `checks.check_padding`; ``PagedAttentionMetadata.for_mixed`` is the validated
    public entry point. The arrays are new and read-only (a step is a value), so a proof can
    rest on them without a copy: the page manager's table is the largest array of a step.
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
    return RaggedStep(slot_mapping=slot_mapping, positions=positions, query_start_loc=starts, page_table=table,
                      context_lens=context, num_seqs=count, proof=None if proof is None else checks.Issue(proof))


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


# ---- what runs on the ragged form's fields alone --------------------------------------------------
class RaggedFields(Protocol):
    """The ragged form's arrays and ``replace``: a `RaggedStep`, or EasyDeL's
    ``PagedAttentionMetadata`` in its mixed form (the same six fields, present)."""

    @property
    def slot_mapping(self) -> Array: ...

    @property
    def positions(self) -> Array: ...

    @property
    def query_start_loc(self) -> Array: ...

    @property
    def page_table(self) -> Array: ...

    @property
    def context_lens(self) -> Array: ...

    @property
    def num_seqs(self) -> Array: ...

    def replace(self, **changes: Array) -> Self: ...


_Ragged = TypeVar("_Ragged", bound=RaggedFields)


def is_ragged(step_meta: object) -> bool:
    """Whether ``step_meta`` holds the ragged form's six fields with a token axis (a `RaggedStep`,
    or EasyDeL's class in its mixed form): what `increment_cache_lengths`, `stack_metadata` and
    the decode loop run on, whichever class holds them."""
    if isinstance(step_meta, RaggedStep):
        return True
    return (isinstance(step_meta, CarriesProof) and all(hasattr(step_meta, f) for f in RAGGED_FIELDS)
            and np.ndim(getattr(step_meta, "slot_mapping", 0)) > 0)  # EasyDeL's absent field: a shape-() array


def increment_cache_lengths(metadata: _Ragged, *, page_size: int, num_pages: int | None = None) -> _Ragged:
    """The next decode step from a decode-only step in the ragged form: every real token moves
    one position on, its slot is read from the (already reserved) page table, context lengths
    above 0 grow by one (padding rows stay 0). Works on numpy and jax arrays alike, inside jit
    too, so a multi-step loop runs without a host round trip [MAX: increment_cache_lengths]. A
    token whose next page the table lacks, or names outside the pool (``num_pages``), gets
    ``INVALID_SLOT``: the write drops and counts it, never writes another sequence's page.

    Args:
      metadata: a decode step of one token per sequence in the ragged form: a `RaggedStep` (the
        page manager's ``plan.metadata`` item), or ``PagedAttentionMetadata.for_mixed``'s; the
        result is of the same class, without a proof.
      page_size: tokens per page.
      num_pages: the pool's pages (None: only slots past int32 are invalid).
    """
    if not is_ragged(metadata):
        raise ValueError(f"increment_cache_lengths takes a decode step in the ragged form (a RaggedStep: the page "
                         f"manager's plan.metadata item, or PagedAttentionMetadata.for_mixed), got "
                         f"{type(metadata).__name__}")
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


def stack_metadata(steps: Sequence[_Ragged]) -> _Ragged:
    """One step whose ragged fields gain a leading step axis (a multi-step plan's steps), of the
    first step's class, without a proof."""
    return steps[0].replace(**{f: np.stack([np.asarray(getattr(m, f)) for m in steps]) for f in RAGGED_FIELDS})


def array_module(*arrays: object) -> ModuleType:
    """numpy when every array is numpy (host work stays on the host), else jax.numpy."""
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np
    import jax.numpy as jnp  # only when handed device arrays

    return jnp


__all__ = ["INVALID_SLOT", "PAD_PAGE", "PAD_POSITION", "PAD_SLOT", "RAGGED_FIELDS", "Form", "RaggedFields",
           "RaggedStep", "StepEntry", "array_module", "build_mixed", "increment_cache_lengths", "is_ragged", "on_host",
           "slots_from_table", "stack_metadata"]
