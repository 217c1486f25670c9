"""sleep / wake on 8 simulated devices: level 1 moves every page to host memory (pinned_host) and
back bit for bit, on the same mesh or another one (the manager re-split with the pool); level 2
frees the pages and starts again from zeroed ones with the manager's versions kept. Device bytes
are counted from the live arrays. Bad calls are refused with nothing changed."""

from __future__ import annotations

import functools
import gc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv import LayerGroup, PagedAttentionCache, PagedAttentionCacheMetaData, PageManager
from easykv.sharding import PartitionAxis, PartitionManager, ShardingAdjustedWarning, create_mesh
from easykv.spec.memory import MemoryBudget
from easykv.tiers.sleep import device_bytes
from tests.support.groups import FORMAT_GROUPS, GROUPS, LAYERS, PS, filled_formats, mesh_and_rule, read, rows_for, same
from tests.support.tiers import tiered


def _live(cache):
    return not any(a.is_deleted() for a in jax.tree.leaves(cache))


def test_level_1_frees_the_device_and_wakes_bit_exact_on_the_same_mesh():
    cache, m, s, _ = filled_formats("tp8")  # int8, bf16 and fp8 layer groups
    want, state = read(cache, m, s), m.state_dict()
    pool = device_bytes(cache)
    assert pool == cache.metadata.bytes_per_device * 8  # every device's shards, as sized
    before = device_bytes()
    sleeping = easykv.sleep(cache, m)
    assert not _live(cache) and sleeping.level == 1 and sleeping.host_bytes == pool
    assert before - device_bytes() >= 0.99 * pool
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(sleeping.key_pages)} == {"pinned_host"}
    woken, wm = easykv.wake(sleeping)
    assert wm is m and m.state_dict() == state and device_bytes(woken) == pool
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(woken)} == {"device"}
    assert [leaf.sharding for leaf in jax.tree.leaves(woken)] == [
        leaf.sharding for leaf in jax.tree.leaves(filled_formats("tp8")[0])]
    same(read(woken, wm, s), want)
    with pytest.raises(ValueError, match="woken already"):
        easykv.wake(sleeping)


def test_level_1_wakes_onto_another_mesh_and_goes_on_decoding():
    cache, m, s, toks = filled_formats("dp2tp4")
    want = read(cache, m, s)
    sleeping = easykv.sleep(cache, m)
    mesh, rule = mesh_and_rule("tp8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        woken, wm = easykv.wake(sleeping, mesh=mesh, partition_manager=rule)
    assert woken.metadata.page_shards == 1 and wm.metadata.page_shards == 1 and woken.layout.mesh is mesh
    same(read(woken, wm, s), want)
    # and the woken cache is a cache: one more decode token, read back
    plan = wm.schedule([s], [1])
    assert plan.work.empty  # nothing to copy or scrub first
    new = rows_for(woken.metadata, np.random.default_rng(9), 1)
    woken, _ = woken.write([k for k, _ in new], [v for _, v in new], plan.metadata)
    wm.commit(plan, [7])
    after = read(woken, wm, s)
    for layer in (1, 3, 4):  # full attention: every position, the old ones unchanged, one more
        (k0, _), (k1, _) = want[layer], after[layer]
        assert len(k1) == len(k0) + 1
        np.testing.assert_array_equal(k1[: len(k0)], k0)


def test_level_2_needs_no_running_sequence_and_starts_again_from_zeros():
    cache, m, s, _ = filled_formats("tp8")
    m.set_weight_version("rollout-3")
    with pytest.raises(ValueError, match=r"sequences \[0\] are still running"):
        easykv.sleep(cache, m, level=2)
    assert _live(cache)
    m.release(s)
    assert m.metrics.cached_pages > 0
    pool = device_bytes(cache)
    before = device_bytes()
    sleeping = easykv.sleep(cache, m, level=2)
    assert sleeping.host_bytes == 0 and before - device_bytes() >= 0.99 * pool
    assert m.metrics.cached_pages == 0 and m.weight_version == "rollout-3"
    woken, wm = easykv.wake(sleeping)
    assert device_bytes(woken) == pool
    assert all(not np.asarray(leaf).any() for leaf in jax.tree.leaves(woken))
    [t] = wm.claim(1)
    assert wm.match_prefix(t, list(range(7))) == 0  # nothing cached survives level 2
    wm.check_invariants()


def test_bad_sleeps_and_wakes_are_refused_with_nothing_changed(monkeypatch):
    cache, m, s, _ = filled_formats("dp2tp4")
    other, om, _, _ = filled_formats("tp8")
    with pytest.raises(ValueError, match="level must be"):
        easykv.sleep(cache, m, level=3)
    with pytest.raises(ValueError, match="a cache of another pool than this manager.s"):
        easykv.sleep(cache, om)
    assert _live(cache)
    sleeping = easykv.sleep(cache, m)
    with pytest.raises(ValueError, match="pass mesh= with it"):
        easykv.wake(sleeping, partition_manager=mesh_and_rule("tp8")[1])
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        easykv.wake(sleeping, mesh="tp8")
    # a mesh whose devices cannot hold the pages
    mesh, rule = mesh_and_rule("tp8")
    monkeypatch.setattr("easykv.storage.placement.device_memory_budget",
                        lambda devices, utilization: MemoryBudget(1024, "override", "1 KiB free (test)"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        with pytest.raises(ValueError, match="but the devices have 1024 free"):
            easykv.wake(sleeping, mesh=mesh, partition_manager=rule)
    monkeypatch.undo()
    assert not sleeping.woken and sleeping.host_bytes > 0
    woken, wm = easykv.wake(sleeping)  # still wakes where it slept
    assert _live(woken)
    del other, om


# Where a cache sleeps and wakes: mesh axes, how many devices (the first ones), the pool's page axis.
# "dp2tp4" splits the pool over dp; "dp2tp4r" replicates it there, so a group whose heads are
# replicated over tp is on every device whole, as on "tp8".
MESHES = {"tp8": ({"dp": 1, "tp": 8}, 8, None), "tp4": ({"dp": 1, "tp": 4}, 4, None),
          "tp2": ({"dp": 1, "tp": 2}, 2, None), "dp2tp4": ({"dp": 2, "tp": 4}, 8, "dp"),
          "dp2tp4r": ({"dp": 2, "tp": 4}, 8, None)}
# Groups whose kv heads are replicated on tp=8 (fewer heads than devices), in every page format.
GROUP_SETS = {
    "one_head": (LayerGroup(tuple(range(LAYERS)), "full", num_kv_heads=1, key_head_dim=8, value_head_dim=8,
                            num_pages=24),),
    "latent": GROUPS,  # sliding 4 heads, full 8 heads, an MLA latent of 1 head; float32
    "formats": FORMAT_GROUPS,  # the same, quantized: int8 and fp8 pages with their scales, and bfloat16
}


@functools.cache
def _mesh(name):
    axes, n, page_axis = MESHES[name]
    mesh = create_mesh(axes, devices=np.array(jax.devices()[:n]))
    return mesh, PartitionManager(PartitionAxis(kv_head_axis="tp", page_axis=page_axis))


def _filled(layout, groups, n=7):
    """A cache on ``layout`` with one sequence of ``n`` tokens; the same values on every call."""
    mesh, rule = _mesh(layout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        meta = PagedAttentionCacheMetaData.create(mesh, 4, LAYERS, 32, PS, 8, 16, 0.9, "float32",
                                                  partition_manager=rule, layer_groups=GROUP_SETS[groups])
        cache = PagedAttentionCache.init_cache(mesh, jnp.float32, meta, rule)
    m = PageManager(cache.metadata)
    [s] = m.claim(1)
    cache = _write(cache, m, s, rows_for(cache.metadata, np.random.default_rng(5), n))
    return cache, m, s


def _write(cache, m, s, rows):
    plan = m.schedule([s], [len(rows[0][0])])
    assert plan.work.empty  # nothing to copy or scrub first
    cache, dropped = cache.write([k for k, _ in rows], [v for _, v in rows], plan.metadata)
    assert int(dropped) == 0
    m.commit(plan, [list(range(len(rows[0][0])))])
    return cache


def _bits(tree):
    return [np.asarray(a).view(f"uint{8 * a.dtype.itemsize}") for a in jax.tree.leaves(tree)]


def _wake_moved(sleeping, layout):
    if layout is None:
        return easykv.wake(sleeping)
    mesh, rule = _mesh(layout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        return easykv.wake(sleeping, mesh=mesh, partition_manager=rule)


WAKES = [(src, dst, groups) for groups in GROUP_SETS
         for src, dst in (("tp8", "tp4"), ("tp8", "dp2tp4"), ("tp8", "dp2tp4r"), ("tp8", "tp8"), ("tp8", None),
                          ("dp2tp4", "tp8"), ("dp2tp4", "dp2tp4"), ("tp2", "tp8"))]


@pytest.mark.parametrize("src,dst,groups", tiered(
    WAKES, fast={("tp8", "tp4", "one_head"), ("tp8", "dp2tp4r", "latent"), ("dp2tp4", "dp2tp4", "formats")},
    ids=lambda c: f"{c[0]}-{c[1] or 'same'}-{c[2]}"))
def test_level_1_wakes_replicated_heads_anywhere_bit_exact_and_usable(src, dst, groups):
    # Replicated heads: the new layout can reuse the staged buffers (all of them where it is
    # replicated on the same devices again, one per device where it splits them); wake used to
    # delete those and hand back a cache over deleted buffers.
    cache, m, s = _filled(src, groups)
    twin, tm, ts = _filled(src, groups)  # never slept: what the woken cache must behave as
    pages, want = _bits(cache), read(cache, m, s)
    sleeping = easykv.sleep(cache, m)
    gc.collect()
    before = device_bytes()
    woken, wm = _wake_moved(sleeping, dst)
    gc.collect()
    # every page back bit for bit, laid out on the target, and no staged copy left behind
    assert sleeping.host_bytes == 0 and not any(a.is_deleted() for a in jax.tree.leaves(woken))
    assert device_bytes() - before == device_bytes(woken) == woken.metadata.bytes_per_device * (
        woken.layout.mesh.devices.size)
    assert {a.sharding.mesh for a in jax.tree.leaves(woken)} == {_mesh(dst or src)[0]}
    for got, had in zip(_bits(woken), pages, strict=True):
        np.testing.assert_array_equal(got, had)
    same(read(woken, wm, s), want)
    # and it is a cache: one more token written and read back as on the cache that never slept
    rows = rows_for(woken.metadata, np.random.default_rng(9), 1)
    woken, twin = _write(woken, wm, s, rows), _write(twin, tm, ts, rows)
    same(read(woken, wm, s), read(twin, tm, ts))


@pytest.mark.parametrize("dst,groups", tiered([("dp2tp4r", "latent"), ("tp4", "formats"), ("tp8", "one_head")],
                                              fast={("dp2tp4r", "latent")}))
def test_level_2_wakes_replicated_heads_onto_another_mesh_as_fresh_pages(dst, groups):
    cache, m, s = _filled("tp8", groups)
    m.release(s)
    woken, wm = _wake_moved(easykv.sleep(cache, m, level=2), dst)
    assert {a.sharding.mesh for a in jax.tree.leaves(woken)} == {_mesh(dst)[0]}
    assert all(not np.asarray(a).any() for a in jax.tree.leaves(woken))
    # usable: the tokens a fresh cache on the target gets (the same values) read back the same
    [t] = wm.claim(1)
    woken = _write(woken, wm, t, rows_for(woken.metadata, np.random.default_rng(5), 7))
    fresh, fm, f = _filled(dst, groups)
    same(read(woken, wm, t), read(fresh, fm, f))
