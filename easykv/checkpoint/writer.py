"""What a checkpoint writer needs beyond orbax: one writer per directory, and write failures
reported as `CheckpointWriteError` (used by `easykv.checkpoint.checkpointer.CacheCheckpointer`).

One writer per directory. orbax's CheckpointManager deletes every ``*.orbax-checkpoint-tmp*``
directory when it is built, and its ``max_to_keep`` deletes old steps: two writers on one
directory destroy each other's unfinished saves. A writer therefore takes an exclusive
advisory lock (``fcntl.flock``) on ``DIR/.easykv-writer-<process_index>.lock`` before orbax
touches the directory, and holds it until `CacheCheckpointer.close` (or until it is garbage
collected, or its process dies: the kernel drops the lock with the last open descriptor, so a
killed writer never leaves a stale lock). The file is never deleted (deleting a lock file
races with the next locker); its text names the holder for the error message. One lock file
per process index lets the processes of one multi-process job write together, while process 0
of a second job (or a second writer in the same process: flock locks open files, not
processes) is refused with `CheckpointLockedError` before anything in the directory changes.
Readers (restore, inspect, list_steps) take no lock. Object stores (``gs://``...) have no
flock: there the lock is skipped and one writer per directory is the caller's rule.

A writer process that forks (os.fork, multiprocessing's "fork") shares the lock with its child
until both have closed it; spawn-started children do not inherit it (the descriptor is not
inheritable).
"""

from __future__ import annotations

import datetime
import errno as errno_codes
import os
import re
import socket

from easykv.checkpoint.orbax_types import EPath
from easykv.errors import CheckpointLockedError, CheckpointWriteError

LOCK_PREFIX = ".easykv-writer-"
_HOLDER_BYTES = 512


def lock_file_name(process_index: int) -> str:
    return f"{LOCK_PREFIX}{process_index}.lock"


def _is_local(directory: EPath) -> bool:
    return "://" not in os.fspath(directory)


class WriterLock:
    """The exclusive writer lock of ``directory`` for one process index (see the module doc)."""

    def __init__(self, directory: EPath, process_index: int):
        self.directory = directory
        self.path = directory / lock_file_name(process_index)
        self._fd: int | None = None
        if not _is_local(directory):
            return
        import fcntl

        try:
            directory.mkdir(parents=True, exist_ok=True)
            # O_CREAT without O_TRUNC: a refused writer must not wipe the holder's text.
            fd = os.open(os.fspath(self.path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise write_error(err, step=None, directory=directory, doing="taking the writer lock of") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise CheckpointLockedError(
                f"{directory} is being written by another CacheCheckpointer or save_cache (holder: {holder}; lock "
                f"{self.path}); two writers would delete each other's unfinished steps. Close the other writer "
                "(or wait for it to finish) first, or save into another directory", directory=str(directory),
            ) from None
        except OSError as err:
            os.close(fd)
            raise write_error(err, step=None, directory=directory, doing="taking the writer lock of") from err
        self._fd = fd
        since = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        text = f"pid {os.getpid()} on host {socket.gethostname()}, process index {process_index}, since {since}\n"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, text.encode(), 0)
        except OSError:
            pass  # the text only improves the message a refused writer sees; the lock is what counts

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (idempotent). Closing the descriptor releases the flock."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        raw = os.pread(fd, _HOLDER_BYTES, 0)
    except OSError:
        raw = b""
    text = "".join(c if c.isprintable() else " " for c in raw.decode("utf-8", "replace")).strip()
    return text or "unknown (it is starting or did not say)"


# ---- write failures -----------------------------------------------------------------------------
_TS_ERRNO = re.compile(r"os_error_code='?(\d+)")  # tensorstore: "... [os_error_code='28']"
_PY_ERRNO = re.compile(r"\[Errno (\d+)\]")
_FIX = {
    errno_codes.ENOSPC: "free space on the device",
    errno_codes.EDQUOT: "free space within your disk quota",
    errno_codes.EFBIG: "raise the file-size limit (ulimit -f) or use a filesystem that allows larger files",
    errno_codes.EACCES: "make the directory writable",
    errno_codes.EPERM: "make the directory writable",
    errno_codes.EROFS: "save to a writable filesystem",
}


def errno_of(err: BaseException) -> int | None:
    """The OS error number behind ``err``: an OSError in its chain, or tensorstore's
    ``os_error_code`` in its message."""
    seen: set[int] = set()
    node: BaseException | None = err
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        if isinstance(node, OSError) and isinstance(node.errno, int):
            return node.errno
        for pattern in (_TS_ERRNO, _PY_ERRNO):
            match = pattern.search(str(node))
            if match:
                return int(match.group(1))
        node = node.__cause__ or node.__context__
    return None


def write_error(err: BaseException, *, step: int | None, directory: EPath,
                doing: str | None = None) -> CheckpointWriteError:
    """A `CheckpointWriteError` for ``err`` (raise it ``from err``)."""
    code = errno_of(err)
    what = doing or (f"saving step {step} to" if step is not None else "writing to")
    name = errno_codes.errorcode.get(code, str(code)) if code is not None else None
    cause = f"{name}: {os.strerror(code)}" if code is not None else type(err).__name__
    text = " ".join(str(err).split())
    text = text if len(text) <= 300 else text[:300] + "..."
    fix = _FIX.get(code, "check the storage") if code is not None else "check the storage and the error above"
    outcome = (f"step {step} was not written and earlier steps are intact" if step is not None
               else "nothing was saved")
    return CheckpointWriteError(f"{what} {directory} failed ({cause}; {text}); {outcome} — {fix} and save again",
                                step=step, directory=str(directory), errno=code)


__all__ = ["LOCK_PREFIX", "WriterLock", "errno_of", "lock_file_name", "write_error"]
