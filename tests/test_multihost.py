"""Real multi-process runs on this machine: 2 processes x 4 CPU devices on 127.0.0.1 (gloo)
form one 8-device runtime. Each test launches tests/multihost/worker.py in a mode."""

import pathlib
import sys
import time

import pytest

from easykv.distributed import MultiProcessError, launch_local

WORKER = str(pathlib.Path(__file__).parent / "multihost" / "worker.py")


def run(mode, tmp_path, timeout=240):
    return launch_local([sys.executable, WORKER, mode], num_processes=2, cpu_devices_per_process=4,
                        timeout=timeout, log_dir=str(tmp_path))  # fmt: skip


@pytest.mark.parametrize("mode", ["cache-tp", "cache-dp"])
def test_cache_written_and_read_across_two_processes(mode, tmp_path):
    outputs = run(mode, tmp_path)
    for pid, out in enumerate(outputs):
        assert f"WORKER OK {pid}" in out, out


def test_lockstep_names_the_diverging_process(tmp_path):
    outputs = run("diverge", tmp_path)
    assert all(f"WORKER OK {pid}" in out for pid, out in enumerate(outputs))


def test_a_dying_worker_fails_the_run_fast(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(MultiProcessError, match=r"process 1 of 2 exited with code 3(.|\n)*fails on purpose"):
        run("die-early", tmp_path, timeout=120)
    assert time.monotonic() - t0 < 60  # process 0 was stopped, not waited for


def test_a_hanging_run_hits_the_time_bound(tmp_path):
    with pytest.raises(MultiProcessError, match=r"still running after 3 s"):
        launch_local([sys.executable, "-c", "import time; time.sleep(60)"], num_processes=2,
                     timeout=3, log_dir=str(tmp_path))  # fmt: skip


def test_checkpoint_written_by_two_processes_restores_in_one_and_back(tmp_path):
    """2 processes write, attend, save one checkpoint and restore it onto dp=2 x tp=4; this
    (single) process restores it onto its own 8 devices; then this process saves and the two
    processes restore that."""
    import jax.numpy as jnp
    import numpy as np

    import easykv
    from sharding import PartitionAxis, PartitionManager, create_mesh

    two = str(tmp_path / "by-two")
    outputs = launch_local([sys.executable, WORKER, "checkpoint", two, "save"], num_processes=2,
                           cpu_devices_per_process=4, timeout=240, log_dir=str(tmp_path / "logs-a"))  # fmt: skip
    assert all(f"WORKER OK {pid}" in out for pid, out in enumerate(outputs))

    rng = np.random.default_rng(11)  # the workers' shared_data()
    k = rng.normal(size=(2, 32, 8, 16)).astype(np.float32)
    v = rng.normal(size=(2, 32, 8, 16)).astype(np.float32)
    mesh = create_mesh({"tp": 8})
    cache, manager = easykv.restore_cache(two, mesh=mesh, partition_manager=PartitionManager(PartitionAxis()))
    rows = manager.page_table([0, 1])
    for layer in range(2):
        keys, values = easykv.gather_kv(cache, layer, rows[1], 20)
        np.testing.assert_array_equal(np.asarray(keys), k[layer, 11:31])
        np.testing.assert_array_equal(np.asarray(values), v[layer, 11:31])
    assert cache[0].key_pages.dtype == jnp.float32

    one = str(tmp_path / "by-one")
    easykv.save_cache(one, cache, manager, step=5)
    outputs = launch_local([sys.executable, WORKER, "checkpoint", one, "restore"], num_processes=2,
                           cpu_devices_per_process=4, timeout=240, log_dir=str(tmp_path / "logs-b"))  # fmt: skip
    assert all(f"WORKER OK {pid}" in out for pid, out in enumerate(outputs))


def test_launch_local_rejects_bad_counts_before_starting_anything(tmp_path):
    logs = tmp_path / "logs"
    with pytest.raises(ValueError, match=r"num_processes must be a positive int, got 0"):
        launch_local([sys.executable, "-c", "pass"], num_processes=0, log_dir=str(logs))
    with pytest.raises(ValueError, match=r"cpu_devices_per_process must be a positive int, got True"):
        launch_local([sys.executable, "-c", "pass"], cpu_devices_per_process=True, log_dir=str(logs))
    assert not logs.exists()  # nothing was started or written
