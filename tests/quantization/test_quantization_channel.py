"""int4-ch: a scale per channel per page. Codes and scales compared code for code with a plain
numpy model of the pages (tests/support/channel_model.py) through every write path, sharded or not;
pages that start over; slot order, padding and dropped slots; the bytes it costs; reads, exports
and the demo's refusal."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv.quantization import Int4ChannelQuantizer, QuantizedPages, get_quantizer, page_head_bytes
from easykv.quantization._logstep import unpack as _unpack
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh
from easykv.storage import writes
from easykv.storage.writes import scatter_page_scaled_local
from tests.support.channel_model import LIMITS, ChannelPages, encode, needed, values
from tests.support.tiers import SLOW, tiered

Q = Int4ChannelQuantizer()


def codes_of(pages: QuantizedPages) -> tuple[np.ndarray, np.ndarray]:
    """(codes (..., page_size, d) in [-8, 7], scale codes (..., d)) of stored pages."""
    return (np.asarray(_unpack(jnp.asarray(pages.values)) - 0.5).astype(np.int64),
            np.asarray(pages.scales).astype(np.int64))


# ---- the arithmetic ------------------------------------------------------------------------------
def test_needed_codes_are_the_smallest_that_hold_the_value():
    rng = np.random.default_rng(0)
    limits = LIMITS[1:].astype(np.float32)
    x = np.concatenate([
        rng.standard_normal(2000).astype(np.float32) * np.exp2(rng.uniform(-40, 40, 2000)).astype(np.float32),
        limits, np.nextafter(limits, np.float32(np.inf)), np.nextafter(limits, np.float32(0)), -limits,
        np.float32([0.0, -0.0, 1e-30, 3e38, -3e38, 7.5, 7.500001]),
    ]).astype(np.float32)  # fmt: skip
    got = np.asarray(Q.needed_codes(jnp.asarray(x))).astype(np.int64)
    np.testing.assert_array_equal(got, needed(x))
    a = np.abs(x)
    held = (got > 0) & (got < 255)
    assert np.all(a[held] <= LIMITS[got[held]]) and np.all(a[held & (got > 1)] > LIMITS[got[held & (got > 1)] - 1])
    assert got[x == 0].tolist() == [0, 0] and got[np.abs(x) == np.float32(3e38)].tolist() == [255, 255]


def test_whole_pages_round_trip_code_for_code():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 5, 16, 64)) * np.exp(rng.normal(size=(1, 1, 1, 64)) * 3)).astype(np.float32)
    x[0, 1] = 0.0  # an empty page: scale code 0, values 0
    q = Q.quantize(jnp.asarray(x))
    assert q.values.shape == (3, 5, 16, 32) and q.values.dtype == jnp.uint8
    assert q.scales.shape == (3, 5, 64) and q.scales.dtype == jnp.uint8 and q.head_dim == 64
    codes, scales = codes_of(q)
    want_scales = needed(x).max(axis=-2)
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(codes, encode(x, want_scales[..., None, :]))
    back = np.asarray(q.dequantize(jnp.float32))
    np.testing.assert_array_equal(back, values(codes, scales))
    assert not back[0, 1].any()
    rel = np.linalg.norm(back - x) / np.linalg.norm(x)
    assert rel < 0.1, rel  # each channel on its own grid, whatever its size
    assert np.asarray(q.dequantize(jnp.bfloat16)).dtype == jnp.bfloat16


def test_requantize_moves_codes_to_a_larger_step_and_keeps_them_at_the_same():
    rng = np.random.default_rng(2)
    codes = rng.integers(-8, 8, size=(4, 16)).astype(np.int64)
    packed = jnp.asarray(((codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)).astype(np.uint8))
    old = jnp.asarray(rng.integers(1, 200, size=16).astype(np.uint8))
    same = np.asarray(_unpack(Q.requantize(packed, old, old)) - 0.5).astype(np.int64)
    np.testing.assert_array_equal(same, codes)
    grown = np.asarray(_unpack(Q.requantize(packed, old, old + 4)) - 0.5).astype(np.int64)  # a step 2x larger
    np.testing.assert_array_equal(grown, np.floor((codes + 0.5) / 2).astype(np.int64))


# ---- writes --------------------------------------------------------------------------------------
LAYERS, HEADS, DIM, PS, POOL = 2, 8, 16, 4, 24


def make(layout: str, dtype=jnp.float32):
    if layout == "dp":
        mesh, pm = create_mesh({"dp": 2, "tp": 4}), PartitionManager(PartitionAxis(page_axis="dp"))
    elif layout == "single":
        mesh, pm = jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1]), PartitionManager(PartitionAxis())
    else:
        mesh, pm = create_mesh({"tp": 8}), PartitionManager(PartitionAxis())
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 3, LAYERS, 24, PS, HEADS, DIM, 0.9, dtype, partition_manager=pm, quantizer="int4-ch",
        num_pages_per_layer=POOL)  # fmt: skip
    return meta, easykv.PagedAttentionCache.init_cache(mesh, dtype, meta, pm, quantizer="int4-ch")


def assert_matches(cache, models) -> None:
    for g, (mk, mv) in enumerate(models):  # one (keys, values) model per layer group
        for pages, model in ((cache.key_pages[g], mk), (cache.value_pages[g], mv)):
            codes, scales = codes_of(pages)
            np.testing.assert_array_equal(scales, model.scales)
            np.testing.assert_array_equal(codes, model.codes)


def slots_of(step_meta, meta) -> np.ndarray:
    from easykv.step.metadata import as_mixed

    return np.asarray(as_mixed(step_meta, page_size=PS, num_pages=POOL, pages_per_sequence=meta.num_pages_per_sequence)
                      .step_meta.slot_mapping)  # fmt: skip


@pytest.mark.parametrize("layout", tiered(["single", "tp", "dp"], fast={"dp"}))
def test_writes_match_the_model_of_the_pages(layout):
    """Prefill chunks, decodes and mixed steps under permuted page tables (each sequence's pages
    in one dp half): after every write each page's codes and scales are the model's, for K and
    V of every layer."""
    meta, cache = make(layout)
    models = [(ChannelPages(LAYERS, HEADS, POOL, PS, DIM), ChannelPages(LAYERS, HEADS, POOL, PS, DIM))]
    rng = np.random.default_rng(3)
    table = np.array([[3, 7, 1, 0, 5, 2], [13, 20, 15, 22, 17, 12], [9, 4, 11, 6, 8, 10]])
    lens = [0, 0, 0]
    width = np.exp(rng.normal(size=DIM) * 2).astype(np.float32)  # channels of very different sizes
    for step in range(14):
        new = [int(rng.integers(0, 7)) if step % 4 == 0 else int(rng.integers(0, 2)) for _ in lens]
        new = [min(n, 24 - n0) for n, n0 in zip(new, lens)]
        if not sum(new):
            continue
        step_meta = easykv.PagedAttentionMetadata.for_mixed(table, lens, new, cache_metadata=meta, pad_tokens_to=24)
        k = (rng.standard_normal((LAYERS, 24, HEADS, DIM)) * width * (1 + 3 * step)).astype(np.float32)
        v = rng.standard_normal((LAYERS, 24, HEADS, DIM)).astype(np.float32)
        cache, dropped = cache.write(jnp.asarray(k), jnp.asarray(v), step_meta)
        assert int(dropped) == 0
        slots = slots_of(step_meta, meta)
        models[0][0].write(k, slots)
        models[0][1].write(v, slots)
        lens = [n0 + n for n0, n in zip(lens, new)]
        assert_matches(cache, models)
    for layer in range(LAYERS):  # and reads give the model's values
        for seq in range(3):
            keys, vals = easykv.gather_kv(cache, layer, table[seq], lens[seq])
            ids = table[seq][np.arange(lens[seq]) // PS]
            want = models[0][0].read(layer)[:, ids, np.arange(lens[seq]) % PS]  # (heads, n, d)
            np.testing.assert_array_equal(np.asarray(keys), np.moveaxis(want, 0, 1))


@jax.jit
def _scanned_write(cache, k, step_meta):
    def body(view, xs):
        i, ki = xs
        return view.at_layer(i).write_mixed_to_cache(ki, ki, step_meta), None

    view, _ = jax.lax.scan(body, cache.group_view(0), (jnp.arange(LAYERS), k))
    cache.update(view)
    return cache


@SLOW
def test_per_layer_and_scanned_views_write_what_the_whole_cache_write_does():
    """The EasyDeL view path (one layer per call), a lax.scan over the layers (a traced layer
    index) and cache.write store the same codes."""
    meta, whole = make("tp")
    _, views = make("tp")
    _, scanned = make("tp")
    rng = np.random.default_rng(4)
    table = [[3, 7, 1, 0, 5, 2]]
    for pos, n in ((0, 6), (6, 1), (7, 1), (8, 3)):
        step_meta = easykv.PagedAttentionMetadata.for_mixed(table, [pos], [n], cache_metadata=meta)
        k = jnp.asarray(rng.standard_normal((LAYERS, n, HEADS, DIM)) * (pos + 1), jnp.float32)
        whole, _ = whole.write(k, k, step_meta)
        for layer in range(LAYERS):
            view = views.views[layer]
            view = view.write_mixed_to_cache(k[layer], k[layer], step_meta)
            views.views[layer] = view
        scanned = _scanned_write(scanned, k, step_meta)
    for other in (views, scanned):
        for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(other)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _one_shard(layers=1, pool=6, seed=5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((layers, 2, pool, PS, DIM)).astype(np.float32) * 4
    return Q.quantize(jnp.asarray(x)), rng


def test_a_page_entered_at_its_first_slot_starts_over_and_others_grow():
    pages, rng = _one_shard()
    model = ChannelPages(1, 2, 6, PS, DIM)
    model.codes[...], model.scales[...] = codes_of(pages)
    small = (rng.standard_normal((1, 2, 2, DIM)) * 0.01).astype(np.float32)
    slots = jnp.asarray([2 * PS, 3 * PS + 2], jnp.int32)  # page 2 from its first slot; page 3 mid-page
    out = scatter_page_scaled_local(pages, jnp.asarray(small), slots, None, layout=None)
    model.write(small, np.asarray(slots))
    codes, scales = codes_of(out)
    np.testing.assert_array_equal(scales, model.scales)
    np.testing.assert_array_equal(codes, model.codes)
    old = np.asarray(pages.scales).astype(np.int64)
    assert np.all(scales[0, :, 2] == needed(small[0, 0]))  # the earlier owner's scale is gone
    assert np.all(scales[0, :, 3] == old[0, :, 3])  # small tokens do not shrink a page's scale
    untouched = [0, 1, 4, 5]
    np.testing.assert_array_equal(np.asarray(out.values)[:, :, untouched], np.asarray(pages.values)[:, :, untouched])


@SLOW
def test_slot_order_within_a_write_does_not_matter():
    pages, rng = _one_shard(layers=2)
    rows = (rng.standard_normal((2, 9, 2, DIM)) * np.exp(rng.normal(size=(9, 1, 1)) * 2)).astype(np.float32)
    slots = np.array([1, 2, 3, 4, 5, 13, 14, 15, 22])  # pages 0 (mid), 1 (whole), 3 (mid, last slots), 5 (mid)
    want = scatter_page_scaled_local(pages, jnp.asarray(rows), jnp.asarray(slots), None, layout=None)
    for seed in range(3):
        perm = np.random.default_rng(seed).permutation(9)
        got = scatter_page_scaled_local(pages, jnp.asarray(rows[:, perm]), jnp.asarray(slots[perm]), None, layout=None)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_padding_other_shards_and_a_layer_outside_the_stack_change_nothing():
    pages, rng = _one_shard(layers=2)
    rows = jnp.asarray(rng.standard_normal((3, 2, DIM)) * 100, jnp.float32)
    out = scatter_page_scaled_local(pages, rows[:0], jnp.zeros((0,), jnp.int32), 0, layout=None)  # no tokens
    assert out is pages
    for slots, layer in (([-1, -1, -1], 0), ([6 * PS, 6 * PS + 5, -7], 1), ([1, 5, 9], 2), ([1, 5, 9], -1)):
        out = jax.jit(lambda p, r, s, i: scatter_page_scaled_local(p, r, s, i, layout=None))(
            pages, rows, jnp.asarray(slots, jnp.int32), jnp.int32(layer))
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(pages)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@SLOW
def test_more_pages_to_requantize_than_one_pass_takes(monkeypatch):
    """The pages that keep their tokens are requantized a chunk at a time: with chunks of 2, a
    decode into 5 pages takes three passes and still matches the model."""
    monkeypatch.setattr(writes, "_REQUANT_CHUNK", 2)
    pages, rng = _one_shard(pool=6)
    model = ChannelPages(1, 2, 6, PS, DIM)
    model.codes[...], model.scales[...] = codes_of(pages)
    rows = (rng.standard_normal((1, 5, 2, DIM)) * 50).astype(np.float32)  # every page's scale grows
    slots = np.array([1, 6, 11, 17, 23])
    out = scatter_page_scaled_local(pages, jnp.asarray(rows), jnp.asarray(slots), None, layout=None)
    model.write(rows, slots)
    codes, scales = codes_of(out)
    np.testing.assert_array_equal(scales, model.scales)
    np.testing.assert_array_equal(codes, model.codes)
    assert (scales > np.asarray(pages.scales)).any(axis=-1)[0][:, [0, 1, 2, 4, 5]].all()


def test_a_bad_slot_from_the_host_is_refused_before_anything_changes():
    meta, cache = make("tp")
    before = [np.asarray(a) for a in jax.tree.leaves(cache)]
    step_meta = easykv.PagedAttentionMetadata.for_decode([[3, 7, 1, 0, 5, 2]], [2], cache_metadata=meta)
    k = jnp.ones((LAYERS, 1, HEADS, DIM), jnp.float32)
    with pytest.raises(ValueError, match="bfloat16|dtype"):
        cache.write(k.astype(jnp.bfloat16), k, step_meta)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(cache)))


# ---- bytes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim, page_size, per_page_head, gain", [
    (128, 16, 16 * 64 + 128, 3.56), (64, 16, 16 * 32 + 64, 3.56), (128, 32, 32 * 64 + 128, 3.76),
    (128, 8, 8 * 64 + 128, 3.2),
])  # fmt: skip
def test_bytes_and_capacity(dim, page_size, per_page_head, gain):
    assert page_head_bytes(Q, page_size, dim, np.dtype("bfloat16")) == per_page_head
    stored = Q.quantize(jnp.zeros((1, page_size, dim)))
    assert stored.values.nbytes + stored.scales.nbytes == per_page_head
    assert round(2 * dim * page_size / per_page_head, 2) == gain
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    common = dict(partition_manager=pm, memory_bytes_per_device=2**20)
    bf16 = easykv.PagedAttentionCacheMetaData.create(mesh, 4, 2, 512, page_size, 8, dim, 0.9, jnp.bfloat16, **common)
    ch = easykv.PagedAttentionCacheMetaData.create(mesh, 4, 2, 512, page_size, 8, dim, 0.9, jnp.bfloat16,
                                                   quantizer="int4-ch", **common)
    assert ch.page_bytes_per_device == 2 * per_page_head  # one kv head per device, K and V
    assert ch.bytes_per_token == -(-2 * 8 * 2 * per_page_head // page_size)
    assert abs(ch.num_pages_per_layer / bf16.num_pages_per_layer - gain) < 0.05
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, ch, pm, quantizer="int4-ch")
    held = sum(s.data.nbytes for leaf in jax.tree.leaves(cache) for s in leaf.addressable_shards
               if s.device == jax.devices()[0])
    assert held == ch.bytes_per_device


def test_names_and_the_metadata():
    assert "int4-ch" in easykv.available_quantizers()
    assert get_quantizer("INT4-CH") == Q and Q.name == "int4-ch"
    meta, _ = make("tp")
    assert easykv.PagedAttentionCacheMetaData.from_json(meta.to_json()) == meta
    with pytest.raises(ValueError, match="head_dim must be even; got 15"):
        Q.validate(15, np.dtype("float32"))
    for bad in ("int4-ch-rot", "int4-g32-ch", "int4-ch-asym"):
        with pytest.raises(ValueError, match="unknown quantizer"):
            get_quantizer(bad)


# ---- reads, exports, the demo ---------------------------------------------------------------------
def test_raw_export_is_refused_and_a_dense_one_moves_the_sequence():
    from easykv.checkpoint.transfer import export_sequence, import_sequence

    meta, cache = make("tp")
    manager = easykv.PageManager(meta)
    [seq] = manager.claim(1)
    rng = np.random.default_rng(6)
    plan = manager.schedule([seq], [10], pad_tokens_to=16)
    k = jnp.asarray(rng.standard_normal((LAYERS, 16, HEADS, DIM)), jnp.float32)
    cache, _ = cache.write(k, k, plan.metadata)
    manager.commit(plan, [list(range(10))])
    before = [np.asarray(a) for a in jax.tree.leaves(cache)]
    with pytest.raises(ValueError, match=r"export_sequence\(dequantize=False\): int4-ch pages keep one scale per "
                                         r"page and channel.*dequantize=True"):
        export_sequence(cache, manager, seq, dequantize=False)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(cache)))
    exported = export_sequence(cache, manager, seq)
    _, target = make("tp")
    target_manager = easykv.PageManager(meta)
    target, new_seq = import_sequence(target, target_manager, exported)
    for layer in range(LAYERS):
        a = easykv.gather_kv(cache, layer, np.asarray(manager.page_table([seq])[0]), 10)
        b = easykv.gather_kv(target, layer, np.asarray(target_manager.page_table([new_seq])[0]), 10)
        for x, y in zip(a, b):  # quantized again from the dequantized tokens, a page at a time
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=0.2 * float(np.abs(np.asarray(x)).max()))


def test_a_crafted_raw_export_of_int4_ch_is_refused():
    from easykv.checkpoint.sequence_export import SequenceExport

    part = {"values": np.zeros((1, 4, 2, 8), np.uint8), "scales": np.zeros((1, 4, 2, 16), np.uint8)}
    with pytest.raises(ValueError, match=r"SequenceExport.raw=True: int4-ch pages keep one scale per page"):
        SequenceExport(length=4, num_hidden_layers=1, num_kv_heads=2, kv_head_dim_size=16, dtype=np.float32,
                       quantization="int4-ch", raw=True, keys=part, values=part)


def test_the_demo_refuses_int4_ch_with_a_way_out():
    from easykv.demo.run import demo_quantizer

    with pytest.raises(ValueError, match="the demo cannot check int4-ch.*--quant int4-rot"):
        demo_quantizer("int4-ch")
    assert demo_quantizer("int4-rot").name == "int4-rot"
