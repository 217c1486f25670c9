"""A third tier plugs in without touching the core: a small in-memory tier (pages kept by digest in
a dict, a stand-in for the shared prefix store) implements `LowerTier` in this file alone, goes into a
manager through ``PageManager(meta, tiers=(factory,))``, and a prefix the device evicted is found
again through it, with exact page ids on a pool of four pages; beside the host tier, each keeps what
the device evicts and a lookup reads the host tier first. The manager holds no state of it (a state
is the same as without it), refuses to write a state while its transfers are pending, refuses a
commit into a page its transfer still fills, and refuses a tier it cannot use."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from easykv.manager.broken import Broken
from easykv.manager.lower_tier import LowerTier, TierTransfers, TierWork
from easykv.manager.manager import PageManager
from easykv.manager.prefix_hash import ROOT_DIGEST, iter_page_digests, salt_digest
from tests.support.managers import PS, make_meta

pytestmark = pytest.mark.numpy_only


@dataclasses.dataclass(frozen=True)
class StoreMetrics:
    kept: int
    dropped: int
    hits: int
    slots: int


class DictStore(LowerTier):
    """Prefix pages kept by digest (per group and replica) in slots numbered as they are taken, at
    most ``capacity`` (then dropped, counted); a slot is never freed. Offloads land in the index
    when handed over (`take_work`), as the host tier's do."""

    name = "store"

    def __init__(self, groups, capacity=8):
        self.devices = [table.pool for table in groups]  # read only
        self.capacity = capacity
        self.index = [{} for _ in groups]  # (replica, digest) -> slot
        self.entries = [{} for _ in groups]  # slot -> (digest, tag)
        self.offloads = [{} for _ in groups]  # slot -> (device page, digest, tag)
        self.onloads = [{} for _ in groups]  # device page -> slot
        self.taken = [0 for _ in groups]
        self.kept = self.dropped = self.hits = 0

    def lookup(self, group, replica, digest):
        return self.index[group].get((replica, digest), -1)

    def attach_hit(self, replica, hits, groups):
        out = []
        for g, (table, group_hits) in enumerate(zip(groups, hits)):
            pages = table.allocate(replica, len(group_hits), overwritten=True) if group_hits else []
            for (_, slot), page in zip(group_hits, pages):
                self.onloads[g][page] = slot
                table.pool.commit(page, *self.entries[g][slot])
            out.append(pages)
        self.hits += 1
        return tuple(out)

    def keep_evicted(self, group, evicted):
        pending = {d for _, d, _ in self.offloads[group].values()}
        for page, digest, tag in evicted:
            if (self.devices[group].replica_of(page), digest) in self.index[group] or digest in pending:
                continue
            if self.taken[group] == self.capacity:
                self.dropped += 1
                continue
            self.offloads[group][self.taken[group]] = (page, digest, tag)
            self.taken[group] += 1
            self.kept += 1

    def forget_prefixes(self):
        held = sum(len(i) for i in self.index)
        for g, device in enumerate(self.devices):
            self.drop_into(g, [p for p in self.onloads[g] if device.refcount[p] == 0 and device.digest_of(p) is None])
            self.index[g].clear()
            self.offloads[g] = {slot: (page, None, None) for slot, (page, _, _) in self.offloads[g].items()}
        return held

    def demote(self, version):
        pass  # a slot is never evicted

    def pending_into(self, group, page):
        return page in self.onloads[group]

    def refill(self, group, dst, page):
        self.onloads[group][dst] = self.onloads[group][page]

    def drop_into(self, group, pages):
        for page in pages:
            self.onloads[group].pop(page, None)

    def moving(self, group):
        return set(self.onloads[group]) | {src for src, _, _ in self.offloads[group].values()}

    def has_transfers(self):
        return any(self.offloads) or any(self.onloads)

    def has_work(self):
        return self.has_transfers()

    def take_work(self):
        work = TierWork(self.name, tuple(
            TierTransfers(offload_src=[src for src, _, _ in off.values()], offload_dst=list(off),
                          onload_src=list(on.values()), onload_dst=list(on))
            for off, on in zip(self.offloads, self.onloads)))
        for g, device in enumerate(self.devices):
            for slot, (page, digest, tag) in self.offloads[g].items():
                if digest is not None:
                    self.index[g][(device.replica_of(page), digest)] = slot
                    self.entries[g][slot] = (digest, tag)
            self.offloads[g], self.onloads[g] = {}, {}
        return work

    def check(self, group, table, seqs):
        for page in self.onloads[group]:
            if table.pool.refcount[page] == 0 and table.pool.digest_of(page) is None:
                raise Broken("store", f"an onload fills the free page {page}")

    def metrics(self):
        return StoreMetrics(kept=self.kept, dropped=self.dropped, hits=self.hits, slots=sum(self.taken))

    def lockstep_state(self):
        return {"slots": [sorted([r, d.hex(), s] for (r, d), s in index.items()) for index in self.index]}


class Simulated:
    """One group's device pages and each tier's pages, one token id per slot, a `DeviceWork` run in
    the runner's order: every tier's offloads read the device, copies, onloads, scrubs, then the
    offloads land."""

    def __init__(self, pages, tiers):
        self.device = np.full((pages, PS), -1, np.int64)
        self.tiers = {name: np.full((n, PS), -1, np.int64) for name, n in tiers.items()}

    def apply(self, work):
        [part] = work.groups
        out = {t.name: self.device[t.groups[0].offload_src].copy() for t in work.tiers}
        back = {t.name: self.tiers[t.name][t.groups[0].onload_src].copy() for t in work.tiers}
        self.device[part.copy_dst] = self.device[part.copy_src]
        for t in work.tiers:
            self.device[t.groups[0].onload_dst] = back[t.name]
        self.device[part.scrubs] = -1
        for t in work.tiers:
            moves, pages = t.groups[0], self.tiers[t.name]
            pages[moves.scrubs] = -1
            pages[moves.offload_dst] = out[t.name]
            pages[moves.scrubs_after] = -1

    def run(self, pm, seq, tokens):
        """One step of ``seq`` writing ``tokens``, as a runner runs it; returns the plan."""
        plan = pm.schedule([seq], [len(tokens)])
        self.apply(plan.work)
        self.device.reshape(-1)[np.asarray(plan.metadata[0].slot_mapping)[: len(tokens)]] = tokens
        pm.commit(plan, [list(tokens)])
        return plan

    def admit(self, pm, tokens):
        [s] = pm.claim(1)
        done = pm.match_prefix(s, tokens)
        self.run(pm, s, tokens[done:])
        return s

    def tokens(self, pm, seq):
        return self.device[pm.pages(seq)].reshape(-1)[: pm.length(seq)].tolist()


def with_store(pages=4, host=None, capacity=8, **kw):
    """A manager of ``pages`` device pages (``host`` host pages) with a `DictStore` below; the store."""
    made = []

    def factory(groups):
        made.append(DictStore(groups, capacity))
        return made[-1]

    meta = make_meta(batch=4, pages=pages, max_len=16)
    pm = PageManager(meta if host is None else meta.replace(host_pages_per_layer=host), tiers=(factory,), **kw)
    return pm, made[0]


A, B = list(range(9)), [7] * 13  # two full pages and one token; three full pages and one


def test_a_prefix_the_device_evicted_is_found_again_in_a_third_tier():
    pm, store = with_store()
    sim = Simulated(4, {"store": 8})
    s = sim.admit(pm, A)
    assert pm.pages(s) == [0, 1, 2]
    pm.release(s)  # pages 0, 1 cached (tail first: 1 then 0); 2 freed
    [t] = pm.claim(1)
    plan = pm.schedule([t], [len(B)])  # needs all four pages: evicts 1 then 0, which the store keeps
    [moves] = plan.work.tier("store").groups
    assert (moves.offload_src.tolist(), moves.offload_dst.tolist()) == ([1, 0], [0, 1])
    assert pm.pages(t) == [2, 3, 1, 0] and [w.name for w in plan.work.tiers] == ["store"]
    sim.apply(plan.work)  # the offloads read pages 1, 0 before the step overwrites them
    sim.device.reshape(-1)[np.asarray(plan.metadata[0].slot_mapping)[: len(B)]] = B
    pm.commit(plan, [B])
    assert sim.tiers["store"][:2].tolist() == [A[4:8], A[:4]]
    pm.release(t)  # B's page 0 freed; 1, 3, 2 cached
    [u] = pm.claim(1)
    assert pm.cached_prefix_length(A) == 8
    assert pm.match_prefix(u, A) == 8  # from the store: fresh pages 0 (free) and 1 (B's, evicted to the store)
    assert pm.pages(u) == [0, 1]
    work = pm.take_work()
    [moves] = work.tier("store").groups
    assert (moves.onload_src.tolist(), moves.onload_dst.tolist()) == ([1, 0], [0, 1])
    assert (moves.offload_src.tolist(), moves.offload_dst.tolist()) == ([1], [2])  # B's page, read first
    sim.apply(work)
    assert sim.tokens(pm, u) == A[:8] and sim.tiers["store"][2].tolist() == B[4:8]
    m = pm.metrics
    assert m.tiers == (StoreMetrics(kept=3, dropped=0, hits=1, slots=3),) and m.host is None
    assert (m.prefix_hits, m.prefix_hit_tokens) == (1, 8)
    pm.check_invariants()


def test_beside_the_host_tier_each_keeps_what_the_device_evicts_and_the_host_is_asked_first():
    pm, store = with_store(host=2)
    sim = Simulated(4, {"host": 2, "store": 8})
    pm.release(sim.admit(pm, A))
    [t] = pm.claim(1)
    plan = sim.run(pm, t, B)  # evicts A's pages 1, 0: the host (2 pages) and the store each keep both
    assert [w.name for w in plan.work.tiers] == ["host", "store"]
    assert [w.groups[0].offload_src.tolist() for w in plan.work.tiers] == [[1, 0], [1, 0]]
    pm.release(t)
    [u] = pm.claim(1)
    assert pm.match_prefix(u, A) == 8  # the host tier is asked first
    work = pm.take_work()
    assert work.tier("host").groups[0].onload_src.tolist() == [1, 0]
    assert work.tier("store").groups[0].onload_src.size == 0  # the store only keeps what u's pages evicted
    sim.apply(work)
    assert sim.tokens(pm, u) == A[:8]
    pm.release(u)
    pm.release(sim.admit(pm, [5] * 13))  # the whole pool: B's pages push A's out of the host (2 pages), not the store
    m = pm.metrics  # the host evicted A's two pages for two of C's evictions, and dropped the other three
    assert pm.cached_prefix_length(A) == 8 and (m.host.evictions, m.host.dropped_pages) == (2, 3)
    [v] = pm.claim(1)
    assert pm.match_prefix(v, A) == 8
    work = pm.take_work()
    assert work.tier("store").groups[0].onload_src.tolist() == [1, 0]
    assert work.tier("host") is None or work.tier("host").groups[0].onload_src.size == 0
    sim.apply(work)
    assert sim.tokens(pm, v) == A[:8]
    assert pm.metrics.host.host_hits == 1 and pm.metrics.tiers[1].hits == 1
    pm.check_invariants()


def test_a_page_whose_data_a_tier_still_owes_is_offered_to_no_tier_when_evicted():
    pm, store = with_store(host=4, capacity=0)  # the store keeps nothing: it counts every page offered to it
    sim = Simulated(4, {"host": 4, "store": 0})
    pm.release(sim.admit(pm, A))
    pm.release(sim.admit(pm, B))  # evicts A's pages to the host
    [u] = pm.claim(1)
    assert pm.match_prefix(u, A) == 8  # two onloads from the host pending into fresh device pages
    pm.release(u)  # cached, still waiting for their data
    offered, evicted = store.dropped, pm.metrics.evictions
    [v] = pm.claim(1)
    plan = pm.schedule([v], [16])  # the whole pool: evicts them before the onloads ran
    assert plan.work.tier("host").groups[0].onload_src.size == 0  # the host dropped its onloads
    # four pages evicted: u's two, which no tier is offered, and two of B's, which the store is
    assert pm.metrics.evictions - evicted == 4 and store.dropped - offered == 2
    pm.abort(plan)
    pm.check_invariants()


def test_the_tier_is_no_part_of_a_state_and_is_refused_while_its_transfers_are_pending():
    pm, store = with_store()
    plain = PageManager(make_meta(batch=4, pages=4, max_len=16))
    sims = Simulated(4, {"store": 8}), Simulated(4, {})
    for m, sim in zip((pm, plain), sims):
        m.release(sim.admit(m, A))
        [t] = m.claim(1)
        plan = m.schedule([t], [len(B)])  # evicts A's pages: the store's offloads go with the plan
        m.commit(plan, [B])
    assert pm.state_dict() == plain.state_dict()
    first, second = iter_page_digests(np.array(A, np.int32), PS, 2, salt_digest(None), ROOT_DIGEST)
    assert pm.state_dict(host_tier=True)["store"] == {"slots": [sorted([[0, second.hex(), 0], [0, first.hex(), 1]])]}
    pm.release(t)
    [u] = pm.claim(1)
    assert pm.match_prefix(u, A) == 8  # onloads pending now
    before = pm.state_dict(host_tier=True)  # the lock-step fingerprint is readable while transfers wait
    with pytest.raises(ValueError, match="does not hold the store tier, and its transfers are pending; apply"):
        pm.state_dict()
    assert pm.state_dict(host_tier=True) == before
    work = pm.take_work()  # handed over (a runner applies it): nothing of the tier is pending
    assert work.tier("store").groups[0].onload_dst.tolist() == pm.pages(u) == [0, 1]
    assert [s["length"] for s in pm.state_dict()["sequences"]] == [8]


def test_a_commit_into_a_page_the_tier_still_fills_is_refused_and_nothing_changes():
    pm, store = with_store()
    sim = Simulated(4, {"store": 8})
    pm.release(sim.admit(pm, A))
    [t] = pm.claim(1)
    pm.commit(pm.schedule([t], [len(B)]), [B])
    pm.release(t)
    [u] = pm.claim(1)
    assert pm.match_prefix(u, A) == 8 and pm.pages(u) == [0, 1]  # both waiting for the store's onloads
    pm.truncate(u, 6)  # page 1 is its unfinished page again, its data still to come
    before = pm.state_dict(host_tier=True)
    with pytest.raises(ValueError, match=rf"sequence {u} commits tokens in page 1, whose store-tier transfer is "
                                         "still pending"):
        pm.step([u], [[5]])
    assert pm.state_dict(host_tier=True) == before


def test_clones_copy_the_tier_and_a_relaid_clone_makes_an_empty_one():
    pm, store = with_store()
    sim = Simulated(4, {"store": 8})
    pm.release(sim.admit(pm, A))
    [t] = pm.claim(1)
    pm.commit(pm.schedule([t], [len(B)]), [B])
    pm.take_work()
    twin = pm.clone()
    assert twin.metrics.tiers == pm.metrics.tiers and twin.cached_prefix_length(A) == 8
    relaid = pm.clone(pm.metadata)
    assert relaid.metrics.tiers == (StoreMetrics(kept=0, dropped=0, hits=0, slots=0),)
    assert relaid.cached_prefix_length(A) == 0


class Incomplete(LowerTier):
    name = "incomplete"


class Named(DictStore):
    def __init__(self, groups, name):
        super().__init__(groups)
        self.name = name


@pytest.mark.parametrize(("tiers", "message"), [
    (DictStore, r"tiers=<class .*DictStore'> must be a tuple of tier factories"),
    ((42,), r"tiers\[0\]=42 is not callable; pass a factory"),
    ((lambda groups: object(),), r"tiers\[0\] made a object, not a LowerTier"),
    ((DictStore, DictStore), r"tiers\[1\] \(DictStore\) is named 'store', which another tier has"),
    ((lambda groups: Named(groups, "host"),), r"tiers\[0\] \(Named\) is named 'host', which is reserved"),
    ((lambda groups: Named(groups, "pool"),), r"tiers\[0\] \(Named\) is named 'pool', which is reserved"),
    ((lambda groups: Named(groups, "a b"),), r"tiers\[0\] \(Named\) has name='a b'; give the class a name"),
])
def test_a_tier_the_manager_cannot_use_is_refused_by_name(tiers, message):
    with pytest.raises(ValueError, match=message):
        PageManager(make_meta(batch=4, pages=4, max_len=16), tiers=tiers)


def test_a_tier_serves_one_manager():
    shared = []

    def factory(groups):  # wrong: hands the same tier to every manager
        shared.append(shared[0] if shared else DictStore(groups))
        return shared[-1]

    PageManager(make_meta(batch=4, pages=4, max_len=16), tiers=(factory,))
    with pytest.raises(ValueError, match=r"tiers\[0\] \(DictStore\) serves another PageManager already; make a new "
                                         "tier in the factory"):
        PageManager(make_meta(batch=4, pages=4, max_len=16), tiers=(factory,))


def test_a_tier_missing_a_method_of_the_interface_cannot_be_made():
    with pytest.raises(TypeError, match="Can't instantiate abstract class Incomplete"):
        PageManager(make_meta(batch=4, pages=4, max_len=16), tiers=(lambda groups: Incomplete(),))


@pytest.mark.parametrize("bad", [-1, 2**31, 2**40])
def test_a_page_id_outside_int32_is_refused_not_wrapped(bad):
    from easykv.manager.lower_tier import page_ids

    assert page_ids([0, 5, 2**31 - 1]).tolist() == [0, 5, 2**31 - 1]
    with pytest.raises(ValueError, match=rf"page id {bad} is outside 0 .. 2\*\*31 - 1"):
        page_ids([3, bad])
