"""Multi-step decode plans: `PageManager.schedule_decode` reserves room for ``k`` tokens of each
sequence and carries step 0's metadata; `commit` commits what each sequence wrote (early
stops commit fewer) and gives back the pages reserved but never written.

Covered here, on tiny pools (page_size 4) with exact page ids: the pages a plan reserves, the
metadata of every step (equal to the mixed form built from the plan's page table), the pages a commit with early stops
gives back and that the next claim gets them first; ``max_tokens``; a plan over forks (copy-on-write
before the loop); a sliding window that holds every page its loop reads and releases what left the
window at commit; a hybrid plan that does not fit; padded plans; every refused plan or
commit (its exception, message and an unchanged `state_dict`); and a randomized equivalence of
plan + commit against one `schedule` / `commit` per token, for full, sliding, chunked
and hybrid (full + sliding) caches, with forks, releases and weight versions between rounds."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from easykv import CacheFullError, LayerGroup, PagedAttentionCacheMetaData, PagedAttentionMetadata, PageManager
from easykv.manager.step_plan import StepPlan
from tests.support.managers import PS, cached_ids, make, prefill

PAD = -1
FIELDS = ("slot_mapping", "positions", "context_lens", "page_table", "query_start_loc", "num_seqs")


def meta(groups, batch=3, max_len=32):
    return PagedAttentionCacheMetaData(
        batch_size=batch, num_hidden_layers=2, num_pages_per_layer=max(g.num_pages for g in groups),
        num_pages_per_sequence=-(-max_len // PS), max_sequences=max_len, page_size=PS, num_kv_heads=2,
        kv_head_dim_size=8, hbm_utilization=0.9, layer_groups=tuple(groups))


def counts(m):
    mm = m.metrics
    return (mm.used_pages, mm.cached_pages, mm.free_pages,
            [(g.used_pages, g.cached_pages, g.free_pages) for g in mm.groups])


def assert_refused(m, exc, match, call, *args, **kw):
    """``call`` raises ``exc`` matching ``match`` and leaves ``m`` exactly as it was."""
    before = m.state_dict()
    with pytest.raises(exc, match=match):
        call(*args, **kw)
    assert m.state_dict() == before
    m.check_invariants()


def two_sequences(pages=10):
    """a: 5 tokens in pages [0, 1]; b: 3 tokens in page [2]."""
    m = make(batch=4, pages=pages, max_len=32)
    a, b = m.claim(2)
    prefill(m, a, [1, 2, 3, 4, 5])
    prefill(m, b, [6, 7, 8])
    return m, a, b


def assert_same_metadata(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for f in FIELDS:
            np.testing.assert_array_equal(np.asarray(getattr(g, f)), np.asarray(getattr(w, f)), err_msg=f)


# ---- 1. exact pages ---------------------------------------------------------------------------
def test_plan_reserves_k_tokens_and_commit_gives_back_what_an_early_stop_never_wrote():
    m, a, b = two_sequences()
    assert (m.pages(a), m.pages(b), counts(m)[:3]) == ([0, 1], [2], (3, 0, 7))
    plan = m.schedule_decode([a, b], 6)
    assert isinstance(plan, StepPlan)
    assert repr(plan) == "StepPlan(decode: 2 sequences x 6 steps, padded to 2 rows, open)"
    assert plan.seq_ids == (a, b) and plan.lengths.tolist() == [5, 3] and not plan.lengths.flags.writeable
    # a: positions 5..10 need column 2 (page 3); b: positions 3..8 need columns 1, 2 (pages 4, 5)
    assert (m.pages(a), m.pages(b)) == ([0, 1, 3], [2, 4, 5])
    assert m.page_table([a, b]).tolist() == [[0, 1, 3] + [PAD] * 5, [2, 4, 5] + [PAD] * 5]
    assert counts(m)[:3] == (6, 0, 4) and (m.length(a), m.length(b)) == (5, 3)
    m.check_invariants()
    (md,) = plan.metadata
    assert md.positions.tolist() == [5, 3] and md.slot_mapping.tolist() == [5, 11]
    assert md.context_lens.tolist() == [6, 4] and md.page_table.tolist() == m.page_table([a, b]).tolist()
    # every step's metadata is the mixed form of one token each over the plan's pages
    cur, table = plan.metadata, m.page_table([a, b])
    for j in range(6):
        assert_same_metadata(cur, [PagedAttentionMetadata.for_mixed(table, [5 + j, 3 + j], [1, 1],
                                                                    cache_metadata=m.metadata)])
        assert cur[0].slot_mapping.tolist() == [m.pages(a)[(5 + j) // PS] * PS + (5 + j) % PS,
                                                m.pages(b)[(3 + j) // PS] * PS + (3 + j) % PS]
        cur = plan.next_metadata(cur)
    m.commit(plan, [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]], [2, 6])
    assert repr(plan).endswith("committed)")
    assert (m.length(a), m.length(b)) == (7, 9)
    assert (m.pages(a), m.pages(b)) == ([0, 1], [2, 4, 5])  # a stopped after 2: page 3 unwritten, given back
    assert counts(m)[:3] == (5, 0, 5)
    # the token log is exact: the committed tokens, and only those, are the cached prefix
    assert m.cached_prefix_length([1, 2, 3, 4, 5, 10, 11, 12, 13]) == 4
    assert m.cached_prefix_length([6, 7, 8, 20, 21, 22, 23, 24, 25]) == 8
    assert m.cached_prefix_length([6, 7, 8, 20, 21, 22, 23, 99, 25]) == 4
    m.check_invariants()
    c = m.claim(1)[0]
    m.schedule([c], [12])  # the given-back page is the first one handed out again
    assert m.pages(c) == [3, 6, 7]
    m.release(a)
    m.release(b)
    assert sorted(cached_ids(m)) == [0, 2, 4]  # full pages of committed tokens only
    m.check_invariants()


def test_pages_given_back_are_handed_out_again_first_in_column_order():
    m, a, b = two_sequences()
    plan = m.schedule_decode([a, b], 11)
    assert (m.pages(a), m.pages(b)) == ([0, 1, 3, 4], [2, 5, 6, 7])
    m.commit(plan, np.ones((2, 11), np.int64), [1, 11])
    assert (m.pages(a), m.pages(b), counts(m)[:3]) == ([0, 1], [2, 5, 6, 7], (6, 0, 4))
    c = m.claim(1)[0]
    m.schedule([c], [12])
    assert m.pages(c) == [3, 4, 8]
    m.check_invariants()


def test_commit_of_zero_tokens_restores_the_state_before_the_plan_and_default_commits_all():
    m, a, b = two_sequences()
    c = m.claim(1)[0]  # no tokens, no pages, bound to no replica
    before = m.state_dict()
    plan = m.schedule_decode([a, b, c], 6)
    replica = m.sequence(c).replica
    assert (m.pages(a), m.pages(b), m.pages(c), replica) == ([0, 1, 3], [2, 4, 5], [6, 7], 0)
    m.commit(plan, np.zeros((3, 6), np.int64), [0, 0, 0])
    replica = m.sequence(c).replica
    assert m.state_dict() == before and (m.pages(a), m.pages(b), m.pages(c), replica) == ([0, 1], [2], [], None)
    plan = m.schedule_decode([b], 3)  # only b: a, not planned, may change meanwhile
    m.commit(m.schedule([a], [2]), [[9, 9]])
    m.commit(plan, jnp.asarray([[30, 31, 32]], jnp.int32))  # num_tokens defaults to all 3
    assert (m.length(a), m.length(b), m.pages(b)) == (7, 6, [2, 3]) and m.pages(a) == [0, 1]
    m.check_invariants()


def test_a_plan_over_forks_carries_the_copy_of_the_shared_partial_page():
    m = make(batch=4, pages=10, max_len=32)
    a = m.claim(1)[0]
    prefill(m, a, [1, 2, 3, 4, 5])
    c = m.fork(a)  # shares pages 0 and the partial page 1
    plan = m.schedule_decode([a, c], 3)
    assert (m.pages(a), m.pages(c)) == ([0, 2], [0, 1])  # the first writer copies, the last keeps page 1
    # The copy is the plan's: the runner applies it before the loop, so the commit does not wait for it.
    assert [x[0].tolist() for x in plan.work.copies()] == [[1], [2]] and not m.has_pending_work
    tokens = [[6, 7, 8], [16, 17, 18]]
    m.commit(plan, tokens, [3, 1])
    assert (m.length(a), m.length(c), m.pages(a), m.pages(c)) == (8, 6, [0, 2], [0, 1])
    assert m.cached_prefix_length([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    assert m.cached_prefix_length([1, 2, 3, 4, 5, 16, 0, 0, 0]) == 4
    m.check_invariants()


def test_max_tokens_reserves_less_for_a_sequence_near_its_end():
    m, a, b = two_sequences()
    assert_refused(m, ValueError, r"max_tokens\[1\]=7 is more than num_steps=6", m.schedule_decode, [a, b], 6,
                   max_tokens=[1, 7])
    plan = m.schedule_decode([a, b], 6, max_tokens=[1, 6])
    assert plan.limits.tolist() == [1, 6] and (m.pages(a), m.pages(b)) == ([0, 1], [2, 3, 4])
    assert_refused(m, ValueError, r"num_tokens\[0\]=2 is more than the 1 tokens", m.commit, plan,
                   np.ones((2, 6), np.int64), [2, 6])
    assert_refused(m, ValueError, r"num_tokens=2 is more than the 1 tokens .* planned for sequence 0", m.commit,
                   plan, np.ones((2, 6), np.int64), 2)
    m.commit(plan, np.ones((2, 6), np.int64))  # by default each commits its limit
    assert (m.length(a), m.length(b)) == (6, 9)
    m.check_invariants()


# ---- 3. sliding windows ----------------------------------------------------------------------------
def test_sliding_plan_holds_every_page_its_loop_reads_and_commit_releases_what_left_the_window():
    m = PageManager(meta([LayerGroup((0, 1), "sliding", 5, num_pages=10)]))
    a, b = m.claim(2)
    for s, toks in ((a, [1, 2, 3, 4, 5, 6]), (b, [7, 8, 9])):
        m.commit(m.schedule([s], [len(toks)]), [toks])
    assert (m.pages(a), m.pages(b)) == ([0, 1], [2])
    plan = m.schedule_decode([a, b], 7)
    assert (m.pages(a), m.pages(b)) == ([0, 1, 3, 4], [2, 5, 6])
    m.check_invariants()
    md = plan.metadata
    for j in range(7):  # a query at p reads p-4..p: every column of it is a page the sequence holds
        for i, s in enumerate((a, b)):
            pos = int(plan.lengths[i]) + j
            assert int(md[0].positions[i]) == pos
            cols = range(max(0, pos - 4) // PS, pos // PS + 1)
            held = m.pages(s)
            assert [int(md[0].page_table[i, c]) for c in cols] == [held[c] for c in cols]
            assert PAD not in [held[c] for c in cols]
        md = plan.next_metadata(md)
    m.commit(plan, np.arange(100, 114).reshape(2, 7), [7, 2])
    # a: length 13, the next query reads 9..13: pages 0, 1 left the window (full: cached)
    # b: length 5, the next query reads 1..5: page 2 still read; page 6 never written, given back
    assert (m.pages(a), m.pages(b)) == ([PAD, PAD, 3, 4], [2, 5])
    assert counts(m)[:3] == (4, 2, 4) and sorted(cached_ids(m)) == [0, 1]
    m.check_invariants()
    c = m.claim(1)[0]
    m.schedule([c], [4])
    assert m.pages(c) == [6]


def test_a_hybrid_plan_that_does_not_fit_the_sliding_pool_changes_neither_group():
    m = PageManager(meta([LayerGroup((0,), "full", num_pages=12), LayerGroup((1,), "sliding", 5, num_pages=4)]))
    a, b = m.claim(2)
    for s in (a, b):
        m.commit(m.schedule([s], [3]), [[s, s, s]])
    assert_refused(m, CacheFullError, r"needs 4 pages .*but only 2 are free", m.schedule_decode, [a, b], 6)
    plan = m.schedule_decode([a, b], 2)
    m.commit(plan, [[1, 2], [3, 4]], [1, 2])
    assert [m.pages(a, group=g) for g in (0, 1)] == [[0], [0]]
    assert [m.pages(b, group=g) for g in (0, 1)] == [[1, 3], [1, 3]]  # a's page 2 was given back in both
    m.check_invariants()


# ---- 4. refusals ----------------------------------------------------------------------------
def test_plan_refuses_bad_steps_and_a_plan_that_does_not_fit_with_nothing_changed():
    m, a, b = two_sequences()
    for k in (0, -1, True, 2**70, 33, 1.0, None):
        assert_refused(m, ValueError, "num_steps must be a positive int", m.schedule_decode, [a], k)
    assert_refused(m, ValueError, r"would hold 33 tokens .*past max_sequences=32", m.schedule_decode, [a], 28)
    assert_refused(m, CacheFullError, r"needs 10 pages but only 7 are free", m.schedule_decode, [a, b], 20)
    assert_refused(m, ValueError, "repeats id", m.schedule_decode, [a, a], 2)
    assert_refused(m, ValueError, "not claimed", m.schedule_decode, [3], 2)
    assert_refused(m, ValueError, "pad_seqs_to", m.schedule_decode, [a], 2, pad_seqs_to=5)


@pytest.mark.parametrize("tokens, num, match", [
    ("ok", [4, 0], r"num_tokens\[0\] = 4 is out of range \(valid: 0\.\.3; tokens each sequence wrote, at most "
                   r"num_steps=3\)"),
    ("ok", [-1, 0], r"num_tokens\[0\] = -1 is out of range"),
    ("ok", [1, 1, 0], "num_tokens has 3 entries"),
    ("ok", [[1, 1]], "num_tokens must have 1 dimension"),
    ("ok", 4, r"num_tokens must be a non-negative int, got 4 \(valid: 0\.\.3"),  # one int: every sequence's count
    ("ok", -1, r"num_tokens must be a non-negative int, got -1"),
    ("ok", True, r"num_tokens must be a non-negative int, got True \(a bool"),
    ("padded", [1, 1, 1, 0], r"num_tokens\[2\]=1 but row 2 is padding"),
    ("padded", [1, 1, 0, 2], r"num_tokens\[3\]=2 but row 3 is padding"),
    (np.zeros((2, 4), np.int64), None, r"token_ids has shape \(2, 4\)"),
    (np.zeros((3, 3), np.int64), None, r"token_ids has shape \(3, 3\)"),
    (np.zeros(3, np.int64), None, "token_ids must have 2 dimension"),
    ([[1, 2, -3], [0, 0, 0]], None, r"token_ids\[0, 2\] = -3 is out of range"),
    ([[1, 2, 2**31], [0, 0, 0]], None, r"token_ids\[0, 2\] = 2147483648 is out of range"),
    (np.zeros((2, 3)), None, r"token_ids\[0, 0\] must be a non-negative int"),
])
def test_commit_refuses_bad_tokens_and_counts_with_nothing_changed(tokens, num, match):
    m, a, b = two_sequences()
    plan = m.schedule_decode([a, b], 3, pad_seqs_to=4)
    if isinstance(tokens, str):  # well-formed ids: (n, k) or (padded_rows, k)
        tokens = np.ones((2 if tokens == "ok" else 4, 3), np.int64)
    assert_refused(m, ValueError, match, m.commit, plan, tokens, num)
    m.commit(plan, np.ones((2, 3), np.int64), [1, 3])  # the plan is still open and commits after
    assert (m.length(a), m.length(b)) == (6, 6)


@pytest.mark.parametrize("num", [2**80, np.uint64(2**64 - 1), 2**63, np.int64(2**63 - 1), 2**31, 4, -(2**70),
                                 [2**80, 0], [np.uint64(2**64 - 1), 0], np.array([2**64 - 1, 0], np.uint64),
                                 np.array([2**63 - 1, 0]), jnp.asarray([4, 0]), np.array(2**64 - 1, np.uint64)],
                         ids=repr)
def test_issue_42_a_count_of_any_size_is_refused_by_the_plan_s_steps_with_nothing_changed(num):
    """Issue 42 attack: ``commit_decode(plan, ids, 2**80)`` (now `commit`) and ``np.uint64(2**64 - 1)``
    passed an unbounded check, then overflowed int64 (OverflowError). Every count is bounded by the
    plan's num_steps before any array holds it; the plan stays open and commits after."""
    m, a, b = two_sequences()
    plan = m.schedule_decode([a, b], 3)
    assert_refused(m, ValueError, r"num_tokens(\[0\])? (must be a non-negative int, got -?[\d.]+|= -?\d+ is out of "
                                  r"range) \(valid: 0\.\.3; tokens each sequence wrote, at most num_steps=3\)",
                   m.commit, plan, np.ones((2, 3), np.int64), num)
    m.commit(plan, np.ones((2, 3), np.int64), jnp.asarray(3, jnp.int32))  # a 0-d jax count: one for all
    assert (m.length(a), m.length(b)) == (8, 6)
    m.check_invariants()


def test_commit_refuses_a_plan_twice_of_another_manager_or_not_a_plan():
    m, a, b = two_sequences()
    plan = m.schedule_decode([a, b], 3)
    other = m.clone()
    assert_refused(other, ValueError, "made by another PageManager", other.commit, plan, np.ones((2, 3), np.int64))
    theirs = other.schedule_decode([a], 2)
    assert_refused(m, ValueError, "made by another PageManager", m.commit, theirs, np.ones((1, 2), np.int64))
    assert_refused(m, TypeError, "commit takes the StepPlan schedule or schedule_decode returned, got dict",
                   m.commit, {"seq_ids": (a, b)}, np.ones((2, 3), np.int64))
    m.commit(plan, np.ones((2, 3), np.int64), [1, 1])
    assert plan.committed and (m.length(a), m.length(b)) == (6, 4)
    assert_refused(m, ValueError, r"ended already \(committed\)", m.commit, plan, np.ones((2, 3), np.int64), [0, 0])
    assert_refused(m, ValueError, r"ended already \(committed\)", m.abort, plan)
    other.commit(theirs, np.ones((1, 2), np.int64))  # the clone's own plan still commits there
    assert other.length(a) == 7 and m.length(a) == 6


@pytest.mark.parametrize("change, what", [
    ("release", "release"),
    ("truncate", "truncate"),
    ("step", "step"),
    ("schedule", "schedule"),
    ("replan", "schedule_decode"),  # a second plan would write the same slots
    ("fork", "fork"),
])
def test_nothing_else_touches_a_planned_sequence_until_its_plan_is_committed(change, what):
    m, a, b = two_sequences()
    plan = m.schedule_decode([a, b], 3)
    call = {"release": lambda: m.release(b), "truncate": lambda: m.truncate(a, 4), "step": lambda: m.step([a], [9]),
            "schedule": lambda: m.schedule([a], [1]), "replan": lambda: m.schedule_decode([b], 2),
            "fork": lambda: m.fork(a)}[change]
    seq = b if change in ("release", "replan") else a
    assert_refused(m, ValueError, rf"{what}\(\) would change sequence {seq}, which open plan #3 holds "
                                  rf"\(sequences \[{a}, {b}\]: .*\); end that plan first with commit\(plan, "
                                  r"token_ids, \.\.\.\) or abort\(plan\)", call)
    m.commit(plan, np.ones((2, 3), np.int64), [2, 0])
    call()  # allowed once the plan is committed
    m.check_invariants()


def test_the_stamp_refuses_a_plan_whose_sequence_changed_behind_the_open_plan_guard():
    """The second line of defence: were the guard bypassed (here by calling the parts the way
    the manager's own code does, below its public methods), a changed sequence is still refused
    at commit, as a bug."""
    from easykv.errors import InvariantError
    from easykv.manager import rollback
    from easykv.manager.commit import commit_tokens

    m, a, b = two_sequences()
    plan = m.schedule_decode([a, b], 3)
    parts = (m._seqs, m._groups)  # reached into on purpose: this test bypasses the public methods' guard
    commit_tokens(*parts, m._tiers, np.array([a]), np.array([1]), [np.array([42])], caching=True, current=None)
    # written and rewound: the same length, pages
    rollback.truncate(*parts, m._copies, a, 5, caching=True, current=None)
    assert_refused(m, InvariantError, "sequence 0 .* changed after the plan .*length 5 then, 5 now", m.commit,
                   plan, np.ones((2, 3), np.int64), 0)
    m, a, b = two_sequences()
    plan = m.schedule_decode([a, b], 3)
    m._groups.release_row(b, int(m._seqs.npages[b]), stale=False)
    m._seqs.reset(b)  # released below the guard
    with pytest.raises(InvariantError, match=r"sequence 1 of StepPlan\(.*\) changed after the plan was made, though "
                                             r"the open plan froze it .*length 3 then, 0 now"):
        m.commit(plan, np.ones((2, 3), np.int64), 0)


def test_a_swapped_or_full_sequence_is_not_planned_and_swap_out_waits_for_the_plan():
    from easykv import LayerGroup, PagedAttentionCacheMetaData, PageManager

    meta = PagedAttentionCacheMetaData(batch_size=4, num_hidden_layers=2, num_pages_per_layer=10,
                                       num_pages_per_sequence=4, max_sequences=16, page_size=4, num_kv_heads=2,
                                       kv_head_dim_size=8, hbm_utilization=0.9,
                                       layer_groups=(LayerGroup((0, 1), "full", num_pages=10),),
                                       host_pages_per_layer=8)
    m = PageManager(meta)
    a, b = m.claim(2)
    prefill(m, a, list(range(16)))  # at max_sequences
    prefill(m, b, [1, 2, 3])
    # a sequence with no position left cannot be planned, even for no token; nothing changes
    assert_refused(m, ValueError, r"sequence 0 would hold 17 tokens \(a decode step's position\)", m.schedule_decode,
                   [b, a], 4, max_tokens=[4, 0])
    plan = m.schedule_decode([b], 2)
    assert_refused(m, ValueError, r"swap_out\(\) would change sequence 1, which open plan #3 holds", m.swap_out, b)
    m.commit(plan, np.ones((1, 2), np.int64))


def test_commit_gives_back_only_what_the_plan_reserved():
    planned, a, b = two_sequences()
    planned.schedule([a], [10])  # room for 15 tokens: 4 pages
    # A state saved while that step was planned: the room stays reserved, with no plan to end.
    m = PageManager.from_state_dict(planned.metadata, planned.state_dict())
    held = m.pages(a)
    assert len(held) == 4
    plan = m.schedule_decode([a], 2)  # fits the room already reserved
    m.commit(plan, np.ones((1, 2), np.int64), [0])
    assert m.pages(a) == held and m.sequence(a).capacity == 16


# ---- 5. padding ---------------------------------------------------------------------------------
def test_a_padded_plan_has_padded_rows_and_commits_its_loops_padded_output():
    m, a, b = two_sequences()
    plan = m.schedule_decode([a, b], 3, pad_seqs_to=4)
    assert plan.padded_rows == 4 and "padded to 4 rows" in repr(plan)
    md = plan.metadata
    for j in range(3):
        assert md[0].page_table.shape[0] == 4 and md[0].positions.tolist() == [5 + j, 3 + j, PAD, PAD]
        assert md[0].slot_mapping[2:].tolist() == [PAD, PAD] and md[0].context_lens.tolist() == [6 + j, 4 + j, 0, 0]
        md = plan.next_metadata(md)
    m.commit(plan, jnp.arange(12, dtype=jnp.int32).reshape(4, 3), jnp.asarray([1, 3, 0, 0]))
    assert (m.length(a), m.length(b), m.pages(a), m.pages(b)) == (6, 6, [0, 1], [2, 3])
    assert m.cached_prefix_length([6, 7, 8, 3, 4, 5, 0]) == 4 and m.cached_prefix_length([1, 2, 3, 4, 5, 0, 0]) == 4
    m.check_invariants()


# ---- 2. equivalence with one step per token --------------------------------------------------------
KINDS = {
    "full": [LayerGroup((0, 1), "full", num_pages=64)],
    "sliding": [LayerGroup((0, 1), "sliding", 5, num_pages=64)],
    "chunked": [LayerGroup((0, 1), "chunked", 8, num_pages=64)],
    "hybrid": [LayerGroup((0,), "full", num_pages=64), LayerGroup((1,), "sliding", 6, num_pages=48)],
}


def shares_tail(m, s):
    """Whether ``s``'s next write lands in a page another sequence holds (a fork's partial page)."""
    col = m.length(s) // PS
    for g in range(m.num_groups):
        pages = m.pages(s, group=g)
        if col < len(pages) and pages[col] != PAD and any(pages[col] in m.pages(o, group=g)
                                                         for o in m.active_ids if o != s):
            return True
    return False


def one_run(kind, seed):
    rng = np.random.default_rng(seed)
    md = meta(KINDS[kind], batch=6, max_len=64)
    A, B = PageManager(md), PageManager(md)
    hist, gone = {}, []
    prompts = [rng.integers(0, 5, 8).tolist() for _ in range(2)]  # shared prefixes: prefix hits
    for s in range(3):
        p = prompts[rng.integers(2)][: rng.integers(1, 9)] + rng.integers(0, 50, rng.integers(0, 4)).tolist()
        for m in (A, B):
            assert m.claim(1) == [s]
            done = m.match_prefix(s, p)
            m.commit(m.schedule([s], [len(p) - done]), [p[done:]])  # (the plan's work: the device's)
        hist[s] = p
    for rnd in range(4):
        if rng.random() < 0.5 and len(hist) < 6:
            parent = int(rng.choice(sorted(hist)))
            child = A.fork(parent)
            assert B.fork(parent) == child
            hist[child] = list(hist[parent])
        if rng.random() < 0.3 and len(hist) > 2:
            s = int(rng.choice(sorted(hist)))
            A.release(s), B.release(s)
            gone.append(hist.pop(s))
        if rng.random() < 0.3:
            A.set_weight_version(rnd + 1), B.set_weight_version(rnd + 1)
        ids = [int(i) for i in rng.permutation(sorted(hist))[: rng.integers(1, len(hist) + 1)]]
        k = int(rng.integers(1, 6))
        toks = rng.integers(0, 50, (len(ids), k))
        # early stops; 0 only where no fork shares the page a write would go into: the plan
        # copies that page at once, the one-step path only when it writes
        num = [max(int(c), int(shares_tail(A, s))) for c, s in zip(rng.integers(0, k + 1, len(ids)), ids)]
        plan = A.schedule_decode(ids, k)
        A.commit(plan, toks, num)
        for j in range(k):  # B: one step per token, only the sequences still running
            live = [i for i, s in enumerate(ids) if num[i] > j]
            if not live:
                break
            B.commit(B.schedule([ids[i] for i in live], [1] * len(live)), [[int(toks[i, j])] for i in live])
        for i, s in enumerate(ids):
            hist[s] += toks[i, : num[i]].tolist()
        A.check_invariants()
        B.check_invariants()
        for s, h in hist.items():
            assert A.length(s) == B.length(s) == len(h), (kind, seed, rnd, s)
        for h in list(hist.values()) + gone:
            assert A.cached_prefix_length(h) == B.cached_prefix_length(h), (kind, seed, rnd, h)
        assert counts(A) == counts(B), (kind, seed, rnd)
        assert A.metrics.evictions == B.metrics.evictions == 0  # (pools large enough to compare)
    return sum(A.cached_prefix_length(h) for h in hist.values())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_plan_and_commit_match_one_step_per_token(kind):
    assert sum(one_run(kind, seed) for seed in range(20)) > 0  # prefix caching was exercised
