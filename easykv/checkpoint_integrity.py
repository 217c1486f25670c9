"""Integrity of checkpointed pages: the checkpoint errors and a cheap fingerprint per array.

orbax keeps no checksum of array data (zarr chunks are written raw), so a flipped byte would
come back as a wrong K/V value. Every saved array therefore gets a fingerprint, recorded in
the checkpoint's JSON at save time and recomputed from the restored arrays.

Fingerprint ``cellsum32-sha256/1`` of an array of shape ``(H, N, *tail)`` (pages are
``(kv_heads, pages, page_size, head_dim)``, scales ``(kv_heads, pages, page_size[, groups])``):

* a *cell* is one ``(h, n)`` entry: one page of one kv head, ``prod(tail) * itemsize`` bytes;
* the cell's sum is the sum of its bytes read as little-endian uint32 words, mod 2**32 (cells
  whose byte count is not a multiple of 4 sum their bytes widened to uint32 instead);
* the fingerprint is sha256 over the ``(H, N)`` grid of cell sums (little-endian uint32, C order).

It is defined on the stored bytes of the global array, so it does not depend on the mesh (cells
never straddle shards: only the kv-head and page axes are split) nor on whether bf16 is stored
as raw uint16 bits (CPU) or as bf16 (GPU/TPU). It catches every change of a single word, any
damage that changes a page's sum, and pages swapped or moved; it does not see words permuted
inside one page with an unchanged sum (it is a checksum against damage, not a MAC).

Cost: one read of the data. On CPU the sums are numpy reductions over zero-copy views of the
device buffers (about 7 GiB/s per core, run on a thread pool, in the background of an async
save); on GPU/TPU they are one jitted reduction per array on the devices, so nothing of pool
size crosses to the host.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

FINGERPRINT_ALGORITHM = "cellsum32-sha256/1"


# Errors live in errors.py with the other typed errors; re-exported here for callers.
from easykv.errors import (  # noqa: E402
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointMismatchError,
    NotACheckpointError,
    StepNotFoundError,
)


# ---- fingerprints -----------------------------------------------------------------------------
def _cell_sums_host(block: np.ndarray) -> np.ndarray:
    """(h, n, *tail) numpy block -> (h, n) uint32 cell sums (see the module doc)."""
    h, n = block.shape[:2]
    raw = np.ascontiguousarray(block).reshape(h * n, -1).view(np.uint8)
    words = raw.view("<u4") if raw.shape[1] % 4 == 0 else raw.astype(np.uint32)
    return words.sum(axis=1, dtype=np.uint32).reshape(h, n)


def _cell_sums_device(x: jax.Array) -> jax.Array:
    """The same cell sums as `_cell_sums_host`, traced (for jit on any backend)."""
    h, n = x.shape[:2]
    raw = x if x.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(x, jnp.uint8)
    raw = raw.reshape(h, n, -1)
    cell_bytes = raw.shape[-1]
    if cell_bytes % 4 == 0:
        words = jax.lax.bitcast_convert_type(raw.reshape(h, n, cell_bytes // 4, 4), jnp.uint32)
    else:
        words = raw.astype(jnp.uint32)
    return jnp.sum(words, axis=-1, dtype=jnp.uint32)


def _digest(sums: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(sums, dtype="<u4").tobytes()).hexdigest()[:32]


def _host_path_ok(x: jax.Array) -> bool:
    return x.is_fully_addressable and all(d.platform == "cpu" for d in x.sharding.device_set)


_DEVICE_SUMS: dict[Any, Any] = {}


def _device_sums(x: jax.Array) -> jax.Array:
    sharding = x.sharding
    out = NamedSharding(sharding.mesh, PartitionSpec()) if isinstance(sharding, NamedSharding) else None
    key = (out,)
    fn = _DEVICE_SUMS.get(key)
    if fn is None:
        fn = _DEVICE_SUMS[key] = jax.jit(_cell_sums_device, out_shardings=out)
    return fn(x)


class PendingFingerprints:
    """Fingerprints of a list of arrays, started now and finished by `result()`.

    Starting takes what is needed so that the arrays may be donated or deleted right after:
    on CPU, zero-copy views of the device buffers (JAX then copies instead of reusing a
    donated buffer a view still points at); elsewhere, the jitted reductions are dispatched
    (JAX orders them before any later donation). `result()` may run on another thread.
    """

    def __init__(self, arrays: Sequence[jax.Array], *, on_device: bool = False):
        self._jobs: list[Any] = []
        for x in arrays:
            if np.ndim(x) < 2:
                raise ValueError(f"fingerprints cover arrays of rank >= 2 (cells are (h, n)), got shape {np.shape(x)}")
            if not on_device and isinstance(x, jax.Array) and _host_path_ok(x):
                blocks = [(s.index, np.asarray(s.data)) for s in x.addressable_shards if s.replica_id == 0]
                self._jobs.append(("host", x.shape[:2], blocks))
            elif isinstance(x, np.ndarray):
                self._jobs.append(("host", x.shape[:2], [((slice(None), slice(None)), x)]))
            else:
                self._jobs.append(("device", _device_sums(x)))

    def result(self) -> list[str]:
        """The fingerprint of each array, in order (blocks on the work; releases the views)."""
        tasks: list[tuple[np.ndarray, tuple[slice, slice], np.ndarray]] = []
        grids: list[np.ndarray] = []
        for job in self._jobs:
            if job[0] == "device":
                grids.append(np.asarray(jax.device_get(job[1]), np.uint32))
                continue
            grid = np.zeros(job[1], np.uint32)
            grids.append(grid)
            tasks.extend((grid, idx[:2], block) for idx, block in job[2])

        def run(task: tuple[np.ndarray, tuple[slice, slice], np.ndarray]) -> None:
            grid, idx, block = task
            grid[idx] = _cell_sums_host(block)

        if len(tasks) > 1:
            with ThreadPoolExecutor(max_workers=min(len(tasks), os.cpu_count() or 1)) as pool:
                list(pool.map(run, tasks))
        else:
            for task in tasks:
                run(task)
        self._jobs = []
        return [_digest(g) for g in grids]


def fingerprints(arrays: Sequence[Any], *, on_device: bool = False) -> list[str]:
    """The fingerprint of each array (jax or numpy), computed now."""
    return PendingFingerprints(arrays, on_device=on_device).result()


__all__ = [
    "FINGERPRINT_ALGORITHM",
    "CheckpointError",
    "CheckpointIntegrityError",
    "CheckpointMismatchError",
    "NotACheckpointError",
    "PendingFingerprints",
    "StepNotFoundError",
    "fingerprints",
]
