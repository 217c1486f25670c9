"""Tests for the `sharding` package on 8 simulated CPU devices (see conftest.py)."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import easykv.sharding as sharding
from easykv.sharding import (
    BATCH,
    HEAD,
    HEAD_DIM,
    KV_HEAD,
    PAGE,
    PAGE_SIZE,
    PartitionAxis,
    PartitionManager,
    ShardingAdjustedWarning,
    create_mesh,
)
from easykv.sharding.manager import shard_count
from easykv.sharding.mesh import mesh_axis_size

CACHE_AXES = (KV_HEAD, PAGE, PAGE_SIZE, HEAD_DIM)


# ---------------------------------------------------------------- PartitionAxis


def test_partition_axis_defaults_are_easydel_compatible():
    pa = PartitionAxis()
    assert pa.batch_axis == ("fsdp", "dp")
    assert (pa.head_axis, pa.kv_head_axis) == ("tp", "tp")
    assert pa.sequence_axis is pa.page_axis is pa.head_dim_axis is pa.hidden_axis is None
    assert pa.mesh_axes(BATCH) == ("fsdp", "dp")
    assert pa.mesh_axes(KV_HEAD) == ("tp",)
    assert pa.mesh_axes(PAGE) == ()
    assert pa.mesh_axes(None) == ()


def test_partition_axis_normalizes_lists_and_is_hashable():
    pa = PartitionAxis(batch_axis=["dp", "fsdp"], page_axis="dp")
    assert pa.batch_axis == ("dp", "fsdp")
    assert pa == PartitionAxis(batch_axis=("dp", "fsdp"), page_axis="dp")
    assert hash(pa) == hash(PartitionAxis(batch_axis=("dp", "fsdp"), page_axis="dp"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        pa.page_axis = "tp"  # frozen


@pytest.mark.parametrize("bad", [3, ("tp", 1), "", (), ("tp", "tp")])
def test_partition_axis_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="kv_head_axis"):
        PartitionAxis(kv_head_axis=bad)


def test_unknown_logical_name_lists_known_names():
    with pytest.raises(ValueError, match="kv_heads") as info:
        PartitionAxis().mesh_axes("kv_heads")
    assert "'kv_head'" in str(info.value) and "'page'" in str(info.value)


# ---------------------------------------------------------------- resolve


@pytest.mark.parametrize("heads, entry", [(8, "tp"), (16, "tp")])
def test_kv_head_divisible_shards_over_tp(tp8, heads, entry):
    pm = PartitionManager()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = pm.resolve(CACHE_AXES, (heads, 64, 16, 128), mesh=tp8)
    assert spec == P(entry, None, None, None)


def test_kv_head_not_divisible_is_replicated_with_warning(tp8):
    pm = PartitionManager()
    with pytest.warns(ShardingAdjustedWarning) as record:
        spec = pm.resolve(CACHE_AXES, (4, 64, 16, 128), mesh=tp8)
    assert spec == P(None, None, None, None)
    assert len(record) == 1
    message = str(record[0].message)
    for needle in ("kv_head", "4", "tp", "8", "dim 0", "replicated along 'tp'"):
        assert needle in message
    # Warning points at the caller, not at sharding internals.
    assert record[0].filename == __file__


def test_report_matches_warnings_and_does_not_warn(tp8):
    pm = PartitionManager()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec, report = pm.resolve_with_report(CACHE_AXES, (4, 64, 16, 128), mesh=tp8)
    assert spec == P(None, None, None, None)
    assert len(report) == 1 and "kv_head" in report[0]
    with pytest.warns(ShardingAdjustedWarning) as record:
        pm.resolve(CACHE_AXES, (4, 64, 16, 128), mesh=tp8)
    assert [str(w.message) for w in record] == list(report)
    with pytest.warns(ShardingAdjustedWarning) as record:  # every call reports, not only the first
        pm.resolve(CACHE_AXES, (4, 64, 16, 128), mesh=tp8)
        pm.resolve(CACHE_AXES, (4, 64, 16, 128), mesh=tp8)
    assert len(record) == 2


def test_missing_mesh_axis_dropped_with_warning():
    mesh = create_mesh({"dp": 8})
    pm = PartitionManager()
    with pytest.warns(ShardingAdjustedWarning, match="no axis 'tp'") as record:
        spec = pm.resolve(CACHE_AXES, (8, 64, 16, 128), mesh=mesh)
    assert spec == P(None, None, None, None)
    assert len(record) == 1 and "kv_head" in str(record[0].message)


def test_tuple_axes_partially_kept(dp2tp4):
    pm = PartitionManager()  # batch -> ("fsdp", "dp"), mesh has only dp
    with pytest.warns(ShardingAdjustedWarning, match="fsdp") as record:
        spec = pm.resolve((BATCH, HEAD), (6, 8), mesh=dp2tp4)
    assert spec == P("dp", "tp")
    assert len(record) == 1


def test_tuple_axes_all_kept_and_cumulative_divisibility():
    mesh = create_mesh({"fsdp": 2, "dp": 4})
    pm = PartitionManager(PartitionAxis(head_axis=None, kv_head_axis=None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pm.resolve((BATCH,), (16,), mesh=mesh) == P(("fsdp", "dp"))
    # 4 is divisible by fsdp=2 and by dp=4 alone, but not by their product 8.
    with pytest.warns(ShardingAdjustedWarning, match="combined") as record:
        assert pm.resolve((BATCH,), (4,), mesh=mesh) == P("fsdp")
    assert "'dp'" in str(record[0].message) and "replicated along 'dp'" in str(record[0].message)


def test_size_one_axes_are_silent(tp8):
    pm = PartitionManager(PartitionAxis(batch_axis="dp", page_axis=None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = pm.resolve((BATCH, KV_HEAD, None), (3, 8, 5), mesh=tp8)
    assert spec == P("dp", "tp", None)


def test_page_axis_on_dp(dp2tp4):
    pm = PartitionManager(PartitionAxis(page_axis="dp"))
    spec = pm.resolve(CACHE_AXES, (8, 64, 16, 128), mesh=dp2tp4)
    assert spec == P("tp", "dp", None, None)


def test_duplicate_mesh_axis_raises(tp8):
    pm = PartitionManager()  # head and kv_head both -> tp
    with pytest.raises(ValueError, match="'tp'"):
        pm.resolve((HEAD, KV_HEAD), (8, 8), mesh=tp8)
    with pytest.raises(ValueError, match="only one dimension"):
        pm.resolve((KV_HEAD, KV_HEAD), (8, 8), mesh=tp8)


def test_length_mismatch_raises(tp8):
    with pytest.raises(ValueError, match="2 entries"):
        PartitionManager().resolve((KV_HEAD, None), (8, 4, 2), mesh=tp8)
    with pytest.raises(ValueError, match="sequence"):
        PartitionManager().resolve(KV_HEAD, (8,), mesh=tp8)


def test_manager_is_hashable_and_defaults():
    assert PartitionManager().paxis == PartitionAxis()
    assert hash(PartitionManager()) == hash(PartitionManager(PartitionAxis()))
    assert PartitionManager(PartitionAxis(page_axis="dp")) != PartitionManager()
    with pytest.raises(ValueError, match="PartitionAxis"):
        PartitionManager({"kv_head_axis": "tp"})


def test_shard_count(dp2tp4):
    assert shard_count(None, dp2tp4) == 1
    assert shard_count("tp", dp2tp4) == 4
    assert shard_count(("dp", "tp"), dp2tp4) == 8
    assert PartitionManager().shard_count("dp", dp2tp4) == 2
    with pytest.raises(ValueError, match="'fsdp'"):
        shard_count("fsdp", dp2tp4)


# ---------------------------------------------------------------- create_mesh


def test_create_mesh_basic_and_axis_types_auto():
    mesh = create_mesh({"dp": 2, "tp": 4})
    assert mesh.axis_names == ("dp", "tp")
    assert dict(mesh.shape) == {"dp": 2, "tp": 4}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


def test_create_mesh_minus_one_and_pairs():
    mesh = create_mesh([("dp", -1), ("tp", 2)])
    assert dict(mesh.shape) == {"dp": 4, "tp": 2}
    assert mesh_axis_size(mesh, ("dp", "tp")) == 8
    assert mesh_axis_size(mesh, ()) == 1


@pytest.mark.parametrize(
    "dims, match",
    [
        ({"dp": 0, "tp": 8}, "'dp'.*0"),
        ({"dp": 2.0, "tp": 4}, "'dp'.*2.0"),
        ({"dp": -2, "tp": -4}, "'dp'.*-2"),
        ({"dp": -1, "tp": -1}, "at most one"),
        ({"dp": True, "tp": 8}, "'dp'.*True"),
        ([("dp", 2), ("dp", 4)], "twice"),
        ({"": 8}, "non-empty"),
    ],
)
def test_create_mesh_bad_sizes(dims, match):
    with pytest.raises(ValueError, match=match):
        create_mesh(dims)


def test_create_mesh_wrong_product_names_counts_and_fix():
    with pytest.raises(ValueError) as info:
        create_mesh({"dp": 2, "tp": 2})
    message = str(info.value)
    assert "4" in message and "8 devices" in message and "-1" in message
    with pytest.raises(ValueError, match="divide"):
        create_mesh({"dp": 3, "tp": -1})


def test_create_mesh_explicit_devices_keeps_order():
    devices = list(reversed(jax.devices()))[:4]
    mesh = create_mesh({"dp": 2, "tp": 2}, devices=devices)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in devices]
    assert mesh.devices.shape == (2, 2)
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    with pytest.raises(ValueError, match="4 devices"):
        create_mesh({"tp": 8}, devices=devices)


# ---------------------------------------------------------------- placement


def test_named_sharding_places_array(dp2tp4):
    pm = PartitionManager(PartitionAxis(page_axis="dp"))
    shape = (8, 6, 4, 2)
    ns = pm.named_sharding(CACHE_AXES, shape, mesh=dp2tp4)
    x = jax.device_put(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape), ns)
    assert x.sharding.spec == P("tp", "dp", None, None)
    shards = x.addressable_shards
    assert len(shards) == 8
    assert all(s.data.shape == (2, 3, 4, 2) for s in shards)
    np.testing.assert_array_equal(np.asarray(x), np.arange(np.prod(shape)).reshape(shape))


def test_named_sharding_replicated_heads(tp8):
    pm = PartitionManager()
    with pytest.warns(ShardingAdjustedWarning) as record:
        ns = pm.named_sharding(CACHE_AXES, (4, 8, 2, 2), mesh=tp8)
    assert len(record) == 1 and record[0].filename == __file__
    assert ns.spec == P(None, None, None, None)
    x = jax.device_put(jnp.zeros((4, 8, 2, 2)), ns)
    assert all(s.data.shape == (4, 8, 2, 2) for s in x.addressable_shards)


def test_constrain_inside_jit(tp8):
    pm = PartitionManager()

    @jax.jit
    def f(x):
        return pm.constrain(x * 2, CACHE_AXES, mesh=tp8)

    y = f(jnp.ones((8, 4, 2, 2)))
    expected = jax.sharding.NamedSharding(tp8, P("tp", None, None, None))
    assert y.sharding.is_equivalent_to(expected, y.ndim)
    assert all(s.data.shape == (1, 4, 2, 2) for s in y.addressable_shards)
    np.testing.assert_array_equal(np.asarray(y), 2 * np.ones((8, 4, 2, 2)))


def test_package_exports():
    for name in sharding.__all__:
        assert hasattr(sharding, name)
    assert {"PartitionAxis", "PartitionManager", "ShardingAdjustedWarning", "create_mesh"} <= set(
        sharding.__all__
    )


def test_the_old_top_level_name_still_imports_with_a_deprecation_warning():
    """`import sharding` (before easykv 0.2) gives the same objects, submodules included, and
    warns once with the new name; the package installs beside easykv for one release."""
    from tests.support.deprecation import warnings_on_import

    seen = warnings_on_import("import sharding\nfrom sharding.mesh import create_mesh", """
import easykv.sharding, easykv.sharding.mesh
assert sharding.PartitionManager is easykv.sharding.PartitionManager
assert create_mesh is easykv.sharding.mesh.create_mesh is sharding.mesh.create_mesh
assert sharding.axes is easykv.sharding.axes and sharding.manager is easykv.sharding.manager
assert sorted(sharding.__all__) == sorted(easykv.sharding.__all__)""")
    assert [(category, message) for category, message, _ in seen] == [
        ("DeprecationWarning", "the top-level package 'sharding' moved to 'easykv.sharding' and will be removed in "
                               "easykv 0.3; import from easykv.sharding instead")]
