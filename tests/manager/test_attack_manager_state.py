"""Loaded PageManager states are input: every field broken in every way is refused precisely.

Two corpora against `PageManager.from_state_dict` (what a checkpoint's manager.json goes
through): a mechanical one that breaks each field of a busy state in each way (type, range,
size, missing and unknown keys), and a hand-written one of states whose fields are each fine
but whose cross-references would let one sequence touch another's pages. Each must raise
`ManagerStateError` naming the field, or (where the change is itself a valid state) load into a
manager that passes `check_invariants` and writes back exactly what was loaded. The input is
never modified.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from easykv.errors import ManagerStateError
from easykv.manager.manager import PageManager
from easykv.manager.state import STATE_FORMAT
from easykv.spec.metadata import PagedAttentionCacheMetaData

PS = 4


def make_meta(shards=1):
    return PagedAttentionCacheMetaData(
        batch_size=6, num_hidden_layers=1, num_pages_per_layer=16, num_pages_per_sequence=4, max_sequences=16,
        page_size=PS, num_kv_heads=1, kv_head_dim_size=8, hbm_utilization=0.9, page_shards=shards)


def busy(shards=1):
    """A manager with every kind of state: prefix pages shared and cached, a fork with a pending
    copy-on-write copy, pending scrubs, a row that stopped hashing, salts, counters."""
    pm = PageManager(make_meta(shards), scrub_released=True)
    a, b, c, f = pm.claim(4)
    for seq, prompt, salt in ((a, list(range(10, 20)), None), (b, list(range(10, 18)) + [1, 2, 3], None),
                              (c, [5] * 6, "tenant"), (f, [7] * 9, None)):
        done = pm.match_prefix(seq, prompt, salt=salt)
        pm.commit(pm.schedule([seq], [len(prompt) - done]), [prompt[done:]])
    pm.commit(pm.schedule([c], [3]))  # c stops hashing: its ids are unknown
    d = pm.fork(a)
    pm.truncate(d, 9)  # d will write again into the page it shares with a: a copy-on-write copy is pending
    pm.release(b)  # its private tail page is freed (scrub pending); its full pages stay with a
    pm.release(f)  # its two full pages stay cached (LRU), its tail page is freed
    [e] = pm.claim(1)
    pm.match_prefix(e, list(range(10, 20)))  # a prefix hit on a's pages
    work = pm.clone().take_work()  # the pending work, read on a copy
    assert work.num_copies and work.scrubs()[0].size and pm.metrics.cached_pages
    pm.check_invariants()
    return pm


BUSY = {1: busy(1).state_dict(), 2: busy(2).state_dict()}


def load(state, shards=1):
    return PageManager.from_state_dict(make_meta(shards), state)


def canonical_equal(loaded: dict, given: dict) -> bool:
    """A loaded state writes back what was given, except the chain and partial tokens of rows
    that stopped hashing, which are never read again and written as neutral values."""
    given = copy.deepcopy(given)
    for seq, mine in zip(given["sequences"], loaded["sequences"]):
        if seq.get("hashable") is False:
            seq["chain"], seq["partial"] = mine["chain"], mine["partial"]
    given["sequences"] = sorted(given["sequences"], key=lambda s: s["id"])
    return json.dumps(loaded, sort_keys=True) == json.dumps(given, sort_keys=True)


# ---- the mechanical corpus: each field broken each way ----------------------------------------------
def _paths(node, path=()):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


def _bad_values(value):
    if isinstance(value, bool):
        return [1, 0, "true", None, not value]
    if isinstance(value, int):
        return [-1, -(2**63), 2**31, 2**64 - 5, 2**200, True, float(value), str(value), None, [value], value + 1]
    if isinstance(value, str):
        return ["", "zz" * 32, value[:-2], value + "00", 5, None, value.upper() if value != value.upper() else "x"]
    if isinstance(value, list):
        out = [None, {}, "[]", [[[[[[]]]]]]]
        if value:
            out += [value[:-1], value + value[:1], [value]]
        return out
    if isinstance(value, dict):
        return [None, [], {}]
    return [None]


def _set(state, path, value):
    node = state
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _mutations(state):
    for path, value in _paths(state):
        if not path:
            continue
        for bad in _bad_values(value):
            mutated = copy.deepcopy(state)
            _set(mutated, path, bad)
            yield f"{'.'.join(map(str, path))}={bad!r:.30}", mutated
        parent = state
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict):
            mutated = copy.deepcopy(state)
            node = mutated
            for key in path[:-1]:
                node = node[key]
            del node[path[-1]]
            yield f"del {'.'.join(map(str, path))}", mutated
            mutated = copy.deepcopy(state)
            node = mutated
            for key in path[:-1]:
                node = node[key]
            node["unknown_field"] = 1
            yield f"extra key beside {'.'.join(map(str, path))}", mutated


@pytest.mark.parametrize("shards", [1, 2])
def test_every_field_broken_every_way_is_refused_or_loaded_exactly(shards):
    state = BUSY[shards]
    refused = accepted = 0
    for what, mutated in _mutations(state):
        frozen = copy.deepcopy(mutated)
        try:
            pm = load(mutated, shards)
        except ManagerStateError as err:
            refused += 1
            assert err.field and err.field in str(err), what
        else:
            accepted += 1
            pm.check_invariants()
            assert canonical_equal(pm.state_dict(), mutated), what
        assert mutated == frozen, f"from_state_dict changed its input ({what})"
    assert refused > 10 * accepted  # almost every break is refused; the rest are valid states
    assert refused > 1000


def test_a_state_that_is_not_a_dict_or_not_ours():
    for bad in (None, [], "state", 5, {"format": STATE_FORMAT}, {**BUSY[1], "format": "easykv.PageManager/9"}):
        with pytest.raises(ManagerStateError):
            load(bad)


def test_huge_and_deep_values_raise_precisely_not_overflow_or_recursion():
    state = copy.deepcopy(BUSY[1])
    state["sequences"][0]["pages"][0] = 2**70
    with pytest.raises(ManagerStateError, match=r"sequences\[0\]\.pages"):
        load(state)
    state = copy.deepcopy(BUSY[1])
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    state["pool"]["free"][0] = deep
    with pytest.raises(ManagerStateError, match=r"pool\.free\[0\]"):
        load(state)


# ---- the hand-written corpus: fields that are each fine, together a breach ---------------------------
def _seq(state, sid):
    return next(s for s in state["sequences"] if s["id"] == sid)


def _live_page(state, sid=0):
    return _seq(state, sid)["pages"][0]


def _cases():
    def scrub_live(s):  # zero a page sequence 0 wrote: its K/V destroyed at the next step
        s["pool"]["scrub"].append(_live_page(s))

    def copy_onto_full(s):  # a pending copy whose destination is a full page another sequence reads
        s["copies"].append([_seq(s, 2)["pages"][0], _live_page(s)])

    def copy_onto_other_partial(s):  # the destination is sequence 2's unfinished page
        s["copies"][0][1] = _seq(s, 2)["pages"][-1]

    def copy_onto_itself(s):
        src, dst = s["copies"][0]
        s["copies"][0] = [dst, dst]

    def float_length(s):
        _seq(s, 0)["length"] = 10.0

    def negative_partial(s):
        _seq(s, 0)["partial"] = [-3, 1]

    def short_salt(s):
        _seq(s, 0)["salt"] = _seq(s, 0)["salt"][:-2]

    def duplicate_sequence(s):
        s["sequences"].append(copy.deepcopy(s["sequences"][0]))

    def negative_counter(s):
        s["counters"]["prefix_hits"] = -1

    def page_twice_in_a_row(s):
        seq = _seq(s, 0)
        seq["pages"][1] = seq["pages"][0]

    def page_owned_and_free(s):
        s["pool"]["free"][0].append(_live_page(s))

    def cached_page_without_digest(s):
        page = s["pool"]["lru"][0][0]
        s["pool"]["digests"] = [d for d in s["pool"]["digests"] if d[0] != page]

    def digest_twice_in_a_replica(s):
        (p0, d0), (p1, _) = s["pool"]["digests"][:2]
        s["pool"]["digests"][1] = [p1, d0]

    def digest_on_an_unfilled_page(s):
        seq = _seq(s, 0)
        s["pool"]["digests"].append([seq["pages"][-1], "ab" * 32])

    def wrong_chain(s):
        _seq(s, 0)["chain"] = "cd" * 32

    def unbound_replica(s):
        _seq(s, 0)["replica"] = -1

    def bound_without_pages(s):
        _seq(s, 1)["replica"] = 0
        _seq(s, 1)["pages"], _seq(s, 1)["length"], _seq(s, 1)["partial"] = [], 0, []
        _seq(s, 1).pop("tokens", None)

    def length_past_pages(s):
        _seq(s, 0)["length"] = 16
        _seq(s, 0)["partial"] = []

    def shared_with_other_salt(s):
        _seq(s, 1)["salt"] = _seq(s, 2)["salt"]

    def more_sequences_than_slots(s):
        s["sequences"] = s["sequences"] * 3

    def lru_page_in_use(s):
        s["pool"]["lru"][0].append(_live_page(s))

    def caching_off_with_digests(s):
        s["config"]["enable_prefix_caching"] = False

    def scrubs_without_scrubbing(s):
        s["config"]["scrub_released"] = False

    def wrong_pool(s):
        s["config"]["num_pages_per_layer"] = 32

    return {
        "scrub of a live page": (scrub_live, r"pool\.scrub"),
        "copy onto another sequence's full page": (copy_onto_full, r"copies"),
        "copy onto another sequence's unfinished page": (copy_onto_other_partial, r"copies"),
        "copy of a page onto itself": (copy_onto_itself, r"copies"),
        "float length": (float_length, r"sequences\[0\]\.length"),
        "negative partial token": (negative_partial, r"sequences\[0\]\.partial"),
        "short salt": (short_salt, r"sequences\[0\]\.salt"),
        "duplicate sequence entry": (duplicate_sequence, r"sequences"),
        "negative counter": (negative_counter, r"counters\.prefix_hits"),
        "a page twice in one sequence": (page_twice_in_a_row, r"sequences\[0\]\.pages"),
        "a page owned and free": (page_owned_and_free, r"pool"),
        "a cached page without digest": (cached_page_without_digest, r"pool"),
        "one digest on two pages of a replica": (digest_twice_in_a_replica, r"pool"),
        "a digest on a page not filled": (digest_on_an_unfilled_page, r"pool\.digests"),
        "a chain that is not the last page's digest": (wrong_chain, r"chain"),
        "pages without a replica": (unbound_replica, r"replica"),
        "a replica without pages": (bound_without_pages, r"replica"),
        "more tokens than pages": (length_past_pages, r"sequences\[0\]\.pages"),
        "a page shared across salts": (shared_with_other_salt, r"salt"),
        "more sequences than slots": (more_sequences_than_slots, r"sequences"),
        "a cached page in use": (lru_page_in_use, r"pool"),
        "digests with prefix caching off": (caching_off_with_digests, r"config|pool|tokens"),
        "scrubs with scrubbing off": (scrubs_without_scrubbing, r"config|pool"),
        "another pool": (wrong_pool, r"config"),
    }


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_crafted_cross_references_are_refused_naming_the_field(name):
    mutate, field = CASES[name]
    state = copy.deepcopy(BUSY[1])
    mutate(state)
    frozen = copy.deepcopy(state)
    with pytest.raises(ManagerStateError) as err:
        load(state)
    assert __import__("re").search(field, err.value.field), (name, err.value.field, str(err.value))
    assert state == frozen


def test_scrubs_with_scrubbing_off_are_refused():
    state = copy.deepcopy(BUSY[1])
    state["config"]["scrub_released"] = False
    with pytest.raises(ManagerStateError):
        PageManager.from_state_dict(make_meta(), state)


def test_the_rules_hold_for_live_managers_too():
    """The checker is shared: a live manager broken the same way is reported as an easykv bug."""
    pm = busy()
    page = pm.pages(0)[0]
    pm._groups[0].pool._scrub[page] = None  # broken on purpose, below the public calls (which cannot)
    with pytest.raises(AssertionError, match=r"easykv bug.*page .* is to be zeroed but holds written tokens"):
        pm.check_invariants()


def test_commits_into_pages_with_pending_work_are_refused():
    pm = busy()
    d = 4  # the fork: its unfinished page waits for a copy
    assert pm.state_dict()["copies"]
    before = pm.state_dict()
    with pytest.raises(ValueError, match="copy-on-write copy is still pending.*apply_pending"):
        pm.step([d], [[9]])
    assert pm.state_dict() == before
    assert pm.take_work().num_copies == 1
    pm.step([d], [[9]])
    pm.check_invariants()


def test_resharding_a_state_checks_it_again():
    pm = busy(2)
    with pytest.raises(ValueError, match=r"straddle|replicas|must stay in one replica"):
        pm.clone(make_meta(1).replace(page_shards=4, num_pages_per_layer=16))
    one = pm.clone(make_meta(1))
    one.check_invariants()
    assert np.array_equal(one.page_table(one.active_ids), pm.page_table(pm.active_ids))


def test_a_small_metadata_cannot_make_the_manager_allocate_gigabytes():
    huge = PagedAttentionCacheMetaData(
        batch_size=10**8, num_hidden_layers=1, num_pages_per_layer=16, num_pages_per_sequence=4, max_sequences=16,
        page_size=4, num_kv_heads=1, kv_head_dim_size=8, hbm_utilization=0.9)
    with pytest.raises(ValueError, match="block table of 400000000 entries"):
        PageManager(huge)
