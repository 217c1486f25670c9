"""The easykv rollout in Tunix's own RL cluster: a GRPO run whose rollouts run on easykv pages, the
cache moving to a new weight version whenever the weights change (through ``update_params`` or
in the parameters the rollout shares with the actor) so no prefix of old weights is ever served,
sleep between calls, and the rollout's output in the form Tunix's learners read."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

pytest.importorskip("tunix")

from flax import nnx  # noqa: E402
from helpers import PAD, ByteTokenizer, make, randomize, uncached_greedy  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from easykv.integrations.tunix import EasyKVRollout, TunixPagedEngine  # noqa: E402

LONG = ["the first prompt, long enough to fill some pages", "and a second prompt that fills pages too"]
OPTS = dict(num_pages=256, page_size=4, batch_size=8, decode_steps=4)


def greedy_config(**kw):
    return base_rollout.RolloutConfig(max_tokens_to_generate=12, max_prompt_length=64, kv_cache_size=128,
                                      temperature=1.0, top_p=None, **kw)


def rollout(model, **kw):
    return EasyKVRollout(rollout_actor=model, tokenizer=ByteTokenizer(), rollout_config=greedy_config(),
                         **{**OPTS, **kw})


def test_the_output_is_what_tunix_s_learners_read():
    model = make("qwen3", seed=6)
    out = rollout(model).generate(LONG, greedy_config())
    tok = ByteTokenizer()
    ids = [[1] + tok.encode(p) for p in LONG]
    assert out.left_padded_prompt_tokens.shape == (2, 64)
    for i, p in enumerate(ids):
        row = out.left_padded_prompt_tokens[i]
        assert row[-len(p):].tolist() == p and (row[: 64 - len(p)] == PAD).all()
        assert out.tokens[i].tolist() == uncached_greedy(model, p, 12)  # no end token inside
        assert out.text[i] == tok.decode(out.tokens[i].tolist())
    assert out.logprobs is None and out.logits == []
    with_logp = rollout(model).generate(LONG, greedy_config(return_logprobs=True))
    assert [len(lp) for lp in with_logp.logprobs] == [len(t) for t in with_logp.tokens]


def test_a_generated_pad_id_ends_the_sample_as_an_end_token_does():
    """Tunix masks a pad id wherever it sits (its scoring and losses too), so a sample that attended to one it
    generated would be scored on a context it was not drawn from: the rollout ends the sample there."""
    model = make("qwen3", seed=6)
    ids = [1] + ByteTokenizer().encode(LONG[0])
    greedy = uncached_greedy(model, ids, 12)
    cut = next(k for k in range(2, len(greedy)) if greedy[k] not in greedy[:k])
    pad = greedy[cut]  # a token the model generates, first at position cut, named the pad id

    class PadIsGenerated(ByteTokenizer):
        def pad_id(self):
            return pad

    ro = EasyKVRollout(rollout_actor=model, tokenizer=PadIsGenerated(), rollout_config=greedy_config(), **OPTS)
    out = ro.generate(LONG[:1], greedy_config())
    assert out.tokens[0].tolist() == greedy[:cut]  # ended at the pad id, which is not returned
    # the engine itself stops only at its eos_ids: it carries on through the same token
    assert ro.engine.generate([ids], 12)[0][0].tolist() == greedy


def test_new_weights_start_a_new_version_and_no_stale_prefix_is_served():
    model = make("llama3", seed=2)
    ro = rollout(model)
    first = ro.generate(LONG, greedy_config())
    again = ro.generate(LONG, greedy_config())  # same weights: the prompts' full pages are found
    assert [t.tolist() for t in again.tokens] == [t.tolist() for t in first.tokens]
    metrics = ro.engine.manager.metrics
    assert metrics.versions[-1].prefix_hits == 2 and ro.engine.version == 0
    # update_params with other weights: a new version; tokens are the new weights' own
    other = make("llama3", seed=4)
    ro.update_params(nnx.state(other, nnx.Param))
    after = ro.generate(LONG, greedy_config())
    assert ro.engine.version == 1
    by_version = {v.version: v for v in ro.engine.manager.metrics.versions}
    assert by_version[1].prefix_queries == 2 and by_version[1].prefix_hits == 0
    ids = [[1] + ByteTokenizer().encode(p) for p in LONG]
    assert [t.tolist() for t in after.tokens] == [uncached_greedy(other, p, 12) for p in ids]
    # the trainer's in-place update of the parameters the rollout shares with the actor: noticed
    randomize(model, seed=9)
    shared = ro.generate(LONG, greedy_config())
    assert ro.engine.version == 2 and ro.engine.manager.metrics.versions[-1].prefix_hits == 0
    assert [t.tolist() for t in shared.tokens] == [uncached_greedy(model, p, 12) for p in ids]


@pytest.mark.parametrize("level", [1, 2])
def test_the_cache_sleeps_between_calls_and_generates_the_same(level):
    model = make("gemma3", layers=6, window=6, seed=6)
    awake = rollout(model).generate(LONG, greedy_config())
    ro = rollout(model, sleep_level=level)
    for _ in range(2):
        out = ro.generate(LONG, greedy_config())
        assert ro.engine.asleep and ro.engine.cache is None
        assert [t.tolist() for t in out.tokens] == [t.tolist() for t in awake.tokens]


def test_bad_rollout_options_are_refused():
    with pytest.raises(ValueError, match="sleep_level=3 must be None"):
        rollout(make("qwen3"), sleep_level=3)
    with pytest.raises(ValueError, match="needs rollout_actor"):
        EasyKVRollout(tokenizer=ByteTokenizer())


@pytest.mark.slow
def test_a_grpo_run_through_tunix_s_cluster_rolls_out_on_easykv_pages():
    import optax
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo import grpo_learner

    actor, reference = make("qwen3", seed=6), make("qwen3", seed=6)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    roles = {rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh}
    config = rl.ClusterConfig(
        role_to_mesh=roles, rollout_engine=functools.partial(EasyKVRollout, **OPTS), offload_to_cpu=False,
        training_config=rl.RLTrainingConfig(actor_optimizer=optax.adamw(1e-2), eval_every_n_steps=100, max_steps=3,
                                            mini_batch_size=2, train_micro_batch_size=2),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=8, max_prompt_length=64, kv_cache_size=128,
                                                  temperature=0.9, top_p=1.0))
    cluster = rl.RLCluster(actor=actor, reference=reference, tokenizer=ByteTokenizer(), cluster_config=config)
    assert isinstance(cluster.rollout, EasyKVRollout)
    learner = grpo_learner.GRPOLearner(cluster, grpo_learner.GRPOConfig(num_generations=4, beta=0.04),
                                       reward_fns=[lambda prompts, completions, **kw: [float(c.count("a"))
                                                                                       for c in completions]])
    learner.train([{"prompts": np.array(LONG)} for _ in range(3)])
    engine: TunixPagedEngine = cluster.rollout.engine
    versions = engine.manager.metrics.versions
    assert cluster.actor_trainer.train_steps == 3 and engine.version == len(versions) - 1 >= 2
    assert all(v.prefix_hits == 0 for v in versions)  # every step's weights were new: nothing stale served
    assert all(v.prefix_queries == 2 for v in versions)  # one prefill per prompt, its 4 samples forked
