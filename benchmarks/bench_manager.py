"""Host cost of the PageManager: is scheduling ever the bottleneck of a step?

Prints one table. Targets (issue 3): one decode step's metadata for 256 running sequences,
page-boundary allocations included, under 0.5 ms median; a prefix lookup for a 4096-token
prompt under 1 ms; a shared-prefix workload (64 requests, 90% common prefix) needing at least
80% fewer prefill tokens with prefix caching than without.

    python benchmarks/bench_manager.py            # the table for docs/benchmarks.md
    python benchmarks/bench_manager.py --quick    # a tenth of the repetitions: a smoke run (CI)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from easykv.manager.manager import PageManager  # noqa: E402
from easykv.spec.metadata import PagedAttentionCacheMetaData  # noqa: E402

PAGE = 16


def _meta(batch: int, max_len: int, pages: int) -> PagedAttentionCacheMetaData:
    return PagedAttentionCacheMetaData(
        batch_size=batch, num_hidden_layers=32, num_pages_per_layer=pages,
        num_pages_per_sequence=-(-max_len // PAGE), max_sequences=max_len, page_size=PAGE,
        num_kv_heads=8, kv_head_dim_size=128, hbm_utilization=0.9)


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def bench_decode(steps: int) -> dict[str, float]:
    """256 running sequences of random lengths; each step schedules one token each (the plan's
    metadata allocates a page for every sequence crossing a page boundary) and commits the tokens."""
    n, max_len = 256, 4096
    rng = np.random.default_rng(0)
    pm = PageManager(_meta(n, max_len, n * (max_len // PAGE)))
    ids = pm.claim(n)
    for s in ids:
        prompt = rng.integers(0, 32000, int(rng.integers(16, 1024)))
        pm.commit(pm.schedule([s], [prompt.size]), [prompt])
    build, commit, boundary = [], [], 0
    tokens = rng.integers(0, 32000, (steps, n))
    for t in range(steps):
        before = pm.metrics.used_pages
        t0 = time.perf_counter()
        plan = pm.schedule(ids, 1)
        t1 = time.perf_counter()
        pm.commit(plan, tokens[t])
        t2 = time.perf_counter()
        build.append(t1 - t0)
        commit.append(t2 - t1)
        boundary += pm.metrics.used_pages - before
    pm.check_invariants()
    both = [a + b for a, b in zip(build, commit)]
    return {"build": _median_ms(build), "commit": _median_ms(commit), "both": _median_ms(both),
            "p99": 1e3 * float(np.percentile(both, 99)), "pages_per_step": boundary / steps}


def bench_lookup(repeats: int) -> dict[str, float]:
    """A 4096-token prompt whose pages are all cached: the pure lookup, and attach + release."""
    max_len = 4096
    pm = PageManager(_meta(4, max_len, 4 * (max_len // PAGE)))
    prompt = np.random.default_rng(1).integers(0, 32000, max_len)
    [s] = pm.claim(1)
    pm.commit(pm.schedule([s], [prompt.size]), [prompt])
    lookup, attach = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        hit = pm.cached_prefix_length(prompt)
        t1 = time.perf_counter()
        [b] = pm.claim(1)
        pm.match_prefix(b, prompt)
        pm.release(b)
        t2 = time.perf_counter()
        lookup.append(t1 - t0)
        attach.append(t2 - t1)
    assert hit == (max_len - 1) // PAGE * PAGE, hit
    return {"lookup": _median_ms(lookup), "attach": _median_ms(attach), "hit": hit}


def bench_shared_prefix(caching: bool) -> dict[str, float]:
    """64 requests of 1024 prompt tokens, the first 90% common, admitted one after another and
    kept running (16 decode steps each); counts prefill tokens and peak pages."""
    n, length, decode = 64, 1024, 16
    rng = np.random.default_rng(2)
    common = rng.integers(0, 32000, int(0.9 * length))
    pm = PageManager(_meta(n, 2048, n * (2048 // PAGE)), enable_prefix_caching=caching)
    prefill, ids = 0, []
    for _ in range(n):
        prompt = np.concatenate([common, rng.integers(0, 32000, length - common.size)])
        [s] = pm.claim(1)
        done = pm.match_prefix(s, prompt)
        pm.commit(pm.schedule([s], [prompt.size - done]), [prompt[done:]])
        prefill += prompt.size - done
        ids.append(s)
    for _ in range(decode):
        pm.commit(pm.schedule(ids, 1), rng.integers(0, 32000, n))
    pm.check_invariants()
    return {"prefill": prefill, "pages": pm.metrics.used_pages, "hit_rate": pm.metrics.token_hit_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a tenth of the repetitions: checks the script runs (CI); numbers meaningless")
    args = parser.parse_args()
    steps, repeats = (100, 50) if args.quick else (1000, 500)
    dec = bench_decode(steps)
    look = bench_lookup(repeats)
    on, off = bench_shared_prefix(True), bench_shared_prefix(False)
    saved = 1 - on["prefill"] / off["prefill"]
    rows = [
        ("decode step, 256 seqs: build metadata", f"{dec['build']:.3f} ms", ""),
        ("decode step, 256 seqs: commit tokens", f"{dec['commit']:.3f} ms", ""),
        ("decode step, 256 seqs: build + commit", f"{dec['both']:.3f} ms (p99 {dec['p99']:.3f})",
         f"< 0.5 ms {'ok' if dec['both'] < 0.5 else 'MISSED'}"),
        ("  new pages per step (boundaries)", f"{dec['pages_per_step']:.1f}", ""),
        ("prefix lookup, 4096-token prompt", f"{look['lookup']:.3f} ms",
         f"< 1 ms {'ok' if look['lookup'] < 1 else 'MISSED'}"),
        ("prefix attach + release, 4096 tokens", f"{look['attach']:.3f} ms", ""),
        ("shared prefix 64x1024, prefill tokens on/off", f"{on['prefill']} / {off['prefill']}",
         f">= 80% fewer {'ok' if saved >= 0.8 else 'MISSED'} ({100 * saved:.1f}%)"),
        ("shared prefix 64x1024, pages used on/off", f"{on['pages']} / {off['pages']}", ""),
        ("shared prefix, token hit rate (on)", f"{100 * on['hit_rate']:.1f}%", ""),
    ]
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(r[1]) for r in rows)
    print(f"{'benchmark':<{width}}  {'median':<{vwidth}}  target")
    print("-" * (width + vwidth + 30))
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:<{vwidth}}  {target}")


if __name__ == "__main__":
    main()
