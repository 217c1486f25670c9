"""A step is a value: `StepPlan`, what the manager decided for one engine step (or ``k`` decode
steps run in one device loop), and the only two ways to end it, `commit` and `abort`.

`schedule` reserves room for a mixed step (a prefill chunk or a decode per sequence, ragged);
`schedule_decode` for ``k`` decode steps of running sequences, each stopping at its own limit
(JetStream's and vLLM's multi-step scheduling). Either is all or nothing (CacheFullError, nothing
changed) and returns a frozen plan: the first step's metadata per layer group and the device work
the step implies (`device_work.DeviceWork`: copies, scrubs, lower-tier transfers), which the runner
applies before the step's writes. On the device, `StepPlan.next_metadata` derives each next decode
step from the one before. `commit` then commits what each sequence wrote (a sequence that stopped
early commits fewer) and gives back the pages reserved for tokens nobody wrote (a private copy of a
shared page, made for its first write, stays); `abort` commits nothing. A sliding or chunked group
releases the pages its window left at the commit, not during the loop: every step may still read them.

While a plan is open, every call that would change one of its sequences is refused (ValueError: the
device may be writing their pages; `open_plans` declares what each call changes and guards them all),
so its commit always finds them as planned, and the abort always succeeds. Other sequences may change
meanwhile. A plan is also stamped with what it was planned over (each sequence's edits, length,
columns and weight version, its block-table rows and window starts in every group); a commit that
finds any of that changed raises InvariantError (the guard failed: a bug), with nothing changed. A
plan ends once: committing or aborting it again, or on another manager, is refused with nothing changed.

Coordinator code over the parts it is handed, like ``growth`` and ``commit``. Imports ``step`` for
the metadata and the manager's ``growth``, ``commit``, ``rollback`` and ``device_work``; never
``storage``, ``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import jax
import numpy as np

from easykv.errors import InvariantError
from easykv.manager import growth
from easykv.manager.commit import Tokens, commit_tokens, parse_tokens
from easykv.manager.device_work import take_work
from easykv.manager.rollback import give_back_reserved
from easykv.step.checks import check_padding
from easykv.step.loop import increment_groups
from easykv.validation import INT32_MAX, integer, integer_array, is_scalar, positive_int

if TYPE_CHECKING:
    from easykv.manager.coordinator import GroupCoordinator, PerGroup
    from easykv.manager.device_work import CopyCounter, DeviceWork
    from easykv.manager.sequences import SequenceTable
    from easykv.manager.tier_set import LowerTiers
    from easykv.spec.metadata import PagedAttentionCacheMetaData
    from easykv.step.ragged import RaggedStep

Form = Literal["mixed", "decode"]


class StepPlan:
    """One engine step (``form="mixed"``) or ``num_steps`` decode steps (``form="decode"``) of
    ``seq_ids``, decided and reserved (`PageManager.schedule` / `schedule_decode`); end it once with
    `PageManager.commit` or `PageManager.abort`. Frozen: its fields never change; whether it is
    still open is the manager's to say (`is_open`).

    Attributes:
      form: ``"mixed"`` (one step, any number of new tokens per sequence) or ``"decode"`` (one new
        token per sequence per step, ``num_steps`` steps).
      num_steps: steps of the plan (1 for a mixed step).
      lengths: ``(n,)`` each sequence's committed length when planned; it writes from there on.
      limits: ``(padded_rows,)`` int32, the most tokens each row may write (room is reserved for
        that many; 0 for padding rows): a mixed step's new tokens, a decode loop's limits.
      metadata: the first step's metadata, a tuple of one `RaggedStep` per layer group.
      work: the device work to run before the step's writes (`DeviceWork`), handed over by the
        manager when the plan was made: the runner applies it.
      page_size: tokens per page.
      num_pages: each layer group's pool size, one int per group.

    Other Parameters:
      owner: the manager's sequence table (a plan ends only on the manager that made it).
      rows: the planned sequences as a read-only int64 array (``seq_ids``).
      stamp: the rows' edit counts when planned, compared when the plan ends (a bug check).
      held: ``(n,)`` columns each sequence held before the plan reserved more.
      number: the open plan's number in the sequence table.
    """

    __slots__ = ("__weakref__", "_ended", "_held", "_number", "_owner", "_rows", "_stamp", "form", "lengths", "limits",
                 "metadata", "num_pages", "num_steps", "page_size", "work")

    _owner: SequenceTable
    _rows: np.ndarray  # seq_ids as a read-only int64 array
    _stamp: np.ndarray
    _held: np.ndarray
    _number: int
    _ended: list[str | None]  # the one mutable cell: how the manager ended the plan
    form: Form
    num_steps: int
    lengths: np.ndarray
    limits: np.ndarray
    metadata: PerGroup[RaggedStep]
    work: DeviceWork
    page_size: int
    num_pages: tuple[int, ...]

    def __init__(self, *, owner: SequenceTable, rows: np.ndarray, form: Form, num_steps: int,
                 lengths: np.ndarray, limits: np.ndarray, metadata: PerGroup[RaggedStep],
                 work: DeviceWork, page_size: int, num_pages: tuple[int, ...], stamp: np.ndarray,
                 held: np.ndarray, number: int) -> None:  # fmt: skip
        put = object.__setattr__  # frozen: set once, here (a step's host cost: no dict of fields)
        put(self, "_owner", owner), put(self, "_rows", rows), put(self, "_stamp", stamp), put(self, "_held", held)
        put(self, "_number", number), put(self, "_ended", [None]), put(self, "form", form)
        put(self, "num_steps", num_steps), put(self, "lengths", lengths), put(self, "limits", limits)
        put(self, "metadata", metadata), put(self, "work", work), put(self, "page_size", page_size)
        put(self, "num_pages", num_pages)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a StepPlan is frozen: {name} cannot be set; end it with commit or abort and schedule "
                             "the next step")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a StepPlan is frozen: {name} cannot be deleted")

    @property
    def seq_ids(self) -> tuple[int, ...]:
        """The planned sequences, ``n`` ints (row ``i < n`` of every step is ``seq_ids[i]``)."""
        ids: tuple[int, ...] = tuple(self._rows.tolist())
        return ids

    @property
    def padded_rows(self) -> int:
        """Sequence rows of every step's metadata: ``len(seq_ids)`` or the ``pad_seqs_to`` asked for."""
        return int(self.metadata[0].page_table.shape[0])

    @property
    def ended(self) -> str | None:
        """``"committed"`` or ``"aborted"`` once the plan ended; None while it is open."""
        return self._ended[0]

    def _mark_ended(self, how: str) -> None:
        """The manager ended the plan (``"committed"`` or ``"aborted"``): its one mutable cell."""
        self._ended[0] = how

    @property
    def committed(self) -> bool:
        """Whether the plan ended (committed or aborted)."""
        return self._ended[0] is not None

    def next_metadata(self, metadata: PerGroup[RaggedStep]) -> PerGroup[RaggedStep]:
        """The next decode step's metadata from this one (one per layer group), numpy or jax, inside jit too:
        each sequence's token moves one position on, into the pages this plan reserved.

        Args:
          metadata: a step's metadata, a tuple of one per layer group (first: ``self.metadata``).

        Returns:
          the next step's, a tuple of one `RaggedStep` per layer group.
        """
        return increment_groups(metadata, page_size=self.page_size, num_pages=self.num_pages)

    def __repr__(self) -> str:
        state = self._ended[0] or "open"
        steps = f" x {self.num_steps} steps" if self.form == "decode" else f", {int(self.limits.sum())} new tokens"
        return (f"StepPlan({self.form}: {len(self.seq_ids)} sequences{steps}, padded to {self.padded_rows} rows, "
                f"{state})")


DecodePlan = StepPlan  # the name of the decode-only plan this generalizes (one release)


def schedule(seqs: SequenceTable, groups: GroupCoordinator, tiers: LowerTiers, counter: CopyCounter,
             seq_ids: Any, num_new_tokens: Any, *, pad_tokens_to: Any, pad_seqs_to: Any,
             metadata: PagedAttentionCacheMetaData) -> StepPlan:
    """`PageManager.schedule`: checked whole, then all or nothing. ``seq_ids`` are in no open plan
    (the manager's guard refused those)."""
    rows = seqs.rows(seq_ids)
    new = seqs.counts(num_new_tokens, rows.size)
    pad_tokens_to, pad_seqs_to = check_padding(metadata, int(new.sum()), rows.size, pad_tokens_to, pad_seqs_to)
    held = seqs.npages[rows].copy()
    growth.reserve(seqs, groups, tiers, counter, rows, new)
    first = growth.step_metadata(seqs, groups, rows, new, pad_tokens_to=pad_tokens_to, pad_seqs_to=pad_seqs_to)
    limits = np.zeros(first[0].page_table.shape[0], np.int32)
    limits[: rows.size] = new
    return _open(seqs, groups, tiers, rows, "mixed", 1, limits, first, held)


def schedule_decode(seqs: SequenceTable, groups: GroupCoordinator, tiers: LowerTiers, counter: CopyCounter,
                    seq_ids: Any, num_steps: Any, max_tokens: Any, *, pad_seqs_to: Any,
                    metadata: PagedAttentionCacheMetaData) -> StepPlan:
    """`PageManager.schedule_decode`: checked whole, then all or nothing (CacheFullError naming the
    pages, nothing changed). ``seq_ids`` are in no open plan (the manager's guard refused those)."""
    rows = seqs.rows(seq_ids)
    k = positive_int("num_steps", num_steps, hi=seqs.max_length,
                     hint=f"decode steps in one plan, at most max_sequences={seqs.max_length}")
    most = np.full(rows.size, k, np.int64) if max_tokens is None else seqs.counts(max_tokens, rows.size)
    if most.max(initial=0) > k:
        i = int(np.argmax(most))
        raise ValueError(f"max_tokens[{i}]={int(most[i])} is more than num_steps={k}; a sequence writes at most "
                         "one token per step")
    _, pad_seqs_to = check_padding(metadata, rows.size, rows.size, None, pad_seqs_to)
    full = np.flatnonzero(seqs.lens[rows] >= seqs.max_length)  # no position left for a step, even one unwritten
    if full.size:
        row = int(rows[full[0]])
        seqs.check_extent(row, int(seqs.lens[row]) + 1, "a decode step's position")
    held = seqs.npages[rows].copy()
    growth.reserve(seqs, groups, tiers, counter, rows, most)
    first = growth.decode_metadata(seqs, groups, rows, 1, pad_seqs_to=pad_seqs_to, stacked=False)[0]
    assert isinstance(first, tuple)
    limits = np.zeros(first[0].page_table.shape[0], np.int32)
    limits[: rows.size] = most
    return _open(seqs, groups, tiers, rows, "decode", k, limits, first, held)


def _open(seqs: SequenceTable, groups: GroupCoordinator, tiers: LowerTiers, rows: np.ndarray, form: Form,
          num_steps: int, limits: np.ndarray, first: PerGroup[RaggedStep], held: np.ndarray) -> StepPlan:
    """The plan of ``rows``, reserved: opened in the sequence table, with every piece of pending
    device work handed over (`take_work`), the step's own copy-on-write copies included."""
    planned = _frozen(rows.copy())
    number = seqs.open_plan(planned)
    return StepPlan(owner=seqs, rows=planned, form=form, num_steps=num_steps, lengths=_frozen(seqs.lens[rows]),
                    limits=_frozen(limits), metadata=first, work=take_work(groups, tiers), page_size=seqs.page_size,
                    num_pages=tuple(table.pool.num_pages for table in groups), stamp=_stamp(seqs, rows),
                    held=held, number=number)


def commit(seqs: SequenceTable, groups: GroupCoordinator, tiers: LowerTiers, plan: StepPlan, token_ids: Any,
           num_tokens: Any, *, caching: bool, current: bytes | None) -> None:
    """`PageManager.commit`: checked whole first, nothing changed on any error (the plan stays open then)."""
    rows = check_open(seqs, groups, plan, "commit")
    counts, tokens = _written(plan, token_ids, num_tokens)
    live = np.flatnonzero(counts > 0)
    if live.size == counts.size:  # the common step: every sequence wrote
        commit_tokens(seqs, groups, tiers, rows, counts, tokens, caching=caching, current=current)
    elif live.size:  # ValueError (a page whose copy is pending), nothing changed: the plan stays open
        known = (None if tokens is None else tokens[live] if isinstance(tokens, np.ndarray)
                 else [tokens[i] for i in live.tolist()])
        commit_tokens(seqs, groups, tiers, rows[live], counts[live], known, caching=caching, current=current)
    # Every planned token committed: the plan's room is all written (or held from before), nothing to give back.
    whole = bool((counts == plan.limits[: counts.size]).all())
    _end(seqs, groups, plan, rows, current, "committed", give_back=not whole)


def abort(seqs: SequenceTable, groups: GroupCoordinator, plan: StepPlan, *, current: bytes | None) -> None:
    """`PageManager.abort`: nothing written is committed; cannot fail once the plan is this table's open one."""
    rows = check_open(seqs, groups, plan, "abort")
    _end(seqs, groups, plan, rows, current, "aborted")


def _end(seqs: SequenceTable, groups: GroupCoordinator, plan: StepPlan, rows: np.ndarray, current: bytes | None,
         how: str, *, give_back: bool = True) -> None:
    if give_back:  # what the plan reserved and nobody wrote goes back (this cannot fail)
        give_back_reserved(seqs, groups, rows, current=current, keep=plan._held)
    seqs.close_plan(plan._number, rows)
    plan._mark_ended(how)


def check_open(seqs: SequenceTable, groups: GroupCoordinator, plan: object, what: str) -> np.ndarray:
    """The rows of ``plan``, once it is an open plan of ``seqs`` as it was planned; TypeError for
    another object, ValueError for another manager's plan or an ended one, InvariantError when a
    planned sequence changed (the guard failed: a bug)."""
    if not isinstance(plan, StepPlan):
        raise TypeError(f"{what} takes the StepPlan schedule or schedule_decode returned, got {type(plan).__name__}")
    if plan._owner is not seqs:
        raise ValueError(f"{plan!r} was made by another PageManager; {what} a plan on the manager that made it")
    if plan.ended is not None:
        raise ValueError(f"{plan!r} ended already ({plan.ended}); a plan ends once: schedule the next step")
    _check_unchanged(seqs, plan)
    return plan._rows


def _written(plan: StepPlan, token_ids: Any, num_tokens: Any) -> tuple[np.ndarray, Tokens]:
    """(count per sequence, their ids: ``(n,)`` or ``(n, k)`` or one array per sequence, or None:
    unknown) of what the plan's step wrote, checked."""
    if plan.form == "decode":
        if token_ids is None:
            raise ValueError(f"{plan!r} commits the ids its loop wrote: token_ids of shape ({len(plan.seq_ids)}, "
                             f"{plan.num_steps}); abort(plan) when it wrote nothing")
        tokens, counts = _decode_written(plan, token_ids, num_tokens)
        if counts.size and (counts == 1).all():  # one token each: the batched commit of a decode step
            return counts, tokens[:, 0]
        return counts, [tokens[i, : counts[i]] for i in range(plan._rows.size)]
    n = plan._rows.size
    if num_tokens is not None:
        raise ValueError(f"num_tokens={num_tokens!r}: {plan!r} is a mixed step, committed whole; its token_ids say how "
                         "many each sequence wrote (None: every planned token, ids unknown)")
    if token_ids is None:
        return plan.limits[:n].astype(np.int64), None
    counts, ids = parse_tokens(token_ids, n)
    over = counts > plan.limits[:n]
    if over.any():
        i = int(np.argmax(over))
        raise ValueError(f"token_ids[{i}] holds {int(counts[i])} ids but {plan!r} planned {int(plan.limits[i])} for "
                         f"sequence {plan.seq_ids[i]}; commit at most what was planned")
    return counts, ids


def _decode_written(plan: StepPlan, token_ids: Any, num_tokens: Any) -> tuple[np.ndarray, np.ndarray]:
    """(ids ``(n, k)``, count per sequence) of what a decode plan's loop wrote, checked."""
    n, k, padded = plan._rows.size, plan.num_steps, plan.padded_rows
    if isinstance(token_ids, jax.Array):
        token_ids = np.asarray(token_ids)
    tokens = integer_array("token_ids", token_ids, ndim=2, lo=0, hi=INT32_MAX, dtype=np.int64, hint="token ids")
    if tokens.shape not in ((n, k), (padded, k)):
        raise ValueError(f"token_ids has shape {tokens.shape}; {plan!r} takes ({n}, {k}) ids (or ({padded}, {k}) as "
                         "its padded loop returns them): the token each sequence wrote at each step")
    if num_tokens is None:
        return tokens[:n], plan.limits[:n].astype(np.int64)
    if isinstance(num_tokens, jax.Array):
        num_tokens = np.asarray(num_tokens)
    # Bounded by the plan's steps before any array holds a count (2**80 would overflow int64); the
    # limit of each sequence, at most num_steps, is compared below with its own message.
    hint = f"tokens each sequence wrote, at most num_steps={k}"
    one = is_scalar(num_tokens)
    if one:  # one count for every sequence
        counts = np.full(n, integer("num_tokens", num_tokens, lo=0, hi=k, hint=hint), np.int64)
    else:
        counts = integer_array("num_tokens", num_tokens, ndim=1, lo=0, hi=k, dtype=np.int64, hint=hint)
        if counts.shape not in ((n,), (padded,)):
            raise ValueError(f"num_tokens has {counts.size} entries; {plan!r} takes one int, {n} (or {padded}, "
                             "padded): how many tokens each sequence wrote")
        if counts[n:].any():
            i = n + int(np.argmax(counts[n:] > 0))
            raise ValueError(f"num_tokens[{i}]={int(counts[i])} but row {i} is padding ({plan!r} has {n} sequences); "
                             "padding rows write nothing")
    over = counts > plan.limits[: counts.size]
    if over.any():
        i = int(np.argmax(over))
        raise ValueError(f"num_tokens{'' if one else f'[{i}]'}={int(counts[i])} is more than the "
                         f"{int(plan.limits[i])} tokens {plan!r} planned for sequence {plan.seq_ids[i]}; commit at "
                         "most what was planned")
    return tokens[:n], counts[:n]


def _stamp(seqs: SequenceTable, rows: np.ndarray) -> np.ndarray:
    """What a plan was planned over: the rows' edit counts (`SequenceTable` counts every change to
    a row). One gather, not a copy of the rows: the guard (`open_plans`) keeps a plan's sequences
    as planned; this tells a bug that got past it."""
    stamp: np.ndarray = seqs.edits[rows]
    return stamp


def _check_unchanged(seqs: SequenceTable, plan: StepPlan) -> None:
    """InvariantError unless ``plan`` is open in ``seqs``, each of its sequences as planned:
    `open_plans` refuses every call that would change them, so only a bug gets here."""
    rows = plan._rows
    if seqs.open_plans.get(plan._number) is not rows:
        raise InvariantError(f"{plan!r} is not open over its sequences {list(plan.seq_ids)} (closed while the plan "
                             "was open)")
    now = _stamp(seqs, rows)
    if not np.array_equal(plan._stamp, now):
        i = int(np.argmax(plan._stamp != now))
        row = int(rows[i])
        raise InvariantError(
            f"sequence {row} of {plan!r} changed after the plan was made, though the open plan froze it "
            f"(written, rewound, released or claimed anew, or its pages or weight version: length "
            f"{int(plan.lengths[i])} then, {int(seqs.lens[row])} now)")


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


__all__ = ["DecodePlan", "StepPlan", "abort", "check_open", "commit", "schedule", "schedule_decode"]
