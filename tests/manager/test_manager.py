"""PageManager unit tests on tiny pools (page_size 4, ten pages), asserting exact page ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from easykv.errors import CacheFullError, InvariantError, ManagerStateError, UnknownSequenceError
from easykv.manager.manager import PageManager, increment_cache_lengths, stack_metadata
from easykv.step.metadata import INVALID_SLOT, PAD_PAGE, PagedAttentionMetadata
from easykv.step.ragged import RaggedStep
from tests.support.managers import PS, make, make_meta, prefill


# ---- sequence slots -------------------------------------------------------------------------------
def test_claim_contains_release_slots():
    pm = make()
    assert pm.claim(2) == [0, 1]
    pm.external_claim([3])
    assert pm.slots_remaining == {2}
    assert pm.contains(0) and 3 in pm and not pm.contains(2) and not pm.contains(99)
    pm.release(0)
    assert pm.claim(1) == [0]
    assert pm.claim(1) == [2]
    with pytest.raises(CacheFullError, match="batch_size=4") as err:
        pm.claim(1)
    assert (err.value.resource, err.value.needed, err.value.available) == ("sequence slots", 1, 0)
    assert pm.claim(0) == []


def test_fork_needs_a_free_slot():
    pm = make(batch=2)
    a, b = pm.claim(2)
    with pytest.raises(CacheFullError, match="sequence slot"):
        pm.fork(a)


# ---- growth ------------------------------------------------------------------------------------
def test_pages_are_allocated_at_page_boundaries_lowest_id_first():
    pm = make()
    a, b = pm.claim(2)
    plan = pm.schedule([a], [5])
    assert pm.pages(a) == [0, 1] and pm.sequence(a).capacity == 8 and pm.length(a) == 0
    pm.commit(plan)
    plan = pm.schedule([a], [3])  # fits in page 1
    assert pm.pages(a) == [0, 1]
    pm.abort(plan)
    b_plan = pm.schedule([b], [1])
    a_plan = pm.schedule([a], [4])
    assert pm.pages(a) == [0, 1, 3] and pm.pages(b) == [2]
    pm.commit(b_plan)
    pm.commit(a_plan)
    pm.release(a)
    pm.schedule([b], [15])  # pages come back lowest first
    assert pm.pages(b) == [2, 0, 1, 3]
    pm.check_invariants()


def test_cache_full_is_all_or_nothing():
    pm = make()
    a, b, c = pm.claim(3)
    pm.commit(pm.schedule([a, b], [16, 12]))  # 7 of 10 pages
    before = pm.state_dict()
    with pytest.raises(CacheFullError, match="needs 4 pages but only 3") as err:
        pm.schedule([c, a], [16, 0])
    assert (err.value.resource, err.value.needed, err.value.available, err.value.replica) == ("pages", 4, 3, None)
    assert pm.state_dict() == before
    with pytest.raises(CacheFullError, match="needs 4 pages"):
        pm.schedule([b, c], [1, 9])
    assert pm.state_dict() == before
    pm.schedule([b, c], [1, 8])  # 1 + 2 pages: exactly full
    assert pm.metrics.free_pages == 0 and pm.usage == 1.0


# ---- step metadata --------------------------------------------------------------------------------
def test_mixed_metadata_matches_hand_computed_slots():
    pm = make()
    a, b = pm.claim(2)
    pm.commit(pm.schedule([a], [6]))  # a: 6 tokens on pages [0, 1]
    (meta,) = pm.schedule([a, b], [3, 5], pad_tokens_to=10, pad_seqs_to=3).metadata
    # a writes positions 6, 7 (page 1) and 8 (new page 2); b prefills 0..4 on pages 3, 4.
    assert pm.pages(a) == [0, 1, 2] and pm.pages(b) == [3, 4]
    np.testing.assert_array_equal(meta.slot_mapping, [6, 7, 8, 12, 13, 14, 15, 16, -1, -1])
    np.testing.assert_array_equal(meta.positions, [6, 7, 8, 0, 1, 2, 3, 4, -1, -1])
    np.testing.assert_array_equal(meta.query_start_loc, [0, 3, 8, 8])
    np.testing.assert_array_equal(meta.context_lens, [9, 5, 0])
    np.testing.assert_array_equal(meta.page_table, [[0, 1, 2, -1], [3, 4, -1, -1], [-1] * 4])
    assert int(meta.num_seqs) == 2 and isinstance(meta, RaggedStep)
    assert pm.length(a) == 6  # lengths advance on commit only
    checked = PagedAttentionMetadata.for_mixed(
        pm.page_table([a, b]), [6, 0], [3, 5], cache_metadata=pm.metadata, pad_tokens_to=10, pad_seqs_to=3)
    for name in ("slot_mapping", "positions", "query_start_loc", "page_table", "context_lens"):
        np.testing.assert_array_equal(getattr(meta, name), getattr(checked, name))


def test_multi_step_decode_reserves_ahead_and_increments_without_the_manager():
    pm = make()
    a, b = pm.claim(2)
    pm.commit(pm.schedule([a, b], [3, 4]), [[1, 2, 3], [4, 5, 6, 7]])  # a: page 0 (3 tokens), b: page 1 (full)
    plan = pm.schedule_decode([a, b], 3, pad_seqs_to=3)
    steps = [plan.metadata]
    for _ in range(2):
        steps.append(plan.next_metadata(steps[-1]))
    steps = [step for (step,) in steps]
    assert pm.pages(a) == [0, 2] and pm.pages(b) == [1, 3]  # reserved for positions 3..5 / 4..6
    assert [s.slot_mapping.tolist() for s in steps] == [[3, 12, -1], [8, 13, -1], [9, 14, -1]]
    assert [s.positions.tolist() for s in steps] == [[3, 4, -1], [4, 5, -1], [5, 6, -1]]
    assert [s.context_lens.tolist() for s in steps] == [[4, 5, 0], [5, 6, 0], [6, 7, 0]]
    stacked = stack_metadata(steps[:2])  # a device loop's steps, stacked
    assert stacked.slot_mapping.shape == (2, 3) and stacked.page_table.shape == (2, 3, 4)
    # on device, inside jit: the same next step
    nxt = jax.jit(lambda m: increment_cache_lengths(m, page_size=PS))(jax.tree.map(jnp.asarray, steps[0]))
    for name in ("slot_mapping", "positions", "context_lens"):
        np.testing.assert_array_equal(np.asarray(getattr(nxt, name)), getattr(steps[1], name))
    pm.commit(plan, np.array([[8, 9, 10], [11, 12, 13]]))
    assert (pm.length(a), pm.length(b)) == (6, 7)
    pm.check_invariants()


def test_increment_never_writes_past_the_reserved_pages():
    pm = make()
    [a] = pm.claim(1)
    (meta,) = pm.schedule_decode([a], 1).metadata  # position 0, one page
    later = meta
    for _ in range(4):
        (later,) = pm.increment_cache_lengths(later)
    # position 4 needs a second page nobody reserved: the slot is invalid (dropped and counted)
    assert later.positions.tolist() == [4] and later.slot_mapping.tolist() == [INVALID_SLOT]


# ---- prefix caching ---------------------------------------------------------------------------------
def test_prefix_reuse_counts_and_limits():
    pm = make()
    a, b, c, d = pm.claim(4)
    prompt = list(range(100, 110))  # 10 tokens: pages 0, 1 full, page 2 partial
    assert prefill(pm, a, prompt) == 0
    assert pm.cached_prefix_length(prompt) == 8
    assert prefill(pm, b, prompt) == 8 and pm.pages(b)[:2] == [0, 1]
    assert pm.match_prefix(c, prompt[:8]) == 4  # at most len - 1 tokens: the last page is recomputed
    assert pm.match_prefix(d, prompt, salt="tenant-2") == 0  # salts never share
    m = pm.metrics
    assert (m.prefix_queries, m.prefix_hits, m.prefix_hit_tokens, m.prefix_query_tokens) == (4, 2, 12, 38)
    assert m.hit_rate == 0.5 and m.token_hit_rate == 12 / 38
    pm.check_invariants()


def test_prefix_caching_off_and_a_commit_without_ids():
    pm = make(enable_prefix_caching=False)
    a, b = pm.claim(2)
    prefill(pm, a, list(range(10)))
    assert pm.match_prefix(b, list(range(10))) == 0 and pm.cached_prefix_length(list(range(10))) == 0
    pm2 = make()
    a, b = pm2.claim(2)
    pm2.commit(pm2.schedule([a], [10]))  # ids unknown: nothing enters the prefix cache
    assert pm2.cached_prefix_length(list(range(10))) == 0


def test_pages_filled_by_decode_are_committed():
    pm = make()
    a, b = pm.claim(2)
    prefill(pm, a, [1, 2, 3])
    for tok in (4, 5, 6):
        pm.commit(pm.schedule_decode([a], 1), [[tok]])
    assert pm.cached_prefix_length([1, 2, 3, 4, 5, 6, 7]) == 4  # page 0 sealed by the 4th token
    assert pm.cached_prefix_length([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4  # page 1 is still partial


def test_released_pages_stay_cached_and_are_evicted_lru_tail_first():
    pm = make()
    a, b, c, d = pm.claim(4)
    prompt = list(range(12))
    prefill(pm, a, prompt + [99])  # pages 0, 1, 2 full; page 3 partial
    pm.release(a)
    m = pm.metrics
    assert (m.free_pages, m.cached_pages, m.used_pages) == (7, 3, 0)  # page 3 was freed
    pm.schedule([b], [16])
    pm.schedule([c], [12])
    assert pm.pages(b) == [3, 4, 5, 6] and pm.pages(c) == [7, 8, 9]  # free pages before cached ones
    assert pm.cached_prefix_length(prompt + [0]) == 12
    plan = pm.schedule([d], [4])  # evicts the tail page of the released prompt first
    assert pm.pages(d) == [2] and pm.metrics.evictions == 1
    assert pm.cached_prefix_length(prompt + [0]) == 8
    pm.abort(plan)
    pm.release(d)
    assert pm.metrics.free_pages == 1  # page 2 came back empty
    pm.check_invariants()


def test_a_reused_cached_page_is_no_longer_evictable():
    pm = make()
    a, b, c = pm.claim(3)
    prefill(pm, a, list(range(9)))  # pages 0, 1 full
    pm.release(a)
    assert prefill(pm, b, list(range(9))) == 8 and pm.pages(b) == [0, 1, 2]
    pm.schedule([c], [16])
    assert pm.pages(c) == [3, 4, 5, 6]
    assert pm.metrics.evictions == 0 and pm.metrics.cached_pages == 0


def test_concurrent_identical_prompts_keep_one_cached_copy():
    pm = make()
    a, b, c = pm.claim(3)
    prompt = list(range(9))
    pm.commit(pm.schedule([a, b], [9, 9]), [prompt, prompt])  # both prefill before either committed
    pm.check_invariants()
    assert pm.match_prefix(c, prompt) == 8 and pm.pages(c) == pm.pages(a)[:2]


# ---- fork and copy-on-write ------------------------------------------------------------------------
def test_fork_shares_pages_and_the_first_writer_copies():
    pm = make()
    [a] = pm.claim(1)
    prefill(pm, a, [1, 2, 3, 4, 5, 6])  # page 0 full, page 1 partial
    b = pm.fork(a)
    assert pm.pages(b) == [0, 1] and pm.length(b) == 6
    plan = pm.schedule([b, a], [1, 1])
    (meta,) = plan.metadata
    assert pm.pages(b) == [0, 2] and pm.pages(a) == [0, 1]  # b copied, a (last writer) kept page 1
    np.testing.assert_array_equal(meta.slot_mapping, [2 * PS + 2, 1 * PS + 2])
    (src,), (dst,) = plan.work.copies()
    assert src.tolist() == [1] and dst.tolist() == [2] and src.dtype == np.int32
    assert not pm.has_pending_work and pm.take_work().empty and pm.metrics.copies == 1
    pm.commit(plan, [[8], [7]])
    plan = pm.schedule([b], [2])  # b: page 2 filled, a new page 3
    assert pm.pages(b) == [0, 2, 3] and plan.work.empty
    c = pm.fork(a)
    (src,), (dst,) = pm.schedule([c], [1]).work.copies()
    assert (src.tolist(), dst.tolist(), pm.pages(c)) == ([1], [4], [0, 4]) and pm.metrics.copies == 2
    pm.check_invariants()


def test_take_work_hands_over_the_copies_and_scrubs_once_with_exact_ids():
    pm = make(scrub_released=True)
    [a, other] = pm.claim(2)
    prefill(pm, a, [1, 2, 3, 4, 5, 6])  # pages 0 (full) and 1 (partial)
    prefill(pm, other, [9, 9])  # page 2
    b = pm.fork(a)
    pm.truncate(b, 5)  # b will write again inside the shared partial page 1: copy 1 -> 3
    pm.release(other)  # page 2 (partial, never cached) leaves every owner: to be scrubbed
    assert pm.has_pending_work
    work = pm.take_work()
    [group] = work.groups
    assert (group.copy_src.tolist(), group.copy_dst.tolist(), group.scrubs.tolist()) == ([1], [3], [2])
    assert work.num_copies == 1 and not work.has_host_work and repr(work) == "DeviceWork(1 copies, 1 scrubs)"
    assert not pm.has_pending_work and pm.take_work().empty  # nothing handed over twice
    pm.step([b], [7])  # the copy was taken (applied): b may commit into page 3
    assert pm.pages(b) == [0, 3]
    pm.check_invariants()


def test_a_fork_of_a_sequence_with_only_reserved_pages_is_unbound():
    planned = make(shards=2, pages=20)
    [a] = planned.claim(1)
    planned.schedule([a], [4])  # a page reserved ahead, nothing written
    # A state saved while the step was planned: the room stays reserved, with no plan to end.
    pm = PageManager.from_state_dict(planned.metadata, planned.state_dict())
    assert pm.pages(a) == [0] and pm.sequence(a).capacity == 4 and pm.sequence(a).replica == 0
    b = pm.fork(a)
    assert pm.pages(b) == [] and pm.sequence(b).replica is None
    pm.check_invariants()
    assert PageManager.from_state_dict(pm.metadata, pm.state_dict()).state_dict() == pm.state_dict()


def test_an_object_whose_index_and_int_disagree_is_read_once():
    class Two:  # passes the bound as 1, would be committed as -4 if converted again
        def __index__(self):
            return 1

        def __int__(self):
            return -4

    pm = make()
    [a] = pm.claim(1)
    prefill(pm, a, list(range(9)))
    pm.commit(pm.schedule([a], [Two()]))
    assert pm.length(a) == 10
    pm.commit(pm.schedule_decode([a], 2), [[7, 8]], [Two()])  # a decode loop's count of tokens written
    assert pm.length(a) == 11
    pm.check_invariants()


def test_fork_keeps_reserved_pages_private_and_commit_into_shared_page_fails():
    pm = make()
    [a] = pm.claim(1)
    pm.commit(pm.schedule([a], [8]), [[1, 2, 3, 4, 5]])  # the partly written page 1 stays a's
    b = pm.fork(a)
    assert pm.pages(a) == [0, 1] and pm.pages(b) == [0, 1] and pm.sequence(b).capacity == 8
    before = pm.state_dict()
    with pytest.raises(ValueError, match="shares since a fork"):
        pm.step([a], [6])
    assert pm.state_dict() == before


def test_copies_of_pending_copies_read_the_original():
    pm = make()
    [a] = pm.claim(1)
    prefill(pm, a, [1, 2, 3, 4, 5, 6, 7])
    b = pm.fork(a)
    pm.truncate(b, 6)  # b rewrites inside the shared page 1: 1 -> 2
    c = pm.fork(b)  # c shares page 2, whose copy is still pending
    pm.truncate(c, 5)  # 2 holds nothing yet: c must copy from page 1
    src, dst = pm.clone().take_work().copies()  # the pending copies, read on a copy of the manager
    assert src[0].tolist() == [1, 1] and dst[0].tolist() == [2, 3]
    pm.release(b)
    pm.release(c)  # pages 2 and 3 freed: their copies are moot
    assert pm.take_work().num_copies == 0


def test_scrub_released_reports_freed_and_evicted_pages():
    pm = make(scrub_released=True)
    a, b = pm.claim(2)
    prefill(pm, a, list(range(6)))  # page 0 full (cached on release), page 1 partial
    pm.release(a)
    assert pm.take_work().scrubs()[0].tolist() == [1]
    plan = pm.schedule([b], [16])  # 1, 2, 3, then ... 4 (free first)
    assert pm.pages(b) == [1, 2, 3, 4] and plan.work.scrubs()[0].tolist() == []
    c, d = pm.claim(2)
    pm.schedule([c], [16])
    plan = pm.schedule([d], [8])  # pages 9 then the cached page 0 (evicted -> scrubbed)
    assert pm.pages(d) == [9, 0] and plan.work.scrubs()[0].tolist() == [0] and pm.metrics.scrubs == 2
    assert pm.take_work().empty


# ---- data-parallel replicas --------------------------------------------------------------------------
def test_replicas_bind_sequences_and_keep_prefixes_inside():
    pm = make(pages=10, shards=2)  # replica 0: pages 0-4, replica 1: pages 5-9
    a, b, c, d = pm.claim(4)
    prompt = list(range(9))
    prefill(pm, a, prompt)
    assert pm.sequence(a).replica == 0 and pm.pages(a) == [0, 1, 2]
    pm.commit(pm.schedule([b], [4]))
    assert pm.sequence(b).replica == 1 and pm.pages(b) == [5]  # least loaded
    assert pm.sequence(c).replica is None
    assert prefill(pm, c, prompt) == 8 and pm.sequence(c).replica == 0  # the replica holding the prefix
    assert prefill(pm, d, prompt) == 8 and pm.pages(c) == [0, 1, 3] and pm.pages(d) == [0, 1, 4]
    before = pm.state_dict()
    with pytest.raises(CacheFullError, match="needs 1 page in data-parallel replica 0 but only 0") as err:
        pm.schedule([b, c], [8, 7])  # replica 1 has room, but c lives in replica 0
    assert (err.value.replica, pm.state_dict()) == (0, before)
    pm.release(d)
    pm.schedule([b, c], [8, 7])
    assert pm.pages(b) == [5, 6, 7] and pm.pages(c) == [0, 1, 3, 4]
    pm.check_invariants()


# ---- sizing -----------------------------------------------------------------------------------------
def test_sizing_helpers():
    meta = make_meta(batch=4, max_len=16)
    per_page = meta.page_bytes_per_device * meta.num_hidden_layers  # 2 * 2 heads * 4 tokens * 8 * 2 bytes * 2 layers
    assert per_page == 512
    assert PageManager.estimated_memory_size(meta, 10**9) == 4 * 4 * per_page  # all the batch can use
    assert PageManager.estimated_memory_size(meta, 10 * per_page + 7) == 10 * per_page  # all memory holds
    assert PageManager.estimated_memory_size(meta, 10**9, max_batch_size=2, max_seq_len=5) == 2 * 2 * per_page
    assert PageManager.infer_optimal_batch_size(meta, 100 * per_page) == 25
    assert PageManager.infer_optimal_batch_size(meta, 100 * per_page, max_seq_len=8) == 50
    assert PageManager.infer_optimal_batch_size(make_meta(pages=10, shards=2), 10 * per_page) == 4
    with pytest.raises(ValueError, match="one sequence needs 4"):
        PageManager.infer_optimal_batch_size(meta, 3 * per_page)


# ---- invariants, persistence, determinism ------------------------------------------------------------
def test_check_invariants_reports_a_bug():
    pm = make()
    [a] = pm.claim(1)
    prefill(pm, a, list(range(9)))
    pm.check_invariants()
    pm._groups[0].pool.refcount[0] += 1  # broken on purpose, below the public calls (which cannot)
    with pytest.raises(InvariantError, match="easykv bug.*page 0 has refcount 2 but 1 owners"):
        pm.check_invariants()


def _busy_manager(**kw):
    pm = make(scrub_released=True, **kw)
    a, b, c = pm.claim(3)
    prefill(pm, a, list(range(10)), salt="x")
    b2 = pm.fork(a)
    prefill(pm, b, list(range(7)))
    pm.commit(pm.schedule([c], [3]), [[1, 2]])  # 3 planned, 2 written
    pm.truncate(b2, 9)  # b2 rewrites inside the partial page it shares with a: a pending copy
    pm.release(b)
    return pm


def test_state_dict_round_trip_is_exact_and_behaves_the_same():
    pm = _busy_manager()
    state = pm.state_dict()
    restored = PageManager.from_state_dict(pm.metadata, json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    works = []
    for m in (pm, restored):
        [x] = m.claim(1)
        m.match_prefix(x, list(range(10)), salt="x")
        works.append(m.schedule([x], [6]).work)
    assert restored.state_dict() == pm.state_dict()
    # the work pending in the state travels with it: b2's copy 2 -> 6 and b's released page 4
    assert [(w.copies()[0][0].tolist(), w.copies()[1][0].tolist(), w.scrubs()[0].tolist()) for w in works] == [
        ([2], [6], [4])] * 2


def test_from_state_dict_refuses_other_pools_and_damage():
    state = _busy_manager().state_dict()
    with pytest.raises(ValueError, match="restore with the metadata"):
        PageManager.from_state_dict(make_meta(pages=12), state)
    damaged = json.loads(json.dumps(state))
    damaged["sequences"][0]["pages"][0] = 9
    with pytest.raises(ManagerStateError, match="page 9 has refcount"):
        PageManager.from_state_dict(make_meta(), damaged)
    with pytest.raises(ManagerStateError, match="field .top level.: must have exactly the keys"):
        PageManager.from_state_dict(make_meta(), {"format": "other"})


def test_same_calls_give_same_pages_in_every_process():
    script = (
        "import json, sys; sys.path.insert(0, '.'); from tests.manager import test_manager as t;"
        "print(json.dumps(t._busy_manager(shards=2).state_dict(), sort_keys=True))"
    )
    root = Path(__file__).resolve().parents[2]  # the checkout
    outs = {
        subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed, "JAX_PLATFORMS": "cpu"}).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1 and json.loads(outs.pop()) == json.loads(json.dumps(_busy_manager(shards=2).state_dict(),
                                                                               sort_keys=True))


# ---- bad input: a precise error and no change of state ----------------------------------------------------
BAD_CALLS = [
    (lambda pm: pm.release(3), UnknownSequenceError, "sequence id 3 is not claimed"),
    (lambda pm: pm.release(42), UnknownSequenceError, "42 is not claimed"),
    (lambda pm: pm.schedule([0], -1), ValueError, r"num_tokens must be a non-negative int, got -1 \(valid: 0\.\.16"),
    (lambda pm: pm.schedule([0, 1], [1, 2, 3]), ValueError, "one per sequence"),
    (lambda pm: pm.schedule([0], 12), ValueError, "past max_sequences=16"),
    (lambda pm: pm.schedule([0, 0], 1), ValueError, "repeats id 0"),
    (lambda pm: pm.schedule(["a"], 1), ValueError, r"seq_ids must hold ints, got dtype <U1"),
    (lambda pm: pm.schedule(0, 1), ValueError, r"seq_ids must have 1 dimension"),
    (lambda pm: pm.schedule([0], [2], pad_tokens_to=1), ValueError, "pad_tokens_to=1 is below the 2 new tokens"),
    (lambda pm: pm.schedule_decode([1], num_steps=0), ValueError, "num_steps must be a positive int"),
    (lambda pm: pm.step([0], [[1, 2, 3, 4]]), ValueError, "room for 3 more tokens but 4"),
    (lambda pm: pm.step([0, 1], [1]), ValueError, r"shape \(1,\)"),
    (lambda pm: pm.step([0], [[-5]]), ValueError, r"token_ids\[0\]\[0\] = -5 is out of range"),
    (lambda pm: pm.step([0], 5), ValueError, "token_ids=5 is not a list or array"),
    (lambda pm: pm.step([1], [[1.5]]), ValueError, r"token_ids\[0\]\[0\] must be a non-negative int, got 1\.5"),
    (lambda pm: pm.step([1], [[1]]), ValueError, "room for 0 more tokens but 1 were committed"),
    (lambda pm: pm.match_prefix(0, [1, 2]), ValueError, "call match_prefix right after claim"),
    (lambda pm: pm.match_prefix(1, list(range(17))), ValueError, "17 tokens.*max_sequences=16"),
    (lambda pm: pm.match_prefix(1, [1, 2], salt=1.5), ValueError, "salt=1.5"),
    (lambda pm: pm.match_prefix(1, [[1, 2]]), ValueError, r"token_ids must have 1 dimension"),
    (lambda pm: pm.external_claim([0]), ValueError, "already claimed"),
    (lambda pm: pm.external_claim([2, 2]), ValueError, "repeat an id"),
    (lambda pm: pm.external_claim([4]), ValueError, r"seq_ids\[0\] = 4 is out of range \(valid: 0\.\.3"),
    (lambda pm: pm.external_claim(2), ValueError, r"pass \[2\]"),
    (lambda pm: pm.claim(-1), ValueError, "n must be a non-negative int"),
    (lambda pm: pm.fork(2), UnknownSequenceError, "2 is not claimed"),
    (lambda pm: pm.contains("0"), ValueError, r"sequence id must be an int, got '0' \(a str\)"),
]


@pytest.mark.parametrize("call,error,message", BAD_CALLS)
def test_bad_input_raises_precisely_and_changes_nothing(call, error, message):
    pm = make()
    a, b = pm.claim(2)
    pm.commit(pm.schedule([a], [5]), [[1, 2, 3, 4, 5]])  # a: 5 tokens, room for 3 more
    before = pm.state_dict()
    with pytest.raises(error, match=message):
        call(pm)
    assert pm.state_dict() == before
    pm.check_invariants()


def test_double_release_is_an_unknown_sequence():
    pm = make()
    [a] = pm.claim(1)
    pm.release(a)
    with pytest.raises(KeyError):
        pm.release(a)


def test_page_table_pads_unassigned_pages():
    pm = make()
    a, b = pm.claim(2)
    pm.schedule([a], [5])
    table = pm.page_table([b, a])
    assert table.tolist() == [[PAD_PAGE] * 4, [0, 1, PAD_PAGE, PAD_PAGE]]
    table[1, 0] = 7  # a copy: the manager is unaffected
    assert pm.pages(a) == [0, 1]
    assert "2/4 sequences" in repr(pm)
