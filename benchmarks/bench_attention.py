"""Decode attention over pages vs a dense cache, and ragged vs full batches, on 8 simulated CPU
devices.

    python benchmarks/bench_attention.py            # the table for the README
    python benchmarks/bench_attention.py --quick    # fewer rounds

Setup (issue 4): 32 sequences, 8 kv heads split over tp=8, 32 q heads (GQA 4), head_dim 128,
bf16 (pages stored as raw uint16 bits, as the CPU cache stores them), page_size 16, pages of
each sequence scattered over the pool by a random permutation.

* paged vs dense: `easykv.attention.api.paged_attention` over the pages vs the same attention over a
  dense contiguous cache (batch, 2048, kv_heads, head_dim) holding the same tokens (one jitted
  masked softmax, head-sharded like the pages; bf16 operands with float32 accumulation, the
  faster of the two dense forms measured — the float32-upcast form is shown too).
  Target: paged <= 1.5x dense with every sequence at 2048 tokens.
* ragged vs full: lengths uniform in [1, 2048] vs all at 2048, same pages. Target <= 0.65x.

Paged timings include the call's host-side checks of the metadata. Each round runs every case
once, in turn, so that load from other processes hits all cases alike; figures are medians over
rounds, ratios the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import time

B, KV_HEADS, Q_HEADS, HEAD_DIM, PAGE, MAX_LEN = 32, 8, 32, 128, 16, 2048


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (8 if args.quick else 30)

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from easykv.attention.api import paged_attention, paged_attention_implementation
    from easykv.storage.pages import PageLayout
    from easykv.runtime import PagedAttentionMetadata, build_mixed
    from sharding import create_mesh

    pages_per_seq = MAX_LEN // PAGE
    num_pages = B * pages_per_seq
    mesh = create_mesh({"dp": 1, "tp": 8})
    layout = PageLayout(mesh, head_axes=("tp",))
    q_sharding = NamedSharding(mesh, P(None, "tp", None))

    def make_pages(key):
        def one(k):
            x = jax.random.normal(k, (KV_HEADS, num_pages, PAGE, HEAD_DIM), jnp.bfloat16)
            return jax.lax.bitcast_convert_type(x, jnp.uint16)

        k1, k2 = jax.random.split(key)
        return one(k1), one(k2)

    kp, vp = jax.jit(make_pages, out_shardings=(layout.sharding,) * 2)(jax.random.key(0))
    rng = np.random.default_rng(0)
    table = rng.permutation(num_pages).reshape(B, pages_per_seq).astype(np.int32)
    q = jax.device_put(jnp.asarray(rng.standard_normal((B, Q_HEADS, HEAD_DIM)), jnp.bfloat16), q_sharding)
    lens_full = np.full(B, MAX_LEN, np.int32)
    lens_ragged = rng.integers(1, MAX_LEN + 1, B).astype(np.int32)
    md_full = PagedAttentionMetadata(decodes_position=lens_full - 1, decodes_page_table=table)
    md_ragged = PagedAttentionMetadata(decodes_position=lens_ragged - 1, decodes_page_table=table)
    md_mixed = build_mixed(table, lens_ragged - 1, np.ones(B, np.int32), page_size=PAGE)

    # The dense cache holding the same tokens, head-sharded like the pages.
    dense_sharding = NamedSharding(mesh, P(None, None, "tp", None))

    def to_dense(pages):
        x = jax.lax.bitcast_convert_type(pages, jnp.bfloat16)[:, table]  # (H, B, P, page, D)
        return jnp.transpose(x, (1, 2, 3, 0, 4)).reshape(B, MAX_LEN, KV_HEADS, HEAD_DIM)

    to_dense = jax.jit(to_dense, out_shardings=dense_sharding)
    kd, vd = to_dense(kp), to_dense(vp)

    def dense_attention(q, k, v, lengths, upcast):
        group = Q_HEADS // KV_HEADS
        qg = q.astype(jnp.float32).reshape(B, KV_HEADS, group, HEAD_DIM) * HEAD_DIM**-0.5
        if upcast:
            k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        else:
            qg = qg.astype(jnp.bfloat16)
        s = jnp.einsum("bhgd,blhd->bhgl", qg, k, preferred_element_type=jnp.float32)
        mask = jnp.arange(MAX_LEN)[None] < lengths[:, None]
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhgl,blhd->bhgd", p, v, preferred_element_type=jnp.float32)
        return out.reshape(B, Q_HEADS, HEAD_DIM).astype(q.dtype)

    dense_bf16 = jax.jit(lambda *a: dense_attention(*a, upcast=False), out_shardings=q_sharding)
    dense_f32 = jax.jit(lambda *a: dense_attention(*a, upcast=True), out_shardings=q_sharding)

    def paged(md):
        return lambda: paged_attention(q, kp, vp, md, layout=layout, dtype=jnp.bfloat16)

    cases = {
        "dense_full": lambda: dense_bf16(q, kd, vd, jnp.asarray(lens_full)),
        "dense_f32_full": lambda: dense_f32(q, kd, vd, jnp.asarray(lens_full)),
        "paged_full": paged(md_full),
        "dense_ragged": lambda: dense_bf16(q, kd, vd, jnp.asarray(lens_ragged)),
        "paged_ragged": paged(md_ragged),
        "paged_mixed_ragged": paged(md_mixed),
    }
    # Correctness first: paged equals dense on the same tokens.
    def max_err(md, lengths):
        got = np.asarray(paged(md)(), np.float32)
        want = np.asarray(dense_f32(q, kd, vd, jnp.asarray(lengths)), np.float32)
        return float(np.abs(got - want).max())

    err_full, err_ragged = max_err(md_full, lens_full), max_err(md_ragged, lens_ragged)
    for fn in cases.values():  # compile and warm up
        jax.block_until_ready(fn())
        jax.block_until_ready(fn())
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    t = {name: np.asarray(v) * 1e3 for name, v in times.items()}
    med = {name: float(np.median(v)) for name, v in t.items()}

    def ratio(a, b):
        return float(np.median(t[a] / t[b]))

    impl = paged_attention_implementation(q, kp, vp, md_full, layout=layout, dtype=jnp.bfloat16)
    print(f"easykv decode attention: {B} sequences, {KV_HEADS} kv heads on tp=8, {Q_HEADS} q heads, "
          f"head_dim {HEAD_DIM}, bf16, page_size {PAGE}, {jax.device_count()} {jax.default_backend()} "
          f"devices, implementation {impl!r}; medians of {rounds} rounds")  # fmt: skip
    print(f"ragged lengths: mean {lens_ragged.mean():.0f}, tokens {lens_ragged.sum()} of {B * MAX_LEN} "
          f"({lens_ragged.sum() / (B * MAX_LEN):.2f}x); max |paged - dense| = {err_full:.2e} (full), "
          f"{err_ragged:.2e} (ragged)")  # fmt: skip
    print()
    print("| case | time | ratio | target |")
    print("|---|---|---|---|")
    print(f"| dense cache, all at 2048 (bf16 dots) | {med['dense_full']:.1f} ms | 1.00x | |")
    print(f"| dense cache, all at 2048 (f32 upcast) | {med['dense_f32_full']:.1f} ms | "
          f"{ratio('dense_f32_full', 'dense_full'):.2f}x dense | |")  # fmt: skip
    r = ratio("paged_full", "dense_full")
    print(f"| paged, all at 2048 | {med['paged_full']:.1f} ms | {r:.2f}x dense | <= 1.5x {'ok' if r <= 1.5 else 'MISSED'} |")
    print(f"| dense cache, ragged [1, 2048] | {med['dense_ragged']:.1f} ms | "
          f"{ratio('dense_ragged', 'dense_full'):.2f}x dense full | |")  # fmt: skip
    r = ratio("paged_ragged", "paged_full")
    print(f"| paged, ragged [1, 2048] | {med['paged_ragged']:.1f} ms | {r:.2f}x paged full | "
          f"<= 0.65x {'ok' if r <= 0.65 else 'MISSED'} |")  # fmt: skip
    print(f"| paged, ragged, mixed-form metadata | {med['paged_mixed_ragged']:.1f} ms | "
          f"{ratio('paged_mixed_ragged', 'paged_ragged'):.2f}x decode form | |")  # fmt: skip


if __name__ == "__main__":
    main()
