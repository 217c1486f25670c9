"""One writer per checkpoint directory, and write failures as CheckpointWriteError.

Two writers on one directory used to delete each other's unfinished steps (orbax's manager
removes every temporary directory when it is built). Now a CacheCheckpointer holds an flock on
``DIR/.easykv-writer-<process_index>.lock`` from construction to close: a second writer, in this
process or another, gets CheckpointLockedError and nothing in the directory changes; the lock
goes with close(), garbage collection and process death (kill -9). Disk full (a tmpfs of our
own, when user namespaces allow mounting one) and file too large (RLIMIT_FSIZE) are real, in a
child process: every failed save raises CheckpointWriteError naming step, directory and errno,
and the earlier step stays restorable."""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from easykv.checkpoint.checkpointer import CacheCheckpointer, list_steps, restore_cache, save_cache
from easykv.checkpoint.writer import WriterLock, errno_of, lock_file_name
from easykv.errors import CheckpointLockedError, CheckpointWriteError
from tests.support.checkpoints import assert_same_bits, engine_run, qsetup
from tests.support.devices import REPO

TESTS = Path(__file__).parent
CHILD = TESTS / "writer_child.py"
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _listing(directory: Path) -> dict[str, int]:
    """Every path under ``directory`` and its size, once the writes in flight have settled
    (tensorstore's ``*.__lock`` temporaries gone, two looks alike)."""
    def look() -> dict[str, int]:
        out = {}
        for p in sorted(directory.rglob("*")):
            try:
                out[str(p.relative_to(directory))] = p.stat().st_size
            except FileNotFoundError:  # a temporary that vanished mid-walk
                return {"(changing)": 0}
        return out

    deadline = time.monotonic() + 30
    last = look()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = look()
        if now == last and not any(name.endswith(".__lock") or name == "(changing)" for name in now):
            return now
        last = now
    raise AssertionError(f"{directory} kept changing: {sorted(last)[:20]}")


@pytest.fixture
def gated_saves(monkeypatch):
    """``arm()`` holds every later save in its background write (before the record is written)
    until the returned event is set."""
    import easykv.checkpoint.format as fmt

    event = threading.Event()
    original = fmt._StateHandler._write

    async def gated(self, directory, args):
        await asyncio.get_running_loop().run_in_executor(None, event.wait, 60)
        await original(self, directory, args)

    def arm() -> threading.Event:
        monkeypatch.setattr(fmt._StateHandler, "_write", gated)
        return event

    yield arm
    event.set()


def test_second_writer_mid_async_save_is_refused_and_the_save_completes(tmp_path, gated_saves):
    cache, manager, _ = engine_run("heads")
    save_cache(tmp_path, cache, manager, step=0)
    ckpt = CacheCheckpointer(tmp_path)
    gate = gated_saves()
    try:
        ckpt.save(cache, manager, step=1)  # in flight: held at the gate, its temporary directory on disk
        before = _listing(tmp_path)
        assert "1.orbax-checkpoint-tmp" in before and "1" not in before
        with pytest.raises(CheckpointLockedError, match=rf"pid {os.getpid()} on host") as err:
            save_cache(tmp_path, cache, manager, step=2)
        assert err.value.directory == str(tmp_path) and str(tmp_path) in str(err.value)
        with pytest.raises(CheckpointLockedError):
            CacheCheckpointer(tmp_path, max_to_keep=1)
        assert _listing(tmp_path) == before  # the refused writers changed nothing
    finally:
        gate.set()
        ckpt.close()
    assert list_steps(tmp_path) == [0, 1]
    mesh, pm, _ = qsetup("heads")
    restored = restore_cache(tmp_path, mesh=mesh, partition_manager=pm, step=1)
    assert_same_bits(restored.cache, cache)
    assert restored.manager.state_dict() == manager.state_dict()
    assert save_cache(tmp_path, cache, manager) == 2  # closed: the lock is free again


def test_readers_take_no_lock(tmp_path):
    cache, manager, _ = engine_run("heads")
    with CacheCheckpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(cache, manager)
        mesh, pm, _ = qsetup("heads")
        assert list_steps(tmp_path) == [0]
        assert_same_bits(restore_cache(tmp_path, mesh=mesh, partition_manager=pm).cache, cache)
        assert_same_bits(ckpt.restore(mesh=mesh, partition_manager=pm).cache, cache)


def test_lock_files_per_process_index(tmp_path):
    """The processes of one job (indexes 0, 1, ...) write together; a second process 0 does not."""
    first = WriterLock(tmp_path, 0)
    other_index = WriterLock(tmp_path, 1)
    with pytest.raises(CheckpointLockedError, match=lock_file_name(0)):
        WriterLock(tmp_path, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [lock_file_name(0), lock_file_name(1)]
    first.release()
    first.release()  # idempotent
    WriterLock(tmp_path, 0).release()
    other_index.release()


def test_lock_released_by_close_even_when_the_last_save_failed(tmp_path, monkeypatch):
    import easykv.checkpoint.format as fmt

    cache, manager, _ = engine_run("heads")
    save_cache(tmp_path, cache, manager, step=0)

    async def disk_full(self, directory, args):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory))

    monkeypatch.setattr(fmt._StateHandler, "_write", disk_full)
    ckpt = CacheCheckpointer(tmp_path)
    ckpt.save(cache, manager, step=1)
    with pytest.raises(CheckpointWriteError, match=r"saving step 1 to .* \(ENOSPC") as err:
        ckpt.close()
    assert (err.value.step, err.value.errno, err.value.directory) == (1, errno.ENOSPC, str(tmp_path))
    assert isinstance(err.value.__cause__, OSError)
    ckpt.close()  # closed once; no second error
    monkeypatch.undo()
    assert list_steps(tmp_path) == [0]
    with CacheCheckpointer(tmp_path) as again:  # the lock was released; the leftovers are cleared
        again.save(cache, manager, step=1)
    assert list_steps(tmp_path) == [0, 1]


def test_lock_released_when_the_checkpointer_is_garbage_collected(tmp_path):
    cache, manager, _ = engine_run("heads")
    ckpt = CacheCheckpointer(tmp_path)
    ckpt.save(cache, manager, step=0)  # async, still in flight
    del ckpt
    gc.collect()
    with CacheCheckpointer(tmp_path) as again:  # the finalizer finished the save, then unlocked
        assert again.all_steps() == [0]


def test_lock_held_by_another_process_and_released_by_its_death(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, str(CHILD), "hold", str(tmp_path)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = child.stdout.readline()
        assert line.startswith("HOLDING"), f"child did not take the lock: {line!r}"
        before = _listing(tmp_path)
        cache, manager, _ = engine_run("heads")
        with pytest.raises(CheckpointLockedError, match=rf"pid {child.pid} on host .* process index 0"):
            save_cache(tmp_path, cache, manager)
        assert _listing(tmp_path) == before
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert save_cache(tmp_path, cache, manager) == 0  # the kernel dropped the dead holder's lock


# ---- write failures, for real ------------------------------------------------------------------
def _run_child(argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _check_attack(out: dict, code: int, directory: str) -> None:
    for when, step in (("sync", 1), ("wait", 2), ("close", 3)):
        failure = out[when]
        assert failure["type"] == "CheckpointWriteError", (when, failure)
        assert (failure["step"], failure["errno"], failure["directory"]) == (step, code, directory), (when, failure)
        assert f"step {step}" in failure["message"] and errno.errorcode[code] in failure["message"]
        assert "earlier steps are intact" in failure["message"]
    assert out["steps_after_failures"] == [0] and out["step0_intact"]
    assert out["steps_after_retry"] == [0, 4] and out["step4_intact"] and out["leftovers"] == []


def test_file_too_large_is_a_write_error_and_earlier_steps_stay(tmp_path):
    directory = str(tmp_path / "ck")
    out = _run_child([sys.executable, str(CHILD), "efbig", directory])
    _check_attack(out, errno.EFBIG, directory)
    assert out["sync"]["cause"] == "ValueError"  # tensorstore's error, its errno read from the message
    assert out["sync_json"]["errno"] == errno.EFBIG and out["sync_json"]["cause"] == "OSError"
    assert out["json_steps"] == [0]


def _can_mount_tmpfs(where: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {where}"],
                           capture_output=True)
    return probe.returncode == 0


def test_disk_full_is_a_write_error_and_earlier_steps_stay(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if not _can_mount_tmpfs(mount):
        pytest.skip("no unprivileged user+mount namespaces here to mount a small tmpfs (unshare -rm)")
    directory = str(mount / "ck")
    script = f'mount -t tmpfs -o size=256k tmpfs {mount} && exec "$0" "$@"'
    out = _run_child(["unshare", "-rm", "sh", "-c", script, sys.executable, str(CHILD), "enospc", directory])
    _check_attack(out, errno.ENOSPC, directory)


def test_errno_is_found_in_orbax_and_tensorstore_errors():
    ts = ValueError("OUT_OF_RANGE: Error writing local file \"x\": Failed to write: File too large "
                    "[os_error_code='27']")
    assert errno_of(ts) == errno.EFBIG
    try:
        try:
            raise OSError(errno.ENOSPC, "full")
        except OSError as inner:
            raise RuntimeError("orbax commit failed") from inner
    except RuntimeError as outer:
        assert errno_of(outer) == errno.ENOSPC
    assert errno_of(RuntimeError("no number here")) is None
