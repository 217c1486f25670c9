"""The demo engine on the runner (issue 43): a step that fails inside the engine's device call
ends its plan by the runner's abort, so every sequence stays usable, the pages the plan reserved
come back to the pool, and the engine goes on to generate what a dense cache does; a restored
checkpoint is taken only when it fits; the dense baseline shares the scheduler without a runner."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

import easykv
from easykv.demo.engine import DenseEngine, Engine, Request, reference_generate
from easykv.demo.model import CompiledModel, DemoConfig, DemoModel
from easykv.demo.workload import make_requests
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh

MAX_LEN = 192
CFG = DemoConfig(layers=2)


def setup(*, pages=96, batch=4, host_pages=None):
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, batch, CFG.layers, MAX_LEN, 8, CFG.kv_heads, CFG.head_dim, 0.9, jnp.float32, partition_manager=pm,
        num_pages_per_layer=pages)  # fmt: skip
    if host_pages:
        meta = meta.replace(host_pages_per_layer=host_pages)
    return easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm), easykv.PageManager(meta)


def pages(manager):
    m = manager.metrics
    return m.free_pages, m.used_pages, m.cached_pages


def fresh(requests):
    return [Request(rid=r.rid, prompt=list(r.prompt), max_new_tokens=r.max_new_tokens, arrival=r.arrival,
                    fork_of=r.fork_of) for r in requests]  # fmt: skip


@pytest.mark.parametrize("method, decode_steps, failing_call", [("paged_step", 1, 3), ("paged_decode", 4, 1)],
                         ids=["one-step", "device-loop"])  # fmt: skip
def test_a_step_that_fails_on_the_device_is_aborted_and_the_engine_goes_on(monkeypatch, method, decode_steps,
                                                                           failing_call):
    model = CompiledModel(DemoModel(CFG))
    cache, manager = setup()
    engine = Engine(model, cache, manager, token_budget=32, max_seqs=4, prefill_chunk=16, decode_steps=decode_steps)
    requests = make_requests(4, 8, seed=1)  # the last one forks the first: shared pages, a copy-on-write
    real_call, calls = getattr(model, method), []

    def fails_once(*args, **kwargs):
        calls.append(method)
        if len(calls) == failing_call:
            raise RuntimeError("the device step failed")
        return real_call(*args, **kwargs)

    # Every plan the engine makes, with the pages before it was scheduled and right after.
    plans = []

    def recorded(schedule):
        def call(*args, **kwargs):
            before = pages(manager)
            plan = schedule(*args, **kwargs)
            plans.append((plan, before, pages(manager)))
            return plan

        return call

    for name in ("schedule", "schedule_decode"):
        monkeypatch.setattr(manager, name, recorded(getattr(manager, name)))
    monkeypatch.setattr(model, method, fails_once)

    with pytest.raises(RuntimeError, match="the device step failed"):
        engine.run(requests)
    failed, before, scheduled = plans[-1]
    assert failed.ended == "aborted" and all(plan.ended == "committed" for plan, _, _ in plans[:-1])
    assert scheduled[0] < before[0]  # the failed plan had reserved pages ...
    assert pages(manager) == before  # ... and every one came back
    assert [manager.length(s) for s in failed.seq_ids] == failed.lengths.tolist()  # nothing it wrote counts
    manager.check_invariants()
    twin = manager.clone()  # each sequence of the failed step releases
    for seq in failed.seq_ids:
        twin.release(seq)
    twin.check_invariants()

    step_index = engine.step_index
    engine.run(requests)  # the failing call was the only one: the engine goes on from where it stopped
    assert engine.step_index > step_index and len(calls) > failing_call
    assert engine.copies >= 1  # the fork wrote into the page it shared
    for r in requests:
        assert r.output == reference_generate(model, r, max_len=MAX_LEN, dtype=jnp.float32), r.rid
    assert manager.metrics.used_pages == 0 and not manager.active_ids
    manager.check_invariants()


def test_restore_takes_a_cache_and_manager_of_one_pool_and_keeps_counting_copies():
    model = CompiledModel(DemoModel(CFG))
    cache, manager = setup()
    engine = Engine(model, cache, manager, token_budget=32, max_seqs=4, prefill_chunk=16)
    requests = make_requests(4, 8, seed=2)
    engine.run(requests, until_step=10)
    runner, copies = engine.runner, engine.copies
    assert copies >= 1  # the fork wrote into the page it shared

    other_cache, other_manager = setup(pages=64)
    with pytest.raises(ValueError, match="another pool than this manager's.*num_pages_per_layer: cache 64, manager 96"):
        engine.restore(other_cache, manager)
    assert engine.runner is runner and engine.manager is manager and engine.cache is runner.cache
    with pytest.raises(ValueError, match="the manager has no host-memory tier"):
        engine.restore(engine.cache, manager, host=object())
    assert engine.runner is runner and engine.copies == copies

    twin = manager.clone()
    engine.restore(engine.cache, twin)  # what the demo does with a checkpoint restored
    assert engine.manager is twin and engine.runner.manager is twin and engine.copies == copies
    engine.run(requests)
    for r in requests:
        assert r.output == reference_generate(model, r, max_len=MAX_LEN, dtype=jnp.float32), r.rid
    assert not twin.active_ids and manager.active_ids  # the first manager was left where it was


def test_an_engine_over_a_host_tier_manager_needs_the_tier():
    model = CompiledModel(DemoModel(CFG))
    cache, manager = setup(pages=40, host_pages=64)
    with pytest.raises(ValueError, match=r"host-memory tier: pass the cache's tier, host=easykv.HostTier\(cache\)"):
        Engine(model, cache, manager, token_budget=32, max_seqs=4, prefill_chunk=16)
    engine = Engine(model, cache, manager, token_budget=32, max_seqs=4, prefill_chunk=16, host=easykv.HostTier(cache))
    assert engine.host is engine.runner.host is not None


def dense_engine(model, manager, *, rows=4, max_len=MAX_LEN):
    shape = (CFG.layers, rows, max_len, CFG.kv_heads, CFG.head_dim)
    return DenseEngine(model, (jnp.zeros(shape), jnp.zeros(shape)), manager, token_budget=32, max_seqs=4,
                       prefill_chunk=16)  # fmt: skip


def test_the_dense_baseline_generates_what_the_paged_engine_does_without_pages_or_plans():
    model = CompiledModel(DemoModel(CFG))
    requests = make_requests(4, 6, seed=4, fork=False)
    paged, dense = fresh(requests), fresh(requests)
    cache, manager = setup()
    Engine(model, cache, manager, token_budget=32, max_seqs=4, prefill_chunk=16).run(paged)
    _, bookkeeping = setup()
    engine = dense_engine(model, bookkeeping)
    engine.run(dense)
    assert [r.output for r in dense] == [r.output for r in paged]
    assert all(len(r.output) == r.max_new_tokens for r in dense)
    assert all(h.used_pages == 0 for h in engine.history)  # its manager hands out sequence slots only
    assert not bookkeeping.active_ids


def test_the_dense_baseline_refuses_forks_a_small_cache_and_a_long_request_before_it_runs():
    model = CompiledModel(DemoModel(CFG))
    _, manager = setup()
    with pytest.raises(ValueError, match=r"rows >= the manager's batch_size=4"):
        dense_engine(model, manager, rows=3)
    engine = dense_engine(model, manager)
    requests = make_requests(3, 4, seed=1)  # the last one forks the first
    with pytest.raises(ValueError, match=r"requests \[2\] are forks, which the dense baseline does not run"):
        engine.run(requests)
    assert engine.step_index == 0 and not manager.active_ids and all(r.seq is None for r in requests)

    long = dataclasses.replace(make_requests(1, 4, seed=1, fork=False)[0], max_new_tokens=10)
    end = len(long.prompt) + 4  # room for the prompt and 4 generated tokens (the 5th is sampled, never written)
    short = dense_engine(model, manager, max_len=end)
    with pytest.raises(ValueError, match=rf"request 0 reaches position {end} but the dense cache holds max_len={end}"):
        short.run([long])
    assert len(long.output) == 5 and short.step_index == len(short.history)  # the refused step ran nothing
