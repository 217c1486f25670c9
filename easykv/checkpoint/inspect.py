"""`easykv inspect DIR`: what a checkpoint directory holds, and whether its data are intact.

`inspect_checkpoint` returns the printable report: the steps (and interrupted saves), and per
step the cache shape and format, sizes in memory and on disk, the mesh it was saved with, the
page-manager summary, the extra metadata, and (``verify=True``) the result of re-reading every
array and checking its fingerprint, and of checking the saved page-manager state against the
record. The record itself is always verified (its sha256 and schema) before anything of it is
shown. Verification reads one array at a time onto one device, so it needs no more memory than
the largest array. Raises `NotACheckpointError` for a directory that is not an easykv
checkpoint; damage (or a step this easykv cannot read) is reported in the text, not raised:
`inspect_report` also says whether every step was intact, for the CLI's exit code.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

import jax
import numpy as np

from easykv.checked_files import file_kind
from easykv.checkpoint import format as fmt
from easykv.checkpoint.orbax_types import CheckpointDir, EPath
from easykv.checkpoint.reader import read_arrays
from easykv.checkpoint.record import is_legacy, legacy_note
from easykv.errors import CheckpointError, CheckpointIntegrityError, NotACheckpointError
from easykv.spec.metadata import known_dtype


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _disk_bytes(path: EPath) -> int | None:
    local = os.fspath(path)
    if "://" in local:
        return None
    total = 0
    for root, _, files in os.walk(local):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def verify_step(directory: CheckpointDir, step: int, record: dict[str, Any] | None = None) -> int:
    """Re-read every array of ``step`` (one at a time, onto one device) and check its
    fingerprint; returns the number of arrays checked or raises CheckpointIntegrityError."""
    directory = fmt.checkpoint_path(directory)
    record = fmt.read_record(directory, step) if record is None else record
    if record["fingerprint_algorithm"] is None:
        return 0
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    for entry in record["arrays"]:
        sds = jax.ShapeDtypeStruct(tuple(entry["shape"]), np.dtype(entry["stored_dtype"]), sharding=sharding)
        arrays, digests = read_arrays(directory, step, record, [(entry, sds)],
                                      algorithm=record["fingerprint_algorithm"])
        del arrays
        fmt.check_fingerprints({**record, "arrays": [entry]}, digests or [], step, directory)
    return len(record["arrays"])


def _mesh_line(mesh: dict[str, Any]) -> str:
    if not mesh:
        return "unknown"
    shape = mesh.get("shape") or {}
    axes = " x ".join(f"{k}={v}" for k, v in shape.items()) or "?"
    heads = ",".join(mesh.get("kv_head_mesh_axes") or []) or "none (replicated)"
    pages = ",".join(mesh.get("page_mesh_axes") or []) or "none"
    return (f"{axes} ({mesh.get('num_devices', '?')} {mesh.get('platform', '?')} devices, "
            f"{mesh.get('process_count', 1)} process(es)); kv heads over {heads}, pages over {pages}")


def _group_line(group: Any) -> str:
    kind = group.attention if group.window is None else f"{group.attention} {group.window}"
    dims = (f"latent {group.key_head_dim} (values: its first {group.value_head_dim})" if group.latent
            else f"K {group.key_head_dim} / V {group.value_head_dim}")
    return (f"layers {group.span}: {kind}; {group.num_kv_heads} kv heads x {dims}; "
            f"{group.num_pages} pages{group.format_note}")


def _step_report(directory: EPath, step: int, verify: bool) -> tuple[list[str], bool]:
    """The lines of one step and whether it is intact."""
    try:
        record = fmt.read_record(directory, step)
        meta = fmt.saved_metadata(record, step, directory)
    except CheckpointIntegrityError as err:
        return [f"step {step}: DAMAGED — {err}"], False
    except CheckpointError as err:
        return [f"step {step}: UNREADABLE — {err}"], False
    arrays = record["arrays"]
    logical = sum(a["nbytes"] for a in arrays)
    disk = _disk_bytes(directory / str(step))
    stored = sorted({a["stored_dtype"] for a in arrays})
    lines = [f"step {step}  (saved {record['created']} by easykv {record['easykv_version']}, "
             f"format version {record['format_version']})"]
    lines.append(f"  cache    {meta.num_hidden_layers} layers x {meta.num_kv_heads} kv heads x head_dim "
                 f"{meta.kv_head_dim_size}; page_size {meta.page_size}, {meta.num_pages_per_layer} pages per layer; "
                 f"batch_size {meta.batch_size}, max_sequences {meta.max_sequences}")
    if not meta.is_uniform:
        lines.extend(f"  group {g}  {_group_line(group)}" for g, group in enumerate(meta.groups))
    lines.append(f"  format   {known_dtype(meta.dtype).name}, quantization {meta.quantization}; stored as "
                 f"{', '.join(stored)} on {record['storage']['platform']}")
    lines.append(f"  size     {_size(logical)} in {len(arrays)} arrays"
                 + (f"; {_size(disk)} on disk" if disk is not None else ""))
    lines.append(f"  mesh     {_mesh_line(record['mesh'])}")
    if meta.has_host_tier:
        lines.append(f"  host     a host-memory tier of {meta.host_pages_per_layer} pages per layer; its pages are not "
                     "saved (it restores empty)")
    mgr = record["manager"]
    if mgr:
        lines.append(f"  manager  {mgr['active_sequences']} sequences, {mgr['tokens']} tokens; pages free "
                     f"{mgr['free_pages']}, cached {mgr['cached_pages']}; {mgr['prefix_pages']} prefix pages")
    else:
        lines.append("  manager  not saved")
    extra = record["extra_metadata"]
    if extra:
        text = json.dumps(extra, sort_keys=True)
        lines.append(f"  extra    {text if len(text) <= 200 else text[:200] + '...'}")
    if is_legacy(record):
        lines.append(f"  note     {legacy_note(step, directory)}")
    ok = True
    if not verify:
        lines.append("  verify   skipped")
        return lines, ok
    if mgr:
        try:
            fmt.read_manager_state(directory, step, record)
            lines.append("  verify   manager state matches the record")
        except CheckpointError as err:
            lines.append(f"  verify   DAMAGED: {err}")
            ok = False
    if record["fingerprint_algorithm"] is None:
        lines.append("  verify   no array fingerprints (saved with integrity=False)")
        return lines, ok
    try:
        n = verify_step(directory, step, record)
        lines.append(f"  verify   OK: {n} arrays match their fingerprints ({record['fingerprint_algorithm']})")
    except CheckpointIntegrityError as err:
        lines.append(f"  verify   DAMAGED: {err}")
        ok = False
    except CheckpointError as err:
        lines.append(f"  verify   cannot verify: {err}")
        ok = False
    return lines, ok


def inspect_report(directory: CheckpointDir, *, verify: bool = True) -> tuple[str, bool]:
    """(the report `easykv inspect DIR` prints, whether every step is intact). A damaged marker
    (a FIFO or link in place of ``easykv_checkpoint.json``) is reported, not raised: the directory
    is not intact, and the steps holding an easykv record are still described."""
    import orbax.checkpoint as ocp

    directory = fmt.checkpoint_path(directory)
    fmt.check_directory(directory)
    try:
        marker, damage = fmt.marker_present(directory), None
    except CheckpointIntegrityError as err:
        marker, damage = False, err
    try:
        steps, partial = fmt.complete_steps(directory, marker)
    except NotACheckpointError:
        if damage is None:
            raise
        steps, partial = [], sorted(str(p) for p in ocp.step.tmp_checkpoints(directory))
    lines = [f"easykv checkpoint {directory}",
             f"  {len(steps)} complete step(s): {', '.join(map(str, steps)) or 'none'}"]
    if damage is not None:
        lines.append(f"  marker   DAMAGED: {damage}")
    if partial:
        lines.append(f"  {len(partial)} interrupted save(s), ignored: {', '.join(partial)}")
    odd = _step_names_not_directories(directory)
    for name, kind in odd:
        lines.append(f"  step {name} DAMAGED: it is {kind}, not a step directory; restore another step")
    intact = damage is None and not odd
    for step in reversed(steps):
        lines.append("")
        step_lines, ok = _step_report(directory, step, verify)
        lines.extend(step_lines)
        intact = intact and ok
    return "\n".join(lines), intact


def _step_names_not_directories(directory: EPath) -> list[tuple[str, str]]:
    """(name, what it is) of each entry named like a step (digits) that is not a directory: a
    FIFO, a file or a dangling link in place of a step would otherwise go unlisted and unreported."""
    local = os.fspath(directory)
    if "://" in local:
        return []  # an object store holds neither FIFOs nor links
    odd = []
    with os.scandir(local) as entries:
        for entry in entries:
            if entry.name.isdigit() and entry.name.isascii():
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISLNK(info.st_mode):
                    try:
                        info = os.stat(entry.path)
                    except OSError:
                        odd.append((entry.name, "a link to nothing readable"))
                        continue
                if not stat.S_ISDIR(info.st_mode):
                    odd.append((entry.name, file_kind(info.st_mode)))
    return sorted(odd, key=lambda item: int(item[0]))


def inspect_checkpoint(directory: CheckpointDir, *, verify: bool = True) -> str:
    """The report `easykv inspect DIR` prints (see the module doc): the steps (and interrupted
    saves), and per step the cache shape and format, sizes, mesh, page-manager summary and extra
    metadata. Damage is reported in the text, not raised.

    Args:
      directory: the checkpoint directory (a str, an ``os.PathLike`` or an epath);
        `NotACheckpointError` when it is not an easykv checkpoint.
      verify: re-read every array and check its fingerprint, and check the saved page-manager
        state against the record (default True); False skips both (the record itself is always
        verified).

    Returns:
      the report, lines joined by newlines.
    """
    return inspect_report(directory, verify=verify)[0]


__all__ = ["inspect_checkpoint", "inspect_report", "verify_step"]
