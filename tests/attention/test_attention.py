"""Paged attention: the dense reference against hand-computed cases; the fast path against the
reference on random pages under permuted page tables (decode, chunked prefill, mixed batches;
GQA, sliding window, soft cap) on one device, head-sharded pages (tp=8), replicated heads and a
dp=2 x tp=4 page-split pool; no collectives in the head-sharded compiled HLO; implementation
choice; every bad input raises a precise error.

Shapes are tiny (head_dim 16, page_size 4, 48 pages) and each case compiles once.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from easykv import PagedAttentionCache, PagedAttentionCacheMetaData, PagedAttentionMetadata
from easykv.attention.api import (
    REFERENCE_OPTIONS,
    ImplementationKeywords,
    paged_attention,
    paged_attention_implementation,
    paged_attention_reference,
    run,
    view_attention,
)
from easykv.attention.checks import prepare
from easykv.attention.options import AttentionKeywords, AttentionOptions, ReferenceKeywords, ViewKeywords
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh
from easykv.step.metadata import build_mixed
from tests.support.attention import (
    BLOCK,
    COLLECTIVES,
    GROUP,
    LAYOUTS,
    MAKERS,
    PAGES,
    PS,
    WIDTH,
    D,
    decode_md,
    make_pages,
    mixed_md,
    page_layout,
    prefill_md,
    real_rows,
    release_before_window,
)
from tests.support.tiers import tiered


def assert_close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# ---------------------------------------------------------------------- the reference by hand
def hand_pages():
    """One kv head, head_dim 4, page size 2. Page 1 holds k0 = 0, k1 = (ln 3, 0, ...) with
    values e0, e1; page 0 holds large garbage no test may read."""
    k = np.full((1, 2, 2, 4), 50.0, np.float32)
    v = np.full((1, 2, 2, 4), 50.0, np.float32)
    k[0, 1, 0] = 0.0
    k[0, 1, 1] = [math.log(3.0), 0, 0, 0]
    v[0, 1, 0] = [1, 0, 0, 0]
    v[0, 1, 1] = [0, 1, 0, 0]
    q = np.array([[1, 0, 0, 0], [0, 1, 0, 0]], np.float32)  # q head 0 scores (0, ln 3); head 1 (0, 0)
    return q, k, v


def test_reference_hand_computed_cases():
    q, k, v = hand_pages()
    ref = functools.partial(paged_attention_reference, scale=1.0)
    decode = PagedAttentionMetadata(
        decodes_position=np.array([1, -1], np.int32), decodes_page_table=np.array([[1, 0], [1, 0]], np.int32)
    )
    q2 = np.stack([q, q])
    out = np.asarray(ref(q2, k, v, decode))
    np.testing.assert_allclose(out[0, 0], [0.25, 0.75, 0, 0], atol=1e-6)  # softmax(0, ln 3)
    np.testing.assert_allclose(out[0, 1], [0.5, 0.5, 0, 0], atol=1e-6)
    assert not out[1].any()  # the padding row

    capped = np.asarray(ref(q2, k, v, decode, logit_soft_cap=1.0))
    w = np.exp(np.tanh(math.log(3.0))) / (1 + np.exp(np.tanh(math.log(3.0))))
    np.testing.assert_allclose(capped[0, 0], [1 - w, w, 0, 0], atol=1e-6)

    windowed = np.asarray(ref(q2, k, v, decode, sliding_window=1))  # only the token itself
    np.testing.assert_allclose(windowed[0], [[0, 1, 0, 0]] * 2, atol=1e-6)

    scaled = np.asarray(paged_attention_reference(q2, k, v, decode))  # default scale 4 ** -0.5
    w = 3**0.5 / (1 + 3**0.5)
    np.testing.assert_allclose(scaled[0, 0], [1 - w, w, 0, 0], atol=1e-6)

    # prefill of both tokens: token 0 sees only itself
    prefill = PagedAttentionMetadata(
        prefill_length=np.asarray(2, np.int32), prefill_position=np.array([0, 1, -1], np.int32),
        prefill_page_table=np.array([1, 0], np.int32),
    )  # fmt: skip
    out = np.asarray(ref(np.stack([q, q, q]), k, v, prefill))
    np.testing.assert_allclose(out[0], [[1, 0, 0, 0]] * 2, atol=1e-6)
    np.testing.assert_allclose(out[1, 0], [0.25, 0.75, 0, 0], atol=1e-6)
    assert not out[2].any()

    # mixed: a decode at position 1, a padding token, and a padding sequence
    mixed = build_mixed(np.array([[1, 0]], np.int32), np.array([1], np.int32), np.array([1], np.int32),
                        page_size=2, pad_tokens_to=2, pad_seqs_to=2)  # fmt: skip
    out = np.asarray(ref(np.stack([q, q]), k, v, mixed))
    np.testing.assert_allclose(out[0, 0], [0.25, 0.75, 0, 0], atol=1e-6)
    assert not out[1].any()

    # GQA: q heads 0, 1 read kv head 0, heads 2, 3 read kv head 1 (whose values are doubled)
    k2, v2 = np.concatenate([k, k]), np.concatenate([v, 2 * v])
    out = np.asarray(ref(np.stack([np.concatenate([q, q])] * 2), k2, v2, decode))
    np.testing.assert_allclose(out[0, 2:], 2 * out[0, :2], atol=1e-6)

    # the fast path agrees on the hand case
    fast = np.asarray(paged_attention(q2, k, v, decode, scale=1.0))
    np.testing.assert_allclose(fast, ref(q2, k, v, decode), atol=1e-6)


# ---------------------------------------------------------------------- fast path == reference
CASES = [
    # (layout, dtype, mode, options)
    ("single", "float32", "decode", {}),
    ("single", "float32", "decode", {"sliding_window": 5}),
    ("single", "float32", "prefill", {"logit_soft_cap": 3.0, "scale": 1.0}),
    ("single", "float32", "mixed", {"sliding_window": 6}),
    ("single", "bfloat16", "mixed", {"logit_soft_cap": 3.0, "scale": 1.0}),
    ("heads", "float32", "decode", {"logit_soft_cap": 3.0, "scale": 1.0}),
    ("heads", "bfloat16", "prefill", {"sliding_window": 5}),
    ("heads", "float32", "mixed", {}),
    ("replicated", "float32", "decode", {"sliding_window": 9}),
    ("replicated", "bfloat16", "mixed", {}),
    ("dp", "float32", "decode", {}),
    ("dp", "float32", "mixed", {"sliding_window": 5, "logit_soft_cap": 3.0}),
]


# The fast tier: every case in blocks of 4 query rows; blocks of 8 (masked past a chunk's end) on
# head-sharded pages.
@pytest.mark.parametrize("name,dtype,mode,options,query_block", tiered(
    [(*c, qb) for qb in (4, 8) for c in CASES], fast=lambda c: c[4] == 4 or c[0] == "heads",
    ids=lambda c: "-".join(map(str, (*c[:3], c[4])))))
def test_fast_path_matches_reference(name, dtype, mode, options, query_block):
    rng = np.random.default_rng(zlib.crc32(f"{name}{dtype}{mode}".encode()))
    (hk, hv), (k, v) = make_pages(rng, name, dtype)
    md = MAKERS[mode](rng, name)
    if "sliding_window" in options:
        released = release_before_window(md, options["sliding_window"])
        assert any((np.asarray(a) != np.asarray(b)).any()
                   for a, b in zip(jax.tree.leaves(md), jax.tree.leaves(released)))
        md = released
    heads = LAYOUTS[name][1]
    q = rng.standard_normal((md.num_tokens, GROUP * heads, D)).astype(np.float32)
    q = q.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else q
    got = paged_attention(q, k, v, md, dtype=dtype, **{**BLOCK, "query_block": query_block}, **options)
    want = paged_attention_reference(q, hk, hv, md, dtype=dtype, **options)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_close(got, want, dtype)
    # padding rows are zeros; every real row attends to something
    real = real_rows(md)
    assert not np.asarray(got, np.float32)[~real].any()
    assert np.abs(np.asarray(want, np.float32)[real]).sum(axis=(1, 2)).min() > 0
    layout = page_layout(name)
    if layout is not None:  # the layout is read off the pages' sharding, and the output is head-split
        assert prepare(q, k, v, md, AttentionOptions(dtype=dtype, **options))[0].layout == layout
        if layout.head_axes:
            assert got.sharding.is_equivalent_to(NamedSharding(layout.mesh, P(None, "tp", None)), 3)


def test_default_blocks_and_traced_metadata_under_jit():
    """Default block sizes, with the metadata traced inside the caller's jit (no host checks)."""
    rng = np.random.default_rng(3)
    name = "heads"
    (hk, hv), (k, v) = make_pages(rng, name, "float32")
    md = mixed_md(rng, name)
    q = rng.standard_normal((md.num_tokens, GROUP * 8, D)).astype(np.float32)
    layout = page_layout(name)
    step = jax.jit(lambda q, k, v, md: paged_attention(q, k, v, md, layout=layout))
    got = step(q, k, v, jax.tree.map(jnp.asarray, md))
    assert_close(got, paged_attention_reference(q, hk, hv, md), "float32")


def test_through_the_cache_api():
    """Pages written by PagedAttentionCache.write (bf16 raw bits on CPU), read by view_attention."""
    rng = np.random.default_rng(4)
    mesh = create_mesh({"dp": 1, "tp": 8})
    pm = PartitionManager(PartitionAxis())
    meta = PagedAttentionCacheMetaData.create(
        mesh, 4, 1, WIDTH * PS, PS, 8, D, 0.9, "bfloat16", partition_manager=pm, num_pages_per_layer=PAGES
    )
    cache = PagedAttentionCache.init_cache(mesh, meta.dtype, meta, pm)
    table = rng.permutation(PAGES)[:12].reshape(2, WIDTH).astype(np.int32)
    new = np.array([10, 5], np.int32)
    md = PagedAttentionMetadata.for_mixed(table, np.zeros(2, np.int32), new, cache_metadata=meta)
    kv = [rng.standard_normal((1, 15, 8, D)).astype(ml_dtypes.bfloat16) for _ in range(2)]
    cache, dropped = cache.write(kv[0], kv[1], md)
    assert int(dropped) == 0
    q = rng.standard_normal((15, 32, D)).astype(ml_dtypes.bfloat16)
    got = view_attention(q, cache[0], md)
    want = paged_attention_reference(q, np.asarray(cache[0].key_pages), np.asarray(cache[0].value_pages), md,
                                     dtype="bfloat16")  # fmt: skip
    assert_close(got, want, "bfloat16")
    # token 0 of sequence 0 sees only itself: its output is its own value row, per kv head
    np.testing.assert_allclose(
        np.asarray(got[0], np.float32).reshape(8, GROUP, D),
        np.repeat(np.asarray(kv[1][0, 0], np.float32)[:, None], GROUP, axis=1), rtol=1e-2, atol=1e-2,
    )  # fmt: skip


# ---------------------------------------------------------------------- no cross-device traffic
def test_head_sharded_hlo_has_no_collectives_and_dp_reduces_only_the_output():
    rng = np.random.default_rng(5)
    for name in ("heads", "dp"):
        layout = page_layout(name)
        (_, _), (k, v) = make_pages(rng, name, "bfloat16")
        for md in (decode_md(rng, name), mixed_md(rng, name)):
            q = jnp.zeros((md.num_tokens, 32, D), jnp.bfloat16)
            # B023: fn is lowered and compiled right below, in this iteration.
            fn = jax.jit(lambda q, k, v, md: paged_attention(q, k, v, md, layout=layout,  # noqa: B023
                                                             dtype="bfloat16"))
            hlo = fn.lower(q, k, v, jax.tree.map(jnp.asarray, md)).compile().as_text()
            found = set(COLLECTIVES.findall(hlo))
            if name == "heads":
                assert not found, f"collectives in head-sharded attention: {found}"
            else:
                # one all-reduce of the output over the replicas, never of pages
                assert found <= {"all-reduce"}, found
                shapes = re.findall(r"= (\S+) all-reduce\(", hlo)
                assert shapes and all(f"[{md.num_tokens},8,{D}]" in s for s in shapes), shapes


# ---------------------------------------------------------------------- implementation choice
def test_implementation_is_visible_and_overridable():
    rng = np.random.default_rng(6)
    (_, _), (k, v) = make_pages(rng, "single", "float32")
    md = decode_md(rng, "single")
    q = np.zeros((md.num_tokens, 8, D), np.float32)
    assert paged_attention_implementation(q, k, v, md) == "xla"
    assert paged_attention_implementation(q, k, v, md, implementation="xla") == "xla"
    with pytest.raises(ValueError, match=r"implementation='pallas_tpu' cannot run this call: it runs on TPU only "
                                         r"and the pages are on cpu"):  # fmt: skip
        paged_attention(q, k, v, md, implementation="pallas_tpu")


def test_pallas_tpu_wiring_in_interpret_mode():
    """The Pallas TPU decode path (scale, lengths, page indices, soft cap, GQA, padding rows),
    run by Pallas' TPU interpreter on CPU. The interpreter rounds dot operands to bf16 like the
    TPU's default precision, hence the bf16 tolerance."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    if not hasattr(pltpu, "force_tpu_interpret_mode"):
        pytest.skip("this jax has no Pallas TPU interpreter")
    rng = np.random.default_rng(9)
    k, v = (rng.standard_normal((2, 16, 16, 128)).astype(np.float32) for _ in range(2))
    table = rng.permutation(16)[:12].reshape(3, 4).astype(np.int32)
    md = PagedAttentionMetadata(decodes_position=np.array([0, 37, -1], np.int32), decodes_page_table=table)
    q = rng.standard_normal((3, 8, 128)).astype(np.float32)
    cfg, step_meta = prepare(q, k, v, md, AttentionOptions(logit_soft_cap=2.0))
    assert cfg.implementation == "xla"  # on CPU; force the TPU path below
    with pltpu.force_tpu_interpret_mode():
        got = run(q, k, v, step_meta, cfg=dataclasses.replace(cfg, implementation="pallas_tpu"))
    assert_close(got, paged_attention_reference(q, k, v, md, logit_soft_cap=2.0), "bfloat16")
    assert not np.asarray(got)[2].any()


# ---------------------------------------------------------------------- bad input
def _bad_cases():
    rng = np.random.default_rng(7)
    k = np.zeros((2, PAGES, PS, D), np.float32)
    raw = np.zeros((2, PAGES, PS, D), np.uint16)
    dec = decode_md(rng, "single")
    q = np.zeros((6, 8, D), np.float32)
    pre = prefill_md(rng, "single")
    mix = mixed_md(rng, "single")
    qm = np.zeros((14, 8, D), np.float32)
    t = dec.decodes_page_table
    yield (q[0], k, k, dec), {}, r"q must be \(tokens, num_q_heads, head_dim\), got shape \(8, 16\)"
    yield (q.astype(np.int32), k, k, dec), {}, r"q has dtype int32"
    yield (q, k[0], k[0], dec), {}, (r"key_pages must be \(num_kv_heads, num_pages, page_size, head_dim\), "
                                     r"got shape \(48, 4, 16\)")
    yield (q, k, k[:, :8], dec), {}, r"key_pages has shape \(2, 48, 4, 16\) but value_pages has shape \(2, 8, 4, 16\)"
    yield (q, k, k.astype(np.float16), dec), {}, r"key_pages are float32 but value_pages are float16"
    yield (q[..., :8], k, k, dec), {}, r"q has head_dim 8 but the pages have head_dim 16"
    yield ((q[:, :6], k[:1].repeat(4, 0), k[:1].repeat(4, 0), dec), {},
           r"q has 6 heads, not a multiple of the 4 kv heads")
    yield (q, raw, raw, dec), {}, r"pages are stored as uint16 \(raw bits\); pass dtype= .*bfloat16 or float16"
    yield (q, raw, raw, dec), {"dtype": "float32"}, r"pages stored as uint16 cannot hold float32 values"
    yield (q, k, k, dec), {"dtype": "int8"}, r"dtype=int8 is not a page dtype"
    yield (q, k, k, dec), {"scale": 0.0}, r"scale must be a number in \(0, inf\), got 0.0"
    yield (q, k, k, dec), {"sliding_window": 0}, r"sliding_window must be a positive int, got 0"
    yield (q, k, k, dec), {"logit_soft_cap": -1.0}, r"logit_soft_cap must be a number in \(0, inf\), got -1.0"
    yield (q, k, k, dec), {"implementation": "cuda"}, r"implementation='cuda'; use one of 'auto', 'xla', 'pallas_tpu'"
    yield (q, k, k, dec), {"pages_per_block": 0}, r"pages_per_block must be a positive int, got 0"
    yield (q, k, k, dec), {"layout": "tp"}, r"layout must be a PageLayout or None, got str"
    yield (q, k, k, {"positions": 1}), {}, (r"the step metadata must be a RaggedStep or a PagedAttentionMetadata, "
                                            r"got dict")
    yield (q, k, k, PagedAttentionMetadata()), {}, r"metadata names no step: it is empty \(init_empty\)"
    # decode
    yield (q[:5], k, k, dec), {}, r"q has 5 rows but metadata.decodes_position has 6; give one query row per token"
    yield ((q, k, k, dec.replace(decodes_page_table=t[:5])), {},
           r"decodes_page_table has 5 rows but decodes_position has 6")
    yield ((q, k, k, dec.replace(decodes_position=dec.decodes_position.astype(np.float32))), {},
           r"decodes_position must hold integers, got dtype float32")
    bad = t.copy()
    bad[4, 5] = PAGES
    yield ((q, k, k, dec.replace(decodes_page_table=bad)), {},
           r"decodes_page_table\[4, 5\] = 48 is not a page of the pool \(0..47\) but row 4 reads it "
           r"\(keys up to position 23\)")
    bad = t.copy()
    bad[2, 1] = -1
    yield ((q, k, k, dec.replace(decodes_page_table=bad)), {},
           r"decodes_page_table\[2, 1\] = -1 is no page \(never assigned, or released when it left a sliding or "
           r"chunked window\)")
    yield ((q, k, k, dec.replace(decodes_page_table=t[:, :5])), {},
           r"row 4 of metadata.decodes_page_table must cover 24 tokens \(6 pages of 4\) but the table has only "
           r"5 columns")
    yield ((q, k, k, dec.replace(decodes_position=np.array([0, 3, -2, 1, 1, 1], np.int32))), {},
           r"decodes_position\[2\] = -2")
    # prefill
    qp = np.zeros((10, 8, D), np.float32)
    yield (qp[:9], k, k, pre), {}, r"q has 9 rows but metadata.prefill_position has 10"
    yield (qp, k, k, pre.replace(prefill_length=np.asarray(11, np.int32))), {}, r"prefill_length=11 is outside 0..10"
    # mixed
    yield (qm[:13], k, k, mix), {}, r"q has 13 rows but metadata.positions has 14"
    yield ((qm, k, k, mix.replace(query_start_loc=mix.query_start_loc[:-1])), {},
           r"query_start_loc needs 7 entries and context_lens 6; got 6 and 6")
    yield (qm, k, k, mix.replace(num_seqs=np.asarray(7, np.int32))), {}, r"num_seqs=7 is outside 0..6"
    yield ((qm, k, k, mix.replace(query_start_loc=np.array([0, 3, 2, 10, 11, 11, 11], np.int32))), {},
           r"query_start_loc \[0, 3, 2, .*\] must start at 0, never decrease")
    yield ((qm, k, k, mix.replace(context_lens=np.array([8, 6, 11, 24, 0, 0], np.int32))), {},
           r"sequence 2 has a query at position 11 but context_lens\[2\] = 11")
    yield ((qm, k, k, mix.replace(page_table=np.where(np.arange(WIDTH) < 1, mix.page_table, -1))), {},
           r"metadata.page_table\[0, 1\] = -1 is no page .* but row 0 reads it \(keys 4.. up to position 7\)")


@pytest.mark.parametrize("case", list(_bad_cases()), ids=lambda c: c[2][:40])
def test_bad_input_raises_precisely(case):
    args, kwargs, message = case
    with pytest.raises(ValueError, match=message):
        paged_attention(*args, **kwargs)


def test_bad_layouts_and_views():
    rng = np.random.default_rng(8)
    layout = page_layout("dp")
    (_, _), (k, v) = make_pages(rng, "dp", "float32")
    md = decode_md(rng, "dp")
    q = np.zeros((md.num_tokens, 32, D), np.float32)
    # a sequence whose pages straddle the two replicas' slices
    table = md.decodes_page_table.copy()
    table[4, 5] = table[1, 0]  # row 4 (24 tokens) lives in slice 0, row 1 in slice 1
    with pytest.raises(ValueError, match=r"row 4 of metadata.decodes_page_table uses pages of two data-parallel "
                                         r"replicas \(page \d+ in slice 0, page \d+ in slice 1; "
                                         r"24 pages per slice\)"):  # fmt: skip
        paged_attention(q, k, v, md.replace(decodes_page_table=table), layout=layout)
    heads = page_layout("heads")
    with pytest.raises(ValueError, match=r"layout splits kv heads over \('tp',\) \(8 shards\) "
                                         r"but the pages have 2 kv heads"):
        paged_attention(q[:, :8], k[:2], v[:2], md, layout=heads)
    view = type("View", (), {"key_pages": k, "value_pages": v, "layout": layout, "dtype": np.dtype("float32")})()
    with pytest.raises(ValueError, match=r"view_attention takes dtype from the view; do not pass dtype="):
        view_attention(q, view, md, dtype="float32")
    with pytest.raises(ValueError, match=r"view must be a PagedAttentionCacheView"):
        view_attention(q, object(), md)


# ---------------------------------------------------------------------- options
def test_entry_point_keywords_are_the_options():
    """AttentionOptions is the one list of the options: paged_attention's keyword-only parameters
    are its fields (names, order, defaults), paged_attention_reference's a subset of them."""
    fields = [(f.name, f.default) for f in dataclasses.fields(AttentionOptions)]

    def keywords(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]

    assert keywords(paged_attention) == fields
    assert set(REFERENCE_OPTIONS) < {name for name, _ in fields}
    q, k = np.zeros((1, 2, D), np.float32), np.zeros((2, PAGES, PS, D), np.float32)
    md = PagedAttentionMetadata(decodes_position=np.zeros(1, np.int32), decodes_page_table=np.zeros((1, 1), np.int32))
    for name in ("layout", "implementation", "query_block", "scael"):
        with pytest.raises(ValueError, match=r"takes the options scale, sliding_window, chunk_size, value_head_dim, "
                                             rf"logit_soft_cap, dtype; got {name}"):
            paged_attention_reference(q, k, k, md, **{name: None})


def test_the_typed_keywords_are_the_options():
    """The ``**options`` the entry points pass on are typed: AttentionKeywords holds the options'
    fields, ImplementationKeywords sinks and layer too, ViewKeywords all but the view's layout and
    dtype, ReferenceKeywords the reference's (REFERENCE_OPTIONS, in order)."""
    def keys(typed):
        return typed.__required_keys__ | typed.__optional_keys__

    fields = {f.name for f in dataclasses.fields(AttentionOptions)}
    assert keys(AttentionKeywords) == fields
    assert keys(ImplementationKeywords) == fields | {"sinks", "layer"}
    assert keys(ViewKeywords) == fields - {"layout", "dtype"}
    assert keys(ReferenceKeywords) == set(REFERENCE_OPTIONS)
    assert REFERENCE_OPTIONS == ("scale", "sliding_window", "chunk_size", "value_head_dim", "logit_soft_cap", "dtype")


def test_equal_options_hash_equal_and_reuse_one_compile():
    """Options are normalized when built (numpy scalars, dtype spellings), so equal options are
    one jit static argument: a second call with the same options in other spellings does not
    compile again."""
    rng = np.random.default_rng(10)
    k, v = (rng.standard_normal((2, PAGES, PS, D)).astype(np.float32) for _ in range(2))
    md = decode_md(rng, "single")
    q = rng.standard_normal((md.num_tokens, 8, D)).astype(np.float32)
    opts = {"scale": 0.5, "sliding_window": 8, "logit_soft_cap": 30.0, "pages_per_block": 2, "query_block": 4}
    other = {**opts, "scale": np.float32(0.5), "sliding_window": np.int64(8), "pages_per_block": np.int32(2)}
    a, b = AttentionOptions(dtype="float32", **opts), AttentionOptions(dtype=np.float32, **other)
    assert a == b and hash(a) == hash(b) and type(b.sliding_window) is int and type(b.scale) is float
    first = paged_attention(q, k, v, md, dtype="float32", **opts)
    compiled = run._cache_size()
    second = paged_attention(q, k, v, md, dtype=np.float32, **other)
    assert run._cache_size() == compiled
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
