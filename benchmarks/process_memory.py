"""What a process holds, told apart from what its allocator keeps: for benchmarks that ask
"does memory grow with work done?".

RSS alone cannot answer that under glibc. Freed memory goes back to the arena it came from,
and an arena returns pages to the system only from its top: a freed block below a live one
stays resident. glibc keeps up to 8 arenas per core (a thread takes a free one, or makes one),
and its threshold for serving a block by ``mmap`` (given back on free) rises to the size of the
largest mmapped block freed so far (up to 32 MiB), so after the first large buffer is freed,
buffers of that size come from the arenas. A workload whose threads allocate and free
megabyte buffers (a checkpoint's shards: orbax's, tensorstore's and the reader's threads) so
sees RSS climb towards a ceiling of about arenas x their high-water marks while the heap in
use stays flat. ``MALLOC_ARENA_MAX=2`` or a fixed ``MALLOC_MMAP_THRESHOLD_`` keeps it flat.

So a `Census` reports, beside RSS: the bytes malloc has handed out and not got back
(``held``: blocks in use in the arenas and mmapped blocks), the free bytes it keeps
(``kept``), the live jax arrays and the Python objects the garbage collector tracks. A leak
grows ``held`` (or the arrays, or the objects); allocator warm-up grows ``kept`` only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc
from collections.abc import Callable

import jax

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33 and later): sizes in bytes, summed over every arena."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    """glibc's ``mallinfo2``, or None where the C library has none (musl, macOS, old glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    function.argtypes = []
    return function


_MALLINFO2 = _mallinfo2()


def proc_status_mib() -> dict[str, float]:
    """``VmRSS`` (all resident pages, the mapped libraries' too) and ``RssAnon`` (the process's
    own memory: heap, arenas, stacks, device buffers on CPU) from ``/proc/self/status``, MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                out[key] = int(value.split()[0]) / 1024  # kB
    return out


def malloc_mib() -> tuple[float, float] | None:
    """(held, kept) in MiB: the bytes malloc has handed out and not got back (in-use arena
    blocks and mmapped blocks), and the free bytes it keeps in its arenas; None without glibc."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return (info.uordblks + info.hblkhd) / MIB, info.fordblks / MIB


@dataclasses.dataclass(frozen=True)
class Sample:
    """A cheap reading (taken every few iterations): seconds into the run, VmRSS, RssAnon, and
    malloc's held and kept MiB (NaN without glibc)."""

    t: float
    rss: float
    anon: float
    held: float
    kept: float

    @classmethod
    def take(cls, t: float) -> Sample:
        status = proc_status_mib()
        held, kept = malloc_mib() or (float("nan"), float("nan"))
        return cls(t, status["VmRSS"], status["RssAnon"], held, kept)


@dataclasses.dataclass(frozen=True)
class Census:
    """A costly reading (a full garbage collection, then every tracked object counted): a
    `Sample`, the live jax arrays (count and MiB) and the Python objects the collector tracks."""

    sample: Sample
    arrays: int
    array_mib: float
    objects: int

    @classmethod
    def take(cls, t: float) -> Census:
        gc.collect()
        objects = len(gc.get_objects())
        arrays = jax.live_arrays()
        return cls(Sample.take(t), len(arrays), sum(a.nbytes for a in arrays) / MIB, objects)


def main(argv: list[str] | None = None) -> None:
    """Run as a script: allocate and free megabyte buffers on a few threads (what a checkpoint's
    shards do) and print RSS against malloc's bytes in use and kept, before and after. ``--quick``
    (CI) frees 64 MiB; the default 1 GiB."""
    import argparse
    import time
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB of buffers instead of 1 GiB (CI)")
    mib = 64 if ap.parse_args(argv).quick else 1024

    def churn(_: int) -> None:
        for _ in range(mib // 32):
            buf = np.ones(4 * MIB, np.uint8)  # a shard-sized buffer, allocated and freed
            del buf

    before = Census.take(time.perf_counter())
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(churn, range(8)))
    after = Census.take(time.perf_counter())
    print("| reading | before | after |\n|---|---:|---:|")
    for name in ("rss", "anon", "held", "kept"):
        print(f"| {name} (MiB) | {getattr(before.sample, name):.1f} | {getattr(after.sample, name):.1f} |")
    print(f"| live jax arrays | {before.arrays} | {after.arrays} |\n| Python objects | {before.objects} | "
          f"{after.objects} |")


__all__ = ["Census", "Sample", "malloc_mib", "proc_status_mib"]

if __name__ == "__main__":
    main()
