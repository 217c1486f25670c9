"""Multi-step decode on the device (`easykv.step.loop.decode_loop`) through the demo model: a k-step
engine generates exactly what the one-step engine and a dense per-request cache generate (sliding
windows, scanned layers, forks, int8 pages, weight versions, the host tier); a row stops at its
end-of-sequence token or its limit and what it did not write goes back; bad input is refused."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv.demo.engine import Engine, Request, reference_disagreements, reference_generate
from easykv.demo.model import CompiledModel, DemoConfig, DemoModel
from easykv.demo.workload import make_requests
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh
from easykv.step.loop import decode_loop, greedy, with_temperature

SLOW = pytest.mark.slow
MAX_LEN = 192
UNIFORM = DemoConfig(layers=2)
HYBRID = DemoConfig(layers=2, pattern="SF", window=16, scan=True)


def setup(cfg, *, pages=96, batch=4, quantizer=None, host_pages=None):
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    groups = cfg.layer_groups()
    if groups is not None:
        groups = tuple(dataclasses.replace(g, num_pages=pages) for g in groups)
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, batch, cfg.layers, MAX_LEN, 8, cfg.kv_heads, cfg.head_dim, 0.9, jnp.float32, partition_manager=pm,
        num_pages_per_layer=pages if groups is None else None, layer_groups=groups, quantizer=quantizer)
    if host_pages:
        meta = meta.replace(host_pages_per_layer=host_pages)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm, quantizer=quantizer)
    return cache, easykv.PageManager(meta)


def run_engine(model, cfg, requests, k, **kw):
    host_pages = kw.pop("host_pages", None)
    cache, manager = setup(cfg, host_pages=host_pages, **kw)
    host = easykv.HostTier(cache) if host_pages else None
    engine = Engine(model, cache, manager, token_budget=32, max_seqs=4, prefill_chunk=16, decode_steps=k, host=host)
    engine.run(requests)
    return engine


def fresh(requests):
    return [Request(rid=r.rid, prompt=list(r.prompt), max_new_tokens=r.max_new_tokens, arrival=r.arrival,
                    fork_of=r.fork_of) for r in requests]  # fmt: skip


@pytest.mark.parametrize("cfg, k", [(UNIFORM, 4), (HYBRID, 8)], ids=["full-k4", "sliding-scanned-k8"])
def test_a_k_step_engine_generates_what_the_one_step_engine_and_a_dense_cache_do(cfg, k):
    model = CompiledModel(DemoModel(cfg))
    requests = make_requests(6, 20, seed=5)  # the last one forks the first
    one, many = fresh(requests), fresh(requests)
    e1, ek = run_engine(model, cfg, one, 1), run_engine(model, cfg, many, k)
    assert [r.output for r in many] == [r.output for r in one]
    assert all(len(r.output) == r.max_new_tokens for r in many)
    assert len(ek.history) < len(e1.history)  # fewer host round trips
    m1, mk = e1.manager.metrics, ek.manager.metrics
    assert (mk.prefix_hits, mk.prefix_hit_tokens, mk.cached_pages, mk.used_pages) == \
        (m1.prefix_hits, m1.prefix_hit_tokens, m1.cached_pages, m1.used_pages)  # fmt: skip
    ek.manager.check_invariants()
    for r in many:
        assert r.output == reference_generate(model, r, max_len=MAX_LEN, dtype=jnp.float32), r.rid


def _prefilled(cfg, prompts, *, pages=96):
    """A cache, manager and model with ``prompts`` prefilled; the first sampled token of each."""
    model = CompiledModel(DemoModel(cfg))
    cache, m = setup(cfg, pages=pages)
    seqs = m.claim(len(prompts))
    plan = m.schedule(seqs, [len(p) for p in prompts], pad_tokens_to=32, pad_seqs_to=4)
    tokens = np.zeros(32, np.int32)
    flat = [t for p in prompts for t in p]
    tokens[: len(flat)] = flat

    def prefill(cache, plan):
        logits, cache = model.paged_step(cache, jnp.asarray(tokens), plan.metadata)
        return cache, logits

    runner = easykv.Runner(m, cache)
    logits = runner.run(plan, prefill, token_ids=prompts)
    ends = np.cumsum([len(p) for p in prompts]) - 1
    return model, runner.cache, m, seqs, np.argmax(np.asarray(logits)[ends], -1).astype(np.int32)


def _loop(model, cache, m, seqs, first, k, limits, eos_id=None):
    """The device loop of ``k`` decode steps of ``seqs``; its open plan (the caller commits) and the loop's output."""
    runner = easykv.Runner(m, cache)
    plan = runner.schedule_decode(seqs, k, pad_seqs_to=4)  # its device work applied before the loop writes
    tokens = np.zeros(4, np.int32)
    tokens[: len(seqs)] = first
    out = model.paged_decode(runner.cache, jnp.asarray(tokens), plan, jnp.asarray(limits, jnp.int32), eos_id=eos_id)
    return plan, out


def test_a_row_stops_at_its_end_token_and_gives_back_the_pages_it_did_not_write():
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
    model, cache, m, seqs, first = _prefilled(UNIFORM, prompts)
    free_before = m.metrics.free_pages
    plan, out = _loop(model, cache, m, seqs, first, 12, [12, 12, 0, 0])
    free_greedy = np.asarray(out.sampled)
    m.abort(plan)  # only its sampled tokens are kept
    # the same run again, with row 0's third sampled token as the end token
    model, cache, m, seqs, first = _prefilled(UNIFORM, prompts)
    eos = int(free_greedy[0, 2])
    hit = [int(np.argmax(free_greedy[r] == eos)) if (free_greedy[r] == eos).any() else 12 for r in range(2)]
    plan, out = _loop(model, cache, m, seqs, first, 12, [12, 12, 0, 0], eos_id=eos)
    counts = np.asarray(out.num_written)
    assert counts.tolist() == [hit[0] + 1, min(hit[1] + 1, 12), 0, 0]
    for r in range(2):  # the tokens up to the stop are the greedy ones; the end token is sampled, not written
        np.testing.assert_array_equal(np.asarray(out.sampled)[r, : counts[r]], free_greedy[r, : counts[r]])
        np.testing.assert_array_equal(np.asarray(out.written)[r, 1 : counts[r]], free_greedy[r, : counts[r] - 1])
    assert int(out.steps) == max(counts)
    m.commit(plan, out.written, out.num_written)
    assert [m.length(s) for s in seqs] == [len(p) + c for p, c in zip(prompts, counts[:2])]
    assert m.metrics.free_pages == free_before - sum(-(-m.length(s) // 8) - -(-len(p) // 8)
                                                     for s, p in zip(seqs, prompts))  # fmt: skip
    m.check_invariants()


def test_rows_with_no_limit_write_nothing_and_the_loop_ends_when_every_row_stopped():
    model, cache, m, seqs, first = _prefilled(UNIFORM, [[1, 2, 3], [4, 5, 6, 7]])
    pages = [m.pages(s) for s in seqs]
    plan, out = _loop(model, cache, m, seqs, first, 16, [3, 0, 0, 0])
    assert np.asarray(out.num_written).tolist() == [3, 0, 0, 0] and int(out.steps) == 3
    m.commit(plan, out.written, out.num_written)
    assert [m.length(s) for s in seqs] == [6, 4] and m.pages(seqs[1]) == pages[1]
    assert m.pages(seqs[0]) == pages[0]  # 6 tokens still fit the first page of 8


def test_a_sampled_loop_is_reproducible_by_its_key_and_stays_in_the_vocabulary():
    import jax

    sample = with_temperature(0.7)
    logits = jnp.log(jnp.asarray([[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]]))
    (a, la), (b, lb) = sample(logits, jax.random.key(3)), sample(logits, jax.random.key(3))
    np.testing.assert_array_equal(la, lb)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == jnp.int32 and set(np.asarray(a).tolist()) <= {0, 1, 2}
    scaled = np.log(np.asarray([[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]])) / 0.7
    expected = scaled - np.log(np.exp(scaled).sum(-1, keepdims=True))
    np.testing.assert_allclose(la, expected[[0, 1], np.asarray(a)], rtol=1e-5)
    tokens, logp = greedy(logits, jax.random.key(0))
    np.testing.assert_array_equal(tokens, [2, 0])
    np.testing.assert_allclose(logp, np.log([0.7, 0.5]), rtol=1e-5)


@pytest.mark.parametrize("bad", [0, -1.0, True, "1", float("nan")])
def test_with_temperature_refuses_what_is_not_a_positive_number(bad):
    with pytest.raises(ValueError, match=f"temperature={bad!r}"):
        with_temperature(bad)


def test_decode_loop_refuses_steps_shapes_and_metadata_it_cannot_run():
    _, cache, m, seqs, first = _prefilled(UNIFORM, [[1, 2, 3]])
    plan = m.schedule_decode(seqs, 2, pad_seqs_to=4)
    step = lambda state, tokens, md: (jnp.zeros((4, 8)), state)  # noqa: E731
    args = dict(page_size=plan.page_size, num_pages=plan.num_pages)
    ok = (jnp.zeros(4, jnp.int32), plan.metadata)
    with pytest.raises(ValueError, match=r"num_steps must be a positive int, got 0 \(valid: 1\.\.192"):
        decode_loop(step, cache, *ok, num_steps=0, limits=jnp.ones(4, jnp.int32), **args)
    with pytest.raises(ValueError, match=r"tokens has shape \(3,\); pass \(4,\): one per row of the plan"):
        decode_loop(step, cache, jnp.zeros(3, jnp.int32), plan.metadata, num_steps=2, limits=jnp.ones(4), **args)
    with pytest.raises(ValueError, match=r"pass a tuple of 1 step metadata.*got a tuple of 2"):
        decode_loop(step, cache, ok[0], plan.metadata * 2, num_steps=2, limits=jnp.ones(4), **args)
    with pytest.raises(ValueError, match=r"pass a tuple of 1 step metadata, one RaggedStep per group.*or the one step "
                                         r"bare\), got a tuple of 1: dict"):
        decode_loop(step, cache, ok[0], ({"page_table": 1},), num_steps=2, limits=jnp.ones(4), **args)
    # EasyDeL's decode form is no ragged step: the loop derives each next step from the ragged form alone
    easydel_decode = easykv.PagedAttentionMetadata.for_decode(np.asarray(plan.metadata[0].page_table), [3, -1, -1, -1],
                                                              cache_metadata=cache.metadata)
    with pytest.raises(ValueError, match=r"one RaggedStep per group .*got PagedAttentionMetadata$"):
        decode_loop(step, cache, ok[0], easydel_decode, num_steps=2, limits=jnp.ones(4), **args)
    with pytest.raises(ValueError, match=r"pass a tuple of 1 step metadata.*got list"):
        decode_loop(step, cache, ok[0], list(plan.metadata), num_steps=2, limits=jnp.ones(4), **args)
    out = decode_loop(step, cache, *ok, num_steps=2, limits=jnp.asarray([2, 0, 0, 0]), **args)
    assert np.asarray(out.num_written).tolist() == [2, 0, 0, 0]  # the constant step samples token 0 twice
    assert np.asarray(out.sampled)[0].tolist() == [0, 0]
    m.abort(plan)  # the constant step wrote no page


def test_decode_loop_takes_a_one_group_cache_s_metadata_bare_or_as_its_one_tuple():
    """Issue 42: the argument check let one bare `PagedAttentionMetadata` through for a one-group
    cache, then the loop indexed it (TypeError: not subscriptable). Both forms now run the same
    loop, and the step function gets the one-tuple either way."""
    _, cache, m, seqs, first = _prefilled(UNIFORM, [[1, 2, 3], [4, 5]])
    plan = m.schedule_decode(seqs, 3, pad_seqs_to=4)
    seen = []

    def step(state, tokens, md):
        seen.append((type(md), len(md), md[0].positions.shape))
        return jnp.zeros((4, 8)).at[:, 5].set(1.0), state  # always samples token 5

    args = dict(num_steps=3, page_size=plan.page_size, num_pages=plan.num_pages, limits=jnp.asarray([3, 2, 0, 0]))
    tokens = jnp.asarray([*first, 0, 0], jnp.int32)
    (bare,) = plan.metadata
    outs = [decode_loop(step, cache, tokens, md, **args) for md in (plan.metadata, bare)]
    for field in ("written", "sampled", "num_written", "steps"):
        np.testing.assert_array_equal(np.asarray(getattr(outs[0], field)), np.asarray(getattr(outs[1], field)))
    assert np.asarray(outs[1].num_written).tolist() == [3, 2, 0, 0]
    assert np.asarray(outs[1].written)[0].tolist() == [int(first[0]), 5, 5]
    assert seen[0] == seen[1] and seen[0][:2] == (tuple, 1)  # traced once per form, each a one-tuple
    m.commit(plan, outs[1].written, outs[1].num_written)
    assert [m.length(s) for s in seqs] == [6, 4]


@SLOW
def test_int8_pages_and_a_weight_update_between_k_step_rounds_match_the_dense_reference():
    from easykv.quantization import get_quantizer

    q = get_quantizer("int8")
    cfg = UNIFORM
    model = CompiledModel(DemoModel(cfg))
    cache, manager = setup(cfg, quantizer=q)
    for version, seed in ((0, 1), (1, 2)):
        manager.set_weight_version(version)
        requests = make_requests(5, 16, seed=seed)
        engine = Engine(model, cache, manager, token_budget=32, max_seqs=4, prefill_chunk=16, decode_steps=6)
        engine.run(requests)
        cache = engine.cache
        for r in requests:
            assert not reference_disagreements(model, r, max_len=MAX_LEN, dtype=jnp.float32, quantizer=q), r.rid
        model = CompiledModel(DemoModel(DemoConfig(layers=2, seed=7)))  # new weights: no stale prefix may serve them
    manager.check_invariants()


@SLOW
def test_a_k_step_engine_with_a_host_tier_preempts_and_matches_the_dense_reference():
    cfg = UNIFORM
    model = CompiledModel(DemoModel(cfg))
    requests = make_requests(6, 24, seed=3)
    engine = run_engine(model, cfg, requests, 8, pages=40, host_pages=128)
    assert engine.preemptions >= 1
    for r in requests:
        assert r.output == reference_generate(model, r, max_len=MAX_LEN, dtype=jnp.float32), r.rid


def test_a_row_with_nothing_to_write_leaves_the_page_it_shares_with_its_fork_untouched():
    """A fork's parent planned with max_tokens=0 keeps the partly filled page it shares with
    nobody now (the child copied it for its own write); the loop computes the parent's row but
    writes nothing into that page."""
    model, cache, m, seqs, first = _prefilled(UNIFORM, [[5, 6, 7, 8, 9], [40, 41, 42]])
    parent = seqs[0]
    child = m.fork(parent)
    runner = easykv.Runner(m, cache)
    plan = runner.schedule_decode([parent, child, seqs[1]], 4, max_tokens=[0, 4, 4], pad_seqs_to=4)
    assert plan.work.num_copies == 1  # the child's private copy of the shared page, applied with the plan
    cache = runner.cache
    page, offset = m.pages(parent)[-1], m.length(parent) % 8
    before = np.asarray(cache.key_pages[0])[:, :, page].copy()
    tokens = np.asarray([first[0], first[0], first[1], 0], np.int32)
    out = model.paged_decode(cache, jnp.asarray(tokens), plan, jnp.asarray(plan.limits))
    assert np.asarray(out.num_written).tolist() == [0, 4, 4, 0]
    after = np.asarray(out.state.key_pages[0])[:, :, page]
    np.testing.assert_array_equal(after, before)  # offset 5.. of the parent's page: still what it was
    assert offset == 5
    m.commit(plan, out.written, out.num_written)
    assert m.length(parent) == 5 and m.length(child) == 9


def test_a_failed_device_loop_closes_its_plan_so_the_engine_s_sequences_stay_usable(monkeypatch):
    model = CompiledModel(DemoModel(UNIFORM))
    cache, manager = setup(UNIFORM)
    engine = Engine(model, cache, manager, token_budget=32, max_seqs=4, prefill_chunk=16, decode_steps=4)
    requests = make_requests(2, 6, seed=1, fork=False)

    def broken(*args, **kwargs):
        raise RuntimeError("the device loop failed")

    monkeypatch.setattr(model, "paged_decode", broken)
    with pytest.raises(RuntimeError, match="the device loop failed"):
        engine.run(requests)
    assert manager.metrics.open_plans == 0
    manager.check_invariants()  # and no row names a plan: the rows agree with the open plans
    for r in requests:  # nothing reserved for the failed loop is left, and every sequence can go
        assert manager.sequence(r.seq).capacity == -(-manager.length(r.seq) // 8) * 8
        manager.release(r.seq)
    manager.check_invariants()
