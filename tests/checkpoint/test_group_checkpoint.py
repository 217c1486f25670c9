"""Checkpoints of a cache of several layer groups (a sliding group of 4 kv heads, a full group of
8 heads whose values are narrower than its keys, a latent group with no value pages): saved with
its manager on one mesh, restored bit for bit onto others (each group's heads re-split on its
own, pages re-sliced over data-parallel replicas with the manager following), converted to
another dtype on request, and refused by name where the target cannot hold it."""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv import LayerGroup, PagedAttentionCacheMetaData
from easykv.errors import CheckpointMismatchError
from easykv.sharding import PartitionAxis, PartitionManager, ShardingAdjustedWarning, create_mesh
from tests.support.groups import GROUPS, LAYERS, PS, filled, mesh_and_rule


def tokens_of(cache, m):
    """Every sequence's K (and V) of every layer as float32 numpy, read through its pages."""
    out = {}
    meta = cache.metadata
    for s in m.active_ids:
        for i in range(LAYERS):
            g, _ = meta.group_of(i)
            first = m.sequence(s).first_kept[g]
            pages = np.asarray(m.pages(s, group=g))
            k, v = easykv.gather_kv(cache, i, np.where(pages < 0, 0, pages), m.length(s))  # holes: not read below
            out[s, i] = (np.asarray(k, np.float32)[first:], None if v is None else np.asarray(v, np.float32)[first:])
    return out


def same_tokens(a, b):
    assert a.keys() == b.keys()
    for key in a:
        for x, y in zip(a[key], b[key]):
            assert (x is None) == (y is None)
            if x is not None:
                np.testing.assert_array_equal(x, y, err_msg=str(key))


@pytest.mark.parametrize("source, target", [("dp2tp4", "tp8"), ("tp8", "tp2"), ("dp2tp4", "dp2tp4")])
def test_a_grouped_cache_restores_bit_exact_onto_other_meshes(tmp_path, source, target):
    cache, m = filled(source)
    want = tokens_of(cache, m)
    state = m.state_dict()
    easykv.save_cache(tmp_path, cache, m, extra_metadata={"run": 1})
    mesh, rule = mesh_and_rule(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        got = easykv.restore_cache(tmp_path, mesh=mesh, partition_manager=rule)
    restored, manager = got
    meta = got.metadata
    assert [g.num_pages for g in meta.groups] == [16, 24, 24] and restored.value_pages[2] is None
    tp = mesh.shape["tp"]
    for group, k in zip(meta.groups, restored.key_pages):  # each group's heads split on their own
        split = group.num_kv_heads % tp == 0
        assert group.kv_head_shards == (tp if split else 1)
        assert k.sharding.spec[1] == ("tp" if split else None)
        assert k.sharding.spec[2] == ("dp" if target == "dp2tp4" else None)
    assert manager.active_ids == m.active_ids
    if meta.page_shards == m.metadata.page_shards:
        assert manager.state_dict() == state
    manager.check_invariants()
    same_tokens(tokens_of(restored, manager), want)
    # the restored pair keeps serving: one more decode step through the manager
    seqs = manager.active_ids
    runner, lengths = easykv.Runner(manager, restored), [manager.length(s) for s in seqs]
    plan = manager.schedule(seqs, [1] * len(seqs))
    n = len(seqs)
    ks = [np.ones((n, g.num_kv_heads, g.key_head_dim), np.float32) for g in (meta.groups[meta.group_of(i)[0]]
                                                                             for i in range(LAYERS))]
    vs = [None if meta.groups[meta.group_of(i)[0]].latent else k[..., :8] for i, k in enumerate(ks)]
    dropped = runner.run(plan, lambda cache, plan: cache.write(ks, vs, plan.metadata))
    assert int(dropped) == 0 and [manager.length(s) for s in seqs] == [n + 1 for n in lengths]


def test_a_grouped_checkpoint_converts_on_request_and_checks_the_target(tmp_path):
    cache, m = filled("tp8")
    want = tokens_of(cache, m)
    easykv.save_cache(tmp_path, cache, m)
    mesh, rule = mesh_and_rule("dp2tp4")
    with pytest.raises(CheckpointMismatchError, match=r"pool of layer group \d of \d+ pages into 2 data-parallel "
                                                      r"slices .* in replicas \[0, 1\]"):
        easykv.restore_cache(tmp_path, mesh=mesh, partition_manager=rule)  # a sequence would straddle two slices
    with pytest.warns(UserWarning, match="without a PageManager"):
        got = easykv.restore_cache(tmp_path, mesh=mesh, partition_manager=rule, restore_manager=False)
    for g, (k, k0) in enumerate(zip(got.cache.key_pages, cache.key_pages)):
        np.testing.assert_array_equal(np.asarray(k), np.asarray(k0), err_msg=f"group {g}")
    mesh, rule = mesh_and_rule("tp8")
    with pytest.raises(CheckpointMismatchError, match="convert=True"):
        easykv.restore_cache(tmp_path, mesh=mesh, partition_manager=rule, dtype="bfloat16")
    got = easykv.restore_cache(tmp_path, mesh=mesh, partition_manager=rule, dtype="bfloat16", convert=True)
    assert got.cache.key_pages[1].dtype == jnp.uint16  # bf16 stored as raw bits on CPU
    for key, (k, v) in tokens_of(got.cache, got.manager).items():
        np.testing.assert_allclose(k, want[key][0], rtol=1e-2, atol=1e-2)
        assert (v is None) == (want[key][1] is None)
    other = PagedAttentionCacheMetaData.create(
        mesh, 4, LAYERS, 32, PS, 8, 16, 0.9, "float32", partition_manager=rule,
        layer_groups=(GROUPS[0], GROUPS[1], LayerGroup((4,), "full", num_kv_heads=1, key_head_dim=12,
                                                       value_head_dim=8, latent=True, num_pages=16)))
    with pytest.raises(CheckpointMismatchError, match=r"layer groups: checkpoint .* target"):
        easykv.restore_cache(tmp_path, mesh=mesh, partition_manager=rule, metadata=other)
    dp3 = create_mesh({"dp": 3, "tp": 2}, devices=np.array(__import__("jax").devices()[:6]))
    with pytest.raises(CheckpointMismatchError, match=r"layers \[0, 2\]: num_pages=16, not a multiple of 3"):
        easykv.restore_cache(tmp_path, mesh=dp3, partition_manager=PartitionManager(
            PartitionAxis(kv_head_axis="tp", page_axis="dp")))


def test_a_grouped_checkpoint_record_lists_each_groups_arrays(tmp_path):
    cache, m = filled("tp8")
    easykv.save_cache(tmp_path, cache, m)
    record = json.loads((tmp_path / "0" / "easykv" / "checkpoint.json").read_text())
    assert [(e["name"], e["shape"]) for e in record["arrays"]] == [
        ("group_000.key_pages", [2, 4, 16, PS, 8]), ("group_000.value_pages", [2, 4, 16, PS, 8]),
        ("group_001.key_pages", [2, 8, 24, PS, 16]), ("group_001.value_pages", [2, 8, 24, PS, 8]),
        ("group_002.key_pages", [1, 1, 24, PS, 12])]
    state = json.loads((tmp_path / "0" / "easykv" / "manager.json").read_text())
    assert state["format"] == "easykv.PageManager/2"
    text = easykv.inspect_checkpoint(tmp_path)
    assert "group 0  layers [0, 2]: sliding 6; 4 kv heads x K 8 / V 8; 16 pages" in text
    assert "group 2  layers [4]: full; 1 kv heads x latent 12 (values: its first 8); 24 pages" in text
    assert "OK: 5 arrays match their fingerprints" in text
