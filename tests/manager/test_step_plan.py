"""A step is a value (issue 43): `PageManager.schedule` / `schedule_decode` return a frozen
`StepPlan` holding the step's metadata and every piece of device work it implies, and `commit` /
`abort` are the only ways to end it, once, on the manager that made it.

Tiny pools (page_size 4, ten pages) so exact page ids are asserted; every refusal is checked for
its exception, its message, and a manager state equal before and after."""

from __future__ import annotations

import numpy as np
import pytest

from easykv.errors import CacheFullError
from easykv.manager.device_work import DeviceWork
from easykv.manager.step_plan import StepPlan
from tests.support.managers import make, prefill


def snapshot(pm):
    return pm.state_dict(host_tier=pm.has_host_tier)


# ---- the value ------------------------------------------------------------------------------------
def test_a_mixed_plan_holds_the_step_metadata_reserved_pages_and_no_work_on_a_fresh_pool():
    pm = make()
    a, b = pm.claim(2)
    plan = pm.schedule([a, b], [5, 2], pad_tokens_to=8, pad_seqs_to=4)
    assert isinstance(plan, StepPlan) and plan.form == "mixed" and plan.num_steps == 1
    assert plan.seq_ids == (a, b) and plan.lengths.tolist() == [0, 0] and plan.limits.tolist() == [5, 2, 0, 0]
    (meta,) = plan.metadata
    # lowest free pages first: a takes 0 and 1 (5 tokens), b takes 2
    assert pm.pages(a) == [0, 1] and pm.pages(b) == [2]
    assert meta.slot_mapping[:7].tolist() == [0, 1, 2, 3, 4, 8, 9]
    assert plan.work.empty and repr(plan.work) == "DeviceWork(none)"
    assert repr(plan) == "StepPlan(mixed: 2 sequences, 7 new tokens, padded to 4 rows, open)"
    pm.commit(plan, [[1, 2, 3, 4, 5], [6, 7]])
    assert plan.ended == "committed" and pm.length(a) == 5 and pm.length(b) == 2
    pm.check_invariants()


def test_a_plan_is_frozen_and_its_arrays_are_read_only():
    pm = make()
    [a] = pm.claim(1)
    plan = pm.schedule([a], [3])
    with pytest.raises(AttributeError, match="a StepPlan is frozen: limits cannot be set"):
        plan.limits = np.zeros(1, np.int32)
    with pytest.raises(AttributeError, match="frozen"):
        del plan.work
    with pytest.raises(ValueError, match="read-only"):
        plan.limits[0] = 9
    with pytest.raises(ValueError, match="read-only"):
        plan.lengths[0] = 9
    pm.abort(plan)


def test_the_plan_carries_the_copy_on_write_its_step_implies_and_the_work_pending_before_it():
    pm = make(scrub_released=True)
    a, gone = pm.claim(2)
    prefill(pm, a, [1, 2, 3, 4, 5, 6])  # pages 0 (full) and 1 (2 tokens)
    prefill(pm, gone, [9, 9])  # page 2
    pm.take_work()
    pm.release(gone)  # page 2 leaves its owner: a pending scrub
    child = pm.fork(a)
    plan = pm.schedule([child], [1])  # writes into the shared partly filled page 1: a private copy
    [work] = plan.work.groups
    # The fresh page is the released one (lowest free first): the copy fills it whole, so its scrub is dropped.
    assert work.copy_src.tolist() == [1] and work.copy_dst.tolist() == [2] and work.scrubs.tolist() == []
    assert pm.pages(child) == [0, 2]
    assert not pm.has_pending_work  # handed over: the runner applies it
    with pytest.raises(ValueError, match="read-only"):
        work.copy_src[0] = 5
    assert repr(plan.work) == "DeviceWork(1 copies)"
    pm.commit(plan, [[7]])
    pm.check_invariants()


def test_a_decode_plan_commits_each_sequence_s_count_and_gives_back_what_nobody_wrote():
    pm = make()
    a, b = pm.claim(2)
    prefill(pm, a, [1, 2, 3])
    prefill(pm, b, [4, 5, 6])
    plan = pm.schedule_decode([a, b], 6, max_tokens=[6, 2])
    assert plan.form == "decode" and plan.limits.tolist() == [6, 2]
    assert pm.sequence(a).capacity == 12 and pm.sequence(b).capacity == 8
    pm.commit(plan, np.arange(12).reshape(2, 6), [2, 1])
    assert pm.length(a) == 5 and pm.length(b) == 4 and pm.sequence(a).capacity == 8 and pm.sequence(b).capacity == 4
    pm.check_invariants()


# ---- ending a plan: once, on its manager ----------------------------------------------------------
@pytest.mark.parametrize("first", ["commit", "abort"])
@pytest.mark.parametrize("second", ["commit", "abort", "check_plan"])
def test_a_plan_ends_once(first, second):
    pm = make()
    [a] = pm.claim(1)
    plan = pm.schedule([a], [3])
    pm.commit(plan, [[1, 2, 3]]) if first == "commit" else pm.abort(plan)
    state = snapshot(pm)
    ended = "committed" if first == "commit" else "aborted"
    with pytest.raises(ValueError, match=rf"StepPlan\(mixed: 1 sequences, 3 new tokens, .*{ended}\) ended already "
                                         rf"\({ended}\); a plan ends once"):
        getattr(pm, second)(plan, [[1, 2, 3]]) if second == "commit" else getattr(pm, second)(plan)
    assert snapshot(pm) == state
    pm.check_invariants()


@pytest.mark.parametrize("call", ["commit", "abort", "check_plan"])
def test_a_plan_given_to_another_manager_is_refused_with_both_unchanged(call):
    pm, other = make(), make()
    [a] = pm.claim(1)
    [b] = other.claim(1)
    plan = pm.schedule([a], [2])
    before, theirs = snapshot(pm), snapshot(other)
    with pytest.raises(ValueError, match="was made by another PageManager"):
        getattr(other, call)(plan, [[1, 2]]) if call == "commit" else getattr(other, call)(plan)
    assert snapshot(pm) == before and snapshot(other) == theirs
    pm.commit(plan, [[1, 2]])
    assert pm.length(a) == 2


@pytest.mark.parametrize("call", ["commit", "abort", "check_plan"])
def test_something_else_than_a_plan_is_a_type_error(call):
    pm = make()
    [a] = pm.claim(1)
    with pytest.raises(TypeError, match="takes the StepPlan schedule or schedule_decode returned, got list"):
        getattr(pm, call)([a])


def test_an_aborted_plan_leaves_its_sequences_as_before_and_its_pages_free():
    pm = make()
    a, b = pm.claim(2)
    prefill(pm, a, [1, 2, 3, 4, 5])
    before = snapshot(pm)
    plan = pm.schedule([a, b], [7, 8])
    assert pm.metrics.free_pages == 10 - 3 - 2  # a: 12 tokens in 3 pages, b: 8 in 2
    pm.abort(plan)
    assert snapshot(pm) == before and pm.metrics.free_pages == 8
    pm.release(a)
    pm.release(b)
    pm.check_invariants()


def test_a_full_pool_refuses_the_plan_with_nothing_changed():
    pm = make(pages=4)
    a, b = pm.claim(2)
    prefill(pm, a, [1, 2, 3, 4, 5])  # 2 of 4 pages
    before = snapshot(pm)
    with pytest.raises(CacheFullError, match="the step needs 3 pages but only 2 are free or evictable"):
        pm.schedule([a, b], [7, 8])
    assert snapshot(pm) == before and not pm.has_pending_work


# ---- committing what was written --------------------------------------------------------------------
def test_a_mixed_commit_takes_fewer_tokens_than_planned_and_gives_the_rest_back():
    pm = make()
    [a] = pm.claim(1)
    plan = pm.schedule([a], [9])  # three pages reserved
    pm.commit(plan, [[1, 2, 3, 4, 5]])
    assert pm.length(a) == 5 and pm.pages(a) == [0, 1]
    assert pm.metrics.free_pages == 8
    pm.check_invariants()


def test_a_mixed_commit_without_ids_commits_the_plan_and_caches_nothing():
    pm = make()
    [a] = pm.claim(1)
    plan = pm.schedule([a], [8])
    pm.commit(plan)  # ids unknown: the full pages are not findable by content
    assert pm.length(a) == 8 and pm.metrics.cached_pages == 0
    [b] = pm.claim(1)
    assert pm.match_prefix(b, list(range(9))) == 0


def test_committed_ids_fill_the_prefix_cache_for_the_next_request():
    pm = make()
    a, b = pm.claim(2)
    plan = pm.schedule([a], [9])
    pm.commit(plan, [list(range(9))])
    assert pm.match_prefix(b, list(range(9)) + [5]) == 8
    assert pm.pages(b) == pm.pages(a)[:2]


@pytest.mark.parametrize(("token_ids", "num_tokens", "message"), [
    ([[1, 2, 3, 4]], None, r"token_ids\[0\] holds 4 ids but StepPlan\(.*\) planned 3 for sequence 0; commit at most"),
    ([[1, 2]], 2, r"num_tokens=2: StepPlan\(.*\) is a mixed step, committed whole"),
    ([[1, 2], [3]], None, "token_ids holds 2 entries for 1 sequences"),
    ([[-1]], None, r"token_ids\[0\]"),
    ("abc", None, "is not a list or array"),
])
def test_a_bad_mixed_commit_is_refused_with_the_plan_still_open(token_ids, num_tokens, message):
    pm = make()
    [a] = pm.claim(1)
    plan = pm.schedule([a], [3])
    before = snapshot(pm)
    with pytest.raises(ValueError, match=message):
        pm.commit(plan, token_ids, num_tokens)
    assert snapshot(pm) == before and plan.ended is None
    pm.commit(plan, [[1, 2, 3]])
    assert pm.length(a) == 3


def test_a_decode_plan_needs_the_ids_its_loop_wrote():
    pm = make()
    [a] = pm.claim(1)
    prefill(pm, a, [1, 2])
    plan = pm.schedule_decode([a], 2)
    with pytest.raises(ValueError, match=r"commits the ids its loop wrote: token_ids of shape \(1, 2\); abort"):
        pm.commit(plan)
    pm.abort(plan)
    assert pm.length(a) == 2 and pm.sequence(a).capacity == 4


def test_the_deprecated_decode_names_run_the_plan_and_warn():
    pm = make()
    [a] = pm.claim(1)
    prefill(pm, a, [1, 2])
    with pytest.warns(DeprecationWarning, match="PageManager.plan_decode is deprecated; use schedule_decode"):
        plan = pm.plan_decode([a], 2)
    assert isinstance(plan, StepPlan) and plan.form == "decode"
    with pytest.warns(DeprecationWarning, match="PageManager.commit_decode is deprecated"):
        pm.commit_decode(plan, np.zeros((1, 2), np.int64), 0)
    assert plan.ended == "aborted" and pm.length(a) == 2


@pytest.mark.parametrize("name", ["apply_pending", "check_cache", "check_host"])
def test_the_calls_that_took_a_cache_or_a_tier_name_their_new_home(name):
    pm = make()
    with pytest.raises(AttributeError, match=rf"PageManager.{name} moved out of the manager, which never sees a "
                                             "cache or a tier: use easykv"):
        getattr(pm, name)
    with pytest.raises(AttributeError, match="has no attribute 'nonsense'"):
        pm.nonsense  # noqa: B018


def test_take_work_hands_the_work_over_once():
    pm = make(scrub_released=True)
    [a] = pm.claim(1)
    prefill(pm, a, [1, 2, 3])
    pm.take_work()
    pm.release(a)
    assert pm.has_pending_work
    work = pm.take_work()
    assert isinstance(work, DeviceWork) and work.groups[0].scrubs.tolist() == [0]
    assert not pm.has_pending_work and pm.take_work().empty
