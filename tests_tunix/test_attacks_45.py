"""Outside review of issue 45 (LoRA models, scoring over pages, weight versions): inputs and situations the
other Tunix tests do not cover. The first four reproduce bugs found in review (each failed before its fix);
the others pin behaviour that is already right and that a wrong implementation would break."""

from __future__ import annotations

import functools
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tunix")
qwix = pytest.importorskip("qwix")

from flax import nnx  # noqa: E402
from helpers import EOS, PAD, VOCAB, ByteTokenizer, apply_lora, make, randomize_adapters  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tunix.rl import common  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from easykv.integrations import _tunix_store  # noqa: E402
from easykv.integrations.tunix import EasyKVRollout, TunixPagedEngine, family_of, use_easykv_scoring  # noqa: E402
from easykv.sharding import create_mesh  # noqa: E402
from easykv.tiers.store import PrefixStore  # noqa: E402

PAGE = 4
OPTS = dict(max_length=48, batch_size=8, page_size=PAGE, num_pages=96, decode_steps=4, prefill_tokens=32,
            score_tokens=32)  # fmt: skip
PW, CW = 13, 9  # one batch shape: Tunix's dense forward compiles once per model


@pytest.fixture(scope="module")
def model():
    return make("qwen3", seed=4)


@pytest.fixture(scope="module")
def eng(model):
    return TunixPagedEngine(model, **OPTS)


def tunix_logps(mdl, prompts, completions, temperature=1.0):
    graphdef, state = nnx.split(mdl)
    return np.asarray(common.compute_per_token_logps(graphdef, state, jnp.asarray(prompts), jnp.asarray(completions),
                                                     PAD, EOS, temperature=temperature))


def assert_tunix_s(out, ref, completions, atol=1e-5):
    completions = np.asarray(completions)
    out, real = np.asarray(out), completions != PAD
    assert out.shape == completions.shape and out.dtype == np.float32
    np.testing.assert_allclose(out[real], ref[real], rtol=0, atol=atol)
    assert (out[~real] == 0).all()


def idle(engine):
    m = engine.manager.metrics
    return (m.active_sequences, m.used_pages, m.open_plans) == (0, 0, 0)


def batch(seed, lengths, groups, *, width=CW, pw=PW, empty_every=0):
    """Left-padded prompts of ``lengths`` tokens, ``groups[i]`` completions each (full width, every
    ``empty_every``-th all padding)."""
    rng = np.random.default_rng(seed)
    prompts, completions = [], []
    for n, g in zip(lengths, groups):
        prompt = np.full(pw, PAD, np.int32)
        prompt[pw - n:] = rng.integers(3, VOCAB, n)
        for _ in range(g):
            comp = rng.integers(3, VOCAB, width).astype(np.int32)
            if empty_every and len(completions) % empty_every == empty_every - 1:
                comp[:] = PAD
            prompts.append(prompt)
            completions.append(comp)
    return np.asarray(prompts, np.int32), np.asarray(completions, np.int32)


# ---- bugs found in review, fixed (each failed before its fix) ------------------------------------------
def test_scoring_prompts_that_generate_just_cached_fits_a_small_pool(model):
    # 12 pages; two 9-token prompts (2 pages each before the last token), 2 completions of 12 tokens each:
    # 3 pages a row. Every row fits alone (5 pages); all at once need 4 + 12 = 16 pages.
    eng = TunixPagedEngine(model, **{**OPTS, "max_length": 24, "num_pages": 12, "score_tokens": 64})
    rng = np.random.default_rng(7)
    a, b = rng.integers(3, VOCAB, 9), rng.integers(3, VOCAB, 9)
    eng.generate([a, b], 1)  # the rollout's generate: the prompts' pages are cached now
    prompts = np.stack([a, a, b, b]).astype(np.int32)
    completions = rng.integers(3, VOCAB, (4, 12)).astype(np.int32)
    try:
        out = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    finally:
        assert idle(eng)
    assert_tunix_s(out, tunix_logps(model, prompts, completions), completions)


def _cluster(roles, *, reference, shape=(1, 1), actor_layers=1):
    """Tunix's RL cluster with the easykv rollout: ``roles`` (names of ``rl.Role``) on one ``(fsdp, tp)`` mesh of
    ``shape``; ``reference``: its reference model or None."""
    import optax
    from tunix.rl import rl_cluster as rl

    mesh = jax.make_mesh(shape, ("fsdp", "tp"), devices=jax.devices()[: shape[0] * shape[1]],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)  # fmt: skip
    config = rl.ClusterConfig(
        role_to_mesh={getattr(rl.Role, r): mesh for r in roles},
        rollout_engine=functools.partial(EasyKVRollout, **{k: v for k, v in OPTS.items() if k != "max_length"}),
        offload_to_cpu=False,
        training_config=rl.RLTrainingConfig(actor_optimizer=optax.sgd(1e-3), eval_every_n_steps=100, max_steps=1,
                                            mini_batch_size=2, train_micro_batch_size=2),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=4, max_prompt_length=16, kv_cache_size=48,
                                                  temperature=0.9, top_p=1.0))
    return rl.RLCluster(actor=make("qwen3", layers=actor_layers, seed=3), reference=reference,
                        tokenizer=ByteTokenizer(), cluster_config=config)


def test_use_easykv_scoring_on_a_cluster_with_a_reference_mesh_but_no_reference_model():
    cluster = _cluster(("ACTOR", "ROLLOUT", "REFERENCE"), reference=None)
    before = cluster.inference_worker
    with pytest.raises(ValueError, match="reference model"):
        use_easykv_scoring(cluster, **OPTS)
    assert cluster.inference_worker is before  # nothing installed


def test_use_easykv_scoring_on_a_cluster_without_a_reference_names_it():
    cluster = _cluster(("ACTOR", "ROLLOUT"), reference=None)
    before = cluster.inference_worker
    try:
        with pytest.raises(ValueError, match="reference model"):
            use_easykv_scoring(cluster, **OPTS)
    finally:
        assert cluster.inference_worker is before


def test_a_temperature_too_large_for_a_float_is_a_value_error(eng):
    prompts, completions = batch(1, [5], [1])
    with pytest.raises(ValueError, match="temperature"):
        eng.score(prompts, completions, pad_id=PAD, eos_id=EOS, temperature=10**400)
    assert idle(eng)


# ---- LoRA: weight versions, the store's fingerprint ----------------------------------------------------------
@pytest.fixture(scope="module")
def lora():
    base = make("qwen3", seed=6)
    model = apply_lora(base, "qwen3")
    randomize_adapters(model, seed=15)
    return base, model


def snapshot(model, kind):
    """``model``'s ``kind`` variables as they are now (``nnx.state`` holds the live variables, which later updates
    change)."""
    return jax.tree.map(lambda a: a, nnx.state(model, kind))


def _memory_url():
    return f"memory://{uuid.uuid4().hex}"


def test_a_lora_model_with_another_alpha_reads_no_page_of_the_first(lora):
    base, first = lora
    second = apply_lora(base, "qwen3", alpha=32.0)
    nnx.update(second, nnx.state(first, nnx.LoRAParam))  # the same adapter arrays, scaled 4x more
    prompts, completions = batch(2, [13, 10], [1, 1])
    url = _memory_url()
    writer = TunixPagedEngine(first, **OPTS, store=url, model_id="tests/lora")
    writer.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert writer.store.flush(30)
    store = PrefixStore(url, model_id="tests/lora", read="wait")
    reader = TunixPagedEngine(second, **OPTS, store=store)
    try:
        out = reader.score(prompts, completions, pad_id=PAD, eos_id=EOS)
        assert_tunix_s(out, tunix_logps(second, prompts, completions), completions)  # the first's pages: off by ~1e-2
        assert reader.store_metrics().pages_read == 0
    finally:
        store.close()
        writer.close()


def test_an_adapter_change_fingerprints_the_adapters_only(lora, monkeypatch):
    base, model = lora
    hashed = []
    real = _tunix_store._fingerprints

    def counting(leaves):
        hashed.append(len(leaves))
        return real(leaves)

    monkeypatch.setattr(_tunix_store, "_fingerprints", counting)
    store = PrefixStore(_memory_url(), model_id="tests/lora")
    old = snapshot(model, nnx.LoRAParam)
    try:
        eng = TunixPagedEngine(model, **OPTS, store=store)
        params = jax.tree.leaves(nnx.state(model, nnx.Param))
        adapters = jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
        assert hashed == [len(params)] and 0 < len(adapters) < len(params)
        first = eng.weight_version
        eng.update_params(nnx.state(base, nnx.Param))  # the frozen base pushed again: nothing to hash
        eng.update_params(nnx.state(eng.model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
        assert eng.weight_version == first and hashed == [len(params)]
        new = randomize_adapters(nnx.clone(model), seed=40)
        eng.update_params(new)
        second = eng.weight_version
        assert second != first and hashed == [len(params), len(adapters)]
        eng.update_params(old)  # the first adapters again (alive, so remembered): their fingerprint, no hashing
        assert eng.weight_version == first and hashed == [len(params), len(adapters)]
    finally:
        nnx.update(model, old)
        store.close()


def test_a_partial_adapter_update_starts_one_version_and_scores_the_new_model(lora):
    base, model = lora
    eng = TunixPagedEngine(model, **OPTS)
    prompts, completions = batch(3, [13, 6], [2, 1])
    before = np.asarray(eng.score(prompts, completions, pad_id=PAD, eos_id=EOS))
    old = snapshot(model, nnx.LoRAParam)
    v = eng.version
    try:
        # the adapters of one projection of one layer, as a trainer that pushes a subset would
        def one(path, value):
            return isinstance(value, nnx.LoRAParam) and path[:4] == ("layers", 0, "attn", "q_proj")

        part = jax.tree.map(lambda a: a + 0.5, nnx.state(model, one))
        assert 0 < len(jax.tree.leaves(part)) < len(jax.tree.leaves(old))
        eng.update_params(part)
        assert eng.version == v + 1
        eng.update_params(nnx.state(model, nnx.LoRAParam))  # the arrays it holds now: no new version
        assert eng.version == v + 1
        after = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
        assert_tunix_s(after, tunix_logps(eng.model, prompts, completions), completions)
        assert np.abs(np.asarray(after) - before).max() > 1e-3
        queries = {x.version: (x.prefix_queries, x.prefix_hits) for x in eng.manager.metrics.versions}
        assert queries[v + 1] == (2, 0)  # nothing of the old adapters found
    finally:
        nnx.update(model, old)
        nnx.update(eng.model, old)


# ---- failures, sleep, interleaving with generate --------------------------------------------------------------
def test_a_step_that_fails_mid_way_leaves_the_engine_idle_and_usable(model, monkeypatch):
    eng = TunixPagedEngine(model, **{**OPTS, "score_tokens": 8})  # several steps a call
    prompts, completions = batch(4, [13, 9, 5], [3, 2, 2])
    ref = tunix_logps(model, prompts, completions)
    real, calls = eng._score_step, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected step failure")
        return real(*args)

    monkeypatch.setattr(eng, "_score_step", failing)
    with pytest.raises(RuntimeError, match="injected step failure"):
        eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert len(calls) == 2 and idle(eng)
    assert_tunix_s(eng.score(prompts, completions, pad_id=PAD, eos_id=EOS), ref, completions)
    assert idle(eng)
    tokens, _ = eng.generate([prompts[0][prompts[0] != PAD]], 4)
    assert tokens[0].size == 4 and idle(eng)


def test_a_fork_that_fails_releases_the_leaders_and_rows_already_claimed(model, monkeypatch):
    eng = TunixPagedEngine(model, **OPTS)
    prompts, completions = batch(15, [13, 9], [3, 2])
    real, calls = eng.manager.fork, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # a leader and a first fork are held by then
            raise MemoryError("injected fork failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(eng.manager, "fork", failing)
    with pytest.raises(MemoryError, match="injected fork failure"):
        eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert len(calls) == 2 and idle(eng)
    monkeypatch.undo()
    assert_tunix_s(eng.score(prompts, completions, pad_id=PAD, eos_id=EOS), tunix_logps(model, prompts, completions),
                   completions)
    assert idle(eng)

@pytest.mark.parametrize("level", [1, 2])
def test_scoring_an_asleep_engine_wakes_it_and_new_weights_given_while_asleep_count(model, level):
    eng = TunixPagedEngine(model, **OPTS)
    prompts, completions = batch(5, [13, 11], [2, 2])
    first = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    eng.sleep(level)
    assert eng.asleep
    hits = eng.manager.metrics.prefix_hits
    again = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert not eng.asleep and idle(eng)
    np.testing.assert_allclose(np.asarray(again), np.asarray(first), rtol=0, atol=1e-6)
    # level 1 kept the pages (both prompts found); level 2 discarded them
    assert eng.manager.metrics.prefix_hits - hits == (2 if level == 1 else 0)
    other = make("qwen3", seed=12)
    eng.sleep(level)
    eng.update_params(nnx.state(other, nnx.Param))
    hits = eng.manager.metrics.prefix_hits
    out = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert eng.manager.metrics.prefix_hits == hits  # nothing of the old weights
    assert_tunix_s(out, tunix_logps(other, prompts, completions), completions)


def test_generate_then_new_weights_then_score_never_crosses_versions(model):
    eng = TunixPagedEngine(model, **OPTS)
    prompts, completions = batch(6, [13, 12, 9], [2, 1, 2])
    ids = [p[p != PAD] for p in prompts[[0, 2, 3]]]
    eng.generate(ids, 3)  # the prompts' pages cached under the first weights
    hits = eng.manager.metrics.prefix_hits
    same = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert eng.manager.metrics.prefix_hits - hits == 3  # generate's pages serve the scoring
    assert_tunix_s(same, tunix_logps(model, prompts, completions), completions)
    other = make("qwen3", seed=13)
    eng.update_params(nnx.state(other, nnx.Param))
    hits = eng.manager.metrics.prefix_hits
    out = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert eng.manager.metrics.prefix_hits == hits
    assert_tunix_s(out, tunix_logps(other, prompts, completions), completions)
    # and the scoring's pages (prompt and completion) serve a generate of the new weights only
    hits = eng.manager.metrics.prefix_hits
    eng.generate([np.concatenate([ids[0], completions[0]])], 2)
    assert eng.manager.metrics.prefix_hits - hits == 1 and idle(eng)


def test_the_rollout_scores_after_its_generate_slept_at_level_1_from_the_kept_pages(model):
    config = base_rollout.RolloutConfig(max_tokens_to_generate=4, max_prompt_length=16, kv_cache_size=48)
    ro = EasyKVRollout(rollout_actor=model, tokenizer=ByteTokenizer(), rollout_config=config, sleep_level=1,
                       **{k: v for k, v in OPTS.items() if k != "max_length"})  # fmt: skip
    out = ro.generate(["a prompt of some length", "another, longer prompt here"], config)
    assert ro.engine.asleep
    prompts = np.asarray(out.left_padded_prompt_tokens, np.int32)
    completions = np.full((2, 4), PAD, np.int32)
    for i, t in enumerate(out.tokens):
        completions[i, : t.size] = t
    hits = ro.engine.manager.metrics.prefix_hits
    logps = ro.get_per_token_logps(jnp.asarray(prompts), jnp.asarray(completions))
    assert ro.engine.asleep and ro.engine.manager.metrics.prefix_hits - hits == 2
    assert_tunix_s(logps, tunix_logps(model, prompts, completions), completions)


# ---- inputs: placements, dtypes, widths, degenerate groups -----------------------------------------------------
def test_scoring_takes_arrays_sharded_over_eight_devices_and_every_int_dtype(eng, model):
    prompts, completions = batch(8, [13, 7, 5, 4], [3, 2, 2, 1], empty_every=3)
    ref = tunix_logps(model, prompts, completions)
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    sharded = NamedSharding(mesh, P("data"))
    given = [(jax.device_put(jnp.asarray(prompts), sharded), jax.device_put(jnp.asarray(completions), sharded)),
             (prompts.astype(np.int64), completions.astype(np.uint64)),
             (prompts.astype(np.uint8), completions.astype(np.int16))]
    for p, c in given:
        assert_tunix_s(eng.score(p, c, pad_id=np.int64(PAD), eos_id=np.uint32(EOS)), ref, completions)
        assert idle(eng)


def test_token_ids_too_large_for_any_int_type_are_refused_by_position(eng):
    prompts, completions = batch(9, [5, 6], [1, 1])
    before = eng.manager.metrics
    as_lists = completions.tolist()
    as_lists[1][4] = 2**70
    with pytest.raises(ValueError, match=rf"completion_tokens\[1, 4\].*{2**70}"):
        eng.score(prompts, as_lists, pad_id=PAD, eos_id=EOS)
    big = completions.astype(np.uint64)
    big[0, 2] = 2**64 - 1  # not -1 read as int64
    with pytest.raises(ValueError, match=rf"completion_tokens\[0, 2\] = {2**64 - 1} is out of range"):
        eng.score(prompts, big, pad_id=PAD, eos_id=EOS)
    assert eng.manager.metrics == before and idle(eng)


def test_zero_width_completions_and_prompts(eng):
    prompts, completions = batch(10, [5, 6], [1, 1])
    before = eng.manager.metrics
    out = eng.score(prompts, completions[:, :0], pad_id=PAD, eos_id=EOS)
    assert out.shape == (2, 0) and out.dtype == jnp.float32
    assert eng.manager.metrics == before and idle(eng)
    with pytest.raises(ValueError, match=r"prompt_tokens\[0\] holds only the pad id"):
        eng.score(prompts[:, :0], completions, pad_id=PAD, eos_id=EOS)
    assert eng.manager.metrics == before and idle(eng)


def test_identical_completions_and_page_edge_prompts_score_as_tunix_does(eng, model):
    # prompts of page+1, 2 pages, 3 pages and 1 token; a group whose completions are all the same, groups
    # whose rows are all padding but one
    prompts, completions = batch(11, [PAGE + 1, 2 * PAGE, 3 * PAGE, 1], [4, 3, 3, 2])
    completions[1:4] = completions[0]
    completions[4:6] = PAD
    completions[7:9] = PAD
    ref = tunix_logps(model, prompts, completions)
    for _ in range(2):  # the second call from the pages the first one cached
        assert_tunix_s(eng.score(prompts, completions, pad_id=PAD, eos_id=EOS), ref, completions)
        assert idle(eng)


# ---- engines on a mesh, quantized pages --------------------------------------------------------------------
def test_an_engine_on_a_tp2_mesh_scores_as_tunix_does(model):
    eng = TunixPagedEngine(model, mesh=create_mesh({"tp": 2}, devices=jax.devices()[:2]), **OPTS)
    prompts, completions = batch(12, [13, 6], [3, 2], empty_every=4)
    assert_tunix_s(eng.score(prompts, completions, pad_id=PAD, eos_id=EOS), tunix_logps(model, prompts, completions),
                   completions)
    assert idle(eng)


def test_int8_pages_score_near_tunix_s_and_the_same_whatever_the_chunking(model):
    prompts, completions = batch(13, [13, 9, 5], [3, 2, 1])
    ref = tunix_logps(model, prompts, completions)
    real = completions != PAD
    outs = []
    for score_tokens in (64, 5):
        eng = TunixPagedEngine(model, **{**OPTS, "quantizer": "int8", "score_tokens": score_tokens})
        outs.append(np.asarray(eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)))
        outs.append(np.asarray(eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)))  # prompts cached
        assert idle(eng)
    err = np.abs(outs[0] - ref)[real]
    # int8 keys and values move the scores a little, not to another model's (the logits are O(1) apart there)
    assert 0 < err.max() < 0.05, err.max()
    for other in outs[1:]:
        np.testing.assert_allclose(other, outs[0], rtol=0, atol=1e-5)
    assert (outs[0][~real] == 0).all()


# ---- qwix: what is served and what is refused ------------------------------------------------------------------
def test_a_lora_provider_subclass_is_refused_by_name():
    class TunedLora(qwix.LoraProvider):  # may change how adapters apply: not what easykv checked
        pass

    base = make("llama3", layers=1)
    model = qwix.apply_lora_to_model(base, TunedLora(module_path=".*q_proj", rank=2, alpha=4.0), rngs=nnx.Rngs(0),
                                     **base.get_model_input())
    with pytest.raises(ValueError, match="a qwix TunedLora model: easykv serves qwix.LoraProvider"):
        family_of(model)


def test_lora_on_every_module_the_rules_match_scores_as_tunix_does():
    # '.*' gives adapters to every projection with a weight, the output head included; the attention core's
    # einsums (activations only) get none, so nothing sits on the part easykv replaces
    base = make("qwen3", seed=21)
    model = apply_lora(base, "qwen3", module_path=".*")
    randomize_adapters(model, seed=22)
    paths = {"/".join(map(str, p)) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.LoRAParam))[0]}
    assert any("lm_head" in p or "embedder" in p for p in paths), sorted(paths)
    eng = TunixPagedEngine(model, **OPTS)
    prompts, completions = batch(14, [13, 7], [2, 2])
    assert_tunix_s(eng.score(prompts, completions, pad_id=PAD, eos_id=EOS), tunix_logps(model, prompts, completions),
                   completions)


# ---- the shared prefix store, Tunix's RL cluster on several devices ----------------------------------------------
def test_scored_pages_serve_another_engine_through_the_store_until_its_weights_change(model):
    url = _memory_url()
    writer = TunixPagedEngine(model, **OPTS, store=url, model_id="tests/scoring")
    prompts, completions = batch(16, [13, 11], [2, 1])
    ref = tunix_logps(model, prompts, completions)
    assert_tunix_s(writer.score(prompts, completions, pad_id=PAD, eos_id=EOS), ref, completions)
    assert writer.store.flush(30) and writer.store_metrics().values_written > 0
    store = PrefixStore(url, model_id="tests/scoring", read="wait")
    reader = TunixPagedEngine(model, **{**OPTS, "num_pages": 64}, store=store)
    try:
        assert_tunix_s(reader.score(prompts, completions, pad_id=PAD, eos_id=EOS), ref, completions)
        # each prompt's whole pages before its last token, written by the writer's leaders: 3 + 2
        assert reader.store_metrics().pages_read == 5
        other = make("qwen3", seed=17)
        reader.update_params(nnx.state(other, nnx.Param))
        reader.sleep(2)  # nothing of the first weights left on the device or in host pages
        out = reader.score(prompts, completions, pad_id=PAD, eos_id=EOS)
        assert reader.store_metrics().pages_read == 5  # nothing of the first weights read
        assert_tunix_s(out, tunix_logps(other, prompts, completions), completions)
    finally:
        store.close()
        writer.close()


def test_reference_and_policy_scoring_in_a_cluster_on_a_2x2_mesh():
    from tunix.rl.inference.inference_worker import InferenceWorker

    cluster = _cluster(("ACTOR", "REFERENCE", "ROLLOUT"), reference=make("qwen3", seed=5), shape=(2, 2),
                       actor_layers=2)  # fmt: skip
    reference = cluster.inference_worker.get_model("reference")
    use_easykv_scoring(cluster, **OPTS)
    prompts, completions = batch(3, [13, 6, 9, 4], [2, 2, 2, 2])
    p, c = jnp.asarray(prompts), jnp.asarray(completions)
    out = cluster.get_ref_per_token_logps(p, c, PAD, EOS)  # the batch sharded over the mesh first
    dense = InferenceWorker({"reference": reference}).get_ref_per_token_logps(p, c, PAD, EOS, temperature=0.9)
    assert_tunix_s(out, np.asarray(dense), completions)
    old = cluster.get_old_per_token_logps(p, c)
    assert_tunix_s(old, tunix_logps(cluster.actor_trainer.model, prompts, completions), completions)
    assert np.isfinite(np.asarray(old - out)).all()  # on one mesh: Tunix's learners combine them
