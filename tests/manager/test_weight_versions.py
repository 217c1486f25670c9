"""Weight versions and prefix-cache resets on tiny pools (page_size 4, ten pages): no prefix hit
ever crosses versions, running sequences finish under theirs, pages of other versions are
evicted first (exact page ids), a reset is safe with sequences running, the state keeps all of
it (and a crafted one is refused by field), and a hypothesis machine changes versions at random
moments while checking every hit against what was written under the lookup's version."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest

from easykv.errors import CacheFullError, ManagerStateError
from easykv.manager.manager import PageManager
from easykv.validation import show
from tests.support.machines import VersionMachine
from tests.support.managers import PS, cached_ids, make, make_meta, prefill

PROMPT = list(range(100, 109))  # 9 tokens: two full pages and one token


def test_a_new_version_never_hits_pages_of_another_and_evicts_them_first():
    pm = make(batch=4, pages=10, max_len=28)
    [a] = pm.claim(1)
    assert prefill(pm, a, PROMPT) == 0 and pm.pages(a) == [0, 1, 2]
    pm.release(a)
    assert cached_ids(pm) == [1, 0]  # tail page first; page 2 (partial) is free
    pm.set_weight_version("step-1")
    assert pm.weight_version == "step-1" and pm.cached_prefix_length(PROMPT) == 0
    [b] = pm.claim(1)
    assert prefill(pm, b, PROMPT) == 0 and pm.pages(b) == [2, 3, 4]  # the old pages are not shared
    pm.release(b)
    assert cached_ids(pm) == [1, 0, 3, 2]  # the unversioned pages go first
    assert pm.cached_prefix_length(PROMPT) == 8
    # a 7-page sequence takes the 6 free pages, then evicts page 1, never 3 or 2
    [c] = pm.claim(1)
    pm.schedule([c], [28])
    assert pm.pages(c) == [4, 5, 6, 7, 8, 9, 1]
    assert cached_ids(pm) == [0, 3, 2] and pm.cached_prefix_length(PROMPT) == 8
    pm.check_invariants()
    (unversioned, step1) = pm.metrics.versions
    assert (unversioned.version, unversioned.current, unversioned.cached_pages, unversioned.prefix_queries) == (
        None, False, 1, 1)
    assert (step1.version, step1.current, step1.cached_pages, step1.live_pages) == ("step-1", True, 2, 7)
    assert (step1.prefix_queries, step1.prefix_hits) == (1, 0)  # b's lookup (c made none)


def test_running_sequences_finish_under_their_version_and_setting_an_old_one_finds_its_pages():
    pm = make(batch=4, pages=10, max_len=24)
    pm.set_weight_version(1)
    [a] = pm.claim(1)
    prefill(pm, a, PROMPT)
    pm.set_weight_version(2)
    [idle] = pm.claim(1)  # claimed under 2
    # a keeps decoding under version 1: the page it completes is cached as version 1
    for t in range(3):
        pm.commit(pm.schedule([a], [1]), [t])
    assert pm.length(a) == 12
    by_version = {m.version: m for m in pm.metrics.versions}
    assert by_version[1].live_pages == 3 and by_version[2].live_pages == 0
    [b] = pm.claim(1)
    assert pm.match_prefix(b, PROMPT + [0, 1, 2, 3]) == 0
    pm.release(b)
    pm.release(a)
    assert cached_ids(pm) == [2, 1, 0]
    assert {m.version: m.cached_pages for m in pm.metrics.versions} == {1: 3, 2: 0}
    pm.set_weight_version(1)  # the caller says the weights are version 1's again
    [c] = pm.claim(1)
    assert pm.match_prefix(c, PROMPT + [0, 1, 2, 3]) == 12 and pm.pages(c) == [0, 1, 2]
    # the sequence claimed under 2 before anything was written runs under 1 now
    assert prefill(pm, idle, [7] * 5) == 0
    pm.release(idle)
    [d] = pm.claim(1)
    assert pm.match_prefix(d, [7] * 5) == 4
    pm.check_invariants()


def test_int_str_and_bytes_versions_are_three_versions_and_bad_ones_change_nothing():
    pm = make()
    [a] = pm.claim(1)
    prefill(pm, a, PROMPT)
    pm.release(a)
    before = pm.state_dict()
    for bad, words in ((True, "is a bool"), (2**64, "must lie in -2"), (1.5, "of type float"),
                       ([1], "of type list"), (object(), "of type object")):
        with pytest.raises(ValueError, match=words):
            pm.set_weight_version(bad)
        assert pm.state_dict() == before and pm.weight_version is None
    hits = {}
    for version in (1, "1", b"1"):
        pm.set_weight_version(version)
        [s] = pm.claim(1)
        hits[repr(version)] = prefill(pm, s, PROMPT)
        pm.release(s)
    assert hits == {"1": 0, "'1'": 0, "b'1'": 0}
    pm.set_weight_version("1")
    assert pm.cached_prefix_length(PROMPT) == 8


@pytest.mark.parametrize("bad", [-(2**63) - 1, 2**64, 2**200, -(2**200)])
def test_an_int_version_or_salt_past_64_bits_is_refused_naming_the_range(bad):
    """Issue 42 attack: ``set_weight_version(-2**63 - 1)`` said "an int version must fit 64 bits,
    got one of 64 bits" (a negative int of 64 bits does not fit; the message contradicted itself).
    The refusal states the range and the value, for a version and a salt alike."""
    pm = make()
    [a] = pm.claim(1)
    before = pm.state_dict()
    shown = re.escape(show(bad))  # a long int is shortened
    for name, call in (("version", lambda: pm.set_weight_version(bad)),
                       ("salt", lambda: pm.match_prefix(a, [1, 2, 3], salt=bad))):
        with pytest.raises(ValueError, match=rf"an int {name} must lie in -2\*\*63 \.\. 2\*\*64 - 1 \(64 bits, signed "
                                             rf"or unsigned\), got {shown}; use a str or bytes"):
            call()
        assert pm.state_dict() == before and pm.weight_version is None
    for edge in (-(2**63), 2**64 - 1, np.int64(-(2**63)), np.uint64(2**64 - 1)):  # both ends are versions
        pm.set_weight_version(edge)
        assert pm.weight_version == edge


def test_setting_the_current_version_again_changes_nothing():
    pm = make()
    pm.set_weight_version("v")
    state = pm.state_dict()
    pm.set_weight_version("v")
    assert pm.state_dict() == state


def test_reset_prefix_cache_is_safe_with_sequences_running():
    pm = make(batch=4, pages=10, max_len=24, scrub_released=True)

    def run(seq, tokens, done=0):
        plan = pm.schedule([seq], [len(tokens) - done])  # the engine zeroes its work's scrubs before the writes
        pm.commit(plan, [list(tokens[done:])])

    [a, b] = pm.claim(2)
    run(a, PROMPT)
    pm.release(a)  # pages 0 and 1 cached, page 2 freed
    done = pm.match_prefix(b, PROMPT)
    assert done == 8
    run(b, PROMPT, done)
    assert pm.pages(b) == [0, 1, 2]
    [c] = pm.claim(1)
    run(c, [5] * 9)
    pm.release(c)  # pages 4 and 3 cached, 5 freed
    assert cached_ids(pm) == [4, 3] and pm.take_work().scrubs()[0].tolist() == [5]
    assert pm.reset_prefix_cache() == 4  # 0, 1 (b holds them) and 3, 4 (cached)
    assert cached_ids(pm) == [] and pm.cached_prefix_length(PROMPT) == 0
    assert pm.take_work().scrubs()[0].tolist() == [4, 3]  # freed now: zeroed before reuse
    assert pm.pages(b) == [0, 1, 2]  # b keeps its pages and goes on
    for t in range(3):
        run(b, [t])
    pm.release(b)  # a page it fills after the reset is cached again
    assert cached_ids(pm) == [2] and pm.metrics.cached_pages == 1
    [d] = pm.claim(1)
    assert pm.match_prefix(d, PROMPT + [0, 1, 2, 3]) == 0  # the chain's first pages were forgotten
    pm.check_invariants()


def test_the_state_keeps_versions_and_a_manager_that_never_set_one_keeps_its_form():
    plain = make()
    [a] = plain.claim(1)
    prefill(plain, a, PROMPT)
    assert "versions" not in plain.state_dict() and "version" not in plain.state_dict()["sequences"][0]
    pm = make(batch=4, pages=10, max_len=24)
    [a] = pm.claim(1)
    prefill(pm, a, PROMPT)
    pm.set_weight_version(b"\x01w")
    [b] = pm.claim(1)
    prefill(pm, b, [3] * 6)
    pm.release(a)
    state = pm.state_dict()
    assert state["versions"]["current"] is not None
    assert [k["version"] for k in state["versions"]["known"]] == [None, {"bytes": "0177"}]
    assert state["pool"]["versions"] and "version" in state["sequences"][0]
    back = PageManager.from_state_dict(make_meta(batch=4, pages=10, max_len=24), state)
    assert back.state_dict() == state and back.weight_version == b"\x01w"
    assert back.metrics.versions == pm.metrics.versions
    assert cached_ids(back) == cached_ids(pm)
    [c] = back.claim(1)
    assert back.match_prefix(c, [3] * 6) == 4 and back.cached_prefix_length(PROMPT) == 0


def _crafted(state, edit):
    out = copy.deepcopy(state)
    edit(out)
    return out


def test_a_crafted_version_state_is_refused_by_field():
    pm = make(batch=4, pages=10, max_len=24)
    pm.set_weight_version("a")
    [a] = pm.claim(1)
    prefill(pm, a, PROMPT)
    pm.set_weight_version("b")
    [b] = pm.claim(1)
    prefill(pm, b, [1, 2])  # no full page yet: its chain is the root of version "b"
    state = pm.state_dict()
    meta = make_meta(batch=4, pages=10, max_len=24)
    other = PageManager(meta)
    other.set_weight_version("z")
    z_hex = other.state_dict()["versions"]["current"]
    cases = [
        (lambda s: s["versions"]["known"][1].update(version={"str": "not-a"}), "versions.known[1]", "does not hash"),
        (lambda s: s["versions"].update(current=z_hex), "versions.current", "does not list"),
        (lambda s: s["sequences"][0].update(version=z_hex), "sequences[0].version", "does not list"),
        (lambda s: s["sequences"][1].update(version=s["sequences"][0]["version"]), "sequences[id=1].chain",
         "root of its weight version"),
        (lambda s: s["sequences"][0].update(version=s["versions"]["current"]), "pool.versions",
         "prefix page 0 was written under another weight version than sequence 0"),
        (lambda s: s["pool"].update(versions=[[0, s["versions"]["current"]], [1, s["versions"]["current"]]]),
         "pool.versions", "another weight version"),
        (lambda s: s["pool"].update(versions=[[1, s["pool"]["versions"][0][1]], [0, s["pool"]["versions"][0][1]]]),
         "pool.versions", "in page order"),
        (lambda s: s["pool"].update(versions=[]), "pool.versions", "is empty"),
        (lambda s: s.update(versions={"current": None, "known": [s["versions"]["known"][0]]}), "versions.known",
         "never set one"),
        (lambda s: s["versions"]["known"][1].update(version={"float": 1.0}), "versions.known[1].version", "must be"),
        (lambda s: s["versions"]["known"].append(s["versions"]["known"][1]), "versions.known[3]", "twice"),
        (lambda s: s.update(extra=1), "(top level)", r"may have \['versions'\]"),
    ]
    for edit, field, words in cases:
        with pytest.raises(ManagerStateError, match=words) as err:
            PageManager.from_state_dict(meta, _crafted(state, edit))
        assert err.value.field == field, (field, str(err.value))
    # a version's page carrying no digest is damage too
    with pytest.raises(ManagerStateError, match="weight version but is not in the prefix cache"):
        PageManager.from_state_dict(meta, _crafted(state, lambda s: s["pool"].update(
            versions=s["pool"]["versions"] + [[9, s["versions"]["current"]]])))


def test_resharding_keeps_stale_pages_ahead():
    meta2 = make_meta(batch=4, pages=20, max_len=16, shards=2)
    pm = PageManager(meta2)
    [a, b] = pm.claim(2)
    prefill(pm, a, PROMPT)
    prefill(pm, b, [9] * 9)
    assert {pm.sequence(a).replica, pm.sequence(b).replica} == {0, 1}
    pm.release(a)
    pm.set_weight_version(7)
    [c] = pm.claim(1)
    prefill(pm, c, [4] * 9)
    pm.release(c)
    pm.release(b)
    one = pm.clone(make_meta(batch=4, pages=20, max_len=16, shards=1))
    pool = one.state_dict()["pool"]
    order = pool["lru"][0]  # the cached pages in eviction order, and each one's weight version
    tags = [{page: bytes.fromhex(tag) for page, tag in pool.get("versions", [])}.get(p) for p in order]
    assert tags.count(None) == 4 and tags[:4] == [None] * 4  # the unversioned pages of a and b go first
    one.check_invariants()
    [d] = one.claim(1)
    assert one.match_prefix(d, [4] * 9) == 8 and one.cached_prefix_length(PROMPT) == 0


def test_a_grouped_windowed_manager_keeps_versions_apart():
    from easykv import LayerGroup
    from easykv.spec.metadata import PagedAttentionCacheMetaData

    groups = (LayerGroup((0,), "sliding", 6, num_pages=10), LayerGroup((1,), num_pages=10))
    meta = PagedAttentionCacheMetaData(batch_size=4, num_hidden_layers=2, num_pages_per_layer=10,
                                       num_pages_per_sequence=4, max_sequences=16, page_size=PS, num_kv_heads=2,
                                       kv_head_dim_size=8, hbm_utilization=0.9, layer_groups=groups)
    pm = PageManager(meta)
    [a] = pm.claim(1)
    prefill(pm, a, list(range(13)))
    pm.release(a)
    assert pm.cached_prefix_length(list(range(13))) == 12
    pm.set_weight_version("new")
    assert pm.cached_prefix_length(list(range(13))) == 0
    [b] = pm.claim(1)
    assert prefill(pm, b, list(range(13))) == 0
    pm.release(b)
    assert pm.cached_prefix_length(list(range(13))) == 12
    state = pm.state_dict()
    assert len(state["pool"]) == 2 and all("versions" in p for p in state["pool"])
    assert PageManager.from_state_dict(meta, state).state_dict() == state


# ---- a state machine: versions change at random moments ------------------------------------------------
# Host logic only: the result does not depend on the jax version, so CI runs it in one environment.
NUMPY_ONLY = pytest.mark.numpy_only
TestVersionMachine = NUMPY_ONLY(VersionMachine.TestCase)


# ---- group sampling: fork(seq, n) ---------------------------------------------------------------------
def test_fork_n_gives_n_children_sharing_pages_with_copy_on_write_of_the_partial_page():
    pm = make(batch=6, pages=12, max_len=16)
    [p] = pm.claim(1)
    prefill(pm, p, PROMPT)  # pages 0, 1 full, page 2 holds one token
    kids = pm.fork(p, 4)
    assert kids == [1, 2, 3, 4] and all(pm.pages(k) == [0, 1, 2] and pm.length(k) == 9 for k in kids)
    holders = [pm.pages(s) for s in [p, *kids]]
    assert [sum(page in pages for pages in holders) for page in (0, 1, 2)] == [5, 5, 5]
    pm.check_invariants()  # each page's reference count is its holders
    # each sample writes its own token: every writer but the last gets a private copy of page 2
    plan = pm.schedule([p] + kids, [1] * 5)
    (src,), (dst,) = plan.work.copies()
    assert src.tolist() == [2, 2, 2, 2] and dst.tolist() == [3, 4, 5, 6]
    assert [pm.pages(s)[2] for s in [p] + kids] == [3, 4, 5, 6, 2]
    pm.commit(plan, [10, 11, 12, 13, 14])
    pm.check_invariants()
    for s in kids:
        pm.release(s)
    pm.release(p)
    assert pm.metrics.used_pages == 0


def test_fork_n_is_all_or_nothing_and_checks_n():
    pm = make(batch=4, pages=10)
    [p] = pm.claim(1)
    prefill(pm, p, PROMPT)
    before = pm.state_dict()
    with pytest.raises(CacheFullError, match=r"fork\(0, n=4\) needs 4 free sequence slots but 3") as err:
        pm.fork(p, 4)
    assert (err.value.needed, err.value.available) == (4, 3)
    for bad, words in ((0, "n must be"), (-1, "n must be"), (True, "bool"), (2**70, "n must be"), (1.0, "n must be")):
        with pytest.raises(ValueError, match=words):
            pm.fork(p, bad)
    assert pm.state_dict() == before
    assert pm.fork(p, 1) == [1] and pm.fork(p) == 2
