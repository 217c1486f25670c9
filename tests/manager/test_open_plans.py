"""An open decode plan freezes its sequences for every call that changes them (issue 42).

Every public member of `PageManager` is found by introspection (properties too) and classified
here: ``READ_ONLY`` is written out below, everything else counts as changing the manager, so a new
member lands in a test that fails until it is given a call here (and a declaration in
`easykv.manager.open_plans`, which must agree with this classification). Then, on a manager with
a host tier and an open plan over a running sequence and one not started yet: each call that
names sequences is refused for each planned one, with the state unchanged; each other call runs
while the plan is open and leaves the planned sequences as planned; each read-only member changes
nothing; and the plan's abort (committing no tokens) and both releases work after every one of
them. Copies of the manager (clone, a state round trip, a clone for another layout) hold no plan. The issue's
reproductions: a plan over a claimed, never-started sequence with ``max_tokens=0`` stranded by
``set_weight_version``, ``match_prefix`` or ``resume``, and a running sequence stranded with it; and
the attack's: an id given as a 0-d numpy or jax array, refused by the guard for every sequence
while any plan was open ("seq_ids must have 1 dimension(s)"), is now read as the call reads it.
The deprecated names are public members too: each is classified and guarded like the others, and
where one runs, its warning is expected (`planned_calls.warns_if_deprecated`)."""

from __future__ import annotations

import inspect
import types

import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv import PageManager
from easykv.errors import InvariantError
from easykv.manager.open_plans import CHANGES, READS
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh
from tests.manager.planned_calls import NAMED_CALLS, refusal, warns_if_deprecated
from tests.support.managers import make, prefill

READ_ONLY = frozenset({
    "active_ids", "cache_length", "cached_prefix_length", "capacity", "check_invariants", "check_plan",
    "clone", "contains", "estimated_memory_size", "first_kept_position", "from_state_dict", "has_host_tier",
    "has_pending_transfers", "has_pending_work", "increment_cache_lengths", "infer_optimal_batch_size",
    "is_swapped", "length", "lockstep_state", "metrics", "num_groups", "page_table", "pages", "pending_copies",
    "pending_scrubs", "pending_transfers", "replica", "reshard", "sequence", "slots_remaining", "state_dict",
    "swapped_ids", "tier_names", "usage", "weight_version", "prompt_digests", "admission_replica",
})
# Calls that change the manager but no sequence they are given: run while the plan is open.
OTHER_CALLS = {
    "claim": lambda env: env.m.claim(1),
    "external_claim": lambda env: env.m.external_claim([max(env.m.slots_remaining)]),
    "reset_prefix_cache": lambda env: env.m.reset_prefix_cache(),
    "take_copies": lambda env: env.m.take_copies(),
    "take_scrubs": lambda env: env.m.take_scrubs(),
    "take_transfers": lambda env: env.m.take_transfers(),
    "take_work": lambda env: env.m.take_work(),
    "attach_host_tier": lambda env: env.m.attach_host_tier(env.tier.token, env.tier.owner),
    "forget_host_tier": lambda env: (env.apply(), env.m.forget_host_tier()),
    "adopt_host_prefixes": lambda env: env.m.adopt_host_prefixes(env.m.prompt_digests(list(range(40, 58)))),
    "watch_prefixes": lambda env: env.m.watch_prefixes(written=True, host_evicted=True),
    "take_prefix_events": lambda env: (env.m.watch_prefixes(written=True, host_evicted=False),
                                       env.m.take_prefix_events()),
}
ENDS_THE_PLAN = {"commit", "abort", "commit_decode"}  # the plan's own end: every test below ends with one
UNSTARTED = "set_weight_version"  # changes the sequences not started yet: its own tests below
READ_CALLS = {
    "active_ids": lambda env: env.m.active_ids,
    "cache_length": lambda env: env.m.cache_length(env.p),
    "cached_prefix_length": lambda env: env.m.cached_prefix_length([1, 2, 3, 4, 5, 6]),
    "prompt_digests": lambda env: env.m.prompt_digests([1, 2, 3, 4, 5, 6]),
    "admission_replica": lambda env: env.m.admission_replica,
    "capacity": lambda env: env.m.capacity(env.p),
    "check_invariants": lambda env: env.m.check_invariants(),
    "check_plan": lambda env: env.m.check_plan(env.plan),
    "clone": lambda env: env.m.clone(),
    "contains": lambda env: env.m.contains(env.w),
    "estimated_memory_size": lambda env: env.m.estimated_memory_size(env.m.metadata, 1 << 30),
    "first_kept_position": lambda env: env.m.first_kept_position(env.p),
    "from_state_dict": lambda env: PageManager.from_state_dict(env.m.metadata, env.m.state_dict()),
    "has_host_tier": lambda env: env.m.has_host_tier,
    "has_pending_transfers": lambda env: env.m.has_pending_transfers(),
    "has_pending_work": lambda env: env.m.has_pending_work,
    "increment_cache_lengths": lambda env: env.m.increment_cache_lengths(env.plan.metadata),
    "infer_optimal_batch_size": lambda env: env.m.infer_optimal_batch_size(env.m.metadata, 1 << 30),
    "is_swapped": lambda env: env.m.is_swapped(env.p),
    "length": lambda env: env.m.length(env.p),
    "lockstep_state": lambda env: env.m.lockstep_state(),
    "metrics": lambda env: env.m.metrics,
    "num_groups": lambda env: env.m.num_groups,
    "page_table": lambda env: env.m.page_table([env.p, env.w]),
    "pages": lambda env: env.m.pages(env.p),
    "pending_copies": lambda env: env.m.pending_copies(),
    "pending_scrubs": lambda env: env.m.pending_scrubs(),
    "pending_transfers": lambda env: env.m.pending_transfers(),
    "replica": lambda env: env.m.replica(env.p),
    "reshard": lambda env: env.m.reshard(env.m.metadata),
    "sequence": lambda env: env.m.sequence(env.p),
    "slots_remaining": lambda env: env.m.slots_remaining,
    "state_dict": lambda env: env.m.state_dict(),
    "swapped_ids": lambda env: env.m.swapped_ids,
    "usage": lambda env: env.m.usage,
    "weight_version": lambda env: env.m.weight_version,
    "tier_names": lambda env: env.m.tier_names,
}


def public_members() -> set[str]:
    return {name for name, _ in inspect.getmembers(PageManager) if not name.startswith("_")}


def planned_env():
    """A manager with a host tier and its cache: ``p`` running (6 tokens), ``w`` claimed and never
    started, ``o`` running outside the plan; the plan over ``[p, w]`` (``max_tokens=[3, 0]``: a page more for ``p``)
    opened, then, while it is open, pending work made by other sequences (a fork's copy, a
    release's scrubs)."""
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 8, 2, 32, 4, 8, 8, 0.5, jnp.float32, partition_manager=pm,
                                                     num_pages_per_layer=24).replace(host_pages_per_layer=16)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    m = PageManager(meta, scrub_released=True)
    env = types.SimpleNamespace(m=m, cache=cache, tier=easykv.HostTier(cache))
    p, w, o, gone = m.claim(4)
    prefill(m, p, [1, 2, 3, 4, 5, 6])
    prefill(m, o, [1, 2, 3, 4, 9, 9])
    prefill(m, gone, [7, 7, 7, 7, 7])

    def apply():
        env.cache, _ = easykv.apply_pending(m, env.cache, host=env.tier)

    env.apply = apply
    apply()
    env.plan = m.schedule_decode([p, w], 3, max_tokens=[3, 0])
    assert m.sequence(p).capacity == 12
    child = m.fork(o)
    m.truncate(child, 5)  # ends inside o's partly filled page: a copy of it, pending
    m.release(gone)  # its partly filled page: a pending scrub
    env.p, env.w, env.o, env.child = p, w, o, child
    return env


def planned_rows(env):
    return [s for s in env.m.state_dict(host_tier=True)["sequences"] if s["id"] in env.plan.seq_ids]


def end_plan_and_release(env):
    """The abort (committing no tokens) ends the plan; both its sequences then release."""
    m = env.m
    m.abort(env.plan)
    assert env.plan.committed and m.metrics.open_plans == 0
    assert m.sequence(env.p).capacity == 8 and m.length(env.p) == 6  # what the plan reserved went back
    m.check_invariants()
    for seq in env.plan.seq_ids:
        m.release(seq)
    m.check_invariants()


def test_every_public_member_is_read_only_here_or_has_a_call_and_the_declarations_agree():
    members = public_members()
    assert {"metrics", "usage", "active_ids", "slots_remaining", "weight_version"} <= members  # properties too
    mutating = members - READ_ONLY
    covered = set(NAMED_CALLS) | set(OTHER_CALLS) | ENDS_THE_PLAN | {UNSTARTED}
    assert not mutating - covered, f"write a call for {sorted(mutating - covered)} in this test (or planned_calls.py)"
    assert not covered - mutating and not READ_ONLY - members, "a call here for a member that is gone"
    assert set(READ_CALLS) == READ_ONLY
    # The guard's declarations cover every member and say what this test says.
    assert set(CHANGES) == members
    assert {name for name in members if CHANGES[name] == READS} == READ_ONLY
    assert {name for name in members if CHANGES[name].arg} == set(NAMED_CALLS)


@pytest.mark.parametrize("name", sorted(NAMED_CALLS))
def test_a_call_that_would_change_a_planned_sequence_is_refused_with_nothing_changed(name):
    env = planned_env()
    m = env.m
    for seq in env.plan.seq_ids:  # the running one and the one never started (refused before a deprecated name warns)
        before, state = m.state_dict(host_tier=True), m.state_dict()
        with pytest.raises(ValueError, match=refusal(name, seq, env.plan.seq_ids)):
            NAMED_CALLS[name](m, [env.o, seq])
        assert m.state_dict(host_tier=True) == before and m.state_dict() == state
        m.check_invariants()
    end_plan_and_release(env)


@pytest.mark.parametrize("name", sorted(OTHER_CALLS))
def test_a_call_that_changes_no_planned_sequence_runs_while_the_plan_is_open_and_leaves_it_as_planned(name):
    env = planned_env()
    rows = planned_rows(env)
    with warns_if_deprecated(name):
        OTHER_CALLS[name](env)
    assert planned_rows(env) == rows
    env.m.check_invariants()
    end_plan_and_release(env)


@pytest.mark.parametrize("name", sorted(READ_ONLY))
def test_a_read_only_member_changes_nothing_while_a_plan_is_open(name):
    env = planned_env()
    before = env.m.state_dict(host_tier=True)
    assert before["copies"] and before["pool"]["scrub"]  # the state holds the pending work: unchanged too
    with warns_if_deprecated(name):
        READ_CALLS[name](env)
    assert env.m.state_dict(host_tier=True) == before
    end_plan_and_release(env)


# ---- set_weight_version: plans over running sequences never block it ----------------------------
def test_a_weight_update_waits_for_a_plan_that_holds_a_sequence_not_started_yet():
    env = planned_env()
    m = env.m
    before = m.state_dict()
    assert (env.p, env.w) == (0, 1)
    with pytest.raises(ValueError, match=r"set_weight_version\(\) would change sequence 1 \(claimed but not started: "
                                         r"it would start under the new version; running sequences keep theirs, so "
                                         r"plans over them never block a weight update\), which open plan #4 "
                                         r"holds \(sequences \[0, 1\]"):
        m.set_weight_version("v2")
    assert m.state_dict() == before and m.weight_version is None
    m.set_weight_version(None)  # the current version again changes nothing: accepted
    end_plan_and_release(env)
    m.set_weight_version("v2")  # once the plan ended


def test_a_weight_update_while_a_plan_over_running_sequences_is_open_is_the_rl_case_and_runs():
    """An RL trainer pushes weights while rollouts decode: the plan's sequences keep the version
    they started under and commit as planned; a sequence claimed meanwhile takes the new one."""
    m = make(batch=4, pages=12, max_len=32)
    m.set_weight_version("v1")
    a, b, waiting = m.claim(3)
    prefill(m, a, [1, 2, 3, 4, 5])
    prefill(m, b, [6, 7, 8])
    plan = m.schedule_decode([a, b], 4, max_tokens=[4, 2])
    m.set_weight_version("v2")
    m.commit(plan, np.arange(8).reshape(2, 4), [4, 2])
    assert (m.length(a), m.length(b)) == (9, 5)
    versions = {s["id"]: s.get("version") for s in m.state_dict()["sequences"]}
    assert versions[a] == versions[b] != versions[waiting]  # running: v1; not started: v2
    [late] = m.claim(1)
    assert m.cached_prefix_length([1, 2, 3, 4, 5, 0]) == 0  # v1's pages serve no v2 prompt
    prefill(m, late, [1, 2, 3, 4, 5, 0])
    assert {s["id"]: s.get("version") for s in m.state_dict()["sequences"]}[late] == versions[waiting]
    m.check_invariants()


# ---- the issue's reproductions ------------------------------------------------------------------------
@pytest.mark.parametrize("change", ["set_weight_version", "match_prefix", "resume"])
def test_issue_42_a_plan_over_a_sequence_never_started_is_not_stranded(change):
    """``plan_decode`` (now `schedule_decode`) over a claimed, never-started sequence with
    ``max_tokens=0`` reserves nothing; the calls that changed it behind the plan are refused, and the
    plan ends and its sequences release (before: the call went through, then commit_decode refused
    the plan, also with num_tokens=0, and release refused each sequence)."""
    m = make(batch=4, pages=10, max_len=32)
    running, waiting = m.claim(2)
    prefill(m, running, [1, 2, 3, 4, 5])
    plan = m.schedule_decode([running, waiting], 4, max_tokens=[4, 0])  # the RL batch: [running, waiting]
    call = {"set_weight_version": lambda: m.set_weight_version(1),
            "match_prefix": lambda: m.match_prefix(waiting, [1, 2, 3, 4, 5, 6]),
            "resume": lambda: m.resume(waiting, 0)}[change]
    before = m.state_dict()
    with pytest.raises(ValueError, match=rf"{change}\(\) would change sequence {waiting}\b.*open plan #2 "
                                         rf"holds \(sequences \[{running}, {waiting}\]"):
        call()
    assert m.state_dict() == before
    m.abort(plan)
    assert m.sequence(running).capacity == 8  # its reserved page went back
    m.release(running)
    m.release(waiting)
    m.check_invariants()
    assert m.metrics.used_pages == 0


def test_copies_of_a_manager_with_an_open_plan_hold_no_plan_and_the_original_still_commits():
    env = planned_env()
    m = env.m
    env.apply()  # a state holds no pending transfers
    for copy in (m.clone(), PageManager.from_state_dict(m.metadata, m.state_dict()), m.clone(m.metadata)):
        # the plan's reserved page: reserved room there
        assert copy.sequence(env.p).capacity == m.sequence(env.p).capacity == 12
        copy.commit(copy.schedule([env.p], [2]))
        copy.set_weight_version("v2")  # nothing is planned there
        copy.release(env.w)
        copy.release(env.p)
        copy.check_invariants()
    m.commit(env.plan, np.full((2, 3), 3, np.int64), [3, 0])
    assert m.length(env.p) == 9 and m.sequence(env.p).capacity == 12
    m.check_invariants()


def test_check_invariants_holds_the_open_plans_to_the_rows_they_hold():
    m = make(batch=4, pages=10, max_len=32)
    a, b = m.claim(2)
    prefill(m, a, [1, 2, 3])
    m.schedule_decode([a, b], 2, max_tokens=[2, 0])
    m.check_invariants()
    m._seqs.plan_of[b] = 0  # broken on purpose (no public call can): the table's two records of the plan disagree
    with pytest.raises(InvariantError, match="the plans disagree with the rows they hold"):
        m.check_invariants()


# ---- an id is read by the guard as the call reads it (issue 42 attack) -------------------------------
SCALAR_IDS = {"numpy": np.array, "numpy-int": np.int64, "jax": lambda s: jnp.arange(8)[s]}
# One id where the call takes one or a list (the deprecated wrappers' forms).
ONE_ID_CALLS = {"reserve(one id)": lambda m, seqs: m.reserve(seqs[-1], 1),
                "advance(one id)": lambda m, seqs: m.advance(seqs[-1], 0)}


def outcome(call):
    """``("ran", result)`` or the error's type and message."""
    try:
        return "ran", call()
    except Exception as err:  # noqa: BLE001  compared whole: type and message
        return type(err), str(err)


def test_issue_42_a_call_naming_another_sequence_by_a_numpy_or_jax_scalar_runs_while_a_plan_is_open():
    """The attack's reproduction: with a plan open over ``a``, ``release(jnp.arange(4)[b])`` raised
    "seq_ids must have 1 dimension(s), got shape ()" (the guard read every id but a Python or numpy
    int as a list); ``reserve`` (deprecated now) refused a jax scalar even with no plan open."""
    m = make(batch=4, pages=20, max_len=32)
    a, b = m.claim(2)
    prefill(m, a, [1, 2, 3, 4, 5])
    prefill(m, b, [1, 2, 3])
    plan = m.schedule_decode([a], 2)
    m.commit(m.schedule([jnp.arange(4)[b]], 1), [[8]])
    with warns_if_deprecated("reserve"):
        m.reserve(jnp.arange(4)[b], 1)
    with warns_if_deprecated("append_tokens"):
        m.append_tokens(jnp.arange(4)[b], [9])
    assert m.length(b) == 5
    m.truncate(np.array(b), 1)
    m.release(jnp.arange(4)[b])
    assert m.active_ids == [a]
    m.commit(plan, [[1, 1]], 2)
    m.check_invariants()


@pytest.mark.parametrize("form", sorted(SCALAR_IDS))
@pytest.mark.parametrize("name", sorted({**NAMED_CALLS, **ONE_ID_CALLS}))
def test_a_numpy_or_jax_scalar_id_is_refused_for_a_planned_sequence_and_read_as_its_int_for_another(name, form):
    """Every call that names sequences, given 0-d numpy or jax ids while a plan is open: a planned
    sequence is refused by the plan (the state unchanged); another gets exactly what the same call
    with Python ints gets (run on a twin manager), and runs where the call can."""
    call, to = {**NAMED_CALLS, **ONE_ID_CALLS}[name], SCALAR_IDS[form]
    env, twin = planned_env(), planned_env()
    m = env.m
    for seq in env.plan.seq_ids:
        state = m.state_dict()
        with pytest.raises(ValueError, match=refusal(name.split("(")[0], seq, env.plan.seq_ids)):
            call(m, [to(env.o), to(seq)])
        assert m.state_dict() == state
    # the running sequence outside the plan (its pending copy applied); a fresh one for the calls that
    # start a sequence
    env.apply()
    twin.apply()
    other = [m.claim(1)[0], twin.m.claim(1)[0]] if name in ("match_prefix", "resume") else [env.o, twin.o]
    with warns_if_deprecated(name):
        got = outcome(lambda: call(m, [to(other[0])]))
    with warns_if_deprecated(name):
        want = outcome(lambda: call(twin.m, [other[1]]))
    assert got[0] == want[0] and (got[0] == "ran" or got == want)
    assert m.state_dict(host_tier=True) == twin.m.state_dict(host_tier=True)
    assert got[0] == "ran" or name == "swap_in" and "is not swapped out" in got[1], got
    if name in ("plan_decode", "schedule", "schedule_decode"):  # its own plan, over the other sequence
        m.abort(got[1])
    end_plan_and_release(env)
