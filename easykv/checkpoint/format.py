"""The on-disk format of easykv checkpoints, and reading it back (used by checkpointer.py,
restore.py and inspect.py; users call `easykv.checkpoint.checkpointer`).

    DIR/easykv_checkpoint.json        marker: this directory holds easykv checkpoints (only its
                                      presence is read; a link or FIFO in its place is damage)
    DIR/.easykv-writer-<i>.lock       the writer lock of process index i: a `CacheCheckpointer`
                                      holds an exclusive flock on it from construction to close
                                      (its text names the holder: pid, host, since when); see
                                      `easykv.checkpoint.writer`. Readers take no lock.
    DIR/<step>/pages/                 every layer's pages (+ quantization scales), an orbax PyTree:
                                      one zarr array per page array, one chunk file per shard,
                                      no compression (K/V pages do not compress), plus orbax's own
                                      _METADATA, _sharding, .zarray and array_metadatas files
    DIR/<step>/_CHECKPOINT_METADATA   orbax's step metadata (timestamps, handler names)
    DIR/<step>/easykv/checkpoint.json the record: format version (2), cache metadata, storage and
                                      mesh saved with, per-array name / path / role / shape /
                                      stored dtype / bytes / fingerprint, the fingerprint
                                      algorithm, the page-manager summary, the extra metadata,
                                      ``manager_sha256`` (sha256 of manager.json's bytes, or null
                                      when no manager was saved) and ``record_sha256`` (sha256 of
                                      the record's own canonical content; `checkpoint_record`)
    DIR/<step>/easykv/manager.json    the PageManager's state_dict, when a manager was saved

Every persisted byte that a restore uses is verified: page arrays by their fingerprints
(`checkpoint_integrity`), the two JSON files by their sha256 and a strict schema
(`checkpoint_record`), and each array's zarr metadata, orbax's ``_METADATA`` and the chunk files
by the reader (`easykv.checkpoint.stored_files`: compared field by field with what the record
implies; `easykv.checkpoint.reader`: regular files of one chunk each, read through the
descriptor they were checked on). orbax's other files need no hash of their own: the reader does
not use them, and damage there either makes orbax's own read fail or leaves easykv's unaffected.
Format version 1 (easykv 0.1, no JSON hashes) still restores, with a warning.

Array names (and PyTree paths): ``group_000.key_pages`` for the plain stacked pages of layer
group 0 (``(layers, heads, pages, page_size, head_dim)``), ``group_000.key_pages.values`` /
``.scales`` for quantized ones; format versions 1-2 held one array per layer
(``layer_007.key_pages``) and restore by stacking them.

A step directory appears only once orbax has committed it (written under
``<step>.orbax-checkpoint-tmp-*`` and renamed, or marked with a commit file on object stores),
so a listing of finalized steps never includes an interrupted save.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from easykv.checked_files import open_regular
from easykv.checkpoint.integrity import PendingFingerprints
from easykv.checkpoint.orbax_types import CheckpointDir, EPath, OrbaxManager, OrbaxPyTreeHandler
from easykv.checkpoint.record import (
    FORMAT,
    FORMAT_VERSION,
    MANAGER_FILE,
    RECORD_FILE,
    STATE_ITEM,
    expected_leaves,
    is_stacked,
    layer_key,
    read_manager_state,
    read_record,
    refused,
    saved_metadata,
    seal,
)
from easykv.errors import CheckpointIntegrityError, FileRefusedError, NotACheckpointError, StepNotFoundError
from easykv.validation import integer, show

MARKER_FILE = "easykv_checkpoint.json"
PAGES_ITEM = "pages"
# Per-array zarr saves ~1.8x faster than OCDBT on local disks (measured, 1 GiB pool); orbax
# reads either, so changing this keeps old checkpoints readable.
USE_OCDBT = False


# ---- the orbax handler of the JSON record -----------------------------------------------------
# The ignores on these three classes: orbax ships no types, so its base classes are Any (orbax_types).
class _StateHandler(ocp.handlers.AsyncCheckpointHandler):  # type: ignore[misc, no-any-unimported]
    """Writes ``easykv/checkpoint.json`` (+ ``manager.json``) once the fingerprints are done;
    orbax commits the step only after this and the pages are written."""

    async def async_save(self, directory: EPath, args: _StateSave) -> list[Any]:
        return [ocp.future.CommitFutureAwaitingContractedSignals(self._write(directory, args), name="easykv_state")]

    async def _write(self, directory: EPath, args: _StateSave) -> None:
        record = dict(args.record)
        record["arrays"] = [dict(e) for e in record["arrays"]]
        if args.fingerprints is not None:
            digests = args.fingerprints.result()
            for entry, digest in zip(record["arrays"], digests):
                entry["fingerprint"] = digest
        record_bytes, manager_bytes = seal(record, args.manager_state)
        if jax.process_index() == 0:
            directory = epath.Path(directory)
            if manager_bytes is not None:  # before the record, which vouches for it
                (directory / MANAGER_FILE).write_bytes(manager_bytes)
            (directory / RECORD_FILE).write_bytes(record_bytes)

    def save(self, directory: EPath, args: _StateSave) -> None:
        async def run() -> None:
            for f in await self.async_save(directory, args):
                f.result()

        asyncio.run(run())

    def restore(self, directory: EPath, args: Any = None) -> dict[str, Any]:
        # orbax's generic path (easykv itself calls `read_record`): the same checked read and verification.
        step_dir = epath.Path(directory).parent
        if not step_dir.name.isdigit():
            raise CheckpointIntegrityError(f"{directory} is not the {STATE_ITEM} item of a step directory (<step>/"
                                           f"{STATE_ITEM}); restore a finalized step")
        return read_record(step_dir.parent, int(step_dir.name))


@ocp.args.register_with_handler(_StateHandler, for_save=True)
@dataclasses.dataclass
class _StateSave(ocp.args.CheckpointArgs):  # type: ignore[misc, no-any-unimported]
    record: dict[str, Any]
    manager_state: dict[str, Any] | None
    fingerprints: PendingFingerprints | None


# Never built by easykv, but needed: orbax's CheckpointManager looks up a restore-args class for
# every item it finds in a step (saving, listing and inspecting fail with "no handler" without it).
@ocp.args.register_with_handler(_StateHandler, for_restore=True)
@dataclasses.dataclass
class _StateRestore(ocp.args.CheckpointArgs):  # type: ignore[misc, no-any-unimported]
    pass


def _pages_handler() -> OrbaxPyTreeHandler:
    """orbax's PyTree handler for the pages, remembering the commit futures of its last save.
    orbax waits on a step's items in name order and stops at the first failure ("easykv" sorts
    before "pages"), so after a failed state write the page files may still be landing;
    `drain_pages` waits for them, so the writer lock is never released (and no next writer
    clears the directory) while they do. (orbax checks a handler's exact class against its args
    registry, hence a wrapped method rather than a subclass.)"""
    handler = ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=USE_OCDBT)
    save = handler.async_save
    handler.easykv_pending = []

    async def async_save(directory: EPath, *args: Any, **kwargs: Any) -> Any:
        futures = await save(directory, *args, **kwargs)
        handler.easykv_pending = list(futures or ())
        return futures

    handler.async_save = async_save
    return handler


def drain_pages(mngr: OrbaxManager) -> None:
    """After a failed save: wait until the page files of that save are written (or failed)."""
    handler = mngr.easykv_pages_handler  # every manager comes from orbax_manager
    pending, handler.easykv_pending = handler.easykv_pending, []
    for f in pending:
        try:
            f.result()
        except Exception:  # noqa: BLE001  the step already failed; its first error is the one raised
            pass


def orbax_manager(directory: EPath, *, read_only: bool, max_to_keep: int | None = None,
                  enable_async: bool = False) -> OrbaxManager:
    """An orbax CheckpointManager over ``directory`` with easykv's two items. A writer's also
    removes temporary directories that interrupted saves left behind: build one only while
    holding the directory's writer lock (`checkpoint_writer`)."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=not read_only, read_only=read_only,
        enable_async_checkpointing=enable_async, cleanup_tmp_directories=not read_only,
    )
    pages = _pages_handler()
    mngr = ocp.CheckpointManager(directory, options=options, item_handlers={PAGES_ITEM: pages,
                                                                             STATE_ITEM: _StateHandler()})
    mngr.easykv_pages_handler = pages  # for drain_pages
    return mngr


def check_step(step: object) -> int:
    return integer("step", step, lo=0, hi=None, hint="a checkpoint step number")


# ---- finding and reading steps -------------------------------------------------------------------
def marker_present(directory: EPath) -> bool:
    """Whether ``directory`` holds the marker of an easykv checkpoint directory. Only its presence
    is read, but a link, FIFO or device in its place is not the file easykv wrote: it is checked on
    the descriptor of one non-blocking open (`easykv.checked_files`), and refused as damage.

    Raises:
      CheckpointIntegrityError: the marker is not a regular file, or cannot be opened."""
    path = directory / MARKER_FILE
    text = os.fspath(path)
    try:
        if "://" in text:  # an object store holds no links, FIFOs or devices
            present: bool = path.exists()
            return present
        with open_regular(text, follow_links=False):
            return True
    except FileNotFoundError:
        return False
    except FileRefusedError as err:
        why = refused(text, err, "not the regular file easykv writes as the marker of a checkpoint directory")
        raise CheckpointIntegrityError(f"{why}; remove it, or replace it with a regular file, to use the "
                                       "directory", directory=str(directory)) from err
    except OSError as err:
        raise CheckpointIntegrityError(f"{path} cannot be opened ({err})", directory=str(directory)) from err


def check_not_foreign(directory: EPath) -> None:
    """Refuse a directory that holds orbax steps which are not easykv checkpoints."""
    if marker_present(directory):
        return
    for child in directory.iterdir():
        if child.name.isdigit() and child.is_dir() and not (child / STATE_ITEM / RECORD_FILE).exists():
            raise NotACheckpointError(
                f"{directory} holds step directories (e.g. {child.name}) that are not easykv checkpoints (no "
                f"{MARKER_FILE}, no {STATE_ITEM}/{RECORD_FILE}); use another directory for the cache")


# Platforms whose page storage restore knows (see pages.storage_dtype: raw bits on CPU only).
STORAGE_PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")


def checkpoint_path(directory: object) -> EPath:
    """A checkpoint directory argument (a str, a path, or an epath for object stores)."""
    if isinstance(directory, (str, os.PathLike, epath.Path)) and str(directory):
        return epath.Path(directory)
    raise ValueError(f"a checkpoint directory must be a path (str or os.PathLike), got {show(directory)}")


def check_directory(directory: EPath) -> None:
    """NotACheckpointError unless ``directory`` is an existing directory."""
    try:
        exists, is_dir = directory.exists(), directory.is_dir()
    except OSError as err:
        raise _unlistable(directory, err) from err
    if not exists:
        raise NotACheckpointError(f"no checkpoint at {directory}: the directory does not exist")
    if not is_dir:
        raise NotACheckpointError(f"{directory} is a file, not a checkpoint directory")


def complete_steps(directory: EPath, marker: bool) -> tuple[list[int], list[str]]:
    """(complete steps, ascending; the temporary directories of interrupted saves) of an existing
    directory. With the ``marker`` every finalized orbax step is easykv's (a damaged one is
    reported when read); without it, those holding an easykv record, and NotACheckpointError
    when there is none."""
    try:
        steps = sorted(int(s) for s in ocp.step.checkpoint_steps(directory))  # finalized steps only
        easykv_steps = [s for s in steps if (directory / str(s) / STATE_ITEM / RECORD_FILE).exists()]
        partial = sorted(str(p) for p in ocp.step.tmp_checkpoints(directory))
    except OSError as err:
        raise _unlistable(directory, err) from err
    if not marker and not easykv_steps:
        what = f"orbax steps {steps} without an {STATE_ITEM}/{RECORD_FILE}" if steps else "no step directories"
        raise NotACheckpointError(
            f"{directory} is not an easykv checkpoint: no {MARKER_FILE} and {what}; pass the directory "
            "given to save_cache / CacheCheckpointer")
    return (steps if marker else easykv_steps), partial


def _unlistable(directory: EPath, err: OSError) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(f"the checkpoint directory {directory} cannot be listed ({type(err).__name__}: "
                                    f"{err}); check its permissions and file system", directory=str(directory))


def resolve_step(directory: EPath, step: int | None) -> tuple[int, list[int]]:
    """(the step to read: ``step``, or the latest complete one when None; every complete step).

    Raises:
      NotACheckpointError: ``directory`` is missing, a file, or no easykv checkpoint.
      StepNotFoundError: ``step`` (or any step, when None) is not complete there.
      CheckpointIntegrityError: its marker is damaged, or the directory cannot be listed."""
    check_directory(directory)
    complete, partial = complete_steps(directory, marker_present(directory))
    note = f" ({len(partial)} interrupted save(s) left temporary directories: {partial[:3]})" if partial else ""
    if step is None:
        if not complete:
            raise StepNotFoundError(f"{directory} holds no complete step{note}", available=[])
        return complete[-1], complete
    step = check_step(step)
    if step not in complete:
        raise StepNotFoundError(
            f"step {step} is not a complete checkpoint in {directory}; available steps: {complete}{note}",
            step=step, available=complete)
    return step, complete


def check_fingerprints(record: Mapping[str, Any], got: list[str], step: int, directory: EPath) -> None:
    """Compare each array's fingerprint as read (``got``, in the record's order) with the
    (schema-checked) record; CheckpointIntegrityError names the first damaged array (and
    counts the others)."""
    bad = [(e, g) for e, g in zip(record["arrays"], got) if e["fingerprint"] != g]
    if bad:
        entry, digest = bad[0]
        more = f" (and {len(bad) - 1} more: {[e['name'] for e, _ in bad[1:4]]})" if len(bad) > 1 else ""
        raise CheckpointIntegrityError(
            f"array {entry['name']} of step {step} in {directory} does not match the fingerprint recorded at save "
            f"time (saved {entry['fingerprint']}, read {digest}){more}: its data file is damaged — restore "
            "another step", array=entry["name"], step=step, directory=str(directory))


def fingerprint_grid(record: Mapping[str, Any]) -> int:
    """The cell grid of a step's arrays: (layer, head, page) for stacked ones, (head, page) before."""
    return 3 if is_stacked(record["format_version"]) else 2


def list_steps(directory: CheckpointDir) -> list[int]:
    """Complete steps of an easykv checkpoint directory, ascending.

    Args:
      directory: the checkpoint directory (a str, an ``os.PathLike`` or an epath).

    Raises:
      NotACheckpointError: ``directory`` is missing, a file, or no easykv checkpoint.
      StepNotFoundError: it holds no complete step.
      CheckpointIntegrityError: its marker is not a regular file, or it cannot be listed.
    """
    return resolve_step(checkpoint_path(directory), None)[1]


__all__ = [
    "STORAGE_PLATFORMS", "checkpoint_path",
    "FORMAT", "FORMAT_VERSION", "MANAGER_FILE", "MARKER_FILE", "PAGES_ITEM", "RECORD_FILE", "STATE_ITEM",
    "check_directory", "check_fingerprints", "check_not_foreign", "check_step", "complete_steps", "expected_leaves",
    "fingerprint_grid", "layer_key", "list_steps", "marker_present", "orbax_manager", "read_manager_state",
    "read_record", "resolve_step", "saved_metadata",
]
