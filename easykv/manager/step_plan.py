"""Multi-step decode: ``k`` decode steps of running sequences decided at once, so an engine runs
them in one device loop and returns to the host once (JetStream's and vLLM's multi-step
scheduling). `plan` reserves room for ``k`` more tokens of each sequence and builds the first
step's metadata; on the device, `DecodePlan.next_metadata` derives each next step from the one
before. `commit` then commits what each sequence wrote (a sequence that stopped early, at its end
of sequence or its length limit, commits fewer) and gives back the pages the plan reserved for
tokens it never wrote (a private copy of a shared page, made at planning for its first write,
stays: its next write needs it). A sliding or chunked group releases the pages its window left at
that commit, not during the loop: every step of the loop may still read them.

While a plan is open, every call that would change one of its sequences is refused (ValueError:
its device loop may be writing their pages; `open_plans` declares what each call changes and
guards them all), so its commit always finds them as planned, and committing no tokens (the
abort) always ends it. Other sequences may change meanwhile. A plan is also stamped with what it
was planned over (each sequence's edits, length, columns and weight version, its block-table rows
and window starts in every group); a commit that finds any of that changed raises InvariantError
(the guard failed: a bug), with nothing changed. Committing a plan twice is refused.

Coordinator code over the parts it is handed, like ``growth`` and ``commit``. Imports ``step`` for
the metadata and the manager's ``growth``, ``commit`` and ``rollback``; never ``storage``,
``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from easykv.errors import InvariantError
from easykv.manager import growth
from easykv.manager.commit import commit_tokens
from easykv.manager.prefix_hash import as_token_ids
from easykv.manager.rollback import give_back_reserved
from easykv.step.checks import check_padding
from easykv.step.loop import increment_groups
from easykv.validation import INT32_MAX, integer, integer_array, is_scalar, positive_int

if TYPE_CHECKING:
    from easykv.manager.coordinator import GroupCoordinator, PerGroup
    from easykv.manager.device_work import PendingWork
    from easykv.manager.host_tier import HostTierPolicy
    from easykv.manager.sequences import SequenceTable
    from easykv.spec.metadata import PagedAttentionCacheMetaData
    from easykv.step.metadata import PagedAttentionMetadata


class DecodePlan:
    """``num_steps`` decode steps of ``seq_ids``, pages reserved for all of them
    (`PageManager.plan_decode`; commit it once with `PageManager.commit_decode`).
    `next_metadata` gives step ``j + 1``'s metadata from step ``j``'s, numpy or jax, inside jit too.

    Attributes:
      seq_ids: the planned sequences, ``n`` ints (row ``i < n`` of every step is ``seq_ids[i]``).
      num_steps: decode steps of the loop.
      lengths: ``(n,)`` each sequence's committed length when planned; step ``j`` writes position
        ``lengths + j``.
      limits: ``(padded_rows,)`` int32, the most tokens each row may write (room is reserved for
        that many; 0 for padding rows): the device loop's limits.
      metadata: the first step's metadata, a tuple of one `PagedAttentionMetadata` per layer
        group, ``padded_rows`` rows each (``pad_seqs_to``).
      page_size: tokens per page.
      num_pages: each layer group's pool size, one int per group.
      committed: whether `PageManager.commit_decode` has taken the plan.

    Other Parameters:
      owner: the manager's sequence table (a plan commits only on the manager that made it).
      number: the open plan's number in that table (`SequenceTable.open_plan`).
      stamp: what the plan was planned over, compared at commit.
      held: ``(n,)`` pages each sequence held before the plan reserved more.
    """

    __slots__ = ("_held", "_number", "_owner", "_stamp", "committed", "lengths", "limits", "metadata", "num_pages",
                 "num_steps", "page_size", "seq_ids")

    def __init__(self, *, owner: SequenceTable, seq_ids: tuple[int, ...], num_steps: int, lengths: np.ndarray,
                 limits: np.ndarray, metadata: PerGroup[PagedAttentionMetadata], page_size: int,
                 num_pages: tuple[int, ...], stamp: tuple[np.ndarray, ...], held: np.ndarray,
                 number: int) -> None:  # fmt: skip
        self._owner, self._stamp, self._held = owner, stamp, held  # held: columns before the plan reserved
        self._number = number
        self.seq_ids, self.num_steps, self.lengths, self.limits = seq_ids, num_steps, lengths, limits
        self.metadata, self.page_size, self.num_pages = metadata, page_size, num_pages
        self.committed = False

    @property
    def padded_rows(self) -> int:
        """Rows of every step's metadata: ``len(seq_ids)`` or the ``pad_seqs_to`` asked for."""
        return int(self.metadata[0].page_table.shape[0])

    def next_metadata(self, metadata: PerGroup[PagedAttentionMetadata]) -> PerGroup[PagedAttentionMetadata]:
        """The next step's metadata from this one (one per layer group): each sequence's token moves
        one position on, into the pages this plan reserved.

        Args:
          metadata: a step's metadata, a tuple of one per layer group (first: ``self.metadata``).

        Returns:
          the next step's, a tuple of one `PagedAttentionMetadata` per layer group.
        """
        return increment_groups(metadata, page_size=self.page_size, num_pages=self.num_pages)

    def __repr__(self) -> str:
        state = "committed" if self.committed else "open"
        return (f"DecodePlan({len(self.seq_ids)} sequences x {self.num_steps} steps, "
                f"padded to {self.padded_rows} rows, {state})")


def plan(seqs: SequenceTable, groups: GroupCoordinator, host: HostTierPolicy, work: PendingWork, seq_ids: Any,
         num_steps: Any, max_tokens: Any, *, pad_seqs_to: Any, metadata: PagedAttentionCacheMetaData) -> DecodePlan:
    """`PageManager.plan_decode`: checked whole, then all or nothing (CacheFullError naming the
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
    growth.reserve(seqs, groups, host, work, rows, most)
    first = growth.decode_metadata(seqs, groups, rows, 1, pad_seqs_to=pad_seqs_to, stacked=False)[0]
    assert isinstance(first, tuple)
    limits = np.zeros(first[0].page_table.shape[0], np.int32)
    limits[: rows.size] = most
    return DecodePlan(owner=seqs, seq_ids=tuple(rows.tolist()), num_steps=k,
                      lengths=_frozen(seqs.lens[rows].copy()), limits=_frozen(limits), metadata=first,
                      page_size=seqs.page_size, num_pages=tuple(table.pool.num_pages for table in groups),
                      stamp=_stamp(seqs, groups, rows), held=held, number=seqs.open_plan(rows))


def commit(seqs: SequenceTable, groups: GroupCoordinator, host: HostTierPolicy, work: PendingWork, plan: DecodePlan,
           token_ids: Any, num_tokens: Any, *, caching: bool, current: bytes | None) -> None:
    """`PageManager.commit_decode`: checked whole first, nothing changed on any error (the plan
    stays open then); committing no tokens cannot fail once the plan is this table's open one."""
    if not isinstance(plan, DecodePlan):
        raise TypeError(f"commit_decode takes the DecodePlan plan_decode returned, got {type(plan).__name__}")
    if plan._owner is not seqs:
        raise ValueError(f"{plan!r} was made by another PageManager; commit a plan on the manager that made it")
    if plan.committed:
        raise ValueError(f"{plan!r} was committed already; plan the next steps with plan_decode")
    rows = np.asarray(plan.seq_ids, np.int64)
    _check_unchanged(seqs, groups, rows, plan)
    tokens, counts = _written(plan, token_ids, num_tokens)
    live = np.flatnonzero(counts > 0)
    if live.size:  # ValueError (a page whose copy is pending), nothing changed: the plan stays open
        written = [as_token_ids(tokens[i, : counts[i]], f"token_ids[{i}]") for i in live.tolist()]
        commit_tokens(seqs, groups, host, rows[live], counts[live], written, caching=caching, current=current)
    # Committed: what the plan reserved and nobody wrote goes back (this cannot fail).
    give_back_reserved(seqs, groups, rows, current=current, keep=plan._held)
    seqs.close_plan(plan._number)
    plan.committed = True


def _written(plan: DecodePlan, token_ids: Any, num_tokens: Any) -> tuple[np.ndarray, np.ndarray]:
    """(ids ``(n, k)``, count per sequence) of what the plan's loop wrote, checked."""
    n, k, padded = len(plan.seq_ids), plan.num_steps, plan.padded_rows
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
    if one:  # one count for every sequence (0: the abort)
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


def _stamp(seqs: SequenceTable, groups: GroupCoordinator, rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """What a plan was planned over: the rows' edits, lengths, columns and weight versions, and
    their block-table rows and window starts in every group."""
    versions = np.array([seqs.version[r] or b"" for r in rows.tolist()], object)
    own = (seqs.edits[rows], seqs.lens[rows], seqs.npages[rows], versions)
    return tuple(a.copy() for a in own) + tuple(a.copy() for table in groups for a in (table.table[rows],
                                                                                       table.start[rows]))


def _check_unchanged(seqs: SequenceTable, groups: GroupCoordinator, rows: np.ndarray, plan: DecodePlan) -> None:
    """InvariantError unless ``plan`` is open in ``seqs`` over ``rows``, each as it was planned:
    `open_plans` refuses every call that would change them, so only a bug gets here."""
    if seqs.open_plans.get(plan._number) != plan.seq_ids or not seqs.active[rows].all():
        raise InvariantError(f"{plan!r} is not open over its sequences {list(plan.seq_ids)} (released or closed "
                             "while the plan was open)")
    now = _stamp(seqs, groups, rows)
    for then, current in zip(plan._stamp, now, strict=True):
        if not np.array_equal(then, current):
            changed = np.flatnonzero((then != current).reshape(rows.size, -1).any(axis=1))
            row = int(rows[changed[0]])
            raise InvariantError(
                f"sequence {row} of {plan!r} changed after the plan was made, though the open plan froze it "
                f"(written, rewound or claimed anew, or its pages or weight version: length "
                f"{int(plan.lengths[changed[0]])} then, {int(seqs.lens[row])} now)")


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


__all__ = ["DecodePlan", "commit", "plan"]
