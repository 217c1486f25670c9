"""Real multi-process runs on this machine: 2 processes x 4 CPU devices on 127.0.0.1 (gloo)
form one 8-device runtime. Each test launches worker.py (beside this file) in a mode; the tests
of the launcher's own failure handling use sleeper.py, which starts no JAX."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from easykv.errors import MultiProcessError
from easykv.multihost import launch_local

# Every test here starts processes; the launcher's argument checks (test_launch_arguments.py) start none.
pytestmark = [pytest.mark.slow, pytest.mark.multihost]

HERE = pathlib.Path(__file__).parent
WORKER = str(HERE / "worker.py")
SLEEPER = str(HERE / "sleeper.py")


def run(mode, tmp_path, timeout=240, *args):
    return launch_local([sys.executable, WORKER, mode, *args], num_processes=2, cpu_devices_per_process=4,
                        timeout=timeout, log_dir=str(tmp_path))  # fmt: skip


@pytest.fixture
def pids(tmp_path, monkeypatch):
    """A directory where every worker (and process it starts) records its pid; at the end of the
    test each of them must be gone."""
    where = tmp_path / "pids"
    where.mkdir()
    monkeypatch.setenv("EASYKV_TEST_PID_DIR", str(where))
    yield where
    assert_all_gone(where, within=30)


def recorded(where):
    return [int(p.name.split("-")[1]) for p in where.iterdir()]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie is dead; only its new parent has yet to reap it


def assert_all_gone(where, within):
    deadline = time.monotonic() + within
    while (left := [p for p in recorded(where) if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:  # do not leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes {left} outlived the launcher"


@pytest.mark.parametrize("mode", ["cache-tp", "cache-dp"])
def test_cache_written_and_read_across_two_processes(mode, tmp_path):
    outputs = run(mode, tmp_path)
    for pid, out in enumerate(outputs):
        assert f"WORKER OK {pid}" in out, out


def test_a_grouped_cache_runs_in_lockstep_across_two_processes(tmp_path):
    outputs = run("grouped", tmp_path, 240, str(tmp_path / "ckpt"))
    for pid, out in enumerate(outputs):
        assert f"WORKER OK {pid}" in out, out


def test_a_host_tier_runs_in_lockstep_across_two_processes(tmp_path):
    outputs = run("host-tier", tmp_path, 240)
    for pid, out in enumerate(outputs):
        assert f"WORKER OK {pid}" in out, out


def test_lockstep_names_the_diverging_process(tmp_path):
    outputs = run("diverge", tmp_path)
    assert all(f"WORKER OK {pid}" in out for pid, out in enumerate(outputs))


def test_a_dying_worker_fails_the_run_fast(tmp_path):
    with pytest.raises(MultiProcessError, match=r"process 1 of 2 exited with code 3(.|\n)*fails on purpose") as info:
        run("die-early", tmp_path, timeout=120)
    # Process 0 waits in initialize for a peer that never comes: it was stopped, not waited for.
    assert "every worker was killed (process 0 was running)" in str(info.value)


def test_a_hanging_run_hits_the_time_bound(tmp_path):
    with pytest.raises(MultiProcessError, match=r"still running after 3 s"):
        launch_local([sys.executable, "-c", "import time; time.sleep(60)"], num_processes=2,
                     timeout=3, log_dir=str(tmp_path))  # fmt: skip


# how a worker fails, which one, its exit status, a line its log (and so the error) must show
FAILURES = [
    ("raise", 1, 1, "RuntimeError: process 1 fails on purpose"),
    ("sys-exit", 0, 3, "process 0 fails on purpose (sys-exit)"),  # process 0 hosts JAX's coordinator
    # its code is out of the exit hook's reach: 1 (easykv.multihost.fail_fast)
    ("systemexit", 1, 1, "process 1 fails on purpose (systemexit)"),
    ("sigkill", 1, -signal.SIGKILL, "process 1 fails on purpose (sigkill)"),
]


@pytest.mark.parametrize("how, who, code, said", FAILURES, ids=[f[0] for f in FAILURES])
def test_a_worker_failing_after_initialize_is_reported_within_seconds(how, who, code, said, tmp_path, pids):
    logs = tmp_path / "logs"
    with pytest.raises(MultiProcessError) as info:
        run("fail", logs, 120, how, str(who))
    reported = time.time()
    err = info.value
    assert (err.process, err.returncode, err.log_path) == (who, code, str(logs / f"process-{who}.log"))
    status = f"exited with code {code}" if code > 0 else "was killed by signal 9 (SIGKILL)"
    assert f"process {who} of 2 {status}" in str(err) and said in str(err), str(err)
    log = pathlib.Path(err.log_path).read_text()
    # Reported at once, not after JAX's heartbeat timeout (100 s) would abort the peer: the peer,
    # blocked in a collective with the failed process, was still running (the launcher killed it) or
    # ended itself with 1 because its collective broke (it may, when the failed process hosted
    # JAX's coordinator, and within the launcher's poll).
    failed_at = float(re.search(r"fails on purpose \(\S+\) at (\d+\.\d+)", log).group(1))
    assert reported - failed_at < 20, (reported - failed_at, str(err))
    peer = re.search(rf"every worker was killed \(process {1 - who} (was running|exited with code 1)\)", str(err))
    assert peer, str(err)
    if how == "raise":
        assert "Traceback (most recent call last)" in log
    if how == "systemexit":
        assert "a SystemExit raised other than by sys.exit(), whose code an exit hook cannot read" in log
    if code > 0:  # its fail-fast hook ended it before JAX's shutdown barrier
        assert "skips JAX's shutdown barrier" in log


@pytest.mark.parametrize("who", [1, 0])
def test_the_worker_that_raised_is_named_not_the_peer_whose_collective_it_broke(who, tmp_path, pids):
    # The peer's collective fails as well ("Connection closed by peer", once the raiser has ended) and
    # it exits with 1 too, possibly seen by the launcher in the same poll as the raiser.
    logs = tmp_path / "logs"
    with pytest.raises(MultiProcessError) as info:
        run("raise-mid-collective", logs, 120, str(who))
    err = info.value
    assert (err.process, err.log_path) == (who, str(logs / f"process-{who}.log")), str(err)
    # Its own exit status: it ended itself before its peer could fail, so JAX had no cause to abort it.
    assert err.returncode == 1 and f"process {who} of 2 exited with code 1" in str(err), str(err)
    assert f"RuntimeError: raiser-marker-{who}" in str(err), str(err)


# Process 1 raises and is slow to end after its fail-fast hook recorded the failure (as a process
# holding much memory is); process 0 fails because of it, and fast: a launcher going by exit order
# names process 0. No JAX runtime; the fail-fast hook as initialize_from_env installs it.
SLOW_TO_EXIT = """
import os, pathlib, sys, time
delay, log_dir = float(sys.argv[1]), sys.argv[2]
if os.environ["EASYKV_PROCESS_ID"] == "1":
    end = os._exit
    os._exit = lambda status: (time.sleep(delay), end(status))  # the hook ends the process by os._exit
from easykv.multihost.fail_fast import install_fail_fast
install_fail_fast()
if os.environ["EASYKV_PROCESS_ID"] == "1":
    raise RuntimeError("raiser-marker-1")
peer = pathlib.Path(log_dir, "process-1.log")
while "skips JAX's shutdown barrier" not in peer.read_text():  # process 1 is exiting
    time.sleep(0.01)
raise RuntimeError("Connection closed by peer (what the collective with process 1 says now)")
"""


@pytest.mark.parametrize("delay, status, code", [(1, "exited with code 1", 1),
                                                 (600, "failed and was still exiting", None)])  # fmt: skip
def test_a_worker_that_failed_first_is_named_though_a_peer_exited_before_it(delay, status, code, tmp_path):
    logs = str(tmp_path / "logs")
    with pytest.raises(MultiProcessError) as info:
        launch_local([sys.executable, "-c", SLOW_TO_EXIT, str(delay), logs], timeout=60, log_dir=logs)
    err = info.value
    assert (err.process, err.returncode) == (1, code), str(err)
    assert f"process 1 of 2 {status}" in str(err) and "RuntimeError: raiser-marker-1" in str(err), str(err)
    assert "(process 0 exited with code 1)" in str(err), str(err)


FOLLOWER = """
import os, sys, time
if os.environ["EASYKV_PROCESS_ID"] == "1":  # what JAX does to a process when a peer has died
    print("F0000 client.h:80] Terminating process because the JAX distributed service detected fatal errors.")
    os.abort()
time.sleep(0.3)
sys.exit(5)
"""


def test_a_worker_that_jax_aborted_for_its_peer_is_not_blamed(tmp_path, pids):
    with pytest.raises(MultiProcessError, match=r"process 0 of 2 exited with code 5 .*process 1 was killed by "
                                                r"signal 6 \(SIGABRT\)") as info:  # fmt: skip
        launch_local([sys.executable, "-c", FOLLOWER], timeout=60, log_dir=str(tmp_path / "logs"))
    assert (info.value.process, info.value.returncode) == (0, 5)


def test_a_hung_run_is_stopped_at_the_timeout_naming_the_hung_workers(tmp_path, pids):
    t0 = time.monotonic()
    with pytest.raises(MultiProcessError, match=r"processes \[0, 1\] of 2 still running after 8 s") as info:
        run("hang", tmp_path / "logs", 8)
    assert time.monotonic() - t0 >= 8  # not before the timeout; the hung workers' own end is 600 s away
    assert (info.value.hung, info.value.process, info.value.returncode) == ((0, 1), 0, None)


@pytest.mark.parametrize("late", [0, 1])
def test_workers_finishing_seconds_apart_shut_down_cleanly(late, tmp_path, pids):
    outputs = run("skew", tmp_path / "logs", 120, str(late))  # raises unless both exit with 0
    for pid, out in enumerate(outputs):
        assert f"WORKER OK {pid}" in out and "shutdown barrier" not in out, out


LAUNCHER = """
import signal, sys
from easykv.multihost import launch_local
signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell may have started us with SIGINT ignored
launch_local([sys.executable, sys.argv[1], sys.argv[2]], num_processes=2, timeout=120, log_dir=sys.argv[3])
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_workers_die_with_their_launcher(sig, tmp_path, pids):
    # SIGTERM/SIGINT: the launcher kills each worker's process group, the worker's own child too;
    # SIGKILL: the kernel kills the workers (PR_SET_PDEATHSIG), which covers no child of theirs.
    children = "alone" if sig == signal.SIGKILL else "with-child"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, SLEEPER, children, str(tmp_path / "logs")],
                                cwd=HERE.parents[1])  # fmt: skip
    try:
        expected, deadline = (2 if children == "alone" else 4), time.monotonic() + 60
        while len(recorded(pids)) < expected:
            assert launcher.poll() is None and time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.05)
        launcher.send_signal(sig)
        assert launcher.wait(timeout=10) == -sig
    finally:
        launcher.kill()
        launcher.wait()
    assert_all_gone(pids, within=30)


def test_checkpoint_written_by_two_processes_restores_in_one_and_back(tmp_path):
    """2 processes write, attend, save one checkpoint and restore it onto dp=2 x tp=4; this
    (single) process restores it onto its own 8 devices; then this process saves and the two
    processes restore that."""
    import jax.numpy as jnp
    import numpy as np

    import easykv
    from easykv.sharding import PartitionAxis, PartitionManager, create_mesh

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
