"""The on-disk format of easykv checkpoints, and reading it back (used by checkpoint.py and
inspect.py; users call `easykv.checkpoint`).

    DIR/easykv_checkpoint.json        marker: this directory holds easykv checkpoints
    DIR/<step>/pages/                 every layer's pages (+ quantization scales), an orbax PyTree:
                                      one zarr array per page array, one chunk file per shard,
                                      no compression (K/V pages do not compress)
    DIR/<step>/easykv/checkpoint.json format version, cache metadata, storage and mesh saved
                                      with, per-array name / shape / stored dtype / fingerprint,
                                      the page-manager summary and the extra metadata
    DIR/<step>/easykv/manager.json    the PageManager's state_dict, when a manager was saved

Array names (and PyTree paths): ``layer_007.key_pages`` for plain pages,
``layer_007.key_pages.values`` / ``.scales`` for quantized ones.

A step directory appears only once orbax has committed it (written under
``<step>.orbax-checkpoint-tmp-*`` and renamed, or marked with a commit file on object stores),
so a listing of finalized steps never includes an interrupted save.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from easykv.checkpoint_integrity import (
    FINGERPRINT_ALGORITHM,
    CheckpointIntegrityError,
    CheckpointMismatchError,
    NotACheckpointError,
    PendingFingerprints,
    StepNotFoundError,
    fingerprints,
)
from easykv.checkpoint_reshard import stored_template
from easykv.metadata import PagedAttentionCacheMetaData
from easykv.quantization import QuantizedPages
from easykv.serialization import SerializationError

FORMAT = "easykv.checkpoint"
FORMAT_VERSION = 1
MARKER_FILE = "easykv_checkpoint.json"
PAGES_ITEM = "pages"
STATE_ITEM = "easykv"
RECORD_FILE = "checkpoint.json"
MANAGER_FILE = "manager.json"
# Per-array zarr saves ~1.8x faster than OCDBT on local disks (measured, 1 GiB pool); orbax
# reads either, so changing this keeps old checkpoints readable.
USE_OCDBT = False


# ---- the orbax handler of the JSON record -----------------------------------------------------
class _StateHandler(ocp.handlers.AsyncCheckpointHandler):
    """Writes ``easykv/checkpoint.json`` (+ ``manager.json``) once the fingerprints are done;
    orbax commits the step only after this and the pages are written."""

    async def async_save(self, directory: epath.Path, args: _StateSave) -> list[Any]:
        return [ocp.future.CommitFutureAwaitingContractedSignals(self._write(directory, args), name="easykv_state")]

    async def _write(self, directory: epath.Path, args: _StateSave) -> None:
        record = dict(args.record)
        if args.fingerprints is not None:
            digests = args.fingerprints.result()
            for entry, digest in zip(record["arrays"], digests):
                entry["fingerprint"] = digest
        if jax.process_index() == 0:
            directory = epath.Path(directory)
            if args.manager_state is not None:
                (directory / MANAGER_FILE).write_text(json.dumps(args.manager_state, separators=(",", ":")))
            (directory / RECORD_FILE).write_text(json.dumps(record, indent=1))

    def save(self, directory: epath.Path, args: _StateSave) -> None:
        import asyncio

        async def run() -> None:
            for f in await self.async_save(directory, args):
                f.result()

        asyncio.run(run())

    def restore(self, directory: epath.Path, args: Any = None) -> dict[str, Any]:
        return json.loads((epath.Path(directory) / RECORD_FILE).read_text())


@ocp.args.register_with_handler(_StateHandler, for_save=True)
@dataclasses.dataclass
class _StateSave(ocp.args.CheckpointArgs):
    record: dict[str, Any]
    manager_state: dict[str, Any] | None
    fingerprints: PendingFingerprints | None


@ocp.args.register_with_handler(_StateHandler, for_restore=True)
@dataclasses.dataclass
class _StateRestore(ocp.args.CheckpointArgs):
    pass


def orbax_manager(directory: epath.Path, *, read_only: bool, max_to_keep: int | None = None,
                  enable_async: bool = False) -> ocp.CheckpointManager:
    """An orbax CheckpointManager over ``directory`` with easykv's two items; a writer also
    removes temporary directories that interrupted saves left behind."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=not read_only, read_only=read_only,
        enable_async_checkpointing=enable_async, cleanup_tmp_directories=not read_only,
    )
    handlers = {
        PAGES_ITEM: ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=USE_OCDBT),
        STATE_ITEM: _StateHandler(),
    }
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


# ---- array names ------------------------------------------------------------------------------
def layer_key(i: int) -> str:
    return f"layer_{i:03d}"


def expected_leaves(meta: PagedAttentionCacheMetaData, platform: str) -> list[tuple[str, tuple[str, ...], Any]]:
    """(name, path, ShapeDtypeStruct in ``platform`` storage) of every array of ``meta``."""
    template = stored_template(meta, platform)
    out = []
    for i in range(meta.num_hidden_layers):
        for kind in ("key_pages", "value_pages"):
            layer = layer_key(i)
            if isinstance(template, QuantizedPages):
                out.append((f"{layer}.{kind}.values", (layer, kind, "values"), template.values))
                out.append((f"{layer}.{kind}.scales", (layer, kind, "scales"), template.scales))
            else:
                out.append((f"{layer}.{kind}", (layer, kind), template))
    return out


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return int(step)


# ---- finding and reading steps -------------------------------------------------------------------
def check_not_foreign(directory: epath.Path) -> None:
    """Refuse a directory that holds orbax steps which are not easykv checkpoints."""
    if (directory / MARKER_FILE).exists():
        return
    for child in directory.iterdir():
        if child.name.isdigit() and child.is_dir() and not (child / STATE_ITEM / RECORD_FILE).exists():
            raise NotACheckpointError(
                f"{directory} holds step directories (e.g. {child.name}) that are not easykv checkpoints (no "
                f"{MARKER_FILE}, no {STATE_ITEM}/{RECORD_FILE}); use another directory for the cache")


def resolve_step(directory: epath.Path, step: int | None) -> tuple[int, list[int]]:
    if not directory.exists():
        raise NotACheckpointError(f"no checkpoint at {directory}: the directory does not exist")
    if not directory.is_dir():
        raise NotACheckpointError(f"{directory} is a file, not a checkpoint directory")
    steps = sorted(int(s) for s in ocp.step.checkpoint_steps(directory))  # finalized steps only
    easykv_steps = [s for s in steps if (directory / str(s) / STATE_ITEM / RECORD_FILE).exists()]
    marker = (directory / MARKER_FILE).exists()
    if not marker and not easykv_steps:
        what = f"orbax steps {steps} without an {STATE_ITEM}/{RECORD_FILE}" if steps else "no step directories"
        raise NotACheckpointError(
            f"{directory} is not an easykv checkpoint: no {MARKER_FILE} and {what}; pass the directory "
            "given to save_cache / CacheCheckpointer")
    complete = steps if marker else easykv_steps  # a damaged step is reported when restored
    partial = sorted(str(p) for p in ocp.step.tmp_checkpoints(directory))
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


def read_record(directory: str | Any, step: int) -> dict[str, Any]:
    """The JSON record of ``step`` (format-checked), or a precise error."""
    path = epath.Path(directory) / str(step) / STATE_ITEM / RECORD_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise CheckpointIntegrityError(f"step {step} in {directory} lacks {STATE_ITEM}/{RECORD_FILE}; the step is "
                                       "damaged — restore another step", step=step, directory=str(directory)) from err
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointIntegrityError(f"{path} is not valid JSON ({err}); the step is damaged — restore "
                                       "another step",
                                       step=step, directory=str(directory)) from err
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise NotACheckpointError(f"{path} is not an easykv checkpoint record (format "
                                  f"{record.get('format') if isinstance(record, dict) else None!r})")
    version = record.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointMismatchError(
            f"step {step} in {directory} has checkpoint format version {version!r}; this easykv reads versions "
            f"<= {FORMAT_VERSION}: upgrade easykv")
    for key in ("metadata", "arrays", "storage"):
        if key not in record:
            raise CheckpointIntegrityError(f"{path} lacks {key!r}; the step is damaged", step=step,
                                           directory=str(directory))
    return record


def read_manager_state(directory: str | Any, step: int) -> dict[str, Any] | None:
    path = epath.Path(directory) / str(step) / STATE_ITEM / MANAGER_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointIntegrityError(f"{path} is not valid JSON ({err}); the step is damaged", step=step,
                                       directory=str(directory)) from err


def saved_metadata(record: Mapping[str, Any], step: int, directory: Any) -> PagedAttentionCacheMetaData:
    try:
        return PagedAttentionCacheMetaData.from_dict(record["metadata"])
    except (SerializationError, ValueError, TypeError) as err:
        raise CheckpointIntegrityError(f"the cache metadata of step {step} in {directory} is unreadable: {err}",
                                       step=step, directory=str(directory)) from err


def _abstract_tree(entries: list[tuple[dict[str, Any], Any]]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for entry, sds in entries:
        node = tree
        *parents, last = entry["path"]
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = sds
    return tree


def _leaf(tree: Mapping[str, Any], path: list[str]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def restore_arrays(mngr: ocp.CheckpointManager, step: int, entries: list[tuple[dict[str, Any], Any]],
                    directory: Any) -> list[jax.Array]:
    """Read every array with its target sharding; an unreadable one is named."""
    def run(subset: list[tuple[dict[str, Any], Any]]) -> list[jax.Array]:
        tree = _abstract_tree(subset)
        restore_args = ocp.checkpoint_utils.construct_restore_args(tree)
        out = mngr.restore(step, args=ocp.args.Composite(**{
            PAGES_ITEM: ocp.args.PyTreeRestore(item=tree, restore_args=restore_args, partial_restore=True)}))
        pages = out[PAGES_ITEM]
        return jax.block_until_ready([_leaf(pages, e["path"]) for e, _ in subset])

    try:
        return run(entries)
    except Exception as err:  # noqa: BLE001  tensorstore/orbax raise many types; find the array
        bulk = err
    if len(entries) == 1:
        entry = entries[0][0]
        raise CheckpointIntegrityError(
            f"array {entry['name']} of step {step} in {directory} cannot be read ({type(bulk).__name__}: "
            f"{_short(bulk)}); its data file is missing, truncated or corrupted — restore another step",
            array=entry["name"], step=step, directory=str(directory)) from bulk
    for entry, sds in entries:
        try:
            run([(entry, sds)])
        except Exception as err:  # noqa: BLE001
            raise CheckpointIntegrityError(
                f"array {entry['name']} of step {step} in {directory} cannot be read ({type(err).__name__}: "
                f"{_short(err)}); its data file is missing, truncated or corrupted — restore another step",
                array=entry["name"], step=step, directory=str(directory)) from err
    raise CheckpointIntegrityError(
        f"the pages of step {step} in {directory} cannot be read ({type(bulk).__name__}: {_short(bulk)})",
        step=step, directory=str(directory)) from bulk


def _short(err: BaseException, n: int = 300) -> str:
    text = str(err).strip().replace("\n", " ")
    return text if len(text) <= n else text[:n] + "..."


def verify_arrays(record: Mapping[str, Any], arrays: list[Any], step: int, directory: Any) -> None:
    """Compare each array's fingerprint with the record; CheckpointIntegrityError names the first
    damaged array (and counts the others)."""
    if not record.get("fingerprint_algorithm"):
        return
    if record["fingerprint_algorithm"] != FINGERPRINT_ALGORITHM:
        raise CheckpointMismatchError(
            f"step {step} was fingerprinted with {record['fingerprint_algorithm']!r}; this easykv knows "
            f"{FINGERPRINT_ALGORITHM!r}: upgrade easykv or restore with verify=False")
    got = fingerprints(arrays)
    bad = [(e, g) for e, g in zip(record["arrays"], got) if e.get("fingerprint") != g]
    if bad:
        entry, digest = bad[0]
        more = f" (and {len(bad) - 1} more: {[e['name'] for e, _ in bad[1:4]]})" if len(bad) > 1 else ""
        raise CheckpointIntegrityError(
            f"array {entry['name']} of step {step} in {directory} does not match the fingerprint recorded at save "
            f"time (saved {entry.get('fingerprint')}, read {digest}){more}: its data file is damaged — restore "
            "another step", array=entry["name"], step=step, directory=str(directory))



def list_steps(directory: str | Any) -> list[int]:
    """Complete steps of an easykv checkpoint directory, ascending."""
    return resolve_step(epath.Path(directory), None)[1]



__all__ = [
    "FORMAT", "FORMAT_VERSION", "MANAGER_FILE", "MARKER_FILE", "PAGES_ITEM", "RECORD_FILE", "STATE_ITEM",
    "check_not_foreign", "check_step", "expected_leaves", "layer_key", "list_steps", "orbax_manager",
    "read_manager_state", "read_record", "resolve_step", "restore_arrays", "saved_metadata", "verify_arrays",
]
