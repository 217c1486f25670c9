"""Memory per cached token and error, per quantizer, on 8 simulated CPU devices.

    python benchmarks/bench_quantization.py

For bf16 (no quantizer), int8, fp8, int4 and int4 with groups of 32: bytes one token costs
(K and V, all layers, all kv heads; scales included), how many pages the same per-device
memory holds relative to bf16, the relative error of a K/V round trip on Gaussian data, and the
relative error of decode attention over the quantized pages against attention over bf16 pages
holding the same tokens (8 kv heads on tp=8, 32 q heads, head_dim 128, 32 sequences of 512).
"""

from __future__ import annotations

import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import easykv  # noqa: E402
from sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402

LAYERS, HEADS, QHEADS, DIM, PAGE, SEQS, LEN = 4, 8, 32, 128, 16, 32, 512
QUANTS = ("none", "int8", "fp8", "int4", "int4-g32")


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def decode_workload(layers: int) -> tuple:
    """The decode benchmark's setting, shared with bench_quantizer_families.py: ``(mesh, pm,
    table, k, v, q, num_pages)`` for SEQS sequences of LEN Gaussian bf16 tokens in ``layers``
    layers over a permuted page table, one query per sequence."""
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    rng = np.random.default_rng(0)
    pages_per_seq = LEN // PAGE
    num_pages = SEQS * pages_per_seq
    table = rng.permutation(num_pages).reshape(SEQS, pages_per_seq).astype(np.int32)
    k = jnp.asarray(rng.normal(size=(layers, SEQS * LEN, HEADS, DIM)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(layers, SEQS * LEN, HEADS, DIM)), jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(SEQS, QHEADS, DIM)), jnp.bfloat16)
    return mesh, pm, table, k, v, q, num_pages


def main() -> None:
    mesh, pm, table, k, v, q, num_pages = decode_workload(LAYERS)
    x = jax.random.normal(jax.random.key(1), (4096, HEADS, DIM), jnp.float32)
    budget = 256 * 2**20
    rows, reference, base_pages = [], None, None
    for name in QUANTS:
        sized = easykv.PagedAttentionCacheMetaData.create(
            mesh, SEQS, LAYERS, LEN, PAGE, HEADS, DIM, 0.9, jnp.bfloat16, partition_manager=pm,
            quantizer=name, memory_bytes_per_device=budget,
        )  # fmt: skip
        meta = sized.replace(num_pages_per_layer=num_pages, memory_bytes_per_device=None)
        cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm, quantizer=name)
        write = easykv.PagedAttentionMetadata.for_mixed(table, [0] * SEQS, [LEN] * SEQS, cache_metadata=meta)
        cache, _ = cache.write(k, v, write)
        decode = easykv.PagedAttentionMetadata.for_decode(table, [LEN - 1] * SEQS, cache_metadata=meta)
        out = np.asarray(easykv.view_attention(q, cache[0], decode), np.float32)
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            jax.block_until_ready(easykv.view_attention(q, cache[0], decode))
            times.append(time.perf_counter() - t0)
        q_obj = easykv.get_quantizer(name)
        round_trip = 0.0 if name == "none" else rel(q_obj.quantize(x).dequantize(jnp.float32), x)
        if name == "none":
            reference, base_pages = out, sized.num_pages_per_layer
        rows.append((name, sized.bytes_per_token, sized.num_pages_per_layer / base_pages, round_trip,
                     rel(out, reference), float(np.median(times)) * 1e3))  # fmt: skip
    print(f"{LAYERS} layers, {HEADS} kv heads (tp=8), head_dim {DIM}, page_size {PAGE}; attention: "
          f"{SEQS} sequences x {LEN} tokens, {QHEADS} q heads, decode\n")  # fmt: skip
    print("| pages | bytes per token | pages in the same memory | K/V round-trip error | attention error vs bf16 | decode attention |")
    print("|---|---|---|---|---|---|")
    for name, per_token, gain, rt, att, ms in rows:
        label = "bf16" if name == "none" else name
        print(f"| {label} | {per_token:,} B | {gain:.2f}x | {rt:.2e} | {att:.2e} | {ms:.1f} ms |")


if __name__ == "__main__":
    main()
