"""The host-memory tier in the page manager: evicted prefix pages offloaded to host pages (exact
ids on tiny pools), prefix hits continuing into the host tier, swap-out / swap-in, bad input
refused with nothing changed, and hypothesis machines that run the manager against a simulated
device and host (every page holds the token ids written into it; transfers, copies and scrubs
applied as the runner orders them) checking after every rule that each live sequence reads
exactly its own tokens and that no hit crosses weight versions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from easykv.errors import CacheFullError
from easykv.manager.manager import PageManager
from easykv.spec.metadata import PagedAttentionCacheMetaData
from tests.manager.test_manager_stateful import run_work
from tests.support.machines import Device, TruncateMachine, VersionMachine
from tests.support.managers import PS, make_meta


def tiered(batch=4, pages=8, host=8, max_len=16, **kw):
    return PageManager(make_meta(batch=batch, pages=pages, max_len=max_len).replace(host_pages_per_layer=host), **kw)


class TierDevice(Device):
    """`Device` with a host store per group, running a `DeviceWork` in the runner's order (`run_work`):
    offloads read the device pages, then copy-on-write copies, then onloads, then scrubs (the
    host's released pages zeroed before the work's offloads land, those it leaves unreferenced
    after)."""

    def __init__(self, pages, host_pages):
        super().__init__(pages)
        hosts = host_pages if self.grouped else [host_pages]
        self.hosts = [np.full((n, PS), -1, np.int64) for n in hosts]

    def apply(self, work):
        run_work(self.stores, self.hosts, work)

    def views(self, pm):
        stores = [s.copy() for s in self.stores]
        run_work(stores, [h.copy() for h in self.hosts], pm.clone().take_work())  # the manager's own stays pending
        return stores


def run(pm, dev, seq, tokens):
    plan = pm.schedule([seq], [len(tokens)])
    dev.apply(plan.work)
    dev.write(plan.metadata, tokens)
    pm.commit(plan, [list(tokens)])


def admit(pm, dev, tokens):
    [s] = pm.claim(1)
    done = pm.match_prefix(s, tokens)
    run(pm, dev, s, tokens[done:])
    return s, done


# ---- exact ids on tiny pools ---------------------------------------------------------------------------
def test_evicted_prefix_pages_go_to_the_host_and_come_back_on_a_hit():
    pm, dev = tiered(pages=4, host=4), TierDevice(4, 4)
    a = list(range(9))  # two full pages and one token
    s, _ = admit(pm, dev, a)
    assert pm.pages(s) == [0, 1, 2]
    pm.release(s)  # pages 0, 1 cached (tail first in LRU order: 1 then 0); 2 freed
    b = [7] * 13  # three full pages and one: needs all four device pages, evicting 1 then 0
    t, _ = admit(pm, dev, b)
    assert pm.pages(t) == [2, 3, 1, 0]
    assert pm.metrics.host.offloaded_pages == 2 and pm.metrics.host.cached_pages == 2
    pm.release(t)
    # a's pages are on the host now: a hit brings them back into fresh device pages.
    [u] = pm.claim(1)
    assert pm.cached_prefix_length(a) == 8
    assert pm.match_prefix(u, a) == 8
    work = pm.take_work()
    assert work.transfers()[0][2].tolist() == [1, 0] and len(pm.pages(u)) == 2  # host pages 1, 0 (b's evictions)
    dev.apply(work)
    assert dev.tokens(pm, u) == a[:8]
    m = pm.metrics
    assert (m.host.host_hits, m.host.host_hit_tokens, m.host.onloaded_pages, m.prefix_hit_tokens) == (1, 8, 2, 8)
    pm.check_invariants()


def test_the_host_tier_evicts_its_least_recently_used_pages_and_counts_what_it_drops():
    pm, dev = tiered(pages=4, host=2), TierDevice(4, 2)
    for base in (0, 100, 200):
        s, _ = admit(pm, dev, [base + i for i in range(9)])
        pm.release(s)
    # A = 0.., B = 100.., C = 200..; each leaves its two full pages cached, tail first in the LRU.
    # B evicted A's second page (device page 1) to the host; C evicted A's first and B's second, and
    # the host (2 pages) evicted its least recently used one for them: A's second.
    assert pm.cached_prefix_length(list(range(9))) == 4  # A's first page, on the host
    assert pm.cached_prefix_length([100 + i for i in range(9)]) == 8  # device, then host
    assert pm.cached_prefix_length([200 + i for i in range(9)]) == 8  # device
    assert pm.metrics.host.evictions == 1 and pm.metrics.host.offloaded_pages == 3
    assert pm.metrics.host.dropped_pages == 0


def test_swap_out_and_in_keeps_the_sequence_bit_for_bit():
    pm, dev = tiered(pages=6, host=6, max_len=24), TierDevice(6, 6)
    tokens = list(range(10))
    s, _ = admit(pm, dev, tokens)
    held = pm.pages(s)
    pm.swap_out(s)
    assert pm.sequence(s).swapped and pm.swapped_ids == [s] and pm.length(s) == 10 and pm.pages(s) == []
    assert pm.metrics.used_pages == 0 and pm.metrics.host.used_pages == 3
    dev.apply(pm.take_work())
    # Its device pages are someone else's now: overwrite them.
    t, _ = admit(pm, dev, [50 + i for i in range(24)])  # the whole pool
    assert set(held) <= set(pm.pages(t))
    pm.release(t)
    pm.swap_in(s)
    dev.apply(pm.take_work())
    assert dev.tokens(pm, s) == tokens
    run(pm, dev, s, [77, 78])  # and it continues
    assert dev.tokens(pm, s) == tokens + [77, 78]
    assert (pm.metrics.host.swap_outs, pm.metrics.host.swap_ins) == (1, 1)
    pm.check_invariants()


def test_swap_shares_what_a_tier_already_holds():
    pm, dev = tiered(pages=8, host=8, max_len=24), TierDevice(8, 8)
    tokens = list(range(10))
    s, _ = admit(pm, dev, tokens)
    pm.swap_out(s)  # 3 pages copied (2 full ones enter the host prefix cache once applied)
    dev.apply(pm.take_work())
    assert pm.metrics.host.offloaded_pages == 3
    t, done = admit(pm, dev, tokens[:9])  # the device still caches the full pages: shared
    assert done == 8
    pm.swap_in(s)  # its two full pages are on the device (t holds them): shared, only the last onloaded
    work = pm.take_work()
    assert pm.pages(s)[:2] == pm.pages(t)[:2] and len(work.transfers()[0][2]) == 1
    dev.apply(work)
    assert dev.tokens(pm, s) == tokens
    pm.check_invariants()


def test_bad_input_is_refused_and_nothing_changes():
    pm, dev = tiered(pages=4, host=2), TierDevice(4, 2)
    s, _ = admit(pm, dev, list(range(9)))
    before = pm.state_dict()
    with pytest.raises(CacheFullError, match="host pages") as err:
        pm.swap_out(s)  # three pages, two host pages
    assert err.value.resource == "host pages" and pm.state_dict() == before
    with pytest.raises(ValueError, match="not swapped out"):
        pm.swap_in(s)
    assert pm.state_dict() == before
    plain = PageManager(make_meta())
    [q] = plain.claim(1)
    with pytest.raises(ValueError, match="host-memory tier"):
        plain.swap_out(q)
    with pytest.raises(ValueError, match="host_tier=True but the metadata has no host-memory tier"):
        PageManager(make_meta(), host_tier=True)
    with pytest.raises(ValueError, match="host_pages_per_layer"):
        make_meta().replace(host_pages_per_layer=0)
    with pytest.raises(ValueError, match="not divisible by page_shards"):
        make_meta(pages=8, shards=2).replace(host_pages_per_layer=3)
    with pytest.raises(ValueError, match="host_memory_bytes"):
        make_meta().with_host_memory(0, 1)
    with pytest.raises(ValueError, match="holds 0 host page"):
        make_meta().with_host_memory(1, 1)


def test_a_swapped_sequence_refuses_work_until_swapped_in():
    pm, dev = tiered(pages=6, host=6, max_len=24), TierDevice(6, 6)
    s, _ = admit(pm, dev, list(range(6)))
    pm.swap_out(s)
    for call in (lambda: pm.schedule([s], [1]), lambda: pm.step([s], [[1]]), lambda: pm.fork(s),
                 lambda: pm.truncate(s, 2), lambda: pm.swap_out(s), lambda: pm.schedule_decode([s], 2),
                 lambda: pm.match_prefix(s, [1, 2])):
        with pytest.raises(ValueError, match=f"sequence {s} is swapped out; swap_in"):
            call()
    with pytest.raises(ValueError, match="swap-out is still pending"):
        pm.swap_in(s)  # its pages are not on the host yet
    with pytest.raises(ValueError, match="does not hold the host-memory tier"):
        pm.state_dict()
    dev.apply(pm.take_work())
    pm.release(s)  # a swapped sequence can be released: its host pages go back
    assert pm.metrics.host.used_pages == 0 and pm.metrics.active_sequences == 0
    pm.check_invariants()


def test_a_swap_outs_transfers_are_the_host_tiers_work_handed_over_once():
    pm, dev = tiered(pages=6, host=6, max_len=24), TierDevice(6, 6)
    s, _ = admit(pm, dev, list(range(6)))
    held = pm.pages(s)
    pm.swap_out(s)
    assert pm.has_pending_work
    work = pm.take_work()
    assert work.has_transfers and work.has_host_work and [t.name for t in work.tiers] == ["host"]
    assert work.transfers()[0][0].tolist() == held and work.copies()[0][0].size == 0  # its pages, read first
    assert not pm.has_pending_work and pm.take_work().empty  # handed over once


def test_create_sizes_the_host_tier_from_host_memory():
    from easykv.sharding import create_mesh

    mesh = create_mesh({"dp": 1, "tp": 8})
    base = dict(mesh=mesh, batch_size=4, num_hidden_layers=2, max_sequences=64, page_size=16, num_kv_heads=8,
                kv_head_dim_size=64, hbm_utilization=0.5, dtype=np.dtype("bfloat16"), num_pages_per_layer=64)
    meta = PagedAttentionCacheMetaData.create(**base, host_memory_bytes=8 << 20)
    # one page of one layer on one device: 1 head x 16 tokens x 64 dims x 2 bytes x (K, V) = 4096 bytes;
    # 8 MiB over 8 devices is 1 MiB each: 1 MiB / (4096 x 2 layers) = 128 pages.
    assert meta.host_pages_per_layer == 128 and meta.host_bytes_per_device == 1 << 20
    assert PagedAttentionCacheMetaData.from_json(meta.to_json()) == meta
    assert '"host_pages_per_layer"' not in PagedAttentionCacheMetaData.create(**base).to_json()
    with pytest.raises(ValueError, match="host_memory_bytes"):
        PagedAttentionCacheMetaData.create(**base, host_memory_bytes=0)


# ---- machines ----------------------------------------------------------------------------------------------
class TieredTruncateMachine(TruncateMachine):
    """The truncation machine on a manager with a small host tier, swapping sequences out and in
    (slots for 6 live and 6 swapped sequences)."""

    def __init__(self):
        super().__init__()
        meta = self.pm.metadata.replace(batch_size=12, host_pages_per_layer=8)
        self.pm = PageManager(meta, scrub_released=True)
        pages = [g.num_pages for g in meta.groups]
        hosts = [meta.group_host_pages(g) for g in meta.groups]
        self.dev = TierDevice(pages, hosts) if self.grouped else TierDevice(pages[0], hosts[0])
        self.swapped: dict[int, list[int]] = {}

    @precondition(lambda self: self.model and len(self.swapped) < 6)
    @rule(data=st.data())
    def swap_out(self, data):
        s = data.draw(st.sampled_from(sorted(self.model)))
        self.dev.apply(self.pm.take_work())  # an engine preempts between steps: earlier copies are applied
        try:
            self.pm.swap_out(s)
        except CacheFullError:
            return
        self.swapped[s] = self.model.pop(s)
        self.dev.apply(self.pm.take_work())

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        s = data.draw(st.sampled_from(sorted(self.swapped)))
        try:
            self.pm.swap_in(s)
        except CacheFullError:
            return
        self.model[s] = self.swapped.pop(s)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def release_swapped(self, data):
        s = data.draw(st.sampled_from(sorted(self.swapped)))
        self.pm.release(s)
        del self.swapped[s]

    @rule()
    def reset(self):
        self.pm.reset_prefix_cache()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def truncate(self, data):  # the base rule compares state_dicts, which swapped sequences refuse
        s = data.draw(st.sampled_from(sorted(self.model)))
        length = data.draw(st.integers(0, len(self.model[s])))
        def snapshot():
            groups = range(self.pm.num_groups) if self.grouped else [None]
            return [self.pm.pages(s, group=g) for g in groups], self.pm.length(s), self.pm.metrics

        before = snapshot()
        try:
            self.pm.truncate(s, length)
        except CacheFullError:
            assert snapshot() == before
            return
        except ValueError as err:  # only a window that released what the length needs refuses
            assert self.grouped and "window released" in str(err), err
            assert snapshot() == before
            return
        del self.model[s][length:]


class GroupedTieredTruncateMachine(TieredTruncateMachine):
    """The same on a sliding (window 6) + full manager: each group's host pool, lookups that
    need only a window's pages from either tier."""

    grouped = True


class TieredVersionMachine(VersionMachine):
    """The weight-version machine with a host tier: hits from the host tier are of the lookup's
    version too. No device here: a plan takes the pending transfers, which count as applied."""

    def __init__(self):
        super().__init__()
        self.pm = PageManager(make_meta(batch=4, pages=12, max_len=16).replace(host_pages_per_layer=6))

    @precondition(lambda self: len(self.live) < 4)
    @rule(prompt=st.sampled_from([(1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 3, 4, 9, 9, 9, 9, 9), (5,) * 6, (1, 2, 3, 4, 5),
                                  (8,) * 13, (6,) * 13]))
    def admit(self, prompt):
        [s] = self.pm.claim(1)
        hit = self.pm.cached_prefix_length(list(prompt))
        done = self.pm.match_prefix(s, list(prompt))
        assert done <= hit  # less only when the device has no room to bring host pages back
        for k in range(1, done // PS + 1):
            assert (self.version, prompt[: k * PS]) in self.written, (self.version, prompt[: k * PS])
        try:
            plan = self.pm.schedule([s], [len(prompt) - done])
        except CacheFullError:
            self.pm.release(s)
            return
        self.pm.commit(plan, [list(prompt[done:])])
        self.live[s] = (self.version, tuple(prompt))
        self._record(s)

    @invariant()
    def host_pages_of_every_version_are_counted(self):
        m = self.pm.metrics
        assert m.host.free_pages + m.host.cached_pages + m.host.used_pages == m.host.total_pages
        if m.versions:
            assert sum(v.host_cached_pages for v in m.versions) == m.host.cached_pages


# Host logic only: the result does not depend on the jax version, so CI runs it in one environment.
NUMPY_ONLY = pytest.mark.numpy_only
TestTieredTruncateMachine = NUMPY_ONLY(TieredTruncateMachine.TestCase)
TestTieredVersionMachine = NUMPY_ONLY(TieredVersionMachine.TestCase)
TestGroupedTieredTruncateMachine = NUMPY_ONLY(GroupedTieredTruncateMachine.TestCase)


def onloads_pending_into_cached_pages(a):
    """A 4-page pool whose prompt ``a``'s two full pages were brought back from the host by a
    sequence released since: cached device pages still waiting for their onloads."""
    pm, dev = tiered(pages=4, host=4), TierDevice(4, 4)
    s, _ = admit(pm, dev, a)
    pm.release(s)
    t, _ = admit(pm, dev, [7] * 13)  # evicts a's pages to the host
    pm.release(t)
    [u] = pm.claim(1)
    assert pm.match_prefix(u, a) == 8  # two onloads pending into fresh device pages
    pm.release(u)
    return pm, dev


def test_an_onload_into_a_page_that_leaves_the_cache_before_it_ran_is_dropped():
    a = list(range(9))
    pm, dev = onloads_pending_into_cached_pages(a)
    [v] = pm.claim(1)
    plan = pm.schedule([v], [16])  # the whole pool: evicts them before the onloads ran
    pm.check_invariants()
    assert plan.work.transfers()[0][2].size == 0  # nothing will overwrite v's pages
    dev.apply(plan.work)
    pm.abort(plan)  # nothing written: its pages go back
    assert pm.cached_prefix_length(a) == 8  # the host pages still hold a's prefix
    pm.release(v)
    [w] = pm.claim(1)
    assert pm.match_prefix(w, a) == 8
    dev.apply(pm.take_work())
    assert dev.tokens(pm, w) == a[:8]


def test_a_reset_drops_the_onloads_into_the_pages_it_frees():
    pm, dev = onloads_pending_into_cached_pages(list(range(9)))
    # two onloads pin their host pages; the hit's allocation evicted one of t's pages: an offload
    assert len(pm.clone().take_work().transfers()[0][2]) == 2 and pm.metrics.host.used_pages == 3
    pm.reset_prefix_cache()  # frees those pages: nothing will fill them
    assert len(pm.clone().take_work().transfers()[0][2]) == 0 and pm.metrics.host.used_pages == 1
    work = pm.take_work()
    assert len(work.transfers()[0][2]) == 0 and len(work.transfers()[0][0]) == 1  # the offload stays
    pm.check_invariants()
    dev.apply(work)
    assert pm.metrics.host.used_pages == 0 and pm.metrics.host.cached_pages == 0  # landed as a plain page


def test_a_manager_rebuilt_from_its_state_scrubs_its_host_pages_too():
    """The state's scrub flag reaches every pool: a restored manager's released host pages are
    reported for zeroing like its device pages (its host pools never scrubbed)."""
    import json

    live = tiered(scrub_released=True)
    restored = PageManager.from_state_dict(live.metadata, json.loads(json.dumps(live.state_dict())))
    for pm in (live, restored):
        [s] = pm.claim(1)
        pm.commit(pm.schedule([s], [6]), [list(range(6))])
        pm.swap_out(s)
        pm.take_work()
        pm.release(s)
        assert pm.take_work().transfers()[0][4].tolist() == [1]  # its unfinished page (the full one stays cached)
