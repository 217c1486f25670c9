"""truncate(seq, length) and fork(seq, n) on tiny pools (page_size 4), with exact page ids, and a
hypothesis machine that runs the manager against a simulated device: every page holds the token
ids written into it (copies and scrubs applied as an engine applies them), and after every rule
each live sequence's tokens, read through its page table, must be exactly its own history. That
is what truncation has to keep: whole pages freed, shared pages untouched, prefix hits and
copy-on-write copies still right, and a truncated-then-regrown sequence equal to one that never
had the tail."""

from __future__ import annotations

import json

import pytest

from easykv.errors import CacheFullError
from easykv.manager.manager import PageManager
from tests.support.machines import Device, GroupedTruncateMachine, TruncateMachine
from tests.support.managers import PS, cached_ids, make, prefill


def test_truncate_frees_whole_pages_and_regrows_like_a_sequence_without_the_tail():
    pm, dev = make(batch=4, pages=10, max_len=24), Device(10)
    [a] = pm.claim(1)
    dev.run(pm, a, list(range(14)))  # pages 0..3, 2 tokens in page 3
    pm.schedule([a], [6])  # and room reserved ahead: page 4
    assert pm.pages(a) == [0, 1, 2, 3, 4]
    # A state saved while that step was planned: the room stays reserved, with no plan to end.
    pm = PageManager.from_state_dict(pm.metadata, pm.state_dict())
    pm.truncate(a, 6)
    assert pm.pages(a) == [0, 1] and pm.length(a) == 6 and pm.sequence(a).capacity == 8
    assert cached_ids(pm) == [2]  # page 2 was full: cached; pages 3 and 4 freed
    dev.run(pm, a, [50, 51, 52])
    assert pm.pages(a) == [0, 1, 3] and dev.tokens(pm, a) == [0, 1, 2, 3, 4, 5, 50, 51, 52]
    pm.check_invariants()
    # the regrown sequence's pages are cached under their real content
    pm.release(a)
    [b] = pm.claim(1)
    assert pm.match_prefix(b, [0, 1, 2, 3, 4, 5, 50, 51, 52]) == 8
    # page 1 now holds the new tail: the old history's second page is gone from the cache (page 2,
    # cached under it, is found no more and waits for eviction)
    [c] = pm.claim(1)
    assert pm.match_prefix(c, list(range(14))) == 4 and pm.pages(c) == [0]


def test_truncating_into_a_shared_page_gives_a_private_copy_and_leaves_the_others_untouched():
    pm, dev = make(batch=4, pages=12, max_len=24), Device(12)
    [a] = pm.claim(1)
    dev.run(pm, a, list(range(10)))  # pages 0, 1 full; page 2 holds 2
    kids = pm.fork(a, 2)
    for k, s in enumerate([a] + kids):
        dev.run(pm, s, [20 + k] * 2)  # each writes into its own copy of page 2 (the last writer keeps it)
    assert [pm.pages(s) for s in [a] + kids] == [[0, 1, 3], [0, 1, 4], [0, 1, 2]]
    # rewind child 1 to inside page 1, which all three share: it gets page 5, a copy of page 1
    pm.truncate(kids[0], 6)
    assert pm.pages(kids[0]) == [0, 5] and pm.clone().take_work().copies()[0][0].tolist() == [1]  # pending
    assert dev.tokens(pm, kids[0]) == [0, 1, 2, 3, 4, 5]
    dev.run(pm, kids[0], [90, 91, 92])
    assert dev.tokens(pm, kids[0]) == [0, 1, 2, 3, 4, 5, 90, 91, 92]
    assert dev.tokens(pm, a) == list(range(10)) + [20] * 2  # untouched
    assert dev.tokens(pm, kids[1]) == list(range(10)) + [22] * 2
    pm.check_invariants()
    # and the shared page 1 is still the prefix cache's
    [d] = pm.claim(1)
    assert pm.match_prefix(d, list(range(10))) == 8 and pm.pages(d) == [0, 1]


def test_truncating_into_a_prefix_page_only_it_holds_takes_it_out_of_the_cache():
    pm, dev = make(batch=4, pages=10, max_len=24), Device(10)
    [a] = pm.claim(1)
    dev.run(pm, a, list(range(9)))
    pm.truncate(a, 5)  # inside page 1, full and cached under a's content, held by a alone
    assert pm.pages(a) == [0, 1] and pm.cached_prefix_length(list(range(9))) == 4
    dev.run(pm, a, [7, 7, 7, 7])
    pm.release(a)
    [b] = pm.claim(1)
    assert pm.match_prefix(b, [0, 1, 2, 3, 4, 7, 7, 7, 9]) == 8 and pm.pages(b) == [0, 1]


def test_truncate_checks_its_input_and_changes_nothing_when_it_refuses():
    pm, dev = make(batch=2, pages=6, max_len=24), Device(6)
    [a] = pm.claim(1)
    dev.run(pm, a, list(range(10)))
    [b] = pm.fork(a, 1)
    dev.run(pm, b, [1] * 10)  # b: a private copy of page 2, then pages 4, 5 (6 pages in use)
    assert pm.metrics.free_pages == 0
    before = pm.state_dict()
    with pytest.raises(CacheFullError, match="needs 1 page"):
        pm.truncate(a, 6)  # page 1 is shared with b: a copy needs a free page, and none is left
    for bad, words in ((11, "length must be"), (-1, "length must be"), (2.0, "length must be"),
                       (True, "bool"), (2**80, "length must be")):
        with pytest.raises(ValueError, match=words):
            pm.truncate(a, bad)
    assert pm.state_dict() == before
    pm.truncate(a, 10)  # its own length: nothing dropped
    assert pm.state_dict() == before


def test_truncate_respects_windows_and_resumed_sequences():
    from easykv import LayerGroup
    from easykv.spec.metadata import PagedAttentionCacheMetaData

    meta = PagedAttentionCacheMetaData(batch_size=2, num_hidden_layers=1, num_pages_per_layer=10,
                                       num_pages_per_sequence=6, max_sequences=24, page_size=PS, num_kv_heads=2,
                                       kv_head_dim_size=8, hbm_utilization=0.9,
                                       layer_groups=(LayerGroup((0,), "sliding", 5, num_pages=10),))
    pm = PageManager(meta)
    [a] = pm.claim(1)
    prefill(pm, a, list(range(17)))  # window 5 at length 17: positions 13.. are read; pages 0..2 released
    assert pm.pages(a) == [-1, -1, -1, 3, 4]
    with pytest.raises(ValueError, match="window released those before position 12"):
        pm.truncate(a, 14)  # a query at 14 reads from position 10: page 2, released
    pm.truncate(a, 16)
    assert pm.pages(a) == [-1, -1, -1, 3] and pm.length(a) == 16
    [b] = pm.claim(1)
    pm.resume(b, 8)
    pm.commit(pm.schedule([b], [1]))  # length 9: its window still reaches back before 8
    with pytest.raises(ValueError, match="holds no tokens before position 8"):
        pm.truncate(b, 7)
    pm.truncate(b, 8)
    assert pm.length(b) == 8 and pm.pages(b) == [-1, -1]
    pm.check_invariants()


# ---- the machine --------------------------------------------------------------------------------------
# Host logic only: the result does not depend on the jax version, so CI runs it in one environment.
NUMPY_ONLY = pytest.mark.numpy_only
TestTruncateMachine = NUMPY_ONLY(TruncateMachine.TestCase)
TestGroupedTruncateMachine = NUMPY_ONLY(GroupedTruncateMachine.TestCase)


def test_a_truncation_copy_between_rows_holding_one_history_in_different_pages():
    """A page filled while another page already held its digest stays private; a later hit
    shares the cached one. Two rows then hold the same tokens in different pages before the page
    a truncation copies: still one history (found by the tiered truncation machine)."""
    pm, dev = make(batch=4, pages=12, max_len=24), Device(12)
    [a] = pm.claim(1)
    dev.run(pm, a, list(range(9)))
    pm.truncate(a, 1)  # page 1 (tokens 4..7) stays cached; page 0 leaves the cache
    pm.truncate(a, 0)
    [b, c] = pm.claim(2)
    dev.run(pm, b, list(range(13)))  # its tokens 4..7 go to a fresh page: the digest is page 1's already
    assert pm.match_prefix(c, list(range(13))) == 12
    dev.run(pm, c, [12])
    assert pm.pages(b)[:3] == [0, 2, 3] and pm.pages(c)[:3] == [0, 1, 3]
    pm.truncate(b, 9)  # inside page 3, which c shares: b gets a private copy of it
    pm.check_invariants()
    # The state restores (it was refused: the ids before b's unfinished page were not in it), and
    # the restored manager goes on exactly as this one.
    restored = PageManager.from_state_dict(pm.metadata, json.loads(json.dumps(pm.state_dict())))
    restored.check_invariants()
    dev.run(pm, b, [9, 10, 11])
    restored.commit(restored.schedule([b], [3]), [[9, 10, 11]])  # (its plan's copy: applied)
    for m in (pm, restored):
        m.truncate(c, 6)
    assert restored.state_dict() == pm.state_dict()
    dev.apply(pm.take_work())
    assert dev.tokens(pm, b) == list(range(12)) and dev.tokens(pm, c) == list(range(6))


def test_a_restored_manager_truncates_and_caches_as_one_never_restored():
    """The state keeps every committed id of a hashing sequence, so a truncation after a restore
    names the pages filled again as the never-restored manager does (the restored one stopped
    prefix caching: it knew only the ids of the unfinished page)."""
    pm = make(batch=4, pages=12, max_len=24)
    [a] = pm.claim(1)
    prefill(pm, a, list(range(9)))
    state = json.loads(json.dumps(pm.state_dict()))
    assert state["sequences"][0]["tokens"] == list(range(9))
    restored = PageManager.from_state_dict(pm.metadata, state)
    for m in (pm, restored):
        m.truncate(a, 5)
        m.commit(m.schedule([a], [4]), [[50, 51, 52, 53]])
    assert restored.state_dict() == pm.state_dict()
    assert restored.state_dict()["sequences"][0]["hashable"]
    [b] = restored.claim(1)
    assert restored.match_prefix(b, [0, 1, 2, 3, 4, 50, 51, 52, 53]) == 8  # the regrown page is cached


def test_a_state_without_token_ids_still_loads_knowing_the_unfinished_page():
    """States written before the token log: a hashing sequence knows the ids of its unfinished
    page only, and truncating before them stops its prefix caching (documented)."""
    pm = make(batch=4, pages=12, max_len=24)
    [a] = pm.claim(1)
    prefill(pm, a, list(range(9)))
    state = json.loads(json.dumps(pm.state_dict()))
    del state["sequences"][0]["tokens"]
    old = PageManager.from_state_dict(pm.metadata, state)
    assert old.state_dict() == state  # canonical: it writes no ids it does not know
    old.truncate(a, 8)  # the ids it keeps: still hashing
    assert old.state_dict()["sequences"][0]["hashable"]
    old.truncate(a, 5)
    assert not old.state_dict()["sequences"][0]["hashable"]


def test_a_crafted_truncation_copy_is_refused_by_field():
    """A legit state with a truncation copy pending loads; the same copy joined to another
    history (another salt, other tokens, another sequence's page) is refused. (A copy from a
    page every sequence let go of cannot be checked against anyone: like a fork's, it is taken
    on trust.)"""
    import json

    from easykv.errors import ManagerStateError

    pm, dev = make(batch=4, pages=12, max_len=24), Device(12)
    [a, c] = pm.claim(2)
    dev.run(pm, a, list(range(10)))  # pages 0, 1 full, page 2 holds [8, 9]
    dev.run(pm, c, [7] * 6)  # another history: pages 3, 4
    [b] = pm.fork(a, 1)
    pm.truncate(b, 9)  # b: page 5, a pending copy of page 2 (a's unfinished page)
    state = pm.state_dict()
    assert state["copies"] == [[2, 5]] and [q["pages"] for q in state["sequences"]] == [[0, 1, 2], [3, 4],
                                                                                       [0, 1, 5]]
    assert PageManager.from_state_dict(pm.metadata, state).state_dict() == state

    def crafted(edit):
        bad = json.loads(json.dumps(state))
        edit(bad)
        return bad

    for edit, words in (
        (lambda s: s["sequences"][2].update(salt=s["sequences"][2]["salt"][::-1]), "different salts"),
        (lambda s: s["sequences"][2].update(partial=[7], tokens=s["sequences"][2]["tokens"][:8] + [7]),
         "different tokens"),
        (lambda s: s["sequences"][2].update(tokens=[9] + s["sequences"][2]["tokens"][1:]), "different tokens"),
        (lambda s: s["sequences"][2].update(partial=[7]), "ending in its partial"),
        (lambda s: s.update(copies=[[4, 5]]), "different histories"),
    ):
        with pytest.raises(ManagerStateError, match=words):
            PageManager.from_state_dict(pm.metadata, crafted(edit))
