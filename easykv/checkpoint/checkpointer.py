"""Checkpoint and restore of a paged cache with orbax: atomic, verified, reshardable.

    step = easykv.save_cache(path, cache, manager)                   # blocking
    with easykv.CacheCheckpointer(path, max_to_keep=3) as ckpt:     # async, keeps the last 3
        ckpt.save(cache, manager, step=100)   # returns once the pages are snapshotted
        cache, _ = cache.write(...)           # donating right away is safe
    restored = easykv.restore_cache(path, mesh=other_mesh, partition_manager=pm)
    cache, manager = restored                 # also .metadata, .step, .extra_metadata

Layout on disk: see `easykv.checkpoint.format` (pages as an orbax PyTree, a JSON record with
the metadata, storage, mesh and fingerprints, the PageManager state, and the writer locks).

Atomicity is orbax's: a step is written under ``<step>.orbax-checkpoint-tmp-*`` and renamed
(or marked with a commit file on object stores) only after every array and both JSON files
are written, so a crash or kill mid-save leaves a temporary directory that is ignored (and
removed by the next writer), never a step that looks complete. An async save returns once the
data are snapshotted (on GPU/TPU: copied to host; on CPU: zero-copy views that make a later
donation copy instead of overwrite) and the fingerprints are started; the write, the
fingerprints and the commit finish in the background. A process that exits cleanly first
finishes its saves.

A save never writes what a restore refuses (`easykv.checkpoint.save_checks`): before anything
is written -- in the call, also for an async save -- every page and scale array must sit where
the cache's layout puts it (mesh, devices, partition spec), and the record the save would write
must pass the check a restore runs; otherwise ``ValueError`` names the array (or field), where
it sits, where it must sit and the fix, and nothing is written.

One writer per directory: a `CacheCheckpointer` (and so `save_cache`) holds the directory's
writer lock from construction to `close` (`easykv.checkpoint.writer`); a second writer, in
this process or another, gets `CheckpointLockedError` and changes nothing. A write that fails
(disk full, file too large, permission, I/O) raises `CheckpointWriteError` naming the step,
the directory and the errno — from `save` when synchronous, else from the next `save`,
`wait_until_finished` or `close`; the failed step is never listed and earlier steps stay
intact.

Verification: every persisted byte a restore uses is checked (array fingerprints, the sha256
of the record and of the manager state, a strict schema of the record, and each array orbax
hands back); damage raises `CheckpointIntegrityError`, never returns as data.

Stored bits: pages are saved as stored (bf16 as raw uint16 on CPU, as bf16 on GPU/TPU; fp8 as
uint8 / float8), with the logical dtype and the stored dtype recorded; restore bitcasts to the
target platform's storage, so the bits are identical across backends.

Restore (`easykv.checkpoint.restore`, re-exported here) may target another mesh or partition
rule: the layout fields of the metadata are rebuilt for the target mesh, the pool size stays,
and each device's shard is read straight into its device buffer (`easykv.checkpoint.reader`).
Another dtype or quantizer is refused unless ``convert=True`` (dequantize and re-encode every
page; lossy when the target is coarser). Errors: `NotACheckpointError`,
`StepNotFoundError`, `CheckpointMismatchError` (ValueError), `CheckpointIntegrityError`,
`CheckpointLockedError`, `CheckpointWriteError` (all `CheckpointError`); nothing is restored (and
no live cache is touched) when one is raised.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import json
import math
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Concatenate, ParamSpec, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from easykv.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    MARKER_FILE,
    PAGES_ITEM,
    STATE_ITEM,
    _StateSave,
    check_not_foreign,
    check_step,
    checkpoint_path,
    drain_pages,
    list_steps,
    orbax_manager,
)
from easykv.checkpoint.integrity import FINGERPRINT_ALGORITHM, PendingFingerprints
from easykv.checkpoint.orbax_types import CheckpointDir, OrbaxManager
from easykv.checkpoint.record import EXTRA_MAX_DEPTH, leaf_role, nest, page_leaves
from easykv.checkpoint.restore import RestoredCache, restore_cache
from easykv.checkpoint.save_checks import check_placement, check_record_to_write
from easykv.checkpoint.writer import WriterLock, write_error
from easykv.errors import (
    CheckpointError,
    NotACheckpointError,
)
from easykv.manager.manager import PageManager
from easykv.manager.state import summarize_state
from easykv.sharding import PartitionManager
from easykv.spec.metadata import PagedAttentionCacheMetaData, known_dtype
from easykv.storage.cache import PagedAttentionCache
from easykv.validation import boolean, optional_int, parse_json


# ---- what is saved ----------------------------------------------------------------------------
def _cache_arrays(cache: PagedAttentionCache) -> tuple[dict[str, Any], list[tuple[str, tuple[str, ...], Any, str]]]:
    """The PyTree orbax saves and its leaves as (name, path, array, role), in the record's order."""
    leaves = page_leaves(list(zip(cache.key_pages, cache.value_pages)))
    return nest((path, arr) for _, path, arr in leaves), [(n, p, a, leaf_role(p)) for n, p, a in leaves]


def _platform(cache: PagedAttentionCache) -> str:
    leaf = jax.tree.leaves(cache)[0]
    platform: str = next(iter(leaf.sharding.device_set)).platform
    return platform


def _mesh_record(cache: PagedAttentionCache) -> dict[str, Any]:
    layout = cache.layout
    leaf = jax.tree.leaves(cache)[0]
    devices = list(leaf.sharding.device_set)
    out: dict[str, Any] = {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "num_devices": len(devices),
        "process_count": jax.process_count(),
    }
    if layout is not None:
        out.update(axis_names=list(layout.mesh.axis_names), shape={k: int(v) for k, v in layout.mesh.shape.items()},
                   kv_head_mesh_axes=list(layout.head_axes), page_mesh_axes=list(layout.page_axes))
    return out


def _check_manager(manager: Any, meta: PagedAttentionCacheMetaData) -> dict[str, Any]:
    if not isinstance(manager, PageManager):
        raise ValueError(f"manager must be the PageManager that schedules this cache, got {type(manager).__name__}")
    mmeta = manager.metadata
    fields = ("batch_size", "num_pages_per_layer", "page_size", "max_sequences", "page_shards")
    diff = [f"{f}: cache {getattr(meta, f)}, manager {getattr(mmeta, f, None)}" for f in fields
            if getattr(mmeta, f, None) != getattr(meta, f)]
    # The kind's value, not the enum: the message shows ('sliding', 6, 16) as it always did.
    pools = [(g.attention.value, g.window, g.num_pages) for g in meta.groups]
    theirs = [(g.attention.value, g.window, g.num_pages) for g in mmeta.groups]
    if pools != theirs:
        diff.append(f"layer groups (attention, window, pages): cache {pools}, manager {theirs}")
    if diff:
        raise ValueError("the manager was built for another pool (" + "; ".join(diff) + "); save a cache "
                         "with the manager that schedules it")
    # A restore holds the state to these rules: a manager breaking them is refused before anything is written.
    # (Called through _checked_input: stacklevel 4 below is save_cache's caller.)
    manager.check_invariants()
    state = manager.state_dict()  # refuses swapped-out sequences and pending host transfers
    host = getattr(manager, "metrics", None)
    host = getattr(host, "host", None)
    if host is not None and host.cached_pages:
        warnings.warn(f"the checkpoint leaves out the host-memory tier: its {host.cached_pages} cached prefix pages "
                      "are not saved (the restored manager starts with an empty host tier)", stacklevel=4)
    try:
        json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"manager.state_dict() is not JSON-safe: {err}") from err
    if summarize_state(state) is None:
        raise ValueError("manager.state_dict() is not a PageManager state (no sequences / pool to summarize); "
                         "save the PageManager that schedules this cache")
    return state


def _check_extra(extra: Any) -> dict[str, Any]:
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"extra_metadata must be a dict of JSON-safe values, got {type(extra).__name__}")
    try:
        text = json.dumps(dict(extra), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as err:
        raise ValueError(f"extra_metadata is not JSON-safe ({err}); keep to str/int/float/bool/None/list/dict") from err
    # What is saved must read back, and read back the same: restore parses with a nesting limit,
    # and JSON would turn int keys into strings and tuples into lists without a word.
    back: dict[str, Any] = parse_json(text, what="extra_metadata", max_depth=EXTRA_MAX_DEPTH)
    if back != extra or not _same_types(back, extra):
        raise ValueError("extra_metadata would not read back unchanged from JSON (keys must be str, sequences "
                         "lists, numbers finite); pass it in that form")
    return back


def _same_types(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, Mapping) and all(_same_types(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and all(_same_types(x, y) for x, y in zip(a, b))
    return type(a) is type(b)


def _checked_input(cache: Any, manager: Any, extra_metadata: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(extra metadata, manager state or None) of a save, once every argument that does not
    depend on the directory is checked: the cache is one, on its layout (`check_placement`),
    ``extra_metadata`` JSON-safe and ``manager`` the cache's. Reads no array data."""
    if not isinstance(cache, PagedAttentionCache):
        raise ValueError(f"cache must be a PagedAttentionCache, got {type(cache).__name__}")
    check_placement(cache)
    extra = _check_extra(extra_metadata)
    manager_state = _check_manager(manager, cache.metadata) if manager is not None else None
    return extra, manager_state


def _record(cache: PagedAttentionCache, leaves: list[tuple[str, tuple[str, ...], Any, str]], step: int,
            manager_state: dict[str, Any] | None, extra: dict[str, Any], integrity: bool) -> dict[str, Any]:
    """The record of ``step`` before the writer adds the fingerprints and seals (`record.seal`)."""
    meta = cache.metadata
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "easykv_version": _easykv_version(),
        "step": step,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "metadata": meta.to_dict(),
        "storage": {"platform": _platform(cache), "logical_dtype": known_dtype(meta.dtype).name,
                    "quantization": meta.quantization},
        "mesh": _mesh_record(cache),
        "arrays": [
            {"name": name, "path": list(path), "role": role, "shape": [int(d) for d in arr.shape],
             "stored_dtype": np.dtype(arr.dtype).name,
             "nbytes": int(math.prod(arr.shape) * np.dtype(arr.dtype).itemsize),
             "fingerprint": None}
            for name, path, arr, role in leaves
        ],
        "fingerprint_algorithm": FINGERPRINT_ALGORITHM if integrity else None,
        "manager": summarize_state(manager_state) if manager_state is not None else None,
        "extra_metadata": extra,
        # manager_sha256 and record_sha256 are added by the writer (checkpoint_record.seal)
    }


# ---- the checkpointer ---------------------------------------------------------------------------
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _one_call_at_a_time(method: Callable[Concatenate[CacheCheckpointer, _P], _R]
                        ) -> Callable[Concatenate[CacheCheckpointer, _P], _R]:
    @functools.wraps(method)
    def serialized(self: CacheCheckpointer, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._calls:
            return method(self, *args, **kwargs)

    return serialized


_LIVE: weakref.WeakSet[CacheCheckpointer] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def _finish_all_at_exit() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for ckpt in live:
        try:
            ckpt.wait_until_finished()
        except Exception:  # noqa: BLE001  an exit must not hang on one bad save
            pass


# A clean exit finishes pending saves. Python shuts the concurrent.futures executors down at
# threading shutdown, before `atexit` callbacks run and while orbax's commit thread still needs
# them (the save would then fail and leave only its temporary directory). Hooks registered with
# threading._register_atexit run in reverse order of registration, so this one, registered after
# concurrent.futures was imported (by orbax above), runs first.
try:
    threading._register_atexit(_finish_all_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover  other Pythons
    atexit.register(_finish_all_at_exit)


class CacheCheckpointer:
    """Saves a cache (+ its PageManager) into numbered steps of ``directory``.

    The checkpointer is the directory's one writer from construction to `close` (or until it is
    garbage collected, or its process ends): another writer gets `CheckpointLockedError`.
    A failed write raises `CheckpointWriteError` (see the module doc).

    Args:
      directory: the checkpoint directory: a str, an ``os.PathLike``, or an epath for object
        stores; created when missing. A file, or a directory of other orbax steps, is refused
        (`NotACheckpointError`).
      max_to_keep: keep the last this many steps (>= 1), deleting older ones; None (default): all.
      async_save: `save` returns once the data are snapshotted and the write finishes in the
        background (`wait_until_finished`, `close`, or a clean exit); default True.
      integrity: fingerprint every array (default True); False skips the fingerprints, and
        restore cannot then verify the pages.
    """

    def __init__(self, directory: CheckpointDir, *, max_to_keep: int | None = None, async_save: bool = True,
                 integrity: bool = True):
        max_to_keep = optional_int("max_to_keep", max_to_keep, lo=1, hi=None, hint="None keeps every step")
        async_save, integrity = boolean("async_save", async_save), boolean("integrity", integrity)
        self.directory = checkpoint_path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise NotACheckpointError(f"{self.directory} is a file, not a checkpoint directory")
        if self.directory.is_dir():
            check_not_foreign(self.directory)
        self.max_to_keep = max_to_keep
        self.async_save = async_save
        self.integrity = integrity
        self._closed = True  # until the lock and orbax's manager are both held
        # One call at a time: two threads saving at once would write one temporary step twice.
        self._calls = threading.RLock()
        self._in_flight: int | None = None  # the step being written, for the error message
        # The lock first: orbax's manager deletes temporary directories (another writer's
        # unfinished steps) as soon as it is built.
        lock = WriterLock(self.directory, jax.process_index())
        try:
            self._mngr = orbax_manager(self.directory, read_only=False, max_to_keep=max_to_keep,
                                        enable_async=self.async_save)
        except BaseException as err:
            lock.release()
            if isinstance(err, Exception) and not isinstance(err, CheckpointError):
                raise write_error(err, step=None, directory=self.directory, doing="opening") from err
            raise
        self._lock = lock
        self._closed = False
        # Garbage collection or interpreter exit: finish the writes, then release the lock
        # (never while orbax still writes into the directory). Holds no reference to self.
        self._finalizer = weakref.finalize(self, _shut_down, self._mngr, lock)
        with _LIVE_LOCK:
            _LIVE.add(self)

    # ---- saving ------------------------------------------------------------------------------
    @_one_call_at_a_time
    def save(self, cache: PagedAttentionCache, manager: PageManager | None = None, *, step: int | None = None,
             extra_metadata: Mapping[str, Any] | None = None) -> int:
        """Save ``cache`` (and ``manager``'s state) as ``step``.

        Nothing is written when an argument is bad (checked in the call, before anything is written,
        also when async): a cache whose arrays sit off its layout, or whose record a restore
        would refuse, raises ValueError (`easykv.checkpoint.save_checks`). A failed write (this
        one when synchronous, else the previous one) raises `CheckpointWriteError`.

        Args:
          cache: the `PagedAttentionCache` to save: the one the last write returned (a donated one is
            refused), every array on the placement its layout gives it.
          manager: the `PageManager` that schedules ``cache`` (its state is saved; its host tier's
            cached pages are not); None (default): the pages only.
          step: a step number >= 0 not yet in the directory; None (default): the latest + 1, or 0.
          extra_metadata: a JSON-safe dict (str keys, lists, finite numbers) that reads back
            unchanged; restore returns it as ``extra_metadata``. None: ``{}``.

        Returns:
          the step saved.
        """
        self._check_open()
        extra, manager_state = _checked_input(cache, manager, extra_metadata)
        self._wait()  # one save at a time (orbax would wait here too); reports the last one's failure
        steps = self.all_steps()
        step = (steps[-1] + 1 if steps else 0) if step is None else check_step(step)
        if step in steps:
            raise ValueError(f"step {step} already exists in {self.directory} (steps {steps}); save under a new "
                             "step number or delete that one first")
        tree, leaves = _cache_arrays(cache)
        record = _record(cache, leaves, step, manager_state, extra, self.integrity)
        # Before the marker and orbax: a record a restore would refuse is never written.
        check_record_to_write(record, manager_saved=manager_state is not None, directory=self.directory)
        # Async: the checksums start once orbax has taken its snapshot (below), so the call returns at once.
        pending = (PendingFingerprints([arr for _, _, arr, _ in leaves], grid=3, start=not self.async_save)
                   if self.integrity else None)
        try:
            self._write_marker()
        except OSError as err:
            raise write_error(err, step=step, directory=self.directory) from err
        self._in_flight = step
        try:
            self._mngr.save(step, args=ocp.args.Composite(**{
                PAGES_ITEM: ocp.args.PyTreeSave(tree),
                STATE_ITEM: _StateSave(record=record, manager_state=manager_state, fingerprints=pending),
            }), force=True)
        except ocp.checkpoint_manager.StepAlreadyExistsError as err:  # a step from another writer
            self._in_flight = None
            raise ValueError(f"step {step} already exists in {self.directory}: {err}") from err
        except Exception as err:  # noqa: BLE001  orbax/tensorstore/OS errors of the write itself
            self._in_flight = None
            drain_pages(self._mngr)
            raise write_error(err, step=step, directory=self.directory) from err
        if pending is not None:
            pending.start()
        if not self.async_save:
            self._wait()
        return step

    @_one_call_at_a_time
    def wait_until_finished(self) -> None:
        """Block until every started save is committed; a failed one raises
        `CheckpointWriteError` (once)."""
        if not self._closed:
            self._wait()

    def _wait(self) -> None:
        try:
            self._mngr.wait_until_finished()
        except Exception as err:  # noqa: BLE001  the background write's failure, whatever its type
            step, self._in_flight = self._in_flight, None
            drain_pages(self._mngr)
            raise write_error(err, step=step, directory=self.directory) from err
        self._in_flight = None

    @_one_call_at_a_time
    def close(self) -> None:
        """Finish pending saves, release orbax's resources and the directory's writer lock
        (released even when the last save failed; that failure is raised)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wait()
        finally:
            self._finalizer()  # closes orbax's manager, then releases the lock
            with _LIVE_LOCK:
                _LIVE.discard(self)

    def __enter__(self) -> CacheCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- reading -----------------------------------------------------------------------------
    @_one_call_at_a_time
    def all_steps(self) -> list[int]:
        """Complete steps, ascending (interrupted or failed saves are not steps)."""
        self._check_open()
        self._mngr.reload()
        return sorted(int(s) for s in self._mngr.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, *, mesh: Mesh, partition_manager: PartitionManager | None = None, step: int | None = None,
                **kwargs: Any) -> RestoredCache:
        """`restore_cache` from this directory (waits for pending saves first).

        Args:
          mesh: the `jax.sharding.Mesh` to restore onto.
          partition_manager: the target's `PartitionManager` (None: the default rules).
          step: the step to restore; None (default): the latest complete one.
          **kwargs: `restore_cache`'s other keywords (``metadata``, ``dtype``, ``quantizer``,
            ``convert``, ``verify``, ``restore_manager``, ``storage_platform``).

        Returns:
          the `RestoredCache`.
        """
        self.wait_until_finished()
        return restore_cache(self.directory, mesh=mesh, partition_manager=partition_manager, step=step, **kwargs)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"this CacheCheckpointer of {self.directory} is closed; create a new one")

    def _write_marker(self) -> None:
        marker = self.directory / MARKER_FILE
        if jax.process_index() != 0 or marker.exists():
            return
        tmp = self.directory / f".{MARKER_FILE}.tmp"
        tmp.write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION}))
        tmp.rename(marker)

    def __repr__(self) -> str:
        return (f"CacheCheckpointer({str(self.directory)!r}, max_to_keep={self.max_to_keep}, "
                f"async_save={self.async_save})")


def _shut_down(mngr: OrbaxManager, lock: WriterLock) -> None:
    """Finish orbax's writes, close its manager, release the writer lock (the finalizer of a
    CacheCheckpointer; `close` has already reported any failure)."""
    try:
        for finish in (mngr.wait_until_finished, mngr.close):
            try:
                finish()
            except Exception:  # noqa: BLE001  reported by close(); a finalizer must not raise
                pass
    finally:
        lock.release()


def _easykv_version() -> str:
    import easykv

    return getattr(easykv, "__version__", "unknown")


def save_cache(directory: CheckpointDir, cache: PagedAttentionCache, manager: PageManager | None = None, *,
               step: int | None = None, extra_metadata: Mapping[str, Any] | None = None, integrity: bool = True) -> int:
    """Save ``cache`` (and the PageManager ``manager``) as ``step`` of ``directory`` and wait
    until it is committed (a `CacheCheckpointer` with ``async_save=False``, closed on return).

    Args:
      directory: the checkpoint directory (a str, an ``os.PathLike`` or an epath), created when
        missing; nothing is created when ``cache``, ``manager`` or ``extra_metadata`` is bad.
      cache: the `PagedAttentionCache` to save, every array on the placement its layout gives it
        (ValueError otherwise: `easykv.checkpoint.save_checks`).
      manager: the `PageManager` that schedules ``cache``; None (default): the pages only.
      step: a step number >= 0 not yet in the directory; None (default): the latest step + 1
        (0 in a new directory).
      extra_metadata: a JSON-safe dict returned by restore (`CacheCheckpointer.save`'s).
      integrity: fingerprint every array (default True); False: restore cannot verify the pages.

    Returns:
      the step saved.
    """
    # Everything but the step's number is checked before the directory is created.
    path, integrity = checkpoint_path(directory), boolean("integrity", integrity)
    extra, manager_state = _checked_input(cache, manager, extra_metadata)
    probe_step = 0 if step is None else check_step(step)
    check_record_to_write(_record(cache, _cache_arrays(cache)[1], probe_step, manager_state, extra, integrity),
                          manager_saved=manager_state is not None, directory=path)
    with CacheCheckpointer(path, async_save=False, integrity=integrity) as ckpt:
        return ckpt.save(cache, manager, step=step, extra_metadata=extra_metadata)


__all__ = [
    "CacheCheckpointer",
    "FORMAT_VERSION",
    "RestoredCache",
    "list_steps",
    "restore_cache",
    "save_cache",
]
