"""Write cost vs pool size, and init_cache memory, on 8 simulated CPU devices.

    python benchmarks/bench_writes.py            # the table for the README
    python benchmarks/bench_writes.py --quick    # fewer repeats

Setup (issue 2): bf16, 4 layers, 8 kv heads (split over tp=8), head_dim 128, page_size 16.
A decode write is 32 sequences x 1 token, a prefill write is one 512-token chunk, both for all
4 layers in one jitted, donating call (`PagedAttentionCache.write`). Each figure is the median
of many calls; ratios are taken within the same run. The "native bf16" column stores pages as
bf16 instead of raw uint16 bits, to show why easykv uses raw bits on CPU.

The memory part runs in a fresh subprocess: it allocates a >= 2 GiB pool with init_cache and
reports the peak RSS growth over the pool bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

LAYERS, HEADS, HEAD_DIM, PAGE = 4, 8, 128, 16


def _setup_jax() -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)


def _median_ms(fn, repeats: int) -> float:
    import numpy as np

    fn()  # compile and warm up
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def _cache(num_pages: int, native: bool):
    import dataclasses

    import jax.numpy as jnp

    import easykv
    from easykv.pages import allocate_pages
    from sharding import PartitionAxis, PartitionManager, create_mesh

    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp"))
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 32, LAYERS, 2048, PAGE, HEADS, HEAD_DIM, 0.9, jnp.bfloat16,
        partition_manager=pm, num_pages_per_layer=num_pages,
    )  # fmt: skip
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm)
    if native:  # same pages, stored as bf16 itself (what XLA:CPU rewrites whole on scatter)
        layout = cache[0].layout
        shape = cache[0].key_pages.shape
        arrays = allocate_pages((shape,) * 2 * LAYERS, (jnp.bfloat16,) * 2 * LAYERS, layout)
        views = [dataclasses.replace(v, key_pages=arrays[2 * i], value_pages=arrays[2 * i + 1])
                 for i, v in enumerate(cache.views)]  # fmt: skip
        cache = easykv.PagedAttentionCache(tuple(views))
    return meta, cache


def bench_writes(num_pages: int, native: bool, repeats: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import easykv

    meta, cache = _cache(num_pages, native)
    rng = np.random.default_rng(0)
    # 32 decoding sequences spread over the pool, each with its own pages.
    table = rng.permutation(num_pages)[: 32 * 4].reshape(32, 4).astype(np.int32)
    table = np.pad(table, ((0, 0), (0, meta.num_pages_per_sequence - 4)), constant_values=-1)
    decode = easykv.PagedAttentionMetadata.for_decode(table, rng.integers(0, 64, 32), cache_metadata=meta)
    prefill_row = rng.permutation(num_pages)[:32].astype(np.int32)
    prefill = easykv.PagedAttentionMetadata.for_prefill(prefill_row, 512, cache_metadata=meta)
    kd = jnp.asarray(rng.normal(size=(LAYERS, 32, HEADS, HEAD_DIM)), jnp.bfloat16)
    kp = jnp.asarray(rng.normal(size=(LAYERS, 512, HEADS, HEAD_DIM)), jnp.bfloat16)
    state = {"cache": cache}

    def step(k, meta_rt):
        def run():
            state["cache"], dropped = state["cache"].write(k, k, meta_rt)
            jax.block_until_ready(state["cache"])
        return run

    return {
        "decode": _median_ms(step(kd, decode), repeats),
        "prefill": _median_ms(step(kp, prefill), repeats),
    }


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def memory_child(num_pages: int) -> None:
    """Run in a subprocess: init a pool of num_pages and print JSON figures."""
    _setup_jax()
    import jax
    import jax.numpy as jnp

    import easykv
    from sharding import PartitionAxis, PartitionManager, create_mesh

    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp"))
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 32, LAYERS, 2048, PAGE, HEADS, HEAD_DIM, 0.9, jnp.bfloat16,
        partition_manager=pm, num_pages_per_layer=num_pages,
    )  # fmt: skip
    jax.block_until_ready(jnp.zeros(8) + 1)  # start the runtime before measuring
    before = _rss_bytes()
    t0 = time.perf_counter()
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm)
    jax.block_until_ready(cache)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pool = meta.bytes_per_device * 8
    print(json.dumps({"pool": pool, "seconds": seconds, "peak_growth": peak - before}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child is not None:
        memory_child(args.memory_child)
        return
    _setup_jax()
    repeats = 30 if args.quick else 200
    print(f"easykv write benchmark: bf16, {LAYERS} layers, {HEADS} kv heads on tp=8, head_dim {HEAD_DIM}, "
          f"page_size {PAGE}; medians of {repeats} calls, all layers in one jit")  # fmt: skip
    results = {}
    for native in (False, True):
        for pages in (256, 2048):
            results[(native, pages)] = bench_writes(pages, native, repeats)
    print()
    print("| write (all 4 layers) | 256 pages | 2048 pages | 2048/256 | native bf16 2048/256 |")
    print("|---|---|---|---|---|")
    for kind, label in (("decode", "decode, 32 seqs x 1 token"), ("prefill", "prefill, 512 tokens")):
        a, b = results[(False, 256)][kind], results[(False, 2048)][kind]
        na, nb = results[(True, 256)][kind], results[(True, 2048)][kind]
        print(f"| {label} | {a:.3f} ms | {b:.3f} ms | {b / a:.2f}x | {nb / na:.2f}x ({na:.2f} -> {nb:.2f} ms) |")

    # 2 GiB and more: 4 layers x 2 (K, V) x pages x 16 tokens x 8 heads x 128 x 2 bytes.
    pages = 8192  # 4 layers x 2 x 8192 x 16 x 8 x 128 x 2 B = 2 GiB
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", str(pages)],
        check=True, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    fig = json.loads(out.stdout.strip().splitlines()[-1])
    print()
    print("| init_cache pool | time | peak RSS growth | growth / pool bytes |")
    print("|---|---|---|---|")
    print(f"| {fig['pool'] / 2**30:.2f} GiB ({pages} pages x {LAYERS} layers) | {fig['seconds']:.2f} s | "
          f"{fig['peak_growth'] / 2**30:.2f} GiB | {fig['peak_growth'] / fig['pool']:.3f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
