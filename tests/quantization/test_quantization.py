"""Quantizers: hand-computed codes, error bounds on Gaussian data, sizing gains, and quantized
pages through init_cache / write / gather_kv / copy / zero on sharded layouts."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv.attention.api import paged_attention_implementation
from easykv.quantization import (
    Fp8Quantizer,
    Int4Quantizer,
    Int8Quantizer,
    QuantizedPages,
    available_quantizers,
    get_quantizer,
    register_quantizer,
)
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh
from tests.support.tiers import tiered

QUANTIZERS = ["int8", "fp8", "int4", "int4-g8", "int8-rot", "int4-rot", "int4-asym", "int4-g8-asym-rot", "int4-ol",
              "int4-ol8"]
BOUNDS = {"int8": 1e-2, "fp8": 5e-2, "int4": 1.5e-1, "int4-g8": 1.5e-1, "int8-rot": 1e-2, "int4-rot": 1.5e-1,
          "int4-asym": 1.5e-1, "int4-g8-asym-rot": 1.5e-1, "fp8-rot": 5e-2, "int4-asym-rot": 1.5e-1, "int4-ol": 1.5e-1,
          "int4-ol8": 1.5e-1}


def rel_error(approx, exact):
    approx, exact = np.asarray(approx, np.float64), np.asarray(exact, np.float64)
    return np.linalg.norm(approx - exact) / np.linalg.norm(exact)


def test_int8_codes_by_hand():
    x = jnp.array([[1.0, -0.5, 0.0, 0.25]], jnp.float32)
    q = Int8Quantizer().quantize(x)
    np.testing.assert_allclose(np.asarray(q.scales), [1 / 127], rtol=1e-7)
    # -63.5 rounds half to even -> -64; 31.75 -> 32
    assert np.asarray(q.values).tolist() == [[127, -64, 0, 32]]
    back = np.asarray(q.dequantize(jnp.float32))
    np.testing.assert_allclose(back, [[1.0, -64 / 127, 0.0, 32 / 127]], rtol=1e-6)


def test_int4_packing_by_hand():
    # absmax 7.5 -> scale 1: codes floor(x) in [-8, 7] stand for code + 0.5; low nibble first.
    x = jnp.array([[7.5, -7.5, 1.2, -1.2, 0.0, 3.9]], jnp.float32)
    q = Int4Quantizer().quantize(x)
    assert q.values.dtype == jnp.uint8 and q.values.shape == (1, 3)
    assert np.asarray(q.values).tolist() == [[0x87, 0xE1, 0x30]]  # (7, -8), (1, -2), (0, 3)
    np.testing.assert_array_equal(np.asarray(q.dequantize(jnp.float32)), [[7.5, -7.5, 1.5, -1.5, 0.5, 3.5]])


def test_int4_groups_take_one_scale_per_group():
    x = jnp.array([[1.0, -2.0, 0.5, 0.25, 75.0, 7.0, -15.0, 0.0]], jnp.float32)
    q = Int4Quantizer(group_size=4).quantize(x)
    np.testing.assert_allclose(np.asarray(q.scales), [[2 / 7.5, 10.0]], rtol=1e-6)
    back = np.asarray(q.dequantize(jnp.float32))
    # group 2 (scale 10): 75 -> code 7 -> 75; 7 -> code 0 -> 5; -15 -> code -2 -> -15; 0 -> 5
    np.testing.assert_allclose(back[0, 4:], [75.0, 5.0, -15.0, 5.0], rtol=1e-6)
    assert get_quantizer("int4-g4") == Int4Quantizer(group_size=4)


def test_fp8_maps_absmax_to_448():
    x = jnp.array([[2.0, -1.0, 0.5, 0.0]], jnp.float32)
    q = Fp8Quantizer().quantize(x)
    assert q.values.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(np.asarray(q.scales), [2 / 448], rtol=1e-7)
    np.testing.assert_allclose(np.asarray(q.dequantize(jnp.float32)), np.asarray(x), rtol=1e-6)


@pytest.mark.parametrize("name", tiered(QUANTIZERS, fast=set(QUANTIZERS) - {"int4-ol8"}))
def test_round_trip_error_on_gaussian_data(name):
    x = jax.random.normal(jax.random.key(0), (64, 8, 128), jnp.float32)
    q = get_quantizer(name)
    err = rel_error(q.quantize(x).dequantize(jnp.float32), x)
    assert err < BOUNDS[name], f"{name}: relative error {err:.4f}"
    zero = q.quantize(jnp.zeros((2, 3, 128))).dequantize(jnp.float32)
    assert not np.asarray(zero).any()  # an all-zero token stays exactly zero (no 0/0)


def test_sizing_counts_quantized_bytes():
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    budget = 64 * 2**20

    def pages(quant):
        meta = easykv.PagedAttentionCacheMetaData.create(
            mesh, 4, 4, 512, 16, 8, 128, 0.9, jnp.bfloat16, partition_manager=pm,
            quantizer=quant, memory_bytes_per_device=budget,
        )  # fmt: skip
        return meta.num_pages_per_layer, meta.bytes_per_token_head

    bf16, bf16_bytes = pages(None)
    int8, int8_bytes = pages("int8")
    int4, int4_bytes = pages("int4")
    assert (bf16_bytes, int8_bytes, int4_bytes) == (256, 132, 68)
    # One page on one device, all 4 layers: 2 (K, V) x 1 head x 16 tokens x bytes per token-head x 4.
    assert bf16 == budget // (2 * 16 * 256 * 4)
    assert int8 == budget // (2 * 16 * 132 * 4)
    assert int8 / bf16 >= 1.9 and int4 / bf16 >= 3.5


def test_metadata_records_quantizer_by_name_and_rejects_odd_int4():
    mesh = create_mesh({"tp": 8})
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 4, 2, 64, 16, 8, 64, 0.9, partition_manager=PartitionManager(), quantizer=Int4Quantizer(8),
        num_pages_per_layer=16,
    )  # fmt: skip
    assert meta.quantization == "int4-g8"
    assert easykv.PagedAttentionCacheMetaData.from_json(meta.to_json()).quantizer == Int4Quantizer(8)
    with pytest.raises(ValueError, match=r"head_dim must be even; got 63"):
        meta.replace(kv_head_dim_size=63)
    with pytest.raises(ValueError, match=r"group_size=24 must be a positive even divisor of head_dim=64"):
        meta.replace(quantization="int4-g24")


def test_custom_quantizer_must_be_registered():
    @dataclasses.dataclass(frozen=True)
    class Halves(Int8Quantizer):
        name: str = "halves-test"

    q = Halves()
    with pytest.raises(ValueError, match=r"not registered under its name 'halves-test'"):
        get_quantizer(q)
    register_quantizer(q)
    assert get_quantizer("halves-test") is q
    with pytest.raises(ValueError, match=r"a different quantizer is already registered as 'int8'"):
        register_quantizer(Halves(name="int8"))
    assert get_quantizer("int8") == Int8Quantizer()


@pytest.mark.parametrize(("name", "fix"), [("Halves-Upper", "'halves-upper'"), (" halves ", "'halves'"),
                                           ("", "'my-quant'"), (7, "'my-quant'")])
def test_a_quantizer_name_that_could_never_be_looked_up_is_refused(name, fix):
    @dataclasses.dataclass(frozen=True)
    class Named(Int8Quantizer):
        name: object = "x"

    before = available_quantizers()
    with pytest.raises(ValueError, match=rf"lower-case string.*got {re.escape(repr(name))}: name it {fix}"):
        register_quantizer(Named(name=name))
    assert available_quantizers() == before


# ---- quantized pages in the cache ----------------------------------------------------------
HEADS, DIM, PAGE, LAYERS = 8, 16, 4, 2


def make_cache(quant, layout):
    if layout == "dp":
        mesh = create_mesh({"dp": 2, "tp": 4})
        pm = PartitionManager(PartitionAxis(page_axis="dp"))
    else:
        mesh = create_mesh({"tp": 8})
        pm = PartitionManager(PartitionAxis())
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 4, LAYERS, 32, PAGE, HEADS, DIM, 0.9, jnp.bfloat16, partition_manager=pm,
        quantizer=quant, num_pages_per_layer=24,
    )  # fmt: skip
    return meta, easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm, quantizer=quant)


@pytest.mark.parametrize("quant, layout", tiered(
    [("int8", "tp"), ("fp8", "dp"), ("int4", "tp"), ("int4-g8", "dp"), ("int8-rot", "dp"), ("int4-g8-asym-rot", "tp"),
     ("int4-ol", "dp")],
    fast={("int8", "tp"), ("fp8", "dp"), ("int4-g8", "dp"), ("int8-rot", "dp")}))
def test_quantized_cache_write_gather_copy_zero(quant, layout):
    meta, cache = make_cache(quant, layout)
    q = get_quantizer(quant)
    view = cache[0]
    assert isinstance(view.key_pages, QuantizedPages)
    groups = q.scale_shape(DIM)
    assert view.key_pages.scales.shape == (HEADS, 24, PAGE, *groups)
    assert view.key_pages.values.shape[:3] == (HEADS, 24, PAGE)
    assert view.key_pages.scales.dtype == (jnp.uint8 if quant == "int4-ol" else jnp.float32)
    if layout == "dp":  # each device holds 2 heads and 12 pages of values and of scales
        shard = view.key_pages.scales.addressable_shards[0].data.shape
        assert shard[:3] == (2, 12, PAGE)

    rng = np.random.default_rng(1)
    rows = [[5, 17, -1, -1, -1, -1, -1, -1], [20, 2, 9, -1, -1, -1, -1, -1]]  # pages in both dp halves
    step_meta = easykv.PagedAttentionMetadata.for_mixed(rows, [0, 0], [7, 10], cache_metadata=meta, pad_tokens_to=20)
    k = jnp.asarray(rng.normal(size=(LAYERS, 20, HEADS, DIM)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(LAYERS, 20, HEADS, DIM)) * 10, jnp.bfloat16)  # V is not derived from K
    cache, dropped = cache.write(k, v, step_meta)
    assert int(dropped) == 0

    def expect(x):  # what the quantizer stores and gives back for these tokens
        return np.asarray(q.quantize(x).dequantize(jnp.bfloat16), np.float32)

    # The same codes as an eager quantize; dequantized, the same values, except that a fused
    # multiply-add may round an asymmetric code's lo + u * s one float32 bit differently.
    same = np.testing.assert_array_equal if not q.name.count("asym") else \
        (lambda a, b: np.testing.assert_allclose(a, b, rtol=2**-7, atol=1e-6))
    for layer in range(LAYERS):
        for seq, (start, n) in enumerate([(0, 7), (7, 10)]):
            keys, values = easykv.gather_kv(cache, layer, np.asarray(rows[seq]), n)
            assert keys.dtype == jnp.bfloat16 and keys.shape == (n, HEADS, DIM)
            same(np.asarray(keys, np.float32), expect(k[layer, start : start + n]))
            same(np.asarray(values, np.float32), expect(v[layer, start : start + n]))
            slots = np.asarray(rows[seq])[np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE
            stored = cache[layer].key_pages
            want = q.quantize(k[layer, start : start + n])
            for got_leaf, want_leaf in zip((stored.values, stored.scales), (want.values, want.scales)):
                got_rows = np.asarray(got_leaf).reshape((HEADS, -1) + got_leaf.shape[3:])[:, slots]
                np.testing.assert_array_equal(np.moveaxis(got_rows, 0, 1), np.asarray(want_leaf).view(got_rows.dtype))
            assert rel_error(values, v[layer, start : start + n]) < BOUNDS[quant]
    # V's scales come from V (10x larger values), not from K (int4-ol: its two log-coded steps,
    # 19% apart, so 10x is more than 13 codes).
    ks = np.abs(np.asarray(cache[0].key_pages.scales[:, 5, 0]).astype(np.float64))  # asymmetric: (step, lo) per group
    vs = np.abs(np.asarray(cache[0].value_pages.scales[:, 5, 0]).astype(np.float64))
    if quant == "int4-ol":
        ks, vs = 2 ** (ks[:, :2] / 4), 2 ** (vs[:, :2] / 4)
    assert np.all(vs > 3 * ks)

    before = easykv.gather_kv(cache, 1, np.asarray(rows[1]), 10)
    cache = cache.copy_pages(np.array([20, 2, -1]), np.array([22, 3, -1]))  # within each dp half
    after = easykv.gather_kv(cache, 1, np.array([22, 3, 9]), 10)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    cache = cache.zero_pages(np.array([22]))
    keys, _ = easykv.gather_kv(cache, 1, np.array([22, 3, 9]), 10)
    assert not np.asarray(keys[:PAGE], np.float32).any()
    assert np.asarray(keys[PAGE:], np.float32).any()


def test_quantized_write_leaves_other_tokens_bit_identical():
    meta, cache = make_cache("int8", "tp")
    rng = np.random.default_rng(2)
    first = easykv.PagedAttentionMetadata.for_prefill([3, 4], 8, cache_metadata=meta)
    k = jnp.asarray(rng.normal(size=(LAYERS, 8, HEADS, DIM)), jnp.bfloat16)
    cache, _ = cache.write(k, k, first)
    snapshot = jax.tree.map(np.asarray, cache[1].key_pages)
    table = np.full((1, meta.num_pages_per_sequence), -1, np.int32)
    table[0, :3] = [3, 4, 7]
    step = easykv.PagedAttentionMetadata.for_decode(table, [8], cache_metadata=meta)
    new = jnp.asarray(rng.normal(size=(LAYERS, 1, HEADS, DIM)), jnp.bfloat16)
    cache, _ = cache.write(new, new, step)
    after = jax.tree.map(np.asarray, cache[1].key_pages)
    changed = np.zeros((24, PAGE), bool)
    for a, b in zip(jax.tree.leaves(snapshot), jax.tree.leaves(after)):
        diff = a != b
        changed |= diff.reshape(diff.shape[:3] + (-1,)).any(axis=(0, 3))
    assert np.argwhere(changed).tolist() == [[7, 0]]  # only the new token's slot


# ---- attention over quantized pages ----------------------------------------------------------
@pytest.mark.parametrize("quant, layout", tiered(
    [("int8", "tp"), ("fp8", "tp"), ("int4", "dp"), ("int4-g8", "tp"), ("int4-asym-rot", "dp"), ("fp8-rot", "tp"),
     ("int4-ol", "tp")],
    fast={("int8", "tp"), ("fp8", "tp"), ("int4", "dp"), ("int4-ol", "tp")}))
def test_attention_over_quantized_pages(quant, layout):
    """The fast path equals the reference on the same quantized pages, and stays within the
    quantizer's bound of attention over unquantized pages holding the same tokens."""
    rng = np.random.default_rng(3)
    rows = [[5, 7, 1, -1, -1, -1, -1, -1], [20, 14, 19, 21, -1, -1, -1, -1]]  # each in one dp half
    write = None
    outs = {}
    for name in ("none", quant):
        meta, cache = make_cache(name, layout)
        if write is None:
            write = easykv.PagedAttentionMetadata.for_mixed(rows, [0, 0], [9, 14], cache_metadata=meta)
            k = jnp.asarray(rng.normal(size=(LAYERS, 23, HEADS, DIM)), jnp.bfloat16)
            v = jnp.asarray(rng.normal(size=(LAYERS, 23, HEADS, DIM)), jnp.bfloat16)
            q = jnp.asarray(rng.normal(size=(2, 2 * HEADS, DIM)), jnp.bfloat16)  # GQA: 2 q heads per kv head
            decode = easykv.PagedAttentionMetadata.for_decode(rows, [8, 13], cache_metadata=meta)
        cache, _ = cache.write(k, v, write)
        view = cache[1]
        fast = easykv.view_attention(q, view, decode)
        ref = easykv.paged_attention_reference(q, view.key_pages, view.value_pages, decode, dtype=view.dtype)
        np.testing.assert_allclose(np.asarray(fast, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)
        outs[name] = np.asarray(fast, np.float32)
    assert isinstance(view.key_pages, QuantizedPages)
    assert paged_attention_implementation(q, view.key_pages, view.value_pages, decode, dtype=view.dtype,
                                                 layout=view.layout) == "xla"  # fmt: skip
    assert rel_error(outs[quant], outs["none"]) < BOUNDS[quant]


def test_quantized_attention_refuses_pallas_and_missing_dtype():
    meta, cache = make_cache("int8", "tp")
    view = cache[0]
    decode = easykv.PagedAttentionMetadata.for_decode([[1, 2, -1, -1, -1, -1, -1, -1]], [3], cache_metadata=meta)
    q = jnp.zeros((1, HEADS, DIM), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"quantized pages need dtype="):
        easykv.paged_attention(q, view.key_pages, view.value_pages, decode)
    with pytest.raises(ValueError, match=r"pallas_tpu.*compact quantized pages"):
        easykv.view_attention(q, view, decode, implementation="pallas_tpu")
    with pytest.raises(ValueError, match=r"value_pages is not quantized"):
        easykv.paged_attention(q, view.key_pages, view.value_pages.values, decode, dtype=jnp.bfloat16)


@pytest.mark.parametrize("name", tiered(["int8", "fp8", "int4", "int4-g16", "int8-rot", "int4-g16-asym-rot", "int4-ol"],
                                         fast={"int8", "int4"}))
def test_quantized_values_of_their_own_head_dim_are_read_as_such(name):
    """Value pages narrower than the keys (a layer group with V dim != K dim), quantized: their
    head_dim is read from the stored shapes and attention equals the reference on the
    dequantized pages."""
    rng = np.random.default_rng(9)
    q8 = easykv.get_quantizer(name)
    k = rng.standard_normal((2, 6, 4, 32)).astype(np.float32)
    v = rng.standard_normal((2, 6, 4, 16)).astype(np.float32)
    kq, vq = q8.quantize(jnp.asarray(k)), q8.quantize(jnp.asarray(v))
    assert (kq.head_dim, vq.head_dim) == (32, 16)
    meta = easykv.PagedAttentionCacheMetaData(
        batch_size=2, num_hidden_layers=1, num_pages_per_layer=6, num_pages_per_sequence=3, max_sequences=12,
        page_size=4, num_kv_heads=2, kv_head_dim_size=32, hbm_utilization=0.9)
    md = easykv.PagedAttentionMetadata.for_mixed([[4, 1, 3], [0, 5, 2]], [3, 0], [6, 9], cache_metadata=meta)
    qry = rng.standard_normal((15, 4, 32)).astype(np.float32)
    got = easykv.paged_attention(qry, kq, vq, md, dtype=jnp.float32)
    want = easykv.paged_attention_reference(qry, np.asarray(kq.dequantize(np.float32)),
                                            np.asarray(vq.dequantize(np.float32)), md)
    assert got.shape == (15, 4, 16)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="do not pair up"):
        dataclasses.replace(vq, scales=vq.scales[:1]).head_dim  # noqa: B018  the property raises
