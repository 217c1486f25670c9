"""The host-memory tier: prefill saved on a shared-prefix workload, and the page copy bandwidth.

    python benchmarks/bench_host_tier.py [--repeats 15] [--pages 16,64,256]
    python benchmarks/bench_host_tier.py --quick    # shorter documents, 2 questions each, 8 pages, 2 repeats (CI)
    python benchmarks/bench_host_tier.py --calls [--quick]   # only part 3 (per-call latency)

1. Shared-prefix workload (the demo model and engine, 8 simulated CPU devices): 16 documents of
   128 tokens, each asked 3 questions in rounds (48 requests, 4 new tokens each, two running at
   a time); the documents' pages are 4x the device pool. Without a host tier the pool's LRU evicts every document before
   it is asked again; with one, evicted pages wait in host memory and come back on the next
   question. Reported: prefill tokens computed, engine steps, wall time, prefix hits per tier,
   and that both runs generate the same tokens. Target (issue 13): >= 2x fewer prefill tokens.
2. Bandwidth: 16, 64 and 256 pages (``--pages``; 8 layers, 8 kv heads over tp=8, head_dim 128,
   page_size 16, bf16: 512 KiB a page over all devices) moved device -> host (an offload: gathered
   from the pool, copied to host memory and written into the host pages; timed until they are
   there) and host -> device (an onload: read from the host pages, copied and scattered into the
   pool; timed until the pool holds them), against the same bytes moved plainly: ``np.asarray``
   of a device array of the pool's sharding, made before the clock starts, and
   ``jax.device_put`` of a numpy array onto that sharding; interleaved, medians.
   Target: >= 0.8x of the plain copy.
3. Per-call latency: one `HostTier.apply` of each kind of work alone.

On CPU "device" and host memory are both RAM: a plain copy is one pass over the bytes, while a
page transfer also gathers the pages on one side and scatters them on the other (an offload two
passes, an onload three), so the ratio here is a floor; on an accelerator the PCIe copy dominates
both.
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
    """Median seconds of an offload and an onload of ``pages`` random pages and of their floors,
    interleaved. An offload is timed until its bytes are in the host pages (`HostTier.flush`), an
    onload until the pool holds them; the floors move an array of the same bytes and sharding
    (the pool's arrays cut to ``pages`` pages): ``np.asarray`` of it, made on the devices before
    the clock starts (device -> host), and ``jax.device_put`` of it from numpy (host -> device)."""
    cache, tier = transfer_pool(pages)
    n = 4 * pages
    rng = np.random.default_rng(0)
    empty = np.zeros(0, np.int32)
    page_bytes = tier._groups[0].page_bytes
    leaves = jax.tree.leaves((cache.key_pages[0], cache.value_pages[0]))
    floor_np = [rng.integers(0, 2**16, a.shape[:2] + (pages,) + a.shape[3:], dtype=np.uint16).view(a.dtype)
                for a in leaves]
    times: dict[str, list[float]] = {k: [] for k in ("offload", "onload", "get", "put")}
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
        on_device = jax.block_until_ready([jax.device_put(a, f.sharding) for a, f in zip(floor_np, leaves)])
        t_put = time.perf_counter() - t
        # a fresh device array each round: np.asarray caches its host copy on the array
        t = time.perf_counter()
        landed = [np.asarray(a) for a in on_device]
        t_get = time.perf_counter() - t
        assert all(np.array_equal(x.view(np.uint16), y.view(np.uint16)) for x, y in zip(landed, floor_np))
        if i:  # the first round compiles
            for k, v in zip(times, (t_off, t_on, t_get, t_put)):
                times[k].append(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    return dict(mib=pages * page_bytes / 2**20, **med)


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


def page_counts(text: str) -> list[int]:
    """``--pages``: positive page counts, comma separated."""
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--pages takes positive page counts separated by commas (e.g. 16,64,256), "
                                         f"got {text!r}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="shorter documents, 2 questions each, 8 pages, 2 repeats: checks the script runs (CI); "
                             "numbers meaningless")
    parser.add_argument("--repeats", type=int, default=None, help="default 15; --quick: 2")
    parser.add_argument("--pages", type=page_counts, default=None,
                        help="page counts moved, comma separated (default 16,64,256; --quick: 8); the per-call "
                             "latency runs on the largest up to 64")
    parser.add_argument("--calls", action="store_true", help="only the per-call latency (part 3)")
    args = parser.parse_args()
    work = QUICK if args.quick else FULL
    repeats = args.repeats or (2 if args.quick else 15)
    counts = args.pages or ([8] if args.quick else [16, 64, 256])
    call_pages = max([c for c in counts if c <= 64] or [min(counts)])
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, {os.cpu_count()} cores")
    if args.calls:
        report_calls(call_pages, repeats)
        return
    report_workload(serve(False, work), serve(True, work), work)
    print(f"\npage copy bandwidth: pages of 512 KiB moved by HostTier.apply against the same bytes moved plainly "
          f"(np.asarray of a device array / jax.device_put of a numpy array, same sharding), median of {repeats}")
    print("| pages | MiB | offload ms | np.asarray ms | ratio | onload ms | device_put ms | ratio (target >= 0.8) |")
    print("|---|---|---|---|---|---|---|---|")
    for pages in counts:
        b = bandwidth(pages, repeats)
        print(f"| {pages} | {b['mib']:.0f} | {b['offload'] * 1e3:.2f} | {b['get'] * 1e3:.2f} | "
              f"{b['get'] / b['offload']:.2f}x | {b['onload'] * 1e3:.2f} | {b['put'] * 1e3:.2f} | "
              f"{b['put'] / b['onload']:.2f}x |")
    report_calls(call_pages, repeats)


if __name__ == "__main__":
    main()
