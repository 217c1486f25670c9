"""easykv.integrations.easydel.runtime_from_easydel without EasyDeL installed: EasyDeL 0.3's
per-step RaggedPagesMetadata fields -> easykv's mixed form, checked against a plain loop, also
for crafted metadata (query_start_loc out of order, page ids outside the pool or the row)."""

import types

import jax
import numpy as np
import pytest

from easykv.integrations.easydel import runtime_from_easydel

PAGE, PAGES, TOKENS = 4, 16, 12


def expected(qsl, ctx, table, num):
    """Per token: (position, slot) from a plain loop; -1/-1 for a token no real sequence holds."""
    pos, slots = np.full(TOKENS, -1), np.full(TOKENS, -1)
    qsl = np.clip(qsl, 0, TOKENS)
    if any(qsl[b + 1] < qsl[b] for b in range(num)):
        return pos, slots  # ranges out of order: the whole step is padding
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


def run(qsl, ctx, table, num):
    def step(q, c, tab, n):  # traced: EasyDeL's metadata is a pytree of device arrays in its step
        md = types.SimpleNamespace(query_start_loc=q, context_lens=c, pages_tables=tab, num_seqs=n)
        return runtime_from_easydel(md, num_tokens=TOKENS, page_size=PAGE, num_pages=PAGES)

    rt = jax.jit(step)(*(np.asarray(a, np.int32) for a in (qsl, ctx, table, [num])))
    return np.asarray(rt.positions), np.asarray(rt.slot_mapping)


@pytest.mark.parametrize("seed", range(40))
def test_random_steps_match_a_plain_loop(seed):
    rng = np.random.default_rng(seed)
    seqs = 3
    counts = rng.integers(0, 5, seqs)
    qsl = np.concatenate([[0], np.cumsum(counts)])
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
