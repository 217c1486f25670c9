"""The runner (issue 43): one engine loop that applies a plan to a cache — its device work, then the
caller's step, then the commit — and aborts the plan on any failure; everything it is given is
checked before anything moves.

Real tiny caches (one device, float32, page_size 4); page contents are read back to show a
copy-on-write the plan carried really reached the device. Every refusal is checked for its
message, for the manager's state and for the cache (neither donated nor written)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv import PageManager, Runner
from easykv.manager.step_plan import StepPlan
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh

PS, LAYERS, HEADS, DIM, MAX_LEN, PAD = 4, 2, 2, 8, 16, 8


def make(*, pages=8, host=None, scrub=False):
    mesh = create_mesh({"dp": 1, "tp": 1}, devices=jax.devices()[:1])
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp"))
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 4, LAYERS, MAX_LEN, PS, HEADS, DIM, 0.5, jnp.float32,
                                                     partition_manager=pm, num_pages_per_layer=pages)
    if host:
        meta = meta.replace(host_pages_per_layer=host)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    return cache, PageManager(meta, scrub_released=scrub)


def kv(tokens, start):
    """K/V of ``tokens`` at positions ``start ..``: a function of token and position, padded to PAD rows."""
    n = len(tokens)
    base = np.asarray(tokens, np.float32)[:, None, None] * 16 + (start + np.arange(n))[:, None, None]
    k = np.broadcast_to(base + np.arange(DIM) / 64, (n, HEADS, DIM)).astype(np.float32)
    k = np.stack([k + layer for layer in range(LAYERS)])
    pad = [(0, 0), (0, PAD - n), (0, 0), (0, 0)]
    return jnp.asarray(np.pad(k, pad)), jnp.asarray(np.pad(-k, pad))


def writer(tokens, start, calls=None):
    """A step that writes ``tokens`` of one sequence at ``start`` (counting its calls in ``calls``)."""

    def step(cache, plan):
        if calls is not None:
            calls.append(plan)
        k, v = kv(tokens, start)
        cache, _ = cache.write(k, v, plan.metadata)
        return cache, "wrote"

    return step


def page_rows(cache, page):
    """Layer 0, head 0's key rows of ``page`` (page_size x dim) as numpy."""
    return np.asarray(cache.key_pages[0][0, 0, page])


def test_run_applies_the_plans_copy_then_the_step_then_commits():
    cache, manager = make()
    runner = Runner(manager, cache)
    [a] = manager.claim(1)
    prompt = [3, 1, 4, 1, 5, 9]
    plan = manager.schedule([a], [6], pad_tokens_to=PAD)
    assert runner.run(plan, writer(prompt, 0), token_ids=[prompt]) == "wrote"
    assert plan.ended == "committed" and manager.length(a) == 6 and manager.pages(a) == [0, 1]
    child = manager.fork(a)
    plan = manager.schedule([child], [1], pad_tokens_to=PAD)  # a private copy of the shared page 1
    [work] = plan.work.groups
    assert work.copy_src.tolist() == [1] and work.copy_dst.tolist() == [2]
    runner.run(plan, writer([7], 6), token_ids=[[7]])
    rows = page_rows(runner.cache, 2)
    # the copy brought positions 4, 5 over (parent's), the step wrote position 6 (child's)
    np.testing.assert_array_equal(rows[:2], page_rows(runner.cache, 1)[:2])
    assert rows[2, 0] == 7 * 16 + 6 and not rows[3].any() and runner.copies == 1
    assert manager.length(child) == 7 and manager.pages(child) == [0, 2]
    manager.check_invariants()


def test_a_failing_step_aborts_the_plan_and_the_exception_goes_on():
    cache, manager = make()
    runner = Runner(manager, cache)
    a, b = manager.claim(2)
    plan = manager.schedule([a], [5], pad_tokens_to=PAD)
    runner.run(plan, writer([1, 2, 3, 4, 5], 0), token_ids=[[1, 2, 3, 4, 5]])
    before = manager.state_dict()

    def broken(cache, plan):
        raise RuntimeError("the model failed")

    plan = manager.schedule([a, b], [3, 4], pad_tokens_to=PAD)
    with pytest.raises(RuntimeError, match="the model failed"):
        runner.run(plan, broken, token_ids=[[1, 1, 1], [2, 2, 2, 2]])
    assert plan.ended == "aborted" and manager.state_dict() == before
    manager.release(a)
    manager.release(b)
    manager.check_invariants()
    assert manager.metrics.used_pages == 0


def test_a_refused_commit_aborts_the_plan_the_step_ran():
    cache, manager = make()
    runner = Runner(manager, cache)
    [a] = manager.claim(1)
    before = manager.state_dict()
    plan = manager.schedule([a], [2], pad_tokens_to=PAD)
    with pytest.raises(ValueError, match=r"token_ids\[0\] holds 3 ids but StepPlan"):
        runner.run(plan, writer([1, 2], 0), token_ids=[[1, 2, 3]])
    assert plan.ended == "aborted" and manager.state_dict() == before


def test_token_ids_and_counts_may_be_read_from_the_steps_output():
    cache, manager = make()
    runner = Runner(manager, cache)
    [a] = manager.claim(1)
    runner.run(manager.schedule([a], [2], pad_tokens_to=PAD), writer([1, 2], 0), token_ids=[[1, 2]])
    plan = manager.schedule_decode([a], 3)

    def loop(cache, plan):
        return cache, {"ids": np.array([[5, 6, 7]]), "count": np.array([2])}

    out = runner.run(plan, loop, token_ids=lambda out: out["ids"], num_tokens=lambda out: out["count"])
    assert out["count"].tolist() == [2] and manager.length(a) == 4 and plan.ended == "committed"


# ---- what the runner refuses, before anything moves ---------------------------------------------
def test_a_plan_of_another_manager_is_refused_before_its_work_runs():
    cache, manager = make()
    other_cache, other = make()
    runner = Runner(manager, cache)
    [a] = other.claim(1)
    plan = other.schedule([a], [2], pad_tokens_to=PAD)
    calls, before = [], other.state_dict()
    with pytest.raises(ValueError, match="was made by another PageManager; run a plan on the manager that made it"):
        runner.run(plan, writer([1, 2], 0, calls), token_ids=[[1, 2]])
    assert not calls and plan.ended is None and other.state_dict() == before
    assert not runner.cache.key_pages[0].is_deleted()  # not donated
    other.abort(plan)


def test_an_ended_plan_is_refused():
    cache, manager = make()
    runner = Runner(manager, cache)
    [a] = manager.claim(1)
    plan = manager.schedule([a], [2], pad_tokens_to=PAD)
    runner.run(plan, writer([1, 2], 0), token_ids=[[1, 2]])
    calls = []
    with pytest.raises(ValueError, match=r"ended already \(committed\)"):
        runner.run(plan, writer([1, 2], 0, calls), token_ids=[[1, 2]])
    assert not calls and manager.length(a) == 2


def test_a_cache_of_another_pool_is_refused():
    cache, manager = make(pages=8)
    other, _ = make(pages=12)
    [a] = manager.claim(1)
    runner = Runner(manager, cache)
    runner.run(manager.schedule([a], [2], pad_tokens_to=PAD), writer([1, 2], 0), token_ids=[[1, 2]])
    before = manager.state_dict()
    with pytest.raises(ValueError, match=r"the runner's cache is a cache of another pool than this manager's "
                                         r"\(num_pages_per_layer: cache 12, manager 8"):
        Runner(manager, other)
    with pytest.raises(ValueError, match="num_pages_per_layer: cache 12, manager 8"):
        runner.replace_cache(other)
    assert manager.state_dict() == before and runner.cache is not other
    assert not other.key_pages[0].is_deleted()  # not donated
    with pytest.raises(ValueError, match="the runner's cache must be the PagedAttentionCache of this manager's pool, "
                                         "got tuple"):
        Runner(manager, (1, 2))
    with pytest.raises(TypeError, match="manager must be a PageManager, got str"):
        Runner("manager", other)


def test_a_donated_cache_is_refused_and_replace_cache_checks_too():
    cache, manager = make()
    runner = Runner(manager, cache)
    [a] = manager.claim(1)
    runner.run(manager.schedule([a], [2], pad_tokens_to=PAD), writer([1, 2], 0), token_ids=[[1, 2]])
    assert cache.key_pages[0].is_deleted()  # the first cache was donated by the write
    with pytest.raises(ValueError, match="holds deleted arrays: it was donated to an earlier call"):
        Runner(manager, cache)
    with pytest.raises(ValueError, match="holds deleted arrays"):
        runner.replace_cache(cache)
    assert runner.cache is not cache and not runner.cache.key_pages[0].is_deleted()


def test_the_host_tier_is_required_exactly_when_the_manager_has_one():
    cache, manager = make(host=4)
    with pytest.raises(ValueError, match=r"the manager has a host-memory tier: pass the cache's tier, "
                                         r"host=easykv.HostTier\(cache\)"):
        Runner(manager, cache)
    with pytest.raises(ValueError, match=r"host= must be the easykv.HostTier of this cache .*got str"):
        Runner(manager, cache, host="tier")
    plain_cache, plain = make()
    with pytest.raises(ValueError, match="host= was given but the manager has no host-memory tier"):
        Runner(plain, plain_cache, host=easykv.HostTier(cache))


def test_a_tier_of_another_cache_or_bound_to_another_manager_is_refused():
    cache, manager = make(host=4)
    other_cache, _ = make(host=4, pages=12)  # a cache of one shape is told apart by the tier's binding (below)
    before = manager.state_dict(host_tier=True)
    with pytest.raises(ValueError, match=r"host= is the HostTier of another cache"):
        Runner(manager, cache, host=easykv.HostTier(other_cache))
    assert manager.state_dict(host_tier=True) == before
    tier = easykv.HostTier(cache)
    Runner(manager, cache, host=tier)  # binds the tier to this manager
    twin = manager.clone()
    before = twin.state_dict(host_tier=True)
    with pytest.raises(ValueError, match="host= is a HostTier bound to another PageManager"):
        Runner(twin, cache, host=tier)
    assert twin.state_dict(host_tier=True) == before


def test_apply_pending_runs_the_work_no_plan_took():
    cache, manager = make(scrub=True)
    runner = Runner(manager, cache)
    [a] = manager.claim(1)
    runner.run(manager.schedule([a], [3], pad_tokens_to=PAD), writer([1, 2, 3], 0), token_ids=[[1, 2, 3]])
    assert page_rows(runner.cache, 0)[0, 0] == 16
    manager.release(a)  # its partly filled page 0: zeroed by the next work
    assert manager.has_pending_work
    assert runner.apply_pending() == 0
    assert not manager.has_pending_work and not page_rows(runner.cache, 0).any()


def test_the_one_shot_apply_pending_returns_the_new_cache():
    cache, manager = make(scrub=True)
    [a] = manager.claim(1)
    plan = manager.schedule([a], [3], pad_tokens_to=PAD)
    k, v = kv([1, 2, 3], 0)
    cache, _ = cache.write(k, v, plan.metadata)
    manager.commit(plan, [[1, 2, 3]])
    manager.release(a)
    cache, copied = easykv.apply_pending(manager, cache)
    assert copied == 0 and not page_rows(cache, 0).any() and not manager.has_pending_work
    assert isinstance(plan, StepPlan)


def test_a_donated_cache_is_refused_before_the_manager_hands_its_work_over():
    cache, manager = make(scrub=True)
    runner = Runner(manager, cache)
    [a] = manager.claim(1)
    runner.run(manager.schedule([a], [3], pad_tokens_to=PAD), writer([1, 2, 3], 0), token_ids=[[1, 2, 3]])
    manager.release(a)
    before = manager.state_dict()
    with pytest.raises(ValueError, match="holds deleted arrays"):  # the first cache was donated by the write
        easykv.apply_pending(manager, cache)
    assert manager.state_dict() == before and manager.has_pending_work  # still pending: a retry applies it
    assert runner.apply_pending() == 0 and not manager.has_pending_work


def test_schedule_applies_the_plans_work_at_once_and_run_does_not_apply_it_again():
    cache, manager = make(scrub=True)
    runner = Runner(manager, cache)
    [a] = manager.claim(1)
    prompt = [3, 1, 4, 1, 5, 9]
    runner.run(manager.schedule([a], [6], pad_tokens_to=PAD), writer(prompt, 0), token_ids=[prompt])
    child = manager.fork(a)
    plan = runner.schedule([child], [1], pad_tokens_to=PAD)  # the copy 1 -> 2 runs now
    assert plan.work.copies()[1][0].tolist() == [2] and runner.copies == 1
    np.testing.assert_array_equal(page_rows(runner.cache, 2)[:2], page_rows(runner.cache, 1)[:2])
    runner.run(plan, writer([7], 6), token_ids=[[7]])
    assert runner.copies == 1 and manager.length(child) == 7  # not copied again (it would erase nothing, but cost)
    assert page_rows(runner.cache, 2)[2, 0] == 7 * 16 + 6


def test_a_step_that_returns_no_cache_is_refused_and_its_plan_aborted():
    cache, manager = make()
    runner = Runner(manager, cache)
    [a] = manager.claim(1)
    before = manager.state_dict()
    plan = manager.schedule([a], [2], pad_tokens_to=PAD)

    def swapped(cache, plan):  # (out, cache): the wrong order
        cache, _ = cache.write(*kv([1, 2], 0), plan.metadata)
        return "logits", cache

    with pytest.raises(TypeError, match="the step must return \\(cache, out\\) with the new PagedAttentionCache "
                                        "first, got str"):
        runner.run(plan, swapped, token_ids=[[1, 2]])
    assert plan.ended == "aborted" and manager.state_dict() == before


def test_a_dead_cache_leaves_the_next_plan_open_with_its_work():
    """A step that donated the cache and then failed leaves the runner a dead cache: the next plan's
    work (a fork's copy) is not lost on it; the plan stays open for a runner with a live cache."""
    cache, manager = make()
    runner = Runner(manager, cache)
    [a] = manager.claim(1)
    prompt = [3, 1, 4, 1, 5, 9]
    runner.run(manager.schedule([a], [6], pad_tokens_to=PAD), writer(prompt, 0), token_ids=[prompt])
    live = runner.cache
    saved = jax.tree.map(lambda x: np.asarray(x).copy(), (live.key_pages, live.value_pages))

    def donates_then_fails(cache, plan):
        cache.write(*kv([2], 6), plan.metadata)  # donates the runner's cache
        raise RuntimeError("the device failed")

    with pytest.raises(RuntimeError, match="the device failed"):
        runner.run(manager.schedule([a], [1], pad_tokens_to=PAD), donates_then_fails, token_ids=[[2]])
    child = manager.fork(a)
    plan = manager.schedule([child], [1], pad_tokens_to=PAD)  # takes the copy 1 -> 2
    with pytest.raises(ValueError, match="holds deleted arrays"):
        runner.run(plan, writer([7], 6), token_ids=[[7]])
    assert plan.ended is None and plan.work.num_copies == 1  # open, its copy still to run
    fresh = easykv.PagedAttentionCache(live.metadata, *jax.tree.map(jnp.asarray, saved), live.layout)
    runner.replace_cache(fresh)
    runner.run(plan, writer([7], 6), token_ids=[[7]])
    np.testing.assert_array_equal(page_rows(runner.cache, 2)[:2], page_rows(runner.cache, 1)[:2])


def test_a_manager_with_a_tier_the_runner_cannot_serve_is_refused():
    from tests.manager.test_lower_tier import DictStore

    cache, manager = make()
    stored = PageManager(manager.metadata, tiers=(lambda groups: DictStore(groups, 8),))
    assert stored.tier_names == ("store",)
    with pytest.raises(ValueError, match=r"the manager has the tiers \['store'\] below its device pool, whose "
                                         "transfers this runner cannot apply"):
        Runner(stored, cache)
