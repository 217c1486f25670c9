"""easykv.integrations.easydel.runtime_from_easydel without EasyDeL installed: EasyDeL 0.3's
per-step RaggedPagesMetadata fields -> easykv's ragged form (a RaggedStep), checked against a plain loop, also
for crafted metadata (query_start_loc out of order or off the token axis, page ids outside the
pool or the row), and padding tokens (before query_start_loc[0], past the real sequences)
written through a cache, checked bit for bit against a numpy model of the pool."""

import re
import types

import jax
import numpy as np
import pytest

from easykv import PagedAttentionCacheMetaData, PagedAttentionMetadata, PageManager
from easykv.integrations._easydel_runtime import easydel_fields_from_easykv
from easykv.integrations.easydel import runtime_from_easydel
from easykv.step.ragged import RaggedStep
from tests.support import pools

PAGE, PAGES, TOKENS = 4, 16, 12


def expected(qsl, ctx, table, num):
    """Per token: (position, slot) from a plain loop; -1/-1 for a token no real sequence holds."""
    pos, slots = np.full(TOKENS, -1), np.full(TOKENS, -1)
    if any(not 0 <= qsl[b] <= qsl[b + 1] <= TOKENS for b in range(num)):
        return pos, slots  # ranges out of order or off the token axis: the whole step is padding
    for b in range(num):
        lo, hi = qsl[b], qsl[b + 1]
        for t in range(lo, hi):
            p = ctx[b] - (hi - t)
            if p < 0:
                continue
            pos[t] = p
            col = p // PAGE
            page = table[b][col] if col < table.shape[1] else -1
            slots[t] = page * PAGE + p % PAGE if 0 <= page < PAGES else -2
    return pos, slots


def fields(qsl, ctx, table, num):
    return types.SimpleNamespace(**{name: np.asarray(a, np.int32) for name, a in zip(
        ("query_start_loc", "context_lens", "pages_tables", "num_seqs"), (qsl, ctx, table, [num]))})


def convert(qsl, ctx, table, num, *, tokens=TOKENS, page=PAGE, pages=PAGES, traced=True, **kw):
    """runtime_from_easydel of these fields: traced (as in EasyDeL's jitted step) or on numpy."""
    def step(q, c, tab, n):
        md = types.SimpleNamespace(query_start_loc=q, context_lens=c, pages_tables=tab, num_seqs=n)
        return runtime_from_easydel(md, num_tokens=tokens, page_size=page, num_pages=pages, **kw)

    md = fields(qsl, ctx, table, num)
    args = (md.query_start_loc, md.context_lens, md.pages_tables, md.num_seqs)
    return jax.jit(step)(*args) if traced else step(*args)


def run(qsl, ctx, table, num):
    step_meta = convert(qsl, ctx, table, num)
    return np.asarray(step_meta.positions), np.asarray(step_meta.slot_mapping)


@pytest.mark.parametrize("seed", range(40))
def test_random_steps_match_a_plain_loop(seed):
    rng = np.random.default_rng(seed)
    seqs = 3
    counts = rng.integers(0, 5, seqs)
    qsl = rng.integers(0, 3) + np.concatenate([[0], np.cumsum(counts)])  # tokens before qsl[0]: padding
    if seed % 5 == 2:  # crafted: ranges out of order, or past the token axis
        qsl[1:] = rng.permutation(qsl[1:]) if seed % 2 else qsl[1:] + rng.integers(0, 20)
    ctx = counts + rng.integers(0, 6, seqs)
    table = rng.permutation(PAGES)[: seqs * 3].reshape(seqs, 3)
    if seed % 4 == 1:
        table[rng.integers(seqs), rng.integers(3)] = rng.choice([-1, PAGES, 2**30])
    num = int(rng.integers(1, seqs + 1))
    pos, slots = run(qsl, ctx, table, num)
    want_pos, want_slots = expected(qsl, ctx, table, num)
    real = want_pos >= 0
    np.testing.assert_array_equal(pos, np.where(real, want_pos, -1))
    # padding tokens are dropped (any negative slot), pages outside the pool or row invalid
    np.testing.assert_array_equal(slots[real] < 0, want_slots[real] < 0)
    np.testing.assert_array_equal(slots[real & (want_slots >= 0)], want_slots[real & (want_slots >= 0)])
    assert (slots[~real] < 0).all()


def test_query_start_loc_out_of_order_writes_nothing():
    table = np.array([[0, 1, 2], [5, 6, 7], [8, 9, 10]], np.int32)
    # sequence 2 claims tokens 2..7 while sequence 0 holds 0..5: overlapping ranges would put a
    # token of sequence 0 into sequence 2's pages (or the reverse); the step is dropped instead
    pos, slots = run([0, 6, 2, 8], [6, 3, 6], table, 3)
    assert (pos == -1).all() and (slots < 0).all()
    # the same ranges in order are written
    pos, slots = run([0, 2, 6, 8], [2, 4, 2], table, 3)
    np.testing.assert_array_equal(pos[:8], [0, 1, 0, 1, 2, 3, 0, 1])
    np.testing.assert_array_equal(slots[:8], [0, 1, 20, 21, 22, 23, 32, 33])


def test_padding_tokens_belong_to_no_sequence():
    table = np.array([[0, 1, 2], [5, 6, 7], [8, 9, 10], [11, 12, 13]], np.int32)
    # tokens 0, 1: before query_start_loc[0]; sequence 0 holds 2..4, sequence 1 no new token,
    # sequence 2 token 5; 6.. are past the real sequences; sequence 3 is inactive (its start,
    # 1, is EasyDeL's free padding and overlaps sequence 0's range)
    qsl, ctx, num = [2, 5, 5, 6, 1], [5, 4, 1, 9], 3
    want_pos = [-1, -1, 2, 3, 4, 0] + [-1] * 6
    want_slots = [-1, -1, 2, 3, 1 * PAGE, 8 * PAGE] + [-1] * 6  # pages 0, 0, 1 of row 0; page 8 of row 2
    for traced in (True, False):
        step_meta = convert(qsl, ctx, table, num, traced=traced)
        np.testing.assert_array_equal(step_meta.positions, want_pos)
        np.testing.assert_array_equal(step_meta.slot_mapping, want_slots)
        np.testing.assert_array_equal(step_meta.query_start_loc, [2, 5, 5, 6, 6])  # the inactive one is empty
        np.testing.assert_array_equal(step_meta.context_lens, [5, 4, 1, 0])
        assert int(step_meta.num_seqs) == 3


def test_padding_tokens_leave_the_cache_untouched():
    """A real write through the cache: sequence 0's cached positions keep their bytes when a
    step has tokens before query_start_loc[0] and after query_start_loc[num_seqs]."""
    cache, (_, _, meta) = pools.new_cache("single"), pools.setup("single")
    model, rng, tokens = pools.PoolModel(meta), np.random.default_rng(0), 8
    table = np.array([[3, 7, 1, 2], [4, 5, 6, 8], [9, 10, 11, 12]], np.int32)
    steps = [([0, 6, 6, 6], [6, 0, 0], 1),  # sequence 0 caches positions 0..5; tokens 6, 7 pad
             ([3, 4, 5, 0], [7, 1, 4], 2)]  # tokens 0..2 lead, 5..7 trail; sequence 2 inactive
    for qsl, ctx, num in steps:
        shape = (pools.LAYERS, tokens, meta.num_kv_heads, meta.kv_head_dim_size)
        k, v = pools.random_tokens(rng, shape), pools.random_tokens(rng, shape)
        step_meta = convert(qsl, ctx, table, num, tokens=tokens, page=pools.PAGE_SIZE, pages=pools.PAGES,
                     pages_per_sequence=pools.PAGES_PER_SEQ)
        cache, dropped = cache.write(k, v, step_meta)
        assert int(dropped) == 0
        for b in range(num):
            for t in range(qsl[b], qsl[b + 1]):
                model.put(k, v, t, pools.slot(table[b], ctx[b] - (qsl[b + 1] - t)))
    model.check_pool(cache)


@pytest.mark.parametrize("qsl, message", [
    ([0, 13, 13, 13], "query_start_loc[1]=13 is outside 0..12"),  # past the token axis
    ([0, 4, 15, 3], "query_start_loc[2]=15 is outside 0..12"),
    ([-2, 3, 5, 5], "query_start_loc[0]=-2 is outside 0..12"),
    ([0, 6, 2, 8], "query_start_loc[2]=2 is below query_start_loc[1]=6"),
])  # fmt: skip
def test_malformed_starts_are_refused_on_host_and_write_nothing_traced(qsl, message):
    table = np.array([[0, 1, 2], [5, 6, 7], [8, 9, 10]], np.int32)
    ctx = [13, 11, 8]
    with pytest.raises(ValueError, match=re.escape(message)):
        convert(qsl, ctx, table, 3, traced=False)
    # Traced it cannot raise: clipping the start would write sequence 0's tokens at the positions
    # of tokens the step does not hold; the step is padding instead.
    step_meta = convert(qsl, ctx, table, 3)
    assert (np.asarray(step_meta.positions) == -1).all() and (np.asarray(step_meta.slot_mapping) == -1).all()
    assert int(step_meta.num_seqs) == 0 and (np.asarray(step_meta.context_lens) == 0).all()


def test_host_num_seqs_outside_the_sequences_is_refused():
    table = np.zeros((3, 3), np.int32)
    with pytest.raises(ValueError, match=re.escape("num_seqs=4 is outside 0..3")):
        convert([0, 1, 2, 3], [1, 1, 1], table, 4, traced=False)
    # past the real sequences, starts are EasyDeL's free padding: never refused
    step_meta = convert([0, 1, 40, -5], [1, 1, 1], table, 1, traced=False)
    np.testing.assert_array_equal(step_meta.query_start_loc, [0, 1, 1, 1])


def test_the_bridge_speaks_the_ragged_form_both_ways():
    """EasyDeL's step becomes a RaggedStep (what the write and attention take as it is, with no
    absent fields to carry), and EasyDeL's fields come from the page manager's RaggedStep and
    from EasyDeL's own class in its mixed form alike; its decode form is refused by name."""
    table = np.array([[3, 7, -1], [0, 1, 2]], np.int32)
    for traced in (True, False):
        step = convert([0, 2, 3], [5, 1], table, 2, traced=traced)
        assert type(step) is RaggedStep and len(jax.tree.leaves(step)) == 6
        assert np.asarray(step.positions)[:3].tolist() == [3, 4, 0]
    meta = PagedAttentionCacheMetaData(batch_size=2, num_hidden_layers=1, num_pages_per_layer=PAGES,
                                       num_pages_per_sequence=3, max_sequences=12, page_size=PAGE, num_kv_heads=2,
                                       kv_head_dim_size=8, hbm_utilization=0.9)
    m = PageManager(meta)
    seqs = m.claim(2)
    (planned,) = m.schedule(seqs, [5, 2]).metadata
    assert type(planned) is RaggedStep
    for version in ("v2", "v3"):
        ours = easydel_fields_from_easykv(planned, page_size=PAGE, version=version)
        seeds = easydel_fields_from_easykv(PagedAttentionMetadata.from_ragged(planned), page_size=PAGE,
                                           version=version)
        assert ours.keys() == seeds.keys()
        assert all(np.array_equal(ours[k], seeds[k]) for k in ours)
    decode = PagedAttentionMetadata.for_decode(table, [4, 7], cache_metadata=meta)
    with pytest.raises(ValueError, match=r"easydel metadata is built from easykv's ragged form \(a RaggedStep, the "
                                         r"page manager's plan.metadata item, or PagedAttentionMetadata.for_mixed\)"):
        easydel_fields_from_easykv(decode, page_size=PAGE)
