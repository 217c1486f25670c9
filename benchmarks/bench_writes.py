"""Write cost vs pool size, and init_cache memory, on 8 simulated CPU devices.

    python benchmarks/bench_writes.py            # the table for docs/benchmarks.md
    python benchmarks/bench_writes.py --quick    # pools of 128 and 256 pages, 5 calls, a 32 MiB init (CI)

Setup (issue 2): bf16, 4 layers, 8 kv heads (split over tp=8), head_dim 128, page_size 16.
A decode write is 32 sequences x 1 token, a prefill write is one 512-token chunk, both for all
4 layers in one jitted, donating call (`PagedAttentionCache.write`). Each figure is the median
of many calls; ratios are taken within the same run. The "native bf16" column stores pages as
bf16 instead of raw uint16 bits, to show why easykv uses raw bits on CPU. The floor row does
the same decode scatter with bare jax into one array holding every layer's K and V (split by kv
head, raw bits), the plain cost easykv's write is compared with.

The memory part runs in a fresh subprocess (median of 3): it allocates a >= 2 GiB pool with
init_cache and reports the peak RSS growth over the pool bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import subprocess
import sys
import time

LAYERS, HEADS, HEAD_DIM, PAGE = 4, 8, 128, 16


@dataclasses.dataclass(frozen=True)
class Sizes:
    pools: tuple[int, int]  # pages per layer of the small and the large pool
    repeats: int  # calls per figure
    native_repeats: int  # calls per figure of native bf16 pages: slow on CPU
    init_pages: int  # pool of the memory part: 8192 pages x 4 layers x 2 x 16 x 8 x 128 x 2 B = 2 GiB
    init_runs: int  # fresh processes of the memory part (median)


# A pool holds at least one 2048-token sequence (128 pages): create refuses less.
FULL = Sizes(pools=(256, 2048), repeats=200, native_repeats=20, init_pages=8192, init_runs=3)
QUICK = Sizes(pools=(128, 256), repeats=5, native_repeats=2, init_pages=128, init_runs=1)


def _setup_jax() -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)


def _interleaved_medians(fns: dict, repeats: int) -> dict:
    """Median ms of each callable, alternating between them so drift hits all alike."""
    import numpy as np

    for fn in fns.values():  # compile and warm up
        fn()
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v) * 1e3) for k, v in times.items()}


def _cache(num_pages: int, native: bool, devices: int = 8):

    import jax
    import jax.numpy as jnp

    import easykv
    from easykv.sharding import PartitionAxis, PartitionManager, create_mesh
    from easykv.storage.pages import allocate_pages

    mesh = create_mesh({"tp": devices}, devices=jax.devices()[:devices])
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp"))
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 32, LAYERS, 2048, PAGE, HEADS, HEAD_DIM, 0.9, jnp.bfloat16,
        partition_manager=pm, num_pages_per_layer=num_pages,
    )  # fmt: skip
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm)
    if native:  # same pages, stored as bf16 itself (what XLA:CPU rewrites whole on scatter)
        template = jax.ShapeDtypeStruct(cache.key_pages[0].shape, jnp.bfloat16)
        k, v = allocate_pages((template, template), cache.layout)
        cache = easykv.PagedAttentionCache(meta, (k,), (v,), cache.layout)
    return meta, cache


def write_calls(num_pages: int, native: bool, devices: int = 8) -> dict:
    """Callables for one pool: the full `cache.write` from host metadata (decode and prefill),
    and the jitted decode step alone with its slots already on the devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import easykv
    from easykv.storage.cache import write_all
    from easykv.storage.writes import token_slots

    meta, cache = _cache(num_pages, native, devices)
    mesh = cache[0].layout.mesh
    rng = np.random.default_rng(0)
    # 32 decoding sequences spread over the pool, each with its own pages.
    table = rng.permutation(num_pages)[: 32 * 4].reshape(32, 4).astype(np.int32)
    table = np.pad(table, ((0, 0), (0, meta.num_pages_per_sequence - 4)), constant_values=-1)
    decode = easykv.PagedAttentionMetadata.for_decode(table, rng.integers(0, 64, 32), cache_metadata=meta)
    prefill_row = rng.permutation(num_pages)[:32].astype(np.int32)
    prefill = easykv.PagedAttentionMetadata.for_prefill(prefill_row, 512, cache_metadata=meta)
    # New K/V arrive split by kv head, as a tensor-parallel model's projections produce them.
    heads = NamedSharding(mesh, P(None, None, "tp", None))
    kd = jax.device_put(jnp.asarray(rng.normal(size=(LAYERS, 32, HEADS, HEAD_DIM)), jnp.bfloat16), heads)
    kp = jax.device_put(jnp.asarray(rng.normal(size=(LAYERS, 512, HEADS, HEAD_DIM)), jnp.bfloat16), heads)
    slots = jax.device_put(token_slots(decode, meta), NamedSharding(mesh, P()))
    state = {"cache": cache}

    def full(k, step_meta):
        def run():
            state["cache"], _ = state["cache"].write(k, k, step_meta)
            jax.block_until_ready(state["cache"])
        return run

    def step_only():
        state["cache"], _ = write_all(state["cache"], kd, kd, (slots,))
        jax.block_until_ready(state["cache"])

    # The floor: the same decode scatter done plainly with bare jax, every layer's K and V
    # stacked in one uint16 array split by kv head (the layout of issue 12's stacked storage).
    stacked_sharding = NamedSharding(mesh, P(None, "tp", None, None))
    floor_state = {"pages": jax.device_put(jnp.zeros((2 * LAYERS, HEADS, num_pages * PAGE, HEAD_DIM), jnp.uint16),
                                           stacked_sharding)}
    new_bits = jax.device_put(jax.lax.bitcast_convert_type(jnp.concatenate([kd, kd]), jnp.uint16).transpose(0, 2, 1, 3),
                              stacked_sharding)

    @functools.partial(jax.jit, donate_argnums=0)
    def plain_scatter(pages, new, slots):
        return pages.at[:, :, slots].set(new, mode="drop")

    def floor():
        floor_state["pages"] = plain_scatter(floor_state["pages"], new_bits, slots)
        jax.block_until_ready(floor_state["pages"])

    return {"decode": full(kd, decode), "prefill": full(kp, prefill), "decode_step": step_only, "floor": floor}


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
    from easykv.sharding import PartitionAxis, PartitionManager, create_mesh

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


def memory_table(sizes: Sizes) -> None:
    """init_cache's time and peak RSS growth, each run in a fresh process (the median one)."""
    runs = []
    for _ in range(sizes.init_runs):
        out = subprocess.run(
            [sys.executable, __file__, "--memory-child", str(sizes.init_pages)],
            check=True, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )  # fmt: skip
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    fig = sorted(runs, key=lambda r: r["peak_growth"])[len(runs) // 2]
    print("| init_cache pool | time | peak RSS growth | growth / pool bytes |")
    print("|---|---|---|---|")
    print(f"| {fig['pool'] / 2**30:.2f} GiB ({sizes.init_pages} pages x {LAYERS} layers) | {fig['seconds']:.2f} s | "
          f"{fig['peak_growth'] / 2**30:.2f} GiB | {fig['peak_growth'] / fig['pool']:.3f}x |")  # fmt: skip


def write_table(sizes: Sizes) -> None:
    """Write cost in the small and the large pool, raw bits and native bf16, interleaved."""
    small, large = sizes.pools
    results = {}
    for native in (False, True):
        calls = {(pages, kind): fn for pages in sizes.pools for kind, fn in write_calls(pages, native).items()}
        reps = sizes.native_repeats if native else sizes.repeats
        for (pages, kind), ms in _interleaved_medians(calls, reps).items():
            results.setdefault((native, pages), {})[kind] = ms
    # The same decode step on a 1-device mesh: what the 8-device figures pay for simulating 8
    # devices on this machine's 2 cores (8 device programs per step).
    one = _interleaved_medians({p: write_calls(p, False, devices=1)["decode_step"] for p in sizes.pools},
                               sizes.repeats)
    print()
    print(f"| write (all 4 layers) | {small} pages | {large} pages | {large}/{small} | native bf16 {large}/{small} |")
    print("|---|---|---|---|---|")
    rows = (("decode", "decode, 32 seqs x 1 token (cache.write)"), ("decode_step", "decode, jitted step alone"),
            ("prefill", "prefill, 512 tokens (cache.write)"))  # fmt: skip
    for kind, label in rows:
        a, b = results[(False, small)][kind], results[(False, large)][kind]
        na, nb = results[(True, small)][kind], results[(True, large)][kind]
        print(f"| {label} | {a:.3f} ms | {b:.3f} ms | {b / a:.2f}x | {nb / na:.2f}x ({na:.2f} -> {nb:.2f} ms) |")
    print(f"| decode, jitted step alone, 1 device | {one[small]:.3f} ms | {one[large]:.3f} ms | "
          f"{one[large] / one[small]:.2f}x | |")
    fa, fb = results[(False, small)]["floor"], results[(False, large)]["floor"]
    print(f"| decode, plain jax scatter into one stacked array (the floor) | {fa:.3f} ms | {fb:.3f} ms | "
          f"{fb / fa:.2f}x | |")
    step = results[(False, large)]["decode_step"]
    print(f"\njitted decode step / plain floor, {large} pages: {step / fb:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small pools, 5 calls, one small init: checks the script runs (CI); numbers meaningless")
    parser.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child is not None:
        memory_child(args.memory_child)
        return
    _setup_jax()
    sizes = QUICK if args.quick else FULL
    print(f"easykv write benchmark: bf16, {LAYERS} layers, {HEADS} kv heads on tp=8, head_dim {HEAD_DIM}, "
          f"page_size {PAGE}; medians of {sizes.repeats} calls, all layers in one jit")  # fmt: skip
    memory_table(sizes)
    write_table(sizes)


if __name__ == "__main__":
    main()
