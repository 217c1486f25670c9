"""Regressions of an outside attack on the reliability promise (docs/reliability.md):
each test is one way in which a call used to escape with the wrong error, change
something silently, hang, or allocate far more than its input.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from easykv import (
    CacheCheckpointer,
    CheckpointIntegrityError,
    PagedAttentionCacheMetaData,
    PageManager,
    inspect_checkpoint,
    restore_cache,
    save_cache,
)
from easykv.checkpoint.checkpointer import list_steps
from easykv.multihost import assert_lockstep
from easykv.step.metadata import increment_cache_lengths
from easykv.validation import integer_array
from tests.support.checkpoints import engine_run, manager_path, qsetup


@pytest.fixture(scope="module")
def run():
    return engine_run("heads")


def test_wrong_types_raise_value_errors_not_type_or_attribute_errors(run, tmp_path):
    cache, manager, _ = run
    mesh, pm, _ = qsetup("heads")
    for call in (lambda: list_steps(None), lambda: restore_cache(None, mesh=mesh),
                 lambda: inspect_checkpoint(None), lambda: save_cache(3, cache),
                 lambda: increment_cache_lengths(object(), page_size=4),
                 lambda: cache.write(None, None, None),
                 lambda: PageManager.estimated_memory_size(object(), 100),
                 lambda: assert_lockstep({"a": object()}), lambda: assert_lockstep({1: 2, "a": 3})):
        with pytest.raises(ValueError):
            call()
    save_cache(tmp_path, cache, manager)
    with pytest.raises(ValueError, match="dtype"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm, dtype=1)
    with pytest.raises(ValueError, match="partition_manager must be an easykv.sharding.PartitionManager"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=1)
    with pytest.raises(ValueError, match="storage_platform must be None or one of"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm, storage_platform="xx")
    for bad in (None, "tp", {"tp": 1}):  # used to fail with AttributeError deep in the partition rules
        with pytest.raises(ValueError, match=r"mesh must be a jax.sharding.Mesh or AbstractMesh, got .*create_mesh"):
            PagedAttentionCacheMetaData.create(bad, 4, 1, 64, 16, 8, 8, 0.9, num_pages_per_layer=64)


def test_what_would_change_silently_is_refused(run, tmp_path):
    cache, manager, _ = run
    for extra in ({1: 2}, {"a": (1, 2)}):  # JSON would give back {"1": 2} and [1, 2]
        with pytest.raises(ValueError, match="would not read back unchanged"):
            save_cache(tmp_path, cache, manager, extra_metadata=extra)
    assert not os.path.exists(tmp_path / "0")
    with pytest.raises(ValueError, match="manager must be the PageManager"):
        save_cache(tmp_path, cache, object())
    with pytest.raises(ValueError, match="must be an array of ints"):
        integer_array("ids", np.ma.masked_array([1, 2], mask=[0, 1]))  # the mask would be dropped


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "huge"])
def test_a_manager_file_that_is_not_a_small_regular_file_is_damage(run, tmp_path, kind):
    cache, manager, _ = run
    mesh, pm, _ = qsetup("heads")
    save_cache(tmp_path, cache, manager)
    path = manager_path(tmp_path)
    path.unlink()
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)  # reading it would block forever
    else:
        with open(path, "wb") as f:
            f.truncate(1 << 33)  # 8 GiB, sparse
    with pytest.raises(CheckpointIntegrityError, match="not a regular file|more than the"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm)
    assert "DAMAGED" in inspect_checkpoint(tmp_path)  # verify reads the manager state: it must not hang


def test_saves_from_two_threads_are_serialized_and_both_commit(run, tmp_path):
    cache, manager, _ = run
    errors = []
    with CacheCheckpointer(tmp_path, async_save=True) as ckpt:
        def save(step):
            try:
                ckpt.save(cache, manager, step=step)
            except Exception as err:  # noqa: BLE001  collected and asserted below
                errors.append(err)

        threads = [threading.Thread(target=save, args=(step,)) for step in (0, 1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
    assert errors == [] and list_steps(tmp_path) == [0, 1, 2]
