"""Replicas sharing a prefix store across processes (issue 44), run by tests/multihost/test_store_multiprocess.py
and benchmarks/bench_store.py (case "replicas").

    python tests/multihost/store_worker.py replica --mesh tp8|dp2tp4 --store URL|none --out FILE.json [...]
    python tests/multihost/store_worker.py program-write|program-read URL   (2 processes under launch_local)

``replica``: one process on its own 8 CPU devices serves a workload through the demo engine (the trained
"uniform" model, host tier + `PrefixStore`), once per ``--store`` given (``none``: no store), and writes each
run's greedy tokens, prompt tokens prefilled and store metrics to ``--out``. With ``--pause-at STEP
--handshake DIR`` the run with a store stops after step ``STEP``, writes ``DIR/paused`` and goes on once
``DIR/resume`` exists (the test SIGKILLs the redis-server in between).

``program-write`` / ``program-read``: ONE multi-controller program (2 processes x 4 CPU devices) writing
prompts on one tp=8 mesh through a file store, then another reading them on dp=2 x tp=4; every backend call is
recorded, so each process can check it wrote and read only the kv heads its devices hold. Prints
"WORKER OK <pid>" when every check passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import threading
import time
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `tests.tiers.store.harness` when run as a script
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from easykv.tiers.store import StoreBackend  # noqa: E402  (JAX's backend starts later: devices set first)

MODEL_ID = "easykv-demo/uniform/trained"  # the demo's own id of these weights (easykv.demo.run._model_id)
PAGE = 16
# the shared opening of every prompt: English, as the trained byte-level demo model learned (its greedy
# tokens then rarely sit on a near-tie)
OPENING = ("easykv holds the attention keys and values of many sequences in fixed-size pages. The page manager "
           "hands out pages to each sequence, and prefix caching lets a new request reuse the pages of a shared "
           "opening. A sliding window layer keeps only the pages of its window. ")


@dataclasses.dataclass(frozen=True)
class Workload:
    """``requests`` prompts of ``prompt_len`` tokens: the first ``shared`` tokens are one opening for all, the
    rest unique to the request and to ``seed`` (another replica's users ask other questions)."""

    requests: int
    prompt_len: int
    shared: int
    new_tokens: int
    seed: int
    arrive_every: int = 0  # steps between arrivals; 0: all at once

    def prompts(self) -> list[list[int]]:
        opening = list(OPENING.encode())
        if self.shared > len(opening):
            raise ValueError(f"shared={self.shared} exceeds the opening's {len(opening)} tokens")
        out = []
        for i in range(self.requests):
            tail = f" #{self.seed}-{i}: what does the page manager do with the pages of a window?"  # unique first
            out.append(opening[: self.shared] + list(tail.encode())[: self.prompt_len - self.shared])
        return out


def run_replica(mesh_shape: dict[str, int], store_url: str | None, work: Workload, *, pause_at: int | None = None,
                handshake: str | None = None) -> dict:
    """One demo engine on ``mesh_shape`` serving ``work`` (with a `PrefixStore` at ``store_url``, or none)."""
    import jax.numpy as jnp

    import easykv
    from easykv import PageManager
    from easykv.demo.engine import Engine, Request
    from easykv.demo.model import CompiledModel
    from easykv.demo.run import demo_model
    from easykv.sharding import PartitionAxis, PartitionManager, create_mesh
    from easykv.tiers.store import PrefixStore

    model = _model(CompiledModel, demo_model)
    mesh = create_mesh(mesh_shape)
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp", page_axis="dp" if mesh_shape.get("dp", 1) > 1 else None))
    cfg = model.cfg
    max_len = -(-(work.prompt_len + work.new_tokens) // PAGE) * PAGE
    pages = work.requests * (max_len // PAGE) + 16
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, work.requests, cfg.layers, max_len, PAGE, cfg.kv_heads, cfg.head_dim, 0.9, jnp.float32,
        partition_manager=pm, num_pages_per_layer=pages).replace(host_pages_per_layer=64)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    store = None if store_url is None else PrefixStore(store_url, model_id=MODEL_ID, io_timeout_s=2.0)
    # every request a sequence slot and its whole prompt in one step's budget: all are admitted (and their
    # prefixes looked up) at their arrival, so without the store no request finds another's pages
    engine = Engine(model, cache, PageManager(meta), token_budget=min(1024, work.requests * max_len),
                    max_seqs=work.requests, prefill_chunk=work.prompt_len, host=easykv.HostTier(cache), store=store)
    prompts = work.prompts()
    requests = [Request(rid=i, prompt=p, max_new_tokens=work.new_tokens, arrival=i * work.arrive_every)
                for i, p in enumerate(prompts)]
    paused = threading.Event()

    def on_step(eng: Engine, _: list[Request]) -> None:
        if store is not None and pause_at is not None and eng.step_index >= pause_at and not paused.is_set():
            paused.set()
            _handshake(str(handshake))

    t = time.perf_counter()
    engine.run(requests, on_step=on_step)
    seconds = time.perf_counter() - t
    metrics = None
    if store is not None:
        store.close()  # every queued page written (or dropped) before the next replica starts
        metrics = dataclasses.asdict(store.metrics())
    m = engine.manager.metrics
    return {"mesh": mesh_shape, "store": store_url, "outputs": [r.output for r in requests],
            "prompt_tokens": sum(len(p) for p in prompts),
            "prefilled": sum(len(r.prompt) - r.cached for r in requests),
            "prefix_hit_tokens": m.prefix_hit_tokens, "steps": engine.step_index, "seconds": seconds,
            "metrics": metrics}


_MODELS: list = []


def _model(compiled, demo_model):
    """The trained "uniform" demo model, built once per process (its runs share the compiled steps)."""
    if not _MODELS:
        _MODELS.append(compiled(demo_model("uniform", "trained")))
    return _MODELS[0]


def _handshake(directory: str, timeout_s: float = 120.0) -> None:
    """Say ``paused`` and wait for ``resume`` (the test does its fault in between)."""
    pathlib.Path(directory, "paused").touch()
    deadline = time.monotonic() + timeout_s
    while not pathlib.Path(directory, "resume").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {directory}/resume within {timeout_s:g} s")
        time.sleep(0.02)


def replica_main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", choices=("tp8", "dp2tp4"), required=True)
    parser.add_argument("--store", action="append", required=True, help="a URL, or 'none'; repeat: one run each")
    parser.add_argument("--out", required=True)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=80)
    parser.add_argument("--shared", type=int, default=72)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arrive-every", type=int, default=0)
    parser.add_argument("--pause-at", type=int, default=None)
    parser.add_argument("--handshake", default=None)
    args = parser.parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    mesh = {"dp": 1, "tp": 8} if args.mesh == "tp8" else {"dp": 2, "tp": 4}
    work = Workload(args.requests, args.prompt_len, args.shared, args.new_tokens, args.seed, args.arrive_every)
    runs = [run_replica(mesh, None if url == "none" else url, work, pause_at=args.pause_at, handshake=args.handshake)
            for url in args.store]
    pathlib.Path(args.out).write_text(json.dumps(runs))


# ---- one multi-controller program (launch_local: 2 processes x 4 CPU devices) -------------------------------
PROGRAM_PROMPTS = [[7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 100 + i, 101 + i, 102 + i, 103 + i, 104 + i, 105 + i]
                   for i in range(3)]  # page 4: 3 shared pages, a 4th page of their own, 3 tokens more
PROGRAM_PAGE = 4


class RecordingBackend(StoreBackend):
    """A `StoreBackend` that passes every call on to ``inner`` and records the keys this process asked, read
    and put."""

    def __init__(self, inner: StoreBackend):
        self.inner, self.url = inner, inner.url
        self.put: list[str] = []
        self.read: list[str] = []
        self.asked: list[str] = []

    def exists_many(self, keys):
        self.asked.extend(keys)
        return self.inner.exists_many(keys)

    def get_many(self, keys):
        self.read.extend(keys)
        return self.inner.get_many(keys)

    def put_if_absent(self, items):
        self.put.extend(k for k, _ in items)
        return self.inner.put_if_absent(items)

    def delete_many(self, keys):
        return self.inner.delete_many(keys)

    def list_keys(self, prefix=""):
        return self.inner.list_keys(prefix)

    def stats(self, prefix=""):
        return self.inner.stats(prefix)

    def gc(self, max_bytes, prefix=""):
        return self.inner.gc(max_bytes, prefix)

    def close(self):
        self.inner.close()


def program_main(mode: str, url: str) -> None:
    from easykv.multihost import initialize_from_env

    pid = initialize_from_env(initialization_timeout=60, heartbeat_timeout_seconds=10, shutdown_timeout_seconds=10)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import easykv
    from easykv.multihost import assert_lockstep
    from easykv.sharding import PartitionAxis, PartitionManager, create_mesh
    from easykv.tiers.store import PrefixStore, open_backend
    from tests.tiers.store.harness import kv_of

    assert jax.process_count() == 2 and jax.local_device_count() == 4
    layers, heads, dim = 2, 8, 8
    if mode == "program-write":
        mesh = create_mesh({"dp": 1, "tp": 8})
        pm = PartitionManager(PartitionAxis(kv_head_axis="tp"))
    else:
        mesh = create_mesh({"dp": 2, "tp": 4})
        pm = PartitionManager(PartitionAxis(kv_head_axis="tp", page_axis="dp"))
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 4, layers, 32, PROGRAM_PAGE, heads, dim, 0.5, jnp.float32,
                                                     partition_manager=pm, num_pages_per_layer=32
                                                     ).replace(host_pages_per_layer=32)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    manager = easykv.PageManager(meta)
    backend = RecordingBackend(open_backend(url))
    store = PrefixStore(backend, model_id="tests/program", read="wait")
    runner = easykv.Runner(manager, cache, host=easykv.HostTier(cache), store=store)
    held = _held_heads(cache)  # the kv heads this process's devices hold, any replica
    spec = P(None, None, "tp")

    def write(tokens, start):
        k = np.stack([kv_of(tokens, start, layer, heads, dim) for layer in range(layers)])
        g = jax.make_array_from_callback(k.shape, NamedSharding(mesh, spec), lambda idx: k[idx])
        return lambda cache, plan: (cache.write(g, -g, plan.metadata)[0], None)

    def read_back(seq, n):
        rows = np.maximum(np.asarray(manager.pages(seq)), 0)
        out = []
        for layer in range(layers):
            k, v = easykv.gather_kv(runner.cache, layer, rows, n)
            out.append((np.asarray(multihost_utils.process_allgather(k, tiled=True)),
                        np.asarray(multihost_utils.process_allgather(v, tiled=True))))
        return out

    found_all = []
    for i, prompt in enumerate(PROGRAM_PROMPTS):
        [seq] = manager.claim(1)
        if mode == "program-read" and i == 0:
            # `_agree`: process 0 lets its fetch arrive, process 1 does not wait for its own (best_effort,
            # begun at admission): without agreeing on the least, their managers would adopt different pages
            store.read = "best_effort"
            if pid == 0:
                runner.prefetch(prompt)
                time.sleep(1.0)
        else:
            store.read = "wait"
            runner.prefetch(prompt)
        found = runner.match_prefix(seq, prompt)
        assert_lockstep(manager)  # the same adoption and lookup on every process
        found_all.append(found)
        plan = runner.schedule([seq], [len(prompt) - found])
        runner.run(plan, write(prompt[found:], found), token_ids=[prompt[found:]])
        assert_lockstep(manager)
        for layer, (k, v) in enumerate(read_back(seq, len(prompt))):  # pages identical to the writer's
            np.testing.assert_array_equal(k, kv_of(prompt, 0, layer, heads, dim), f"prompt {i} layer {layer} K")
            np.testing.assert_array_equal(v, -kv_of(prompt, 0, layer, heads, dim), f"prompt {i} layer {layer} V")
        manager.release(seq)
    assert store.flush(60)
    m = store.metrics()
    put_heads = {int(k.rsplit("/", 1)[1]) for k in backend.put}
    read_heads = {int(k.rsplit("/", 1)[1]) for k in backend.read + backend.asked}
    assert put_heads <= held and read_heads <= held, (pid, held, put_heads, read_heads)
    report = {"pid": pid, "held": sorted(held), "found": found_all, "written": m.values_written,
              "present": m.values_present, "read": m.values_read, "pages_read": m.pages_read,
              "put_heads": sorted(put_heads), "read_heads": sorted(read_heads), "failures": m.failures,
              "refused": m.refused, "dropped": m.dropped}
    multihost_utils.sync_global_devices("every value written")
    if pid == 0:
        report["keys"] = len(backend.list_keys())
    store.close()
    print("STORE REPORT " + json.dumps(report), flush=True)
    print(f"WORKER OK {pid}", flush=True)


def _held_heads(cache) -> set[int]:
    """The kv heads of layer group 0 on this process's devices (the pool's axis 1)."""
    pages = cache.key_pages[0]
    held = set()
    for shard in pages.addressable_shards:
        s = shard.index[1]
        held.update(range(s.start or 0, pages.shape[1] if s.stop is None else s.stop))
    return held


if __name__ == "__main__":
    if sys.argv[1] == "replica":
        replica_main(sys.argv[2:])
    elif sys.argv[1] in ("program-write", "program-read"):
        program_main(sys.argv[1], sys.argv[2])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}; use replica, program-write or program-read")
