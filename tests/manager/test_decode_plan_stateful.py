"""Decode plans inside the page manager's state machines (tests/manager/test_manager_stateful.py):
a rule plans k steps of some sequences (random per-sequence limits, padding), simulates the device
loop (each row writes its token while it runs and garbage after it stopped, as a loop without the
stopped-row mask would), lets other sequences move between plan, loop and commit, and commits
random early stops; the machines' invariants then check that the simulated device, read through
every page table, gives back exactly the committed tokens, on both the live and the restored
manager. Written by the outside review of issue 32."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

import tests.manager.test_manager_stateful as machines
from easykv.errors import CacheFullError

GARBAGE = 77  # what a stopped row would write: never a committed token's place


def _plan_loop_commit(self, data, k):
    ready = [s for s in sorted(self.model) if self._room(s) >= 1]
    if not ready:
        return
    seqs = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True))
    most = [data.draw(st.integers(0, min(k, self._room(s)))) for s in seqs]
    pad = data.draw(st.sampled_from([None, min(len(seqs) + 1, machines.BATCH)]))
    before = self._state()
    try:
        live = self.pm.live.plan_decode(seqs, k, max_tokens=most, pad_seqs_to=pad)
    except CacheFullError:
        assert self._state() == before  # all or nothing
        return
    restored = self.pm.restored.plan_decode(seqs, k, max_tokens=most, pad_seqs_to=pad)
    counts = [data.draw(st.integers(0, m)) for m in most]
    tokens = [data.draw(st.lists(machines.TOKENS, min_size=k, max_size=k)) for _ in seqs]
    others = [s for s in sorted(self.model) if s not in seqs]
    meanwhile = data.draw(st.sampled_from(["none", "before the loop", "after the loop"])) if others else "none"

    def other_step():
        o = data.draw(st.sampled_from(others))
        n = data.draw(st.integers(0, min(3, self._room(o))))
        self._grow([o], [data.draw(st.lists(machines.TOKENS, min_size=n, max_size=n))])

    if meanwhile == "before the loop":
        other_step()
    self._apply_page_ops()
    meta = live.metadata
    for j in range(max(counts, default=0)):
        for device, rt in zip(self.device, meta):
            slots = np.asarray(rt.slot_mapping)
            for i in range(len(seqs)):
                if slots[i] >= 0:
                    device.reshape(-1)[slots[i]] = tokens[i][j] if j < counts[i] else GARBAGE
        meta = live.next_metadata(meta)
    if meanwhile == "after the loop":
        other_step()
    written = np.array(tokens, np.int64)
    self.pm.live.commit_decode(live, written, counts)
    self.pm.restored.commit_decode(restored, written, counts)
    for s, t, c in zip(seqs, tokens, counts):
        self.model[s]["tokens"] += t[:c]


def _with_plans(machine):
    class Planned(machine):
        @precondition(lambda self: self.model)
        @rule(data=st.data(), k=st.integers(1, 5))
        def plan_loop_commit(self, data, k):
            _plan_loop_commit(self, data, k)

    Planned.__name__ = Planned.__qualname__ = "Planned" + machine.__name__
    return machines.NUMPY_ONLY(Planned.TestCase)


TestPlannedManagerMachine = _with_plans(machines.ManagerMachine)
TestPlannedHybridDataParallelMachine = _with_plans(machines.HybridDataParallelMachine)
TestPlannedTieredMachine = _with_plans(machines.TieredMachine)
TestPlannedWindowsOnlyMachine = _with_plans(machines.WindowsOnlyMachine)
