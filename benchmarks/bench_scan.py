"""Compile time and step time of a model whose layers run under ``lax.scan`` over a layer
group's stacked pages, against the same model unrolled, on 8 simulated CPU devices.

    python benchmarks/bench_scan.py            # the table for docs/benchmarks.md
    python benchmarks/bench_scan.py --quick    # 2 and 4 layers, one compile, 3 steps: a smoke run (CI)

The model (issue 12): per layer, project K, V and Q from the hidden state, write the new K/V
into the layer's pages, attend over the cache, add the output back. bf16 pages, 8 kv heads on
tp=8, 16 q heads, head_dim 64, page_size 16, 256 pages per layer; a decode step of 32
sequences x 1 token at 40..100 cached tokens. The scanned step carries ``cache.group_view(0)``
through the scan and calls ``view.at_layer(i)`` each iteration; the unrolled step writes
``cache.views[i]`` for each layer. Compile time is trace + lower + compile of a fresh jit,
median of 3; step time the median of interleaved calls (the cache donated each call).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

HEADS, Q_HEADS, HEAD_DIM, PAGE, PAGES, SEQS, MODEL = 8, 16, 64, 16, 256, 32, 256


@dataclasses.dataclass(frozen=True)
class Sizes:
    layers: tuple[int, ...]
    compiles: int  # compile time is the median of this many fresh compiles
    repeats: int  # timed steps


FULL = Sizes(layers=(8, 32), compiles=3, repeats=40)
QUICK = Sizes(layers=(2, 4), compiles=1, repeats=3)


def _setup():
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np

    import easykv
    from easykv.sharding import PartitionAxis, PartitionManager, create_mesh

    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp"))
    return jax, jnp, np, easykv, mesh, pm


def _model(layers: int):
    jax, jnp, np, easykv, mesh, pm = _setup()
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, SEQS, layers, 1024, PAGE, HEADS, HEAD_DIM, 0.9, jnp.bfloat16,
        partition_manager=pm, num_pages_per_layer=PAGES)  # fmt: skip
    rng = np.random.default_rng(0)
    scale = 1 / np.sqrt(MODEL)
    weights = {name: jnp.asarray(rng.standard_normal((layers, MODEL, out)) * scale, jnp.bfloat16)
               for name, out in (("q", Q_HEADS * HEAD_DIM), ("k", HEADS * HEAD_DIM), ("v", HEADS * HEAD_DIM))}
    weights["o"] = jnp.asarray(rng.standard_normal((layers, Q_HEADS * HEAD_DIM, MODEL)) * scale, jnp.bfloat16)
    lengths = rng.integers(40, 100, SEQS)
    table = rng.permutation(PAGES)[: SEQS * 7].reshape(SEQS, 7).astype(np.int32)
    table = np.pad(table, ((0, 0), (0, meta.num_pages_per_sequence - 7)), constant_values=-1)
    md = easykv.PagedAttentionMetadata.for_decode(table, lengths, cache_metadata=meta)
    h = jnp.asarray(rng.standard_normal((SEQS, MODEL)), jnp.bfloat16)

    def layer(view, w, h):
        t = h.shape[0]
        q = (h @ w["q"]).reshape(t, Q_HEADS, HEAD_DIM)
        k = (h @ w["k"]).reshape(t, HEADS, HEAD_DIM)
        v = (h @ w["v"]).reshape(t, HEADS, HEAD_DIM)
        view = view.write_decodes_to_cache(k, v, md)
        out = easykv.view_attention(q, view, md)
        return view, h + (out.reshape(t, -1) @ w["o"]).astype(h.dtype)

    def scanned(cache, weights, h):
        def body(carry, xs):
            view, h = carry
            i, w = xs
            view, h = layer(view.at_layer(i), w, h)
            return (view, h), None

        (view, h), _ = jax.lax.scan(body, (cache.group_view(0), h), (jnp.arange(layers), weights))
        cache.update(view)
        return cache, h

    def unrolled(cache, weights, h):
        for i in range(layers):
            view, h = layer(cache.views[i], jax.tree.map(lambda a: a[i], weights), h)  # noqa: B023  called at once
            cache.views[i] = view
        return cache, h

    def new_cache():
        return easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm)

    return {"scan": scanned, "unrolled": unrolled}, new_cache, weights, h


def compile_seconds(fn, cache, weights, h) -> float:
    import jax

    t0 = time.perf_counter()
    jax.jit(lambda c, w, x: fn(c, w, x), donate_argnums=0).lower(cache, weights, h).compile()
    return time.perf_counter() - t0


def bench_layers(layers: int, sizes: Sizes) -> None:
    """Print the scan and unrolled rows of a model of ``layers`` layers."""
    import jax
    import numpy as np

    fns, new_cache, weights, h = _model(layers)
    cache = new_cache()
    compile_s = {name: float(np.median([compile_seconds(fn, cache, weights, h) for _ in range(sizes.compiles)]))
                 for name, fn in fns.items()}
    steps = {name: jax.jit(fn, donate_argnums=0) for name, fn in fns.items()}
    state = {name: new_cache() for name in fns}
    outs = {}
    for name in fns:  # warm up, and the first step's output to compare
        state[name], outs[name] = steps[name](state[name], weights, h)
    equal = np.allclose(np.asarray(outs["scan"], np.float32), np.asarray(outs["unrolled"], np.float32),
                        rtol=2e-2, atol=2e-2)
    times = {name: [] for name in fns}
    for _ in range(sizes.repeats):
        for name in fns:
            t0 = time.perf_counter()
            state[name], out = steps[name](state[name], weights, h)
            jax.block_until_ready(out)
            times[name].append(time.perf_counter() - t0)
    for name in fns:
        ms = float(np.median(times[name]) * 1e3)
        print(f"| {layers} | {name} | {compile_s[name]:.2f} s | {ms:.2f} ms | {equal} |")
    print(f"| {layers} | unrolled / scan | {compile_s['unrolled'] / compile_s['scan']:.1f}x | "
          f"{np.median(times['unrolled']) / np.median(times['scan']):.2f}x | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 and 4 layers, one compile, 3 steps: checks the script runs (CI); numbers meaningless")
    sizes = QUICK if parser.parse_args().quick else FULL
    print(f"easykv scan benchmark: bf16, {HEADS} kv heads on tp=8, {Q_HEADS} q heads, head_dim {HEAD_DIM}, "
          f"{PAGES} pages per layer, decode {SEQS} sequences x 1 token")  # fmt: skip
    print(f"| layers | step | compile (median of {sizes.compiles}) | step time (median of {sizes.repeats}) | "
          "outputs equal |")
    print("|---|---|---|---|---|")
    for layers in sizes.layers:
        bench_layers(layers, sizes)


if __name__ == "__main__":
    main()
