"""What a shared prefix store reads of the page manager and gives it (`easykv.manager.store_feed`): the digests a
lookup tries (`PageManager.prompt_digests`), the journals of filled pages and host evictions
(`watch_prefixes` / `take_prefix_events`) and host pages adopted for a chain the store holds
(`adopt_host_prefixes`). Pure manager on tiny pools: exact page ids."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from easykv import PageManager
from tests.support.managers import make_meta

PS = 4


def manager(pages=8, host=4, max_len=32, shards=1):
    meta = make_meta(pages=pages, max_len=max_len, shards=shards)
    if host:
        meta = meta.replace(host_pages_per_layer=host)
    pm = PageManager(meta)
    pm.check_invariants()
    return pm


def fill(pm, tokens, salt=None):
    """A new sequence of ``tokens`` (its cached prefix matched), committed; returns (seq, found, work)."""
    [seq] = pm.claim(1)
    found = pm.match_prefix(seq, tokens, salt=salt)
    plan = pm.schedule([seq], [len(tokens) - found])
    work = plan.work
    pm.commit(plan, [list(tokens[found:])])
    pm.check_invariants()
    return seq, found, work


def prompt(i, n=13):
    return [100 * i + j for j in range(n)]


def test_prompt_digests_are_the_lookup():
    pm = manager()
    pm.watch_prefixes(written=True, host_evicted=False)
    p = prompt(1, 13)
    seq, _, _ = fill(pm, p)
    filled = pm.take_prefix_events().written[0]
    assert [page for page, _ in filled] == pm.pages(seq)[:3]
    pm.release(seq)
    digests = [d for _, d in filled]
    # every page but one holding the last token: 13 tokens -> 3, 12 -> 2, 4 -> 0
    assert list(pm.prompt_digests(p)) == digests
    assert list(pm.prompt_digests(p[:12])) == digests[:2]
    assert pm.prompt_digests(p[:4]) == ()
    assert pm.prompt_digests(np.asarray(p)) == pm.prompt_digests(p)
    # a page is found exactly when its digest is among those the prompt's lookup tries
    known = set(digests)
    for n in range(1, 20):
        for variant in (p[:n], p[:n] + [7] * 3, [9] + p[1:n]):
            lead = 0
            for d in pm.prompt_digests(variant):
                if d not in known:
                    break
                lead += 1
            assert pm.cached_prefix_length(variant) == PS * lead, variant
    # another salt or weight version: other digests, nothing found
    salted = pm.prompt_digests(p, salt="tenant")
    assert not set(salted) & known and pm.cached_prefix_length(p, salt="tenant") == 0
    pm.set_weight_version(2)
    assert not set(pm.prompt_digests(p)) & known and pm.cached_prefix_length(p) == 0
    pm.check_invariants()


def test_written_journal_lists_filled_pages_once_in_order():
    pm = manager(pages=12, host=4)
    pm.watch_prefixes(written=True, host_evicted=False)
    a, _, _ = fill(pm, prompt(1, 9))  # 2 full pages; the third holds 1 token
    assert [p for p, _ in pm.take_prefix_events().written[0]] == pm.pages(a)[:2] == [0, 1]
    for t in range(3):  # the third page fills with the third decode token
        plan = pm.schedule([a], [1])
        pm.commit(plan, [[7 + t]])
        events = pm.take_prefix_events()
        assert [p for p, _ in events.written[0]] == ([2] if t == 2 else [])
    assert pm.take_prefix_events().empty
    # another sequence finding the prefix fills only its own new pages
    b, found, _ = fill(pm, prompt(1, 9) + [500, 501, 502, 503])
    assert found == 8
    assert [p for p, _ in pm.take_prefix_events().written[0]] == [pm.pages(b)[2]]
    # two sequences filling the same prefix in one step: one page enters the prefix map, once
    pm.release(a)
    pm.release(b)
    c, d = pm.claim(2)
    plan = pm.schedule([c, d], [5, 5])
    pm.commit(plan, [prompt(3, 5), prompt(3, 5)])
    written = pm.take_prefix_events().written[0]
    assert len(written) == 1 and written[0][0] in (pm.pages(c)[0], pm.pages(d)[0])
    pm.check_invariants()
    pm.watch_prefixes(written=False, host_evicted=False)
    fill(pm, prompt(4, 5))
    assert pm.take_prefix_events().empty


def test_journal_leaves_out_host_onloads_and_lists_host_evictions():
    pm = manager(pages=8, host=4)
    pm.watch_prefixes(written=True, host_evicted=True)
    on_host: dict[int, bytes] = {}  # host page -> digest, from the offloads the work carries
    digest_of: dict[int, bytes] = {}  # device page -> digest, from the written journal
    first, _, _ = fill(pm, prompt(1))
    digest_of.update(pm.take_prefix_events().written[0])
    pm.release(first)
    for i in range(2, 6):
        seq, found, work = fill(pm, prompt(i))
        assert found == 0
        src, dst, onload_src, _, _ = work.transfers()[0]
        assert onload_src.size == 0
        events = pm.take_prefix_events()
        # evicted: the host pages an offload takes that held a prefix, with that prefix's digest, once each
        assert [p for p, _ in events.host_evicted[0]] == [h for h in dst.tolist() if h in on_host]
        assert all(on_host.pop(h) == d for h, d in events.host_evicted[0])
        on_host.update({h: digest_of[s] for s, h in zip(src.tolist(), dst.tolist())})
        assert [p for p, _ in events.written[0]] == pm.pages(seq)[:3]
        digest_of.update(events.written[0])
        pm.release(seq)
    # a prompt whose first pages only the host holds: matched, onloaded from exactly those, not journaled as filled
    held = {d: h for h, d in on_host.items()}
    i = next(i for i in range(1, 6) if pm.prompt_digests(prompt(i))[0] in held)
    run = 0
    for d in pm.prompt_digests(prompt(i)):
        if d not in held:
            break
        run += 1
    seq, found, work = fill(pm, prompt(i))
    assert found == PS * run > 0
    _, _, onload_src, onload_dst, _ = work.transfers()[0]
    assert onload_src.tolist() == [held[d] for d in pm.prompt_digests(prompt(i))[:run]]
    assert onload_dst.tolist() == pm.pages(seq)[:run]
    assert [p for p, _ in pm.take_prefix_events().written[0]] == pm.pages(seq)[run:3]


def test_watch_evictions_needs_a_host_tier():
    pm = manager(host=0)
    with pytest.raises(ValueError, match="host"):
        pm.watch_prefixes(written=True, host_evicted=True)
    pm.watch_prefixes(written=True, host_evicted=False)
    fill(pm, prompt(1))
    assert pm.take_prefix_events().host_evicted == ((),)


def test_adopt_exact_host_pages_then_match_onloads_them():
    pm = manager(pages=8, host=4)
    p = prompt(1, 17)
    digests = pm.prompt_digests(p)
    assert len(digests) == 4
    assert pm.adopt_host_prefixes(digests[:3]) == ([0, 1, 2],)
    pm.check_invariants()
    assert pm.cached_prefix_length(p) == 12
    seq, found, work = fill(pm, p)
    assert found == 12
    _, _, onload_src, onload_dst, _ = work.transfers()[0]
    assert onload_src.tolist() == [0, 1, 2] and onload_dst.tolist() == pm.pages(seq)[:3]


def test_adopt_skips_what_the_device_or_host_holds():
    pm = manager(pages=8, host=4)
    p = prompt(1, 17)
    digests = pm.prompt_digests(p)
    seq, _, _ = fill(pm, p[:5])  # the device holds page 0
    pm.release(seq)
    assert pm.adopt_host_prefixes(digests[:2]) == ([-1, 0],)
    pm.check_invariants()
    assert pm.adopt_host_prefixes(digests) == ([-1, -1, 1, 2],)  # host page 0 held: only the new ones
    pm.check_invariants()
    assert pm.cached_prefix_length(p) == 16


def test_adopt_takes_the_longest_run_that_fits_without_evicting_its_own_chain():
    pm = manager(pages=8, host=4, max_len=32)
    p = prompt(1, 33)
    digests = pm.prompt_digests(p)
    assert len(digests) == 8
    assert pm.adopt_host_prefixes(digests[:2]) == ([0, 1],)
    # 4 host pages, 2 held by this chain (kept): 2 more fit, none of the chain's own evicted for them
    assert pm.adopt_host_prefixes(digests) == ([-1, -1, 2, 3],)
    pm.check_invariants()
    assert pm.cached_prefix_length(p) == 16
    # a full pool: another chain evicts this one's tail first (released tail first)
    other = pm.prompt_digests(prompt(2, 9))
    assert pm.adopt_host_prefixes(other[:1]) == ([3],)
    assert pm.cached_prefix_length(p) == 12
    assert pm.adopt_host_prefixes(other[1:2]) == ([2],)
    assert pm.cached_prefix_length(p) == 8
    assert pm.cached_prefix_length(prompt(2, 9)) == 8
    pm.check_invariants()


def test_adopt_on_a_replica():
    pm = manager(pages=16, host=4, shards=2)
    digests = pm.prompt_digests(prompt(1, 9))
    assert pm.adopt_host_prefixes(digests, replica=1) == ([2, 3],)  # replica 1's host pages are 2, 3
    pm.check_invariants()


@pytest.mark.parametrize("bad, match", [
    (lambda d: [d[0], d[1][:31]], r"digests\[1\]=.*32-byte"),
    (lambda d: [d[0], "x" * 32], r"digests\[1\]=.*32-byte"),
    (lambda d: [None], r"digests\[0\]=None"),
])
def test_adopt_refuses_bad_digests_unchanged(bad, match):
    pm = manager()
    fill(pm, prompt(3))
    before = copy.deepcopy(pm.state_dict(host_tier=True))
    with pytest.raises(ValueError, match=match):
        pm.adopt_host_prefixes(bad(pm.prompt_digests(prompt(1))))
    assert pm.state_dict(host_tier=True) == before
    pm.check_invariants()


@pytest.mark.parametrize("replica, match", [(1, r"replica=1 .*0 \.\. 0"), (-1, "replica")])
def test_adopt_refuses_a_bad_replica_unchanged(replica, match):
    pm = manager()
    before = copy.deepcopy(pm.state_dict(host_tier=True))
    with pytest.raises(ValueError, match=match):
        pm.adopt_host_prefixes(pm.prompt_digests(prompt(1)), replica=replica)
    assert pm.state_dict(host_tier=True) == before


def test_adopt_without_a_host_tier():
    pm = manager(host=0)
    before = copy.deepcopy(pm.state_dict())
    with pytest.raises(ValueError, match="host"):
        pm.adopt_host_prefixes(pm.prompt_digests(prompt(1)))
    assert pm.state_dict() == before
