"""Reading a step's page arrays: every shard straight into the buffer that becomes its device
array, its fingerprint cells checksummed while its bytes are in host memory.

orbax's reader stages each shard in a host buffer of its own and copies it again to the device,
and the fingerprints then read every array once more. Here each addressable shard of the target
sharding (a shard replicated on several devices of this process: once, then copied to the
others) is read by tensorstore, orbax's own engine, into its device buffer: on CPU a buffer XLA
allocated (zeroed, then written through a numpy view of its bytes before anything reads it; a
numpy buffer XLA merely adopted could not be donated, and the first donated write would copy the
pool), on GPU/TPU an aligned host buffer, the staging copy of the transfer. The chunk
files are memory-mapped (tensorstore's ``file_io_mode: memmap``), so a shard's bytes are copied
once, from the page cache into that buffer. While tensorstore reads one shard on its own threads,
this thread checksums the one before, and the next read starts only when that is done: host
memory beyond the restored arrays is the mapped pages of the chunk files one shard reads (the
page cache, counted in the process's RSS while mapped), not the pool (with more reads in flight
the mapped pages of several shards at once were seen in RSS, and no faster restore). A chunk file
truncated in place while mapped would end the process with SIGBUS; no easykv or orbax writer
rewrites a committed step.

The layout read is the one easykv writes through orbax (`easykv.checkpoint.format`): one zarr
(v2) array per page array under ``<step>/pages/<name>/``, uncompressed, C order, one chunk file
per saved shard. The ``.zarray`` must describe the array the record names (shape, stored dtype,
no compressor or filter, C order) and every chunk file must be present, a regular file of exactly
one chunk's bytes, so a crafted file can neither block the read (a FIFO), make it allocate (a huge
sparse file), nor be read in another layout. orbax's tree metadata (``_METADATA``) must still
list every array, so that orbax itself can restore the step.

Fingerprints are checked only where this host holds every shard of an array on CPU devices;
otherwise (GPU/TPU, several processes) the restored array's cells are computed on the devices
(`easykv.checkpoint.integrity`), as before.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import stat
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from easykv.checkpoint.format import PAGES_ITEM
from easykv.checkpoint.integrity import digest, fingerprints, host_cells, host_path_ok
from easykv.checkpoint.orbax_types import EPath
from easykv.checkpoint.record import RECORD_MAX_BYTES, read_small_file
from easykv.errors import CheckpointIntegrityError

_ALIGN = 64  # the host staging buffers of GPU/TPU reads: aligned for the transfer
_AHEAD = 1  # shards being read while one is checksummed (see the module doc)


def array_dir(directory: EPath, step: int, entry: Mapping[str, Any]) -> EPath:
    """Where orbax wrote the array of a record entry: its PyTree path joined by dots."""
    return directory / str(step) / PAGES_ITEM / ".".join(entry["path"])


def read_arrays(directory: EPath, step: int, entries: list[tuple[dict[str, Any], jax.ShapeDtypeStruct]], *,
                algorithm: str | None, grid: int) -> tuple[list[jax.Array], list[str] | None]:
    """Every array of ``entries`` (record entry, stored shape/dtype with its target sharding),
    read shard by shard; with an ``algorithm``, also each array's fingerprint as read (None
    without one). An array whose files are missing, malformed or unreadable is named in a
    `CheckpointIntegrityError`."""
    _check_tree_metadata(directory, step, [e for e, _ in entries])
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}, "file_io_mode": {"mode": "memmap"}})
    stores = [_open(directory, step, entry, sds, context) for entry, sds in entries]
    # Cells are checksummed as read where this host reads every shard onto CPU devices.
    cells: list[np.ndarray | None] = [
        np.zeros(sds.shape[:grid], np.uint32) if algorithm is not None and host_path_ok(sds.sharding) else None
        for _, sds in entries]
    placed: list[dict[Any, jax.Array]] = [{} for _ in entries]
    in_flight: list[tuple[int, tuple[slice, ...], list[Any], jax.Array | None, np.ndarray, Any]] = []

    def land(i: int, index: tuple[slice, ...], devices: list[Any], owned: jax.Array | None, buf: np.ndarray,
             read: Any) -> None:
        try:
            read.result()
        except Exception as err:  # noqa: BLE001  tensorstore raises many types on damaged files
            raise _unreadable(entries[i][0], step, directory, err) from err
        grid_cells = cells[i]
        if grid_cells is not None and algorithm is not None:
            grid_cells[index[:grid]] = host_cells(buf, algorithm, grid)
        for device in devices:
            placed[i][device] = (owned if owned is not None and device == devices[0]
                                 else jax.device_put(owned if owned is not None else buf, device))

    try:
        for i, (store, (_, sds)) in enumerate(zip(stores, entries)):
            for index, devices in _regions(sds):
                owned, buf = _target_buffer(tuple(s.stop - s.start for s in index), np.dtype(sds.dtype), devices[0])
                read = ts.array(buf, copy=False, write=True).write(store[index])
                in_flight.append((i, index, devices, owned, buf, read))
                if len(in_flight) > _AHEAD:
                    land(*in_flight.pop(0))
        while in_flight:
            land(*in_flight.pop(0))
    except BaseException:
        # A read still in flight writes into a buffer that the unwinding frees (on CPU, memory XLA
        # owns, which the numpy view does not keep alive): wait for it first.
        for *_, read in in_flight:
            try:
                read.result()
            except Exception:  # noqa: BLE001, S110  the error being raised is the first one; this read is discarded
                pass
        raise
    arrays: list[jax.Array] = [
        jax.make_array_from_single_device_arrays(sds.shape, sds.sharding, list(shards.values()))
        for shards, (_, sds) in zip(placed, entries)]
    if algorithm is None:
        return arrays, None
    digests = [digest(c) if c is not None else fingerprints([a], algorithm=algorithm, grid=grid)[0]
               for c, a in zip(cells, arrays)]
    return arrays, digests


def _regions(sds: jax.ShapeDtypeStruct) -> list[tuple[tuple[slice, ...], list[Any]]]:
    """The distinct shards of ``sds``'s sharding held on this process's devices, each with the
    devices that hold it."""
    out: dict[tuple[tuple[int, int], ...], list[Any]] = {}
    for device, index in sds.sharding.addressable_devices_indices_map(sds.shape).items():
        key = tuple(s.indices(n)[:2] for s, n in zip(index, sds.shape))
        out.setdefault(key, []).append(device)
    return [(tuple(slice(a, b) for a, b in key), devices) for key, devices in out.items()]


def _target_buffer(shape: tuple[int, ...], dtype: np.dtype, device: Any) -> tuple[jax.Array | None, np.ndarray]:
    """Where a shard for ``device`` is read: on CPU, a buffer XLA allocated on that device and a
    numpy view of its bytes (so that the array can be donated later: XLA:CPU adopts a numpy
    buffer without a copy but cannot donate it, and the first donated write after a restore
    would copy the whole pool); elsewhere, an aligned host buffer that ``device_put`` copies."""
    if device.platform != "cpu":
        return None, _aligned_empty(shape, dtype)
    # Zeros, not empty: JAX has no uninitialised allocation; the array is written here before
    # anything reads it, and never after. Made on ``device`` itself (jnp.zeros(device=) made it
    # on the default device and copied it: a shard's worth more memory).
    owned = jax.block_until_ready(_zeros(shape, dtype, device)())
    nbytes = math.prod(shape) * dtype.itemsize
    raw = memoryview((ctypes.c_char * nbytes).from_address(owned.unsafe_buffer_pointer())).cast("B")
    return owned, np.frombuffer(raw, dtype).reshape(shape)


@functools.cache
def _zeros(shape: tuple[int, ...], dtype: np.dtype, device: Any) -> Callable[[], jax.Array]:
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=jax.sharding.SingleDeviceSharding(device))


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    out: np.ndarray = raw[start:start + nbytes].view(dtype).reshape(shape)
    return out


# ---- what is opened ---------------------------------------------------------------------------------
def _kvstore(path: EPath) -> Any:
    text = os.fspath(path)
    return text if "://" in text else {"driver": "file", "path": text}


def _open(directory: EPath, step: int, entry: dict[str, Any], sds: jax.ShapeDtypeStruct, context: Any) -> Any:
    """The array's zarr store, once its metadata and chunk files are what easykv writes."""
    path = array_dir(directory, step, entry)
    stored = np.dtype(sds.dtype)
    problem = _zarray_problem(path, step, directory, sds.shape, stored)
    if problem is None:
        try:
            store = ts.open({"driver": "zarr", "kvstore": _kvstore(path)}, open=True, read=True,
                            context=context).result()
            meta = store.spec().to_json().get("metadata", {})
        except Exception as err:  # noqa: BLE001  malformed .zarray: tensorstore's many types
            raise _unreadable(entry, step, directory, err) from err
        problem = _chunk_files_problem(path, meta, stored)
    if problem is not None:
        raise CheckpointIntegrityError(
            f"array {entry['name']} of step {step} in {directory} cannot be read: {problem}; its files are "
            "damaged — restore another step", array=entry["name"], step=step, directory=str(directory))
    return store


def _zarray_problem(path: EPath, step: int, directory: EPath, shape: tuple[int, ...], stored: np.dtype) -> str | None:
    """Why the array's ``.zarray`` (read as a small regular file: a FIFO would block tensorstore,
    a huge file fill memory) does not describe what easykv writes (None: it does). The dtype is
    compared as written: ``>f4`` would be read as byte-swapped ``<f4`` values."""
    data = read_small_file(path / ".zarray", RECORD_MAX_BYTES, step, directory)
    if data is None:
        return "its .zarray is missing"
    try:
        meta = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        return f"its .zarray is not JSON ({short(err, 100)})"
    if not isinstance(meta, dict):
        return "its .zarray is not a JSON object"
    want = (list(shape), {stored.str, stored.name}, None, None, "C", ".")
    got = (meta.get("shape"), meta.get("dtype"), meta.get("compressor"), meta.get("filters") or None,
           meta.get("order"), meta.get("dimension_separator", "."))
    if got[0] != want[0] or not isinstance(got[1], str) or got[1] not in want[1]:
        return f"its .zarray describes {got[0]!r:.80} {got[1]!r:.40}, the record {want[0]} {stored.str}"
    if got[2:] != want[2:]:
        return (f"its .zarray asks for compressor {got[2]!r:.60}, filters {got[3]!r:.60}, order {got[4]!r:.10}, "
                f"dimension separator {got[5]!r:.10}; easykv writes none, none, 'C', '.'")
    return None


def _chunk_files_problem(path: EPath, meta: Mapping[str, Any], dtype: np.dtype) -> str | None:
    """Why the chunk files of a local array are not exactly its chunk grid's names, each a regular
    file of one chunk's bytes (None: they are)."""
    local = os.fspath(path)
    if "://" in local:
        return None  # an object store: no FIFOs or sparse files; a missing object is left to the fingerprints
    chunks = [int(c) for c in meta.get("chunks", [])]
    chunk_bytes = math.prod(chunks) * dtype.itemsize
    found = set()
    with os.scandir(local) as it:
        for item in it:
            if item.name.startswith("."):
                continue  # .zarray (read above), .zattrs
            info = item.stat(follow_symlinks=False)  # a link is refused too: easykv writes none
            if not stat.S_ISREG(info.st_mode):
                return f"its chunk {item.name!r} is not a regular file (a link, a directory or a device)"
            if info.st_size != chunk_bytes:
                return f"its chunk {item.name!r} holds {info.st_size} bytes, not one chunk's {chunk_bytes}"
            found.add(item.name)
    # A missing chunk would read as zeros (easykv writes every chunk, zeros included); a misnamed
    # one would be left unread.
    grid = [-(-int(n) // c) for n, c in zip(meta.get("shape", []), chunks)]
    want = {".".join(map(str, index)) for index in np.ndindex(*grid)}
    if found != want:
        odd = sorted(found - want)[:3] or sorted(want - found)[:3]
        return (f"its chunk files are not the {len(want)} that its shape and chunks imply (named by grid "
                f"position): {odd} {'are not among them' if found - want else 'are missing'}")
    return None


def _check_tree_metadata(directory: EPath, step: int, entries: list[dict[str, Any]]) -> None:
    """orbax's ``_METADATA`` of the pages lists every array of the record (orbax restores the
    step by it; easykv reads the arrays by the record)."""
    path = directory / str(step) / PAGES_ITEM / "_METADATA"
    data = read_small_file(path, RECORD_MAX_BYTES, step, directory)  # a FIFO or a huge file is refused
    try:
        if data is None:
            raise FileNotFoundError(f"{path} is missing")
        tree = json.loads(data)["tree_metadata"]
        keys = set(tree)
    except Exception as err:  # noqa: BLE001  missing, not JSON, not orbax's shape
        raise CheckpointIntegrityError(
            f"orbax's metadata of the pages of step {step} in {directory} is unreadable ({type(err).__name__}: "
            f"{short(err)}); restore another step", step=step, directory=str(directory)) from err
    for entry in entries:
        if str(tuple(entry["path"])) not in keys:
            raise CheckpointIntegrityError(
                f"array {entry['name']} of step {step} in {directory} is missing from orbax's metadata of the "
                "step (pages/_METADATA), which is damaged — restore another step", array=entry["name"],
                step=step, directory=str(directory))


def _unreadable(entry: Mapping[str, Any], step: int, directory: EPath, err: BaseException) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(
        f"array {entry['name']} of step {step} in {directory} cannot be read ({type(err).__name__}: {short(err)}); "
        "its data or metadata files are missing, truncated or corrupted — restore another step",
        array=entry["name"], step=step, directory=str(directory))


def short(err: BaseException, n: int = 300) -> str:
    """An exception's text on one line, cut to ``n`` characters."""
    text = str(err).strip().replace("\n", " ")
    return text if len(text) <= n else text[:n] + "..."


__all__ = ["array_dir", "read_arrays", "short"]
