"""PagedAttentionCacheMetaData: pool sizing against hand-computed figures, validation, JSON.

Sizing figures (memory_bytes_per_device= makes them deterministic). One page of one layer on one
device costs 2 (K and V) x heads stored on that device x page_size x head_dim x itemsize bytes.
"""

import dataclasses
import json
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from easykv import PagedAttentionCacheMetaData
from easykv.errors import SerializationError
from easykv.sharding import PartitionAxis, PartitionManager, ShardingAdjustedWarning, create_mesh

MiB = 2**20
EASYDEL_FIELDS = (
    "batch_size", "num_hidden_layers", "num_pages_per_layer", "num_pages_per_sequence",
    "max_sequences", "page_size", "num_kv_heads", "kv_head_dim_size", "hbm_utilization",
)  # fmt: skip


HEADS_TP = PartitionManager(PartitionAxis(kv_head_axis="tp"))
PAGES_DP = PartitionManager(PartitionAxis(kv_head_axis="tp", page_axis="dp"))


def make(mesh, pm=HEADS_TP, **kw):
    """create() with the figures used throughout: 4 layers, page_size 16, head_dim 128,
    max_sequences 100 (ceil(100 / 16) = 7 pages per sequence), 1 MiB per device."""
    args = dict(
        batch_size=4, num_hidden_layers=4, max_sequences=100, page_size=16, num_kv_heads=8,
        kv_head_dim_size=128, hbm_utilization=0.9, dtype=jnp.bfloat16,
    )  # fmt: skip
    if "num_pages_per_layer" not in kw:
        args["memory_bytes_per_device"] = MiB
    args.update(kw)
    return PagedAttentionCacheMetaData.create(mesh, partition_manager=pm, **args)


# ------------------------------------------------------------------------------ sizing
def test_head_sharded_sizing(tp8):
    # 8 kv heads over tp=8: one head per device. 2 * 1 * 16 * 128 * 2 B = 8192 B per page and
    # layer; x 4 layers = 32768 B; a budget of 1 MiB + 32767 B holds floor(...) = 32 pages.
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardingAdjustedWarning)
        meta = make(tp8, memory_bytes_per_device=MiB + 32767)
    assert meta.num_pages_per_layer == 32
    assert meta.num_pages_per_sequence == 7
    assert (meta.kv_head_mesh_axes, meta.kv_head_shards) == (("tp",), 8)
    assert (meta.page_mesh_axes, meta.page_shards) == ((), 1)
    assert meta.kv_heads_per_device == 1
    assert meta.page_bytes_per_device == 8192
    assert meta.bytes_per_device == 8192 * 32 * 4 == MiB
    assert meta.bytes_per_token == 2 * 8 * 128 * 2 * 4 == 16384
    assert meta.tokens_per_layer == 32 * 16
    assert meta.max_full_sequences == 4  # 32 // 7
    assert meta.memory_bytes_per_device == MiB + 32767
    assert meta.pages_per_shard == 32


def test_replicated_heads_sizing_warns_and_stores_all_heads(tp8):
    # 4 kv heads do not split over tp=8: every device stores all 4 heads, so one page costs
    # 2 * 4 * 16 * 128 * 2 = 32768 B per layer, 131072 B for 4 layers -> 8 pages in 1 MiB.
    with pytest.warns(ShardingAdjustedWarning, match=r"'tp'.*does not divide 4"):
        meta = make(tp8, num_kv_heads=4)
    assert meta.num_pages_per_layer == 8
    assert (meta.kv_head_mesh_axes, meta.kv_head_shards, meta.kv_heads_per_device) == ((), 1, 4)
    assert meta.page_bytes_per_device == 32768
    assert meta.bytes_per_device == MiB


def test_data_parallel_page_axis_multiplies_the_pool(dp2tp4):
    # dp=2 x tp=4: 2 heads per device -> 2 * 2 * 16 * 128 * 2 = 16384 B per page and layer,
    # 65536 B for 4 layers -> 16 pages per device; each dp replica owns its own 16 pages.
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardingAdjustedWarning)
        sharded = make(dp2tp4, pm=PAGES_DP)
        replicated = make(dp2tp4, pm=HEADS_TP)  # pages not split: both replicas hold the same 16
    assert sharded.page_bytes_per_device == replicated.page_bytes_per_device == 16384
    assert (sharded.page_mesh_axes, sharded.page_shards) == (("dp",), 2)
    assert sharded.pages_per_shard == 16
    assert sharded.num_pages_per_layer == 2 * 16 == 32
    assert sharded.max_full_sequences == 2 * (16 // 7) == 4
    assert (replicated.page_shards, replicated.num_pages_per_layer) == (1, 16)
    assert sharded.kv_head_shards == replicated.kv_head_shards == 4


def test_page_axis_missing_from_mesh_is_reported(tp8):
    with pytest.warns(ShardingAdjustedWarning, match=r"'page'.*no axis 'dp'"):
        meta = make(create_mesh({"tp": 8}), pm=PAGES_DP)
    assert (meta.page_mesh_axes, meta.page_shards, meta.num_pages_per_layer) == ((), 1, 32)
    # dp of size 1 exists: kept, one slice, same pool.
    meta = make(tp8, pm=PAGES_DP)
    assert (meta.page_mesh_axes, meta.page_shards, meta.num_pages_per_layer) == (("dp",), 1, 32)


def test_dtype_effect_on_pages(tp8):
    bf16 = make(tp8, dtype=jnp.bfloat16)
    f16 = make(tp8, dtype="float16")
    f32 = make(tp8, dtype=np.float32)
    assert (bf16.num_pages_per_layer, f16.num_pages_per_layer, f32.num_pages_per_layer) == (32, 32, 16)
    assert f32.page_bytes_per_device == 16384
    assert (bf16.dtype, f16.dtype, f32.dtype) == (np.dtype(jnp.bfloat16), np.dtype("float16"), np.dtype("float32"))


def test_num_pages_per_layer_override(tp8, dp2tp4):
    meta = make(tp8, num_pages_per_layer=40)
    assert meta.num_pages_per_layer == 40 and meta.memory_bytes_per_device is None
    # The override wins over memory (a budget too small for one page is not consulted).
    meta = make(tp8, num_pages_per_layer=40, memory_bytes_per_device=1)
    assert meta.num_pages_per_layer == 40
    dp = make(dp2tp4, pm=PAGES_DP, num_pages_per_layer=30)
    assert (dp.num_pages_per_layer, dp.pages_per_shard, dp.page_shards) == (30, 15, 2)
    with pytest.raises(ValueError, match=r"num_pages_per_layer=31 is not divisible by page_shards=2"):
        make(dp2tp4, pm=PAGES_DP, num_pages_per_layer=31)
    with pytest.raises(ValueError, match=r"cannot hold one full sequence: 6 pages per pool"):
        make(tp8, num_pages_per_layer=6)
    with pytest.raises(ValueError, match=r"cannot hold one full sequence: 6 pages per replica"):
        make(dp2tp4, pm=PAGES_DP, num_pages_per_layer=12)
    with pytest.raises(ValueError, match=r"num_pages_per_layer must be a positive int, got 0"):
        make(tp8, num_pages_per_layer=0)


def test_create_keeps_easydel_positional_order(tp8):
    meta = PagedAttentionCacheMetaData.create(
        tp8, 4, 4, 100, 16, 8, 128, 0.9, jnp.float32, memory_bytes_per_device=MiB
    )
    assert (meta.batch_size, meta.num_hidden_layers, meta.max_sequences, meta.page_size) == (4, 4, 100, 16)
    assert (meta.num_kv_heads, meta.kv_head_dim_size, meta.hbm_utilization) == (8, 128, 0.9)
    assert meta.num_pages_per_layer == 16 and meta.dtype == np.float32


def test_create_on_the_real_cpu_host(tp8):
    meta = PagedAttentionCacheMetaData.create(
        tp8, 2, 1, 64, 16, 8, 8, 0.05, jnp.float32, partition_manager=HEADS_TP
    )
    per_page = 2 * 1 * 16 * 8 * 4  # one head per device, float32, 1 layer
    assert isinstance(meta.memory_bytes_per_device, int) and meta.memory_bytes_per_device > 0
    cap = (2**31 - 1) // 16
    assert meta.num_pages_per_layer == min(meta.memory_bytes_per_device // per_page, cap)
    assert meta.num_pages_per_layer >= meta.num_pages_per_sequence == 4


def test_huge_budget_is_capped_to_int32_slot_ids(tp8, dp2tp4):
    # 2**40 B / (2 * 1 * 4 * 8 * 2 B) = 2**33 pages would overflow int32 slot ids.
    kw = dict(num_hidden_layers=1, page_size=4, kv_head_dim_size=8, max_sequences=16,
              memory_bytes_per_device=2**40)  # fmt: skip
    meta = make(tp8, **kw)
    assert meta.num_pages_per_layer == (2**31 - 1) // 4
    assert meta.num_pages_per_layer * 4 <= 2**31 - 1
    dp = make(dp2tp4, pm=PAGES_DP, **kw)
    assert dp.num_pages_per_layer == 2 * (((2**31 - 1) // 4) // 2)


@pytest.mark.parametrize(
    "field", ["batch_size", "num_hidden_layers", "max_sequences", "page_size", "num_kv_heads",
              "kv_head_dim_size"],
)  # fmt: skip
@pytest.mark.parametrize("bad", [0, -3, True, 2.0])
def test_non_positive_sizes_rejected(tp8, field, bad):
    with pytest.raises(ValueError, match=rf"{field} must be a positive int, got {bad!r}"):
        make(tp8, **{field: bad})


@pytest.mark.parametrize("util", [0, 0.0, -0.1, 1.0001, 2, float("nan"), True])
def test_utilization_outside_unit_interval_rejected(tp8, util):
    with pytest.raises(ValueError, match=r"hbm_utilization must be a number in \(0, 1\]"):
        make(tp8, hbm_utilization=util)


def test_utilization_one_is_allowed(tp8):
    assert make(tp8, hbm_utilization=1).hbm_utilization == 1.0


def test_unknown_dtypes_rejected(tp8):
    with pytest.raises(ValueError, match=r"dtype='int7' is not a dtype; use one of float32, bfloat16, float16"):
        make(tp8, dtype="int7")
    with pytest.raises(ValueError, match=r"dtype int8 is not a cache dtype.*quantizer="):
        make(tp8, dtype=jnp.int8)
    with pytest.raises(ValueError, match=r"dtype float64 is not a cache dtype"):
        make(tp8, dtype=np.float64)


def test_unknown_quantizer_rejected(tp8):
    with pytest.raises(ValueError, match=r"unknown quantizer 'int3'; "
                                         r"available: none, int8, int8-rot, fp8, fp8-rot, int4, int4-rot"):
        make(tp8, quantizer="int3")
    assert make(tp8, quantizer="none").quantization == "none"


def test_pool_too_small_for_one_sequence(tp8):
    # 7 pages per sequence x 32768 B = 229376 B: one byte less gives only 6 pages.
    assert make(tp8, memory_bytes_per_device=7 * 32768).num_pages_per_layer == 7
    with pytest.raises(ValueError, match=r"budget holds 6 pages per device .* needs 7"):
        make(tp8, memory_bytes_per_device=7 * 32768 - 1)
    with pytest.raises(ValueError, match=r"budget holds 0 pages"):
        make(tp8, memory_bytes_per_device=100)


def test_bad_memory_override_rejected(tp8):
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError, match=r"memory_bytes_per_device must be a positive int"):
            make(tp8, memory_bytes_per_device=bad)


def test_direct_construction_validates_consistency():
    base = dict(
        batch_size=1, num_hidden_layers=1, num_pages_per_layer=8, num_pages_per_sequence=4,
        max_sequences=16, page_size=4, num_kv_heads=8, kv_head_dim_size=8, hbm_utilization=0.5,
    )  # fmt: skip
    PagedAttentionCacheMetaData(**base)
    with pytest.raises(ValueError, match=r"num_pages_per_sequence=5 does not match .* = ceil\(16 / 4\) = 4"):
        PagedAttentionCacheMetaData(**{**base, "num_pages_per_sequence": 5})
    with pytest.raises(ValueError, match=r"num_kv_heads=8 is not divisible by kv_head_shards=3"):
        PagedAttentionCacheMetaData(**base, kv_head_mesh_axes=("tp",), kv_head_shards=3)
    with pytest.raises(ValueError, match=r"give both .the head layout. or neither"):
        PagedAttentionCacheMetaData(**base, kv_head_shards=2)
    with pytest.raises(ValueError, match=r"exceeds int32 slot ids"):
        PagedAttentionCacheMetaData(**{**base, "num_pages_per_layer": 2**30})
    with pytest.raises(ValueError, match=r"kv_head_mesh_axes must be a tuple of mesh axis names"):
        PagedAttentionCacheMetaData(**base, kv_head_mesh_axes=("tp", ""), kv_head_shards=1)
    with pytest.raises(ValueError, match=r"page_mesh_axes must be a tuple of mesh axis names, got 5"):
        PagedAttentionCacheMetaData(**base, page_mesh_axes=5)
    # A single name is one axis, not a string of one-letter axes.
    assert PagedAttentionCacheMetaData(**base, kv_head_mesh_axes="tp", kv_head_shards=1).kv_head_mesh_axes == ("tp",)


# ------------------------------------------------------------------------------ JSON
@pytest.fixture(scope="module")
def dp_meta(dp2tp4):
    return make(dp2tp4, pm=PAGES_DP, dtype="float16", memory_bytes_per_device=MiB + 7)


def test_to_dict_contents(dp_meta):
    d = dp_meta.to_dict()
    assert d["__schema__"] == "easykv.PagedAttentionCacheMetaData" and d["__version__"] == 1
    assert d["dtype"] == "float16"
    assert d["kv_head_mesh_axes"] == ["tp"] and d["page_mesh_axes"] == ["dp"]
    assert (d["page_shards"], d["kv_head_shards"], d["num_pages_per_layer"]) == (2, 4, 32)
    assert d["memory_bytes_per_device"] == MiB + 7
    assert json.loads(dp_meta.to_json()) == d


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_exact_round_trip(dp2tp4, dtype):
    meta = make(dp2tp4, pm=PAGES_DP, dtype=dtype, memory_bytes_per_device=MiB + 7)
    for back in (
        PagedAttentionCacheMetaData.from_dict(meta.to_dict()),
        PagedAttentionCacheMetaData.from_json(meta.to_json()),
        PagedAttentionCacheMetaData.from_json(meta.to_json(indent=2).encode()),
    ):
        assert back == meta and hash(back) == hash(meta)
        assert back.dtype == np.dtype(dtype) and back.page_mesh_axes == ("dp",)
        assert back.to_json() == meta.to_json()


def test_hashable_static_jit_argument(dp_meta):
    f = jax.jit(lambda m, x: x * m.page_size, static_argnums=0)
    assert int(f(dp_meta, jnp.int32(3))) == 48
    assert {dp_meta: 1}[PagedAttentionCacheMetaData.from_json(dp_meta.to_json())] == 1


def test_frozen(dp_meta):
    with pytest.raises(dataclasses.FrozenInstanceError):
        dp_meta.batch_size = 3
    assert dp_meta.batch_size == 4


def test_replace(dp_meta):
    other = dp_meta.replace(batch_size=9, hbm_utilization=0.5)
    assert (other.batch_size, other.hbm_utilization) == (9, 0.5)
    assert dataclasses.replace(other, batch_size=4, hbm_utilization=0.9) == dp_meta
    assert dp_meta.batch_size == 4
    with pytest.raises(SerializationError, match=r"cannot replace unknown field\(s\) \['pages'\]"):
        dp_meta.replace(pages=3)
    with pytest.raises(ValueError, match=r"num_pages_per_sequence=7 does not match"):
        dp_meta.replace(page_size=8)
    with pytest.raises(ValueError, match=r"batch_size must be a positive int"):
        dp_meta.replace(batch_size=0)


def test_schema_and_version_checked(dp_meta):
    d = dp_meta.to_dict()
    assert d["__version__"] == 1 and "layer_groups" not in d  # uniform: the JSON easykv 1 wrote and reads
    with pytest.raises(SerializationError, match=r"version 4, but this easykv reads up to version 3"):
        PagedAttentionCacheMetaData.from_dict({**d, "__version__": 4})
    # A version-2 file cannot carry a field version 3 added (a host tier): edited or damaged.
    with pytest.raises(SerializationError, match=r"host_pages_per_layer"):
        PagedAttentionCacheMetaData.from_dict({**d, "__version__": 2, "host_pages_per_layer": 8})
    tiered = dp_meta.replace(host_pages_per_layer=8).to_dict()
    assert tiered["__version__"] == 3 and tiered["host_pages_per_layer"] == 8
    with pytest.raises(SerializationError, match=r"needs a positive int '__version__'"):
        PagedAttentionCacheMetaData.from_dict({k: v for k, v in d.items() if k != "__version__"})
    with pytest.raises(SerializationError, match=r"JSON is a 'easykv.PageManager', not a"):
        PagedAttentionCacheMetaData.from_dict({**d, "__schema__": "easykv.PageManager"})


def test_unknown_and_missing_fields_rejected(dp_meta):
    d = dp_meta.to_dict()
    with pytest.raises(SerializationError, match=r"unknown field\(s\) \['pagesize'\]"):
        PagedAttentionCacheMetaData.from_dict({**d, "pagesize": 4})
    missing = {k: v for k, v in d.items() if k != "page_size"}
    with pytest.raises(SerializationError, match=r"missing required field\(s\) \['page_size'\]"):
        PagedAttentionCacheMetaData.from_json(json.dumps(missing))
    with pytest.raises(SerializationError, match=r"unknown dtype name 'int7'"):
        PagedAttentionCacheMetaData.from_dict({**d, "dtype": "int7"})
    with pytest.raises(ValueError, match=r"dtype int8 is not a cache dtype"):
        PagedAttentionCacheMetaData.from_dict({**d, "dtype": "int8"})
    with pytest.raises(ValueError, match=r"hbm_utilization must be a number in \(0, 1\]"):
        PagedAttentionCacheMetaData.from_dict({**d, "hbm_utilization": 1.5})
    with pytest.raises(ValueError, match=r"kv_head_mesh_axes must be a tuple of mesh axis names, got 4"):
        PagedAttentionCacheMetaData.from_dict({**d, "kv_head_mesh_axes": 4})
    hand_edited = PagedAttentionCacheMetaData.from_dict({**d, "page_mesh_axes": "dp"})
    assert hand_edited.page_mesh_axes == ("dp",) and hand_edited == dp_meta


@pytest.mark.parametrize(
    "text, match",
    [
        ("[1, 2]", r"must be an object, got list"),
        ("{not json", r"is not valid JSON"),
        ('{"model": "llama", "layers": 32}', r"fields EasyDeL does not write: \['layers', 'model'\]"),
        ("{}", r"missing fields \['batch_size'"),
    ],
)
def test_json_that_is_not_ours(text, match):
    with pytest.raises(SerializationError, match=match):
        PagedAttentionCacheMetaData.from_json(text)


def test_from_json_needs_text(dp_meta):
    with pytest.raises(SerializationError, match=r"needs JSON text, got dict"):
        PagedAttentionCacheMetaData.from_json(dp_meta.to_dict())


def easydel_json(**over):
    data = dict(
        batch_size=32, num_hidden_layers=2, num_pages_per_layer=100, num_pages_per_sequence=8,
        max_sequences=128, page_size=16, num_kv_heads=8, kv_head_dim_size=64, hbm_utilization=0.9,
    )  # fmt: skip
    data.update(over)
    return json.dumps(data)


def test_easydel_json_accepted():
    meta = PagedAttentionCacheMetaData.from_json(easydel_json())
    assert tuple(meta.to_dict()[f] for f in EASYDEL_FIELDS) == (32, 2, 100, 8, 128, 16, 8, 64, 0.9)
    # EasyDeL passes the dtype to init_cache and has no head layout: both stay open until then,
    # and sizing figures assume bfloat16 with every head on every device.
    assert meta.dtype is None and meta.sizing_dtype == np.dtype(jnp.bfloat16)
    assert (meta.quantization, meta.kv_head_shards, meta.head_shards, meta.page_shards) == ("none", None, 1, 1)
    assert meta.memory_bytes_per_device is None
    # From then on it is ours: it round-trips with schema and dtype.
    assert PagedAttentionCacheMetaData.from_json(meta.to_json()) == meta


def test_easydel_json_with_foreign_or_missing_fields_rejected():
    with pytest.raises(SerializationError, match=r"fields EasyDeL does not write: \['sliding_window'\]"):
        PagedAttentionCacheMetaData.from_json(easydel_json(sliding_window=4))
    with pytest.raises(SerializationError, match=r"fields EasyDeL does not write: \['dtype'\]"):
        PagedAttentionCacheMetaData.from_json(easydel_json(dtype="float32"))
    data = json.loads(easydel_json())
    del data["hbm_utilization"]
    with pytest.raises(SerializationError, match=r"missing fields \['hbm_utilization'\]"):
        PagedAttentionCacheMetaData.from_dict(data)
    with pytest.raises(ValueError, match=r"num_pages_per_sequence=9 does not match"):
        PagedAttentionCacheMetaData.from_json(easydel_json(num_pages_per_sequence=9))


def test_bytes_per_device_consistent_with_sizing(dp2tp4):
    meta = make(dp2tp4, pm=PAGES_DP, memory_bytes_per_device=3 * MiB + 5)
    per_page = meta.page_bytes_per_device * meta.num_hidden_layers
    assert meta.pages_per_shard == (3 * MiB + 5) // per_page == 48
    assert meta.bytes_per_device <= 3 * MiB + 5 < meta.bytes_per_device + per_page
    # Nothing is replicated (heads over tp, pages over dp): the 8 devices together hold the
    # pool exactly once.
    assert math.prod(dp2tp4.devices.shape) * meta.bytes_per_device == (
        meta.bytes_per_token * meta.tokens_per_layer
    ) == 16384 * 96 * 16
