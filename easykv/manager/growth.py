"""How sequences get pages: room reserved ahead of writes (new pages at page boundaries, bound to
one data-parallel replica, all or nothing), a private copy of a shared, partly filled page before
it is written (copy-on-write), fork, and the step metadata built right after reserving [MAX:
fetch, increment_cache_lengths].

Coordinator code: functions over the parts they are handed (the sequence table, the group
allocators, the pending work); no state of its own. Imports ``step`` for the metadata and the
manager's parts for their types; never ``storage``, ``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from easykv.errors import CacheFullError
from easykv.step.checks import HostChecked, mark_checked
from easykv.step.ragged import RaggedStep, build_mixed, increment_cache_lengths, stack_metadata

if TYPE_CHECKING:
    from easykv.manager.coordinator import GroupCoordinator, PerGroup
    from easykv.manager.device_work import CopyCounter
    from easykv.manager.group_table import GroupTable
    from easykv.manager.sequences import SequenceTable
    from easykv.manager.tier_set import LowerTiers


# ---- reserving ----------------------------------------------------------------------------------
def reserve(seqs: SequenceTable, groups: GroupCoordinator, tiers: LowerTiers, counter: CopyCounter,
            rows: np.ndarray, new: np.ndarray) -> None:
    """Room for ``new[i]`` more tokens of each of ``rows`` in every group (`PageManager.reserve`):
    all or nothing, CacheFullError with nothing changed."""
    ps = seqs.page_size
    tiers.refuse_held(rows, "reserving pages for it")
    lens = seqs.lens[rows]
    ends = lens + new
    if ends.size and ends.max() > seqs.max_length:
        i = int(np.argmax(ends))
        seqs.check_extent(int(rows[i]), int(ends[i]), f"{int(lens[i])} cached + {int(new[i])} new tokens")
    held = seqs.npages[rows]
    need = (ends + (ps - 1)) // ps - held  # columns: the same in every group
    grow = np.flatnonzero(need > 0)
    cows = [table.copy_on_write_rows(rows, lens, new) for table in groups]
    if not grow.size and not any(cows):
        return
    counts = need[grow]
    if groups.num_replicas == 1:
        for table, cow in zip(groups, cows):
            demand = int(counts.sum()) + len(cow)
            if demand > table.pool.num_available(0):
                table.raise_full(0, demand)
        seqs.bind(rows[grow], 0)
        rep = None
    else:
        rep = _bind_replicas(seqs, groups, rows, grow, counts, cows)
    # Checks passed: nothing below can fail.
    for table, cow in zip(groups, cows):
        for i in cow:
            row = int(rows[i])
            counter.count(table.copy_on_write(row, int(lens[i]) // ps, int(seqs.replica[row])))
        if grow.size:
            table.new_pages(rows[grow], held[grow], counts, rep if rep is None else rep[grow])
    if grow.size:
        seqs.grow(rows[grow], counts)


def _bind_replicas(seqs: SequenceTable, groups: GroupCoordinator, rows: np.ndarray, grow: np.ndarray,
                   counts: np.ndarray, cows: list[list[int]]) -> np.ndarray:
    """Check per-replica capacity in every group, binding unbound sequences to the least
    loaded replica (most pages left in its tightest group, then the lowest index); returns
    the batch's replicas. Raises CacheFullError."""
    n_rep = groups.num_replicas
    demand = np.zeros((len(groups), rows.size), np.int64)
    demand[:, grow] = counts
    for g, cow in enumerate(cows):
        demand[g, cow] += 1
    rep: np.ndarray = seqs.replica[rows].copy()
    avail = np.stack([table.pool.available_per_replica() for table in groups])
    bound = rep >= 0
    left = avail - np.stack([np.bincount(rep[bound], weights=d[bound], minlength=n_rep)
                             for d in demand]).astype(np.int64)
    wants = demand.sum(axis=0) > 0
    for i in np.flatnonzero(~bound & wants):
        r = int(np.argmax(left.min(axis=0)))
        rep[i] = r
        left[:, r] -= demand[:, i]
    if left.min() < 0:
        g, r = map(int, np.unravel_index(int(np.argmin(left)), left.shape))
        groups[g].raise_full(r, int(avail[g, r] - left[g, r]))
    seqs.bind(rows[wants], rep[wants])
    return rep


# ---- fork -----------------------------------------------------------------------------------------
def fork(seqs: SequenceTable, groups: GroupCoordinator, row: int, count: int, *, what: str) -> list[int]:
    """``count`` children of ``row`` (`PageManager.fork`; ``what``: the call, for the message)."""
    free = seqs.free_rows()
    if free.size < count:
        raise CacheFullError(
            f"{what} needs {count} free sequence slot{'s' * (count > 1)} but {free.size} of "
            f"batch_size={seqs.batch_size} are free; release sequences first", resource="sequence slots",
            needed=count, available=int(free.size))
    return [_fork_one(seqs, groups, row, int(child)) for child in free[:count]]


def _fork_one(seqs: SequenceTable, groups: GroupCoordinator, row: int, child: int) -> int:
    k = seqs.written_columns(row)
    partial = bool(seqs.lens[row] % seqs.page_size)
    for table in groups:
        table.fork_row(row, child, k, partial=partial)
    seqs.fork_row(row, child, k)
    return child


# ---- step metadata [MAX: fetch, increment_cache_lengths] --------------------------------------------
def step_metadata(seqs: SequenceTable, groups: GroupCoordinator, rows: np.ndarray, new: np.ndarray, *,
                  pad_tokens_to: int | None, pad_seqs_to: int | None) -> PerGroup[RaggedStep]:
    """The mixed-form metadata of one step of ``rows`` writing ``new`` tokens each, reserved."""
    lens, ps, new32 = seqs.lens[rows], seqs.page_size, new.astype(np.int32)
    reads = not seqs.floor[rows].any()
    return tuple(build_mixed(table.table[rows], lens, new32, page_size=ps, pad_tokens_to=pad_tokens_to,
                             pad_seqs_to=pad_seqs_to, proof=_proof(table, reads))
                 for table in groups)


def decode_metadata(seqs: SequenceTable, groups: GroupCoordinator, rows: np.ndarray, num_steps: int, *,
                    pad_seqs_to: int | None, stacked: bool
                    ) -> PerGroup[RaggedStep] | list[PerGroup[RaggedStep]]:
    """``num_steps`` decode steps of ``rows`` (reserved): a list of one per step, or stacked."""
    ps, lens, ones = seqs.page_size, seqs.lens[rows], np.ones(rows.size, np.int32)
    reads = not seqs.floor[rows].any()
    stacks: list[RaggedStep] = []  # per group: its steps stacked (stacked)
    by_group: list[list[RaggedStep]] = []  # per group: its steps, checked (not stacked)
    for table in groups:
        steps = [build_mixed(table.table[rows], lens, ones, page_size=ps, pad_tokens_to=pad_seqs_to,
                             pad_seqs_to=pad_seqs_to, proof=None if stacked else _proof(table, reads))]
        for _ in range(num_steps - 1):
            steps.append(increment_cache_lengths(steps[-1], page_size=ps, num_pages=table.pool.num_pages))
        if stacked:
            stacks.append(stack_metadata(steps))
        else:
            by_group.append(steps[:1] + [_proved(table, m, reads) for m in steps[1:]])
    if stacked:
        return tuple(stacks)
    return [tuple(step) for step in zip(*by_group)]


def _proof(table: GroupTable, reads: bool) -> HostChecked:
    """What the manager vouches for in a step of ``table``'s group: its invariants prove what the
    constructors check (every page a row reads is its own, assigned and in its replica's slice; a
    page written this step belongs to one sequence), so the write and attention skip those checks;
    a sliding or chunked cache's mark holds only for reads within its window. ``reads``: False when
    a resumed sequence's window may still reach before its floor (its reads are not vouched for)."""
    group = table.group
    return HostChecked(num_pages=table.pool.num_pages, page_size=table.page_size, reads=reads,
                       page_shards=table.pool.num_replicas, attention=group.attention, window=group.window)


def _proved(table: GroupTable, step_meta: RaggedStep, reads: bool) -> RaggedStep:
    """``step_meta`` (a later decode step, derived from the first) marked as checked (`_proof`)."""
    return mark_checked(step_meta, _proof(table, reads))


__all__ = ["decode_metadata", "fork", "reserve", "step_metadata"]
