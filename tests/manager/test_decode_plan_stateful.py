"""Decode plans inside the page manager's state machines (tests/manager/test_manager_stateful.py).

Plans stay open across rules: one rule opens a plan over some sequences (random per-sequence
limits, padding, sequences never started among them), another simulates its device loop (each row
writes its token while it runs and garbage after it stopped, as a loop without the stopped-row mask
would), another ends it (committing random early stops, or aborting: no tokens, before or after
its loop). Up to two plans are open at once, and meanwhile every rule of the machine runs on the
other sequences (claims, prefix hits, writes, decodes, forks, releases, truncations, prefix-cache
resets, weight versions, swaps and host-tier resets), while a rule throws every call that names
sequences (tests/manager/planned_calls.py) at a planned one: each is refused with the state
unchanged. Copies of the manager (clone, a state round trip) hold no plan. The machines'
invariants then check that the simulated device, read through every page table, gives back
exactly the committed tokens, on both the live and the restored manager. Written by the outside
review of issue 32; plans kept open across rules for issue 42; on the step plan API for issue 43."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

import tests.manager.test_manager_stateful as machines
from easykv.errors import CacheFullError
from easykv.manager.manager import PageManager
from tests.manager.planned_calls import NAMED_CALLS, refusal

GARBAGE = 77  # what a stopped row would write: never a committed token's place
MAX_OPEN = 2


def _open_plan(self, data, k):
    ready = [s for s in self._movable() if self._room(s) >= 1]
    if not ready:
        return
    seqs = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True))
    most = [data.draw(st.integers(0, min(k, self._room(s)))) for s in seqs]
    pad = data.draw(st.sampled_from([None, min(len(seqs) + 1, machines.BATCH)]))
    before, held = self._state(), [self.pm.sequence(s).capacity for s in seqs]
    try:
        live = self.pm.live.schedule_decode(seqs, k, max_tokens=most, pad_seqs_to=pad)
    except CacheFullError:
        assert self._state() == before  # all or nothing
        return
    restored = self.pm.restored.schedule_decode(seqs, k, max_tokens=most, pad_seqs_to=pad)
    assert repr(live.work) == repr(restored.work)
    for mine, theirs in zip(live.work.groups, restored.work.groups, strict=True):
        assert all(np.array_equal(getattr(mine, f), getattr(theirs, f)) for f in mine.__dataclass_fields__)
    assert [t.name for t in live.work.tiers] == [t.name for t in restored.work.tiers]
    for mine, theirs in zip(live.work.tiers, restored.work.tiers, strict=True):
        for group, other in zip(mine.groups, theirs.groups, strict=True):  # one TierTransfers per layer group
            assert all(np.array_equal(getattr(group, f), getattr(other, f)) for f in group.__dataclass_fields__)
    # The plan took every piece of pending work: applied now, as a runner's schedule does, before any
    # other rule writes a page (a scrub of a page another admission reserves next must land first).
    machines.run_work(self.device, self.host, live.work)
    self.plans.append({"live": live, "restored": restored, "seqs": seqs, "most": most, "held": held, "ran": None})
    self.frozen.update(seqs)


def _run_loop(self, data):
    plan = data.draw(st.sampled_from([p for p in self.plans if p["ran"] is None]))
    seqs, k = plan["seqs"], plan["live"].num_steps
    counts = [data.draw(st.integers(0, m)) for m in plan["most"]]
    tokens = [data.draw(st.lists(machines.TOKENS, min_size=k, max_size=k)) for _ in seqs]
    self._apply_page_ops()  # work pending since the plan took its own (other rules'), before the loop writes
    meta = plan["live"].metadata
    for j in range(max(counts, default=0)):
        for device, step_meta in zip(self.device, meta):
            slots = np.asarray(step_meta.slot_mapping)
            for i in range(len(seqs)):
                if slots[i] >= 0:
                    device.reshape(-1)[slots[i]] = tokens[i][j] if j < counts[i] else GARBAGE
        meta = plan["live"].next_metadata(meta)
    plan["ran"] = (counts, tokens)


def _end_plan(self, data):
    plan = self.plans.pop(data.draw(st.integers(0, len(self.plans) - 1)))
    seqs, k = plan["seqs"], plan["live"].num_steps
    abort = plan["ran"] is None or data.draw(st.booleans())  # no loop ran, or it failed: commit nothing
    counts, tokens = ([0] * len(seqs), [[0] * k] * len(seqs)) if abort else plan["ran"]
    written = np.array(tokens, np.int64)
    for manager, made in ((self.pm.live, plan["live"]), (self.pm.restored, plan["restored"])):
        manager.abort(made) if abort else manager.commit(made, written, counts)
    self.frozen.difference_update(seqs)
    for s, t, c, room in zip(seqs, tokens, counts, plan["held"]):
        self.model[s]["tokens"] += t[:c]
        self._check_room(s, room)


def _touch_planned(self, data, name):
    seq = data.draw(st.sampled_from(sorted(self.frozen)))
    [plan] = [p for p in self.plans if seq in p["seqs"]]
    others = self._movable()
    seqs = ([data.draw(st.sampled_from(others))] if others and data.draw(st.booleans()) else []) + [seq]
    before = self._state()
    with pytest.raises(ValueError, match=refusal(name, seq, plan["seqs"])):
        NAMED_CALLS[name](self.pm, seqs)
    assert self._state() == before


def _with_plans(machine):
    class Planned(machine):
        @initialize()
        def no_plans(self):
            self.plans = []

        @precondition(lambda self: len(self.plans) < MAX_OPEN and self._movable())
        @rule(data=st.data(), k=st.integers(1, 5))
        def open_plan(self, data, k):
            _open_plan(self, data, k)

        @precondition(lambda self: any(p["ran"] is None for p in self.plans))
        @rule(data=st.data())
        def run_plan_loop(self, data):
            _run_loop(self, data)

        @precondition(lambda self: self.plans)
        @rule(data=st.data())
        def end_plan(self, data):
            _end_plan(self, data)

        @precondition(lambda self: self.plans)
        @rule(data=st.data(), name=st.sampled_from(sorted(NAMED_CALLS)))
        def touch_planned(self, data, name):
            _touch_planned(self, data, name)

        @rule(data=st.data())
        def claim_waiting(self, data):
            """A sequence claimed by its id and not started: plans may hold it (for no token)."""
            free = sorted(self.pm.slots_remaining)
            if free:
                seq = data.draw(st.sampled_from(free))
                self.pm.external_claim([seq])
                self.model[seq] = {"tokens": [], "salt": None, "version": self.version}

        @precondition(lambda self: self.plans and not self.swapped and not self._transfers_pending())
        @rule()
        def copies_hold_no_plan(self):
            for copy in (self.pm.live.clone(), PageManager.from_state_dict(self.meta, self.pm.live.state_dict())):
                for seq in sorted(self.frozen):
                    copy.release(seq)
                copy.check_invariants()

        @precondition(lambda self: self.host_pages and not self.swapped and not self._transfers_pending())
        @rule()
        def forget_host_tier(self):
            self.pm.forget_host_tier()
            self._apply_page_ops()  # the forgotten host pages' scrubs

    Planned.__name__ = Planned.__qualname__ = "Planned" + machine.__name__
    return machines.NUMPY_ONLY(Planned.TestCase)


TestPlannedManagerMachine = _with_plans(machines.ManagerMachine)
TestPlannedHybridDataParallelMachine = _with_plans(machines.HybridDataParallelMachine)
TestPlannedTieredMachine = _with_plans(machines.TieredMachine)
TestPlannedWindowsOnlyMachine = _with_plans(machines.WindowsOnlyMachine)
