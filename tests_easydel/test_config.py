"""EasyDeL 0.3's RaggedPagesCacheConfig JSON (v2 and v3) <-> easykv's metadata, both ways, and
the configs easykv refuses (each error names the object and the supported alternative)."""

import pytest

pytest.importorskip("easydel", reason="EasyDeL 0.3 is not installed: pip install 'easykv[easydel]'")

import dataclasses  # noqa: E402
import json  # noqa: E402

import jax.numpy as jnp  # noqa: E402
from easydel.caching import MLARaggedPagesCacheConfig, RaggedPagesCacheConfig  # noqa: E402
from eformer.escale import PartitionAxis as EPartitionAxis  # noqa: E402
from eformer.escale import PartitionManager as EPartitionManager  # noqa: E402
from helpers import easydel_pool_of  # noqa: E402

import easykv  # noqa: E402
from easykv.integrations.easydel import (  # noqa: E402
    easydel_config_dict,
    easydel_config_from_metadata,
    easydel_config_json,
    metadata_from_easydel_config,
)
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402

AXES = ("dp", "fsdp", "ep", "tp", "sp")


def mesh_of(dp, tp):
    return create_mesh(dict(zip(AXES, (dp, 1, 1, tp, 1))))


def easydel_config(mesh, version, dtype=jnp.bfloat16, pages=96, max_len=200, page_size=16):
    with easydel_pool_of(pages, dtype, page_size):
        return RaggedPagesCacheConfig.create(
            mesh=mesh, partition_manager=EPartitionManager(EPartitionAxis()), kvdtype=dtype, num_hidden_layers=2,
            num_kv_heads=8, max_model_length=max_len, kv_head_dim_size=8, page_size=page_size, version=version)


@pytest.mark.parametrize("version", ["v2", "v3"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16], ids=["bf16", "f32", "f16"])
@pytest.mark.parametrize("dp,tp", [(1, 8), (2, 4)], ids=["tp8", "dp2xtp4"])
def test_easydel_json_round_trip(version, dtype, dp, tp):
    mesh = mesh_of(dp, tp)
    config = easydel_config(mesh, version, dtype)
    text = config.to_json()
    meta = metadata_from_easydel_config(text, mesh=mesh, partition_manager=EPartitionManager(EPartitionAxis()))
    assert (meta.num_pages_per_layer, meta.page_size, meta.max_sequences) == (config.num_pages, 16, 200)
    assert meta.num_pages_per_sequence == config.max_num_pages_per_req == 13
    assert meta.dtype == jnp.dtype(dtype) and meta.quantization == "none"
    assert (meta.kv_head_mesh_axes, meta.kv_head_shards) == (("tp",), tp)
    assert (meta.page_mesh_axes, meta.page_shards) == ((("dp",), 2) if dp == 2 else ((), 1))
    assert easydel_config_json(meta, version=version) == text  # byte for byte what EasyDeL writes
    # The object and a dict of its fields read the same.
    assert metadata_from_easydel_config(config, mesh=mesh) == meta
    assert metadata_from_easydel_config(json.loads(text), mesh=mesh) == meta
    assert easydel_config_from_metadata(meta, version=version) == config
    # The pool it describes is allocated by easykv on that mesh, laid out as the config says.
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp", page_axis="dp" if dp == 2 else None))
    cache = easykv.PagedAttentionCache.init_cache(mesh, meta.dtype, meta, pm)
    assert cache.metadata.kv_head_shards == tp and cache.metadata.page_shards == dp


@pytest.mark.parametrize("version", ["v2", "v3"])
@pytest.mark.parametrize("batch_size", [None, 12])
def test_easykv_metadata_round_trip(version, batch_size):
    mesh = mesh_of(1, 8)
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 12 if batch_size else 1024 * 1024 // 2 // 13 // 4, 3, 200, 16, 8, 8, 0.5, jnp.float32,
        partition_manager=PartitionManager(PartitionAxis(kv_head_axis="tp")), num_pages_per_layer=40)
    text = easydel_config_json(meta, version=version)
    data = json.loads(text)
    assert data["max_num_reqs"] == (12 if batch_size else -1)  # EasyDeL's get_max_num_seqs default is -1
    assert data["num_pages"] == 40 and data["kv_head_shards"] == 8 and data["_kvdtype_str"] == "fp32"
    assert RaggedPagesCacheConfig.from_json(text).to_json() == text  # EasyDeL reads it as its own
    assert metadata_from_easydel_config(text, mesh=mesh) == meta
    # A budget-sized metadata keeps everything but the budget record, which EasyDeL has no field for.
    sized = easykv.PagedAttentionCacheMetaData.create(mesh, 4, 2, 64, 16, 8, 8, 0.5, jnp.bfloat16,
                                                      memory_bytes_per_device=1 << 20)
    back = metadata_from_easydel_config(easydel_config_json(sized, version=version), mesh=mesh, batch_size=4)
    assert back == dataclasses.replace(sized, memory_bytes_per_device=None)


def _json(**changes):
    return json.dumps({**easydel_config_dict(_meta()), **changes})


def _meta():
    return easykv.PagedAttentionCacheMetaData.create(mesh_of(1, 8), 4, 2, 64, 16, 8, 8, 0.5, jnp.bfloat16,
                                                     num_pages_per_layer=32)


@pytest.mark.parametrize("changes,match", [
    ({"version": "v4"}, r"version 'v4' is not supported.*'v2' and 'v3'"),
    ({"version": "v1"}, r"version 'v1' is not supported"),
    ({"v_headdim": 16}, r"k_headdim=8 differs from v_headdim=16.*one head_dim"),
    ({"_kvdtype_str": "fp8_e4m3fn"}, r"'fp8_e4m3fn'.*quantizer='fp8'"),
    ({"_kvdtype_str": "fp64"}, r"'fp64' is not an easykv cache dtype.*'fp32'"),
    ({"num_pages": -1}, r"num_pages=-1: the config was never sized.*RaggedPagesCacheConfig.create"),
    ({"max_num_pages_per_req": 7}, r"max_num_pages_per_req=7 differs from .* = 4"),
    ({"num_slices_per_kv_cache_update_page": 3}, r"num_slices_per_kv_cache_update_page=3 .* set it to -1 or 64"),
    ({"max_num_tokens": 256}, r"max_num_tokens=256 cannot be kept: .*pad_tokens_to"),
    ({"window_aware_max_num_seqs": 8}, r"window_aware_max_num_seqs=8 .*enable_window_aware_runtime_cap=False"),
    ({"_mixed_layer_configs": {"0": 1}}, r"_mixed_layer_configs is set: .*per-layer"),
    ({"num_kv_heads": 4, "kv_head_shards": 8}, r"kv_head_shards=8 does not divide num_kv_heads=4.*whole kv heads"),
    ({"turboquant_config": {"bits": 4}}, r"TurboQuantRaggedPagesCacheConfig.*quantizer='int4-rot'"),
    ({"extra_field": 1}, r"no fields \['extra_field'\]"),
])  # fmt: skip
def test_refused_configs(changes, match):
    with pytest.raises(ValueError, match=match):
        metadata_from_easydel_config(_json(**changes))


def test_refused_inputs():
    unified = {k: v for k, v in easydel_config_dict(_meta()).items() if k not in ("k_headdim", "v_headdim",
                                                                                 "kv_head_shards")}
    with pytest.raises(ValueError, match=r"UnifiedAttentionCacheConfig.*ragged_page_attention_v3"):
        metadata_from_easydel_config({**unified, "head_dim": 8})
    mla = MLARaggedPagesCacheConfig(**{**easydel_config_dict(_meta()), "k_headdim": 128, "v_headdim": 64})
    with pytest.raises(ValueError, match=r"MLARaggedPagesCacheConfig cannot be mapped.*MLARaggedPagesCache"):
        metadata_from_easydel_config(mla)
    with pytest.raises(ValueError, match=r"missing the required fields \['num_kv_heads'\]"):
        metadata_from_easydel_config({k: v for k, v in json.loads(_json()).items() if k != "num_kv_heads"})
    with pytest.raises(ValueError, match="not valid JSON"):
        metadata_from_easydel_config("{not json")
    with pytest.raises(ValueError, match="expected an EasyDeL RaggedPagesCacheConfig"):
        metadata_from_easydel_config(42)
    with pytest.raises(ValueError, match=r"batch_size=3 contradicts the config's max_num_reqs=12"):
        metadata_from_easydel_config(_json(max_num_reqs=12), batch_size=3)
    # Shard counts the mesh cannot produce: the layout cannot be mapped.
    with pytest.raises(ValueError, match=r"kv_head_shards=4 cannot be laid out on this mesh.*of size 8"):
        metadata_from_easydel_config(_json(kv_head_shards=4), mesh=mesh_of(1, 8))
    with pytest.raises(ValueError, match=r"data_parallel_size=2 cannot be laid out on this mesh"):
        metadata_from_easydel_config(_json(data_parallel_size=2), mesh=mesh_of(1, 8))


def test_refused_reverse_conversions():
    meta = _meta()
    with pytest.raises(ValueError, match=r"quantization='int8': EasyDeL keeps KV quantization in the model config"):
        easydel_config_json(dataclasses.replace(meta, quantization="int8"))
    with pytest.raises(ValueError, match=r"version 'v5'.*'v2' or 'v3'"):
        easydel_config_json(meta, version="v5")
    # 4 kv heads of 64 dims in bf16 pack into 2 groups in EasyDeL's v3 layout: 4 shards cannot split them.
    odd = easykv.PagedAttentionCacheMetaData.create(mesh_of(2, 4), 4, 2, 64, 16, 4, 64, 0.5, jnp.bfloat16,
                                                    partition_manager=PartitionManager(PartitionAxis()),
                                                    num_pages_per_layer=32)
    with pytest.raises(ValueError, match=r"v3 layout packs 4 kv heads .* into 2 groups.*version='v2'"):
        easydel_config_json(odd, version="v3")
    assert json.loads(easydel_config_json(odd, version="v2"))["kv_head_shards"] == 4
