"""The shared prefix store: pages served from it against the backend's raw read, the decode step with
``write_through`` against no store, the time to first token of a shared prefix served from it
against recomputing it, and two replicas in two processes sharing it.

    python benchmarks/bench_store.py [--repeats 7]
    python benchmarks/bench_store.py --quick    # fewer pages, steps and requests, a smaller model, 2 repeats (CI)

1. Fetch: a cached prefix of N pages (16 and 256; ``--quick``: 16 and 64; 8 layers, 8 kv heads over
   tp=8, head_dim 128, page 16, bf16: 512 KiB a page, 64 KiB a value) that another cache wrote
   through, brought into a fresh cache as a user waits for it: ``Runner.match_prefix`` with
   ``read="wait"`` (the batched reads -- the chain's lookup -- checks, copies into host pages), then
   ``Runner.schedule`` of the next token (the plan's onload applied) until the device pool holds the
   pages (``block_until_ready``); both parts are reported (the store's, the host tier's onload). The floor is the
   backend's raw read of the same values: ``backend.get_many`` of the same keys in one call (the values only, no
   decode, no copy), on the caller's thread; the values are read once before either timing (both warm) and the
   two timings alternate in order round by round. Two backends: the
   ``file://`` store (tensorstore) and Redis (``MGET`` through a real ``redis-server`` started as
   the tests start one; skipped with the line that installs it when there is none). Each round
   serves a prompt no cache holds yet; rounds interleave the two timings; medians. Target >= 0.8x.
2. Decode: the time of a decode step of 4 sequences (a jitted step writing one token's K and V
   each: ``cache.write``) with a ``write_through`` store against no store; a page fills every 16
   steps per sequence and is gathered, copied and written in the background. Steps alternate
   between the two runners; median and mean. Target: within 5%.
3. Time to first token of a shared prefix of 2,048 tokens (``--quick``: 256) for the demo model
   with random weights, 28 layers, 8 kv heads, head_dim 128, 16 q heads, hidden 256 (narrow: a real
   model's prefill costs far more, so the ratio here is a floor), page 16, bf16 cache: served from a
   ``file://`` store (another cache wrote it through) and one token computed, against the whole prompt
   computed (a real prefill of the same model on the same devices, in chunks of 256 tokens).

4. Replicas: two replicas in two processes (each its own 8 simulated devices) sharing a ``file://`` store,
   the trained "uniform" demo model through the demo engine (host tier + store). 64 requests (``--quick``: 16)
   arrive at once, each prompt 160 tokens: a shared opening of 144 (90%, 9 pages of 16) and 16 of its own;
   4 greedy tokens each. Every request has a sequence slot and the step budget is 1,024 tokens, so all are
   admitted (their prefixes looked up) at arrival: without the store no request finds another's pages.
   Process A (tp=8) runs with the store and writes; then process B (dp=2 x tp=4, other users: other
   suffixes) runs with the store and without. Prompt tokens prefilled = prompt tokens less those found
   cached at admission; target: B with the store prefills >= 85% fewer, its tokens identical to B without.
   (``--quick`` keeps the 160-token prompts: shorter ones would change the page-aligned share.)

On CPU the "device" and host memory are both RAM and the file store sits in the page cache, so the
fetch ratio compares the store's own work (existence query, decode, CRC, two copies) with a bare
read; the decode step is tiny here, so the write-through cost is a large share of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import easykv  # noqa: E402
from easykv import PageManager, Runner  # noqa: E402
from easykv.demo.model import VOCAB, CompiledModel, DemoConfig, DemoModel  # noqa: E402
from easykv.demo.run import MODELS  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402
from easykv.tiers.store import PrefixStore  # noqa: E402

PAGE, HEADS, DIM = 16, 8, 128
FETCH_LAYERS = 8
MODEL_ID = "bench/store@random"
REDIS_INSTALL = "apt-get install -y redis-server"
# rounds not counted: the first compiles, the third is the first whose onload evicts host pages (another program)
WARMUP_ROUNDS = 3
PREFILL_CHUNK = 256  # tokens a prefill step computes, as an engine's chunked prefill
# the model's width: its weights are replicated on each of the 8 simulated devices, twice (the scanned copy), so
# hidden 1024 (about 1.1 GB of float32 weights) does not fit this machine's memory; 256 peaks at 4.8 GB
HIDDEN = 256


class Pool:
    """A cache on tp=8 with a host tier and its runner (with ``store``, or none)."""

    def __init__(self, layers: int, pages: int, host_pages: int, max_len: int, store: PrefixStore | None,
                 dtype: Any = jnp.bfloat16, max_seqs: int = 4, heads: int = HEADS, dim: int = DIM):
        mesh = create_mesh({"dp": 1, "tp": 8})
        pm = PartitionManager(PartitionAxis(kv_head_axis="tp"))
        meta = easykv.PagedAttentionCacheMetaData.create(mesh, max_seqs, layers, max_len, PAGE, heads, dim, 0.9,
                                                         dtype, partition_manager=pm, num_pages_per_layer=pages)
        meta = meta.replace(host_pages_per_layer=host_pages)
        cache = easykv.PagedAttentionCache.init_cache(mesh, dtype, meta, pm)
        self.layers = layers
        self.manager = PageManager(meta)
        self.runner = Runner(self.manager, cache, host=easykv.HostTier(cache), store=store)


def write_step(layers: int, tokens: int) -> Callable[[easykv.PagedAttentionCache, Any], tuple[Any, None]]:
    """A step writing random K and V for ``tokens`` rows of every layer (one jitted write)."""
    key = jax.random.key(tokens)
    k = jax.random.normal(key, (layers, tokens, HEADS, DIM), jnp.bfloat16)
    v = -k

    def step(cache: easykv.PagedAttentionCache, plan: Any) -> tuple[easykv.PagedAttentionCache, None]:
        cache, _ = cache.write(k, v, plan.metadata)
        return cache, None

    return step


def prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, tokens).tolist() for _ in range(n)]


def fill(pool: Pool, prompt: list[int], step: Callable[..., Any]) -> None:
    """Prefill ``prompt`` in one step (its full pages written through when the runner has a store)."""
    [seq] = pool.manager.claim(1)
    plan = pool.manager.schedule([seq], [len(prompt)])
    pool.runner.run(plan, step, token_ids=[prompt])
    pool.manager.release(seq)


def serve(pool: Pool, prompt: list[int]) -> tuple[float, float, int]:
    """Seconds until the host tier holds the prompt's prefix read from the store (`Runner.match_prefix`: the
    store's part), then until the device pool holds it (the host tier's onload), and the tokens found."""
    manager, runner = pool.manager, pool.runner
    [seq] = manager.claim(1)
    t = time.perf_counter()
    found = runner.match_prefix(seq, prompt)
    matched = time.perf_counter()
    plan = runner.schedule([seq], [len(prompt) - found])
    jax.block_until_ready(jax.tree.leaves(runner.cache))
    onloaded = time.perf_counter()
    manager.abort(plan)
    manager.release(seq)
    return matched - t, onloaded - matched, found


def redis_or_none(workdir: str) -> Any:
    """A started redis server of the tests' own kind (tests/support/redis_server.py: loopback, a free port, no
    persistence) working in ``workdir``, or None with the install line printed."""
    binary = shutil.which("redis-server")
    if binary is None:
        print(f"redis-server is not installed: the Redis column is skipped ({REDIS_INSTALL})")
        return None
    from tests.support.redis_server import RedisServer

    os.makedirs(workdir)
    server = RedisServer(binary, workdir)
    server.start()
    return server


def fetch_case(pages: int, repeats: int, store_dir: str, redis_url: str | None) -> dict[str, dict[str, float]]:
    """Part 1 for ``pages`` pages: per backend, median seconds of the end-to-end serve (its store part and its
    onload) and of the raw read. The same values are read once before either is timed (both warm), and the order of
    the two alternates round by round."""
    tokens = pages * PAGE + 1
    url = f"file://{store_dir}/fetch-{pages}"
    todo = prompts(repeats + WARMUP_ROUNDS, tokens, seed=pages)
    writer_store = PrefixStore(url, model_id=MODEL_ID)
    writer = Pool(FETCH_LAYERS, pages + 8, 8, tokens + PAGE, writer_store)
    step = write_step(FETCH_LAYERS, tokens)
    for prompt in todo:
        fill(writer, prompt, step)
    if not writer_store.flush(600):
        raise RuntimeError("the writer store did not drain within 600 s")
    stores = {"file": PrefixStore(url, model_id=MODEL_ID, read="wait")}
    if redis_url is not None:
        redis_store = PrefixStore(redis_url, model_id=MODEL_ID, read="wait")
        keys = writer_store.backend.list_keys()
        values = writer_store.backend.get_many(keys)
        redis_store.backend.put_if_absent([(k, v) for k, v in zip(keys, values) if v is not None])
        stores["redis"] = redis_store
    readers = {name: Pool(FETCH_LAYERS, 2 * pages + 8, 2 * pages + 8, tokens + PAGE, s) for name, s in stores.items()}
    times: dict[str, dict[str, list[float]]] = {name: {"serve": [], "store": [], "onload": [], "raw": []}
                                                for name in stores}
    page_bytes = 0
    for i, prompt in enumerate(todo):
        for name, reader in readers.items():
            ns = stores[name].namespace
            keys = [ns.key(0, d, h) for d in reader.manager.prompt_digests(prompt)[:pages] for h in range(HEADS)]
            stores[name].backend.get_many(keys)  # warm: both timings read values the engine holds in memory
            if i % 2:
                raw = _time(lambda: stores[name].backend.get_many(keys))  # noqa: B023 (called at once)
            store_s, onload_s, found = serve(reader, prompt)
            if not i % 2:
                raw = _time(lambda: stores[name].backend.get_many(keys))  # noqa: B023 (called at once)
            if found != pages * PAGE:
                raise RuntimeError(f"{name}: the store served {found} tokens of {pages * PAGE}")
            page_bytes = sum(len(v or b"") for v in stores[name].backend.get_many(keys[:HEADS]))
            if i >= WARMUP_ROUNDS:
                times[name]["serve"].append(store_s + onload_s)
                times[name]["store"].append(store_s)
                times[name]["onload"].append(onload_s)
                times[name]["raw"].append(raw)
    for s in (writer_store, *stores.values()):
        s.close()
    out = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    for o in out.values():
        o["mib"] = pages * page_bytes / 2**20
    return out


def _time(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def decode_case(steps: int, store_dir: str) -> dict[str, list[float]]:
    """Part 2: per-step seconds of 4 sequences decoding, with a write_through store and without, alternating."""
    seqs = 4
    max_len = (steps + 2 * PAGE) // PAGE * PAGE + PAGE
    pages = seqs * max_len // PAGE + 8
    store = PrefixStore(f"file://{store_dir}/decode", model_id=MODEL_ID)
    pools = {"off": Pool(FETCH_LAYERS, pages, 8, max_len, None), "write_through": Pool(FETCH_LAYERS, pages, 8, max_len,
                                                                                       store)}
    step = write_step(FETCH_LAYERS, seqs)
    prefill = write_step(FETCH_LAYERS, seqs * PAGE)
    rng = np.random.default_rng(7)
    ids: dict[str, list[int]] = {}
    for name, pool in pools.items():
        ids[name] = pool.manager.claim(seqs)
        plan = pool.manager.schedule(ids[name], PAGE)
        pool.runner.run(plan, prefill, token_ids=rng.integers(0, VOCAB, (seqs, PAGE)).tolist())
    times: dict[str, list[float]] = {name: [] for name in pools}
    for i in range(steps + 2):
        for name, pool in pools.items():
            new = rng.integers(0, VOCAB, (seqs, 1)).tolist()
            t = time.perf_counter()
            plan = pool.runner.schedule(ids[name], 1)
            pool.runner.run(plan, step, token_ids=new)
            jax.block_until_ready(jax.tree.leaves(pool.runner.cache))
            if i >= 2:  # the first steps compile
                times[name].append(time.perf_counter() - t)
    store.flush()
    metrics = store.metrics()
    store.close()
    if metrics.values_written == 0:
        raise RuntimeError(f"write_through wrote nothing: {metrics}")
    times["dropped"] = [float(metrics.dropped)]
    times["written"] = [float(metrics.values_written)]
    return times


def ttft_case(prefix: int, cfg: DemoConfig, repeats: int, store_dir: str) -> dict[str, float]:
    """Part 3: median seconds to the first token's logits, the prefix from the store against recomputed, for a
    model of ``cfg`` with random weights."""
    model = CompiledModel(DemoModel(cfg))
    url = f"file://{store_dir}/ttft-{cfg.layers}-{cfg.head_dim}"
    writer_store, reader_store = PrefixStore(url, model_id=MODEL_ID), PrefixStore(url, model_id=MODEL_ID, read="wait")
    pages = (prefix + PAGE) // PAGE + 4
    shape = {"heads": cfg.kv_heads, "dim": cfg.head_dim}
    writer = Pool(cfg.layers, 2 * pages, 8, prefix + 2 * PAGE, writer_store, **shape)
    reader = Pool(cfg.layers, 2 * pages, 2 * pages, prefix + 2 * PAGE, reader_store, **shape)
    times: dict[str, list[float]] = {"store": [], "recompute": []}
    for i, prompt in enumerate(prompts(repeats + 1, prefix + 1, seed=11)):
        seconds, found = first_token(model, writer, prompt)
        if found:
            raise RuntimeError(f"the recompute run found {found} tokens cached")
        if not writer_store.flush(600):
            raise RuntimeError("the writer store did not drain within 600 s")
        served, found = first_token(model, reader, prompt)
        if found != prefix:
            raise RuntimeError(f"the store served {found} tokens of {prefix}")
        if i:
            times["recompute"].append(seconds)
            times["store"].append(served)
    page_mib = writer_store.metrics().values_written and _value_bytes(writer_store) * cfg.kv_heads / 2**20
    writer_store.close()
    reader_store.close()
    return {**{k: statistics.median(v) for k, v in times.items()}, "mib": page_mib * (prefix // PAGE)}


def _value_bytes(store: PrefixStore) -> int:
    keys = store.backend.list_keys()[:1]
    return sum(len(v or b"") for v in store.backend.get_many(keys))


def first_token(model: CompiledModel, pool: Pool, prompt: list[int]) -> tuple[float, int]:
    """Seconds from admission to the first token's logits on the host (the prompt's uncached tokens computed
    in chunks of `PREFILL_CHUNK`, as an engine does); the prompt tokens found cached."""
    manager, runner = pool.manager, pool.runner
    [seq] = manager.claim(1)
    t = time.perf_counter()
    found = runner.match_prefix(seq, prompt)
    rest = prompt[found:]
    for start in range(0, len(rest), PREFILL_CHUNK):
        chunk = rest[start: start + PREFILL_CHUNK]
        plan = runner.schedule([seq], [len(chunk)])
        tokens = jnp.asarray(chunk, jnp.int32)

        def step(cache: easykv.PagedAttentionCache, plan: Any,
                 tokens: jax.Array = tokens) -> tuple[easykv.PagedAttentionCache, jax.Array]:
            logits, cache = model.paged_step(cache, tokens, plan.metadata)
            return cache, logits

        logits = runner.run(plan, step, token_ids=[chunk])
    np.asarray(logits[len(chunk) - 1])
    seconds = time.perf_counter() - t
    manager.release(seq)
    return seconds, found


def report_fetch(counts: list[int], repeats: int, store_dir: str, redis_url: str | None) -> None:
    print(f"\n1. fetch: N pages of 512 KiB (8 layers x 8 kv heads x 16 x 128, bf16) served from the store until the "
          f"device pool holds them, against backend.get_many of the same values; median of {repeats}")
    print("(store part: match_prefix, the reads, checks and copies into host pages; onload: the host tier's "
          "transfer to the device)")
    print("| backend | pages | MiB | served ms | store part ms | onload ms | raw get_many ms | ratio (target >= 0.8) "
          "| store part ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for pages in counts:
        for name, r in fetch_case(pages, repeats, store_dir, redis_url).items():
            print(f"| {name} | {pages} | {r['mib']:.0f} | {r['serve'] * 1e3:.1f} | {r['store'] * 1e3:.1f} | "
                  f"{r['onload'] * 1e3:.1f} | {r['raw'] * 1e3:.1f} | {r['raw'] / r['serve']:.2f}x | "
                  f"{r['raw'] / r['store']:.2f}x |")
    if redis_url is None:
        print(f"| redis | - | - | skipped: redis-server is not installed ({REDIS_INSTALL}) | | | | | |")


def report_decode(steps: int, store_dir: str) -> None:
    t = decode_case(steps, store_dir)
    off, on = t["off"], t["write_through"]
    print(f"\n2. decode: {steps} steps of 4 sequences (8 layers, one token's K and V each), write_through store "
          f"against none; {t['written'][0]:.0f} values written, {t['dropped'][0]:.0f} pages dropped")
    print("| store | median ms | mean ms |")
    print("|---|---|---|")
    for name, v in (("off", off), ("write_through", on)):
        print(f"| {name} | {statistics.median(v) * 1e3:.2f} | {statistics.mean(v) * 1e3:.2f} |")
    print(f"write_through / off: median {statistics.median(on) / statistics.median(off):.3f}x, "
          f"mean {statistics.mean(on) / statistics.mean(off):.3f}x (target <= 1.05x)")


def report_ttft(prefix: int, hidden: int, repeats: int, store_dir: str) -> None:
    shapes = {"the demo model (uniform: 4 layers, 8 kv heads, head_dim 16, hidden 128)": MODELS["uniform"],
              f"28 layers, 8 kv heads, head_dim 128, hidden {hidden}": DemoConfig(
                  layers=28, hidden=hidden, q_heads=16, kv_heads=HEADS, head_dim=DIM, mlp=2 * hidden, scan=True)}
    print(f"\n3. time to first token of a shared prefix of {prefix} tokens, random weights, median of {repeats}")
    print("| model | MiB of pages | served from the file:// store, one token computed, ms | recomputed, ms | ratio |")
    print("|---|---|---|---|---|")
    for name, cfg in shapes.items():
        r = ttft_case(prefix, cfg, repeats, store_dir)
        print(f"| {name} | {r['mib']:.0f} | {r['store'] * 1e3:.0f} | {r['recompute'] * 1e3:.0f} | "
              f"{r['recompute'] / r['store']:.2f}x |")


REPLICA_WORKER = os.path.join(os.path.dirname(__file__), "..", "tests", "multihost", "store_worker.py")


def replica_process(mesh: str, stores: list[str], requests: int, seed: int, out: str) -> list[dict[str, Any]]:
    """One replica process (tests/multihost/store_worker.py): a run per store URL ('none': without), as JSON."""
    argv = [sys.executable, REPLICA_WORKER, "replica", "--mesh", mesh, "--out", out, "--requests", str(requests),
            "--prompt-len", "160", "--shared", "144", "--new-tokens", "4", "--seed", str(seed)]
    for url in stores:
        argv += ["--store", url]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # its own 8 devices, set by the worker
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"replica process on {mesh} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    with open(out) as f:
        runs: list[dict[str, Any]] = json.load(f)
    return runs


def report_replicas(requests: int, store_dir: str) -> None:
    url = f"file://{store_dir}/replicas"
    t = time.perf_counter()
    [a] = replica_process("tp8", [url], requests, 0, os.path.join(store_dir, "replica-a.json"))
    b_store, b_none = replica_process("dp2tp4", [url, "none"], requests, 1, os.path.join(store_dir, "replica-b.json"))
    seconds = time.perf_counter() - t
    fewer = 1 - b_store["prefilled"] / b_none["prefilled"]
    same = b_store["outputs"] == b_none["outputs"]
    m = b_store["metrics"]
    print(f"\n4. replicas: {requests} requests at once, prompts of 160 tokens sharing 144 (90%), 4 greedy tokens; "
          f"A on tp=8 writes a file:// store, then B on dp=2 x tp=4 (another process) with it and without; "
          f"{seconds:.0f} s for both processes")
    print("| run | prompt tokens | prefilled | values written | pages read | tokens identical to B without |")
    print("|---|---|---|---|---|---|")
    print(f"| A, tp=8, store | {a['prompt_tokens']} | {a['prefilled']} | {a['metrics']['values_written']} | 0 | - |")
    print(f"| B, dp=2 x tp=4, store | {b_store['prompt_tokens']} | {b_store['prefilled']} | {m['values_written']} | "
          f"{m['pages_read']} | {'yes' if same else 'NO'} |")
    print(f"| B, dp=2 x tp=4, no store | {b_none['prompt_tokens']} | {b_none['prefilled']} | - | - | (itself) |")
    print(f"B prefilled {fewer:.1%} fewer prompt tokens with the store (target >= 85%); tokens identical: "
          f"{'yes' if same else 'NO'}; store refused {m['refused']}, failures {m['failures']}, dropped {m['dropped']}")
    if not same:
        raise RuntimeError("B's tokens with the store differ from B's without it")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="16 and 64 pages, 48 decode steps, a 256-token prefix, 2 repeats, 16 requests "
                             "of two replicas: "
                             "checks the script runs (CI); numbers rough")
    parser.add_argument("--repeats", type=int, default=None, help="default 7; --quick: 2")
    parser.add_argument("--part", choices=("fetch", "decode", "ttft", "replicas"), default=None, help="only this part")
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 7)
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, {os.cpu_count()} cores")
    store_dir = tempfile.mkdtemp(prefix="easykv-bench-store-")
    server = None
    try:
        if args.part in (None, "fetch"):
            server = redis_or_none(os.path.join(store_dir, "redis"))
            report_fetch([16, 64] if args.quick else [16, 256], repeats, store_dir, server and server.url)
        if args.part in (None, "decode"):
            report_decode(48 if args.quick else 256, store_dir)
        if args.part in (None, "ttft"):
            report_ttft(256 if args.quick else 2048, HIDDEN, repeats, store_dir)
        if args.part in (None, "replicas"):
            report_replicas(16 if args.quick else 64, store_dir)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(store_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
