"""Save a running cache and its page manager on tp=8, restore both onto dp=2 x tp=4, continue.

    python examples/checkpoint_reshard.py
"""

import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import easykv  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402


def main() -> None:
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 4, 2, 128, 16, 8, 64, 0.9, jnp.bfloat16, partition_manager=pm, num_pages_per_layer=64
    )
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm)
    manager = easykv.PageManager(meta)
    seq = manager.claim(1)[0]
    prompt = list(range(40))
    plan = manager.schedule([seq], [len(prompt)])  # a fresh pool: the plan carries no device work
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.normal(size=(2, 40, 8, 64)), jnp.bfloat16)
    cache, _ = cache.write(kv, kv, plan.metadata)
    manager.commit(plan, [prompt])

    directory = tempfile.mkdtemp(prefix="easykv-ckpt-")
    easykv.save_cache(directory, cache, manager, step=1, extra_metadata={"note": "after prefill"})
    print(easykv.inspect_checkpoint(directory).splitlines()[0])

    other = create_mesh({"dp": 2, "tp": 4})  # 2 kv heads per device instead of 1
    restored = easykv.restore_cache(directory, mesh=other, partition_manager=pm)
    cache, manager = restored
    print(f"restored step {restored.step} onto {dict(other.shape)}: pages sharded as "
          f"{cache[0].key_pages.sharding.spec}, {manager.length(seq)} tokens of sequence {seq}")  # fmt: skip
    keys, _ = easykv.gather_kv(cache, 1, manager.page_table([seq])[0], 40)
    assert np.array_equal(np.asarray(keys), np.asarray(kv[1]))

    plan = manager.schedule([seq], [1])  # and generation goes on
    new = jnp.asarray(rng.normal(size=(2, 1, 8, 64)), jnp.bfloat16)
    cache, _ = cache.write(new, new, plan.metadata)
    manager.commit(plan, [[40]])
    keys, _ = easykv.gather_kv(cache, 0, manager.page_table([seq])[0], 41)
    assert np.array_equal(np.asarray(keys[40]), np.asarray(new[0, 0]))
    print("continued writing on the new mesh: exactly the tokens written")


if __name__ == "__main__":
    main()
