"""Reading a step's page arrays: every shard straight into the buffer that becomes its device
array, its fingerprint cells checksummed while its bytes are in host memory.

orbax's reader stages each shard in a host buffer of its own and copies it again to the device,
and the fingerprints then read every array once more. Here each addressable shard of the target
sharding (a shard replicated on several devices of this process: once, then copied to the
others) is read into its device buffer: on CPU a buffer XLA allocated (zeroed, then written
through a numpy view of its bytes before anything reads it; a numpy buffer XLA merely adopted
could not be donated, and the first donated write would copy the pool), on GPU/TPU an aligned
host buffer, the staging copy of the transfer.

A local step's chunk files are read here, not by tensorstore, which opens paths itself (a FIFO
swapped in after the checks would block it forever): each chunk a shard overlaps is opened once,
non-blocking and without following a link, ``fstat`` of that descriptor must show a regular file
of exactly one chunk's bytes, and the part the shard needs is read with ``preadv`` through the
same descriptor straight into the shard's buffer (only the kv-head and page axes, and at most
one more axis of a replicated shard, are ever split, so the part is a few contiguous runs). A
file that shrinks while read is refused, where a memory map would end the process with SIGBUS.
Two threads each allocate a shard's buffer and read it (``preadv`` releases the GIL) while this
thread checksums the shard before, and the next read starts only when that is done: nothing is
staged beyond the buffers that become the restored arrays (the page cache is the kernel's, not
the process's; on GPU/TPU, two shards' host buffers), save one chunk's part at a time where it
would fall into more than ``_MAX_RUNS`` pieces of the shard (`copy_chunk_part`). An object
store's arrays (``://``) are read by tensorstore, as orbax does.

The layout read is the one easykv writes through orbax (`easykv.checkpoint.format`): one zarr
(v2) array per page array under ``<step>/pages/<name>/``, uncompressed, C order, one chunk file
per saved shard. Before anything is listed or read, orbax's ``_METADATA`` and every ``.zarray``
are compared, field by field, with what the record implies (`easykv.checkpoint.stored_files`):
a crafted chunk shape is refused by that comparison, never enumerated, and the work that follows is
bounded by the number of chunk files the record implies. A local array's directory must then
hold exactly the chunk grid's names (a missing chunk would read as zeros).

Fingerprints are checked only where this host holds every shard of an array on CPU devices;
otherwise (GPU/TPU, several processes) the restored array's cells are computed on the devices
(`easykv.checkpoint.integrity`), as before.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from easykv.checked_files import open_regular, read_into
from easykv.checkpoint import stored_files
from easykv.checkpoint.format import PAGES_ITEM, fingerprint_grid
from easykv.checkpoint.integrity import digest, fingerprints, host_cells, host_path_ok
from easykv.checkpoint.orbax_types import EPath
from easykv.checkpoint.record import refused
from easykv.checkpoint.stored_files import SavedArray
from easykv.errors import CheckpointIntegrityError, FileRefusedError

_ALIGN = 64  # the host staging buffers of GPU/TPU reads: aligned for the transfer
_AHEAD = 1  # shards being read while one is checksummed (see the module doc)
_READERS = 2  # threads allocating and reading shards: the shard checksummed is already read
_Read = tuple["jax.Array | None", np.ndarray]  # a shard read: its XLA buffer (CPU) and the bytes read
_MAX_RUNS = 1024  # a chunk's part in more (so smaller) runs is read in file order and copied once


def array_dir(directory: EPath, step: int, path: Sequence[str]) -> EPath:
    """Where orbax wrote the array of a record entry: its PyTree path joined by dots."""
    return directory / str(step) / PAGES_ITEM / ".".join(path)


def read_arrays(directory: EPath, step: int, record: Mapping[str, Any],
                entries: list[tuple[dict[str, Any], jax.ShapeDtypeStruct]], *,
                algorithm: str | None) -> tuple[list[jax.Array], list[str] | None]:
    """Every array of ``entries`` (record entry, stored shape/dtype with its target sharding),
    read shard by shard; with an ``algorithm``, also each array's fingerprint as read (None
    without one). ``record`` is the step's verified record: the files are compared with it.

    Raises:
      CheckpointIntegrityError: orbax's metadata, or an array's metadata or chunk files, are
        missing, malformed, not what the record implies, or unreadable (the array is named)."""
    grid = fingerprint_grid(record)
    saved = {a.name: a for a in stored_files.saved_arrays(record, step, directory)}
    chunks = stored_files.check_tree_metadata(directory, step, list(saved.values()))
    sources = [_source(directory, step, saved[entry["name"]], chunks[entry["name"]]) for entry, _ in entries]
    # Cells are checksummed as read where this host reads every shard onto CPU devices.
    cells: list[np.ndarray | None] = [
        np.zeros(sds.shape[:grid], np.uint32) if algorithm is not None and host_path_ok(sds.sharding) else None
        for _, sds in entries]
    placed: list[dict[Any, jax.Array]] = [{} for _ in entries]
    in_flight: collections.deque[tuple[int, tuple[slice, ...], list[Any], Future[_Read]]] = collections.deque()

    def read(i: int, index: tuple[slice, ...], device: Any) -> _Read:
        # On a reader thread: the buffer is allocated (its pages touched by the zeros) there too.
        owned, buf = _target_buffer(tuple(s.stop - s.start for s in index), np.dtype(entries[i][1].dtype), device)
        sources[i].read(index, buf)
        return owned, buf

    def land(i: int, index: tuple[slice, ...], devices: list[Any], done: Future[_Read]) -> None:
        owned, buf = done.result()
        grid_cells = cells[i]
        if grid_cells is not None and algorithm is not None:
            grid_cells[index[:grid]] = host_cells(buf, algorithm, grid)
        for device in devices:
            placed[i][device] = (owned if owned is not None and device == devices[0]
                                 else jax.device_put(owned if owned is not None else buf, device))

    with ThreadPoolExecutor(max_workers=_READERS, thread_name_prefix="easykv-restore") as pool:
        try:
            for i, (_, sds) in enumerate(entries):
                for index, devices in _regions(sds):
                    in_flight.append((i, index, devices, pool.submit(read, i, index, devices[0])))
                    if len(in_flight) > _AHEAD:
                        land(*in_flight.popleft())
            while in_flight:
                land(*in_flight.popleft())
        except BaseException:
            # Reads still in flight are abandoned: none is left running behind the error.
            for *_, done in in_flight:
                done.cancel()
                with contextlib.suppress(Exception):
                    done.result()
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
def _source(directory: EPath, step: int, array: SavedArray, chunks: tuple[int, ...]) -> _LocalArray | _StoreArray:
    """The reader of one array, once its ``.zarray`` (and, on a local disk, the names of its
    chunk files) are what the record implies."""
    path = array_dir(directory, step, array.path)
    local = os.fspath(path)
    problem = stored_files.zarray_problem(path, array, chunks)
    if problem is None and "://" not in local:
        try:
            problem = stored_files.chunk_files_problem(local, array.grid(chunks))
        except OSError as err:
            problem = f"its directory cannot be listed ({type(err).__name__}: {err})"
    if problem is not None:
        raise _damaged(array.name, step, directory, problem)
    if "://" in local:
        return _StoreArray(local, array.name, step, directory)
    return _LocalArray(local, array, chunks, step, directory)


class _LocalArray:
    """The chunk files of an array on a local disk, read through checked descriptors."""

    def __init__(self, path: str, array: SavedArray, chunks: tuple[int, ...], step: int, directory: EPath):
        self.path, self.name, self.chunks, self.step, self.directory = path, array.name, chunks, step, directory
        self.chunk_bytes = math.prod(chunks) * array.dtype.itemsize

    def read(self, index: tuple[slice, ...], buf: np.ndarray) -> None:
        """Fill ``buf`` with the region ``index`` of the array, chunk by chunk."""
        lo = tuple(s.start for s in index)
        hi = tuple(s.stop for s in index)
        overlapped = [range(a // c, (b - 1) // c + 1) for a, b, c in zip(lo, hi, self.chunks)]
        for position in itertools.product(*overlapped):
            name = ".".join(map(str, position))
            path = os.path.join(self.path, name)
            try:
                with open_regular(path, follow_links=False, size=self.chunk_bytes) as (fd, _):
                    start = tuple(p * c for p, c in zip(position, self.chunks))
                    copy_chunk_part(fd, path, self.chunks, start, buf, lo)
            except FileRefusedError as err:
                raise _damaged(self.name, self.step, self.directory, refused(
                    path, err, f"not a regular file of one chunk's {self.chunk_bytes} bytes")) from err
            except FileNotFoundError as err:
                raise _damaged(self.name, self.step, self.directory, f"its chunk {name!r} is missing (it was listed; "
                               "the step changed while read)") from err
            except OSError as err:
                raise _damaged(self.name, self.step, self.directory,
                               f"its chunk {name!r} cannot be read ({type(err).__name__}: {err})") from err


def copy_chunk_part(fd: int, path: str, chunks: Sequence[int], start: Sequence[int], buf: np.ndarray,
                    lo: Sequence[int]) -> None:
    """Read, from the open chunk file ``fd`` of shape ``chunks`` whose first element is global
    position ``start``, the part that overlaps the region held by ``buf`` (which starts at global
    ``lo``) into its place in ``buf``: straight in, one ``preadv`` per run contiguous in both;
    or, when that would be many small runs, the part in file order into a staging array, then
    copied into place."""
    box_lo = [max(a, b) for a, b in zip(lo, start)]
    box_hi = [min(a + n, b + c) for a, n, b, c in zip(lo, buf.shape, start, chunks)]
    ext = [b - a for a, b in zip(box_lo, box_hi)]
    in_chunk = [a - b for a, b in zip(box_lo, start)]
    in_buf = [a - b for a, b in zip(box_lo, lo)]
    k = _runs_from(ext, chunks, buf.shape)
    if math.prod(ext[:k]) <= _MAX_RUNS:
        _read_runs(fd, path, chunks, in_chunk, ext, k, buf, in_buf)
        return
    staged = np.empty(ext, buf.dtype)
    _read_runs(fd, path, chunks, in_chunk, ext, _runs_from(ext, chunks), staged, [0] * len(ext))
    buf[tuple(slice(a, a + e) for a, e in zip(in_buf, ext))] = staged


def _read_runs(fd: int, path: str, chunks: Sequence[int], in_chunk: Sequence[int], ext: Sequence[int], k: int,
               target: np.ndarray, at: Sequence[int]) -> None:
    """Read the box of extent ``ext`` at ``in_chunk`` of the chunk file into ``target`` at
    ``at``, one ``preadv`` per run of axes ``k:`` (contiguous in both)."""
    item = target.dtype.itemsize
    run = ext[k] * math.prod(chunks[k + 1:]) * item
    flat = _bytes_of(target)
    for src, dst in zip(_run_starts(in_chunk, ext, chunks, k), _run_starts(at, ext, target.shape, k)):
        read_into(fd, int(src) * item, flat[int(dst) * item:int(dst) * item + run], path)


def _bytes_of(a: np.ndarray) -> memoryview:
    """The bytes of ``a`` itself, flat (an error for an array not in C order, never a copy)."""
    return a.view(np.uint8).data.cast("B")


def _runs_from(ext: Sequence[int], *shapes: Sequence[int]) -> int:
    """The first axis of the runs a box of extent ``ext`` falls into in C-ordered arrays of
    ``shapes``: every later axis is whole in the box and in each of them."""
    k = len(ext) - 1
    while k > 0 and all(ext[k] == s[k] for s in shapes):
        k -= 1
    return k


def _run_starts(start: Sequence[int], ext: Sequence[int], shape: Sequence[int], k: int) -> np.ndarray:
    """Element offsets, in a C-ordered array of ``shape``, of the runs of a box at ``start`` of
    extent ``ext`` whose axes from ``k`` on are contiguous: one per index of the axes before
    ``k``, in C order."""
    strides = [math.prod(shape[j + 1:]) for j in range(len(shape))]
    offsets = np.array([sum(a * s for a, s in zip(start, strides))], np.int64)
    for j in range(k):
        offsets = (offsets[:, None] + np.arange(ext[j], dtype=np.int64) * strides[j]).reshape(-1)
    return offsets


class _StoreArray:
    """An array on an object store, read by tensorstore (no FIFOs or links there)."""

    def __init__(self, url: str, name: str, step: int, directory: EPath):
        self.name, self.step, self.directory = name, step, directory
        try:
            self.store = ts.open({"driver": "zarr", "kvstore": url}, open=True, read=True,
                                 context=ts.Context({"cache_pool": {"total_bytes_limit": 0}})).result()
        except Exception as err:  # noqa: BLE001  tensorstore raises many types on damaged files
            raise _unreadable(name, step, directory, err) from err

    def read(self, index: tuple[slice, ...], buf: np.ndarray) -> None:
        """Fill ``buf`` with the region ``index`` of the array."""
        try:
            ts.array(buf, copy=False, write=True).write(self.store[index]).result()
        except Exception as err:  # noqa: BLE001  tensorstore raises many types on damaged files
            raise _unreadable(self.name, self.step, self.directory, err) from err


def _damaged(name: str, step: int, directory: EPath, problem: str) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(
        f"array {name} of step {step} in {directory} cannot be read: {problem}; its files are damaged — restore "
        "another step", array=name, step=step, directory=str(directory))


def _unreadable(name: str, step: int, directory: EPath, err: BaseException) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(
        f"array {name} of step {step} in {directory} cannot be read ({type(err).__name__}: {short(err)}); "
        "its data or metadata files are missing, truncated or corrupted — restore another step",
        array=name, step=step, directory=str(directory))


def short(err: BaseException, n: int = 300) -> str:
    """An exception's text on one line, cut to ``n`` characters."""
    text = str(err).strip().replace("\n", " ")
    return text if len(text) <= n else text[:n] + "..."


__all__ = ["array_dir", "copy_chunk_part", "read_arrays", "short"]
