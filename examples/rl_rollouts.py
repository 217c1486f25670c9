"""RL rollouts across a weight update: the prefix cache never serves K/V of the old weights.

    python examples/rl_rollouts.py

Three prompts share a 24-token system prompt; each is rolled out twice (a parent and a fork
that takes the second most likely first token), through the demo model on 8 simulated devices.
Then the weights are updated (perturbed), the manager is told the new weight version, and the
same prompts are rolled out again. Every rollout is checked token for token against a dense
per-request cache run with the weights of its round: a page of K/V computed by the old weights
served to the new ones would change the tokens. The cache is put to sleep while the "trainer"
updates the weights (its device memory freed) and woken for the second round.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import easykv  # noqa: E402
from easykv.demo.engine import Engine, Request, reference_generate  # noqa: E402
from easykv.demo.model import CompiledModel, DemoConfig, DemoModel  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402
from easykv.tiers.sleep import device_bytes  # noqa: E402

SYSTEM = list(range(1, 25))
PROMPTS = [SYSTEM + [100 + i] * 5 for i in range(3)]
MAX_LEN, NEW = 64, 8


def perturbed(model: DemoModel, scale: float, seed: int) -> DemoModel:
    """The model after a (pretend) optimizer step: every weight nudged."""
    graphdef, params = nnx.split(model)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params))))
    params = jax.tree.map(lambda p: p + scale * jnp.std(p) * jax.random.normal(next(keys), p.shape, p.dtype), params)
    return nnx.merge(graphdef, params)


def rollouts(model: CompiledModel, cache, manager):
    requests = []
    for i, prompt in enumerate(PROMPTS):
        requests.append(Request(rid=2 * i, prompt=prompt, max_new_tokens=NEW, arrival=i))
        requests.append(Request(rid=2 * i + 1, prompt=prompt, max_new_tokens=NEW, arrival=i, fork_of=2 * i))
    engine = Engine(model, cache, manager, token_budget=32, max_seqs=8, prefill_chunk=16)
    engine.run(requests)
    for r in requests:  # the paged rollouts are exactly the dense ones of these weights
        assert r.output == reference_generate(model, r, max_len=MAX_LEN, dtype=jnp.float32), r.rid
    return engine.cache, [r.output for r in requests]


def main() -> None:
    cfg = DemoConfig()
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 8, cfg.layers, MAX_LEN, 8, cfg.kv_heads, cfg.head_dim, 0.9,
                                                     jnp.float32, partition_manager=pm, num_pages_per_layer=64)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    manager = easykv.PageManager(meta)

    policy = DemoModel(cfg)
    manager.set_weight_version(0)
    cache, first = rollouts(CompiledModel(policy), cache, manager)

    pool, held = device_bytes(cache), device_bytes()
    sleeping = easykv.sleep(cache, manager)  # the trainer takes the accelerators
    freed = held - device_bytes()
    assert freed == pool
    print(f"asleep: the pool's {pool} device bytes are free ({sleeping.host_bytes} bytes in host memory)")
    policy = perturbed(policy, 0.3, seed=1)  # the weight update
    cache, manager = easykv.wake(sleeping)
    manager.set_weight_version(1)
    assert manager.cached_prefix_length(PROMPTS[0]) == 0  # version 0's pages are not found
    cache, second = rollouts(CompiledModel(policy), cache, manager)

    changed = sum(a != b for a, b in zip(first, second))
    print(f"rollouts of {len(first)} samples changed by the update: {changed}")
    for v in manager.metrics.versions:
        print(f"weight version {v.version}: {v.prefix_queries} prefix lookups, {v.prefix_hits} hits "
              f"({v.prefix_hit_tokens} prompt tokens not prefilled), {v.cached_pages} pages cached"
              f"{' (current)' if v.current else ''}")
    by_version = {v.version: v for v in manager.metrics.versions}
    # within a round the later prompts reuse the system prompt: hits, but only of their own version
    assert by_version[0].prefix_hits == by_version[1].prefix_hits == 2
    assert np.all([len(o) == NEW for o in second])
    print("every rollout matched the dense reference of its own weights: no stale prefix hit")


if __name__ == "__main__":
    main()
