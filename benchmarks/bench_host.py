"""Host cost of a step's runtime metadata: built, checked once, never checked again.

Prints one table. Targets (issue 11): ``for_mixed`` for 256 sequences x 512-page rows under
0.5 ms; a decode step's host work in the page manager (build + commit, 256 sequences) no
slower than 0.42 ms; an eager attention call and a ``cache.write`` do not re-check what the
runtime metadata already checked: their host checks on validated metadata cost a small
fraction of the same checks on the same arrays built by hand (unmarked). Attention's first layer
of a step also scans the pages the step's proof vouches for (once per step).

Each round times every case once, in turn (interleaved), and the table shows medians.

    python benchmarks/bench_host.py            # the table for docs/benchmarks.md
    python benchmarks/bench_host.py --quick    # 60 rounds: a smoke run (CI)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from easykv.attention.checks import prepare  # noqa: E402
from easykv.attention.options import AttentionOptions  # noqa: E402
from easykv.manager.manager import PageManager  # noqa: E402
from easykv.spec.metadata import PagedAttentionCacheMetaData  # noqa: E402
from easykv.step.metadata import PagedAttentionMetadata  # noqa: E402
from easykv.storage.writes import token_slots  # noqa: E402

SEQS, WIDTH, PAGE = 256, 512, 16


def _meta() -> PagedAttentionCacheMetaData:
    return PagedAttentionCacheMetaData(
        batch_size=SEQS, num_hidden_layers=32, num_pages_per_layer=SEQS * WIDTH, num_pages_per_sequence=WIDTH,
        max_sequences=WIDTH * PAGE, page_size=PAGE, num_kv_heads=8, kv_head_dim_size=128, hbm_utilization=0.9)


def _unmarked(step_meta: PagedAttentionMetadata) -> PagedAttentionMetadata:
    """The same step built by hand: equal arrays (copies), no constructor's mark."""
    return dataclasses.replace(step_meta, **{f.name: np.array(getattr(step_meta,
                                                                      f.name)) for f in dataclasses.fields(step_meta)})


def _manager_decode(rng: np.random.Generator) -> tuple[PageManager, np.ndarray]:
    """256 running sequences of random lengths (as in bench_manager.py)."""
    pm = PageManager(_meta())
    ids = pm.claim(SEQS)
    for s in ids:
        prompt = rng.integers(0, 32000, int(rng.integers(16, 1024)))
        pm.commit(pm.schedule([s], [prompt.size]), [prompt])
    return pm, np.asarray(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="60 rounds instead of 600: checks the script runs (CI); numbers meaningless")
    args = parser.parse_args()
    rounds = 60 if args.quick else 600
    meta = _meta()
    rng = np.random.default_rng(0)
    table = rng.permutation(SEQS * WIDTH).reshape(SEQS, WIDTH).astype(np.int32)
    cached = rng.integers(1, WIDTH * PAGE - 1, SEQS).astype(np.int32)
    ones = np.ones(SEQS, np.int32)
    step_meta = PagedAttentionMetadata.for_mixed(table, cached, ones, cache_metadata=meta)
    hand = _unmarked(step_meta)
    # Attention's checks need pages only for their shapes and dtypes: a tiny q and pool shape.
    q = np.zeros((SEQS, 8, 128), np.float32)
    pages = np.broadcast_to(np.zeros((), np.float32), (8, SEQS * WIDTH, PAGE, 128))  # a shape, no memory
    options = AttentionOptions()
    pm, ids = _manager_decode(rng)
    tokens = rng.integers(0, 32000, (rounds, SEQS))

    def commit_round(i: int) -> None:
        pm.commit(pm.schedule(ids, 1), tokens[i])

    cases = {
        "for_mixed, 256 seqs x 512-page rows (decode step)": lambda i: PagedAttentionMetadata.for_mixed(
            table, cached, ones, cache_metadata=meta),
        "PageManager decode step, 256 seqs: build + commit": commit_round,
        # The first layer of a step scans the pages its proof vouches for (a -1 or a page outside the
        # pool raises); later layers find the scan done. `fresh[i]`: a new step (built untimed).
        "eager attention host checks, validated metadata, first layer": lambda i: prepare(
            q, pages, pages, fresh[i], options),
        "eager attention host checks, validated metadata": lambda i: prepare(q, pages, pages, step_meta, options),
        "eager attention host checks, same arrays unmarked": lambda i: prepare(q, pages, pages, hand, options),
        "cache.write host checks, validated metadata": lambda i: token_slots(step_meta, meta),
        "cache.write host checks, same arrays unmarked": lambda i: token_slots(hand, meta),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    fresh: dict[int, PagedAttentionMetadata] = {}
    for i in range(rounds):
        # The same arrays under the same proof, a new step: no copy, and nothing checked yet.
        fresh = {i: PagedAttentionMetadata(**{f.name: getattr(step_meta,
                                                              f.name) for f in dataclasses.fields(step_meta)},
                                           proof=step_meta.checked)}
        for name, case in cases.items():
            t0 = time.perf_counter()
            case(i)
            samples[name].append(time.perf_counter() - t0)
    targets = {
        "for_mixed, 256 seqs x 512-page rows (decode step)": "< 0.5 ms",
        "PageManager decode step, 256 seqs: build + commit": "<= 0.42 ms",
    }
    print(f"| host work ({rounds} interleaved rounds) | median | p99 | target |")
    print("|---|---|---|---|")
    for name, times in samples.items():
        ms = 1e3 * statistics.median(times)
        p99 = 1e3 * float(np.quantile(times, 0.99))
        print(f"| {name} | {ms:.3f} ms | {p99:.3f} ms | {targets.get(name, '')} |")
    for what in ("eager attention", "cache.write"):
        marked = statistics.median(samples[f"{what} host checks, validated metadata"])
        unmarked = statistics.median(samples[f"{what} host checks, same arrays unmarked"])
        print(f"\n{what}: validated metadata costs {marked / unmarked:.2f}x the unmarked checks")


if __name__ == "__main__":
    main()
