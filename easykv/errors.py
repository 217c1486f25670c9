"""easykv's typed errors: the page manager's, one per tier of trouble, the multi-process
ones (`LockstepError`, raised by ``easykv.multihost.assert_lockstep``; `MultiProcessError`,
raised by ``easykv.multihost.launch_local``), the checkpoints', and the metadata and memory
sizing ones (`SerializationError`, `MemoryUnavailableError`). Every public exception class of
easykv is defined here (the modules that raise them import them from here).

A caller must be able to tell three things apart without parsing messages:

* the cache is full (expected under load; the scheduler preempts or waits): `CacheFullError`;
* the caller passed a bad value (a bug in the caller; nothing changed): `ValueError`, or
  `UnknownSequenceError` for sequence ids that are not (or no longer) claimed;
* the manager broke its own bookkeeping (a bug in easykv): `InvariantError`.
"""

from __future__ import annotations

from collections.abc import Sequence


class CacheFullError(RuntimeError):
    """The pool (or the batch's sequence slots) cannot hold what was asked; nothing changed.

    ``resource`` is ``"pages"`` or ``"sequence slots"``; ``needed`` and ``available`` count it;
    ``replica`` is the data-parallel replica that ran out (None when the pool is not split).
    """

    def __init__(self, message: str, *, resource: str, needed: int, available: int, replica: int | None = None):
        super().__init__(message)
        self.resource = resource
        self.needed = needed
        self.available = available
        self.replica = replica


class UnknownSequenceError(KeyError, ValueError):
    """A sequence id that is not claimed (never claimed, or already released).

    A KeyError (the id is a key the manager does not hold) and a ValueError (it is bad input),
    so callers may catch either.
    """

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class InvariantError(AssertionError):
    """easykv's own bookkeeping (the page manager's, a sequence transfer's, the demo engine's) is
    inconsistent. This is a bug in easykv, never bad input."""

    def __init__(self, message: str, *, where: str = "page manager"):
        super().__init__(f"easykv bug: {where} invariant broken: {message}. "
                         "Please report it with the calls that led here.")
        self.detail = message


class ManagerStateError(ValueError):
    """A PageManager state (``from_state_dict``, a checkpoint's ``manager.json``) is malformed or
    inconsistent: a field of the wrong type or range, or a cross-reference that would let one
    sequence touch another's pages. ``field`` names the offending field (e.g.
    ``"sequences[2].pages"``, ``"pool.scrub"``); nothing was built from it."""

    def __init__(self, message: str, *, field: str):
        super().__init__(f"PageManager state field {field}: {message}")
        self.field = field


__all__ = [
    "CacheFullError", "CheckpointError", "CheckpointIntegrityError", "CheckpointLockedError",
    "CheckpointMismatchError", "CheckpointWriteError", "FileRefusedError", "InvariantError", "ManagerStateError",
    "LockstepError", "MemoryUnavailableError", "MultiProcessError", "NotACheckpointError",
    "SerializationError", "StepNotFoundError", "StoreUnavailableError", "StoreValueError", "UnknownSequenceError",
]


# ---- several processes ---------------------------------------------------------------------
class LockstepError(RuntimeError):
    """Hosts that must hold identical state do not."""


class MultiProcessError(RuntimeError):
    """A local multi-process run failed: a worker died, the run exceeded its time bound, or the
    launcher was stopped by a signal; every worker was killed.

    ``process`` is the worker that failed first (the first still running at a timeout; None when
    the launcher was stopped), ``returncode`` its exit code (negative: the signal that killed it;
    None if it was still running), ``log_path`` its log, ``hung`` the workers still running at the
    timeout (empty otherwise).
    """

    def __init__(self, message: str, *, process: int | None = None, returncode: int | None = None,
                 log_path: str | None = None, hung: tuple[int, ...] = ()):  # fmt: skip
        super().__init__(message)
        self.process = process
        self.returncode = returncode
        self.log_path = log_path
        self.hung = hung


# ---- files read back ----------------------------------------------------------------------
class FileRefusedError(ValueError):
    """A file easykv was asked to read is not what it can read safely: a link where none may be,
    a FIFO, device, socket or directory, a size outside what the file can hold, or a file that
    shrank or grew while read (`easykv.checked_files`). Nothing was read from it; ``path`` names it.
    Checkpoint reads turn it into `CheckpointIntegrityError`."""

    def __init__(self, message: str, *, path: object = None):
        super().__init__(message)
        self.path = None if path is None else str(path)


# ---- metadata JSON and device memory -------------------------------------------------------
class SerializationError(ValueError):
    """A dict/JSON cannot become (or an object cannot be written as) a Serializable class."""


class MemoryUnavailableError(RuntimeError):
    """The device's memory could not be determined; pass ``memory_bytes_per_device=``."""


# ---- checkpoints: a directory that is not one, a missing step, a format that does not fit,
# damaged data ------------------------------------------------------------------------------
class StoreUnavailableError(ConnectionError):
    """A shared prefix store (``easykv.tiers.store``) did not answer: its server is down or
    unreachable, its directory is gone or read-only, its disk is full, or a call took longer than
    its timeout. The store tier counts it, logs it once and treats lookups as misses until the
    store answers again; a caller of a backend method sees it directly. ``url`` names the store."""

    def __init__(self, message: str, *, url: str | None = None):
        super().__init__(message)
        self.url = url


class StoreValueError(ValueError):
    """A value read from the shared prefix store is not the one asked for: damaged, of another key,
    of another layout or format. The store tier counts it and treats it as a miss; it never reaches a
    page.

    Attributes:
      reason: why, one of ``easykv.tiers.store.codec.REASONS``: ``"magic"`` (not an easykv store value), ``"version"``
        (another layout version), ``"key"`` (written under another key), ``"shape"`` (other leaves:
        count, dtypes or shapes), ``"truncated"`` (not the expected length: cut short or extended),
        ``"checksum"`` (the bytes changed after they were written).
      key: the key it was read under.
    """

    def __init__(self, message: str, *, reason: str, key: str):
        super().__init__(message)
        self.reason = reason
        self.key = key


class CheckpointError(Exception):
    """Base class of the errors raised by easykv's checkpoint functions; ``step`` and
    ``directory`` say where, when known (None otherwise)."""

    def __init__(self, message: str = "", *, step: int | None = None, directory: str | None = None):
        super().__init__(message)
        self.step = step
        self.directory = directory

    def __str__(self) -> str:  # the OSError subclasses would format (errno, strerror)
        return str(self.args[0]) if self.args else ""


class NotACheckpointError(CheckpointError, FileNotFoundError):
    """The directory does not exist or holds no easykv checkpoint."""


class StepNotFoundError(CheckpointError, FileNotFoundError):
    """The requested step is not a complete checkpoint in the directory; ``available`` lists
    the complete ones."""

    def __init__(self, message: str, *, step: int | None = None, available: Sequence[int] = ()):
        super().__init__(message, step=step)
        self.available = list(available)


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint cannot become the requested cache: other model shape, dtype or quantizer
    (without ``convert=True``), a mesh the pool cannot be split over, or a newer format."""


class CheckpointIntegrityError(CheckpointError):
    """Saved data are damaged: a fingerprint mismatch, an unreadable or truncated data file, or
    a damaged JSON record. ``array`` names the damaged array (None when not one array)."""

    def __init__(self, message: str, *, array: str | None = None, step: int | None = None,
                 directory: str | None = None):
        super().__init__(message, step=step, directory=directory)
        self.array = array


class CheckpointLockedError(CheckpointError):
    """Another writer (a `CacheCheckpointer` or `save_cache`, in this process or another) holds
    the checkpoint ``directory``; two writers would delete each other's unfinished steps."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (disk full, file too large, permission, I/O error). The step
    being written does not exist; earlier steps are intact. ``errno`` is the OS error number
    when there is one."""

    def __init__(self, message: str, *, step: int | None = None, directory: str | None = None,
                 errno: int | None = None):
        super().__init__(message, step=step, directory=directory)
        self.errno = errno
