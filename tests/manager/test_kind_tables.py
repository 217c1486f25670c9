"""Each per-kind table alone (no PageManager), over a pool of ten pages of four tokens, with exact
page ids, as vLLM's test_single_type_kv_cache_manager.py tests its managers: allocation order,
what a commit of each length releases (the ids freed, the rows with their holes), chunk
boundaries, the prefix lookup of each kind (the window lookup's longest hit, the row it gives),
eviction order, and that a full-attention table never releases."""

import numpy as np
import pytest

from easykv.manager.allocators import (
    ALLOCATORS,
    ChunkedTable,
    FullAttentionTable,
    SlidingWindowTable,
    allocator_for,
)
from easykv.manager.coordinator import GroupCoordinator
from easykv.manager.prefix_hash import ROOT_DIGEST, iter_page_digests
from easykv.manager.sequences import SequenceTable
from easykv.spec.groups import AttentionKind, LayerGroup
from easykv.spec.windows import ChunkedRule, SlidingWindowRule
from easykv.step.metadata import PAD_PAGE as PAD

pytestmark = pytest.mark.numpy_only

PS, POOL, BATCH, COLUMNS = 4, 10, 2, 10


def table_for(kind, window=None):
    """A fresh table of ``kind`` over ten pages of four tokens, two rows of ten columns (with the
    host tier below it: tests/tiers/test_host_group_tier.py)."""
    group = LayerGroup((0,), kind, window, num_pages=POOL)
    return allocator_for(group, index=0, grouped=False, page_size=PS, batch_size=BATCH, pages_per_sequence=COLUMNS,
                         page_shards=1, scrub_released=False)


def grow(table, row, held, n):
    """``row``, holding ``held`` columns, takes ``n`` fresh pages after them (the table's own
    `new_pages`, as the manager's reserve calls it); returns the pages."""
    table.new_pages(np.array([row]), np.array([held]), np.array([n]), None)
    return table.table[row, held:held + n].tolist()


def sequences(*versions):
    """A tiny sequence table whose rows run under ``versions`` (the release reads each row's)."""
    seqs = SequenceTable(BATCH, PS, COLUMNS * PS)
    for row, version in enumerate(versions):
        seqs.claim([row], version, ROOT_DIGEST)
    return seqs


def release(table, seqs, rows, lens, current=None):
    """The table's out-of-window release after a commit leaving ``rows`` at ``lens``."""
    return table.release_out_of_window(np.array(rows), np.array(lens), seqs.version, current).tolist()


def refs(table):
    return table.pool.refcount.tolist()


# ---- the map and the constructor ----------------------------------------------------------------
def test_each_kind_builds_its_own_table_and_refuses_another_kinds_group():
    assert ALLOCATORS == {AttentionKind.FULL: FullAttentionTable, AttentionKind.SLIDING: SlidingWindowTable,
                          AttentionKind.CHUNKED: ChunkedTable}
    sliding, chunked = table_for("sliding", 6), table_for("chunked", 8)
    assert type(sliding) is SlidingWindowTable and sliding.rule == SlidingWindowRule(6) and sliding.windowed
    assert type(chunked) is ChunkedTable and chunked.rule == ChunkedRule(8) and chunked.windowed
    assert type(table_for("full")) is FullAttentionTable and not table_for("full").windowed
    group = LayerGroup((3, 4), "chunked", 8, num_pages=POOL)
    with pytest.raises(ValueError, match=r"SlidingWindowTable keeps the pages of a sliding layer group, but layers "
                                         r"3\.\.4 are chunked; build a group's table with allocator_for\(group\)"):
        SlidingWindowTable.fresh(group, index=0, grouped=False, page_size=PS, batch_size=BATCH,
                                 pages_per_sequence=COLUMNS, page_shards=1, scrub_released=False)


@pytest.mark.parametrize("kind, window", [("full", None), ("sliding", 6), ("chunked", 8)])
def test_allocation_hands_out_the_lowest_free_ids_in_order(kind, window):
    table = table_for(kind, window)
    assert grow(table, 0, 0, 3) == [0, 1, 2]
    assert grow(table, 1, 0, 2) == [3, 4]
    assert grow(table, 0, 3, 1) == [5]
    assert table.held(0, 4) == [0, 1, 2, 5] and table.held(1, 2) == [3, 4]
    assert refs(table) == [1, 1, 1, 1, 1, 1, 0, 0, 0, 0] and table.pool.num_free() == 4
    table.release_pages([4, 1])  # (as a release of their rows would)
    assert table.allocate(0, 3) == [1, 4, 6]  # freed ids come back lowest first


# ---- full attention: nothing leaves --------------------------------------------------------------
def test_a_full_attention_table_never_releases():
    table, seqs = table_for("full"), sequences(None, None)
    grow(table, 0, 0, 10)
    for length in (1, 4, 5, 17, 33, 40):
        assert release(table, seqs, [0, 1], [length, 0]) == [0, 0]
        assert table.row_pages(0, 10) == list(range(10)) and table.start.tolist() == [0, 0]
        assert refs(table) == [1] * 10
    assert table.released_columns(np.array([0, 39, 40])).tolist() == [0, 0, 0]
    assert table.first_needed(np.array([0, 7, 39])).tolist() == [0, 0, 0]
    assert table.first_kept_position(40, 0) == 0


# ---- sliding: one page leaves as one enters -----------------------------------------------------
def test_a_sliding_table_releases_the_pages_that_left_the_window_after_each_commit():
    """Window 6: a sequence of length L reads from L - 5 on, so columns before (L - 5) // 4 go."""
    table, seqs = table_for("sliding", 6), sequences(None, None)
    grow(table, 0, 0, 3)  # positions 0..11
    assert release(table, seqs, [0], [8]) == [0]  # the next query (8) reads 3..8: column 0 still
    assert table.row_pages(0, 3) == [0, 1, 2] and refs(table)[:3] == [1, 1, 1]
    assert release(table, seqs, [0], [9]) == [1]  # reads 4..9: column 0 has left
    assert table.row_pages(0, 3) == [PAD, 1, 2] and table.start.tolist() == [1, 0]
    assert refs(table)[:3] == [0, 1, 1] and table.pool.num_free() == 8
    assert release(table, seqs, [0], [12]) == [1]  # 7..12: nothing more
    assert table.row_pages(0, 3) == [PAD, 1, 2]
    grow(table, 0, 3, 3)  # the freed page 0 comes back first: columns 3..5 hold 0, 3, 4
    assert table.row_pages(0, 6) == [PAD, 1, 2, 0, 3, 4]
    assert release(table, seqs, [0], [21]) == [4]  # one commit of 9 tokens: reads 16..21, columns 1..3 go at once
    assert table.row_pages(0, 6) == [PAD, PAD, PAD, PAD, 3, 4] and table.held(0, 6) == [3, 4]
    assert refs(table) == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0] and table.pool.num_free() == 8


def test_a_sliding_release_of_several_rows_frees_each_rows_own_pages():
    table, seqs = table_for("sliding", 6), sequences(None, None)
    grow(table, 0, 0, 3)
    grow(table, 1, 0, 4)  # pages 3..6
    assert release(table, seqs, [0, 1], [5, 14]) == [0, 2]
    assert table.row_pages(0, 3) == [0, 1, 2] and table.row_pages(1, 4) == [PAD, PAD, 5, 6]
    assert refs(table) == [1, 1, 1, 0, 0, 1, 1, 0, 0, 0] and table.start.tolist() == [0, 2]
    assert table.first_kept_position(14, 0) == 9 and table.first_kept_position(14, 12) == 12
    assert table.first_kept_position(3, 0) == 0


# ---- chunked: a chunk's pages leave together at its end -----------------------------------------
def test_a_chunked_table_releases_a_whole_chunk_at_each_boundary():
    """Chunks of 8 tokens (2 pages): a sequence of length L reads from L - L % 8 on."""
    table, seqs = table_for("chunked", 8), sequences(None, None)
    grow(table, 0, 0, 2)
    assert release(table, seqs, [0], [7]) == [0]  # position 7 is still in chunk 0
    assert table.row_pages(0, 2) == [0, 1]
    assert release(table, seqs, [0], [8]) == [2]  # the next query (8) starts chunk 1: both pages go
    assert table.row_pages(0, 2) == [PAD, PAD] and table.held(0, 2) == [] and refs(table)[:2] == [0, 0]
    grow(table, 0, 2, 2)  # chunk 1 takes the freed pages 0 and 1 again
    assert table.row_pages(0, 4) == [PAD, PAD, 0, 1]
    assert release(table, seqs, [0], [15]) == [2]
    assert table.row_pages(0, 4) == [PAD, PAD, 0, 1]
    grow(table, 0, 4, 3)
    assert release(table, seqs, [0], [25]) == [6]  # one commit across two boundaries (16, 24)
    assert table.row_pages(0, 7) == [PAD, PAD, PAD, PAD, PAD, PAD, 4] and refs(table) == [0, 0, 0, 0, 1] + [0] * 5
    assert table.first_kept_position(25, 0) == 24 and table.first_kept_position(23, 0) == 16


# ---- eviction order -----------------------------------------------------------------------------
def test_released_prefix_pages_are_evicted_tail_first_and_stale_versions_before_current_ones():
    """A window releases a row's pages last column first: its newest leaves first go first; a
    row of another weight version goes ahead of every current one."""
    table, seqs = table_for("sliding", 6), sequences(b"new", b"old")
    grow(table, 0, 0, 4)  # pages 0..3, columns 0..2 will leave at length 17
    grow(table, 1, 0, 3)  # pages 4..6, columns 0..1 will leave at length 13
    for page in (0, 1, 2, 4, 5):
        assert table.pool.commit(page, b"digest-%d" % page, b"new" if page < 4 else b"old")
    assert release(table, seqs, [0, 1], [17, 13], current=b"new") == [3, 2]
    assert table.row_pages(0, 4) == [PAD, PAD, PAD, 3] and table.row_pages(1, 3) == [PAD, PAD, 6]
    assert table.pool.num_cached() == 5 and table.pool.num_free() == 3
    assert table.allocate(0, 3) == [7, 8, 9]  # free pages first
    # then the stale row's pages (its tail first), then the current row's, tail first
    assert table.allocate(0, 5) == [5, 4, 2, 1, 0] and table.pool.num_cached() == 0


# ---- the prefix lookup of each kind -------------------------------------------------------------
DIGESTS = [b"page-%d" % k for k in range(6)]


def cache(table, pages_of):
    """``pages_of``: page index k -> the page to hold ``DIGESTS[k]`` in the prefix cache (held, then
    released: cached and unreferenced). Pages are taken in that order, from page 0."""
    pages = table.allocate(0, len(pages_of))
    for k, page in zip(pages_of, pages):
        assert table.pool.commit(page, DIGESTS[k])
    table.release_pages(pages)
    return pages


def hits(table):
    """The device pool's own lookup (no tier below is asked)."""
    served, found = table.prefix_hits(DIGESTS, 0, tiers=False)
    return served.tolist(), found.tolist()


def test_the_full_attention_lookup_needs_every_page_from_the_first():
    table = table_for("full")
    cache(table, [0, 1, 2, 4])  # pages 0, 1, 2 hold digests 0..2, page 3 holds digest 4; digest 3 is not cached
    served, found = hits(table)
    assert found == [0, 1, 2, -1, 3, -1]
    assert served == [True, True, True, False, False, False]
    assert table.hit_row(np.array(found), 3) == [0, 1, 2]


def test_the_sliding_lookup_finds_the_longest_hit_whose_window_pages_are_cached():
    """Window 6: a hit of k pages (its next query at 4k) needs columns (4k - 5) // 4 .. k - 1,
    so a hit of 5 pages needs only the prompt's pages 3 and 4, though its pages 0 and 1 were
    evicted."""
    table = table_for("sliding", 6)
    cache(table, [2, 3, 4])  # pages 0, 1, 2 hold digests 2, 3, 4
    served, found = hits(table)
    assert found == [-1, -1, 0, 1, 2, -1]
    assert served == [False, False, False, True, True, False]
    assert table.hit_row(np.array(found), 5) == [PAD, PAD, PAD, 1, 2]
    assert table.hit_row(np.array(found), 4) == [PAD, PAD, 0, 1]


def test_the_chunked_lookup_needs_the_last_chunks_pages_and_no_hit_ends_on_a_boundary():
    """Chunks of 8 (2 pages): a hit of k pages needs columns from its chunk's start; one of 2, 4
    or 6 pages would start a new chunk and need no page here, which is no hit."""
    table = table_for("chunked", 8)
    cache(table, [2, 4, 5])  # pages 0, 1, 2 hold digests 2, 4, 5
    served, found = hits(table)
    assert found == [-1, -1, 0, -1, 1, 2]
    assert served == [False, False, True, False, True, False]
    assert table.hit_row(np.array(found), 5) == [PAD, PAD, PAD, PAD, 1]
    assert table.hit_row(np.array(found), 3) == [PAD, PAD, 0]


def test_the_coordinator_takes_the_longest_hit_every_kind_serves():
    """A full and a sliding group side by side: the full group's cached run decides."""
    tokens = np.arange(6 * PS + 1)
    digests = list(iter_page_digests(tokens, PS, 6, b"", ROOT_DIGEST))
    full, sliding = table_for("full"), table_for("sliding", 6)
    for table, ks in ((full, range(4)), (sliding, (2, 3, 4, 5))):
        pages = table.allocate(0, len(ks))
        for k, page in zip(ks, pages):
            table.pool.commit(page, digests[k])
        table.release_pages(pages)
    replica, pages, last = GroupCoordinator([full, sliding]).lookup(tokens, b"", ROOT_DIGEST, -1)
    assert (replica, pages, last) == (0, [[0, 1, 2, 3], [PAD, PAD, 0, 1]], digests[3])
