"""GRPO through Tunix's own RL cluster, its rollouts on easykv pages (needs ``easykv[tunix]``).

    pip install -e '.[tunix]' && python examples/grpo_tunix.py

A tiny Qwen3 (Tunix's own module, random weights) learns for a few steps to write more of the
letter "a". Each step Tunix's cluster asks the rollout engine for 4 samples of each of 2 prompts:
easykv prefills each prompt once and forks it 3 times (copy-on-write pages), decodes 8 tokens per
device loop with sampling on the device, and after the trainer's update (the rollout shares the
actor's parameters) moves its cache to a new weight version, so no prompt page computed by the old
weights is found again. Between steps the cache sleeps (its device memory freed for the trainer).
"""

import functools

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402
from tunix.rl import rl_cluster as rl  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from easykv.integrations.tunix import EasyKVRollout  # noqa: E402

PROMPTS = ["write the letter a as often as you can: ", "now write many a's, please, and nothing else: "]


class Bytes:
    """Tunix's tokenizer protocol over bytes: ids 3..258, 0 pad, 1 bos, 2 eos."""

    def encode(self, text, **kw):
        return [3 + b for b in text.encode()]

    def decode(self, ids, **kw):
        return bytes(i - 3 for i in ids if i >= 3).decode(errors="replace")

    def bos_id(self):
        return 1

    def eos_id(self):
        return 2

    def pad_id(self):
        return 0


def tiny_qwen3(seed):
    cfg = qwen3.ModelConfig(num_layers=2, vocab_size=259, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
                            num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-6)
    model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(seed))
    leaves, tree = jax.tree.flatten(nnx.state(model, nnx.Param))
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    nnx.update(model, jax.tree.unflatten(tree, [a + 0.05 * jax.random.normal(k, a.shape)
                                                for a, k in zip(leaves, keys)]))
    return model


def reward(prompts, completions, **kwargs):
    return [c.count("a") / max(1, len(c)) for c in completions]


def main():
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    engine = functools.partial(EasyKVRollout, num_pages=256, page_size=16, batch_size=16, decode_steps=8, sleep_level=2)
    config = rl.ClusterConfig(
        role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
        rollout_engine=engine, offload_to_cpu=False,
        training_config=rl.RLTrainingConfig(actor_optimizer=optax.adamw(3e-3), eval_every_n_steps=1000, max_steps=4,
                                            mini_batch_size=2, train_micro_batch_size=2),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=16, max_prompt_length=64, kv_cache_size=128,
                                                  temperature=0.9, top_p=1.0))
    cluster = rl.RLCluster(actor=tiny_qwen3(0), reference=tiny_qwen3(0), tokenizer=Bytes(), cluster_config=config)
    learner = grpo_learner.GRPOLearner(cluster, grpo_learner.GRPOConfig(num_generations=4, beta=0.04),
                                       reward_fns=[reward])
    learner.train([{"prompts": np.array(PROMPTS)} for _ in range(4)])

    kv = cluster.rollout.engine
    print(f"trainer steps: {cluster.actor_trainer.train_steps}; the rollout cache's weight versions: {kv.version + 1}")
    for v in kv.manager.metrics.versions:
        print(f"  version {v.version}: {v.prefix_queries} prompts prefilled (their samples forked), "
              f"{v.prefix_hits} prefix hits")
    assert cluster.actor_trainer.train_steps == 4 and kv.version >= 3
    assert all(v.prefix_hits == 0 for v in kv.manager.metrics.versions)  # nothing of old weights was served
    print("every step's rollouts ran on easykv pages under that step's weights")


if __name__ == "__main__":
    main()
