"""Random claim / prefix reuse / write / decode / fork / release / restore sequences.

A plain model keeps each sequence's token ids; a simulated device (one token id per slot)
applies the manager's page copies and scrubs, then each step's writes through its slot
mapping. After every step the device, read through each sequence's page table, must give back
exactly the model's tokens (prefix hits included), and check_invariants() must pass.

Every call goes to two managers: one never restored, one restored from its JSON state at random
points. Both must answer every call identically and hold the same state byte for byte: the
state is canonical, so hosts in lock-step agree whether or not one of them restored. Every state
the machine reaches must also restore on its own (what a checkpoint saved mid-way needs), and
truncation, prefix-cache resets and weight-version changes run between restores. The tiered
machines add a host tier: swapped sequences, offloads and onloads applied on a simulated host,
and after every apply a released host page holds nothing.

Every write is a step plan (`PageManager.schedule` / `schedule_decode`): its work (`DeviceWork`, all
the work pending when it was made) runs on the simulated pages before its writes, as the runner
runs it, and `commit` (or `abort`) ends it. What the next step will see is read on clones
(``clone().take_work()``): taking work there changes nothing real.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from easykv.errors import CacheFullError, UnknownSequenceError
from easykv.manager.lower_tier import TierTransfers
from easykv.manager.manager import PageManager
from easykv.manager.prefix_hash import iter_page_digests, salt_digest, version_digest, version_root
from easykv.manager.step_plan import StepPlan
from easykv.spec.groups import LayerGroup
from easykv.spec.metadata import PagedAttentionCacheMetaData

PS, PAGES, BATCH, MAX_LEN = 4, 12, 5, 16
BASES = [list(range(100, 116)), [7] * 16]  # prompts share these prefixes (or earlier sequences')
TOKENS = st.integers(0, 2)  # a small vocabulary: decoded pages get matched by later prompts
GARBAGE = 77  # what a step writes past the tokens it keeps: never a committed token's place
# What a plan shows its engine (its owner, the sequence table, is each twin's own).
PLAN_FIELDS = ("form", "num_steps", "seq_ids", "lengths", "limits", "metadata", "work", "page_size", "num_pages",
               "ended")


def _same(a, b) -> bool:
    if isinstance(a, StepPlan):
        return type(b) is StepPlan and all(_same(getattr(a, f), getattr(b, f)) for f in PLAN_FIELDS)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b)) and np.asarray(a).dtype == np.asarray(b).dtype
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class Plans:
    """The plans the twins made in one call (`Twins`): the same plan, each its manager's. Given to a
    `Twins` call (``commit``, ``abort``), each twin gets its own; read, it is the live twin's."""

    def __init__(self, live: StepPlan, restored: StepPlan):
        self.live, self.restored = live, restored

    def __getattr__(self, name):
        return getattr(self.live, name)


class Twins:
    """Two managers driven by the same calls: ``live`` is never restored, ``restored`` is
    rebuilt from its JSON state at random points. Each call must give both the same result,
    or the same exception; a plan comes back as its `Plans`."""

    def __init__(self, live: PageManager, restored: PageManager):
        self.live, self.restored = live, restored

    def __getattr__(self, name):
        a, b = getattr(self.live, name), getattr(self.restored, name)
        if not callable(a):
            return a

        def call(*args, **kwargs):
            mine, theirs = _twin_args(args, "live"), _twin_args(args, "restored")
            try:
                got = a(*mine, **kwargs)
            except Exception as err:
                with pytest.raises(type(err)):
                    b(*theirs, **kwargs)
                raise
            other = b(*theirs, **kwargs)
            assert _same(got, other), name
            return Plans(got, other) if isinstance(got, StepPlan) else got

        return call


def _twin_args(args, twin):
    """``args`` with each `Plans` replaced by ``twin``'s plan."""
    return [getattr(x, twin) if isinstance(x, Plans) else x for x in args]


class ManagerMachine(RuleBasedStateMachine):
    shards = 1
    caching = True
    scrub = True
    # Layer groups, one layer each (None: one full-attention group of PAGES pages). A sliding or
    # chunked group releases the pages that left its window; groups have their own pools.
    layer_groups = None
    host_pages = None  # pages of the host tier per group (None: no host tier)

    @property
    def groups(self):
        return self.meta.groups

    @initialize()
    def setup(self):
        groups = self.layer_groups
        self.meta = PagedAttentionCacheMetaData(
            batch_size=BATCH, num_hidden_layers=1 if groups is None else len(groups),
            num_pages_per_layer=PAGES if groups is None else max(g.num_pages for g in groups),
            num_pages_per_sequence=MAX_LEN // PS, max_sequences=MAX_LEN, page_size=PS, num_kv_heads=1,
            kv_head_dim_size=8, hbm_utilization=0.9, page_shards=self.shards, layer_groups=groups,
            host_pages_per_layer=self.host_pages)
        self.pm = Twins(*(PageManager(self.meta, enable_prefix_caching=self.caching, scrub_released=self.scrub)
                          for _ in range(2)))
        self.device = [np.full((g.num_pages, PS), -1, np.int64) for g in self.groups]  # one token id per slot
        self.host = [np.full((self.meta.group_host_pages(g), PS), -1, np.int64) for g in self.groups] \
            if self.host_pages else []
        self.model: dict[int, dict] = {}
        self.swapped: dict[int, dict] = {}
        self.history: list[list[int]] = []  # token ids of released sequences
        self.version = None
        self.frozen: set[int] = set()  # sequences of open decode plans (test_decode_plan_stateful.py opens them)

    # ---- device simulation ---------------------------------------------------------------------
    def _apply_page_ops(self):
        """The work no plan took (both twins hand over the same), applied as `Runner.apply_pending` does."""
        run_work(self.device, self.host, self.pm.take_work())

    def _next_work(self):
        """The work the next plan will take, as both twins hold it: read on clones, so the managers' own
        stays pending."""
        live, restored = (m.clone().take_work() for m in (self.pm.live, self.pm.restored))
        assert _same(live, restored)
        return live

    def _transfers_pending(self):
        """Whether host-tier transfers are pending (what a state cannot hold)."""
        return bool(self.host_pages) and self.pm.live.clone().take_work().has_transfers

    def _write(self, meta, tokens):
        for device, step_meta in zip(self.device, meta, strict=True):
            slots = np.asarray(step_meta.slot_mapping)
            real = slots >= 0
            assert real.sum() == len(tokens)
            device.reshape(-1)[slots[real]] = tokens

    def _grow(self, seqs, tokens, ids=True):
        """One mixed step: append ``tokens[i]`` to ``seqs[i]`` (committed with their ids, or
        without: ``commit(plan)``). False when the pool is full."""
        before = self._state()
        try:
            plan = self.pm.schedule(seqs, [len(t) for t in tokens], pad_tokens_to=sum(map(len, tokens)) + 2)
        except CacheFullError:
            assert self._state() == before
            return False
        run_work(self.device, self.host, plan.work)
        self._write(plan.metadata, [x for t in tokens for x in t])
        self.pm.commit(plan, tokens if ids else None)
        for s, t in zip(seqs, tokens):
            self.model[s]["tokens"] += list(t)
        return True

    def _room(self, seq):
        return MAX_LEN - len(self.model[seq]["tokens"])

    def _movable(self):
        """The running sequences no open decode plan holds, ascending: what the rules change."""
        return [s for s in sorted(self.model) if s not in self.frozen]

    # ---- rules ---------------------------------------------------------------------------------
    @rule(data=st.data(), keep=st.integers(1, MAX_LEN), tail=st.lists(TOKENS, max_size=4),
          salt=st.sampled_from([None, None, "tenant"]))
    def admit(self, data, keep, tail, salt):
        base = data.draw(st.sampled_from(BASES + self.history))
        prompt = (base[:keep] + tail)[:MAX_LEN] or [0]
        if len(self.model) + len(self.swapped) == BATCH:
            try:
                self.pm.claim(1)
            except CacheFullError as err:
                assert err.resource == "sequence slots"
                return
            raise AssertionError("claim beyond batch_size succeeded")
        [seq] = self.pm.claim(1)
        done = self.pm.match_prefix(seq, prompt, salt=salt)
        assert done % PS == 0 and (done <= len(prompt) - 1 or done == 0)
        if not self.caching:
            assert done == 0
        self.model[seq] = {"tokens": prompt[:done], "salt": salt, "version": self.version}
        self._check_contents()  # the reused pages really hold the prompt's tokens
        if not self._grow([seq], [prompt[done:]]):
            self.pm.release(seq)
            del self.model[seq]

    @precondition(lambda self: all(g.attention != "full" for g in self.groups))
    @rule(data=st.data(), first=st.integers(0, MAX_LEN - 1))
    def resume(self, data, first):
        """A sequence that starts mid-way (moved in with its window's tokens only): positions
        before its first page hold nothing (-1 in the model)."""
        if len(self.model) + len(self.swapped) == BATCH:
            return
        [seq] = self.pm.claim(1)
        self.pm.resume(seq, first)
        start = first // PS * PS
        self.model[seq] = {"tokens": [-1] * start, "salt": None, "floor": start, "version": self.version}
        n = data.draw(st.integers(0, MAX_LEN - start))
        if not self._grow([seq], [data.draw(st.lists(TOKENS, min_size=n, max_size=n))]):
            self.pm.release(seq)
            del self.model[seq]

    @precondition(lambda self: self._movable())
    @rule(data=st.data())
    def write(self, data):
        seq = data.draw(st.sampled_from(self._movable()))
        n = data.draw(st.integers(0, self._room(seq)))
        self._grow([seq], [data.draw(st.lists(TOKENS, min_size=n, max_size=n))], ids=data.draw(st.booleans()) or n == 0)

    @precondition(lambda self: self._movable())
    @rule(data=st.data(), k=st.integers(1, 3))
    def decode(self, data, k):
        ready = [s for s in self._movable() if self._room(s) >= k]
        if not ready:
            return
        seqs = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True))
        tokens = np.array(data.draw(st.lists(TOKENS, min_size=k * len(seqs),
                                             max_size=k * len(seqs)))).reshape(len(seqs), k)
        mixed = k == 1 and data.draw(st.booleans())  # one mixed step, committed as (n,) ids: the one-token fast path
        before = self._state()
        try:
            plan = self.pm.schedule(seqs, 1) if mixed else self.pm.schedule_decode(seqs, k)
        except CacheFullError:
            assert self._state() == before
            return
        run_work(self.device, self.host, plan.work)
        meta = plan.metadata
        for j in range(k):
            self._write(meta, tokens[:, j])
            meta = plan.next_metadata(meta)
        self.pm.commit(plan, tokens[:, 0] if mixed else tokens)
        for s, t in zip(seqs, tokens.tolist()):
            self.model[s]["tokens"] += t

    @precondition(lambda self: self._movable())
    @rule(data=st.data())
    def write_part(self, data):
        """Room (and copy-on-write copies) for ``n`` tokens planned, and fewer kept: the step writes
        all ``n`` slots, the ones past what it keeps with garbage (a rejected speculative token), and
        the commit gives back the room past the kept tokens; keeping none aborts the plan (a private
        copy made for the first write stays)."""
        seq = data.draw(st.sampled_from(self._movable()))
        n = data.draw(st.integers(0, self._room(seq)))
        before, held = self._state(), self.pm.sequence(seq).capacity
        try:
            plan = self.pm.schedule([seq], [n])
        except CacheFullError:
            assert self._state() == before
            return
        run_work(self.device, self.host, plan.work)
        kept = data.draw(st.lists(TOKENS, max_size=n))
        self._write(plan.metadata, kept + [GARBAGE] * (n - len(kept)))
        if kept:
            self.pm.commit(plan, [kept])
        else:
            self.pm.abort(plan)
        self.model[seq]["tokens"] += kept
        self._check_room(seq, held)

    def _check_room(self, seq, held):
        """A plan over ``seq`` ended: it holds the room it held before (``held`` tokens) or what its
        tokens fill, whichever is more; what the plan reserved past that went back."""
        assert self.pm.sequence(seq).capacity == max(held, -(-len(self.model[seq]["tokens"]) // PS) * PS), seq

    @precondition(lambda self: self._movable())
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(self._movable()))
        if len(self.model) + len(self.swapped) == BATCH:
            return
        child = self.pm.fork(seq)
        assert child not in self.model
        self.model[child] = {**self.model[seq], "tokens": list(self.model[seq]["tokens"])}

    @precondition(lambda self: self._movable())
    @rule(data=st.data())
    def release(self, data):
        seq = data.draw(st.sampled_from(self._movable()))
        self.pm.release(seq)
        tokens = self.model.pop(seq)["tokens"]
        if -1 not in tokens:  # a resumed sequence's history is not a prompt
            self.history.append(tokens)
        before = self._state()
        try:
            self.pm.release(seq)
        except UnknownSequenceError:
            assert self._state() == before
        else:
            raise AssertionError("double release succeeded")

    @precondition(lambda self: not self.swapped and not self._transfers_pending()
                  and not self.frozen)  # a restored twin holds no plan (the plans' own rules test that)
    @rule()
    def restore(self):
        state = json.loads(json.dumps(self.pm.restored.state_dict()))
        restored = PageManager.from_state_dict(self.meta, state)
        assert restored.state_dict() == state
        if self.host_pages:  # a state leaves the host tier out: the live twin forgets its own (scrubbed now)
            self.pm.live.forget_host_tier()
            # Taking the host scrubs takes the device work too: the restored twin's, read back from
            # the state, must be the same, and both are applied (a runner's forget_host_tier does so).
            work = self.pm.live.take_work()
            assert not work.has_transfers and _same(work.groups, restored.take_work().groups)
            run_work(self.device, self.host, work)
        self.pm = Twins(self.pm.live, restored)

    def _state(self, manager=None):
        """A manager's state (the live twin's by default), also while sequences are swapped out
        (`state_dict` refuses then), less the host tier's (a restored twin's starts empty)."""
        manager = self.pm.live if manager is None else manager
        return {k: v for k, v in manager.state_dict(host_tier=True).items() if k != "host"}

    @precondition(lambda self: self._movable())
    @rule(data=st.data())
    def truncate(self, data):
        seq = data.draw(st.sampled_from(self._movable()))
        tokens = self.model[seq]["tokens"]
        n = data.draw(st.integers(0, len(tokens)))
        before = self._state()
        try:
            self.pm.truncate(seq, n)
        except (CacheFullError, ValueError) as err:  # a full pool, or tokens a window (or a resume) let go
            assert isinstance(err, CacheFullError) or "released" in str(err) or "resumed" in str(err), err
            assert self._state() == before
            return
        del tokens[n:]

    @rule()
    def reset_prefix_cache(self):
        self.pm.reset_prefix_cache()

    @rule(version=st.sampled_from([None, 1, "1"]))
    def set_version(self, version):
        changes = version_digest(version) != version_digest(self.version)
        waiting = [s for s in sorted(self.frozen)
                   if not self.model[s]["tokens"] and not self.pm.sequence(s).capacity]
        if changes and waiting:  # an open plan holds a sequence not started yet: the update waits for the plan
            before = self._state()
            with pytest.raises(ValueError, match=rf"set_weight_version\(\) would change sequence {waiting[0]} "):
                self.pm.set_weight_version(version)
            assert self._state() == before
            return
        self.pm.set_weight_version(version)
        if not changes:
            return  # the current one again: nothing changes
        self.version = version
        for seq, info in {**self.model, **self.swapped}.items():
            if not info["tokens"] and not self.pm.sequence(seq).capacity:  # nothing written or reserved: the new one
                info["version"] = version

    @precondition(lambda self: self.host_pages and self._movable())
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(self._movable()))
        self._apply_page_ops()  # an engine preempts between steps
        try:
            self.pm.swap_out(seq)
        except CacheFullError:
            return
        self.swapped[seq] = self.model.pop(seq)
        self._apply_page_ops()

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), back=st.booleans())
    def swap_in_or_release(self, data, back):
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        if not back:
            self.pm.release(seq)
            del self.swapped[seq]
            self._apply_page_ops()  # its host pages are scrubbed now
            return
        try:
            self.pm.swap_in(seq)
        except CacheFullError:
            return
        self.model[seq] = self.swapped.pop(seq)

    # ---- invariants ------------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "pm"):
            return
        self.pm.check_invariants()
        live, restored = (json.dumps(self._state(m), sort_keys=True) for m in (self.pm.live, self.pm.restored))
        assert live == restored  # canonical: the same calls give the same state, restored or not
        work = self._next_work()
        if not self.swapped and not work.has_transfers:
            state = json.loads(live)  # every state reached restores, and writes back the same
            assert PageManager.from_state_dict(self.meta, state).state_dict() == state
        assert self.pm.active_ids == sorted({**self.model, **self.swapped})
        state = self.pm.live.state_dict(host_tier=True)  # the host pools too
        pools = state["pool"] if len(self.groups) > 1 else [state["pool"]]
        self._check_contents(pools, work)
        m = self.pm.metrics
        assert m.free_pages + m.cached_pages + m.used_pages == sum(g.num_pages for g in self.groups)
        for g, (group, pool) in enumerate(zip(self.groups, m.groups)):
            assert pool.free_pages + pool.cached_pages + pool.used_pages == pool.total_pages == group.num_pages
            if self.scrub:  # a free page holds nothing, or is reported for zeroing
                pending = set(work.groups[g].scrubs.tolist())
                for heap in pools[g]["free"]:
                    for page in heap:
                        assert page in pending or (self.device[g][page] == -1).all(), (g, page)
                if self.host_pages:  # a released host page holds nothing once the pending work ran
                    host = work.tier("host")
                    moves = host.groups[g] if host is not None else TierTransfers()
                    waiting = set(moves.scrubs.tolist()) | set(moves.offload_dst.tolist())
                    for heap in state["host"]["pools"][g]["free"]:
                        for page in heap:
                            assert page in waiting or (self.host[g][page] == -1).all(), ("host", g, page)

    def _check_contents(self, pools=None, work=None):
        """``pools``: each group's pool as the manager's state gives it; ``work``: the next plan's
        (`_next_work`); None: read here."""
        if pools is None:
            state = self.pm.live.state_dict(host_tier=True)
            pools = state["pool"] if len(self.groups) > 1 else [state["pool"]]
        digests = [{page: bytes.fromhex(d) for page, d in pool["digests"]} for pool in pools]  # per group
        devices = [d.copy() for d in self.device]  # as the next step will see them: pending work applied
        run_work(devices, [h.copy() for h in self.host], self._next_work() if work is None else work)
        for g, group in enumerate(self.groups):
            device = devices[g]
            for seq, info in self.model.items():
                tokens = info["tokens"]
                assert self.pm.length(seq) == len(tokens)
                pages = self.pm.pages(seq, group=g)
                # Exactly the pages wholly before the next query's window are released (-1), and
                # no page inside it was freed or reused: it still holds the sequence's tokens.
                gone = max(self._released(group, len(tokens), len(pages)), info.get("floor", 0) // PS)
                assert all(p == -1 for p in pages[:gone]) and all(p >= 0 for p in pages[gone:]), (g, seq, pages)
                got = device[pages[gone:]].reshape(-1)[: len(tokens) - gone * PS] if pages else np.zeros(0)
                assert got.tolist() == tokens[gone * PS:], (g, seq, got.tolist(), tokens)
                # a page in the prefix cache is named by exactly the history it holds
                full = len(tokens) // PS
                root = version_root(version_digest(info.get("version")))
                want = list(iter_page_digests(np.array(tokens, np.int32), PS, full, salt_digest(info["salt"]), root))
                for col, page in enumerate(pages[:full]):
                    if col < gone:
                        continue
                    digest = digests[g].get(page)
                    assert digest is None or digest == want[col], (g, seq, col, page)

    @staticmethod
    def _released(group, length: int, held: int) -> int:
        """Columns wholly before the first position a query at ``length`` reads, written here
        from the definitions (sliding: the last W positions; chunked: its own chunk)."""
        if group.attention == "full":
            return 0
        w = group.window
        first = max(0, length - w + 1) if group.attention == "sliding" else length - length % w
        return min(first // PS, held)


def run_work(devices, hosts, work):
    """A plan's `DeviceWork` on simulated pages, in the runner's order: offloads read the device,
    copies, onloads, scrubs, host scrubs, the offloads land in the host, then the host pages the
    transfers left unreferenced are zeroed. The host tier's part is its `TierWork` (``"host"``);
    a manager without one hands over no tier work."""
    host = work.tier("host")
    assert [t.name for t in work.tiers] == (["host"] if host is not None else [])
    assert host is None or hosts  # host work only where there is a host tier
    for g, (device, part) in enumerate(zip(devices, work.groups, strict=True)):
        moves = host.groups[g] if host is not None else None
        out = device[moves.offload_src].copy() if moves is not None else None
        back = hosts[g][moves.onload_src].copy() if moves is not None else None
        device[part.copy_dst] = device[part.copy_src]
        if moves is not None:
            device[moves.onload_dst] = back
        device[part.scrubs] = -1
        if moves is not None:
            hosts[g][moves.scrubs] = -1
            hosts[g][moves.offload_dst] = out
            hosts[g][moves.scrubs_after] = -1


class DataParallelMachine(ManagerMachine):
    shards = 2


class NoCachingMachine(ManagerMachine):
    caching = False
    scrub = False


class SlidingWindowMachine(ManagerMachine):
    layer_groups = (LayerGroup((0,), "sliding", 6, num_pages=PAGES),)  # a window over two pages, not a page multiple


class ChunkedDataParallelMachine(ManagerMachine):
    layer_groups = (LayerGroup((0,), "chunked", 8, num_pages=PAGES),)
    shards = 2


class HybridMachine(ManagerMachine):
    """A full group beside a sliding one with a smaller pool (gpt-oss, Gemma): a prefix hit needs
    both groups' pages, the sliding group frees what left its window, the full one keeps all."""
    layer_groups = (LayerGroup((0,), "full", num_pages=PAGES), LayerGroup((1,), "sliding", 5, num_pages=8))


class HybridDataParallelMachine(ManagerMachine):
    """Three pools split over two replicas: full, chunked and sliding groups."""
    layer_groups = (LayerGroup((0,), "full", num_pages=PAGES), LayerGroup((1,), "chunked", 8, num_pages=10),
                    LayerGroup((2,), "sliding", 6, num_pages=8))
    shards = 2


class WindowsOnlyMachine(ManagerMachine):
    """Two window groups (and no full one): sequences can resume mid-way in both."""
    layer_groups = (LayerGroup((0,), "sliding", 3, num_pages=6), LayerGroup((1,), "chunked", 8, num_pages=PAGES))


class TieredMachine(ManagerMachine):
    """A host tier of 6 pages: evicted prefixes offloaded and found again, sequences swapped."""
    host_pages = 6


class TieredHybridDataParallelMachine(HybridDataParallelMachine):
    """Three pools over two replicas, each with its host tier."""
    host_pages = 8


# Host logic only: the result does not depend on the jax version, so CI runs it in one environment.
NUMPY_ONLY = pytest.mark.numpy_only
TestManagerMachine = NUMPY_ONLY(ManagerMachine.TestCase)
TestDataParallelMachine = NUMPY_ONLY(DataParallelMachine.TestCase)
TestNoCachingMachine = NUMPY_ONLY(NoCachingMachine.TestCase)
TestSlidingWindowMachine = NUMPY_ONLY(SlidingWindowMachine.TestCase)
TestChunkedDataParallelMachine = NUMPY_ONLY(ChunkedDataParallelMachine.TestCase)
TestHybridMachine = NUMPY_ONLY(HybridMachine.TestCase)
TestHybridDataParallelMachine = NUMPY_ONLY(HybridDataParallelMachine.TestCase)
TestWindowsOnlyMachine = NUMPY_ONLY(WindowsOnlyMachine.TestCase)
TestTieredMachine = NUMPY_ONLY(TieredMachine.TestCase)
TestTieredHybridDataParallelMachine = NUMPY_ONLY(TieredHybridDataParallelMachine.TestCase)
