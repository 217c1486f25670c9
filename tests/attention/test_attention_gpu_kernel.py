"""JAX's Pallas GPU paged-attention kernel behind easykv's attention: which calls go to it (the
dispatch rules, on a pretended GPU), and what it computes, run in Pallas interpret mode on CPU
against the XLA path on random pages under permuted page tables."""

import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv.attention import checks
from easykv.attention.api import paged_attention_implementation
from easykv.attention.checks import gpu_blocks
from easykv.quantization import get_quantizer
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh
from tests.support.tiers import tiered

HEADS, DIM, PS, PAGES, WIDTH = 2, 32, 8, 40, 8


def pages(rng, quant, dtype=jnp.bfloat16, heads=HEADS, dim=DIM):
    """One layer's K and V pages of random tokens, plain or quantized."""
    k = jnp.asarray(rng.standard_normal((heads, PAGES, PS, dim)), dtype)
    v = jnp.asarray(rng.standard_normal((heads, PAGES, PS, dim)), dtype)
    if quant == "none":
        return k, v
    q = get_quantizer(quant)
    return q.quantize(k), q.quantize(v)


def decode(rng, lengths, width=WIDTH):
    """Decode metadata over a permuted page table; a length of 0 is a padding row."""
    perm = rng.permutation(PAGES)
    table = np.full((len(lengths), width), -1, np.int32)
    used = 0
    for b, n in enumerate(lengths):
        need = -(-n // PS)
        table[b, :need] = perm[used:used + need]
        used += need
    positions = np.array([n - 1 if n else -1 for n in lengths], np.int32)
    return easykv.PagedAttentionMetadata(decodes_position=positions, decodes_page_table=table)


@pytest.fixture
def on_gpu(monkeypatch):
    """Pretend the pages live on a GPU (or another platform): only the dispatch rules run."""
    def pretend(platform="gpu"):
        monkeypatch.setattr(checks, "_platform", lambda layout, pages: platform)
    return pretend


# ---- which calls go where -------------------------------------------------------------------------
@pytest.mark.parametrize("quant", ["none", "int8", "fp8", "int8-rot", "fp8-rot"])
def test_fitting_decode_goes_to_the_gpu_kernel(on_gpu, quant):
    rng = np.random.default_rng(0)
    k, v = pages(rng, quant)
    md = decode(rng, [9, 30, 0])
    q = jnp.zeros((3, 4 * HEADS, DIM), jnp.bfloat16)
    on_gpu()
    assert paged_attention_implementation(q, k, v, md, dtype=jnp.bfloat16) == "pallas_gpu"
    assert paged_attention_implementation(q, k, v, md, dtype=jnp.bfloat16, implementation="xla") == "xla"
    assert paged_attention_implementation(q, k, v, md, dtype=jnp.bfloat16, logit_soft_cap=30.0) == "pallas_gpu"


def _unfit_cases(rng):
    """(what differs, call arguments, message of the refusal) for calls the GPU kernel cannot take."""
    k, v = pages(rng, "none")
    md = decode(rng, [9, 30])
    q = jnp.zeros((2, 4 * HEADS, DIM), jnp.bfloat16)
    base = {"dtype": jnp.bfloat16}
    yield "int4 pages", (q, *pages(rng, "int4"), md), base, r"int8 / fp8 pages .* not int4 pages"
    yield "int4-ol pages", (q, *pages(rng, "int4-ol"), md), base, r"int8 / fp8 pages .* not int4-ol pages"
    yield "float32 cache", (q.astype(jnp.float32), *pages(rng, "none", jnp.float32), md), {}, r"TF32"
    yield "window", (q, k, v, md), {**base, "sliding_window": 4}, r"no sliding window"
    yield "sinks", (q, k, v, md), {**base, "sinks": jnp.zeros(4 * HEADS)}, r"no sinks"
    yield "latent", (q, k, None, md), {**base, "value_head_dim": 16}, r"no latent cache"
    prefill = easykv.PagedAttentionMetadata(prefill_length=np.int32(5), prefill_position=np.arange(5, dtype=np.int32),
                                            prefill_page_table=md.decodes_page_table[0])
    yield "prefill", (jnp.zeros((5, 4 * HEADS, DIM), jnp.bfloat16), k, v, prefill), base, r"decode only"
    odd_k, odd_v = pages(rng, "none", dim=48)
    yield "head_dim 48", (jnp.zeros((2, 4 * HEADS, 48), jnp.bfloat16), odd_k, odd_v, md), base, r"powers of two"
    yield "narrow table", (q, k, v, decode(rng, [9, 10], width=3)), base, r"3 pages wide .* no block"


def test_calls_it_cannot_take_go_to_xla_and_forcing_them_says_why(on_gpu):
    on_gpu()
    for what, args, options, message in _unfit_cases(np.random.default_rng(1)):
        sinks = options.pop("sinks", None)
        assert paged_attention_implementation(*args, sinks=sinks, **options) == "xla", what
        with pytest.raises(ValueError, match=r"implementation='pallas_gpu' cannot run this call: .*" + message):
            easykv.paged_attention(*args, sinks=sinks, implementation="pallas_gpu", **options)


def test_tpu_kernel_first_on_tpu_and_no_kernel_on_cpu(on_gpu):
    rng = np.random.default_rng(2)
    k, v = pages(rng, "none", dim=128)
    md = decode(rng, [9, 30])
    q = jnp.zeros((2, 4 * HEADS, 128), jnp.bfloat16)
    on_gpu("tpu")
    assert paged_attention_implementation(q, k, v, md) == "pallas_tpu"
    with pytest.raises(ValueError, match=r"'pallas_gpu' cannot run this call: it runs on GPU only and the pages "
                                         r"are on tpu \('pallas_gpu_interpret' runs it"):
        easykv.paged_attention(q, k, v, md, implementation="pallas_gpu")
    on_gpu("cpu")
    assert paged_attention_implementation(q, k, v, md) == "xla"
    assert paged_attention_implementation(q, k, v, md, implementation="pallas_gpu_interpret") == \
        "pallas_gpu_interpret"


def test_page_split_over_replicas_is_not_for_the_kernel(on_gpu):
    mesh = create_mesh({"dp": 2, "tp": 4})
    pm = PartitionManager(PartitionAxis(page_axis="dp"))
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 2, 1, 64, PS, 4, DIM, 0.9, jnp.bfloat16,
                                                     partition_manager=pm, num_pages_per_layer=16)
    view = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm)[0]
    md = easykv.PagedAttentionMetadata.for_decode([[1, 2, -1, -1, -1, -1, -1, -1]], [10], cache_metadata=meta)
    on_gpu()
    with pytest.raises(ValueError, match=r"split over data-parallel replicas"):
        easykv.view_attention(jnp.zeros((1, 8, DIM), jnp.bfloat16), view, md, implementation="pallas_gpu")


@pytest.mark.parametrize("width, page_size, want", [
    (8, 8, (4, 2)), (16, 16, (16, 1)), (8, 4, (2, 4)), (64, 16, (16, 4)), (3, 8, None), (6, 8, (1, 2)), (5, 16, (1, 1)),
])  # fmt: skip
def test_gpu_blocks(width, page_size, want):
    got = gpu_blocks(width, page_size)
    assert got == want
    if got is not None:
        splits, per_block = got
        assert width % splits == 0 and (width // splits) % per_block == 0
        tokens = per_block * page_size
        assert tokens >= 16 and tokens & (tokens - 1) == 0


# ---- what it computes, in interpret mode ------------------------------------------------------------
@pytest.mark.parametrize("quant", tiered(["none", "int8", "fp8", "int8-rot"], fast={"none", "int8"}))
def test_interpreted_kernel_equals_the_xla_path(quant):
    """Random pages, permuted tables, 4 q heads per kv head, a soft cap, a padding row and
    lengths ending mid-page: the kernel (interpret mode) equals the XLA path on the same pages
    to bf16 rounding (the kernel takes the query in bf16)."""
    rng = np.random.default_rng(3)
    k, v = pages(rng, quant)
    md = decode(rng, [9, 0, 64, 17])
    q = jnp.asarray(rng.standard_normal((4, 4 * HEADS, DIM)), jnp.bfloat16)
    for options in ({}, {"logit_soft_cap": 2.0, "scale": 0.3}):
        want = easykv.paged_attention(q, k, v, md, dtype=jnp.bfloat16, implementation="xla", **options)
        got = easykv.paged_attention(q, k, v, md, dtype=jnp.bfloat16, implementation="pallas_gpu_interpret", **options)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
        assert not np.asarray(got[1], np.float32).any()  # the padding row


def test_interpreted_kernel_on_a_sharded_cache_layer():
    """A cache's stacked group on tp=8 (one kv head per device), layer 1 of 2, int8 pages: each
    device runs the kernel on its head; equal to the XLA path and near the dense reference."""
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 3, 2, 128, PS, 8, DIM, 0.9, jnp.bfloat16,
                                                     partition_manager=pm, quantizer="int8", num_pages_per_layer=48)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm, quantizer="int8")
    rng = np.random.default_rng(4)
    rows = np.full((3, meta.num_pages_per_sequence), -1, np.int32)
    perm = rng.permutation(48)
    rows[0, :5], rows[1, :9], rows[2, :2] = perm[:5], perm[5:14], perm[14:16]
    k = jnp.asarray(rng.standard_normal((2, 116, 8, DIM)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, 116, 8, DIM)), jnp.bfloat16)
    cache, _ = cache.write(k, v, easykv.PagedAttentionMetadata.for_mixed(rows, [0, 0, 0], [37, 70, 9],
                                                                         cache_metadata=meta))
    md = easykv.PagedAttentionMetadata.for_decode(rows, [36, 69, -1], cache_metadata=meta)
    q = jnp.asarray(rng.standard_normal((3, 16, DIM)), jnp.bfloat16)
    view = cache[1]
    got = easykv.view_attention(q, view, md, implementation="pallas_gpu_interpret")
    want = easykv.view_attention(q, view, md, implementation="xla")
    ref = easykv.paged_attention_reference(q, view.group_key_pages, view.group_value_pages, md, layer=1,
                                           dtype=jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)
    assert got.sharding.spec[1] == "tp"


def test_a_page_id_outside_the_pool_ends_the_sequence_there():
    """Device metadata cannot be checked on the host: an id past the pool must not be read (a
    kernel reads whole pages) nor clipped onto another page; the sequence's keys end before it."""
    rng = np.random.default_rng(5)
    k, v = pages(rng, "none")
    md = decode(rng, [30, 20])
    table = np.array(md.decodes_page_table)
    bad = table.copy()
    bad[0, 2] = PAGES + 3  # the third page of sequence 0: keys 16.. are gone
    q = jnp.asarray(rng.standard_normal((2, 4 * HEADS, DIM)), jnp.bfloat16)
    on_device = easykv.PagedAttentionMetadata(decodes_position=jnp.asarray(md.decodes_position),
                                              decodes_page_table=jnp.asarray(bad))
    got = easykv.paged_attention(q, k, v, on_device, implementation="pallas_gpu_interpret")
    # What sequence 0 still sees: its first 16 keys, read by a query at position 15's view.
    cut = easykv.PagedAttentionMetadata(decodes_position=np.array([15, 19], np.int32), decodes_page_table=table)
    want = easykv.paged_attention(q, k, v, cut, implementation="xla")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
    whole = easykv.paged_attention(q, k, v, md, implementation="xla")  # sequence 1 is untouched, 0 is not
    np.testing.assert_allclose(np.asarray(got[1], np.float32), np.asarray(whole[1], np.float32), atol=2e-2, rtol=2e-2)
    assert np.abs(np.asarray(got[0], np.float32) - np.asarray(whole[0], np.float32)).max() > 0.1
