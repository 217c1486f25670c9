"""PagedAttentionMetadata: exact arrays from the host constructors, mode predicates, bad input.

The pool in these tests: 12 pages of 4 tokens, sequences of at most 16 tokens (4 pages).
A slot is page * 4 + offset.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from easykv import PAD_SLOT, PagedAttentionCacheMetaData, PagedAttentionMetadata
from easykv.step.metadata import INVALID_SLOT, as_mixed

META = PagedAttentionCacheMetaData(
    batch_size=4, num_hidden_layers=1, num_pages_per_layer=12, num_pages_per_sequence=4,
    max_sequences=16, page_size=4, num_kv_heads=8, kv_head_dim_size=8, hbm_utilization=0.9,
)  # fmt: skip


def slots_of(md):
    return np.asarray(token_slots(md, page_size=4, num_pages=12, pages_per_sequence=4))


def token_slots(md, **pool):
    """The slots a write reads: the mixed form's (EasyDeL's forms converted by as_mixed)."""
    return as_mixed(md, **pool).step_meta.slot_mapping


def eq(a, b):
    a = np.asarray(a)
    return a.dtype == np.int32 and a.shape == np.shape(b) and np.array_equal(a, b)


# ---------------------------------------------------------------------- exact constructions
def test_for_prefill_exact():
    md = PagedAttentionMetadata.for_prefill([5, 2, 9], 7, cache_metadata=META, padded_length=10)
    assert eq(md.prefill_length, 7) and np.shape(md.prefill_length) == ()
    assert eq(md.prefill_position, [0, 1, 2, 3, 4, 5, 6, -1, -1, -1])
    assert eq(md.prefill_page_table, [5, 2, 9])
    assert md.is_prefill_mode() and not md.is_decode_mode() and not md.is_mixed_mode()
    assert md.num_tokens == 10
    for absent in (md.decodes_position, md.decodes_page_table, md.slot_mapping, md.page_table):
        assert np.shape(absent) == ()
    # page 5 holds positions 0..3 (slots 20..23), page 2 holds 4..6 (slots 8..10).
    assert eq(slots_of(md), [20, 21, 22, 23, 8, 9, 10, -1, -1, -1])


def test_for_prefill_chunk_with_start():
    md = PagedAttentionMetadata.for_prefill([5, 2, -1], 5, start=3, cache_metadata=META, padded_length=8)
    assert eq(md.prefill_position, [3, 4, 5, 6, 7, -1, -1, -1])
    assert eq(md.prefill_length, 5)
    assert eq(slots_of(md), [23, 8, 9, 10, 11, -1, -1, -1])
    md = PagedAttentionMetadata.for_prefill([5, 2, 9, 0], 16, cache_metadata=META)
    assert eq(md.prefill_position, np.arange(16))
    assert eq(slots_of(md), [20, 21, 22, 23, 8, 9, 10, 11, 36, 37, 38, 39, 0, 1, 2, 3])


def test_for_prefill_empty_chunk():
    md = PagedAttentionMetadata.for_prefill([-1], 0, cache_metadata=META, padded_length=3)
    assert eq(md.prefill_position, [-1, -1, -1]) and eq(slots_of(md), [-1, -1, -1])


def test_for_decode_exact():
    table = [[3, 7, -1, -1], [-1, -1, -1, -1], [11, 0, 4, -1]]
    md = PagedAttentionMetadata.for_decode(table, [5, -1, 9], cache_metadata=META)
    assert eq(md.decodes_page_table, table) and eq(md.decodes_position, [5, -1, 9])
    assert md.is_decode_mode() and not md.is_prefill_mode() and not md.is_mixed_mode()
    assert md.num_tokens == 3
    # pos 5 -> page 7 offset 1; pos 9 -> third page (4) offset 1.
    assert eq(slots_of(md), [29, -1, 17])


def test_for_mixed_exact():
    table = [[3, 7, -1, -1], [10, 1, 6, -1], [2, -1, -1, -1]]
    md = PagedAttentionMetadata.for_mixed(
        table, [5, 0, 3], [1, 9, 0], cache_metadata=META, pad_tokens_to=12, pad_seqs_to=4
    )
    assert md.is_mixed_mode() and not md.is_prefill_mode() and not md.is_decode_mode()
    assert md.num_tokens == 12
    assert eq(md.slot_mapping, [29, 40, 41, 42, 43, 4, 5, 6, 7, 24, -1, -1])
    assert eq(md.positions, [5, 0, 1, 2, 3, 4, 5, 6, 7, 8, -1, -1])
    assert eq(md.query_start_loc, [0, 1, 10, 10, 10])
    assert eq(md.page_table, table + [[-1, -1, -1, -1]])
    assert eq(md.context_lens, [6, 9, 3, 0])
    assert eq(md.num_seqs, 3)
    assert eq(slots_of(md), md.slot_mapping)


def test_for_mixed_unpadded():
    md = PagedAttentionMetadata.for_mixed([[0, 1, 2, 3]], [14], [2], cache_metadata=META)
    assert eq(md.slot_mapping, [14, 15]) and eq(md.positions, [14, 15])
    assert eq(md.query_start_loc, [0, 2]) and eq(md.context_lens, [16]) and eq(md.num_seqs, 1)


def test_for_mixed_random_against_python_reference():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 4))
        table = np.full((n, 4), -1, np.int64)
        perm, used = rng.permutation(12), 0
        cached, new = np.zeros(n, np.int64), np.zeros(n, np.int64)
        for b in range(n):
            total = int(rng.integers(0, 17))
            while used + -(-total // 4) > 12:
                total //= 2
            cached[b] = rng.integers(0, total + 1)
            new[b] = total - cached[b]
            k = -(-total // 4)
            table[b, :k] = perm[used : used + k]
            used += k
        md = PagedAttentionMetadata.for_mixed(table, cached, new, cache_metadata=META, pad_tokens_to=40)
        want_slots, want_pos, want_qsl = [], [], [0]
        for b in range(n):
            for p in range(cached[b], cached[b] + new[b]):
                want_slots.append(table[b, p // 4] * 4 + p % 4)
                want_pos.append(p)
            want_qsl.append(len(want_slots))
        pad = 40 - len(want_slots)
        assert eq(md.slot_mapping, want_slots + [-1] * pad)
        assert eq(md.positions, want_pos + [-1] * pad)
        assert eq(md.query_start_loc, want_qsl)
        assert eq(md.context_lens, cached + new)


def test_init_empty_and_modes():
    md = PagedAttentionMetadata.init_empty()
    assert not (md.is_prefill_mode() or md.is_decode_mode() or md.is_mixed_mode())
    assert all(np.shape(leaf) == () for leaf in jax.tree.leaves(md))
    assert len(jax.tree.leaves(md)) == 11
    with pytest.raises(ValueError, match=r"empty \(init_empty\)"):
        md.num_tokens  # noqa: B018  the property raises
    with pytest.raises(ValueError, match=r"empty \(init_empty\)"):
        token_slots(md, page_size=4, num_pages=12)


def test_metadata_is_a_pytree_jit_can_take():
    md = PagedAttentionMetadata.for_decode([[3, 7, -1, -1]], [5], cache_metadata=META)
    leaves, tree = jax.tree.flatten(md)
    back = jax.tree.unflatten(tree, leaves)
    assert eq(back.decodes_page_table, [[3, 7, -1, -1]]) and back.is_decode_mode()

    @jax.jit
    def slots(m):
        return token_slots(m, page_size=4, num_pages=12, pages_per_sequence=4)

    assert np.array_equal(np.asarray(slots(md)), [29])


def test_traced_slots_mark_bad_tokens_invalid():
    # Inside jit values are unknown on the host: bad tokens get INVALID_SLOT (dropped, counted).
    md = PagedAttentionMetadata(
        decodes_position=jnp.array([5, 3, 20, -1, 0, 4], jnp.int32),
        decodes_page_table=jnp.array(
            [[3, 7, -1, -1, -1], [12, 0, 0, 0, 0], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0], [-1, 0, 0, 0, 0],
             [1, -2, 0, 0, 0]],
            jnp.int32,
        ),
    )
    got = jax.jit(lambda m: token_slots(m, page_size=4, num_pages=12, pages_per_sequence=4))(md)
    # rows: valid; page 12 outside pool; position 20 past 4 pages per sequence; padding;
    # unassigned page; page -2.
    assert np.array_equal(np.asarray(got), [29, INVALID_SLOT, INVALID_SLOT, PAD_SLOT, INVALID_SLOT, INVALID_SLOT])


def test_replace():
    md = PagedAttentionMetadata.for_decode([[3, 7, -1, -1]], [5], cache_metadata=META)
    other = md.replace(decodes_position=np.array([6], np.int32))
    assert eq(other.decodes_position, [6]) and eq(md.decodes_position, [5])


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", [12, 40, -2])
def test_page_ids_outside_pool(bad):
    msg = rf"= {bad} is out of range \(valid: -1\.\.11; page ids of a pool of 12 pages"
    with pytest.raises(ValueError, match=msg):
        PagedAttentionMetadata.for_prefill([0, bad], 2, cache_metadata=META)
    with pytest.raises(ValueError, match=r"page_table\[1, 2\] " + msg):
        PagedAttentionMetadata.for_decode([[0, 1, 2, 3], [0, 1, bad, 3]], [0, 1], cache_metadata=META)
    with pytest.raises(ValueError, match=msg):
        PagedAttentionMetadata.for_mixed([[bad, -1, -1, -1]], [0], [0], cache_metadata=META)


def test_lengths_beyond_the_sequence_limit():
    row = [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"length must be a non-negative int, got 17 \(valid: 0\.\.16; "
                                         r"a sequence holds at most num_pages_per_sequence \* page_size = 16 tokens"):
        PagedAttentionMetadata.for_prefill(row, 17, cache_metadata=META)
    with pytest.raises(ValueError, match=r"start \+ length = 17 reaches 17 tokens"):
        PagedAttentionMetadata.for_prefill(row, 7, start=10, cache_metadata=META)
    with pytest.raises(ValueError, match=r"positions\[1\] = 16 is out of range \(valid: -1\.\.15"):
        PagedAttentionMetadata.for_decode([row, row], [3, 16], cache_metadata=META)
    with pytest.raises(ValueError, match=r"sequence 1: cached \+ new reaches 17 tokens"):
        PagedAttentionMetadata.for_mixed([row, row], [0, 10], [1, 7], cache_metadata=META)
    with pytest.raises(ValueError, match=r"5 pages per sequence but the cache allows num_pages_per_sequence=4"):
        PagedAttentionMetadata.for_prefill([0, 1, 2, 3, 4], 3, cache_metadata=META)
    with pytest.raises(ValueError, match=r"num_pages_per_sequence=4"):
        PagedAttentionMetadata.for_decode([[0, 1, 2, 3, 4]], [0], cache_metadata=META)


def test_unassigned_page_for_a_real_token():
    with pytest.raises(ValueError, match=r"position 4 of row 0 falls on logical page 1, which is unassigned"):
        PagedAttentionMetadata.for_prefill([5, -1], 6, cache_metadata=META)
    with pytest.raises(ValueError, match=r"position 9 of row 1 falls on logical page 2, which is unassigned"):
        PagedAttentionMetadata.for_decode([[1, -1, -1, -1], [2, 3, -1, -1]], [0, 9], cache_metadata=META)
    with pytest.raises(ValueError, match=r"position 4 of row 1 falls on logical page 1, which is unassigned"):
        PagedAttentionMetadata.for_mixed([[1, -1, -1, -1], [2, -1, -1, -1]], [2, 2], [1, 3], cache_metadata=META)
    with pytest.raises(ValueError, match=r"needs logical page 2 but the page table has only 2 columns"):
        PagedAttentionMetadata.for_prefill([5, 6], 9, cache_metadata=META)
    with pytest.raises(ValueError, match=r"needs logical page 1 but the page table has only 1 columns"):
        PagedAttentionMetadata.for_decode([[5]], [4], cache_metadata=META)


def test_mixed_table_too_narrow_is_a_value_error():
    with pytest.raises(ValueError, match=r"sequence 0 reaches 9 tokens, which needs 3 pages.*only 2 columns"):
        PagedAttentionMetadata.for_mixed([[0, 1]], [0], [9], cache_metadata=META)


def test_mismatched_lengths():
    with pytest.raises(ValueError, match=r"page_table has 2 rows but positions has 3 entries"):
        PagedAttentionMetadata.for_decode([[0, -1, -1, -1], [1, -1, -1, -1]], [0, 1, 2], cache_metadata=META)
    with pytest.raises(ValueError, match=r"page_table rows \(1\), cached_lens \(2\) and new_lens \(1\) must agree"):
        PagedAttentionMetadata.for_mixed([[0, -1, -1, -1]], [0, 0], [1], cache_metadata=META)
    with pytest.raises(ValueError, match=r"padded_length=3 is shorter than length=4"):
        PagedAttentionMetadata.for_prefill([0], 4, cache_metadata=META, padded_length=3)
    with pytest.raises(ValueError, match=r"pad_tokens_to=2 is below the 3 new tokens"):
        PagedAttentionMetadata.for_mixed([[0, -1, -1, -1]], [0], [3], cache_metadata=META, pad_tokens_to=2)
    with pytest.raises(ValueError, match=r"pad_seqs_to=1 is below the 2 sequences"):
        PagedAttentionMetadata.for_mixed([[0, -1, -1, -1]] * 2, [0, 0], [0, 0], cache_metadata=META, pad_seqs_to=1)


def test_negative_lengths():
    with pytest.raises(ValueError, match=r"length must be a non-negative int, got -1"):
        PagedAttentionMetadata.for_prefill([0], -1, cache_metadata=META)
    with pytest.raises(ValueError, match=r"start must be a non-negative int, got -4"):
        PagedAttentionMetadata.for_prefill([0], 1, start=-4, cache_metadata=META)
    with pytest.raises(ValueError, match=r"new_lens\[1\] = -1 is out of range \(valid: 0\.\.16"):
        PagedAttentionMetadata.for_mixed([[0, -1, -1, -1]] * 2, [0, 3], [2, -1], cache_metadata=META)
    with pytest.raises(ValueError, match=r"cached_lens\[0\] = -1 is out of range"):
        PagedAttentionMetadata.for_mixed([[0, -1, -1, -1]], [-1], [2], cache_metadata=META)
    with pytest.raises(ValueError, match=r"positions\[1\] = -2 is out of range \(valid: -1\.\.15"):
        PagedAttentionMetadata.for_decode([[0, -1, -1, -1]] * 2, [0, -2], cache_metadata=META)


def test_wrong_kinds_of_arrays():
    with pytest.raises(ValueError, match=r"page_table_row must have 1 dimension\(s\), got shape \(1, 2\)"):
        PagedAttentionMetadata.for_prefill([[0, 1]], 1, cache_metadata=META)
    with pytest.raises(ValueError, match=r"page_table\[0, 0\] must be an int, got 0\.0 \(a float"):
        PagedAttentionMetadata.for_decode([[0.0, 1.0]], [0], cache_metadata=META)
    with pytest.raises(ValueError, match=r"cached_lens\[0\] = 1099511627776 is out of range"):
        PagedAttentionMetadata.for_mixed([[0, -1, -1, -1]], [2**40], [0], cache_metadata=META)
    with pytest.raises(ValueError, match=r"length must be a non-negative int, got True"):
        PagedAttentionMetadata.for_prefill([0], True, cache_metadata=META)


def test_traced_inputs_rejected():
    with pytest.raises(ValueError, match=r"page_table_row is a traced value .*build it on the host"):
        jax.jit(lambda row: PagedAttentionMetadata.for_prefill(row, 3, cache_metadata=META))(jnp.array([0, 1]))
    with pytest.raises(ValueError, match=r"positions is a traced value"):
        jax.jit(lambda p: PagedAttentionMetadata.for_decode([[0, 1, -1, -1]], p, cache_metadata=META))(jnp.array([1]))
    with pytest.raises(ValueError, match=r"new_lens is a traced value"):
        jax.jit(lambda n: PagedAttentionMetadata.for_mixed([[0, -1, -1, -1]], [0], n, cache_metadata=META))(
            jnp.array([1])
        )


def test_constructors_copy_their_inputs():
    row = np.array([5, 2, 9])
    md = PagedAttentionMetadata.for_prefill(row, 7, cache_metadata=META)
    row[0] = 11
    assert eq(md.prefill_page_table, [5, 2, 9])
    table = np.array([[3, 7, -1, -1]])
    md = PagedAttentionMetadata.for_decode(table, [5], cache_metadata=META)
    table[0, 1] = 8
    assert eq(md.decodes_page_table, [[3, 7, -1, -1]])
