"""Writes: random K/V through every write path, on every page layout, compared bitwise with a
numpy model of the whole pool; dropped-and-counted slots under jit; no collectives in the
compiled write; every bad input raises before anything is written."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from easykv import PagedAttentionMetadata
from easykv.storage.cache import write_all
from tests.support.pools import (
    HEAD_DIM,
    LAYERS,
    PAGES,
    SLOTS,
    PoolModel,
    assert_unchanged,
    new_cache,
    random_tokens,
    setup,
    slot,
    snapshot,
)

T = 12  # every write in these tests uses a 12-token axis: one compile per layout and form
LAYOUT_NAMES = ["single", "heads", "replicated", "dp"]


def tables(rng):
    """Three sequences' page-table rows over a random permutation of the pool."""
    perm = rng.permutation(PAGES)
    return {"a": perm[0:4], "b": perm[4:8], "c": perm[8:12]}


def expect_writes(model, keys, values, rows, tokens):
    """tokens: (token row, sequence, position) of each real token; the rest is padding."""
    for t, seq, pos in tokens:
        model.put(keys, values, t, slot(rows[seq], pos), seq=seq, pos=pos)


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_cache_write_all_paths_round_trip(layout):
    rng = np.random.default_rng(10)
    _, _, meta = setup(layout)
    heads = meta.num_kv_heads
    cache, model, rows = new_cache(layout), PoolModel(meta), tables(rng)
    if layout == "dp":  # the sequences use pages of both replicas' slices
        used = np.concatenate(list(rows.values()))
        assert (used < PAGES // 2).any() and (used >= PAGES // 2).any()

    def kv():
        return random_tokens(rng, (LAYERS, T, heads, HEAD_DIM)), random_tokens(rng, (LAYERS, T, heads, HEAD_DIM))

    # 1. prefill a[0:10] (crosses two page boundaries), stacked (layers, T, heads, dim) arrays.
    k, v = kv()
    md = PagedAttentionMetadata.for_prefill(rows["a"][:3], 10, cache_metadata=meta, padded_length=T)
    cache, dropped = cache.write(k, v, md)
    assert int(dropped) == 0
    expect_writes(model, k, v, rows, [(t, "a", t) for t in range(10)])
    model.check_pool(cache)

    # 2. chunked prefill a[10:15] (start > 0, crosses the boundary at 12), list-of-layers form.
    k, v = kv()
    md = PagedAttentionMetadata.for_prefill(rows["a"], 5, start=10, cache_metadata=meta, padded_length=T)
    cache, dropped = cache.write([k[0], k[1]], (v[0], v[1]), md)
    assert int(dropped) == 0
    expect_writes(model, k, v, rows, [(t, "a", 10 + t) for t in range(5)])
    model.check_pool(cache)

    # 3. mixed: a decodes its last token, b prefills 6, c prefills 3; padded to 12 tokens.
    k, v = kv()
    table = np.stack([rows["a"], rows["b"], rows["c"]])
    md = PagedAttentionMetadata.for_mixed(table, [15, 0, 0], [1, 6, 3], cache_metadata=meta, pad_tokens_to=T,
                                          pad_seqs_to=4)
    cache, dropped = cache.write(k, v, md)
    assert int(dropped) == 0
    expect_writes(model, k, v, rows,
                  [(0, "a", 15)] + [(1 + i, "b", i) for i in range(6)] + [(7 + i, "c", i) for i in range(3)])
    model.check_pool(cache)

    # 4. decode: b at 6, c at 3; the other 10 rows are padding with no pages.
    k, v = kv()
    table = np.full((T, 4), -1)
    table[3], table[7] = rows["b"], rows["c"]
    pos = np.full(T, -1)
    pos[3], pos[7] = 6, 3
    md = PagedAttentionMetadata.for_decode(table, pos, cache_metadata=meta)
    cache, dropped = cache.write(k, v, md)
    assert int(dropped) == 0
    expect_writes(model, k, v, rows, [(3, "b", 6), (7, "c", 3)])
    model.check_pool(cache)

    # Read back: a is 16 tokens (a full sequence), b 7, c 4 (exactly one page).
    model.check_gather(cache, 1, "a", rows["a"])
    model.check_gather(cache, 0, "b", rows["b"])
    model.check_gather(cache, 1, "c", rows["c"])
    for view in cache:  # placement survives the writes
        assert view.key_pages.sharding == new_cache(layout)[0].key_pages.sharding


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_view_writes_update_the_view_in_place(layout):
    rng = np.random.default_rng(11)
    _, _, meta = setup(layout)
    heads = meta.num_kv_heads
    cache, model, rows = new_cache(layout), PoolModel(meta), tables(rng)
    view = cache[1]

    def kv():
        # (layers, T, ...) arrays for the model; only layer 1 is written, so layer 0 is zero.
        k, v = random_tokens(rng, (LAYERS, T, heads, HEAD_DIM)), random_tokens(rng, (LAYERS, T, heads, HEAD_DIM))
        k[0], v[0] = 0, 0
        return k, v

    k, v = kv()
    md = PagedAttentionMetadata.for_prefill(rows["a"][:2], 7, start=0, cache_metadata=meta, padded_length=T)
    v1 = view.write_prefill_to_cache(k[1], v[1], md)
    expect_writes(model, k, v, rows, [(t, "a", t) for t in range(7)])

    k, v = kv()
    table = np.full((T, 4), -1)
    table[0], table[5] = rows["a"], rows["b"]
    pos = np.full(T, -1)
    pos[0], pos[5] = 7, 0
    v2 = v1.write_decodes_to_cache(k[1], v[1], PagedAttentionMetadata.for_decode(table, pos, cache_metadata=meta))
    expect_writes(model, k, v, rows, [(0, "a", 7), (5, "b", 0)])

    k, v = kv()
    md = PagedAttentionMetadata.for_mixed(
        np.stack([rows["a"], rows["b"]]), [8, 1], [5, 4], cache_metadata=meta, pad_tokens_to=T
    )
    v3 = v2.write_mixed_to_cache(k[1], v[1], md)
    expect_writes(model, k, v, rows, [(i, "a", 8 + i) for i in range(5)] + [(5 + i, "b", 1 + i) for i in range(4)])

    # EasyDeL's contract: each write updates the view itself and returns it, and the cache the
    # view came from sees every write; putting the view back (as EasyDeL's models do) is accepted.
    assert v1 is view and v2 is view and v3 is view
    cache[1] = v3
    model.check_pool(cache)  # layer 0 untouched (zeros), layer 1 holds exactly the writes
    model.check_gather(cache, 1, "a", rows["a"])
    model.check_gather(v3, 1, "b", rows["b"])
    assert v3.layer_index == 1 and v3.group_key_pages.sharding.is_equivalent_to(cache[0].group_key_pages.sharding, 5)


def test_view_write_inside_jit():
    rng = np.random.default_rng(12)
    _, _, meta = setup("dp")
    cache, model, rows = new_cache("dp"), PoolModel(meta), tables(rng)
    k, v = random_tokens(rng, (LAYERS, T, 8, HEAD_DIM)), random_tokens(rng, (LAYERS, T, 8, HEAD_DIM))
    md = PagedAttentionMetadata.for_prefill(rows["c"], 11, start=2, cache_metadata=meta, padded_length=T)

    @jax.jit
    def step(c, k, v, m):
        for i in range(len(c)):
            c[i] = c[i].write_prefill_to_cache(k[i], v[i], m)
        return c

    out = step(cache, k, v, md)
    expect_writes(model, k, v, rows, [(t, "c", 2 + t) for t in range(11)])
    model.check_pool(out)


# ------------------------------------------------------------------- dropped under jit
@pytest.mark.parametrize("layout", ["heads", "dp"])
def test_out_of_range_slots_under_jit_are_dropped_and_counted(layout):
    rng = np.random.default_rng(13)
    _, _, meta = setup(layout)
    heads = meta.num_kv_heads
    cache, model, rows = new_cache(layout), PoolModel(meta), tables(rng)
    # Mixed form with device arrays: values unknown on the host, so the write cannot refuse.
    md = PagedAttentionMetadata.for_mixed(np.stack([rows["a"], rows["b"]]), [0, 0], [6, 6], cache_metadata=meta)
    slots = np.asarray(md.slot_mapping).copy()
    good = [(t, "a", t) for t in range(6)] + [(6 + t, "b", t) for t in range(6)]
    # One past the pool (would clip to the last slot), far past, negative (would wrap), -2.
    bad = {1: SLOTS, 4: SLOTS + 5, 7: -7, 10: -2, 11: 2**30}
    slots[list(bad)] = list(bad.values())
    slots[9] = -1  # padding: dropped, not counted
    jmd = jax.tree.map(jnp.asarray, md).replace(slot_mapping=jnp.asarray(slots))
    k, v = random_tokens(rng, (LAYERS, T, heads, HEAD_DIM)), random_tokens(rng, (LAYERS, T, heads, HEAD_DIM))
    cache, dropped = cache.write(k, v, jmd)
    assert int(dropped) == len(bad) == 5
    expect_writes(model, k, v, rows, [g for g in good if g[0] not in bad and g[0] != 9])
    model.check_pool(cache)

    # Decode form with device arrays: a page outside the pool, page -2, an unassigned page,
    # a position past num_pages_per_sequence (with a table wide enough to hold a page for
    # it), a position below -1; one good token and padding.
    table = np.full((T, 5), -1)
    table[0] = [PAGES, 0, 0, 0, 0]
    table[1] = [-2, 0, 0, 0, 0]
    table[2] = [-1, -1, -1, -1, -1]
    table[3] = [*rows["c"], rows["a"][0]]
    table[4, 0] = rows["c"][0]
    table[5] = [*rows["c"], 0]
    pos = np.full(T, -1)
    pos[[0, 1, 2, 3, 4, 5]] = [0, 1, 2, 16, -3, 5]
    jmd = PagedAttentionMetadata(decodes_position=jnp.asarray(pos, jnp.int32),
                                 decodes_page_table=jnp.asarray(table, jnp.int32))
    k, v = random_tokens(rng, k.shape), random_tokens(rng, v.shape)
    cache, dropped = cache.write(k, v, jmd)
    assert int(dropped) == 5
    expect_writes(model, k, v, rows, [(5, "c", 5)])
    model.check_pool(cache)


# ------------------------------------------------------------------- compiled HLO
COLLECTIVES = re.compile(r"all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter")


@pytest.mark.parametrize("layout", ["heads", "dp"])
def test_compiled_write_has_no_collectives(layout):
    _, _, meta = setup(layout)
    cache = new_cache(layout)
    keys = jnp.zeros((LAYERS, T, meta.num_kv_heads, HEAD_DIM), jnp.bfloat16)
    hlo = write_all.lower(cache, keys, keys, (jnp.zeros(T, jnp.int32),)).compile().as_text()
    assert "scatter" in hlo  # it is the write
    assert not COLLECTIVES.findall(hlo)
    # The same check on the user-level step: a jitted wrapper around cache.write.
    md = PagedAttentionMetadata.for_decode([[i, -1, -1, -1] for i in range(T)], [0] * T, cache_metadata=meta)
    step = jax.jit(lambda c, k, m: c.write(k, k, m), donate_argnums=0)
    hlo = step.lower(cache, keys, jax.tree.map(jnp.asarray, md)).compile().as_text()
    assert "scatter" in hlo and not COLLECTIVES.findall(hlo)


# ------------------------------------------------------------------- bad input
def test_bad_write_inputs_raise_before_writing():
    rng = np.random.default_rng(14)
    _, _, meta = setup("heads")
    cache, model, rows = new_cache("heads"), PoolModel(meta), tables(rng)
    k, v = random_tokens(rng, (LAYERS, T, 8, HEAD_DIM)), random_tokens(rng, (LAYERS, T, 8, HEAD_DIM))
    md = PagedAttentionMetadata.for_prefill(rows["a"], 12, cache_metadata=meta)
    cache, _ = cache.write(k, v, md)
    expect_writes(model, k, v, rows, [(t, "a", t) for t in range(12)])
    before = snapshot(cache)

    f32 = k.astype(np.float32)
    past_limit = PagedAttentionMetadata(  # hand-built, bypassing the validated constructors
        prefill_length=np.asarray(T, np.int32),
        prefill_position=np.arange(8, 8 + T, dtype=np.int32),  # positions 8..19 > 16
        prefill_page_table=np.asarray([*rows["b"], rows["c"][0]], np.int32),
    )
    table = np.zeros((T, 4), np.int32)
    table[3, 0] = PAGES  # token 3's page is outside the pool; the others write slot 0
    outside = PagedAttentionMetadata(decodes_position=np.zeros(T, np.int32), decodes_page_table=table)
    unassigned = PagedAttentionMetadata(  # token 5 is real but its row has no pages
        decodes_position=np.asarray([-1] * 5 + [2] + [-1] * 6, np.int32),
        decodes_page_table=np.full((T, 4), -1, np.int32),
    )
    bad_slots = PagedAttentionMetadata(slot_mapping=np.asarray([0] * 11 + [SLOTS], np.int32))
    cases = [
        ((k[:, :11], v, md),
         r"keys has shape \(11, 8, 8\), expected \(num_tokens, num_kv_heads, head_dim\) = \(12, 8, 8\)"),
        ((k[:, :, :4], v, md), r"keys has shape \(12, 4, 8\), expected .* = \(12, 8, 8\)"),
        ((k, v[:, :, :, :4], md), r"values has shape \(12, 8, 4\)"),
        ((f32, v, md), r"keys has dtype float32, but the cache stores bfloat16"),
        ((k, v.astype(np.float16), md), r"values has dtype float16, but the cache stores bfloat16"),
        ((k[:1], v[:1], md), r"keys holds 1 layers but the cache has num_hidden_layers=2"),
        ((k, [v[0], v[1], v[1]], md), r"values holds 3 layers"),
        ((k[0], v[0], md), r"keys must be \(num_layers, num_tokens, num_kv_heads, head_dim\)"),
        (([k[0], f32[1]], v, md), r"keys\[1\] has dtype float32"),
        ((k, v, outside), r"token 3 would be written to slot -2, outside the pool's 96 slots"),
        ((k, v, unassigned), r"token 5 would be written to slot -2"),
        ((k, v, past_limit), r"token 8 would be written to slot -2"),
        ((k, v, bad_slots), r"token 11 would be written to slot 96"),
        ((k, v, PagedAttentionMetadata.init_empty()), r"empty \(init_empty\)"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            cache.write(*args)
        assert_unchanged(cache, before)
    model.check_pool(cache)

    view = cache[0]
    decode = PagedAttentionMetadata.for_decode([rows["b"]], [0], cache_metadata=meta)
    view_cases = [
        (lambda: view.write_prefill_to_cache(k[0, :1], v[0, :1], decode), r"needs prefill metadata"),
        (lambda: view.write_decodes_to_cache(k[0], v[0], md), r"needs decode metadata"),
        (lambda: view.write_mixed_to_cache(k[0], v[0], md), r"needs mixed metadata"),
        (lambda: view.write_decodes_to_cache(k[0], v[0, :1], decode),
         r"key has shape \(12, 8, 8\), expected .* = \(1, 8, 8\)"),
        (lambda: view.write_decodes_to_cache(k[0, :1], f32[0, :1], decode), r"value has dtype float32"),
        (lambda: view.write_prefill_to_cache(k[0], v[0], past_limit), r"token 8 would be written to slot -2"),
        (lambda: view.write_decodes_to_cache(k[0], v[0], outside), r"token 3 would be written"),
        (lambda: view.write_tokens(k[0, :2], v[0, :2], [5, SLOTS]), r"token 1 would be written to slot 96"),
        (lambda: view.write_tokens(k[0, :2], v[0, :2], np.array([[5, 6]])), r"slots must have 1 dimension"),
    ]
    for call, match in view_cases:
        with pytest.raises(ValueError, match=match):
            call()
        assert_unchanged(cache, before)
    model.check_pool(cache)


def test_float32_cache_round_trip():
    rng = np.random.default_rng(15)
    _, _, meta = setup("dp", "float32")
    cache, model, rows = new_cache("dp", "float32"), PoolModel(meta), tables(rng)
    k = random_tokens(rng, (LAYERS, T, 8, HEAD_DIM), "float32")
    v = random_tokens(rng, k.shape, "float32")
    md = PagedAttentionMetadata.for_prefill(rows["b"], 9, start=3, cache_metadata=meta, padded_length=T)
    cache, dropped = cache.write(k, v, md)
    assert int(dropped) == 0 and cache[0].key_pages.dtype == np.float32
    expect_writes(model, k, v, rows, [(t, "b", 3 + t) for t in range(9)])
    model.check_pool(cache)
    with pytest.raises(ValueError, match=r"keys has dtype bfloat16, but the cache stores float32"):
        cache.write(k.astype(jnp.bfloat16), v, md)
