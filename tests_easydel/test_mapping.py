"""EasyDeL's partition managers and quantizers as easykv's (or refused, naming the alternative),
use_easykv's refusals (a refused model is left unchanged), the traceable runtime conversion,
cache interop, and the module without EasyDeL installed."""

import pytest

pytest.importorskip("easydel", reason="EasyDeL 0.3 is not installed: pip install 'easykv[easydel]'")

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from easydel.layers.attention import FlexibleAttentionModule  # noqa: E402
from easydel.layers.quantization import (  # noqa: E402
    EasyQuantizer,
    QuantizationConfig,
    QuantizationType,
    TurboQuantConfig,
)
from easydel.utils.traversals import iter_module_search  # noqa: E402
from eformer.escale import PartitionAxis as EPartitionAxis  # noqa: E402
from eformer.escale import PartitionManager as EPartitionManager  # noqa: E402
from helpers import GreedyEngine, run_greedy, tiny_llama  # noqa: E402
from test_config import mesh_of  # noqa: E402

import easykv  # noqa: E402
from easykv.integrations.easydel import (  # noqa: E402
    EasyKVCache,
    EasyKVRaggedPageAttnV3,
    easydel_config_from_metadata,
    easydel_metadata_from_easykv,
    metadata_from_easydel_config,
    partition_manager_from_easydel,
    quantizer_from_easydel,
    runtime_from_easydel,
    use_easykv,
)
from easykv.quantization import QuantizedPages  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager  # noqa: E402


# ---- partition managers -----------------------------------------------------------------------------
def test_partition_manager_from_easydel():
    pm = partition_manager_from_easydel(EPartitionManager(EPartitionAxis()))
    assert pm.paxis == PartitionAxis(batch_axis=("fsdp", "dp"), sequence_axis="sp", head_axis="tp", kv_head_axis="tp",
                                     head_dim_axis=None, page_axis="dp", hidden_axis="tp")
    # On a mesh, axes of size 1 split nothing and are dropped (as EasyDeL's sizing treats them).
    on_tp8 = partition_manager_from_easydel(EPartitionAxis(), mesh=mesh_of(1, 8))
    assert (on_tp8.paxis.kv_head_axis, on_tp8.paxis.page_axis, on_tp8.paxis.batch_axis) == ("tp", None, None)
    on_dp2 = partition_manager_from_easydel(EPartitionAxis(), mesh=mesh_of(2, 4))
    assert (on_dp2.paxis.kv_head_axis, on_dp2.paxis.page_axis) == ("tp", "dp")
    custom = partition_manager_from_easydel(EPartitionAxis(kv_head_axis=("dp", "tp")), mesh=mesh_of(2, 4))
    assert custom.paxis.kv_head_axis == ("dp", "tp")
    # easykv's own pass through; eformer's work wherever easykv takes a partition manager here.
    assert partition_manager_from_easydel(pm) is pm
    meta = easykv.PagedAttentionCacheMetaData.create(mesh_of(2, 4), 4, 2, 64, 16, 8, 8, 0.5, jnp.bfloat16,
                                                     partition_manager=on_dp2, num_pages_per_layer=32)
    assert (meta.kv_head_shards, meta.page_shards) == (4, 2)
    config = easydel_config_from_metadata(meta)
    cache = EasyKVCache.init_cache(mesh_of(2, 4), config, EPartitionManager(EPartitionAxis()))
    assert cache.easykv_metadata == metadata_from_easydel_config(config, mesh=mesh_of(2, 4),
                                                                 partition_manager=EPartitionAxis())
    assert cache.views[0].layout.page_axes == ("dp",) and cache.views[0].layout.head_axes == ("tp",)


def test_easykv_core_names_the_conversion_for_eformer_partition_managers():
    with pytest.raises(ValueError, match=r"got PartitionManager \(an eformer/EasyDeL one converts with "
                       r"easykv.integrations.easydel.partition_manager_from_easydel"):
        easykv.PagedAttentionCacheMetaData.create(mesh_of(1, 8), 4, 2, 64, 16, 8, 8, 0.5, jnp.bfloat16,
                                                  partition_manager=EPartitionManager(EPartitionAxis()),
                                                  num_pages_per_layer=32)


def test_partition_manager_refusals():
    with pytest.raises(ValueError, match=r"easykv or eformer/EasyDeL PartitionManager or PartitionAxis, got dict"):
        partition_manager_from_easydel({"kv_head_axis": "tp"})
    with pytest.raises(ValueError, match=r"rule for kv_head_axis is \('tp', 3\).*mesh axis names"):
        partition_manager_from_easydel(EPartitionAxis(kv_head_axis=("tp", 3)))


# ---- quantizers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,head_dim,name", [
    (None, 128, "none"),
    (EasyQuantizer(None), 128, "none"),
    (EasyQuantizer(QuantizationConfig(dtype=QuantizationType.INT8)), 128, "int8"),
    (QuantizationConfig(dtype="int8"), 128, "int8"),
    (QuantizationConfig(dtype="int8", group_size=128), 128, "int8"),
    (QuantizationConfig(dtype="affine", bits=8), 128, "int8"),
    (QuantizationConfig(dtype="affine", bits=4), 128, "int4-g64-asym"),
    (QuantizationConfig(dtype="affine", bits=4, group_size=32), 128, "int4-g32-asym"),
    (QuantizationConfig(dtype="affine", bits=4, group_size=128), 128, "int4-asym"),
    (QuantizationConfig(dtype="affine"), 64, "int4-asym"),
    (QuantizationConfig(dtype="nvfp8"), 128, "fp8"),
    (QuantizationConfig(dtype="mxfp8"), 128, "fp8"),
    (QuantizationType.INT8, 128, "int8"),
    ("int4-g32", 128, "int4-g32"),
    ("int4-ol", 128, "int4-ol"),
    (easykv.get_quantizer("fp8"), 128, "fp8"),
])  # fmt: skip
def test_quantizer_mapping(value, head_dim, name):
    assert quantizer_from_easydel(value, head_dim=head_dim) == name


@pytest.mark.parametrize("value,match", [
    (QuantizationConfig(dtype="nf4"), r"'nf4'.*non-uniform.*'int4-g64'"),
    (QuantizationConfig(dtype="mxfp4"), r"'mxfp4'.*'int4-g32'"),
    (QuantizationConfig(dtype="nvfp4"), r"'nvfp4'.*'int4-g16'"),
    (QuantizationConfig(dtype="ternary"), r"'ternary'.*'int4'"),
    (QuantizationConfig(dtype="binary"), r"'binary'.*'int4'"),
    (QuantizationType.TURBOQUANT, r"'turboquant'.*'int4-rot' or 'int8-rot'"),
    (TurboQuantConfig(bits=3), r"TurboQuantConfig\(bits=3\).*'int4-rot'"),
    (QuantizationConfig(dtype="int8", simulate=True), r"simulate=True.*quantizer=None"),
    (QuantizationConfig(dtype="int8", runtime_dtype="nf4"), r"runtime_dtype=nf4.*runtime_dtype=None"),
    (QuantizationConfig(dtype="int8", group_size=32),
     r"group_size=32: easykv's 'int8' keeps one scale per token and kv head.*'int4-g32'"),
    (QuantizationConfig(dtype="affine", bits=3), r"bits=3: easykv has 'int8' and 'int4' pages only"),
    (QuantizationConfig(dtype="affine", bits=4, group_size=48), r"group_size=48 does not divide head_dim=128"),
    ("nf5", r"unknown quantizer 'nf5'"),
])  # fmt: skip
def test_quantizer_refusals(value, match):
    with pytest.raises(ValueError, match=match):
        quantizer_from_easydel(value, head_dim=128)


def test_quantizer_type_refusal():
    with pytest.raises(ValueError, match=r"quantizer must be None, an easykv quantizer.*got int"):
        quantizer_from_easydel(8)


# ---- use_easykv ---------------------------------------------------------------------------------------
def _impls(model):
    return [type(f.impl).__name__ for _, f in iter_module_search(model, FlexibleAttentionModule)]


def test_use_easykv_refusals_leave_the_model_unchanged():
    with pytest.raises(ValueError, match="EasyDeL 0.3 model"):
        use_easykv(object())
    model = tiny_llama(jnp.float32)
    before = (type(model), _impls(model))
    with pytest.raises(ValueError, match="num_pages_per_layer .* or memory_bytes_per_device .* not both"):
        use_easykv(model, num_pages_per_layer=8, memory_bytes_per_device=1 << 20)
    for options, match in (({"query_block": 0}, r"query_block must be a positive int, got 0"),
                           ({"implementation": "cuda"}, r"'cuda'"),
                           ({"sliding_window": 4}, r"a dict of \('query_block'"), ([("query_block", 8)], r"a dict")):
        with pytest.raises(ValueError, match=match):
            use_easykv(model, attention_options=options)
    model.config.kv_cache_quantization_config = TurboQuantConfig(bits=4)
    with pytest.raises(ValueError, match=r"TurboQuantConfig\(bits=4\) has no easykv counterpart"):
        use_easykv(model)
    model.config.kv_cache_quantization_config = QuantizationConfig(dtype="int8")
    with pytest.raises(ValueError, match=r"use_easykv\(quantizer='fp8'\) contradicts the model's KV quantization"):
        use_easykv(model, quantizer="fp8")
    model.config.kv_cache_quantization_config = None
    from easydel.operations import VanillaAttn

    first = next(iter_module_search(model, FlexibleAttentionModule))[1]
    first.impl_decode = VanillaAttn(first.impl.metadata)  # a decode operation that cannot read pages
    with pytest.raises(ValueError, match=r"impl_decode runs 'vanilla'.*ragged_page_attention_v3"):
        use_easykv(model)
    assert (type(model), _impls(model)) == before
    mla = tiny_llama(jnp.float32)
    mla.config.attn_mechanism = "multi_latent_ragged_page_attention_v2"
    with pytest.raises(ValueError, match=r"multi-latent \(MLA\).*MLARaggedPagesCache"):
        use_easykv(mla)


def test_use_easykv_converts_other_mechanisms():
    model = use_easykv(tiny_llama(jnp.float32, mechanism="vanilla"), num_pages_per_layer=32)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.attn_mechanism == "ragged_page_attention_v3"
    assert set(_impls(model)) == {EasyKVRaggedPageAttnV3.__name__}
    assert model.esurge_compatible_model is model  # eSurge keeps this model (and its easykv hooks)
    config = model.create_ragged_page_cache_config(64, page_size=16)
    assert (config.num_pages, config.version, config.max_num_pages_per_req) == (32, "v3", 4)


def test_quantized_cache_from_the_model_config():
    """The model config's EasyDeL quantizer (what eSurge passes) gives easykv int8 pages; a
    forward pass writes quantized codes and reads them back."""
    model = tiny_llama(jnp.float32)
    model.config.kv_cache_quantization_config = QuantizationConfig(dtype=QuantizationType.INT8)
    model = use_easykv(model, num_pages_per_layer=32)
    quantizer = EasyQuantizer(quantization_config=model.config.kv_cache_quantization_config)  # as eSurge builds it
    cache = model.init_operations_cache(2, 64, page_size=16, quantizer=quantizer)
    meta = cache.easykv_metadata
    assert meta.quantization == "int8" and isinstance(cache.views[0].k_pages, QuantizedPages)
    engine = GreedyEngine(model, cache, "v3")
    (out,) = run_greedy([engine], [[5, 6, 7], [9, 10, 11, 12, 13, 14]], 4, meta=meta, tokens_per_step=16)
    assert all(len(seq) == 4 for seq in out)
    values = np.asarray(engine.cache.views[1].k_pages.values)
    assert values.dtype == np.int8 and np.count_nonzero(values) > 0


# ---- runtime metadata, cache interop ------------------------------------------------------------------
def test_runtime_conversion_is_exact_and_traceable():
    meta = easykv.PagedAttentionCacheMetaData.create(mesh_of(1, 8), 4, 2, 64, 16, 8, 8, 0.5, jnp.bfloat16,
                                                     num_pages_per_layer=32)
    table = np.array([[3, 7, 1, 2], [4, 5, 6, 8], [9, 10, 11, 12], [13, 14, 15, 16]], np.int32)
    step_meta = easykv.PagedAttentionMetadata.for_mixed(table, [14, 0, 0, 30], [5, 17, 0, 1], cache_metadata=meta,
                                                 pad_tokens_to=32, pad_seqs_to=4)
    for version in ("v2", "v3"):
        md = easydel_metadata_from_easykv(step_meta, page_size=16, version=version)
        back = jax.jit(lambda m: runtime_from_easydel(m, num_tokens=32, page_size=16, num_pages=32))(md)
        for field in ("slot_mapping", "positions", "query_start_loc", "page_table", "context_lens", "num_seqs"):
            np.testing.assert_array_equal(np.asarray(getattr(back, field)), np.asarray(getattr(step_meta, field)),
                                          field)
    v2 = easydel_metadata_from_easykv(step_meta, page_size=16, version="v2")
    # The page manager's answer (a tuple, one item per layer group) is taken as its one item.
    from_tuple = easydel_metadata_from_easykv((step_meta,), page_size=16, version="v2")
    assert np.array_equal(np.asarray(from_tuple.slot_mapping), np.asarray(v2.slot_mapping))
    with pytest.raises(ValueError, match="2"):
        easydel_metadata_from_easykv((step_meta, step_meta), page_size=16)  # 2 layer groups: index it by group
    n = int(v2.num_kv_update_slices[0])  # positions 14..18 of seq 0 cross from page 3 to 7; seq 1 fills page 4
    assert np.asarray(v2.slot_mapping)[:, :n].tolist() == [[62, 112, 64, 80, 238], [0, 2, 5, 21, 22], [2, 3, 16, 1, 1]]
    # A page id outside the pool gives an invalid slot (dropped by the write), never a clipped one.
    bad = md.replace(pages_tables=md.pages_tables.at[0, 0].set(1 << 20))
    slots = runtime_from_easydel(bad, num_tokens=32, page_size=16, num_pages=32).slot_mapping
    assert int(slots[0]) == -2 and int(slots[2]) == np.asarray(step_meta.slot_mapping)[2]


def test_cache_interop_shares_arrays():
    mesh = mesh_of(1, 8)
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 4, 2, 64, 16, 8, 8, 0.5, jnp.bfloat16,
                                                     num_pages_per_layer=32)
    ekv = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, PartitionManager(PartitionAxis()))
    wrapped = EasyKVCache.from_easykv(ekv, version="v2")
    assert wrapped.views[1].group_key_pages is ekv.key_pages[0] and wrapped.metadata.version == "v2"
    assert wrapped.views[1].layer == 1 and wrapped.views[1].key_pages.shape == (8, 32, 16, 8)
    assert wrapped.views[0].key_pages.dtype == np.uint16 and wrapped.views[0].dtype == np.dtype("bfloat16")
    back = wrapped.to_easykv()
    assert back.value_pages[0] is ekv.value_pages[0] and back.metadata == meta
    with pytest.raises(NotImplementedError, match="key_pages / value_pages"):
        wrapped.views[0].flattened_kv_pages()
    # One leaf per stacked array: the views hold none (a view holding the stack would make jit
    # return one copy of the pool per layer).
    leaves = jax.tree.leaves(wrapped)
    assert len(leaves) == 2 and all(leaf.shape == (2, 8, 32, 16, 8) for leaf in leaves)
    rebuilt = jax.tree.unflatten(jax.tree.structure(wrapped), leaves)
    assert rebuilt.views[1].group_key_pages is leaves[0]  # the rebuilt views follow the rebuilt cache


def test_without_easydel_installed():
    """JSON, partition and quantizer conversions need no EasyDeL; the rest says how to install it."""
    code = r"""
import json, sys
sys.modules["easydel"] = None  # as if not installed
import easykv.integrations.easydel as e
meta = e.metadata_from_easydel_config(json.dumps(CONFIG), batch_size=4)
assert e.easydel_config_json(meta, version="v2") == json.dumps(CONFIG)
assert e.quantizer_from_easydel("int8") == "int8"
for call in (lambda: e.use_easykv(None), lambda: e.EasyKVCache, lambda: e.easydel_config_from_metadata(meta)):
    try:
        call()
    except ImportError as err:
        assert "pip install 'easykv[easydel]'" in str(err), err
    else:
        raise AssertionError("no ImportError")
print("ok")
"""
    from easykv.integrations.easydel import easydel_config_dict

    meta = easykv.PagedAttentionCacheMetaData.create(mesh_of(1, 8), 4, 2, 64, 16, 8, 8, 0.5, jnp.bfloat16,
                                                     num_pages_per_layer=32)
    config = easydel_config_dict(meta, version="v2")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", f"CONFIG = {config!r}\n{code}"], capture_output=True, text=True,
                         check=False, env=env, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
