"""Sleep and wake: device memory handed back and taken again.

    python benchmarks/bench_sleep.py [--mib 256] [--repeats 5] [--dir /tmp/easykv-bench-sleep]
    python benchmarks/bench_sleep.py --quick    # a 16 MiB pool, 2 repeats, a temporary directory (CI)

A bf16 pool of ``--mib`` MiB (4 layers, 8 kv heads, head_dim 128, page_size 16) on 8 simulated
CPU devices, kv heads over tp=8, with a manager holding 8 sequences of 512 tokens (``--quick``:
64). Per repeat, interleaved
(medians reported):

* device bytes held, counted from the live arrays: before sleeping, asleep (level 1 and level
  2), after waking; target (issue 13): sleep frees >= 99% of the pool;
* time to sleep (level 1: device -> pinned_host), to wake (level 1: host -> device, bit for bit;
  level 2: fresh zeroed pages), against what a cache costs without sleep: a fresh ``init_cache``
  and ``restore_cache`` of the same pool from disk; and a plain ``jax.device_put`` of the same
  pinned_host arrays back to device memory (the floor of a level-1 wake), timed just before it.

On CPU "device" and "pinned_host" memory are both host RAM: the bytes are what they are on an
accelerator; the times show the cost of the copies, not of PCIe.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import easykv  # noqa: E402
from easykv.checkpoint.checkpointer import restore_cache, save_cache  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402
from easykv.tiers.sleep import device_bytes  # noqa: E402

LAYERS, HEADS, DIM, PAGE = 4, 8, 128, 16


def build(mib: int, tokens: int):
    mesh = create_mesh({"dp": 1, "tp": 8})
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp"))
    per_page = 2 * LAYERS * HEADS * PAGE * DIM * 2
    pages = max(64, mib * 2**20 // per_page)
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 16, LAYERS, 1024, PAGE, HEADS, DIM, 0.9, jnp.bfloat16,
                                                     partition_manager=pm, num_pages_per_layer=pages)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm)
    manager = easykv.PageManager(cache.metadata)
    rng = np.random.default_rng(0)
    ids = manager.claim(8)
    plan = manager.schedule(ids, [tokens] * 8)  # a fresh pool: the plan carries no device work
    k = rng.standard_normal((LAYERS, 8 * tokens, HEADS, DIM)).astype(jnp.bfloat16)
    cache, _ = cache.write(k, k, plan.metadata)
    manager.commit(plan)
    return mesh, pm, cache, manager


def ms(samples):
    return 1e3 * statistics.median(samples)


def level1_round(state: dict, directory: str, reference: list, times: dict, held: dict) -> None:
    """Sleep (level 1) and wake once, with the floor, a fresh init_cache and a restore from disk."""
    mesh, pm, cache, manager, pool = (state[k] for k in ("mesh", "pm", "cache", "manager", "pool"))
    gc.collect()
    base = device_bytes() - pool
    t0 = time.perf_counter()
    sleeping = easykv.sleep(cache, manager)
    t1 = time.perf_counter()
    held["asleep (level 1)"] = device_bytes() - base
    # the floor: the same pinned_host arrays back to device memory, plainly
    host = jax.tree.leaves((sleeping.key_pages, sleeping.value_pages))
    t2 = time.perf_counter()
    plain = [jax.device_put(h, h.sharding.with_memory_kind("device")) for h in host]
    jax.block_until_ready(plain)
    times["device_put"].append(time.perf_counter() - t2)
    del plain, host
    t2 = time.perf_counter()
    cache, manager = easykv.wake(sleeping)
    t3 = time.perf_counter()
    state["cache"], state["manager"] = cache, manager
    gc.collect()
    held["awake"] = device_bytes() - base
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(cache), reference))
    times["sleep1"].append(t1 - t0)
    times["wake1"].append(t3 - t2)
    t0 = time.perf_counter()
    fresh = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, cache.metadata, pm)
    jax.block_until_ready(jax.tree.leaves(fresh))
    times["init"].append(time.perf_counter() - t0)
    del fresh
    t0 = time.perf_counter()
    restored = restore_cache(directory, mesh=mesh, partition_manager=pm)
    jax.block_until_ready(jax.tree.leaves(restored.cache))
    times["restore"].append(time.perf_counter() - t0)


def level2_round(state: dict, times: dict, held: dict) -> None:
    """Sleep (level 2: the pages are discarded) and wake to zeroed pages, once."""
    manager = state["manager"]
    for s in manager.active_ids:
        manager.release(s)
    gc.collect()
    base = device_bytes() - state["pool"]
    t0 = time.perf_counter()
    sleeping = easykv.sleep(state["cache"], manager, level=2)
    t1 = time.perf_counter()
    held["asleep (level 2)"] = device_bytes() - base
    state["cache"], state["manager"] = easykv.wake(sleeping)
    jax.block_until_ready(jax.tree.leaves(state["cache"]))
    t2 = time.perf_counter()
    times["sleep2"].append(t1 - t0)
    times["wake2"].append(t2 - t1)


def report(state: dict, times: dict, held: dict, repeats: int) -> None:
    pool, cache = state["pool"], state["cache"]
    print(f"pool: {pool / 2**20:.1f} MiB over 8 devices ({cache.metadata.num_pages_per_layer} pages x {LAYERS} "
          f"layers, bf16); {repeats} repeats, medians\n")
    print("| measure | value | target |\n|---|---|---|")
    print(f"| device bytes before sleep | {pool / 2**20:.1f} MiB | |")
    for name, value in held.items():
        freed = 1 - value / pool
        target = ">= 99% freed" if "asleep" in name else "the pool"
        ok = ("ok" if freed >= 0.99 else "MISSED") if "asleep" in name else ("ok" if value == pool else "MISSED")
        print(f"| device bytes {name} | {value / 2**20:.2f} MiB ({100 * freed:.2f}% freed) | {target} {ok} |"
              if "asleep" in name else f"| device bytes {name} | {value / 2**20:.1f} MiB | {target} {ok} |")
    print(f"| sleep, level 1 | {ms(times['sleep1']):.1f} ms | |")
    print(f"| wake, level 1 (bit for bit) | {ms(times['wake1']):.1f} ms | |")
    print(f"| plain jax.device_put of the same bytes | {ms(times['device_put']):.1f} ms | floor |")
    print(f"| sleep, level 2 | {ms(times['sleep2']):.1f} ms | |")
    print(f"| wake, level 2 (zeroed pages) | {ms(times['wake2']):.1f} ms | |")
    print(f"| init_cache of the same pool | {ms(times['init']):.1f} ms | |")
    print(f"| restore_cache of the same pool from disk | {ms(times['restore']):.1f} ms | |")
    print(f"\nwake level 1 vs init_cache + restore from disk: "
          f"{(ms(times['init']) + ms(times['restore'])) / ms(times['wake1']):.1f}x faster; "
          f"vs the device_put floor: {ms(times['device_put']) / ms(times['wake1']):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a 16 MiB pool, 2 repeats, a temporary directory: checks the script runs (CI); numbers "
                             "meaningless")
    parser.add_argument("--mib", type=int, default=None, help="pool size (default 256; --quick: 16)")
    parser.add_argument("--repeats", type=int, default=None, help="default 5; --quick: 2")
    parser.add_argument("--dir", default=None, help="where the pool is saved, removed afterwards (default "
                                                    "/tmp/easykv-bench-sleep; --quick: a temporary one)")
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    directory = args.dir or (tempfile.mkdtemp(prefix="easykv-bench-sleep-") if args.quick
                             else "/tmp/easykv-bench-sleep")
    warnings.simplefilter("ignore")
    mesh, pm, cache, manager = build(args.mib or (16 if args.quick else 256), 64 if args.quick else 512)
    state = dict(mesh=mesh, pm=pm, cache=cache, manager=manager, pool=device_bytes(cache))
    del cache, manager  # state holds the live ones: sleeping must free the only reference
    times = {k: [] for k in ("sleep1", "wake1", "sleep2", "wake2", "init", "restore", "device_put")}
    held = {}
    try:
        shutil.rmtree(directory, ignore_errors=True)
        save_cache(directory, state["cache"], state["manager"])
        reference = [np.asarray(a) for a in jax.tree.leaves(state["cache"])]
        for _ in range(repeats):
            level1_round(state, directory, reference, times, held)
        for _ in range(repeats):  # level 2 after the level-1 rounds: it discards the pages
            level2_round(state, times, held)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    report(state, times, held, repeats)


if __name__ == "__main__":
    main()
