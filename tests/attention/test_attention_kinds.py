"""The attention kinds of today's models: chunked-local attention (Llama 4), attention sinks
(gpt-oss) and value pages with their own head dim.

The dense reference against a float64 numpy computation written here from the definitions; the
fast path against the reference on random pages under permuted page tables, for the three step
forms, on one device, head-sharded pages (tp=8) and a dp=2 x tp=4 page-split pool; the Pallas
TPU kernel is never chosen for what it cannot do; bad sinks and options are refused by name.
"""

from __future__ import annotations

import zlib

import jax
import numpy as np
import pytest

from easykv import PagedAttentionMetadata
from easykv.attention.api import paged_attention, paged_attention_reference
from easykv.attention.checks import _Fit, prepare
from easykv.attention.options import AttentionOptions
from tests.support.attention import (
    BLOCK,
    GROUP,
    LAYOUTS,
    MAKERS,
    PAGES,
    PS,
    D,
    numpy_attention,
    page_layout,
    real_rows,
    table_rows,
)
from tests.support.tiers import tiered

V_DIM = 24  # value head dim different from the keys' (D = 16)


def contiguous(pages, row, length):
    """The first ``length`` tokens of a sequence whose pages are ``row``: (length, heads, dim)."""
    picked = pages[:, row[: -(-length // PS)]]  # (heads, n, PS, dim)
    return np.transpose(picked, (1, 2, 0, 3)).reshape(-1, pages.shape[0], pages.shape[-1])[:length]


@pytest.mark.parametrize("options", [{"chunk_size": 4}, {"chunk_size": 5, "sliding_window": 3}, {}])
def test_reference_matches_the_definitions(options):
    rng = np.random.default_rng(1)
    k = rng.standard_normal((2, PAGES, PS, D)).astype(np.float32)
    v = rng.standard_normal((2, PAGES, PS, V_DIM)).astype(np.float32)
    row = rng.permutation(PAGES)[:6].astype(np.int32)
    md = PagedAttentionMetadata.for_mixed(row[None], [9], [11], cache_metadata=_meta())
    q = rng.standard_normal((11, 2 * GROUP, D)).astype(np.float32)
    sinks = rng.standard_normal(2 * GROUP).astype(np.float32) * 2
    got = paged_attention_reference(q, k, v, md, sinks, **options)
    pos = np.arange(9, 20)
    want = numpy_attention(q, contiguous(k, row, 20), contiguous(v, row, 20), pos, sinks=sinks,
                           window=options.get("sliding_window"), chunk=options.get("chunk_size"))
    assert got.shape == (11, 2 * GROUP, V_DIM)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=2e-5)
    # A sink takes weight: the output shrinks towards zero as the sink logit grows.
    big = paged_attention_reference(q, k, v, md, sinks + 30.0, **options)
    assert np.abs(np.asarray(big)).max() < 1e-3 * np.abs(np.asarray(got)).max()


def _meta():
    from easykv import PagedAttentionCacheMetaData

    return PagedAttentionCacheMetaData(
        batch_size=8, num_hidden_layers=1, num_pages_per_layer=PAGES, num_pages_per_sequence=6,
        max_sequences=24, page_size=PS, num_kv_heads=2, kv_head_dim_size=D, hbm_utilization=0.9)


CASES = [
    ("single", "decode", {"chunk_size": 4}),
    ("single", "prefill", {"chunk_size": 6}),
    ("single", "mixed", {"chunk_size": 5, "sliding_window": 3}),
    ("single", "mixed", {"sinks": True}),
    ("single", "prefill", {"v_dim": True, "sinks": True}),
    ("heads", "mixed", {"chunk_size": 8, "sinks": True, "v_dim": True}),
    ("heads", "decode", {"sinks": True, "logit_soft_cap": 3.0}),
    ("dp", "mixed", {"chunk_size": 4, "sinks": True}),
    ("dp", "decode", {"v_dim": True, "chunk_size": 8}),
]


@pytest.mark.parametrize("name,mode,case,query_block", tiered(
    [(*c, qb) for qb in (4, 8) for c in CASES], fast=lambda c: c[3] == 4,
    ids=lambda c: f"{c[0]}-{c[1]}-{'-'.join(c[2])}-{c[3]}"))
def test_fast_path_matches_reference(name, mode, case, query_block):
    rng = np.random.default_rng(zlib.crc32(f"{name}{mode}{sorted(case)}".encode()))
    heads = LAYOUTS[name][1]
    v_dim = V_DIM if case.get("v_dim") else D
    hk = rng.standard_normal((heads, PAGES, PS, D)).astype(np.float32)
    hv = rng.standard_normal((heads, PAGES, PS, v_dim)).astype(np.float32)
    layout = page_layout(name)
    k, v = (x if layout is None else jax.device_put(x, layout.layer_sharding) for x in (hk, hv))
    md = MAKERS[mode](rng, name)
    q = rng.standard_normal((md.num_tokens, GROUP * heads, D)).astype(np.float32)
    sinks = rng.standard_normal(GROUP * heads).astype(np.float32) if case.get("sinks") else None
    options = {key: value for key, value in case.items() if key not in ("sinks", "v_dim")}
    got = paged_attention(q, k, v, md, sinks, **{**BLOCK, "query_block": query_block}, **options)
    want = paged_attention_reference(q, hk, hv, md, sinks, **options)
    assert got.shape == (md.num_tokens, GROUP * heads, v_dim)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-6, rtol=3e-5)
    real = real_rows(md)
    assert not np.asarray(got)[~real].any()
    assert np.abs(np.asarray(want)[real]).sum(axis=(1, 2)).min() > 0


def test_a_chunk_reads_only_its_own_pages():
    """With chunk_size 8 (two pages), a query at position 21 reads pages 4 and 5 only: the
    earlier ones may be released (-1) and the answer does not change."""
    rng = np.random.default_rng(4)
    k, v = (rng.standard_normal((2, PAGES, PS, D)).astype(np.float32) for _ in range(2))
    table = table_rows(rng, "single", 1)
    md = PagedAttentionMetadata(decodes_position=np.array([21], np.int32), decodes_page_table=table)
    q = rng.standard_normal((1, 2 * GROUP, D)).astype(np.float32)
    full = paged_attention(q, k, v, md, chunk_size=8, **BLOCK)
    released = table.copy()
    released[0, :4] = -1
    np.testing.assert_array_equal(np.asarray(paged_attention(q, k, v, md.replace(decodes_page_table=released),
                                                             chunk_size=8, **BLOCK)), np.asarray(full))
    # chunk_size 11: position 21's chunk starts at 11, on page 2, which was released
    with pytest.raises(ValueError, match=r"decodes_page_table\[0, 2\] = -1 is no page"):
        paged_attention(q, k, v, md.replace(decodes_page_table=released), chunk_size=11)


def test_the_pallas_kernel_is_not_chosen_for_what_it_cannot_do():
    rng = np.random.default_rng(2)
    k = np.zeros((2, PAGES, PS, 128), np.float32)
    md = MAKERS["decode"](rng, "single")
    q = np.zeros((md.num_tokens, 2 * GROUP, 128), np.float32)
    f32 = np.dtype("float32")
    plain, _ = prepare(q, k, k, md, AttentionOptions())

    def tpu_unfit(cfg, v_dim):
        return _Fit(cfg, stored=f32, head_dims=(128, v_dim), form="decode", platform="tpu", table_width=8,
                    quantizer=None).why_not("pallas_tpu")

    assert tpu_unfit(plain, 128) == ""  # on a TPU the baseline fits
    for sinks, options, v_dim in ((np.zeros(2 * GROUP, np.float32), {}, 128), (None, {"chunk_size": 8}, 128),
                                  (None, {}, 64)):
        v = np.zeros((2, PAGES, PS, v_dim), np.float32)
        cfg, _ = prepare(q, k, v, md, AttentionOptions(**options), sinks=sinks)
        assert cfg.implementation == "xla"
        assert tpu_unfit(cfg, v_dim) == (
            "it has no chunked attention, no sinks, no latent cache, and one head_dim for keys and values")


def test_bad_sinks_and_value_pages_are_refused():
    rng = np.random.default_rng(3)
    k = np.zeros((2, PAGES, PS, D), np.float32)
    md = MAKERS["decode"](rng, "single")
    q = np.zeros((md.num_tokens, 2 * GROUP, D), np.float32)
    for sinks, got in ((np.zeros(3, np.float32), r"shape \(3,\) of float32"),
                       (np.zeros(2 * GROUP, np.int32), r"shape \(8,\) of int32"),
                       (np.zeros((1, 2 * GROUP), np.float32), r"shape \(1, 8\)")):
        with pytest.raises(ValueError, match=r"sinks must be \(num_q_heads,\) = \(8,\) floats, one logit per q head; "
                                             r"got " + got):
            paged_attention(q, k, k, md, sinks)
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int, got 0"):
        paged_attention(q, k, k, md, chunk_size=0)
    with pytest.raises(ValueError, match=r"must match in \(num_kv_heads, num_pages, page_size\)"):
        paged_attention(q, k, np.zeros((2, PAGES, 2, D), np.float32), md)


LATENT_CASES = [("single", "mixed", {}), ("single", "decode", {"sinks": True}), ("replicated", "prefill", {}),
                ("heads", "mixed", {"chunk_size": 6}), ("dp", "decode", {"sliding_window": 5})]


@pytest.mark.parametrize("name,mode,case", tiered(LATENT_CASES,
                                                  fast=lambda c: c[0] in ("single", "dp") and c[1] != "decode"
                                                  or c[0] == "dp", ids=[f"{c[0]}-{c[1]}" for c in LATENT_CASES]))
def test_latent_cache_values_are_the_keys_leading_dims(name, mode, case):
    """value_pages=None (DeepSeek's MLA stores one latent per token): attention equals attention
    over separate value pages holding the keys' first value_head_dim dims, and the numpy
    definition on a sequence."""
    rng = np.random.default_rng(zlib.crc32(f"latent{name}{mode}".encode()))
    heads = LAYOUTS[name][1]
    hk = rng.standard_normal((heads, PAGES, PS, D)).astype(np.float32)
    layout = page_layout(name)
    k, kv = (x if layout is None else jax.device_put(x, layout.layer_sharding) for x in (hk, hk[..., :10].copy()))
    md = MAKERS[mode](rng, name)
    q = rng.standard_normal((md.num_tokens, GROUP * heads, D)).astype(np.float32)
    sinks = rng.standard_normal(GROUP * heads).astype(np.float32) if case.pop("sinks", False) else None
    got = paged_attention(q, k, None, md, sinks, value_head_dim=10, **BLOCK, **case)
    assert got.shape == (md.num_tokens, GROUP * heads, 10)
    separate = paged_attention(q, k, kv, md, sinks, **BLOCK, **case)
    np.testing.assert_allclose(np.asarray(got), np.asarray(separate), atol=1e-6, rtol=1e-6)
    want = paged_attention_reference(q, hk, None, md, sinks, value_head_dim=10, **case)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-6, rtol=3e-5)


def test_latent_cache_matches_the_definition_and_refuses_mixed_signals():
    rng = np.random.default_rng(6)
    latent = rng.standard_normal((1, PAGES, PS, D)).astype(np.float32)  # one latent "head" per token
    row = rng.permutation(PAGES)[:6].astype(np.int32)
    md = PagedAttentionMetadata.for_mixed(row[None], [7], [5], cache_metadata=_meta())
    q = rng.standard_normal((5, 8, D)).astype(np.float32)  # 8 q heads over the one latent
    got = paged_attention_reference(q, latent, None, md, value_head_dim=12, scale=0.3)
    lat = contiguous(latent, row, 12)
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, lat, lat[..., :12], np.arange(7, 12), scale=0.3),
                               atol=2e-6, rtol=2e-5)
    for value_pages, options, match in (
        (None, {}, r"value_pages=None .* goes with value_head_dim=.*got value_pages=None and value_head_dim=None"),
        (latent, {"value_head_dim": 8}, r"got value_pages=ndarray and value_head_dim=8"),
        (None, {"value_head_dim": D + 1}, r"value_head_dim=17 exceeds the keys' head_dim 16"),
    ):
        with pytest.raises(ValueError, match=match):
            paged_attention(q, latent, value_pages, md, **options)


@pytest.mark.parametrize("quantizer", ["int8", "int4"])
def test_quantized_latent_cache_reads_its_values_from_the_dequantized_keys(quantizer):
    from easykv import get_quantizer

    rng = np.random.default_rng(7)
    latent = rng.standard_normal((1, PAGES, PS, D)).astype(np.float32)
    pages = get_quantizer(quantizer).quantize(jax.numpy.asarray(latent))  # (heads, pages, page_size) scales
    dequantized = np.asarray(pages.dequantize(np.float32))
    md = MAKERS["mixed"](rng, "single")
    q = rng.standard_normal((md.num_tokens, 8, D)).astype(np.float32)
    got = paged_attention(q, pages, None, md, value_head_dim=12, dtype="float32", **BLOCK)
    want = paged_attention_reference(q, dequantized, None, md, value_head_dim=12)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-6, rtol=3e-5)
