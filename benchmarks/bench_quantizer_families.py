"""Quantizers on real-looking activations: error per data family, bytes, and decode time.

    python benchmarks/bench_quantizer_families.py

Families and errors are defined in tests/quant_families.py (the tests' bounds use the same
code): Gaussian, outlier channels (4 of 64 x50; 1 of 128 x100), Student-t with 3 degrees of
freedom. Each cell is "all channels / ordinary channels / attention", the mean of five draws
(512 tokens x 8 kv heads, 32 Gaussian queries per head, K and V from the family).

Decode time: attention of 32 sequences x 512 tokens (8 kv heads on tp=8, 32 q heads, head_dim
128, page_size 16) over each quantizer's pages, timed interleaved (one call per quantizer per
round, 30 rounds, median), with the rotated quantizer's time divided by its plain twin's in the
same rounds.
"""

from __future__ import annotations

import os
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import easykv  # noqa: E402
from bench_quantization import DIM, HEADS, LEN, PAGE, QHEADS, SEQS, decode_workload  # noqa: E402
from quant_families import FAMILIES, errors  # noqa: E402

QUANTS = ("int8", "int8-rot", "fp8", "fp8-rot", "int4", "int4-rot", "int4-asym", "int4-asym-rot", "int4-g32",
          "int4-g32-rot", "int4-g32-asym-rot")
TIMED = ("none", "int8", "int8-rot", "int4", "int4-rot", "int4-asym", "int4-asym-rot")
ROUNDS = 30


def error_cells(name: str) -> list[str]:
    cells = []
    for fam in FAMILIES:
        runs = [errors(easykv.get_quantizer(name), fam, seed=seed) for seed in range(5)]
        mean = {k: float(np.mean([r[k] for r in runs])) for k in ("all", "ordinary", "attention")}
        cells.append(f"{mean['all']:.3f} / {mean['ordinary']:.3f} / {mean['attention']:.3f}")
    return cells


def decode_times() -> dict[str, float]:
    mesh, pm, table, k, v, q, num_pages = decode_workload(1)
    calls = {}
    for name in TIMED:
        meta = easykv.PagedAttentionCacheMetaData.create(
            mesh, SEQS, 1, LEN, PAGE, HEADS, DIM, 0.9, jnp.bfloat16, partition_manager=pm, quantizer=name,
            num_pages_per_layer=num_pages)  # fmt: skip
        cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm, quantizer=name)
        cache, _ = cache.write(k, v, easykv.PagedAttentionMetadata.for_mixed(table, [0] * SEQS, [LEN] * SEQS,
                                                                             cache_metadata=meta))
        decode = easykv.PagedAttentionMetadata.for_decode(table, [LEN - 1] * SEQS, cache_metadata=meta)
        view = cache[0]
        calls[name] = (lambda view=view, decode=decode: easykv.view_attention(q, view, decode))
        jax.block_until_ready(calls[name]())  # compile
    samples: dict[str, list[float]] = {name: [] for name in TIMED}
    for _ in range(ROUNDS):
        for name in TIMED:
            t0 = time.perf_counter()
            jax.block_until_ready(calls[name]())
            samples[name].append(time.perf_counter() - t0)
    return {name: float(np.median(s)) * 1e3 for name, s in samples.items()}


def main() -> None:
    times = decode_times()
    print(f"errors: all / ordinary / attention, mean of 5 draws; decode: {SEQS} x {LEN} tokens, {HEADS} kv heads "
          f"(tp=8), {QHEADS} q heads, head_dim {DIM}, median of {ROUNDS} interleaved rounds\n")
    print("| quantizer | bytes per token-head (head_dim 128) | tokens vs bf16 | " + " | ".join(FAMILIES)
          + " | decode attention |")
    print("|---" * (4 + len(FAMILIES)) + "|")
    bf16 = 2 * DIM
    for name in ("none",) + QUANTS:
        q = easykv.get_quantizer(name)
        per = q.bytes_per_token_head(DIM, np.dtype("bfloat16"))
        cells = ["0 / 0 / 0"] * len(FAMILIES) if name == "none" else error_cells(name)
        timed = f"{times[name]:.1f} ms" if name in times else ""
        label = "bf16" if name == "none" else name
        print(f"| {label} | {per} B | {bf16 / per:.2f}x | " + " | ".join(cells) + f" | {timed} |")
    print()
    for plain in ("int8", "int4", "int4-asym"):
        print(f"decode time {plain}-rot / {plain}: {times[plain + '-rot'] / times[plain]:.2f}x (target <= 1.3x)")


if __name__ == "__main__":
    main()
