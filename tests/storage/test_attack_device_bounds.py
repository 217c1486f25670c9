"""Inside jit no page id, however crafted, reaches another page: page arithmetic never wraps.

Host-built metadata is validated before it reaches a device; metadata built or edited on the
device (``increment_cache_lengths`` in a multi-step loop, a page table computed by a model, a
traced row handed to ``gather_kv``, page ids for copies) cannot be. There every page id is
bounded before it is multiplied by the page size: a page of ``2**30`` must not wrap in int32 onto
page 0, a page of -1 must not read the pool's last page. Invalid tokens are dropped and counted,
invalid reads come back as zeros, invalid copies do nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from easykv import PagedAttentionMetadata, gather_kv
from easykv.step.metadata import INVALID_SLOT, PAD_SLOT, increment_cache_lengths, slots_from_table
from tests.support.pools import LAYERS, PAGE_SIZE, PAGES, bits, new_cache, random_tokens, setup, snapshot

INT32 = np.iinfo(np.int32)
HOSTILE_PAGES = [2**30, 2**31 - 1, 2**29 + 3, PAGES, PAGES + 1, -2, -(2**31), (2**31) // PAGE_SIZE]


def reference_slot(table_row, pos, page_size, num_pages, width):
    """The slot of one token with Python ints: what the device must compute, never wrapping."""
    if pos == -1:
        return PAD_SLOT
    if pos < 0 or pos // page_size >= width:
        return INVALID_SLOT
    page = int(table_row[pos // page_size])
    last_slot_of_page = page * page_size + page_size - 1  # a page is valid only if all its slots are
    if page < 0 or (num_pages is not None and page >= num_pages) or last_slot_of_page > INT32.max:
        return INVALID_SLOT
    return page * page_size + pos % page_size


@given(data=st.data(), page_size=st.sampled_from([1, 3, 4, 16, 64, 2**20]),
       num_pages=st.one_of(st.none(), st.integers(1, 2**31 - 1)))
def test_slots_from_table_matches_exact_integer_arithmetic_on_host_and_device(data, page_size, num_pages):
    width = data.draw(st.integers(1, 6))
    rows = data.draw(st.integers(1, 4))
    page_ids = st.one_of(st.integers(INT32.min, INT32.max), st.sampled_from([-1, 0, 1, 2**30, INT32.max]))
    table = np.array(data.draw(st.lists(st.lists(page_ids, min_size=width, max_size=width), min_size=rows,
                                        max_size=rows)), np.int32)
    positions = np.array(data.draw(st.lists(st.one_of(st.integers(-1, width * page_size + 2),
                                                      st.integers(INT32.min, INT32.max)),
                                            min_size=rows, max_size=rows)), np.int32)
    want = [reference_slot(table[i], int(positions[i]), page_size, num_pages, width) for i in range(rows)]
    host = slots_from_table(table, positions, page_size=page_size, num_pages=num_pages)
    device = jax.jit(lambda t, p: slots_from_table(t, p, page_size=page_size, num_pages=num_pages))(table, positions)
    assert host.tolist() == want
    assert np.asarray(device).tolist() == want


@pytest.mark.parametrize("layout", ["heads", "dp"])
def test_increment_cache_lengths_drops_tokens_on_hostile_pages_inside_jit(layout):
    """A decode loop on device whose page table names pages outside the pool: every such token
    is dropped and counted; no page of the pool changes (page 2**30 used to wrap onto page 0)."""
    _, _, meta = setup(layout)
    cache = new_cache(layout)
    rng = np.random.default_rng(3)
    table = np.full((len(HOSTILE_PAGES), 4), -1, np.int32)
    table[:, 0] = np.arange(len(HOSTILE_PAGES))  # the first token of each sequence: a real page
    table[:, 1] = HOSTILE_PAGES  # the next one: hostile
    step_meta = PagedAttentionMetadata.for_mixed(table[:, :1], [PAGE_SIZE - 1] * len(HOSTILE_PAGES),
                                          [1] * len(HOSTILE_PAGES), cache_metadata=meta)
    step_meta = step_meta.replace(page_table=table)  # crafted after validation, as a device computation could
    keys = random_tokens(rng, (LAYERS, len(HOSTILE_PAGES), meta.num_kv_heads, 8))

    @jax.jit
    def step(cache, step_meta, keys):
        nxt = increment_cache_lengths(step_meta, page_size=PAGE_SIZE)  # no num_pages: bounded by int32 reach
        return cache.write(keys, keys, nxt), nxt

    before = snapshot(cache)
    (cache, dropped), nxt = step(cache, jax.tree.map(jnp.asarray, step_meta), keys)
    assert int(dropped) == len(HOSTILE_PAGES)
    # invalid at once where the page's slots pass int32, else beyond the pool (the write drops them)
    assert all(s == INVALID_SLOT or s >= PAGES * PAGE_SIZE for s in np.asarray(nxt.slot_mapping).tolist())
    for view, (k, v) in zip(cache, before):
        assert np.array_equal(bits(view.key_pages), bits(k)) and np.array_equal(bits(view.value_pages), bits(v))
    nxt = increment_cache_lengths(step_meta, page_size=PAGE_SIZE, num_pages=PAGES)  # the pool known: invalid at once
    assert np.asarray(nxt.slot_mapping).tolist() == [INVALID_SLOT] * len(HOSTILE_PAGES)


def test_the_last_position_cannot_move_on_by_wrapping():
    step_meta = PagedAttentionMetadata(slot_mapping=np.array([0], np.int32), positions=np.array([INT32.max], np.int32),
                                query_start_loc=np.array([0, 1], np.int32), page_table=np.array([[0]], np.int32),
                                context_lens=np.array([1], np.int32), num_seqs=np.asarray(1, np.int32))
    nxt = increment_cache_lengths(step_meta, page_size=PAGE_SIZE)
    assert nxt.slot_mapping.tolist() == [INVALID_SLOT] and nxt.positions.tolist() == [-1]


@pytest.mark.parametrize("layout", ["heads", "dp"])
def test_a_traced_row_never_reads_another_page(layout):
    """gather_kv with a row computed inside jit: unassigned (-1) and out-of-pool ids read zeros,
    never the pool's last page (what jnp.take does with -1) or a wrapped page."""
    _, _, meta = setup(layout)
    cache = new_cache(layout)
    rng = np.random.default_rng(5)
    n = PAGES * PAGE_SIZE  # fill every slot of the pool with nonzero data
    keys = random_tokens(rng, (LAYERS, n, meta.num_kv_heads, 8))
    cache, dropped = cache.write(keys, keys, PagedAttentionMetadata(slot_mapping=np.arange(n, dtype=np.int32)))
    assert int(dropped) == 0

    @jax.jit
    def read(cache, row):
        return gather_kv(cache, 0, row, 4 * PAGE_SIZE)

    row = jnp.array([3, -1, PAGES, 2**30], jnp.int32)
    k, v = read(cache, row)
    k = bits(k)
    assert np.array_equal(k[:PAGE_SIZE], bits(keys[0, 3 * PAGE_SIZE:4 * PAGE_SIZE]))
    assert not k[PAGE_SIZE:].any()  # zeros: nobody's tokens


@pytest.mark.parametrize("layout", ["heads", "dp"])
def test_device_page_ids_for_copies_and_zeroing_touch_only_valid_pages(layout):
    cache = new_cache(layout)
    _, _, meta = setup(layout)
    rng = np.random.default_rng(6)
    n = PAGES * PAGE_SIZE
    keys = random_tokens(rng, (LAYERS, n, meta.num_kv_heads, 8))
    cache, _ = cache.write(keys, keys, PagedAttentionMetadata(slot_mapping=np.arange(n, dtype=np.int32)))
    before = [bits(v.key_pages).copy() for v in cache]
    bad = jnp.array([2**30, -5, PAGES, -(2**31)], jnp.int32)
    cache = cache.copy_pages(bad, jnp.array([1, 2, 3, 4], jnp.int32))  # sources outside: nothing copied
    cache = cache.copy_pages(jnp.array([1, 2, 3, 4], jnp.int32), bad)  # destinations outside: nothing written
    cache = cache.zero_pages(bad)
    for view, k in zip(cache, before):
        assert np.array_equal(bits(view.key_pages), k)


@pytest.mark.parametrize("layout", ["heads", "dp"])
def test_device_slots_outside_the_pool_are_dropped_and_counted(layout):
    cache = new_cache(layout)
    _, _, meta = setup(layout)
    keys = random_tokens(np.random.default_rng(7), (LAYERS, 6, meta.num_kv_heads, 8))
    slots = jnp.array([-2, PAGES * PAGE_SIZE, 2**31 - 1, -(2**31), 2**30, -1], jnp.int32)
    before = snapshot(cache)
    cache, dropped = jax.jit(lambda c, k, s: c.write(k, k, PagedAttentionMetadata(slot_mapping=s)))(cache, keys, slots)
    assert int(dropped) == 5  # every real token outside the pool; -1 is padding
    for view, (k, _) in zip(cache, before):
        assert np.array_equal(bits(view.key_pages), bits(k))
