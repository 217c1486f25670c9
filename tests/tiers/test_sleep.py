"""sleep / wake on 8 simulated devices: level 1 moves every page to host memory (pinned_host) and
back bit for bit, on the same mesh or another one (the manager re-split with the pool); level 2
frees the pages and starts again from zeroed ones with the manager's versions kept. Device bytes
are counted from the live arrays. Bad calls are refused with nothing changed."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import easykv
from easykv.spec.memory import MemoryBudget
from sharding import ShardingAdjustedWarning
from tests.support.groups import filled_formats, mesh_and_rule, read, rows_for, same


def _live(cache):
    return not any(a.is_deleted() for a in jax.tree.leaves(cache))


def test_level_1_frees_the_device_and_wakes_bit_exact_on_the_same_mesh():
    cache, m, s, _ = filled_formats("tp8")  # int8, bf16 and fp8 layer groups
    want, state = read(cache, m, s), m.state_dict()
    pool = easykv.device_bytes(cache)
    assert pool == cache.metadata.bytes_per_device * 8  # every device's shards, as sized
    before = easykv.device_bytes()
    sleeping = easykv.sleep(cache, m)
    assert not _live(cache) and sleeping.level == 1 and sleeping.host_bytes == pool
    assert before - easykv.device_bytes() >= 0.99 * pool
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(sleeping.key_pages)} == {"pinned_host"}
    woken, wm = easykv.wake(sleeping)
    assert wm is m and m.state_dict() == state and easykv.device_bytes(woken) == pool
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
    rts = wm.build_step_metadata([s], [1])
    new = rows_for(woken.metadata, np.random.default_rng(9), 1)
    woken, _ = woken.write([k for k, _ in new], [v for _, v in new], rts)
    wm.step([s], [7])
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
    pool = easykv.device_bytes(cache)
    before = easykv.device_bytes()
    sleeping = easykv.sleep(cache, m, level=2)
    assert sleeping.host_bytes == 0 and before - easykv.device_bytes() >= 0.99 * pool
    assert m.metrics.cached_pages == 0 and m.weight_version == "rollout-3"
    woken, wm = easykv.wake(sleeping)
    assert easykv.device_bytes(woken) == pool
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
    monkeypatch.setattr("easykv.storage.cache.device_memory_budget",
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
