"""Each part's own methods alone (no PageManager), over tiny parts with exact ids. Every change the
manager's operations make to a part goes through one of its methods (tests/manager/test_parts_own_state.py
holds that rule over the package), so each of those methods is pinned here: what it changes, and
what it leaves as it was."""

import numpy as np
import pytest

from easykv.manager.allocators import allocator_for
from easykv.manager.page_pool import PagePool
from easykv.manager.prefix_hash import ROOT_DIGEST, salt_digest
from easykv.manager.sequences import SequenceTable
from easykv.spec.groups import LayerGroup
from easykv.step.metadata import PAD_PAGE as PAD

pytestmark = pytest.mark.numpy_only

PS, POOL, BATCH, COLUMNS = 4, 10, 3, 6
DIGESTS = [bytes([i]) * 32 for i in range(4)]


def claimed():
    """A sequence table of three rows, all claimed, unversioned, holding nothing."""
    seqs = SequenceTable(BATCH, PS, COLUMNS * PS)
    seqs.claim([0, 1, 2], None, ROOT_DIGEST)
    return seqs


def table_for(kind="full", window=None):
    """A fresh table of ``kind`` over ten pages of four tokens (with the host tier below it:
    tests/tiers/test_host_group_tier.py)."""
    group = LayerGroup((0,), kind, window, num_pages=POOL)
    return allocator_for(group, index=0, grouped=False, page_size=PS, batch_size=BATCH, pages_per_sequence=COLUMNS,
                         page_shards=1, scrub_released=False)


def refs(table):
    return table.pool.refcount.tolist()


# ---- SequenceTable ----------------------------------------------------------------------------------
def test_advance_moves_the_lengths_and_edits_only_the_rows_that_wrote():
    seqs = claimed()
    edits = seqs.edits.copy()
    seqs.advance(np.array([0, 2]), np.array([5, 0]))
    seqs.advance(np.array([0]), np.array([3]))
    assert seqs.lens.tolist() == [8, 0, 0]
    assert (seqs.edits - edits).tolist() == [2, 0, 0]


def test_columns_are_bound_grown_kept_and_unbound_with_the_last_one():
    seqs = claimed()
    seqs.bind(np.array([0, 1]), 0)
    seqs.grow(np.array([0, 1]), np.array([2, 1]))
    assert seqs.npages.tolist() == [2, 1, 0] and seqs.replica.tolist() == [0, 0, -1]
    seqs.keep_columns(0, 1)
    seqs.keep_columns(1, 0)
    assert seqs.npages.tolist() == [1, 0, 0] and seqs.replica.tolist() == [0, -1, -1]
    seqs.hold_columns(2, 3, 0)
    assert seqs.npages[2] == 3 and seqs.replica[2] == 0
    seqs.hold_columns(2, 0, 0)  # a row of no columns is unbound, whatever replica it was given
    assert seqs.npages[2] == 0 and seqs.replica[2] == -1


def test_rewind_sets_the_length_and_columns_and_counts_an_edit():
    seqs = claimed()
    seqs.bind(np.array([0]), 0)
    seqs.grow(np.array([0]), np.array([3]))
    seqs.advance(np.array([0]), np.array([9]))
    edits = int(seqs.edits[0])
    seqs.rewind(0, 5, 2)
    assert (int(seqs.lens[0]), int(seqs.npages[0]), int(seqs.replica[0])) == (5, 2, 0)
    assert seqs.edits[0] == edits + 1
    seqs.rewind(0, 0, 0)
    assert (int(seqs.lens[0]), int(seqs.npages[0]), int(seqs.replica[0])) == (0, 0, -1)


def test_a_new_root_keeps_the_salt_an_unstarted_row_was_given():
    seqs = claimed()
    tenant, version, root = salt_digest("tenant"), b"v" * 32, b"r" * 32
    seqs.start(0, None, ROOT_DIGEST, tenant)
    assert seqs.hashes.salt[0] == tenant and seqs.hashes.chain[0] == ROOT_DIGEST
    seqs.restart_unstarted(version, root)
    assert seqs.version[0] == version and seqs.hashes.chain[0] == root and seqs.hashes.salt[0] == tenant


def test_a_row_started_on_a_prefix_holds_its_columns_and_logs_its_ids():
    seqs = claimed()
    seqs.start_on_prefix(1, 2, 0, DIGESTS[1], np.arange(11, dtype=np.int32))
    assert (int(seqs.lens[1]), int(seqs.npages[1]), int(seqs.replica[1])) == (8, 2, 0)
    assert seqs.hashes.chain[1] == DIGESTS[1] and seqs.hashes.ids(1, 0, 8).tolist() == list(range(8))
    assert seqs.lens[0] == seqs.lens[2] == 0  # the other rows are untouched


def test_a_resumed_row_stops_hashing_and_forgets_its_floor_once_told():
    seqs = claimed()
    seqs.resume_at(0, 2, 8, 0)
    assert (int(seqs.lens[0]), int(seqs.npages[0]), int(seqs.floor[0]), int(seqs.replica[0])) == (8, 2, 8, 0)
    assert not seqs.hashes.hashable[0] and seqs.hashes.hashable[1]
    seqs.forget_floors(np.array([0]))
    assert seqs.floor.tolist() == [0, 0, 0]


# ---- GroupTable ----------------------------------------------------------------------------------------
def test_hold_puts_holes_before_the_start():
    table = table_for("sliding", 6)
    table.hold(0, 2, [7, 8])
    assert table.table[0].tolist() == [PAD, PAD, 7, 8, PAD, PAD] and table.start.tolist() == [2, 0, 0]
    table.hold(1, 3, [])  # a resumed row: holes only
    assert table.table[1].tolist() == [PAD] * COLUMNS and table.start.tolist() == [2, 3, 0]


def test_new_pages_go_out_in_batch_order_after_each_rows_columns():
    table = table_for()
    table.new_pages(np.array([0, 1]), np.array([0, 0]), np.array([2, 1]), None)
    table.new_pages(np.array([0, 1]), np.array([2, 1]), np.array([1, 1]), None)  # one page each: the decode case
    assert table.table[:2, :3].tolist() == [[0, 1, 3], [2, 4, PAD]]
    assert refs(table) == [1] * 5 + [0] * 5


def test_a_fork_shares_the_held_pages_and_marks_a_partly_filled_last_one():
    table = table_for()
    table.new_pages(np.array([0]), np.array([0]), np.array([3]), None)
    table.fork_row(0, 1, 3, partial=True)
    assert table.table[1, :3].tolist() == [0, 1, 2] and refs(table)[:4] == [2, 2, 2, 0]
    assert table.shared_partial == {2}
    windowed = table_for("sliding", 6)
    windowed.hold(0, 1, windowed.allocate(0, 2))  # column 0 left the window
    windowed.fork_row(0, 2, 3, partial=False)
    assert windowed.table[2, :3].tolist() == [PAD, 0, 1] and windowed.start[2] == 1
    assert refs(windowed)[:2] == [2, 2] and not windowed.shared_partial


def test_dropped_columns_go_back_last_first_and_leave_holes():
    table = table_for()
    table.new_pages(np.array([0]), np.array([0]), np.array([4]), None)
    table.pool.commit(2, DIGESTS[2])
    table.pool.commit(3, DIGESTS[3])
    table.drop_columns(0, 2, 4, stale=False)
    assert table.table[0].tolist() == [0, 1, PAD, PAD, PAD, PAD] and refs(table)[:4] == [1, 1, 0, 0]
    assert table.pool.state_dict()["lru"] == [[3, 2]]  # the last column is evicted first


def test_a_copy_on_write_gives_the_row_a_fresh_page_filled_from_the_shared_one():
    table = table_for()
    table.new_pages(np.array([0]), np.array([0]), np.array([2]), None)
    table.fork_row(0, 1, 2, partial=True)
    assert table.copy_on_write(1, 1, 0) == 1
    assert table.table[1, :2].tolist() == [0, 2] and table.table[0, :2].tolist() == [0, 1]
    assert refs(table)[:3] == [2, 1, 1]
    assert table.take_copies() == {2: 1} and table.copies == {}


# ---- PagePool ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [False, True])
def test_a_pool_keeps_what_it_evicts_only_when_built_to(keep):
    pool = PagePool(2, keep_evicted=keep)
    pool.allocate(0, 2)
    pool.commit(0, DIGESTS[0])
    pool.release([0])
    assert pool.allocate(0, 1) == [0]  # evicted
    assert pool.take_evicted() == ([(0, DIGESTS[0], None)] if keep else [])


def test_scrubbing_applies_to_pages_released_after_it_is_turned_on():
    pool = PagePool(4)
    pool.allocate(0, 2)
    pool.release([0])
    pool.set_scrub_released(True)
    pool.release([1])
    assert pool.pending_scrubs().tolist() == [1] and pool.scrub_released
