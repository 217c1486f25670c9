"""Device work on pages compiles a number of programs logarithmic in the pool (issue 42).

Copies, scrubs and host-tier transfers are padded to one bucket per call (a power of two, at
most the pool's pages), so a long run compiles at most ``2 + log2(pages)`` shapes of the program
that does them, however many distinct counts of work it meets, and no other program (the host
tier's staging arrays are put on the devices, not made by one); padding never touches a page.

Programs are counted when jax lowers them (``jaxpr_to_mlir_module`` events), before the disk
compilation cache the tests share is asked, so a program counts although another process
compiled it first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv.errors import CacheFullError
from easykv.sharding import PartitionAxis, PartitionManager
from easykv.storage.page_work import work_bucket
from easykv.tiers import host as host_module
from tests.support.pools import new_cache

LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
POOL, PAGE = 64, 4
BOUND = 2 + math.log2(POOL)


@contextlib.contextmanager
def lowered_programs() -> Iterator[list[str]]:
    """The names of the programs jax lowers inside the block, in order."""
    names: list[str] = []

    def listen(event: str, duration: float, **kwargs: object) -> None:
        if event == LOWERED:
            names.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def small_pool(tp8, *, host: bool, dtype=jnp.bfloat16):
    """A 64-page pool of 4-token pages (2 layers, 8 kv heads over tp=8); with ``host``, a host
    tier of 64 pages."""
    meta = easykv.PagedAttentionCacheMetaData.create(
        tp8, 8, 2, 64, PAGE, 8, 8, 0.5, dtype,
        partition_manager=PartitionManager(PartitionAxis(kv_head_axis="tp")), num_pages_per_layer=POOL)
    if host:
        meta = meta.replace(host_pages_per_layer=POOL)
    cache = easykv.PagedAttentionCache.init_cache(tp8, dtype, meta,
                                                  PartitionManager(PartitionAxis(kv_head_axis="tp")))
    tier = easykv.HostTier(cache) if host else None
    return cache, tier, easykv.PageManager(meta, scrub_released=True)


class RandomLoad:
    """Arrivals (shared prefixes), prefill and decode steps, forks, truncations, releases, weight
    versions, prefix-cache resets and (with a host tier) swaps, in random order; the runner
    applies the device work: each step's plan's before its (empty) step, and the work no plan
    took after some of the other actions (the work of several waits for one call), with the
    programs it lowers recorded. No K/V is written: only the device work is counted."""

    def __init__(self, cache, tier, manager, seed: int):
        self.runner, self.tier, self.m = easykv.Runner(manager, cache, host=tier), tier, manager
        self.rng = np.random.default_rng(seed)
        self.prefixes = [list(self.rng.integers(1, 500, 24)) for _ in range(3)]
        self.work_sizes: set[int] = set()  # distinct sizes of pending copies + scrubs met

    def met(self, work) -> None:
        self.work_sizes.add(sum(a.size for a in work.scrubs()) + work.num_copies)

    def apply(self, programs: list[str]) -> None:
        """The work no plan took (`Runner.apply_pending`)."""
        self.met(self.m.clone().take_work())  # the pending work, read on a copy
        with lowered_programs() as names:
            self.runner.apply_pending()
        programs += names

    def running(self) -> list[int]:
        return [s for s in self.m.active_ids if not (self.tier and self.m.sequence(s).swapped)]

    def write(self, seqs: list[int], tokens: list[list[int]], programs: list[str]) -> None:
        """A step of ``seqs`` run by the runner: the plan's work (everything pending), a step that writes
        nothing, the commit."""
        try:
            plan = self.m.schedule(seqs, [len(t) for t in tokens])
        except CacheFullError:
            return
        self.met(plan.work)
        with lowered_programs() as names:
            self.runner.run(plan, lambda cache, plan: (cache, None), token_ids=tokens)
        programs += names

    def action(self, programs: list[str]) -> None:
        m, rng, running = self.m, self.rng, self.running()
        kind = rng.choice(["arrive", "decode", "fork", "truncate", "release", "version", "reset", "swap"],
                          p=[0.25, 0.25, 0.1, 0.1, 0.15, 0.03, 0.02, 0.1])
        if kind == "arrive" and m.slots_remaining:
            [s] = m.claim(1)
            shared = self.prefixes[rng.integers(3)][: rng.integers(1, 25)]
            prompt = shared + list(rng.integers(1, 500, rng.integers(1, 30)))
            done = m.match_prefix(s, prompt)
            if done < len(prompt):
                self.write([s], [prompt[done:]], programs)
        elif kind == "decode" and running:
            seqs = [s for s in running if m.length(s) < m.max_length]
            if seqs:
                self.write(seqs, [[int(rng.integers(1, 500))] for _ in seqs], programs)
        elif kind == "fork" and running and m.slots_remaining:
            m.fork(int(rng.choice(running)))
        elif kind == "truncate" and running:
            s = int(rng.choice(running))
            if m.length(s) > 1:
                m.truncate(s, int(rng.integers(1, m.length(s))))
        elif kind == "release" and m.active_ids:
            m.release(int(rng.choice(m.active_ids)))
        elif kind == "version":
            m.set_weight_version(int(rng.integers(1, 4)))
        elif kind == "reset":
            m.reset_prefix_cache()  # every cached page is freed: a large scrub
        elif kind == "swap" and self.tier is not None:
            swapped = m.swapped_ids
            if swapped and rng.random() < 0.5:
                with contextlib.suppress(CacheFullError):
                    m.swap_in(int(rng.choice(swapped)))
            elif running:
                m.swap_out(int(rng.choice(running)))
        if rng.random() < 0.3:  # else the work of several actions waits for one call
            self.apply(programs)

    def run(self, actions: int) -> list[str]:
        programs: list[str] = []
        for _ in range(actions):
            self.action(programs)
        for s in list(self.m.active_ids):
            self.m.release(s)
        self.apply(programs)
        return programs


def assert_all_free(manager) -> None:
    manager.check_invariants()
    m = manager.metrics
    assert m.used_pages == 0 and not manager.active_ids and not manager.has_pending_work, m


@pytest.mark.parametrize("host", [False, True], ids=["device", "host-tier"])
def test_a_long_random_run_compiles_at_most_2_plus_log2_pool_device_work_programs(tp8, host):
    """Every program lowered while the runner applies device work over 400 random actions, whatever it is:
    fails on a tree that shapes the device work by its count (one program per count, or per
    combination of counts of transfers, copies and scrubs), and on one that compiles programs
    beside it (zeroed staging arrays made by a jitted ``zeros`` for calls without onloads)."""
    cache, tier, manager = small_pool(tp8, host=host)
    load = RandomLoad(cache, tier, manager, seed=7)
    programs = load.run(400)
    assert len(load.work_sizes) > BOUND + 4  # enough distinct counts that one program per count would show
    assert len(programs) <= BOUND, f"{len(programs)} programs for a pool of {POOL} pages: {programs}"
    assert set(programs) == {"jit(_move)" if host else "jit(page_work)"}
    if host:  # sequences went to the host tier and came back through the same program
        assert tier.bytes_offloaded > 0 and tier.bytes_onloaded > 0
    assert_all_free(manager)


def test_thirty_scrubs_and_copies_of_1_to_30_pages_compile_a_few_programs(tp8):
    """The issue's reproduction: zeroing (then copying) 1, 2, ..., 30 pages compiled 30 programs
    each; padded to a power of two, at most log2(64) + 2 in all (one program does both)."""
    cache, _, _ = small_pool(tp8, host=False, dtype=jnp.float32)  # a pool no other test compiles for
    with lowered_programs() as names:
        for n in range(1, 31):
            cache = cache.zero_pages(np.arange(n, dtype=np.int32))
            cache = cache.copy_pages(np.arange(n, dtype=np.int32), np.arange(32, 32 + n, dtype=np.int32))
    assert len(names) <= BOUND, names
    assert set(names) == {"jit(page_work)"}


def test_buckets_are_powers_of_two_capped_at_the_pool():
    assert [work_bucket(n, 48) for n in (0, 1, 2, 3, 5, 17, 33, 47, 48)] == [0, 1, 2, 4, 8, 32, 48, 48, 48]
    assert work_bucket(100, 48) == 128  # only a caller's own padding can exceed the pool: still a power of two
    assert len({work_bucket(n, POOL) for n in range(1, POOL + 1)}) <= BOUND


def pool_contents(cache) -> list[np.ndarray]:
    return [np.asarray(a).copy() for a in jax.tree.leaves((cache.key_pages, cache.value_pages))]


def numbered(cache):
    """``cache`` with every element distinct and non-zero (each page holds its own numbers), on
    the cache's own layout."""
    def number(a):
        return jax.jit(lambda: (jnp.arange(a.size).reshape(a.shape) % 60000 + 1).astype(a.dtype),
                       out_shardings=a.sharding)()

    return dataclasses.replace(cache, key_pages=tuple(number(a) for a in cache.key_pages),
                               value_pages=tuple(number(a) for a in cache.value_pages))


@pytest.mark.parametrize("layout", ["heads", "dp"])
def test_padding_never_touches_a_page(layout):
    """Copies and scrubs padded with -1 (by the caller and by the bucket) change exactly the real
    pages, bit for bit: no -1 is clipped into page 0 or the last page, on a head-sharded pool
    and on one whose pages are split over two data-parallel replicas."""
    cache = numbered(new_cache(layout))
    before = pool_contents(cache)
    pages = before[0].shape[2]  # 24: page 11 ends the first replica's slice on "dp"
    src = np.array([3, -1, 13, 5, -1], np.int32)
    dst = np.array([-1, 7, 20, 9, -1], np.int32)  # one real pair per slice; the rest padding
    cache = cache.copy_pages(src, dst)
    cache = cache.zero_pages(np.array([-1, 2, 23, -1, -1], np.int32))
    cache = cache.copy_pages(jnp.asarray([-1, 0], jnp.int32), jnp.asarray([11, -1], jnp.int32))  # device ids
    for old, new in zip(before, pool_contents(cache)):
        want = old.copy()
        want[:, :, 20], want[:, :, 9] = old[:, :, 13], old[:, :, 5]
        want[:, :, 2] = want[:, :, 23] = 0
        changed = sorted({p for p in range(pages) if not np.array_equal(new[:, :, p], old[:, :, p])})
        assert changed == [2, 9, 20, 23]
        np.testing.assert_array_equal(new, want)


def test_empty_work_runs_no_program(tp8):
    cache, _, _ = small_pool(tp8, host=False)
    with lowered_programs() as names:
        assert cache.zero_pages(np.zeros(0, np.int32)) is cache
        assert cache.copy_pages(np.zeros(0, np.int32), np.zeros(0, np.int32)) is cache
    assert names == []


def test_transfers_are_not_padded_to_the_scrubs_beside_them():
    """A few onloads beside many scrubs: the onloads go in a call of their own bucket (moving 2
    pages over the host link, not 64), the scrubs in one of theirs; copies ride along where
    they fit, and a long swap moves in chunks of `TRANSFER_CHUNK` pages."""
    def plan(off: int, on: int):
        def ids(n: int) -> np.ndarray:
            return np.zeros((1, n), np.int32)
        return host_module._Plan(ids(off), ids(off), np.array([off]), ids(on), ids(on), np.array([on]))

    def calls(off: int, copies: int, on: int, scrubs: int):
        device = [(np.zeros(copies, np.int32), np.zeros(copies, np.int32), np.zeros(scrubs, np.int32))]
        return [(c.size, c.width, sorted(c.parts)) for c in host_module._calls([plan(off, on)], device, 512)]

    assert calls(0, 0, 2, 40) == [(2, 2, ["on"]), (64, 64, ["scrubs"])]
    assert calls(1, 1, 2, 2) == [(1, 1, ["copies", "off"]), (2, 2, ["on", "scrubs"])]
    assert calls(0, 3, 0, 100) == [(128, 64, ["copies", "scrubs"])]
    assert calls(0, 0, 150, 0) == [(64, 64, ["on"]), (64, 64, ["on"]), (32, 32, ["on"])]
    # Both directions share a call's staging arrays, so they never share a call.
    assert calls(2, 0, 2, 0) == [(2, 2, ["off"]), (2, 2, ["on"])]
    assert calls(4, 3, 4, 4) == [(4, 4, ["copies", "off"]), (4, 4, ["on", "scrubs"])]
    assert calls(64, 0, 100, 0) == [(64, 64, ["off"]), (64, 64, ["on"]), (64, 64, ["on"])]
    assert calls(64, 0, 0, 300) == [(512, 64, ["off", "scrubs"])]  # a full chunk is never padded


def test_onloads_beside_many_scrubs_come_back_exact_and_the_rest_reads_zero(tp8):
    """A swapped-out sequence comes back in the same `Runner.apply_pending` as a large scrub (split
    into a call of the onloads' bucket and one of the scrubs'): its pages read back bit for bit
    and every other page of the pool reads zero."""
    cache, tier, m = small_pool(tp8, host=True)
    runner = easykv.Runner(m, cache, host=tier)
    rng = np.random.default_rng(3)
    written = {}
    for n in (12, 20, 20, 20, 20, 20):  # the first (3 pages) is swapped; the others fill 25 pages
        [s] = m.claim(1)
        plan = m.schedule([s], [n])
        k = jnp.asarray(rng.standard_normal((2, n, 8, 8)), jnp.bfloat16)
        runner.run(plan, lambda cache, plan, k=k: cache.write(k, -k, plan.metadata),
                   token_ids=[list(rng.integers(1, 500, n))])
        written[s] = k
    a, *others = written
    m.swap_out(a)
    runner.apply_pending()
    for s in others:
        m.release(s)
    m.reset_prefix_cache()  # every page the others held is freed: a scrub of about 25 pages
    m.swap_in(a)
    work = m.clone().take_work()  # the pending work, read on a copy
    transfers, scrubs = work.transfers(), work.scrubs()
    assert 0 < transfers[0][2].size <= 4 and scrubs[0].size > 16
    runner.apply_pending()
    cache = runner.cache
    row = np.asarray(m.page_table([a])[0])
    for layer in range(2):
        k, v = easykv.gather_kv(cache, layer, row, 12)
        np.testing.assert_array_equal(np.asarray(k), np.asarray(written[a][layer]))
        np.testing.assert_array_equal(np.asarray(v), -np.asarray(written[a][layer]))
    held = set(m.pages(a))
    for leaf in pool_contents(cache):
        others_pages = [p for p in range(POOL) if p not in held]
        assert not np.any(leaf[:, :, others_pages])


@pytest.mark.parametrize("mesh", ["tp8", "dp2tp4"])
def test_the_host_tier_program_updates_the_pool_in_place(mesh, request, monkeypatch):
    """The host tier's program (offloads gathered as an output beside in-place writes) needs
    scratch memory of the pages it moves, not of the pool: XLA copied the whole pool on every
    call to keep the gather's input (also for calls that only zero pages)."""
    mesh = request.getfixturevalue(mesh)
    dp = mesh.shape["dp"]
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp", page_axis="dp" if dp > 1 else None))
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 4, 2, 64, 16, 8, 64, 0.5, jnp.float32, partition_manager=pm, num_pages_per_layer=512,
    ).replace(host_pages_per_layer=64)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    tier = easykv.HostTier(cache)
    calls = []
    real = host_module._move

    def spy(*args, **kwargs):
        calls.append((jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                   if isinstance(x, jax.Array) else x, args), kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(host_module, "_move", spy)
    empty = np.zeros(0, np.int32)
    ids = np.array([1, 2, 3, 300][: 4 if dp > 1 else 3], np.int32)  # on dp=2, page 300 is the second replica's
    cache = tier.apply(cache, ((empty,) * 5,), scrubs=(ids,))  # zeroes only
    cache = tier.apply(cache, ((ids, np.array([1, 2, 3, 40][: ids.size], np.int32), empty, empty, empty),))
    tier.flush()
    shard = cache.key_pages[0].addressable_shards[0].data.nbytes * 2  # K and V of one device
    assert len(calls) == 2
    for args, kwargs in calls:
        temp = real.lower(*args, **kwargs).compile().memory_analysis().temp_size_in_bytes
        assert temp < shard / 10, f"{temp / shard:.2f}x the pool per device"
