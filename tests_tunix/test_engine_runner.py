"""The Tunix engine's steps run through its `easykv.Runner`: a failure inside its jitted decode loop
aborts the loop's plan (nothing open, the pages reserved for the loop given back, exactly), the
manager stays consistent, and the next rollout is the one a fresh engine gives."""

from __future__ import annotations

import pytest

pytest.importorskip("tunix")

from helpers import ids_of, make  # noqa: E402

from easykv.integrations.tunix import TunixPagedEngine  # noqa: E402

PROMPTS = [ids_of("hello there, pages"), ids_of("a paged cache for rollouts")]  # distinct: no fork, no copy


def engine(model):
    return TunixPagedEngine(model, max_length=128, batch_size=8, page_size=4, num_pages=160, decode_steps=8,
                            prefill_tokens=32)


def pages(manager):
    m = manager.metrics
    return m.free_pages, m.cached_pages, m.used_pages


def test_a_failing_decode_loop_aborts_its_plan_and_gives_back_exactly_its_pages(monkeypatch):
    model = make("qwen3")
    expected, _ = engine(model).generate(PROMPTS, 24)
    eng = engine(model)
    mgr = eng.manager
    seen = {"plans": [], "loops": 0}

    # Counted at the failing loop's schedule_decode and at the first release after it (generate's
    # cleanup), so between them only the plan and its abort happened.
    schedule_decode, release, loop = mgr.schedule_decode, mgr.release, eng._decode_loop

    def spy_schedule_decode(*args, **kwargs):
        seen["before"] = pages(mgr)
        plan = schedule_decode(*args, **kwargs)
        seen["plans"].append(plan)
        seen["reserved"] = pages(mgr)
        return plan

    def spy_release(seq_id):
        if "failed" in seen and "after" not in seen:
            seen["after"] = pages(mgr)
        release(seq_id)

    def fails_on_the_second_loop(*args, **kwargs):
        seen["loops"] += 1
        if seen["loops"] == 2:  # after one loop ran and committed: the sequences hold decoded tokens
            seen["failed"] = True
            raise RuntimeError("the device loop failed")
        return loop(*args, **kwargs)

    monkeypatch.setattr(mgr, "schedule_decode", spy_schedule_decode)
    monkeypatch.setattr(mgr, "release", spy_release)
    monkeypatch.setattr(eng, "_decode_loop", fails_on_the_second_loop)
    with pytest.raises(RuntimeError, match="the device loop failed"):
        eng.generate(PROMPTS, 24)

    first, failed = seen["plans"]
    assert first.ended == "committed" and failed.ended == "aborted"  # no plan left open
    assert seen["reserved"][2] > seen["before"][2]  # the failed loop had pages reserved ...
    assert seen["after"] == seen["before"]  # ... and exactly those went back at its abort
    m = mgr.metrics
    assert (m.active_sequences, m.used_pages) == (0, 0)
    mgr.check_invariants()

    monkeypatch.setattr(eng, "_decode_loop", loop)  # the next rollout runs, and as a fresh engine's
    tokens, _ = eng.generate(PROMPTS, 24)
    assert [t.tolist() for t in tokens] == [t.tolist() for t in expected]
    assert (mgr.metrics.active_sequences, mgr.metrics.used_pages) == (0, 0)
    mgr.check_invariants()
