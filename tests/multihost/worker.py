"""One worker of a 2-process run started by easykv.multihost.launch_local (see test_multihost.py).

    python tests/multihost/worker.py MODE [ARGS...]

Prints "WORKER OK <pid>" when every check of MODE passed; any failure raises (exit code != 0).
With $EASYKV_TEST_PID_DIR set, records its pid there (tests check no worker outlives the launcher).
"""

import os
import signal
import sys
import time

from easykv.multihost import initialize_from_env

MODE = sys.argv[1]
if "EASYKV_TEST_PID_DIR" in os.environ:
    open(os.path.join(os.environ["EASYKV_TEST_PID_DIR"], f"pid-{os.getpid()}"), "w").close()
if MODE == "die-early":
    if os.environ.get("EASYKV_PROCESS_ID") == "1":
        print("process 1 fails on purpose", flush=True)
        raise SystemExit(3)
pid = initialize_from_env(initialization_timeout=60, heartbeat_timeout_seconds=10, shutdown_timeout_seconds=10)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import easykv  # noqa: E402
from easykv.errors import LockstepError  # noqa: E402
from easykv.multihost import assert_lockstep  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402
from easykv.tiers.sleep import device_bytes  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4


def global_array(x, mesh, spec):
    """A global array from host data that every process holds in full (tests only)."""
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


def cache_mode(layout: str) -> None:
    if layout == "dp":  # pages split over dp: replica 0's pages live on process 0's devices
        mesh = create_mesh({"dp": 2, "tp": 4})
        pm = PartitionManager(PartitionAxis(page_axis="dp"))
    else:
        mesh = create_mesh({"tp": 8})
        pm = PartitionManager(PartitionAxis())
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 4, 2, 64, 8, 8, 16, 0.9, jnp.bfloat16, partition_manager=pm, num_pages_per_layer=32
    )
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm)
    pages = cache[0].key_pages
    assert not pages.is_fully_addressable  # each process holds only its own shards
    assert len(pages.addressable_shards) == 4
    rng = np.random.default_rng(7)  # same seed on every process: same "model output"
    rows = np.array([[2, 30, -1, -1, -1, -1, -1, -1], [17, 5, 9, -1, -1, -1, -1, -1]], np.int32)
    step_meta = easykv.PagedAttentionMetadata.for_mixed(rows, [0, 0], [11, 20], cache_metadata=meta, pad_tokens_to=32)
    k = rng.normal(size=(2, 32, 8, 16)).astype(jnp.bfloat16)
    v = rng.normal(size=(2, 32, 8, 16)).astype(jnp.bfloat16)
    spec = P(None, None, "tp")
    cache, dropped = cache.write(global_array(k, mesh, spec), global_array(v, mesh, spec), step_meta)
    assert dropped.is_fully_replicated and int(dropped.addressable_data(0)) == 0
    for layer in range(2):
        for seq, (start, n) in enumerate([(0, 11), (11, 20)]):
            keys, values = easykv.gather_kv(cache, layer, rows[seq], n)
            keys = np.asarray(multihost_utils.process_allgather(keys, tiled=True))
            values = np.asarray(multihost_utils.process_allgather(values, tiled=True))
            assert np.array_equal(keys, k[layer, start : start + n]), (layer, seq)
            assert np.array_equal(values, v[layer, start : start + n]), (layer, seq)
    assert_lockstep({"rows": rows.tolist(), "step": 1})


def shared_data():
    """The cache contents every test process agrees on (same seed everywhere)."""
    rng = np.random.default_rng(11)
    k = rng.normal(size=(2, 32, 8, 16)).astype(np.float32)
    v = rng.normal(size=(2, 32, 8, 16)).astype(np.float32)
    q = rng.normal(size=(2, 16, 16)).astype(np.float32)
    return k, v, q


def gathered(x):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def check_restored(restored, k, v) -> None:
    cache, manager = restored
    rows = manager.page_table([0, 1])
    for layer in range(2):
        for seq, (start, n) in enumerate([(0, 11), (11, 20)]):
            keys, values = easykv.gather_kv(cache, layer, rows[seq], n)
            assert np.array_equal(gathered(keys), k[layer, start : start + n]), (layer, seq)
            assert np.array_equal(gathered(values), v[layer, start : start + n]), (layer, seq)
    assert manager.length(0) == 11 and manager.length(1) == 20
    assert_lockstep(manager)


def checkpoint_mode(directory: str, action: str) -> None:
    """save: write, attend and save from both processes; restore: restore a checkpoint (written
    by 1 or 2 processes) onto dp=2 x tp=4 and check every value."""
    from easykv.checkpoint.checkpointer import restore_cache, save_cache

    k, v, q = shared_data()
    if action == "save":
        mesh = create_mesh({"tp": 8})
        pm = PartitionManager(PartitionAxis())
        meta = easykv.PagedAttentionCacheMetaData.create(
            mesh, 4, 2, 64, 8, 8, 16, 0.9, jnp.float32, partition_manager=pm, num_pages_per_layer=32
        )
        cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
        manager = easykv.PageManager(meta)
        a, b = manager.claim(2)
        plan = manager.schedule([a, b], [11, 20])
        rows = manager.page_table([a, b])  # the pages the manager chose
        step_meta = easykv.PagedAttentionMetadata.for_mixed(rows, [0, 0], [11, 20], cache_metadata=meta,
                                                            pad_tokens_to=32)
        spec = P(None, None, "tp")
        cache, _ = cache.write(global_array(k, mesh, spec), global_array(v, mesh, spec), step_meta)
        manager.commit(plan)
        # attend across both processes: each holds half the kv heads
        decode = easykv.PagedAttentionMetadata.for_decode(rows, [10, 19], cache_metadata=meta)
        out = gathered(easykv.view_attention(global_array(q, mesh, P(None, "tp")), cache[1], decode))
        ref = easykv.paged_attention_reference(q, np.asarray(gathered_pages(cache[1].key_pages)),
                                               np.asarray(gathered_pages(cache[1].value_pages)), decode)  # fmt: skip
        np.testing.assert_allclose(out, np.asarray(ref), rtol=1e-5, atol=1e-5)
        save_cache(directory, cache, manager, step=3)
    mesh2 = create_mesh({"dp": 2, "tp": 4})
    check_restored(restore_cache(directory, mesh=mesh2, partition_manager=PartitionManager(PartitionAxis())), k, v)


def grouped_mode(directory: str) -> None:
    """A cache of two layer groups (sliding window 6 over 4 kv heads; full over 8 heads with V
    narrower than K) with pages split over dp: both processes run the same PageManager calls,
    write through its per-group metadata, read every window back, stay in lock-step, save from
    both, and restore onto tp=8 with the manager re-sliced."""
    from easykv.checkpoint.checkpointer import restore_cache, save_cache

    mesh = create_mesh({"dp": 2, "tp": 4})
    groups = (easykv.LayerGroup((0,), "sliding", 6, num_kv_heads=4, key_head_dim=16, value_head_dim=16, num_pages=16),
              easykv.LayerGroup((1,), "full", num_kv_heads=8, key_head_dim=16, value_head_dim=8, num_pages=32))
    pm = PartitionManager(PartitionAxis(page_axis="dp"))
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 4, 2, 64, 8, 8, 16, 0.9, jnp.float32,
                                                     partition_manager=pm, layer_groups=groups)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    manager = easykv.PageManager(cache.metadata)
    a, b = manager.claim(2)
    rng = np.random.default_rng(5)  # the same "model output" on every process
    shapes = [(4, 16, 16), (8, 16, 8)]  # per layer: heads, K dim, V dim
    hist = {s: [[np.zeros((0, h, dk), np.float32), np.zeros((0, h, dv), np.float32)] for h, dk, dv in shapes]
            for s in (a, b)}
    spec = P(None, "tp")
    runner = easykv.Runner(manager, cache)

    def write(keys, values):
        return lambda cache, plan: cache.write(keys, values, plan.metadata)

    for counts in ([11, 20], [1, 1], [1, 1], [1, 1]):
        plan = manager.schedule([a, b], counts)
        n = sum(counts)
        ks = [rng.normal(size=(n, h, dk)).astype(np.float32) for h, dk, _ in shapes]
        vs = [rng.normal(size=(n, h, dv)).astype(np.float32) for h, _, dv in shapes]
        keys, values = [global_array(k, mesh, spec) for k in ks], [global_array(v, mesh, spec) for v in vs]
        dropped = runner.run(plan, write(keys, values), token_ids=[list(range(c)) for c in counts])
        assert int(dropped.addressable_data(0)) == 0
        t = 0
        for s, c in zip((a, b), counts):
            for layer in range(2):
                hist[s][layer] = [np.concatenate([hist[s][layer][0], ks[layer][t:t + c]]),
                                  np.concatenate([hist[s][layer][1], vs[layer][t:t + c]])]
            t += c
        assert_lockstep(manager)
    cache = runner.cache

    def check(cache, manager):
        for s in (a, b):
            for layer in range(2):
                first = manager.sequence(s).first_kept[layer]
                row = np.maximum(np.asarray(manager.pages(s, group=layer)), 0)
                keys, values = easykv.gather_kv(cache, layer, row, manager.length(s))
                assert np.array_equal(gathered(keys)[first:], hist[s][layer][0][first:]), (s, layer)
                assert np.array_equal(gathered(values)[first:], hist[s][layer][1][first:]), (s, layer)
        assert_lockstep(manager)

    assert manager.sequence(b).first_kept[0] == 18  # length 23, window 6: the rest was released
    check(cache, manager)
    # sleep (each process keeps its own shards in host memory) and wake where it slept
    pool = device_bytes(cache)
    sleeping = easykv.sleep(cache, manager)
    assert sleeping.host_bytes == pool and device_bytes(sleeping.key_pages) == 0
    cache, manager = easykv.wake(sleeping)
    check(cache, manager)
    save_cache(directory, cache, manager, step=1)
    cache, manager = restore_cache(directory, mesh=create_mesh({"tp": 8}), partition_manager=PartitionManager(
        PartitionAxis()))
    check(cache, manager)
    # and from tp=8 back onto dp=2 x tp=4 through host memory: the manager re-sliced over dp
    cache, manager = easykv.wake(easykv.sleep(cache, manager), mesh=mesh, partition_manager=pm)
    assert manager.metadata.page_shards == 2
    check(cache, manager)


def host_tier_mode() -> None:
    """A host tier across two processes (pages over dp=2 x tp=4; each process keeps its own
    shards' host pages): prefixes evicted from a small pool come back from the host bit for bit,
    a sequence swapped out mid-way returns unchanged, and both processes stay in lock-step."""
    mesh = create_mesh({"dp": 2, "tp": 4})
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp", page_axis="dp"))
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 4, 2, 32, 4, 8, 16, 0.9, jnp.float32, partition_manager=pm,
                                                     num_pages_per_layer=16).replace(host_pages_per_layer=32)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    manager = easykv.PageManager(meta)
    runner = easykv.Runner(manager, cache, host=easykv.HostTier(cache))
    rng = np.random.default_rng(3)
    prompts = [[50 * i + t for t in range(13)] for i in range(4)]
    written = {i: rng.normal(size=(2, 13, 8, 16)).astype(np.float32) for i in range(4)}
    spec = P(None, None, "tp")

    def read(seq, n):
        return [gathered(easykv.gather_kv(runner.cache, layer, np.asarray(manager.pages(seq)), n)[0])
                for layer in range(2)]

    def write(keys):
        return lambda cache, plan: cache.write(keys, keys, plan.metadata)

    for _ in range(2):
        for i, prompt in enumerate(prompts):
            [s] = manager.claim(1)
            done = manager.match_prefix(s, prompt)
            plan = runner.schedule([s], [13 - done])  # its work (the hit's onloads) applied at once
            for layer, keys in enumerate(read(s, done) if done else ()):
                assert np.array_equal(keys, written[i][layer, :done]), (i, layer)
            runner.run(plan, write(global_array(written[i][:, done:], mesh, spec)), token_ids=[prompt[done:]])
            manager.release(s)
            assert_lockstep(manager)
    assert manager.metrics.host.host_hits >= 3
    [s] = manager.claim(1)
    plan = manager.schedule([s], [10])
    runner.run(plan, write(global_array(written[0][:, :10], mesh, spec)), token_ids=[list(range(10))])
    manager.swap_out(s)
    runner.apply_pending()
    assert_lockstep(manager)
    manager.swap_in(s)
    runner.apply_pending()
    for layer, keys in enumerate(read(s, 10)):
        assert np.array_equal(keys, written[0][layer, :10]), layer
    assert_lockstep(manager)


def gathered_pages(pages):
    return multihost_utils.process_allgather(pages, tiled=True)


def diverge_mode() -> None:
    assert_lockstep({"seq": [1, 2, 3]})  # identical: passes
    try:
        assert_lockstep({"seq": [1, 2, 3 + pid]})
    except LockstepError as err:
        assert "processes [1] disagree with processes [0]" in str(err), str(err)
    else:
        raise AssertionError("divergent state was not detected")


def fail_mode(how: str, who: int) -> None:
    """Process ``who`` fails after initialize as ``how`` says; the others wait for it in a collective."""
    if pid == who:
        print(f"process {pid} fails on purpose ({how}) at {time.time():.3f}", flush=True)
        if how == "raise":
            raise RuntimeError(f"process {pid} fails on purpose")
        if how == "sys-exit":
            sys.exit(3)
        if how == "systemexit":
            raise SystemExit(3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise SystemExit(f"unknown failure {how!r}")
    multihost_utils.sync_global_devices("waits for the failing process")
    raise AssertionError("a collective returned although a process had failed")


def raise_mid_collective_mode(who: int) -> None:
    """Process ``who`` raises while its peer waits in a collective with it; the peer's collective
    then fails too (its connection to ``who`` closes), so both exit with 1."""
    multihost_utils.sync_global_devices("both joined")  # the collectives' connections are up
    if pid == who:
        time.sleep(0.5)  # the peer is inside the collective below by now
        raise RuntimeError(f"raiser-marker-{pid}")
    multihost_utils.sync_global_devices("the raiser never comes")
    raise AssertionError("a collective returned although a process had failed")


def hang_mode() -> None:
    """Process 1 lives on (JAX's heartbeats go on) but never joins process 0's collective."""
    if pid == 1:
        time.sleep(600)
    multihost_utils.sync_global_devices("process 1 never comes")


def skew_mode(late: int) -> None:
    """Process ``late`` finishes 3 s after the other, which ends by sys.exit(0): a clean exit, so it
    waits in JAX's shutdown barrier for the late one."""
    multihost_utils.sync_global_devices("both ran")
    if pid == late:
        time.sleep(3)
    else:
        print(f"WORKER OK {pid}", flush=True)
        sys.exit(0)


if MODE in ("cache-tp", "cache-dp"):
    cache_mode(MODE.split("-")[1])
elif MODE == "checkpoint":
    checkpoint_mode(sys.argv[2], sys.argv[3])
elif MODE == "grouped":
    grouped_mode(sys.argv[2])
elif MODE == "host-tier":
    host_tier_mode()
elif MODE == "diverge":
    diverge_mode()
elif MODE == "fail":
    fail_mode(sys.argv[2], int(sys.argv[3]))
elif MODE == "raise-mid-collective":
    raise_mid_collective_mode(int(sys.argv[2]))
elif MODE == "hang":
    hang_mode()
elif MODE == "skew":
    skew_mode(int(sys.argv[2]))
elif MODE == "die-early":
    multihost_utils.sync_global_devices("never reached by process 1")
else:
    raise SystemExit(f"unknown mode {MODE!r}")
print(f"WORKER OK {pid}", flush=True)
