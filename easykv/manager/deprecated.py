"""`PageManager`'s names of the release before the step plan, kept for one release: each warns
once per call site (DeprecationWarning naming its replacement) and runs the new one.

The plan replaced them: `schedule` / `schedule_decode` and `commit` / `abort` do what
`build_step_metadata`, `build_decode_metadata`, `reserve`, `plan_decode`, `step` (after those),
`append_tokens`, `advance` and `commit_decode` did; `sequence(seq_id)` gives what `capacity`,
`replica`, `first_kept_position` and `is_swapped` did; `clone(metadata)` is `reshard`;
``state_dict(host_tier=True)`` is ``lockstep_state``; the device work a plan carries
(`StepPlan.work`), or `take_work` for work no plan took, replaces the ``pending_*`` / ``take_*`` /
``has_pending_transfers`` calls; and `easykv.Runner` applies it (``apply_pending``,
``check_cache`` and ``check_host`` took a cache or a tier, which the manager no longer receives: a
call names the runner's method instead).

A mixin of `PageManager` only (it reads the manager's parts like the class itself). Imports the
manager's ``growth``, ``commit`` and ``device_work``, and ``step.checks``; never ``storage``,
``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from easykv.manager import growth
from easykv.manager.commit import commit_tokens
from easykv.manager.host_tier import require_host
from easykv.step.checks import check_padding
from easykv.validation import non_negative_int, positive_int

if TYPE_CHECKING:
    from collections.abc import Sequence

    from easykv.manager.coordinator import GroupCoordinator, PerGroup
    from easykv.manager.device_work import CopyCounter, DeviceWork
    from easykv.manager.host_tier import HostTierLayer, Transfers
    from easykv.manager.metrics import SequenceInfo
    from easykv.manager.sequences import SequenceTable
    from easykv.manager.step_plan import StepPlan
    from easykv.manager.tier_set import LowerTiers
    from easykv.manager.versions import VersionLog
    from easykv.spec.metadata import PagedAttentionCacheMetaData

# Moved to the runner: the manager receives no cache or tier object (`__getattr__` names the new home).
MOVED_TO_RUNNER = {
    "apply_pending": "easykv.Runner(manager, cache, host=tier).apply_pending() (or easykv.apply_pending(manager, "
                     "cache, host=tier))",
    "check_cache": "easykv.Runner(manager, cache), which checks the cache, or "
                   "easykv.storage.pool_match.check_cache_of(cache, manager.metadata)",
    "check_host": "easykv.Runner(manager, cache, host=tier), which checks the tier when it is made",
}


def deprecated(old: str, new: str) -> None:
    """Warn that ``PageManager.old`` is deprecated in favour of ``new`` (the caller's line)."""
    warnings.warn(f"PageManager.{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)


def moved(name: str) -> NoReturn:
    """AttributeError naming where a method that took a cache or a tier went."""
    raise AttributeError(f"PageManager.{name} moved out of the manager, which never sees a cache or a tier: use "
                         f"{MOVED_TO_RUNNER[name]}")


class DeprecatedMethods:
    """The deprecated names of `PageManager` (see the module doc); ``_seqs``, ``_groups``,
    ``_tiers`` (``_host``: the host tier's layer, or None) are the manager's parts."""

    _seqs: SequenceTable
    _groups: GroupCoordinator
    _tiers: LowerTiers
    _host: HostTierLayer | None
    _copies: CopyCounter
    _versions: VersionLog
    metadata: PagedAttentionCacheMetaData
    enable_prefix_caching: bool

    if TYPE_CHECKING:  # the manager's own methods these call
        def schedule_decode(self, seq_ids: Sequence[int], num_steps: int, *, max_tokens: Any = None,
                            pad_seqs_to: int | None = None) -> StepPlan: ...
        def commit(self, plan: StepPlan, token_ids: Any = None, num_tokens: Any = None) -> None: ...
        def abort(self, plan: StepPlan) -> None: ...
        def take_work(self) -> DeviceWork: ...
        def state_dict(self, *, host_tier: bool = False) -> dict[str, Any]: ...
        def clone(self, metadata: PagedAttentionCacheMetaData | None = None) -> Any: ...
        def step(self, seq_ids: Sequence[int], token_ids: Any) -> None: ...
        def sequence(self, seq_id: int) -> SequenceInfo: ...

    # ---- a step without a plan: `schedule` and `commit` replace them -------------------------------
    def reserve(self, seq_ids: int | Sequence[int], num_tokens: int | Sequence[int]) -> None:
        """Deprecated: `schedule` reserves a step's room (and `commit` / `abort` give back what nobody wrote)."""
        deprecated("reserve", "schedule(seq_ids, num_new_tokens), which reserves the step's room")
        seqs = self._seqs
        rows = seqs.one_or_more_rows(seq_ids)
        growth.reserve(seqs, self._groups, self._tiers, self._copies, rows, seqs.counts(num_tokens, rows.size))

    def build_step_metadata(self, seq_ids: Sequence[int], num_new_tokens: int | Sequence[int], *,
                            pad_tokens_to: int | None = None, pad_seqs_to: int | None = None) -> Any:
        """Deprecated: ``schedule(...).metadata`` (the plan ends with `commit`, not `step`)."""
        deprecated("build_step_metadata", "schedule(seq_ids, num_new_tokens, ...): a plan holding the metadata "
                                          "(plan.metadata) and its device work, ended by commit(plan, token_ids)")
        seqs, groups = self._seqs, self._groups
        rows = seqs.rows(seq_ids)
        new = seqs.counts(num_new_tokens, rows.size)
        pad_tokens_to, pad_seqs_to = check_padding(self.metadata, int(new.sum()), rows.size, pad_tokens_to, pad_seqs_to)
        growth.reserve(seqs, groups, self._tiers, self._copies, rows, new)
        return growth.step_metadata(seqs, groups, rows, new, pad_tokens_to=pad_tokens_to, pad_seqs_to=pad_seqs_to)

    def build_decode_metadata(self, seq_ids: Sequence[int], num_steps: int = 1, *, pad_seqs_to: int | None = None,
                              stacked: bool = False) -> Any:
        """Deprecated: `schedule_decode` (its plan's ``metadata`` and ``next_metadata``)."""
        deprecated("build_decode_metadata", "schedule_decode(seq_ids, num_steps): plan.metadata, plan.next_metadata")
        seqs, groups = self._seqs, self._groups
        rows = seqs.rows(seq_ids)
        k = positive_int("num_steps", num_steps)
        _, pad_seqs_to = check_padding(self.metadata, rows.size, rows.size, None, pad_seqs_to)
        growth.reserve(seqs, groups, self._tiers, self._copies, rows, np.full(rows.size, k, np.int64))
        return growth.decode_metadata(seqs, groups, rows, k, pad_seqs_to=pad_seqs_to, stacked=stacked)

    def append_tokens(self, seq_id: int, token_ids: Sequence[int] | np.ndarray) -> None:
        """Deprecated: ``commit(plan, [token_ids])`` (or `step` for one sequence)."""
        deprecated("append_tokens", "commit(plan, [token_ids]) of the plan that reserved them")
        self.step([self._seqs.row(seq_id)], [token_ids])  # the id read as the open-plan guard reads it

    def advance(self, seq_ids: int | Sequence[int], num_tokens: int | Sequence[int]) -> None:
        """Deprecated: ``commit(plan)`` with no ids (the written pages are not prefix-cached)."""
        deprecated("advance", "commit(plan) without token_ids (its pages are not prefix-cached)")
        seqs = self._seqs
        rows = seqs.one_or_more_rows(seq_ids)
        commit_tokens(seqs, self._groups, self._tiers, rows, seqs.counts(num_tokens, rows.size), None,
                      caching=self.enable_prefix_caching, current=self._versions.current)

    # ---- one sequence's numbers: `sequence(seq_id)` gives them all ------------------------------------
    def capacity(self, seq_id: int) -> int:
        """Deprecated: ``sequence(seq_id).capacity``."""
        deprecated("capacity", "sequence(seq_id).capacity")
        return int(self._seqs.npages[self._seqs.row(seq_id)]) * self._seqs.page_size

    def replica(self, seq_id: int) -> int | None:
        """Deprecated: ``sequence(seq_id).replica``."""
        deprecated("replica", "sequence(seq_id).replica")
        replica = int(self._seqs.replica[self._seqs.row(seq_id)])
        return replica if replica >= 0 else None

    def first_kept_position(self, seq_id: int, *, group: int | None = None) -> int:
        """Deprecated: ``sequence(seq_id).first_kept[group]``."""
        deprecated("first_kept_position", "sequence(seq_id).first_kept[group]")
        table = self._groups[self._groups.group_index(group)]
        row = self._seqs.row(seq_id)
        return table.first_kept_position(int(self._seqs.lens[row]), int(self._seqs.floor[row]))

    def reshard(self, metadata: PagedAttentionCacheMetaData) -> Any:
        """Deprecated: ``clone(metadata)``."""
        deprecated("reshard", "clone(metadata), a copy laid out for another metadata of the same pool")
        return self.clone(metadata)

    def plan_decode(self, seq_ids: Sequence[int], num_steps: int, *, max_tokens: Any = None,
                    pad_seqs_to: int | None = None) -> StepPlan:
        """Deprecated: `schedule_decode`."""
        deprecated("plan_decode", "schedule_decode (the same arguments)")
        return self.schedule_decode(seq_ids, num_steps, max_tokens=max_tokens, pad_seqs_to=pad_seqs_to)

    def commit_decode(self, plan: StepPlan, token_ids: Any, num_tokens: Any = None) -> None:
        """Deprecated: `commit`, or `abort` for no tokens (``num_tokens=0``)."""
        deprecated("commit_decode", "commit(plan, token_ids, num_tokens), or abort(plan) to commit nothing")
        if num_tokens is not None and not isinstance(num_tokens, (list, tuple, np.ndarray)) and _is_zero(num_tokens):
            self.abort(plan)
        else:
            self.commit(plan, token_ids, num_tokens)

    def is_swapped(self, seq_id: int) -> bool:
        """Deprecated: ``sequence(seq_id).swapped``."""
        deprecated("is_swapped", "sequence(seq_id).swapped")
        return self._tiers.holds(self._seqs.row(seq_id))

    def lockstep_state(self) -> dict[str, Any]:
        """Deprecated: ``state_dict(host_tier=True)``."""
        deprecated("lockstep_state", "state_dict(host_tier=True)")
        return self.state_dict(host_tier=True)

    # ---- pending device work: what a plan carries (`StepPlan.work`) or `take_work` hands over -----
    def has_pending_transfers(self) -> bool:
        """Deprecated: ``plan.work.has_transfers``."""
        deprecated("has_pending_transfers", "plan.work.has_transfers (or take_work().has_transfers)")
        return self._tiers.has_transfers()

    def pending_copies(self, pad_to: int | None = None) -> tuple[PerGroup[np.ndarray], PerGroup[np.ndarray]]:
        """Deprecated: ``plan.work.copies()``."""
        deprecated("pending_copies", "plan.work.copies() (or take_work().copies())")
        src = tuple(np.fromiter(t.copies.values(), np.int32, len(t.copies)) for t in self._groups)
        dst = tuple(np.fromiter(t.copies.keys(), np.int32, len(t.copies)) for t in self._groups)
        return _padded_all(src, pad_to, "copies", self._groups), _padded_all(dst, pad_to, "copies", self._groups)

    def pending_scrubs(self, pad_to: int | None = None) -> PerGroup[np.ndarray]:
        """Deprecated: ``plan.work.scrubs()``."""
        deprecated("pending_scrubs", "plan.work.scrubs() (or take_work().scrubs())")
        return _padded_all(tuple(t.pool.pending_scrubs() for t in self._groups), pad_to, "scrubs", self._groups)

    def pending_transfers(self) -> Transfers:
        """Deprecated: ``plan.work.transfers()``."""
        deprecated("pending_transfers", "plan.work.transfers() (or take_work().transfers())")
        return require_host(self._host, "pending_transfers").pending_transfers()

    def take_copies(self, pad_to: int | None = None) -> tuple[PerGroup[np.ndarray], PerGroup[np.ndarray]]:
        """Deprecated: ``take_work().copies()``."""
        deprecated("take_copies", "take_work() (all the work, in one value) and its copies()")
        self._refuse_transfers("take_copies")
        src = tuple(np.fromiter(t.copies.values(), np.int32, len(t.copies)) for t in self._groups)
        dst = tuple(np.fromiter(t.copies.keys(), np.int32, len(t.copies)) for t in self._groups)
        out = _padded_all(src, pad_to, "copies", self._groups), _padded_all(dst, pad_to, "copies", self._groups)
        for table in self._groups:  # checked: taken
            table.take_copies()
        return out

    def take_scrubs(self, pad_to: int | None = None) -> PerGroup[np.ndarray]:
        """Deprecated: ``take_work().scrubs()``."""
        deprecated("take_scrubs", "take_work() (all the work, in one value) and its scrubs()")
        self._refuse_transfers("take_scrubs")
        out = _padded_all(tuple(t.pool.pending_scrubs() for t in self._groups), pad_to, "scrubs", self._groups)
        for table in self._groups:  # checked: taken
            table.pool.take_scrubs()
        return out

    def take_transfers(self) -> Transfers:
        """Deprecated: ``take_work().transfers()``."""
        deprecated("take_transfers", "take_work() (all the work, in one value) and its transfers()")
        host = require_host(self._host, "take_transfers")
        out = host.pending_transfers()
        host.transfers_done()
        return out

    def _refuse_transfers(self, what: str) -> None:
        # Only offloads and onloads must run before copies and device scrubs; the host scrubs a
        # take_transfers leaves stay pending for the next one and touch no device page.
        if self._tiers.has_transfers():
            raise ValueError(f"{what}: host-tier transfers are pending and must run first (an offload reads a page a "
                             "copy or scrub overwrites); take all the work at once with take_work()")

    def __getattr__(self, name: str) -> Any:
        if name in MOVED_TO_RUNNER:
            moved(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def _is_zero(value: Any) -> bool:
    try:
        return int(value) == 0 and not isinstance(value, bool)
    except (TypeError, ValueError, OverflowError):
        return False


def _padded_all(arrays: PerGroup[np.ndarray], pad_to: int | None, what: str,
                groups: GroupCoordinator) -> PerGroup[np.ndarray]:
    return tuple(_padded(a, pad_to, what, table.pool.num_pages) for a, table in zip(arrays, groups))


def _padded(values: np.ndarray, pad_to: int | None, what: str, most: int) -> np.ndarray:
    """``values`` padded with -1 to ``pad_to`` entries; never more than ``most`` (the pool's
    pages: no more copies or scrubs can be pending), so a huge pad allocates nothing."""
    n = int(values.size)
    size = n if pad_to is None else non_negative_int("pad_to", pad_to, hi=most,
                                                     hint=f"at most one entry per page of the pool of {most}")
    if size < n:
        raise ValueError(f"pad_to={pad_to} is below the {n} pending {what}; pass at least {n} (or None)")
    out = np.full(size, -1, np.int32)
    out[:n] = values
    return out


__all__ = ["MOVED_TO_RUNNER", "DeprecatedMethods", "deprecated", "moved"]
