"""`TensorstoreBackend`: the shared prefix store on tensorstore's kvstore (``file://``,
``memory://``, ``gs://``, ``s3://``, each optionally under ``ocdbt``; `easykv.tiers.store.url`
parses the URL).

How each call maps onto tensorstore:

- ``get_many`` / ``exists_many``: one `tensorstore.Batch` of reads (``exists`` reads a byte range
  of 0 bytes: the engine answers present or missing without moving the value).
- ``put_if_absent``: one conditional write per key, ``if_equal`` the generation tensorstore gives a
  missing key (`NO_VALUE_GENERATION`): the engine writes only if the key holds nothing (the file
  driver takes a lock file and renames the value in place, so a reader sees the whole value or
  none); a write that lost the race comes back with an empty generation and counts as False.
- ``list_keys``: ``list()`` over the key range of the prefix; ``delete_many``: writes of None.
- ``stats`` / ``gc``: count and delete only keys of the shape easykv writes
  (`key_syntax.is_store_key`); any other name under the root (a project's files, notes, a name
  that is not ASCII) is left alone and counted in ``foreign_entries``. A ``file`` store reads
  sizes and modification times with ``os.lstat`` under its root (a link is never followed, nor
  counted as a value); other drivers read every value's size through the kvstore (times None)
  and refuse ``gc`` (no times to order by).

A ``file`` store reads only regular files: before a read, each key's path is ``lstat``-ed and
anything else there (a FIFO, a device, a directory, a link) reads as missing, is never opened and
is counted in ``refused_paths`` (tensorstore would block one of its I/O threads for good in
``open()`` on a FIFO). Each store also has its own tensorstore context, so its I/O threads are its
own: a store stuck on its file system never starves another store or a checkpoint.

Faults: every tensorstore failure (its errors are ValueErrors carrying a status such as
``FAILED_PRECONDITION`` or ``UNAVAILABLE``) and every wait past ``timeout_s`` raise
`StoreUnavailableError` naming the URL. A ``file`` store's root is created when the backend opens
(unless ``create=False``: an operator's command must not create a mistyped path) and checked
before every call: tensorstore would recreate a removed directory on the next write
and read a missing or replaced one as empty, so a shared directory that went away (unmounted,
deleted, replaced by a file) would look like an empty store; it is reported as unavailable
instead, until a directory is there again.

``gs://`` and ``s3://`` are spec plumbing only here: the spec is built and checked by tensorstore
without network (the tests cannot reach a bucket); the calls are the same as on any driver.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Sequence
from typing import Any

import tensorstore as ts

from easykv.errors import StoreUnavailableError
from easykv.tiers.store.backend import GcResult, StoreBackend, StoreStats
from easykv.tiers.store.key_syntax import (
    check_items,
    check_keys,
    check_prefix,
    is_store_key,
    key_problem,
)

NO_VALUE_GENERATION = b"\x02"
"""The storage generation tensorstore reports for a missing key (``StorageGeneration::NoValue``
as tensorstore 0.1.x encodes it); a write conditioned on it succeeds only on a missing key.
tests/tiers/store/test_backends.py checks it against a missing key's read on every driver."""

_STATS_CHUNK = 256  # values read at once when a driver keeps no sizes outside the value

# One context for every memory:// store of the process: tensorstore gives each context its own
# memory store, so two opens of memory://name share data only through a shared context.
_MEMORY_CONTEXT = ts.Context()
# Each other store opens in a context of its own with this many file I/O threads (see the module).
_FILE_IO_CONCURRENCY = 8


class TensorstoreBackend(StoreBackend):
    """A store on a tensorstore kvstore (see the module docstring).

    Args:
      url: the store's URL, for messages (`easykv.tiers.store.url.open_backend` parses it).
      kvstore_spec: tensorstore's kvstore JSON spec the URL names.
      root: a ``file`` store's directory (None for other drivers).
      timeout_s: how long one call waits on tensorstore before StoreUnavailableError.
      create: create a missing ``file`` root (a store a cache writes into); False: a missing root
        is an error (an operator's command on an existing store).

    Attributes:
      refused_paths: key paths of a ``file`` store found to be no regular file when read (read as
        missing, never opened), counted since the backend opened.

    Raises:
      StoreUnavailableError: the kvstore cannot be opened (a file root that cannot be created, or
        with ``create=False`` one that is no directory).
    """

    def __init__(self, url: str, kvstore_spec: dict[str, Any], *, root: str | None, timeout_s: float,
                 create: bool = True):
        self.url = url
        self._root = root
        self._timeout_s = timeout_s
        self._has_file_times = kvstore_spec["driver"] == "file"
        self.refused_paths = 0
        self._refused_lock = threading.Lock()
        if self._root is not None and create:
            try:
                os.makedirs(self._root, exist_ok=True)
            except OSError as err:
                raise self._unavailable("cannot create its directory", err) from err
        elif self._root is not None and not os.path.isdir(self._root):
            raise self._unavailable(f"its directory {self._root} does not exist or is not a directory",
                                    "check the path; this command never creates a store")
        uses_memory = "memory" in (kvstore_spec["driver"], kvstore_spec.get("base", {}).get("driver"))
        own_context = {"file_io_concurrency": {"limit": _FILE_IO_CONCURRENCY}}
        context = _MEMORY_CONTEXT if uses_memory else ts.Context(own_context)
        self._kv: Any = self._wait([ts.KvStore.open(kvstore_spec, context=context)], "open")[0]

    # ---- failures ---------------------------------------------------------------------------
    def _unavailable(self, what: str, cause: BaseException | str) -> StoreUnavailableError:
        text = " ".join(str(cause).split()) or type(cause).__name__
        return StoreUnavailableError(f"store {self.url}: {what}: {text}", url=self.url)

    def _check_root(self) -> None:
        """Refuse a call when the file store's root is no longer a directory (see the module)."""
        if self._root is None:
            return
        try:
            is_dir = stat.S_ISDIR(os.stat(self._root).st_mode)
        except FileNotFoundError:
            is_dir = False
        except OSError as err:
            raise self._unavailable(f"its directory {self._root} cannot be read", err) from err
        if not is_dir:
            raise self._unavailable(f"its directory {self._root} is gone or is not a directory",
                                    "restore the directory (or mount the shared file system) to use the store again")

    def _wait(self, futures: Sequence[Any], what: str) -> list[Any]:
        """The futures' results, all within ``timeout_s``; a failure or a wait past it cancels the
        rest and raises StoreUnavailableError."""
        deadline = time.monotonic() + self._timeout_s
        try:
            # A future already done is read without a timeout: result(timeout=...) off the main thread costs about
            # as much as the read itself.
            return [f.result() if f.done() else f.result(timeout=max(0.0, deadline - time.monotonic()))
                    for f in futures]
        except (ValueError, OSError) as err:  # tensorstore's I/O errors are ValueErrors (a status code, the OS error)
            for f in futures:
                f.cancel()
            timed_out = isinstance(err, TimeoutError)
            cause = f"no answer within {self._timeout_s:g} s" if timed_out else err
            raise self._unavailable(f"{what} failed", cause) from err

    def _batched_reads(self, keys: Sequence[str], what: str, **read_options: Any) -> list[Any]:
        """tensorstore's read result per key, None for a path refused (`_readable`)."""
        self._check_root()
        readable = self._readable(keys)
        with ts.Batch() as batch:
            futures = [self._kv.read(key, batch=batch, **read_options) for key, ok in zip(keys, readable) if ok]
        results = iter(self._wait(futures, what))
        return [next(results) if ok else None for ok in readable]

    def _readable(self, keys: Sequence[str]) -> list[bool]:
        """Per key, False where a ``file`` store's path is there but no regular file (see the module)."""
        if self._root is None:
            return [True] * len(keys)
        readable = []
        for key in keys:
            try:
                mode: int | None = os.lstat(os.path.join(self._root, key)).st_mode
            except (FileNotFoundError, NotADirectoryError):  # missing: tensorstore answers that itself
                mode = None
            except OSError as err:
                raise self._unavailable(f"cannot inspect the path of {key}", err) from err
            readable.append(mode is None or stat.S_ISREG(mode))
        refused = readable.count(False)
        if refused:
            with self._refused_lock:
                self.refused_paths += refused
        return readable

    # ---- the backend ------------------------------------------------------------------------
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        check_keys(keys)
        results = self._batched_reads(keys, "exists", byte_range=slice(0, 0))
        return [r is not None and r.state == "value" for r in results]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        check_keys(keys)
        return [r.value if r is not None and r.state == "value" else None for r in self._batched_reads(keys, "get")]

    def put_if_absent(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        keys = check_items(items)
        self._check_root()
        # A path that is there but no regular file (a FIFO, a directory) is never written through: the key is
        # taken (False), counted in refused_paths, and the other items are written as usual.
        writable = self._readable(keys)
        futures = [self._kv.write(key, value, if_equal=NO_VALUE_GENERATION)
                   for (key, value), ok in zip(items, writable) if ok]
        # A conditional write that found a value returns the empty ("unknown") generation.
        stamps = iter(self._wait(futures, "put"))
        return [bool(next(stamps).generation) if ok else False for ok in writable]

    def delete_many(self, keys: Sequence[str]) -> int:
        held = self.exists_many(keys)
        present = [key for key, there in zip(keys, held) if there]
        self._wait([self._kv.write(key, None) for key in present], "delete")
        return len(present)

    def list_keys(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        self._check_root()
        return self._list(prefix)[0]

    def _list(self, prefix: str) -> tuple[list[str], int]:
        """The keys under ``prefix``, sorted, and how many names there are no key (not ASCII, or
        not of the key syntax: files a file store's root holds that easykv never wrote)."""
        key_range = ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=_prefix_end(prefix))
        (names,) = self._wait([self._kv.list(key_range)], "list")
        keys = [name.decode("ascii") for name in names if name.isascii()]
        keys = [key for key in keys if key_problem(key, prefix=False) is None]
        return sorted(keys), len(names) - len(keys)

    def stats(self, prefix: str = "") -> StoreStats:
        check_prefix(prefix)
        entries, foreign = self._entries(prefix)
        times = [t for _, _, t in entries if t is not None]
        return StoreStats(entries=len(entries), bytes=sum(size for _, size, _ in entries),
                            oldest=min(times) if times else None, newest=max(times) if times else None,
                            foreign_entries=foreign)

    def _entries(self, prefix: str) -> tuple[list[tuple[str, int, float | None]], int]:
        """``(key, bytes, modification time or None)`` of every easykv value under ``prefix``, and
        how many other names are there (`StoreStats.foreign_entries`)."""
        self._check_root()
        names, foreign = self._list(prefix)
        keys = [key for key in names if is_store_key(key)]
        foreign += len(names) - len(keys)
        if self._has_file_times:
            entries = self._file_entries(keys)
            return entries, foreign + len(keys) - len(entries)
        out: list[tuple[str, int, float | None]] = []
        for start in range(0, len(keys), _STATS_CHUNK):  # bounded memory: a chunk of values at a time
            chunk = keys[start:start + _STATS_CHUNK]
            values = self.get_many(chunk)
            out += [(key, len(value), None) for key, value in zip(chunk, values) if value is not None]
        return out, foreign

    def _file_entries(self, keys: Sequence[str]) -> list[tuple[str, int, float | None]]:
        """The regular files among ``keys``; a link, directory or FIFO is no value (never followed)."""
        assert self._root is not None  # a file store has a root (parse_store_url)
        out: list[tuple[str, int, float | None]] = []
        for key in keys:
            try:
                info = os.lstat(os.path.join(self._root, key))
            except FileNotFoundError:  # deleted since the listing (another gc, a wipe): not there
                continue
            except OSError as err:
                raise self._unavailable(f"cannot read the size of {key}", err) from err
            if stat.S_ISREG(info.st_mode):
                out.append((key, info.st_size, info.st_mtime))
        return out

    def gc(self, max_bytes: int, prefix: str = "") -> GcResult:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes!r} must be an int >= 0 (the bytes to keep)")
        check_prefix(prefix)
        if not self._has_file_times:
            raise ValueError(f"store {self.url}: gc orders values by modification time, which only a file:// store "
                             "keeps; delete keys with delete_many, or use a file:///abs/dir store")
        found, foreign = self._entries(prefix)
        entries = sorted(found, key=lambda e: (e[2] or 0.0, e[0]))
        kept_bytes = sum(size for _, size, _ in entries)
        doomed: list[tuple[str, int]] = []
        for key, size, _ in entries:  # oldest first
            if kept_bytes <= max_bytes:
                break
            doomed.append((key, size))
            kept_bytes -= size
        self._wait([self._kv.write(key, None) for key, _ in doomed], "gc delete")
        removed_bytes = sum(size for _, size in doomed)
        return GcResult(removed_entries=len(doomed), removed_bytes=removed_bytes,
                               kept_entries=len(entries) - len(doomed), kept_bytes=kept_bytes, foreign_entries=foreign)

    def close(self) -> None:
        self._kv = _Closed(self.url)


def _prefix_end(prefix: str) -> str:
    """The smallest string above every string starting with ``prefix`` ("" when none is)."""
    while prefix and prefix[-1] == "\x7f":
        prefix = prefix[:-1]
    return prefix[:-1] + chr(ord(prefix[-1]) + 1) if prefix else ""


class _Closed:
    """Stands in for the kvstore after close(): any call says the backend was closed."""

    def __init__(self, url: str):
        self._url = url

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"store {self._url} was closed; open it again with open_backend(url)")


__all__ = ["NO_VALUE_GENERATION", "TensorstoreBackend"]
