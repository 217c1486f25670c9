"""What an open plan freezes: which sequences each public method of `PageManager` changes,
declared once here, and the one guard that enforces it.

A plan (`step_plan`) is open from `PageManager.schedule` / `schedule_decode` until its `commit` or `abort`: its
device loop may be writing its sequences' pages, and its commit relies on them being as it planned
them. So while it is open nothing but that commit may change them. Every public member of
`PageManager` declares here what it changes (`CHANGES`), and `freeze_planned` wraps the class once:
a call that would change a sequence an open plan holds is refused before it runs (ValueError naming
the sequence, the plan's sequences and the fix, nothing changed). A public member without a
declaration (or a declaration of no member) fails when the class is made, so a new method cannot
forget the rule. The plan's own commit still compares what it was planned over, as a bug check.

The declarations:

- `READS`: changes nothing of this manager (inspection; `clone`, `state_dict` and `reshard`
  return copies, which hold no plans: there a planned sequence is free and the pages its plan
  reserved are reserved room).
- `NO_SEQUENCE`: changes the manager but no claimed sequence: claiming free ids, the pending
  device and tier work, the prefix caches (a reset forgets the digests of pages in use, which keep
  their contents and owners). These run while plans are open: an engine admits requests and
  applies a plan's copies while its loop runs.
- `named(arg, read)`: the sequences argument ``arg`` names, read by ``read``, the `SequenceTable`
  function the method itself reads it with (`SequenceTable.row`: one id; ``rows``: a list;
  ``one_or_more_rows``: either), so the guard reads a numpy or jax scalar id, a list or a bad
  value exactly as the call does (a bad one gets the call's own error).
- `UNSTARTED`: `set_weight_version` (when the version changes): every claimed sequence that holds
  nothing yet takes the new version. Running sequences keep theirs, so a plan over them never
  blocks a weight update: an RL trainer pushes weights while rollouts decode, and they finish
  under the version they started with, plan or no plan. A plan that holds a sequence not started
  yet (planned for no token) blocks it, since the update would change the version that sequence
  starts under behind the plan; end the plan first, or leave such sequences out of plans.
- `OWN_PLAN`: `commit` and `abort` (and the deprecated `commit_decode`), the calls that change a plan's
  sequences, and end the plan.

Imports the manager's ``prefix_hash`` and ``sequences`` only; never ``storage``, ``attention``,
``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from easykv.manager.prefix_hash import version_digest
from easykv.manager.sequences import SequenceTable

T = TypeVar("T")
# (manager, positional args, keyword args) -> the rows the call would change; None: none
RowsOf = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]
# how a method reads the sequences an argument names: SequenceTable.row, .rows or .one_or_more_rows
ReadRows = Callable[[SequenceTable, Any], Any]


@dataclasses.dataclass(frozen=True)
class Changes:
    """What one public member of `PageManager` changes (see the module doc).

    Attributes:
      kind: in words: nothing, no claimed sequence, the sequences it names, every sequence not
        started yet, or its plan's sequences.
      arg: for the sequences it names: the argument naming them (an id or a list of ids).
      read: for the sequences it names: the `SequenceTable` function the method reads ``arg`` with.
      why: how it changes them, where the refusal should say so.
    """

    kind: str
    arg: str | None = None
    read: ReadRows | None = None
    why: str = ""


READS = Changes("nothing")
NO_SEQUENCE = Changes("no claimed sequence")
UNSTARTED = Changes("every sequence not started yet",
                    why=" (claimed but not started: it would start under the new version; running sequences keep "
                        "theirs, so plans over them never block a weight update)")
OWN_PLAN = Changes("its plan's sequences")


def named(arg: str, read: ReadRows) -> Changes:
    """The sequences argument ``arg`` names, read as the method reads it: by ``read``."""
    return Changes("the sequences it names", arg, read)


_ONE, _SOME = named("seq_id", SequenceTable.row), named("seq_ids", SequenceTable.rows)
_ONE_OR_MORE = named("seq_ids", SequenceTable.one_or_more_rows)
CHANGES: dict[str, Changes] = {
    # sequence slots
    "claim": NO_SEQUENCE, "external_claim": NO_SEQUENCE, "release": _ONE, "contains": READS,
    "slots_remaining": READS, "active_ids": READS,
    # how a sequence starts, and the prefix caches
    "match_prefix": _ONE, "resume": _ONE, "cached_prefix_length": READS, "reset_prefix_cache": NO_SEQUENCE,
    # growth and commits
    "reserve": _ONE_OR_MORE, "fork": _ONE, "build_step_metadata": _SOME, "build_decode_metadata": _SOME,
    "schedule": _SOME, "schedule_decode": _SOME, "commit": OWN_PLAN, "abort": OWN_PLAN, "check_plan": READS,
    "plan_decode": _SOME, "commit_decode": OWN_PLAN, "increment_cache_lengths": READS, "step": _SOME,
    "append_tokens": _ONE, "advance": _ONE_OR_MORE, "truncate": _ONE,
    # weight versions
    "weight_version": READS, "set_weight_version": UNSTARTED,
    # inspection
    "num_groups": READS, "length": READS, "cache_length": READS, "capacity": READS, "pages": READS, "sequence": READS,
    "first_kept_position": READS, "replica": READS, "page_table": READS, "metrics": READS, "usage": READS,
    "estimated_memory_size": READS, "infer_optimal_batch_size": READS,
    # the host-memory tier
    "has_host_tier": READS,
    "tier_names": READS, "forget_host_tier": NO_SEQUENCE, "attach_host_tier": NO_SEQUENCE, "is_swapped": READS,
    "swapped_ids": READS, "swap_out": _ONE, "swap_in": _ONE, "has_pending_transfers": READS,
    "pending_transfers": READS, "take_transfers": NO_SEQUENCE,
    # a shared prefix store above
    "prompt_digests": READS, "admission_replica": READS, "adopt_host_prefixes": NO_SEQUENCE,
    "watch_prefixes": NO_SEQUENCE, "take_prefix_events": NO_SEQUENCE,
    # pending device work
    "take_work": NO_SEQUENCE, "pending_copies": READS, "has_pending_work": READS, "take_copies": NO_SEQUENCE,
    "pending_scrubs": READS, "take_scrubs": NO_SEQUENCE,
    # invariants and persistence
    "check_invariants": READS, "state_dict": READS, "clone": READS, "lockstep_state": READS,
    "from_state_dict": READS, "reshard": READS,
}
_MISSING = object()


def freeze_planned(cls: type[T]) -> type[T]:
    """``cls`` (`PageManager`) with every method that changes sequences guarded by `CHANGES`.

    Raises:
      TypeError: a public member has no declaration, a declaration names no member, or a member
        declared to change sequences is not a plain method of ``cls``.
    """
    public = {name for name in dir(cls) if not name.startswith("_")}
    if public != CHANGES.keys():
        raise TypeError(f"{cls.__name__} members without a declaration of what they change: "
                        f"{sorted(public - CHANGES.keys())}; declarations of no member: "
                        f"{sorted(CHANGES.keys() - public)}; declare each public member once in "
                        "easykv/manager/open_plans.py CHANGES")
    for name, changes in CHANGES.items():
        if changes in (READS, NO_SEQUENCE, OWN_PLAN):
            continue
        method = inspect.getattr_static(cls, name, None)  # the class's own or a base's (the deprecated names)
        if not inspect.isfunction(method):
            raise TypeError(f"{cls.__name__}.{name} is declared to change sequences ({changes.kind}) but is not "
                            "a plain method of the class, which the guard could wrap")
        setattr(cls, name, _guarded(name, method, _rows_of(method, changes), changes.why))
    return cls


def _guarded(name: str, method: Callable[..., Any], rows_of: RowsOf, why: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        seqs = self._seqs
        if seqs.open_plans:  # one dict test while no plan is open: the hot path
            rows = rows_of(self, args, kwargs)
            if rows is not None:
                seqs.refuse_planned(rows, f"{name}()", why)
        return method(self, *args, **kwargs)

    return guarded


def _rows_of(method: Callable[..., Any], changes: Changes) -> RowsOf:
    """How to find the rows a call of ``method`` changes: its argument read by the function the
    method itself reads it with (so a bad id gets the method's own error)."""
    if changes == UNSTARTED:
        return _unstarted
    params = list(inspect.signature(method).parameters)
    arg, read = changes.arg, changes.read
    if arg not in params[1:] or read is None:
        raise TypeError(f"{method.__qualname__} is declared to change the sequences its argument {arg!r} names, "
                        f"but takes no such argument, or the declaration says not how it reads it")
    at = params.index(arg) - 1  # after self

    def rows_named(manager: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        value = args[at] if len(args) > at else kwargs.get(arg, _MISSING)
        if value is _MISSING:  # the call itself raises its TypeError
            return None
        return read(manager._seqs, value)

    return rows_named


def _unstarted(manager: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`set_weight_version`'s rows: those not started yet, when the version changes."""
    version = args[0] if args else kwargs.get("version", _MISSING)
    if version is _MISSING or version_digest(version) == manager._versions.current:
        return None
    return manager._seqs.unstarted_rows()


__all__ = ["CHANGES", "NO_SEQUENCE", "OWN_PLAN", "READS", "UNSTARTED", "Changes", "freeze_planned", "named"]
