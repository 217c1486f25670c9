"""The demo engine with the paged cache vs a dense cache preallocated at max length per request.

    python benchmarks/bench_demo.py
    python benchmarks/bench_demo.py --quick    # 4 requests of 4 tokens, a 1-layer model (CI)

Throughput: a model of the demo's architecture at DemoConfig's default sizes (4 layers, 16 q / 8 kv heads,
head_dim 32, f32, random weights; larger than `easykv demo`'s trained model) serves the same
24 requests (shared system prompt, lengths up to 256 tokens) with the same scheduler (token
budget 64 per step, up to 16 sequences), on 8 simulated CPU devices. Paged: kv heads split over
tp=8, pages read through the page tables, prefix caching on (its default) and off. Dense: every
request holds a (max_len, kv_heads, head_dim) row and attends over all of it. Each engine runs
the workload once to compile, then the timed run; generated tokens / second of the timed run.

Admission: under the same memory, requests with lengths uniform in [1, max_len] are admitted
until the memory is full: the dense cache reserves max_len tokens per request, the paged cache
ceil(length / page_size) pages (PageManager.reserve until CacheFullError).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import easykv  # noqa: E402
from easykv.demo.engine import DenseEngine, Engine  # noqa: E402
from easykv.demo.model import CompiledModel, DemoConfig, DemoModel  # noqa: E402
from easykv.demo.workload import make_requests  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402

MAX_LEN, PAGE, BUDGET, SEQS = 256, 8, 64, 16


@dataclasses.dataclass(frozen=True)
class Workload:
    requests: int
    new_tokens: int
    layers: int
    admission: tuple[tuple[int, int, int], ...]  # (pages, page size, max length) per row


FULL = Workload(24, 48, DemoConfig().layers, ((4096, 16, 2048), (16384, 16, 4096)))
QUICK = Workload(4, 4, 1, ((256, 16, 512),))


def run_paged(model: CompiledModel, meta, mesh, pm, prefix: bool, work: Workload) -> tuple[float, int]:
    def once() -> tuple[float, int]:
        cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
        mgr = easykv.PageManager(meta, enable_prefix_caching=prefix)
        engine = Engine(model, cache, mgr, token_budget=BUDGET, max_seqs=SEQS, prefill_chunk=BUDGET // 2)
        requests = make_requests(work.requests, work.new_tokens, seed=1, fork=False)
        t0 = time.perf_counter()
        engine.run(requests)
        jax.block_until_ready(engine.cache)
        return time.perf_counter() - t0, sum(len(r.output) for r in requests)

    once()
    return once()


def run_dense(model: CompiledModel, meta, cfg: DemoConfig, work: Workload) -> tuple[float, int]:
    def once() -> tuple[float, int]:
        shape = (cfg.layers, SEQS, MAX_LEN, cfg.kv_heads, cfg.head_dim)
        mgr = easykv.PageManager(meta, enable_prefix_caching=False)  # scheduling bookkeeping only
        engine = DenseEngine(model, (jnp.zeros(shape), jnp.zeros(shape)), mgr, token_budget=BUDGET, max_seqs=SEQS,
                             prefill_chunk=BUDGET // 2)  # fmt: skip
        requests = make_requests(work.requests, work.new_tokens, seed=1, fork=False)
        t0 = time.perf_counter()
        engine.run(requests)
        jax.block_until_ready(engine.cache)
        return time.perf_counter() - t0, sum(len(r.output) for r in requests)

    once()
    return once()


def admission(meta_pages: int, page_size: int, max_len: int, seed: int = 0) -> tuple[int, int]:
    """(paged, dense) requests admitted at once in memory for meta_pages pages of page_size."""
    meta = easykv.PagedAttentionCacheMetaData(
        batch_size=4096, num_hidden_layers=1, num_pages_per_layer=meta_pages,
        num_pages_per_sequence=max_len // page_size, max_sequences=max_len, page_size=page_size,
        num_kv_heads=1, kv_head_dim_size=8, hbm_utilization=0.9,
    )  # fmt: skip
    mgr = easykv.PageManager(meta, enable_prefix_caching=False)
    rng = np.random.default_rng(seed)
    admitted = 0
    while True:
        seq = mgr.claim(1)[0]
        try:
            mgr.schedule([seq], [int(rng.integers(1, max_len + 1))])  # its pages reserved (the plan left open)
        except easykv.CacheFullError:
            break
        admitted += 1
    dense = meta_pages * page_size // max_len
    return admitted, dense


def throughput(work: Workload) -> dict[str, tuple[float, int]]:
    """(seconds, generated tokens) of the timed run of each engine."""
    cfg = DemoConfig(layers=work.layers)
    model = CompiledModel(DemoModel(cfg))
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    # The paged pool holds the same tokens as the dense rows: SEQS x MAX_LEN.
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, SEQS, cfg.layers, MAX_LEN, PAGE, cfg.kv_heads, cfg.head_dim, 0.9, jnp.float32,
        partition_manager=pm, num_pages_per_layer=SEQS * MAX_LEN // PAGE,
    )  # fmt: skip
    return {
        "paged, prefix caching on": run_paged(model, meta, mesh, pm, True, work),
        "paged, prefix caching off": run_paged(model, meta, mesh, pm, False, work),
        "dense, max length per request": run_dense(model, meta, cfg, work),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="4 short requests on a 1-layer model: checks the script runs (CI); numbers meaningless")
    work = QUICK if parser.parse_args().quick else FULL
    results = throughput(work)
    dense_tps = results["dense, max length per request"][1] / results["dense, max length per request"][0]
    print(f"{work.requests} requests, up to {work.new_tokens} new tokens each, token budget {BUDGET}, "
          f"max length {MAX_LEN}, {work.layers}-layer demo model\n")
    print("| engine | generated tokens | time | tokens/s | vs dense |")
    print("|---|---|---|---|---|")
    for name, (seconds, tokens) in results.items():
        tps = tokens / seconds
        print(f"| {name} | {tokens} | {seconds:.2f} s | {tps:.1f} | {tps / dense_tps:.2f}x |")
    print()
    print("| memory (tokens) | max length | page size | paged admits | dense admits | ratio |")
    print("|---|---|---|---|---|---|")
    for pages, page_size, max_len in work.admission:
        paged, dense = admission(pages, page_size, max_len)
        print(f"| {pages * page_size:,} | {max_len} | {page_size} | {paged} | {dense} | {paged / dense:.2f}x |")


if __name__ == "__main__":
    main()
