"""Two processes on this machine, 4 CPU devices each, forming one 8-device JAX runtime: each
process runs this same file, allocates only its own shards of the cache, and both write and
read it together.

    python examples/multihost_launch.py            # launches 2 workers and waits for them

On a TPU pod slice or several GPU hosts, run the worker part on every host instead, after
`easykv.multihost.initialize()` (arguments from the cluster environment).
"""

import sys
import tempfile


def worker() -> None:
    from easykv.multihost import assert_lockstep, initialize_from_env

    pid = initialize_from_env(initialization_timeout=60, heartbeat_timeout_seconds=10, shutdown_timeout_seconds=10)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    import easykv
    from easykv.sharding import PartitionAxis, PartitionManager, create_mesh

    mesh = create_mesh({"tp": jax.device_count()})
    pm = PartitionManager(PartitionAxis())
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 4, 2, 64, 8, 8, 16, 0.9, jnp.float32, partition_manager=pm, num_pages_per_layer=32
    )
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    manager = easykv.PageManager(meta)  # runs identically on every host
    seq = manager.claim(1)[0]
    plan = manager.schedule([seq], [12])  # a fresh pool: the plan carries no device work
    keys = np.arange(2 * 12 * 8 * 16, dtype=np.float32).reshape(2, 12, 8, 16)
    cache, _ = cache.write(keys, keys, plan.metadata)
    manager.commit(plan)
    assert_lockstep(manager)
    got, _ = easykv.gather_kv(cache, 1, manager.page_table([seq])[0], 12)
    got = np.asarray(multihost_utils.process_allgather(got, tiled=True))
    assert np.array_equal(got, keys[1])
    print(f"process {pid}/{jax.process_count()}: holds {len(cache[0].key_pages.addressable_shards)} of "
          f"{jax.device_count()} shards; read back exactly")  # fmt: skip


def main() -> None:
    from easykv.multihost import launch_local

    logs = tempfile.mkdtemp(prefix="easykv-multihost-")
    outputs = launch_local([sys.executable, __file__, "--worker"], num_processes=2, cpu_devices_per_process=4,
                           timeout=180, log_dir=logs)  # fmt: skip
    for out in outputs:
        print(next(line for line in out.splitlines() if line.startswith("process ")))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
