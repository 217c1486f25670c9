"""Scoring completions over easykv pages against Tunix's own dense ``compute_per_token_logps``: the
engine's `TunixPagedEngine.score`, the rollout's ``get_per_token_logps``, the reference scoring of
`EasyKVInferenceWorker` and `use_easykv_scoring` in Tunix's RL cluster. Each distinct prompt is
computed once, batches larger than the cache run in waves, and bad input changes nothing."""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tunix")

from flax import nnx  # noqa: E402
from helpers import EOS, PAD, VOCAB, ByteTokenizer, make  # noqa: E402
from tunix.rl import common  # noqa: E402
from tunix.rl.inference.inference_worker import InferenceWorker  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from easykv.errors import CacheFullError  # noqa: E402
from easykv.integrations.tunix import (  # noqa: E402
    EasyKVInferenceWorker,
    EasyKVRollout,
    TunixPagedEngine,
    use_easykv_scoring,
)

FAMILIES = ("qwen3", "llama3", "gemma3")
PAGE = 4
# 32 tokens a step: a batch takes several steps, a completion may be split between two.
OPTS = dict(max_length=64, batch_size=16, page_size=PAGE, num_pages=96, decode_steps=4, score_tokens=32)
PROMPT_W, WIDTH = 13, 9  # one batch shape everywhere: Tunix compiles its dense forward once per model


class Zoo:
    """The module's models and engines, made on first use (one compile each) and dropped with the module."""

    def __init__(self):
        self.models, self.engines = {}, {}

    def model(self, family):
        if family not in self.models:  # gemma3: 6 layers (the sixth global), a window of 5, below most prompts
            self.models[family] = make(family, layers=6 if family == "gemma3" else 2, window=5,
                                       seed=FAMILIES.index(family))  # fmt: skip
        return self.models[family]

    def engine(self, family):
        if family not in self.engines:
            self.engines[family] = TunixPagedEngine(self.model(family), **OPTS)
        return self.engines[family]


@pytest.fixture(scope="module")
def zoo():
    return Zoo()


def tunix_logps(mdl, prompts, completions, *, temperature=1.0, pad=PAD, eos=EOS):
    graphdef, state = nnx.split(mdl)
    return np.asarray(common.compute_per_token_logps(graphdef, state, jnp.asarray(prompts), jnp.asarray(completions),
                                                     pad, eos, temperature=temperature))


def assert_tunix_s(out, ref, completions, pad=PAD):
    """Within 1e-5 of Tunix's where a completion token is, exactly 0 at padding, Tunix's shape, float32."""
    completions = np.asarray(completions)
    assert isinstance(out, jax.Array) and out.shape == completions.shape and out.dtype == jnp.float32
    out, real = np.asarray(out), completions != pad
    np.testing.assert_allclose(out[real], ref[real], rtol=0, atol=1e-5)
    assert (out[~real] == 0.0).all()


def scoring_batch(rng, lengths, groups, *, pad=PAD, prompt_w=PROMPT_W, width=WIDTH):
    """Left-padded prompts of ``lengths`` tokens, ``groups[i]`` completions of prompt i, the rows shuffled (a
    prompt's rows are not adjacent). Completions cycle through: the full width, an early end token then
    padding, padding only, cut short without an end token."""
    tokens = np.setdiff1d(np.arange(VOCAB), [pad, EOS])  # the end token only where a kind puts it
    kinds = itertools.cycle(("full", "eos", "empty", "cut"))
    prompts, completions = [], []
    for n, g in zip(lengths, groups):
        prompt = np.full(prompt_w, pad)
        prompt[prompt_w - n:] = rng.choice(tokens, n)
        for _ in range(g):
            comp, kind = rng.choice(tokens, width), next(kinds)
            if kind == "eos":
                end = int(rng.integers(0, width - 1))
                comp[end], comp[end + 1:] = EOS, pad
            elif kind == "empty":
                comp[:] = pad
            elif kind == "cut":
                comp[int(rng.integers(1, width)):] = pad
            prompts.append(prompt)
            completions.append(comp)
    order = rng.permutation(len(prompts))
    return np.asarray(prompts, np.int32)[order], np.asarray(completions, np.int32)[order]


def distinct_prompts(prompts, completions, pad=PAD):
    """Prompts with at least one completion token: the ones scoring has to compute."""
    return {p.tobytes() for p, c in zip(prompts, completions) if c[0] != pad}


@contextlib.contextmanager
def within(seconds):
    """Fail, rather than hang the suite, if a scheduling loop stops making progress (SIGALRM interrupts the
    Python loop; the previous deadline is restored after)."""

    def expire(*_):
        raise TimeoutError(f"no result within {seconds} s: the scorer made no progress")

    previous = signal.signal(signal.SIGALRM, expire)
    left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, left)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def deadline():
    with within(120):
        yield


def idle(eng):
    m = eng.manager.metrics
    return m.active_sequences == 0 and m.used_pages == 0


# ---- 1. every family, every kind of row, temperatures ---------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_scores_are_tunix_s_for_every_kind_of_row(family, zoo):
    rng = np.random.default_rng(10 + FAMILIES.index(family))
    # 1 token, the full width, 8 (two pages), others not multiples of the page; G = 1 .. 4
    prompts, completions = scoring_batch(rng, [1, 13, 6, 7, 10, 8], [1, 4, 2, 3, 2, 1])
    kinds = completions != PAD
    assert (~kinds).all(axis=1).any() and kinds.all(axis=1).any() and (completions == EOS).any()
    eng, mdl = zoo.engine(family), zoo.model(family)
    given = [(1.0, prompts.astype(np.int64), completions),  # numpy
             (0.7, jnp.asarray(prompts), jnp.asarray(completions)),  # jax arrays, as Tunix's learners pass them
             (0.0, prompts.tolist(), completions.tolist())]  # lists
    for temperature, p, c in given:
        out = eng.score(p, c, pad_id=PAD, eos_id=EOS, temperature=temperature)
        assert_tunix_s(out, tunix_logps(mdl, prompts, completions, temperature=temperature), completions)
        assert idle(eng)
    # temperature 0 leaves the logits as they are (Tunix's rule), so it is temperature 1's result
    np.testing.assert_allclose(tunix_logps(mdl, prompts, completions, temperature=0.0),
                               tunix_logps(mdl, prompts, completions), atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_a_pad_inside_a_prompt_is_padding(family, zoo):
    # Tunix masks a pad id wherever it sits (attention and positions). Not Gemma 3: Tunix's dense Gemma 3
    # slides its window over array columns, so a pad inside a prompt shifts it there (easykv: positions).
    rng = np.random.default_rng(30)
    prompts, completions = scoring_batch(rng, [11, 9, 12], [2, 1, 1])
    completions[completions[:, 0] == PAD, 0] = 7  # every row scores something
    for row in prompts:
        row[np.flatnonzero(row != PAD)[1:-1:3]] = PAD  # the last token stays real (Tunix scores from it)
    out = zoo.engine(family).score(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert_tunix_s(out, tunix_logps(zoo.model(family), prompts, completions), completions)


# ---- 2. each prompt once, then from the prefix cache ----------------------------------------------
def test_each_distinct_prompt_is_computed_once_and_found_again(zoo):
    eng, mdl = zoo.engine("qwen3"), zoo.model("qwen3")
    prompts, completions = scoring_batch(np.random.default_rng(40), [5, 13, 9, 2, 12], [4, 3, 1, 2, 3])
    distinct = distinct_prompts(prompts, completions)
    ref = tunix_logps(mdl, prompts, completions)
    before = eng.manager.metrics
    first = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    mid = eng.manager.metrics
    assert mid.prefix_queries - before.prefix_queries == len(distinct) == 5
    assert mid.prefix_hits == before.prefix_hits  # fresh random prompts: nothing cached yet
    assert_tunix_s(first, ref, completions)
    assert idle(eng)
    again = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    after = eng.manager.metrics
    assert after.prefix_queries - mid.prefix_queries == len(distinct)
    # at least every prompt's full pages before its last token (computed by its leader) are found
    lengths = [int(np.count_nonzero(np.frombuffer(p, np.int32))) for p in distinct]
    assert after.prefix_hit_tokens - mid.prefix_hit_tokens >= sum((n - 1) // PAGE * PAGE for n in lengths) > 0
    assert after.prefix_hits - mid.prefix_hits >= sum(n - 1 >= PAGE for n in lengths)
    np.testing.assert_allclose(np.asarray(again), np.asarray(first), rtol=0, atol=1e-6)
    assert_tunix_s(again, ref, completions)
    assert idle(eng)


def test_rows_without_completion_tokens_compute_nothing(zoo):
    eng = zoo.engine("qwen3")
    prompts, _ = scoring_batch(np.random.default_rng(41), [3, 7], [2, 1])
    before = eng.manager.metrics
    out = eng.score(prompts, np.zeros((3, WIDTH), np.int32), pad_id=PAD, eos_id=EOS)
    assert out.shape == (3, WIDTH) and out.dtype == jnp.float32 and not np.asarray(out).any()
    assert eng.manager.metrics.prefix_queries == before.prefix_queries and idle(eng)


# ---- 3. waves: more rows than sequence slots, more pages than the pool, small steps ---------------
def test_completions_split_across_small_steps_score_the_same(zoo):
    eng = TunixPagedEngine(zoo.model("qwen3"), **{**OPTS, "score_tokens": 5})
    # 12 rows of up to 9 completion tokens, 5 tokens a step: every long completion spans 2 or 3 steps
    prompts, completions = scoring_batch(np.random.default_rng(50), [6, 13, 3, 9], [3, 4, 2, 3])
    with within(60):
        out = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert_tunix_s(out, tunix_logps(zoo.model("qwen3"), prompts, completions), completions)
    assert idle(eng) and eng.manager.metrics.prefix_queries == len(distinct_prompts(prompts, completions))


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_more_rows_than_sequence_slots_run_in_waves(slots, zoo):
    eng = TunixPagedEngine(zoo.model("qwen3"), **{**OPTS, "batch_size": slots})
    prompts, completions = scoring_batch(np.random.default_rng(50), [6, 13, 3, 9], [3, 4, 2, 3])  # 12 rows
    with within(15):
        out = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert_tunix_s(out, tunix_logps(zoo.model("qwen3"), prompts, completions), completions)
    # one slot leaves no room for a fork: each row is looked up (and finds the whole pages of its prompt)
    rows = int((completions != PAD).any(axis=1).sum())
    queries = rows if slots == 1 else len(distinct_prompts(prompts, completions))
    assert idle(eng) and eng.manager.metrics.prefix_queries == queries


def small_pool_case(zoo, lengths, groups, *, num_pages, max_length, seed=60):
    """An engine whose pool holds one full sequence of ``max_length`` but not the batch; prompts of ``lengths``
    tokens (12 columns) with ``groups`` completions of 16 tokens each (no padding: every row needs its pages)."""
    eng = TunixPagedEngine(zoo.model("qwen3"), **{**OPTS, "max_length": max_length, "num_pages": num_pages,
                                              "score_tokens": 16})  # fmt: skip
    prompts, completions = scoring_batch(np.random.default_rng(seed), lengths, groups, prompt_w=12, width=16)
    completions[completions == PAD] = 5
    return eng, prompts, completions


def test_one_prompt_s_completions_run_in_waves_over_a_small_pool(zoo):
    # 11 + 16 = 27 tokens a row: 7 pages of the pool's 8; 4 rows, one at a time
    eng, prompts, completions = small_pool_case(zoo, [12], [4], num_pages=8, max_length=28)
    out = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert_tunix_s(out, tunix_logps(zoo.model("qwen3"), prompts, completions), completions)
    assert idle(eng)


def test_several_prompts_run_in_waves_over_a_small_pool(zoo):
    # two 12-token prompts, two completions each: 7 pages a row, 10 in the pool
    eng, prompts, completions = small_pool_case(zoo, [12, 12], [2, 2], num_pages=10, max_length=32)
    out = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert_tunix_s(out, tunix_logps(zoo.model("qwen3"), prompts, completions), completions)
    assert idle(eng)


def test_a_row_as_long_as_the_pool_scores(zoo):
    # max_length 16 = the 4-page pool; an 8-token prompt (7 computed by its leader: a shared partial page)
    # and two 8-token completions: 15 tokens a row.
    eng = TunixPagedEngine(zoo.model("qwen3"), **{**OPTS, "max_length": 16, "num_pages": 4, "score_tokens": 16})
    prompts, completions = scoring_batch(np.random.default_rng(61), [8], [2], prompt_w=8, width=8)
    completions[completions == PAD] = 5
    out = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)  # leaders stop at a page: no copy-on-write page
    assert_tunix_s(out, tunix_logps(zoo.model("qwen3"), prompts, completions), completions)
    assert idle(eng)


def test_the_default_step_fits_a_small_cache(zoo):
    # the default score_tokens=1024 is more than one step of this cache holds (8 sequences x 64 tokens)
    opts = {k: v for k, v in OPTS.items() if k != "score_tokens"}
    try:
        eng = TunixPagedEngine(zoo.model("qwen3"), **{**opts, "batch_size": 8})
    except ValueError as err:  # refused when made is fine too, naming the option
        assert "score_tokens" in str(err)
        return
    prompts, completions = scoring_batch(np.random.default_rng(62), [5, 9], [2, 1])
    out = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert_tunix_s(out, tunix_logps(zoo.model("qwen3"), prompts, completions), completions)


# ---- 4. bad input: a precise error and nothing changed --------------------------------------------
@pytest.fixture(scope="module")
def good(zoo):
    """A batch of 4 rows (prompts of 4, 13, 7 and 1 tokens), and Tunix's values for it."""
    prompts, completions = scoring_batch(np.random.default_rng(70), [4, 13, 7, 1], [1, 1, 1, 1])
    return prompts, completions, tunix_logps(zoo.model("qwen3"), prompts, completions)


def _with(array, index, value):
    array = array.copy()
    array[index] = value
    return array


def bad_cases():
    """``(id, args(prompts, completions) -> score's changed arguments, error, message)``, built lazily (no model
    at collection)."""
    for name in ("pad_id", "eos_id"):
        for value, shown in ((-1, "-1"), (VOCAB, "64"), (2**70, str(2**70)), (True, "True"), (1.0, "1.0")):
            yield (f"{name}={shown}", lambda p, c, name=name, value=value: {name: value}, ValueError,
                   rf"{name} must be .*got {re.escape(shown)}")  # fmt: skip
    yield ("rows disagree", lambda p, c: dict(prompts=p[:3]), ValueError,
           r"prompt_tokens \(3, 13\) and completion_tokens \(4, 9\)")
    yield "1-D prompts", lambda p, c: dict(prompts=p[0]), ValueError, r"prompt_tokens must have 2 dim.*shape \(13,\)"
    yield "3-D completions", lambda p, c: dict(completions=c[None]), ValueError, r"completion_tokens .*\(1, 4, 9\)"
    yield "float prompts", lambda p, c: dict(prompts=p.astype(np.float32)), ValueError, r"prompt_tokens\[0, 0\] .*float"
    yield ("float completions", lambda p, c: dict(completions=jnp.asarray(c, jnp.float32)), ValueError,
           r"completion_tokens\[0, 0\] .*float32")  # a jax array, as Tunix passes them
    yield ("token == vocab", lambda p, c: dict(completions=_with(c, (1, 3), VOCAB)), ValueError,
           r"completion_tokens\[1, 3\] = 64 is out of range")
    yield ("negative token", lambda p, c: dict(prompts=_with(p, (2, 12), -3)), ValueError,
           r"prompt_tokens\[2, 12\] = -3 is out of range")
    yield ("padding prompt", lambda p, c: dict(prompts=_with(p, 2, PAD)), ValueError,
           r"prompt_tokens\[2\] holds only the pad id 0")
    for value, shown in ((-0.5, "-0.5"), (float("nan"), "nan"), (float("inf"), "inf"), ("hot", "'hot'"),
                         (True, "True"), (None, "None")):  # fmt: skip
        yield (f"temperature={shown}", lambda p, c, value=value: dict(temperature=value), ValueError,
               rf"temperature={re.escape(shown)}")  # fmt: skip


@pytest.mark.parametrize("case", list(bad_cases()), ids=lambda case: case[0])
def test_bad_input_is_refused_and_changes_nothing(case, zoo, good):
    _, changed, error, message = case
    p, c, ref = good
    args = dict(prompt_tokens=p, completion_tokens=c, pad_id=PAD, eos_id=EOS, temperature=1.0)
    renamed = {"prompts": "prompt_tokens", "completions": "completion_tokens"}
    args.update({renamed.get(k, k): v for k, v in changed(p, c).items()})
    eng = zoo.engine("qwen3")
    before = eng.manager.metrics
    with pytest.raises(error, match=message):
        eng.score(args.pop("prompt_tokens"), args.pop("completion_tokens"), **args)
    assert eng.manager.metrics == before and idle(eng)  # every counter, the prefix cache's too
    assert_tunix_s(eng.score(p, c, pad_id=PAD, eos_id=EOS), ref, c)


def test_a_row_longer_than_a_sequence_is_refused_naming_the_pages(zoo, good):
    eng, mdl = zoo.engine("qwen3"), zoo.model("qwen3")
    p = good[0]
    long = np.full((4, 60), 9, np.int32)
    row = int(np.argmax((p != PAD).sum(axis=1)))  # the 13-token prompt: 12 + 60 = 72 tokens > max_length=64
    for other in {0, 1, 2, 3} - {row}:
        long[other, 10 + 10 * other:] = PAD  # the others fit: only their real tokens count
    before = eng.manager.metrics
    with pytest.raises(CacheFullError, match=rf"row {row} needs 72 tokens .*18 pages of 4.*max_length=64") as err:
        eng.score(p, long, pad_id=PAD, eos_id=EOS)
    assert (err.value.resource, err.value.needed, err.value.available) == ("pages", 18, 16)
    assert eng.manager.metrics == before and idle(eng)
    long[row, 50:] = PAD  # 12 + 50 = 62 tokens: fits
    assert_tunix_s(eng.score(p, long, pad_id=PAD, eos_id=EOS), tunix_logps(mdl, p, long), long)


# ---- 5. the rollout's get_per_token_logps ---------------------------------------------------------
class PadFive(ByteTokenizer):
    """A tokenizer whose pad id is not 0, so a scorer that assumed 0 would be caught."""

    def pad_id(self):
        return 5


def test_the_rollout_scores_with_its_tokenizer_s_ids_and_sleeps_between_calls(zoo):
    config = base_rollout.RolloutConfig(max_tokens_to_generate=8, max_prompt_length=16, kv_cache_size=64)
    ro = EasyKVRollout(rollout_actor=zoo.model("qwen3"), tokenizer=PadFive(), rollout_config=config, sleep_level=2,
                       **{k: v for k, v in OPTS.items() if k != "max_length"})  # fmt: skip
    assert (ro.pad_id(), ro.eos_id()) == (5, EOS)
    prompts, completions = scoring_batch(np.random.default_rng(80), [3, 13, 8], [2, 3, 1], pad=5)
    ref = tunix_logps(zoo.model("qwen3"), prompts, completions, pad=5)
    for _ in range(2):  # the second call wakes the cache the first one put to sleep
        out = ro.get_per_token_logps(jnp.asarray(prompts), jnp.asarray(completions))
        assert_tunix_s(out, ref, completions, pad=5)
        assert ro.engine.asleep and ro.engine.cache is None
    hot = ro.get_per_token_logps(jnp.asarray(prompts), jnp.asarray(completions), temperature=0.7)
    ref = tunix_logps(zoo.model("qwen3"), prompts, completions, temperature=0.7, pad=5)
    assert_tunix_s(hot, ref, completions, pad=5)


# ---- 6. reference scoring in Tunix's RL cluster ---------------------------------------------------
def test_the_inference_worker_scores_the_reference_as_tunix_s_does(zoo):
    mdl, other = zoo.model("llama3"), make("llama3", seed=9)
    worker = EasyKVInferenceWorker({"reference": mdl, "reward": other}, **OPTS)
    assert worker.get_model("reference") is mdl and worker.get_model("reward") is other
    with pytest.raises(ValueError, match="critic"):
        worker.get_model("critic")  # Tunix's own answer for a role it has no model for
    prompts, completions = scoring_batch(np.random.default_rng(90), [2, 11, 6], [3, 1, 2])
    p, c = jnp.asarray(prompts), jnp.asarray(completions)
    out = worker.get_ref_per_token_logps(p, c, PAD, EOS, temperature=0.9)
    ref = np.asarray(InferenceWorker({"reference": mdl}).get_ref_per_token_logps(p, c, PAD, EOS, temperature=0.9))
    assert_tunix_s(out, ref, completions)
    assert idle(worker.engine)
    assert worker.engine.manager.metrics.prefix_queries == len(distinct_prompts(prompts, completions)) == 3
    for models in ({}, {"reward": other}):
        with pytest.raises(ValueError, match="reference model"):
            EasyKVInferenceWorker(models, **OPTS)


@pytest.mark.parametrize("level", [1, 2])
def test_the_inference_worker_sleeps_between_calls_and_finds_prompts_after_level_1(level, zoo):
    mdl = zoo.model("llama3")
    worker = EasyKVInferenceWorker({"reference": mdl}, sleep_level=level, **OPTS)
    prompts, completions = scoring_batch(np.random.default_rng(91), [9, 11], [2, 2])
    ref = np.asarray(InferenceWorker({"reference": mdl}).get_ref_per_token_logps(prompts, completions, PAD, EOS))
    for _ in range(2):
        assert_tunix_s(worker.get_ref_per_token_logps(prompts, completions, PAD, EOS), ref, completions)
        assert worker.engine.asleep  # its device memory is the trainer's until the next call
    hits = worker.engine.manager.metrics.prefix_hits
    assert hits == (2 if level == 1 else 0)  # level 1 kept the prompts' pages in host memory; level 2 did not
    for bad in (0, 3, True, "1"):
        with pytest.raises(ValueError, match=rf"sleep_level={re.escape(repr(bad))} must be None"):
            EasyKVInferenceWorker({"reference": mdl}, sleep_level=bad, **OPTS)


def test_use_easykv_scoring_serves_a_tunix_cluster_s_reference():
    import optax
    from tunix.rl import rl_cluster as rl

    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    engine_opts = {k: v for k, v in OPTS.items() if k != "max_length"}
    config = rl.ClusterConfig(
        role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
        rollout_engine=functools.partial(EasyKVRollout, **engine_opts), offload_to_cpu=False,
        training_config=rl.RLTrainingConfig(actor_optimizer=optax.sgd(1e-3), eval_every_n_steps=100, max_steps=1,
                                            mini_batch_size=2, train_micro_batch_size=2),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=8, max_prompt_length=16, kv_cache_size=64,
                                                  temperature=0.9, top_p=1.0))
    cluster = rl.RLCluster(actor=make("qwen3", seed=3), reference=make("qwen3", seed=5), tokenizer=ByteTokenizer(),
                           cluster_config=config)
    reference = cluster.inference_worker.get_model("reference")
    worker = use_easykv_scoring(cluster, **OPTS)
    assert isinstance(worker, EasyKVInferenceWorker) and cluster.inference_worker is worker
    assert worker.get_model("reference") is reference
    for role in ("critic", "reward"):  # the cluster has none: the worker has none either
        with pytest.raises(ValueError, match=role):
            worker.get_model(role)
    prompts, completions = scoring_batch(np.random.default_rng(100), [4, 13, 9], [2, 2, 1])
    p, c = jnp.asarray(prompts), jnp.asarray(completions)
    # the cluster scores at its rollout temperature (0.9) and shards the batch first
    out = cluster.get_ref_per_token_logps(p, c, PAD, EOS)
    ref = np.asarray(InferenceWorker({"reference": reference}).get_ref_per_token_logps(p, c, PAD, EOS,
                                                                                      temperature=0.9))
    assert_tunix_s(out, ref, completions)
    assert idle(worker.engine)
    assert worker.engine.manager.metrics.prefix_queries == len(distinct_prompts(prompts, completions)) == 3
    # the policy's old log-probabilities run over the rollout's pages, as Tunix's vanilla rollout scores them
    old = cluster.get_old_per_token_logps(p, c)
    assert_tunix_s(old, tunix_logps(cluster.actor_trainer.model, prompts, completions), completions)
