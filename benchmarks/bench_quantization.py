"""Memory per cached token and error, per quantizer, on 8 simulated CPU devices.

    python benchmarks/bench_quantization.py
    python benchmarks/bench_quantization.py --quick    # 1 layer, 4 sequences of 64 tokens, 2 calls (CI)

For bf16 (no quantizer), int8, fp8, int4 and int4 with groups of 32: bytes one token costs
(K and V, all layers, all kv heads; scales included), how many pages the same per-device
memory holds relative to bf16, the relative error of a K/V round trip on Gaussian data, and the
relative error of decode attention over the quantized pages against attention over bf16 pages
holding the same tokens (8 kv heads on tp=8, 32 q heads, head_dim 128, 32 sequences of 512).
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
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402

HEADS, QHEADS, DIM, PAGE = 8, 32, 128, 16
QUANTS = ("none", "int8", "fp8", "int4", "int4-g32")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The decode workload (shared with bench_quantizer_families.py) and how often it is timed."""

    layers: int
    seqs: int
    length: int
    calls: int  # timed calls (medians)
    round_trip_tokens: int


FULL = Sizes(layers=4, seqs=32, length=512, calls=10, round_trip_tokens=4096)
QUICK = Sizes(layers=1, seqs=4, length=64, calls=2, round_trip_tokens=256)
QUICK_HELP = "tiny sizes and few calls: checks the script runs (CI); numbers meaningless"


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def decode_workload(layers: int, sizes: Sizes = FULL) -> tuple:
    """The decode benchmark's setting, shared with bench_quantizer_families.py: ``(mesh, pm,
    table, k, v, q, num_pages)`` for ``sizes.seqs`` sequences of ``sizes.length`` Gaussian bf16
    tokens in ``layers`` layers over a permuted page table, one query per sequence."""
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    rng = np.random.default_rng(0)
    pages_per_seq = sizes.length // PAGE
    num_pages = sizes.seqs * pages_per_seq
    table = rng.permutation(num_pages).reshape(sizes.seqs, pages_per_seq).astype(np.int32)
    k = jnp.asarray(rng.normal(size=(layers, sizes.seqs * sizes.length, HEADS, DIM)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(layers, sizes.seqs * sizes.length, HEADS, DIM)), jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(sizes.seqs, QHEADS, DIM)), jnp.bfloat16)
    return mesh, pm, table, k, v, q, num_pages


def measure(name: str, workload: tuple, sizes: Sizes) -> tuple:
    """(sized metadata, decode attention output, median ms) of quantizer ``name``."""
    mesh, pm, table, k, v, q, num_pages = workload
    n, length = sizes.seqs, sizes.length
    sized = easykv.PagedAttentionCacheMetaData.create(
        mesh, n, sizes.layers, length, PAGE, HEADS, DIM, 0.9, jnp.bfloat16, partition_manager=pm,
        quantizer=name, memory_bytes_per_device=256 * 2**20,
    )  # fmt: skip
    meta = sized.replace(num_pages_per_layer=num_pages, memory_bytes_per_device=None)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm, quantizer=name)
    write = easykv.PagedAttentionMetadata.for_mixed(table, [0] * n, [length] * n, cache_metadata=meta)
    cache, _ = cache.write(k, v, write)
    decode = easykv.PagedAttentionMetadata.for_decode(table, [length - 1] * n, cache_metadata=meta)
    out = np.asarray(easykv.view_attention(q, cache[0], decode), np.float32)
    times = []
    for _ in range(sizes.calls):
        t0 = time.perf_counter()
        jax.block_until_ready(easykv.view_attention(q, cache[0], decode))
        times.append(time.perf_counter() - t0)
    return sized, out, float(np.median(times)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    sizes = QUICK if parser.parse_args().quick else FULL
    workload = decode_workload(sizes.layers, sizes)
    x = jax.random.normal(jax.random.key(1), (sizes.round_trip_tokens, HEADS, DIM), jnp.float32)
    rows, reference, base_pages = [], None, None
    for name in QUANTS:
        sized, out, ms = measure(name, workload, sizes)
        q_obj = easykv.get_quantizer(name)
        round_trip = 0.0 if name == "none" else rel(q_obj.quantize(x).dequantize(jnp.float32), x)
        if name == "none":
            reference, base_pages = out, sized.num_pages_per_layer
        rows.append((name, sized.bytes_per_token, sized.num_pages_per_layer / base_pages, round_trip,
                     rel(out, reference), ms))  # fmt: skip
    print(f"{sizes.layers} layers, {HEADS} kv heads (tp=8), head_dim {DIM}, page_size {PAGE}; attention: "
          f"{sizes.seqs} sequences x {sizes.length} tokens, {QHEADS} q heads, decode\n")  # fmt: skip
    print("| pages | bytes per token | pages in the same memory | K/V round-trip error | attention error vs bf16 | "
          "decode attention |")
    print("|---|---|---|---|---|---|")
    for name, per_token, gain, step_meta, att, ms in rows:
        label = "bf16" if name == "none" else name
        print(f"| {label} | {per_token:,} B | {gain:.2f}x | {step_meta:.2e} | {att:.2e} | {ms:.1f} ms |")


if __name__ == "__main__":
    main()
