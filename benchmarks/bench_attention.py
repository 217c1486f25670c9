"""Decode attention over pages vs a dense cache, and ragged vs full batches, on 8 simulated CPU
devices.

    python benchmarks/bench_attention.py            # the table for docs/benchmarks.md
    python benchmarks/bench_attention.py --quick    # tiny sizes, 3 rounds: a smoke run (CI)

Setup (issue 4): 32 sequences, 8 kv heads split over tp=8, 32 q heads (GQA 4), head_dim 128,
bf16, page_size 16, pages of each sequence scattered over the pool by a random permutation. The
pages are a one-layer cache's (``PagedAttentionCache.init_cache``, filled with Gaussian values):
the layer group's stack ``(1, kv_heads, pages, page_size, head_dim)`` in the platform's storage
dtype (raw uint16 bits on CPU), read by ``easykv.paged_attention(..., layer=0)`` as a model reads
its cache; the step metadata is built by ``PagedAttentionMetadata.for_decode`` / ``for_mixed``.

* paged vs dense: paged attention vs the same attention over a dense contiguous cache
  (batch, 2048, kv_heads, head_dim) holding the same tokens (one jitted masked softmax,
  head-sharded like the pages; bf16 operands with float32 accumulation, the faster of the two
  dense forms measured — the float32-upcast form is shown too).
  Target: paged <= 1.5x dense with every sequence at 2048 tokens.
* ragged vs full: lengths uniform in [1, 2048] vs all at 2048, same pages. Target <= 0.65x.

Paged timings include the call's host-side checks of the metadata. Each round runs every case
once, in turn, so that load from other processes hits all cases alike; figures are medians over
rounds, ratios the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import easykv  # noqa: E402
from easykv.attention.api import paged_attention_implementation  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402
from easykv.storage.pages import PageLayout  # noqa: E402

KV_HEADS, Q_HEADS, HEAD_DIM, PAGE = 8, 32, 128, 16


@dataclasses.dataclass(frozen=True)
class Sizes:
    batch: int
    max_len: int
    rounds: int


FULL, QUICK = Sizes(batch=32, max_len=2048, rounds=30), Sizes(batch=8, max_len=128, rounds=3)


@dataclasses.dataclass(frozen=True)
class Setup:
    """One run's data: the cache's layer-0 stacks, the dense copy, queries and step metadata."""

    meta: easykv.PagedAttentionCacheMetaData
    kp: jax.Array
    vp: jax.Array
    layout: PageLayout
    kd: jax.Array
    vd: jax.Array
    q: jax.Array
    lens_full: np.ndarray
    lens_ragged: np.ndarray
    md: dict  # "full", "ragged" (decode form), "mixed" (the ragged step in mixed form)


def filled_cache(mesh, pm, sizes: Sizes):
    """A one-layer bf16 cache holding ``batch`` sequences of ``max_len`` Gaussian tokens."""
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, sizes.batch, 1, sizes.max_len, PAGE, KV_HEADS, HEAD_DIM, 0.9, jnp.bfloat16,
        partition_manager=pm, num_pages_per_layer=sizes.batch * (sizes.max_len // PAGE))  # fmt: skip
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm)
    view = cache[0]

    # Made on the devices with the pages' own sharding, so no host copy of the pool is needed.
    def fill(key, x):
        values = jax.random.normal(key, x.shape, jnp.bfloat16)
        return values if x.dtype == values.dtype else jax.lax.bitcast_convert_type(values, x.dtype)

    kp, vp = (jax.jit(fill, out_shardings=x.sharding)(jax.random.key(i), x)
              for i, x in enumerate((view.group_key_pages, view.group_value_pages)))
    return meta, kp, vp, view.layout


def dense_copy(pages, table, sizes: Sizes, sharding):
    """The same tokens as a dense (batch, max_len, kv_heads, head_dim) bf16 cache."""

    def to_dense(pages):
        x = pages[0] if pages.dtype == jnp.bfloat16 else jax.lax.bitcast_convert_type(pages[0], jnp.bfloat16)
        x = x[:, table]  # (H, B, pages per sequence, page, D)
        return jnp.transpose(x, (1, 2, 3, 0, 4)).reshape(sizes.batch, sizes.max_len, KV_HEADS, HEAD_DIM)

    return jax.jit(to_dense, out_shardings=sharding)(pages)


def setup(sizes: Sizes) -> Setup:
    mesh = create_mesh({"dp": 1, "tp": 8})
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp"))
    meta, kp, vp, layout = filled_cache(mesh, pm, sizes)
    rng = np.random.default_rng(0)
    b, width = sizes.batch, sizes.max_len // PAGE
    table = rng.permutation(b * width).reshape(b, width).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((b, Q_HEADS, HEAD_DIM)), jnp.bfloat16)
    q = jax.device_put(q, NamedSharding(mesh, P(None, "tp", None)))
    lens_full = np.full(b, sizes.max_len, np.int32)
    lens_ragged = rng.integers(1, sizes.max_len + 1, b).astype(np.int32)
    md = {
        "full": easykv.PagedAttentionMetadata.for_decode(table, lens_full - 1, cache_metadata=meta),
        "ragged": easykv.PagedAttentionMetadata.for_decode(table, lens_ragged - 1, cache_metadata=meta),
        "mixed": easykv.PagedAttentionMetadata.for_mixed(table, lens_ragged - 1, np.ones(b, np.int32),
                                                         cache_metadata=meta),
    }
    dense_sharding = NamedSharding(mesh, P(None, None, "tp", None))
    kd, vd = (dense_copy(x, table, sizes, dense_sharding) for x in (kp, vp))
    return Setup(meta, kp, vp, layout, kd, vd, q, lens_full, lens_ragged, md)


def dense_attention(q, k, v, lengths, *, upcast: bool):
    """Masked softmax over the whole dense cache; float32 scores either way."""
    batch, max_len = k.shape[:2]
    group = Q_HEADS // KV_HEADS
    qg = q.astype(jnp.float32).reshape(batch, KV_HEADS, group, HEAD_DIM) * HEAD_DIM**-0.5
    if upcast:
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    else:
        qg = qg.astype(jnp.bfloat16)
    s = jnp.einsum("bhgd,blhd->bhgl", qg, k, preferred_element_type=jnp.float32)
    mask = jnp.arange(max_len)[None] < lengths[:, None]
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgl,blhd->bhgd", p, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, Q_HEADS, HEAD_DIM).astype(q.dtype)


def make_cases(s: Setup) -> dict:
    sharding = s.q.sharding
    dense_bf16 = jax.jit(lambda *a: dense_attention(*a, upcast=False), out_shardings=sharding)
    dense_f32 = jax.jit(lambda *a: dense_attention(*a, upcast=True), out_shardings=sharding)
    full, ragged = jnp.asarray(s.lens_full), jnp.asarray(s.lens_ragged)

    def paged(md):
        return lambda: easykv.paged_attention(s.q, s.kp, s.vp, md, layer=0, layout=s.layout, dtype=jnp.bfloat16)

    return {
        "dense_full": lambda: dense_bf16(s.q, s.kd, s.vd, full),
        "dense_f32_full": lambda: dense_f32(s.q, s.kd, s.vd, full),
        "paged_full": paged(s.md["full"]),
        "dense_ragged": lambda: dense_bf16(s.q, s.kd, s.vd, ragged),
        "paged_ragged": paged(s.md["ragged"]),
        "paged_mixed_ragged": paged(s.md["mixed"]),
        # not timed: the float32 dense reference the paged outputs are checked against
        "_dense_f32_ragged": lambda: dense_f32(s.q, s.kd, s.vd, ragged),
    }


def max_errors(cases: dict) -> tuple[float, float]:
    """max |paged - dense f32| on the same tokens, all at max length and ragged."""

    def err(got, want):
        return float(np.abs(np.asarray(cases[got](), np.float32) - np.asarray(cases[want](), np.float32)).max())

    return err("paged_full", "dense_f32_full"), err("paged_ragged", "_dense_f32_ragged")


def interleaved_ms(cases: dict, rounds: int) -> dict[str, np.ndarray]:
    """Per-round ms of every case; each round runs each case once, in turn."""
    for fn in cases.values():  # compile and warm up
        jax.block_until_ready(fn())
        jax.block_until_ready(fn())
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: np.asarray(v) * 1e3 for name, v in times.items()}


def report(s: Setup, sizes: Sizes, t: dict[str, np.ndarray], errors: tuple[float, float]) -> None:
    med = {name: float(np.median(v)) for name, v in t.items()}

    def ratio(a, b):
        return float(np.median(t[a] / t[b]))

    impl = paged_attention_implementation(s.q, s.kp, s.vp, s.md["full"], layer=0, layout=s.layout,
                                                 dtype=jnp.bfloat16)
    b, n = sizes.batch, sizes.max_len
    ragged = s.lens_ragged
    print(f"easykv decode attention: {b} sequences, {KV_HEADS} kv heads on tp=8, {Q_HEADS} q heads, "
          f"head_dim {HEAD_DIM}, bf16, page_size {PAGE}, {jax.device_count()} {jax.default_backend()} "
          f"devices, implementation {impl!r}; medians of {sizes.rounds} rounds")  # fmt: skip
    print(f"ragged lengths: mean {ragged.mean():.0f}, tokens {ragged.sum()} of {b * n} "
          f"({ragged.sum() / (b * n):.2f}x); max |paged - dense| = {errors[0]:.2e} (full), "
          f"{errors[1]:.2e} (ragged)\n")  # fmt: skip
    print("| case | time | ratio | target |")
    print("|---|---|---|---|")
    print(f"| dense cache, all at {n} (bf16 dots) | {med['dense_full']:.1f} ms | 1.00x | |")
    print(f"| dense cache, all at {n} (f32 upcast) | {med['dense_f32_full']:.1f} ms | "
          f"{ratio('dense_f32_full', 'dense_full'):.2f}x dense | |")  # fmt: skip
    r = ratio("paged_full", "dense_full")
    print(f"| paged, all at {n} | {med['paged_full']:.1f} ms | {r:.2f}x dense | "
          f"<= 1.5x {'ok' if r <= 1.5 else 'MISSED'} |")  # fmt: skip
    print(f"| dense cache, ragged [1, {n}] | {med['dense_ragged']:.1f} ms | "
          f"{ratio('dense_ragged', 'dense_full'):.2f}x dense full | |")  # fmt: skip
    r = ratio("paged_ragged", "paged_full")
    print(f"| paged, ragged [1, {n}] | {med['paged_ragged']:.1f} ms | {r:.2f}x paged full | "
          f"<= 0.65x {'ok' if r <= 0.65 else 'MISSED'} |")  # fmt: skip
    print(f"| paged, ragged, mixed-form metadata | {med['paged_mixed_ragged']:.1f} ms | "
          f"{ratio('paged_mixed_ragged', 'paged_ragged'):.2f}x decode form | |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and few rounds: checks the script runs (CI); numbers meaningless")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.rounds:
        sizes = dataclasses.replace(sizes, rounds=args.rounds)
    s = setup(sizes)
    cases = make_cases(s)
    errors = max_errors(cases)
    timed = {name: fn for name, fn in cases.items() if not name.startswith("_")}
    report(s, sizes, interleaved_ms(timed, sizes.rounds), errors)


if __name__ == "__main__":
    main()
