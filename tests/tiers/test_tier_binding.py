"""A host tier's pages belong to one manager and outlive nothing they should not, on real tiny
caches (one device, float32): a released sequence's host pages are zeroed by the next
`apply_pending` (``scrub_released``), also when scrubs are its only work; a `HostTier` serves the
manager that first took it and is refused to any other (two caches of one shape never write into
each other's host pages); `import_sequence` and `apply_pending` refuse a bad ``host=`` before
anything changes; and a hypothesis machine drives two caches through admissions, writes, swaps,
releases and wrong tiers, checking that every free host page holds zeros and every live sequence
reads its own K/V."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import easykv
from easykv.errors import CacheFullError
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh

PS, LAYERS, HEADS, DIM, MAX_LEN = 4, 2, 2, 8, 16
PAD = MAX_LEN  # every write padded to one shape: one compile for all of them


def make(*, prefix=True, pages=6, host=6):
    """A one-device float32 cache with a host tier, its HostTier and a scrubbing manager."""
    mesh = create_mesh({"dp": 1, "tp": 1}, devices=jax.devices()[:1])
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp"))
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 4, LAYERS, MAX_LEN, PS, HEADS, DIM, 0.5, jnp.float32, partition_manager=pm,
        num_pages_per_layer=pages).replace(host_pages_per_layer=host)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    manager = easykv.PageManager(meta, scrub_released=True, enable_prefix_caching=prefix)
    return cache, easykv.HostTier(cache), manager


def kv(side, tokens, start, n):
    """K/V of positions ``start .. start + n - 1``: a function of the cache (``side``), the token
    and its position only, so a shared prefix page holds what any sharer would write."""
    pos = np.arange(start, start + n)
    tok = np.asarray(tokens[start : start + n], np.float64)
    base = side * 5000 + tok * 16 + pos
    k = base[None, :, None, None] + np.arange(LAYERS)[:, None, None, None] * 0.5 + np.arange(HEADS)[:, None] * 0.25
    k = np.broadcast_to(k + np.arange(DIM) / 64, (LAYERS, n, HEADS, DIM)).astype(np.float32)
    return k, -k - 1


def write(cache, tier, manager, seq, side, tokens, start):
    """Write ``tokens[start:]`` of ``seq`` (reserving, applying the pending work first)."""
    n = len(tokens) - start
    k, v = kv(side, tokens, start, n)
    pad = [(0, 0), (0, PAD - n), (0, 0), (0, 0)]

    def step(cache, plan):
        cache, _ = cache.write(jnp.asarray(np.pad(k, pad)), jnp.asarray(np.pad(v, pad)), plan.metadata)
        return cache, None

    runner = easykv.Runner(manager, cache, host=tier)
    runner.run(manager.schedule([seq], [n], pad_tokens_to=PAD, pad_seqs_to=4), step, token_ids=[list(tokens[start:])])
    return runner.cache


def admit(cache, tier, manager, side, tokens):
    [s] = manager.claim(1)
    done = manager.match_prefix(s, list(tokens))
    return write(cache, tier, manager, s, side, list(tokens), done), s


def read(cache, manager, seq):
    """K and V of ``seq``'s committed tokens, ``(layers, length, heads, dim)``, from its device pages."""
    n = manager.length(seq)
    row = np.asarray(manager.page_table([seq])[0])
    pos = np.arange(n)
    pages = row[pos // PS]
    out = []
    for pool in (cache.key_pages[0], cache.value_pages[0]):
        a = np.asarray(jax.tree.leaves(pool)[0])  # (layers, heads, pages, page_size, dim)
        out.append(np.transpose(a[:, :, pages, pos % PS, :], (0, 2, 1, 3)))
    return out


def assert_reads(cache, manager, seq, side, tokens):
    k, v = read(cache, manager, seq)
    want_k, want_v = kv(side, tokens, 0, len(tokens))
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)


def host_arrays(tier):
    """Every host array of the tier (landed first), page-major, copied."""
    tier.flush()
    return [a.copy() for store in tier._groups for shards in store.shards for a in shards.values()]


def nonzero_host_pages(tier):
    held = np.zeros(tier.metadata.host_pages_per_layer, bool)
    for a in host_arrays(tier):
        held |= a.reshape(a.shape[0], -1).any(axis=1)
    return set(np.flatnonzero(held).tolist())


def free_host_pages(manager):
    """The host pages no sequence or transfer holds and no prefix names (the host pool's free lists)."""
    return {h for heap in manager.state_dict(host_tier=True)["host"]["pools"][0]["free"] for h in heap}


def pending(manager):
    """Whether any work waits for `apply_pending` (host scrubs included), as a copy of the manager
    would hand it over."""
    return not manager.clone().take_work().empty


def transfers_pending(manager):
    return manager.clone().take_work().has_transfers


def assert_no_leak(manager, tier):
    """After an `apply_pending`: every host page the manager holds free reads zeros."""
    leaked = free_host_pages(manager) & nonzero_host_pages(tier)
    assert not leaked, f"free host pages {sorted(leaked)} still hold released K/V"


def snapshot(manager, *tiers):
    return manager.state_dict(host_tier=True), manager.metrics, [host_arrays(t) for t in tiers]


def same(a, b):
    (state_a, metrics_a, hosts_a), (state_b, metrics_b, hosts_b) = a, b
    assert state_a == state_b and metrics_a == metrics_b
    for xs, ys in zip(hosts_a, hosts_b):
        assert all(np.array_equal(x, y) for x, y in zip(xs, ys))


TOKENS = list(range(10, 16))  # one full page and a partial one


# ---- released data leaves host memory ------------------------------------------------------------------------
def test_a_released_swapped_sequence_is_zeroed_in_host_memory_by_the_next_apply():
    cache, tier, manager = make(prefix=False)  # no digests: every host page of it is freed on release
    cache, s = admit(cache, tier, manager, 1, TOKENS)
    manager.swap_out(s)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    assert nonzero_host_pages(tier) == {0, 1}  # its two pages, on the host
    manager.release(s)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)  # host scrubs are its only work
    assert nonzero_host_pages(tier) == set()
    assert not transfers_pending(manager) and not manager.has_pending_work and not pending(manager)


def test_a_host_scrub_alone_is_pending_work_and_needs_the_tier():
    cache, tier, manager = make(prefix=False)
    cache, s = admit(cache, tier, manager, 1, TOKENS)
    manager.swap_out(s)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    manager.release(s)
    assert not transfers_pending(manager) and manager.has_pending_work and pending(manager)
    with pytest.raises(ValueError, match="pass the cache's tier"):
        easykv.apply_pending(manager, cache)  # without the tier, the scrub would be skipped
    assert manager.state_dict()  # a state holds no host page: the scrub stays pending here
    assert manager.has_pending_work
    cache, copied = easykv.apply_pending(manager, cache, host=tier)
    assert copied == 0 and not any(a.is_deleted() for a in jax.tree.leaves(cache))  # no device program
    assert nonzero_host_pages(tier) == set() and manager.state_dict()


def test_swapping_in_leaves_no_host_copy_behind_and_nothing_pending():
    cache, tier, manager = make(prefix=False)
    cache, s = admit(cache, tier, manager, 1, TOKENS)
    manager.swap_out(s)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    cache, t = admit(cache, tier, manager, 2, list(range(40, 56)))  # writes over the pages it held
    manager.release(t)
    manager.swap_in(s)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    assert_reads(cache, manager, s, 1, TOKENS)
    assert nonzero_host_pages(tier) == set()  # the onloads' sources, zeroed once read
    assert not manager.has_pending_work
    manager.state_dict()  # nothing of the host tier is left pending


def test_an_offload_into_a_page_released_before_it_ran_never_lands():
    cache, tier, manager = make(prefix=False)
    cache, s = admit(cache, tier, manager, 1, TOKENS)
    manager.swap_out(s)
    manager.release(s)  # the offloads still run (they hold their pages), then free them
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    assert nonzero_host_pages(tier) == set() and not manager.has_pending_work


def test_forgetting_the_tier_zeroes_what_it_kept():
    cache, tier, manager = make()
    cache, s = admit(cache, tier, manager, 1, TOKENS)
    manager.swap_out(s)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    manager.release(s)
    assert manager.metrics.host.cached_pages == 1  # the full page stays cached on the host
    runner = easykv.Runner(manager, cache, host=tier)
    assert runner.forget_host_tier() == 1 and runner.host is None
    assert nonzero_host_pages(tier) == set() and not manager.has_pending_work
    with pytest.raises(ValueError, match="bound to another PageManager"):
        easykv.apply_pending(make()[2], cache, host=tier)  # still this manager's: no other takes it


# ---- a tier serves one manager -------------------------------------------------------------------------------
def two_caches_with_a_swapped_victim():
    """Two caches of one shape; cache A's sequence is swapped out into its tier."""
    a_cache, a_tier, a = make(prefix=False)
    b_cache, b_tier, b = make(prefix=False)
    a_cache, victim = admit(a_cache, a_tier, a, 1, TOKENS)
    a.swap_out(victim)
    a_cache, _ = easykv.apply_pending(a, a_cache, host=a_tier)
    b_cache, intruder = admit(b_cache, b_tier, b, 2, list(range(70, 76)))
    return (a_cache, a_tier, a, victim), (b_cache, b_tier, b, intruder)


def test_another_managers_tier_is_refused_with_nothing_changed():
    (a_cache, a_tier, a, victim), (b_cache, b_tier, b, intruder) = two_caches_with_a_swapped_victim()
    b.swap_out(intruder)  # its offload would land on host page 0: the victim's page in a_tier
    before = snapshot(b, a_tier, b_tier)
    with pytest.raises(ValueError, match=r"bound to another PageManager.*easykv\.HostTier\(cache\)"):
        easykv.apply_pending(b, b_cache, host=a_tier)
    same(snapshot(b, a_tier, b_tier), before)
    assert not any(x.is_deleted() for x in jax.tree.leaves(b_cache))
    b_cache, _ = easykv.apply_pending(b, b_cache, host=b_tier)  # the right one still works
    a.swap_in(victim)
    a_cache, _ = easykv.apply_pending(a, a_cache, host=a_tier)
    assert_reads(a_cache, a, victim, 1, TOKENS)  # its own K/V, not the intruder's
    b.swap_in(intruder)
    b_cache, _ = easykv.apply_pending(b, b_cache, host=b_tier)
    assert_reads(b_cache, b, intruder, 2, list(range(70, 76)))


def test_a_fresh_manager_cannot_take_a_bound_tier_and_a_used_one_cannot_switch():
    (a_cache, a_tier, a, _), _ = two_caches_with_a_swapped_victim()
    fresh_cache, fresh_tier, fresh = make(prefix=False)
    with pytest.raises(ValueError, match="bound to another PageManager"):
        easykv.apply_pending(fresh, fresh_cache, host=a_tier)  # empty, but the tier is a's
    with pytest.raises(ValueError, match="not the HostTier this manager's host pages live in"):
        easykv.apply_pending(a, a_cache, host=fresh_tier)  # a's swapped pages live in a_tier
    rebuilt = easykv.PageManager.from_state_dict(fresh.metadata, fresh.state_dict())
    with pytest.raises(ValueError, match="bound to another PageManager"):
        easykv.apply_pending(rebuilt, fresh_cache, host=a_tier)
    fresh_cache, _ = easykv.apply_pending(rebuilt, fresh_cache, host=fresh_tier)  # an unbound tier is taken
    assert fresh_tier.owner is not None and fresh_tier.owner is not a_tier.owner


def test_a_clone_cannot_write_into_its_originals_tier():
    (a_cache, a_tier, a, victim), _ = two_caches_with_a_swapped_victim()
    trial = a.clone()
    trial.swap_in(victim)
    before = snapshot(a, a_tier)
    with pytest.raises(ValueError, match="clone"):
        easykv.apply_pending(trial, a_cache, host=a_tier)
    same(snapshot(a, a_tier), before)


@pytest.mark.parametrize("bad", ["tier", 3, "cache"], ids=["str", "int", "a cache"])
def test_apply_pending_refuses_a_host_that_is_no_tier(bad):
    cache, tier, manager = make()
    cache, s = admit(cache, tier, manager, 1, TOKENS)
    manager.swap_out(s)
    bad = cache if bad == "cache" else bad
    before = snapshot(manager, tier)
    with pytest.raises(ValueError, match=rf"host= must be the easykv.HostTier of this cache.*got {type(bad).__name__}"):
        easykv.apply_pending(manager, cache, host=bad)
    same(snapshot(manager, tier), before)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)


# ---- import_sequence checks host= first ----------------------------------------------------------------------
def cached_prefix_and_export():
    """A cache whose prefix cache holds ``TOKENS``' full page, and an export of a sequence that
    starts with it (its import would hit that page: counters and LRU order would change)."""
    cache, tier, manager = make()
    cache, s = admit(cache, tier, manager, 1, TOKENS)
    exported = easykv.export_sequence(cache, manager, s, token_ids=TOKENS)
    manager.release(s)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    return cache, tier, manager, exported


@pytest.mark.parametrize("bad", ["other tier", "str", "cache"])
def test_import_sequence_refuses_a_bad_host_before_anything_changes(bad):
    cache, tier, manager, exported = cached_prefix_and_export()
    other_cache, other_tier, other = make()
    easykv.apply_pending(other, other_cache, host=other_tier)  # binds it to the other manager
    host = {"other tier": other_tier, "str": "tier", "cache": cache}[bad]
    before = snapshot(manager, tier)
    counters = manager.metrics.prefix_hits, manager.metrics.prefix_hit_tokens
    with pytest.raises(ValueError, match="bound to another PageManager|host= must be the easykv.HostTier"):
        easykv.import_sequence(cache, manager, exported, host=host)
    same(snapshot(manager, tier), before)
    assert (manager.metrics.prefix_hits, manager.metrics.prefix_hit_tokens) == counters
    assert not any(x.is_deleted() for x in jax.tree.leaves(cache))
    cache, seq = easykv.import_sequence(cache, manager, exported, host=tier)
    assert manager.metrics.prefix_hits == counters[0] + 1
    assert_reads(cache, manager, seq, 1, TOKENS)


# ---- two caches, one machine ---------------------------------------------------------------------------------
PROMPTS = [(1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 7), (8, 8, 8, 8, 8, 8, 8, 8, 9), (5, 5, 5)]


class TwoTieredCaches(RuleBasedStateMachine):
    """Two caches of one shape (tiny pools, scrubbing), each with its own tier; rules admit,
    write, swap out and in, release and apply on either, and some pass the other cache's tier
    (refused, nothing changed). After every `apply_pending`, every host page its manager holds
    free reads zeros; after every rule, with nothing pending, every live sequence reads its own
    K/V (a function of its cache, token and position) from its device pages."""

    def __init__(self):
        super().__init__()
        self.sides = [list(make(pages=6, host=6)) for _ in range(2)]  # [cache, tier, manager]
        for side in self.sides:  # each tier bound to its manager from the start
            side[0], _ = easykv.apply_pending(side[2], side[0], host=side[1])
        self.live = [{}, {}]  # seq -> tokens
        self.swapped = [{}, {}]

    def _apply(self, i):
        cache, tier, manager = self.sides[i]
        self.sides[i][0], _ = easykv.apply_pending(manager, cache, host=tier)
        assert_no_leak(manager, tier)

    def _write(self, i, seq, tokens, start):
        cache, tier, manager = self.sides[i]
        self.sides[i][0] = write(cache, tier, manager, seq, i, tokens, start)  # applies first
        assert_no_leak(manager, tier)

    @precondition(lambda self: any(len(self.live[i]) + len(self.swapped[i]) < 4 for i in range(2)))
    @rule(i=st.integers(0, 1), prompt=st.sampled_from(PROMPTS))
    def admit(self, i, prompt):
        manager = self.sides[i][2]
        if len(self.live[i]) + len(self.swapped[i]) >= 4:
            return
        [s] = manager.claim(1)
        done = manager.match_prefix(s, list(prompt))
        try:
            self._write(i, s, list(prompt), done)
        except CacheFullError:
            manager.release(s)
            return
        self.live[i][s] = list(prompt)

    @precondition(lambda self: self.live[0] or self.live[1])
    @rule(data=st.data(), token=st.integers(0, 3), n=st.integers(1, 5))
    def extend(self, data, token, n):
        i = data.draw(st.sampled_from([i for i in range(2) if self.live[i]]))
        s = data.draw(st.sampled_from(sorted(self.live[i])))
        tokens = self.live[i][s]
        n = min(n, MAX_LEN - len(tokens))
        if not n:
            return
        new = tokens + [token + j for j in range(n)]
        try:
            self._write(i, s, new, len(tokens))
        except CacheFullError:
            return
        self.live[i][s] = new

    @precondition(lambda self: self.live[0] or self.live[1])
    @rule(data=st.data())
    def swap_out(self, data):
        i = data.draw(st.sampled_from([i for i in range(2) if self.live[i]]))
        s = data.draw(st.sampled_from(sorted(self.live[i])))
        self._apply(i)  # an engine preempts between steps: the step's work has run
        try:
            self.sides[i][2].swap_out(s)
        except CacheFullError:
            return
        self.swapped[i][s] = self.live[i].pop(s)

    @precondition(lambda self: self.swapped[0] or self.swapped[1])
    @rule(data=st.data())
    def swap_in(self, data):
        i = data.draw(st.sampled_from([i for i in range(2) if self.swapped[i]]))
        s = data.draw(st.sampled_from(sorted(self.swapped[i])))
        self._apply(i)  # its swap-out has run
        try:
            self.sides[i][2].swap_in(s)
        except CacheFullError:
            return
        self.live[i][s] = self.swapped[i].pop(s)

    @precondition(lambda self: any(self.live[i] or self.swapped[i] for i in range(2)))
    @rule(data=st.data())
    def release(self, data):
        i = data.draw(st.sampled_from([i for i in range(2) if self.live[i] or self.swapped[i]]))
        held = {**self.live[i], **self.swapped[i]}
        s = data.draw(st.sampled_from(sorted(held)))
        self.sides[i][2].release(s)
        self.live[i].pop(s, None)
        self.swapped[i].pop(s, None)

    @rule(i=st.integers(0, 1))
    def apply(self, i):
        self._apply(i)

    @rule(i=st.integers(0, 1), kind=st.sampled_from(["other tier", "other tier", "str", "other cache"]))
    def apply_with_a_wrong_host(self, i, kind):
        cache, _, manager = self.sides[i]
        host = {"other tier": self.sides[1 - i][1], "str": "tier", "other cache": self.sides[1 - i][0]}[kind]
        before = snapshot(manager, self.sides[0][1], self.sides[1][1])
        with pytest.raises(ValueError, match="bound to another PageManager|host= must be the easykv.HostTier"):
            easykv.apply_pending(manager, cache, host=host)
        same(snapshot(manager, self.sides[0][1], self.sides[1][1]), before)
        assert not any(x.is_deleted() for x in jax.tree.leaves(cache))

    @invariant()
    def sequences_read_their_own(self):
        for i, (cache, _, manager) in enumerate(self.sides):
            manager.check_invariants()
            if not pending(manager):  # else their pages are not all there yet
                for s, tokens in self.live[i].items():
                    assert_reads(cache, manager, s, i, tokens)


TestTwoTieredCaches = TwoTieredCaches.TestCase
