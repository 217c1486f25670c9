"""The host-memory tier: prefill saved on a shared-prefix workload, and the page copy bandwidth.

    python benchmarks/bench_host_tier.py [--repeats 15] [--pages 64]
    python benchmarks/bench_host_tier.py --quick    # shorter documents, 2 questions each, 8 pages, 2 repeats (CI)
    python benchmarks/bench_host_tier.py --calls [--quick]   # only part 3 (per-call latency)

1. Shared-prefix workload (the demo model and engine, 8 simulated CPU devices): 16 documents of
   128 tokens, each asked 3 questions in rounds (48 requests, 4 new tokens each, two running at
   a time); the documents' pages are 4x the device pool. Without a host tier the pool's LRU evicts every document before
   it is asked again; with one, evicted pages wait in host memory and come back on the next
   question. Reported: prefill tokens computed, engine steps, wall time, prefix hits per tier,
   and that both runs generate the same tokens. Target (issue 13): >= 2x fewer prefill tokens.
2. Bandwidth: ``--pages`` pages (8 layers, 8 kv heads over tp=8, head_dim 128, page_size 16,
   bf16: 512 KiB a page over all devices) moved device -> host (an offload: gathered from the
   pool, copied to host memory and written into the host pages) and host -> device (an onload:
   read from the host pages, copied and scattered into the pool), timed to completion, against a
   plain ``jax.device_put`` of an array of the same bytes and sharding (device -> pinned_host, and
   host numpy -> device), interleaved, medians. Target: >= 0.8x of the plain copy.

On CPU "device" and host memory are both RAM: a plain copy is one memcpy, while a page transfer
also gathers and scatters pages (three copies), so the ratio here is a floor; on an accelerator
the PCIe copy dominates both.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import easykv  # noqa: E402
from easykv.demo.engine import Engine, Request  # noqa: E402
from easykv.demo.model import CompiledModel, DemoConfig, DemoModel  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402

PAGE = 8


@dataclasses.dataclass(frozen=True)
class Workload:
    docs: int
    doc_tokens: int
    questions: int  # rounds of questions, each asking every document once
    new_tokens: int


# Quick keeps 16 documents: fewer make the pool (a quarter of their pages) too small for the two
# requests running at once.
FULL = Workload(docs=16, doc_tokens=128, questions=3, new_tokens=4)
QUICK = Workload(docs=16, doc_tokens=64, questions=2, new_tokens=2)


def workload(work: Workload) -> list[Request]:
    rng = np.random.default_rng(0)
    docs = [rng.integers(32, 127, work.doc_tokens).tolist() for _ in range(work.docs)]
    requests = []
    for r in range(work.questions):
        for d, doc in enumerate(docs):
            question = list(f"\nQ{r}: what does part {d} say?\nA:".encode())
            requests.append(Request(rid=len(requests), prompt=doc + question, max_new_tokens=work.new_tokens))
    return requests


def serve(host_tier: bool, work: Workload) -> dict:
    cfg = DemoConfig(layers=2)
    model = CompiledModel(DemoModel(cfg))
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    pool = work.docs * work.doc_tokens // PAGE // 4  # the documents need 4x the device pool
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 2, cfg.layers, 192, PAGE, cfg.kv_heads, cfg.head_dim, 0.9,
                                                     jnp.float32, partition_manager=pm, num_pages_per_layer=pool)
    if host_tier:
        meta = meta.replace(host_pages_per_layer=2 * pool * 4)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    manager = easykv.PageManager(meta)
    tier = easykv.HostTier(cache) if host_tier else None
    engine = Engine(model, cache, manager, token_budget=64, max_seqs=2, prefill_chunk=64, host=tier)
    requests = workload(work)
    start = time.perf_counter()
    engine.run(requests)
    wall = time.perf_counter() - start
    m = manager.metrics
    host_hit = m.host.host_hit_tokens if m.host else 0
    return dict(prefill=sum(len(r.prompt) - r.cached for r in requests), steps=engine.step_index, wall=wall,
                device_hit=m.prefix_hit_tokens - host_hit, host_hit=host_hit,
                outputs=[r.output for r in requests], pool=meta.num_pages_per_layer)


def transfer_pool(pages: int) -> tuple[easykv.PagedAttentionCache, easykv.HostTier]:
    """The bandwidth run's pool: ``4 * pages`` device and host pages of 512 KiB (8 layers, 8 kv
    heads over tp=8, head_dim 128, page 16, bf16)."""
    mesh = create_mesh({"dp": 1, "tp": 8})
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp"))
    n = 4 * pages
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 4, 8, 64, 16, 8, 128, 0.9, jnp.bfloat16,
                                                     partition_manager=pm, num_pages_per_layer=n)
    meta = meta.replace(host_pages_per_layer=n)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm)
    return cache, easykv.HostTier(cache)


def bandwidth(pages: int, repeats: int) -> dict:
    cache, tier = transfer_pool(pages)
    n = 4 * pages
    rng = np.random.default_rng(0)
    empty = np.zeros(0, np.int32)
    page_bytes = tier._groups[0].page_bytes
    leaves = jax.tree.leaves((cache.key_pages[0], cache.value_pages[0]))
    floor = [jnp.zeros(a.shape[:2] + (pages,) + a.shape[3:], a.dtype, device=a.sharding) for a in leaves]
    host_kind = [a.sharding.with_memory_kind("pinned_host") for a in floor]
    floor_np = [np.asarray(a) for a in floor]
    times = {k: [] for k in ("offload", "onload", "put_d2h", "put_h2d")}
    for i in range(repeats + 1):
        src = rng.permutation(n)[:pages].astype(np.int32)
        dst = rng.permutation(n)[:pages].astype(np.int32)
        t = time.perf_counter()
        cache = tier.apply(cache, ((src, dst, empty, empty, empty),))
        tier.flush()
        t_off = time.perf_counter() - t
        t = time.perf_counter()
        cache = tier.apply(cache, ((empty, empty, dst, src, empty),))
        jax.block_until_ready(jax.tree.leaves(cache))
        t_on = time.perf_counter() - t
        t = time.perf_counter()
        jax.block_until_ready([jax.device_put(a, s) for a, s in zip(floor, host_kind)])
        t_d2h = time.perf_counter() - t
        t = time.perf_counter()
        jax.block_until_ready([jax.device_put(a, f.sharding) for a, f in zip(floor_np, floor)])
        t_h2d = time.perf_counter() - t
        if i:  # the first round compiles
            for k, v in zip(times, (t_off, t_on, t_d2h, t_h2d)):
                times[k].append(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    mib = pages * page_bytes / 2**20
    return dict(mib=mib, **med)


def call_latency(pages: int, repeats: int) -> dict[str, float]:
    """Median seconds of one `HostTier.apply` of each kind of work alone (see the module doc),
    the kinds interleaved; the first round compiles and is not counted."""
    cache, tier = transfer_pool(pages)
    n = 4 * pages
    rng = np.random.default_rng(1)
    empty = np.zeros(0, np.int32)
    kinds = {"offload 8": ("off", 8), f"offload {pages}": ("off", pages), "onload 8": ("on", 8),
             f"onload {pages}": ("on", pages), "scrub 16": ("scrub", 16)}  # --pages 8: four kinds
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(repeats + 1):
        for name, (kind, count) in kinds.items():
            src = rng.permutation(n)[:count].astype(np.int32)
            dst = rng.permutation(n)[:count].astype(np.int32)
            transfers = {"off": (src, dst, empty, empty, empty), "on": (empty, empty, src, dst, empty)}
            t = time.perf_counter()
            if kind == "scrub":
                cache = tier.apply(cache, ((empty,) * 5,), scrubs=(src,))
            else:
                cache = tier.apply(cache, (transfers[kind],))
            tier.flush()
            jax.block_until_ready(jax.tree.leaves(cache))
            if i:
                times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def report_calls(pages: int, repeats: int) -> None:
    lat = call_latency(pages, repeats)
    print(f"\nper-call latency: one HostTier.apply of each kind alone, pool {4 * pages} pages, median of {repeats}")
    print("| call | ms |")
    print("|---|---|")
    for name, seconds in lat.items():
        print(f"| {name} | {seconds * 1e3:.2f} |")


def report_workload(off: dict, on: dict, work: Workload) -> None:
    print(f"\nshared-prefix workload: {work.docs} documents x {work.doc_tokens} tokens x {work.questions} questions, "
          f"device pool {off['pool']} pages of {PAGE} (the documents need "
          f"{work.docs * work.doc_tokens // PAGE / off['pool']:.0f}x it)")
    print("| run | prefill tokens | engine steps | device hit tokens | host hit tokens | wall s |")
    print("|---|---|---|---|---|---|")
    for name, r in (("no host tier", off), ("host tier", on)):
        print(f"| {name} | {r['prefill']} | {r['steps']} | {r['device_hit']} | {r['host_hit']} | {r['wall']:.2f} |")
    print(f"prefill tokens {off['prefill'] / on['prefill']:.2f}x fewer with the tier (target >= 2x); "
          f"steps {off['steps'] / on['steps']:.2f}x fewer; same tokens generated: {off['outputs'] == on['outputs']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="shorter documents, 2 questions each, 8 pages, 2 repeats: checks the script runs (CI); "
                             "numbers meaningless")
    parser.add_argument("--repeats", type=int, default=None, help="default 15; --quick: 2")
    parser.add_argument("--pages", type=int, default=None, help="default 64; --quick: 8")
    parser.add_argument("--calls", action="store_true", help="only the per-call latency (part 3)")
    args = parser.parse_args()
    work = QUICK if args.quick else FULL
    repeats = args.repeats or (2 if args.quick else 15)
    pages = args.pages or (8 if args.quick else 64)
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices")
    if args.calls:
        report_calls(pages, repeats)
        return
    report_workload(serve(False, work), serve(True, work), work)
    b = bandwidth(pages, repeats)
    print(f"\npage copy bandwidth: {pages} pages = {b['mib']:.0f} MiB, median of {repeats}")
    print("| direction | page transfer ms | plain device_put ms | GiB/s | ratio (target >= 0.8) |")
    print("|---|---|---|---|---|")
    for name, mine, plain in (("device -> host (offload)", b["offload"], b["put_d2h"]),
                              ("host -> device (onload)", b["onload"], b["put_h2d"])):
        print(f"| {name} | {mine * 1e3:.2f} | {plain * 1e3:.2f} | {b['mib'] / 1024 / mine:.2f} | {plain / mine:.2f}x |")
    report_calls(pages, repeats)


if __name__ == "__main__":
    main()
