"""LoRA GRPO through Tunix's own RL cluster, rollouts and log-prob scoring on easykv pages (needs ``easykv[tunix]``).

    pip install -e '.[tunix]' && python examples/grpo_tunix_lora.py

The run of ``examples/grpo_tunix.py`` (whose tiny Qwen3, tokenizer and reward it reuses), as Tunix's
LoRA recipes set it up: the policy is a qwix LoRA model over a frozen base, and the reference model
is that base itself (Tunix's cluster sees the two share their backbone and keeps one copy). Each
step, for 4 samples of each of 2 prompts:

- the rollout (easykv) prefills each prompt once under the current adapters, forks it per sample;
- GRPO's old-policy log-probs (``num_iterations=2``) are scored on the same pages: each prompt is
  found in the prefix cache the rollout just filled, only the completions are computed;
- the reference log-probs (``beta != 0``) are scored over a second easykv cache of the base model
  (`use_easykv_scoring`): the base never changes, so its cache keeps one weight version and serves
  the prompts again at every later step;
- the trainer updates only the adapters, in the parameters the rollout shares (so Tunix skips its
  weight sync); the next rollout sees new adapter arrays and moves its cache to a new weight
  version, so no page computed with old adapters is found again.

At the end the example checks each of these, and that every reference score Tunix trained with
equals Tunix's own dense ``compute_per_token_logps`` on the same batch.
"""

import functools

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
import qwix  # noqa: E402
from flax import nnx  # noqa: E402
from grpo_tunix import PROMPTS, Bytes, reward, tiny_qwen3  # noqa: E402
from tunix.rl import common  # noqa: E402
from tunix.rl import rl_cluster as rl  # noqa: E402
from tunix.rl import utils as rl_utils  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from easykv.integrations.tunix import EasyKVRollout, use_easykv_scoring  # noqa: E402

STEPS, ITERATIONS = 4, 2  # GRPO steps (one rollout each), trainer updates per step
PROJECTIONS = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj|.*up_proj"  # as Tunix's GRPO scripts


def lora_policy(mesh):
    """The frozen base (on ``mesh``, so Tunix's cluster keeps it as it is) and a qwix LoRA policy over it."""
    base = tiny_qwen3(0)
    on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    nnx.update(base, jax.device_put(nnx.state(base), on_mesh))
    actor = qwix.apply_lora_to_model(base, qwix.LoraProvider(module_path=PROJECTIONS, rank=4, alpha=8.0),
                                     rngs=nnx.Rngs(3), **base.get_model_input())
    nnx.update(actor, jax.device_put(nnx.state(actor, nnx.LoRAParam), on_mesh))
    return base, actor


def recording(fn, calls):
    """``fn``, appending each call's arguments and result to ``calls``."""

    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    return call


def main():
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    base, actor = lora_policy(mesh)
    engine = functools.partial(EasyKVRollout, num_pages=256, page_size=16, batch_size=16, decode_steps=8, sleep_level=1)
    tok = Bytes()
    config = rl.ClusterConfig(
        role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
        rollout_engine=engine, offload_to_cpu=False,
        training_config=rl.RLTrainingConfig(actor_optimizer=optax.adamw(3e-3), eval_every_n_steps=1000,
                                            max_steps=STEPS * ITERATIONS, mini_batch_size=2, train_micro_batch_size=2),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=16, max_prompt_length=64, kv_cache_size=128,
                                                  temperature=0.9, top_p=1.0))
    cluster = rl.RLCluster(actor=actor, reference=base, tokenizer=tok, cluster_config=config)
    worker = use_easykv_scoring(cluster, num_pages=256, page_size=16, batch_size=16, max_length=128)
    reference = worker.get_model("reference")
    assert rl_utils.is_sharing_backbone(cluster.actor_trainer.model, reference)  # one copy of the frozen base

    kv, ref = cluster.rollout.engine, worker.engine
    scored = []  # each reference scoring Tunix asked for: (args, kwargs, result)
    worker.get_ref_per_token_logps = recording(worker.get_ref_per_token_logps, scored)
    learner = grpo_learner.GRPOLearner(
        cluster, grpo_learner.GRPOConfig(num_generations=4, num_iterations=ITERATIONS, beta=0.04),
        reward_fns=[reward])
    learner.train([{"prompts": np.array(PROMPTS)} for _ in range(STEPS)])
    report(cluster, kv, ref, reference, scored)


def report(cluster, kv, ref, reference, scored):
    steps = cluster.actor_trainer.train_steps
    print(f"trainer steps: {steps} ({STEPS} GRPO steps x {ITERATIONS} iterations); "
          f"the rollout cache's weight versions: {kv.version + 1}")
    versions = kv.manager.metrics.versions
    for v in versions:
        print(f"  version {v.version}: {v.prefix_queries} prompt lookups (rollout, then old-policy scoring), "
              f"{v.prefix_hits} found")
    assert steps == STEPS * ITERATIONS and len(versions) == STEPS and kv.version == STEPS - 1
    # Each version's rollout found nothing (no page of older adapters is served); its scoring found both prompts.
    assert all(v.prefix_queries == 2 * len(PROMPTS) and v.prefix_hits == len(PROMPTS) for v in versions)

    (base_version,) = ref.manager.metrics.versions
    print(f"reference cache: {ref.version + 1} weight version; {base_version.prefix_queries} prompt lookups, "
          f"{base_version.prefix_hits} found (every step after the first)")
    assert ref.version == 0 and base_version.prefix_queries == len(PROMPTS) * STEPS
    assert base_version.prefix_hits == len(PROMPTS) * (STEPS - 1)  # the first step's cache was empty

    graphdef, state = nnx.split(reference)
    worst = 0.0
    for (prompts, completions, pad, eos), kwargs, logps in scored:
        dense = common.compute_per_token_logps(graphdef, state, prompts, completions, pad, eos, **kwargs)
        mask = np.asarray(completions) != pad  # the positions Tunix's losses read
        worst = max(worst, float(np.abs(np.where(mask, np.asarray(dense) - np.asarray(logps), 0)).max()))
    print(f"reference log-probs of {len(scored)} steps against Tunix's dense compute_per_token_logps: "
          f"largest difference {worst:.1e}")
    assert len(scored) == STEPS and worst < 1e-5
    print("every step's rollouts and scores ran on easykv pages under that step's weights")


if __name__ == "__main__":
    main()
