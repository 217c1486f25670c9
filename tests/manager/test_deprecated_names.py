"""`PageManager`'s names of the release before the step plan (issue 43), kept for one release:
each warns ("PageManager.X is deprecated; use ...", naming its replacement) and does what its
replacement does, checked against that replacement on a copy of the manager. Also what only
these names offer and the tests of the plan API no longer reach: the ``pad_to`` of the pending
work, ``build_decode_metadata(stacked=True)``, ``first_kept_position``'s group argument.

Everything else in the suite uses the new names; pyproject.toml makes any other use of these
an error."""

from __future__ import annotations

import numpy as np
import pytest

from easykv import LayerGroup, PagedAttentionCacheMetaData, PageManager
from tests.support.deprecation import DEPRECATED
from tests.support.managers import make, make_meta, prefill


def deprecated(name, replacement=""):
    """Expect the warning of ``PageManager.name``, naming ``replacement``."""
    return pytest.warns(DeprecationWarning, match=rf"PageManager\.{name} is deprecated; use {replacement}")


def forked():
    """a: 6 tokens (page 0 full, page 1 partial), b: its fork, sharing both pages."""
    pm = make(scrub_released=True)
    [a] = pm.claim(1)
    prefill(pm, a, [1, 2, 3, 4, 5, 6])
    return pm, a, pm.fork(a)


def same_arrays(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def same_metadata(got, want):
    """Two per-group tuples of step metadata, field by field."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for name in ("slot_mapping", "positions", "query_start_loc", "context_lens", "page_table", "num_seqs"):
            np.testing.assert_array_equal(np.asarray(getattr(g, name)), np.asarray(getattr(w, name)), err_msg=name)


def test_the_deprecated_names_are_the_ones_this_file_covers():
    assert DEPRECATED == {
        "reserve", "build_step_metadata", "build_decode_metadata", "append_tokens", "advance", "plan_decode",
        "commit_decode", "capacity", "replica", "first_kept_position", "is_swapped", "lockstep_state", "reshard",
        "pending_copies", "pending_scrubs", "pending_transfers", "take_copies", "take_scrubs", "take_transfers",
        "has_pending_transfers"}


# ---- a step without a plan -----------------------------------------------------------------------------
def test_reserve_and_build_step_metadata_reserve_what_schedule_reserves():
    pm, a, b = forked()
    twin = pm.clone()
    with deprecated("reserve", r"schedule\(seq_ids, num_new_tokens\)"):
        pm.reserve(b, 3)
    plan = twin.schedule([b], [3])
    assert pm.pages(b) == twin.pages(b) == [0, 2, 3] and pm.state_dict()["sequences"] == twin.state_dict()["sequences"]
    # the copy-on-write stays pending in the manager (no plan took it)
    same_arrays(pm.clone().take_work().copies(), plan.work.copies())
    pm, a, b = forked()
    twin = pm.clone()
    with deprecated("build_step_metadata", r"schedule\(seq_ids, num_new_tokens, \.\.\.\): a plan"):
        got = pm.build_step_metadata([a, b], [2, 1], pad_tokens_to=4, pad_seqs_to=3)
    same_metadata(got, twin.schedule([a, b], [2, 1], pad_tokens_to=4, pad_seqs_to=3).metadata)
    assert pm.state_dict()["sequences"] == twin.state_dict()["sequences"]


def test_append_tokens_and_advance_commit_what_commit_commits():
    pm, a, b = forked()
    twin = pm.clone()
    with deprecated("reserve"):
        pm.reserve(a, 5)
    pm.take_work()  # the copy of the page a shares with b (the device applies it)
    with deprecated("append_tokens", r"commit\(plan, \[token_ids\]\)"):
        pm.append_tokens(a, [7, 8])
    with deprecated("advance", r"commit\(plan\) without token_ids"):
        pm.advance(a, 3)
    twin.commit(twin.schedule([a], [2]), [[7, 8]])
    twin.commit(twin.schedule([a], [3]))
    assert pm.length(a) == twin.length(a) == 11 and pm.pages(a) == twin.pages(a)
    assert pm.state_dict()["sequences"] == twin.state_dict()["sequences"]
    pm.check_invariants()


def test_build_decode_metadata_gives_every_step_of_the_decode_plan_listed_or_stacked():
    pm, a, b = forked()
    twin, stacked_twin = pm.clone(), pm.clone()
    with deprecated("build_decode_metadata", r"schedule_decode\(seq_ids, num_steps\)"):
        steps = pm.build_decode_metadata([a, b], num_steps=3, pad_seqs_to=3)
    plan = twin.schedule_decode([a, b], 3, pad_seqs_to=3)
    want = [plan.metadata]
    for _ in range(2):
        want.append(plan.next_metadata(want[-1]))
    assert len(steps) == 3
    for got, expected in zip(steps, want, strict=True):
        same_metadata(got, expected)
    with deprecated("build_decode_metadata"):
        (stacked,) = stacked_twin.build_decode_metadata([a, b], num_steps=2, stacked=True)
    assert stacked.slot_mapping.shape == (2, 2) and stacked.page_table.shape == (2, 2, 4)
    for j in range(2):
        np.testing.assert_array_equal(stacked.slot_mapping[j], want[j][0].slot_mapping[:2])


def test_plan_decode_and_commit_decode_are_schedule_decode_and_commit_or_abort():
    pm, a, b = forked()
    with deprecated("plan_decode", "schedule_decode"):
        plan = pm.plan_decode([a], 2)
    with deprecated("commit_decode", r"commit\(plan, token_ids, num_tokens\), or abort\(plan\)"):
        pm.commit_decode(plan, [[7, 8]], [1])
    assert plan.ended == "committed" and pm.length(a) == 7
    plan = pm.schedule_decode([a], 2)
    with deprecated("commit_decode"):
        pm.commit_decode(plan, [[0, 0]], 0)  # one count of 0 for all: the abort
    assert plan.ended == "aborted" and pm.length(a) == 7


# ---- one sequence's numbers ---------------------------------------------------------------------------
def test_the_per_sequence_numbers_are_the_fields_of_sequence():
    pm = PageManager(make_meta(pages=10, shards=2).replace(host_pages_per_layer=8))
    a, b = pm.claim(2)
    prefill(pm, a, [1, 2, 3, 4, 5, 6])
    pm.swap_out(a)
    for seq in (a, b):
        info = pm.sequence(seq)
        with deprecated("capacity", r"sequence\(seq_id\)\.capacity"):
            assert pm.capacity(seq) == info.capacity
        with deprecated("replica", r"sequence\(seq_id\)\.replica"):
            assert pm.replica(seq) == info.replica
        with deprecated("is_swapped", r"sequence\(seq_id\)\.swapped"):
            assert pm.is_swapped(seq) is info.swapped
        with deprecated("first_kept_position", r"sequence\(seq_id\)\.first_kept\[group\]"):
            assert pm.first_kept_position(seq) == info.first_kept[0]
    assert pm.sequence(a).swapped and not pm.sequence(b).swapped and pm.sequence(b).replica is None


def test_first_kept_position_needs_the_group_where_there_are_several():
    groups = (LayerGroup((0,), "full", num_pages=10), LayerGroup((1,), "sliding", 5, num_pages=6))
    pm = PageManager(PagedAttentionCacheMetaData(
        batch_size=3, num_hidden_layers=2, num_pages_per_layer=10, num_pages_per_sequence=8, max_sequences=32,
        page_size=4, num_kv_heads=2, kv_head_dim_size=8, hbm_utilization=0.9, layer_groups=groups))
    [s] = pm.claim(1)
    pm.commit(pm.schedule([s], [9]), [list(range(9))])
    with deprecated("first_kept_position"), pytest.raises(ValueError, match=r"2 layer groups, each with its own "
                                                                             r"pages; pass group=0..1"):
        pm.first_kept_position(s)
    with deprecated("first_kept_position"):
        assert [pm.first_kept_position(s, group=g) for g in (0, 1)] == list(pm.sequence(s).first_kept) == [0, 5]


def test_lockstep_state_and_reshard_are_state_dict_and_clone():
    pm = PageManager(make_meta(pages=10, shards=2))
    [a] = pm.claim(1)
    prefill(pm, a, [1, 2, 3, 4, 5, 6])
    with deprecated("lockstep_state", r"state_dict\(host_tier=True\)"):
        assert pm.lockstep_state() == pm.state_dict(host_tier=True)
    with deprecated("reshard", r"clone\(metadata\)"):
        one = pm.reshard(make_meta(pages=10, shards=1))
    assert one.state_dict() == pm.clone(make_meta(pages=10, shards=1)).state_dict()


# ---- pending device work ------------------------------------------------------------------------------
def pending_work():
    """A pending copy-on-write (b truncated inside the page it shares with a) and a pending scrub."""
    pm, a, b = forked()
    [gone] = pm.claim(1)
    prefill(pm, gone, [9, 9])  # page 2
    pm.truncate(b, 5)  # b: page 3, a copy of page 1
    pm.release(gone)  # page 2: a scrub
    return pm


def test_pending_and_take_hand_over_the_work_take_work_hands_over():
    pm = pending_work()
    want = pm.clone().take_work()
    with deprecated("pending_copies", r"plan\.work\.copies\(\)"):
        same_arrays(pm.pending_copies(), want.copies())
    with deprecated("pending_scrubs", r"plan\.work\.scrubs\(\)"):
        same_arrays(pm.pending_scrubs(), want.scrubs())
    assert [[x.tolist() for x in part] for part in want.copies()] == [[[1]], [[3]]]
    assert want.scrubs()[0].tolist() == [2]
    with deprecated("take_copies", r"take_work\(\)"):
        same_arrays(pm.take_copies(), want.copies())
    with deprecated("take_scrubs", r"take_work\(\)"):
        same_arrays(pm.take_scrubs(), want.scrubs())
    assert not pm.has_pending_work  # taken


def test_pad_to_pads_the_pending_work_with_minus_one_and_refuses_less_than_pending():
    pm = pending_work()
    with deprecated("pending_copies"):
        assert [x[0].tolist() for x in pm.pending_copies(pad_to=3)] == [[1, -1, -1], [3, -1, -1]]
    with deprecated("pending_scrubs"):
        assert pm.pending_scrubs(pad_to=3)[0].tolist() == [2, -1, -1]
    before = pm.state_dict()
    for name, call in (("take_copies", lambda: pm.take_copies(pad_to=0)), ("take_scrubs",
                                                                          lambda: pm.take_scrubs(pad_to=0))):
        what = "copies" if name == "take_copies" else "scrubs"
        with deprecated(name), pytest.raises(ValueError, match=rf"pad_to=0 is below the 1 pending {what}"):
            call()
        assert pm.state_dict() == before
    with deprecated("take_copies"):
        assert pm.take_copies(pad_to=2)[1][0].tolist() == [3, -1]
    with deprecated("take_copies"):
        assert pm.take_copies(pad_to=2)[0][0].tolist() == [-1, -1]  # nothing handed over twice
    with deprecated("take_scrubs"):
        assert pm.take_scrubs(pad_to=1)[0].tolist() == [2]


def test_the_transfer_names_hand_over_the_host_tier_work():
    pm = PageManager(make_meta(pages=8).replace(host_pages_per_layer=8))
    [a] = pm.claim(1)
    prefill(pm, a, [1, 2, 3, 4, 5, 6])
    pm.swap_out(a)  # its written pages: pending offloads
    want = pm.clone().take_work()
    with deprecated("has_pending_transfers", r"plan\.work\.has_transfers"):
        assert pm.has_pending_transfers() and want.has_transfers
    with deprecated("pending_transfers", r"plan\.work\.transfers\(\)"):
        for got, expected in zip(pm.pending_transfers(), want.transfers(), strict=True):
            same_arrays(got, expected)
    with deprecated("take_copies"), pytest.raises(ValueError, match="host-tier transfers are pending and must run "
                                                                    r"first .*take_work\(\)"):
        pm.take_copies()
    with deprecated("take_transfers", r"take_work\(\)"):
        for got, expected in zip(pm.take_transfers(), want.transfers(), strict=True):
            same_arrays(got, expected)
    with deprecated("has_pending_transfers"):
        assert not pm.has_pending_transfers()
    plain = make()
    with deprecated("pending_transfers"), pytest.raises(ValueError, match="host"):
        plain.pending_transfers()


@pytest.mark.parametrize("kinds", [(LayerGroup((0,), "full", num_pages=10),),
                                   (LayerGroup((0,), "full", num_pages=10),
                                    LayerGroup((1,), "sliding", 5, num_pages=6)),
                                   (LayerGroup((0,), "full", num_pages=10), LayerGroup((1,), "chunked", 4, num_pages=6),
                                    LayerGroup((2,), "sliding", 5, num_pages=6))],
                         ids=["one group", "two groups", "three groups"])
def test_every_per_group_answer_of_the_old_names_is_a_tuple_of_one_per_group(kinds):
    """As the plan's (test_group_manager.py): the old names' decode steps (listed or stacked), pending
    and taken copies and scrubs hold one entry per layer group, whatever their number."""
    n = len(kinds)
    pm = PageManager(PagedAttentionCacheMetaData(
        batch_size=3, num_hidden_layers=n, num_pages_per_layer=10, num_pages_per_sequence=8, max_sequences=32,
        page_size=4, num_kv_heads=2, kv_head_dim_size=8, hbm_utilization=0.9, layer_groups=kinds),
        scrub_released=True)
    [s] = pm.claim(1)
    prefill(pm, s, [1, 2, 3, 4, 5, 6])
    child = pm.fork(s)
    with deprecated("build_decode_metadata"):
        steps = pm.build_decode_metadata([child], num_steps=2)
    with deprecated("build_decode_metadata"):
        stacked = pm.build_decode_metadata([s], num_steps=1, stacked=True)
    with deprecated("pending_copies"):
        src, dst = pm.pending_copies()
    with deprecated("pending_scrubs"):
        scrubs = pm.pending_scrubs()
    answers = [*steps, stacked, src, dst, scrubs]
    assert all(type(a) is tuple and len(a) == n for a in answers), [(type(a), len(a)) for a in answers]
    assert [a.tolist() for a in src] == [[1]] * n and [a.tolist() for a in dst] == [[2]] * n  # the child's copy
    with deprecated("take_copies"):
        taken = pm.take_copies()
    assert type(taken) is tuple and all(type(x) is tuple and len(x) == n for x in taken)
    pm.release(child)
    with deprecated("take_scrubs"):
        scrubs = pm.take_scrubs()
    assert type(scrubs) is tuple and len(scrubs) == n
