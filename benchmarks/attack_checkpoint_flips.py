"""Byte-flip attack on a checkpoint: flip one bit of every byte of every file, restore, classify.

    python benchmarks/attack_checkpoint_flips.py [--all-bits] [--every N] [--dir /tmp/easykv-flips]
    python benchmarks/attack_checkpoint_flips.py --quick    # a few bytes per file: a smoke run (CI)

The checkpoint is the test suite's flip fixture (tests/support/checkpoints.py `flip_fixture`: 2
layers of 8 random pages over tp=2, a PageManager with sequences, prefix pages, a pending copy
and a pending scrub), saved by `save_cache`: orbax's files (_METADATA, _CHECKPOINT_METADATA,
_sharding, array_metadatas, .zarray, chunk files, commit markers) and easykv's (marker, writer
lock, record, manager state). For each byte one bit is flipped (bit = position mod 8; with
``--all-bits`` all 8, one at a time) and the latest step is restored with verification on.

A flip must end in one of two ways: the restore raises a CheckpointError (almost always
CheckpointIntegrityError), or it returns a cache whose every array is bit-identical and a
manager whose state_dict is equal (the byte was one no restore reads, or orbax reads it to
the same effect). "SILENT" (different data returned) and "RAW ..." (another exception type)
are failures; the script exits 1 if it saw any. Prints a markdown table of counts per file and
outcome. tests/checkpoint/test_checkpoint_integrity.py runs a sample of the same flips in the
suite. About 30 ms per restore: the default sweep (~12,000 flips) takes a few minutes.
``--quick`` flips a few bytes spread over each file (first and last included) in a temporary
directory that is removed afterwards: every file is still attacked, in seconds.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# The flips are the suite's own (tests.support, from the repository root), so the sweep and the
# tests agree.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from easykv.checkpoint.checkpointer import save_cache  # noqa: E402
from tests.support.checkpoints import file_kind, flip_fixture, flip_outcome, raw_leaves  # noqa: E402

QUICK_BYTES_PER_FILE = 16


def positions(size: int, every: int, quick: bool) -> list[int]:
    """Byte positions of a file to attack: every ``every``-th, or (quick) a few spread evenly."""
    if not quick:
        return list(range(0, size, every))
    n = min(size, QUICK_BYTES_PER_FILE)
    return sorted({round(i * (size - 1) / max(n - 1, 1)) for i in range(n)})


def sweep(directory: Path, args, want) -> tuple[dict, dict, dict, int]:
    """Flip each chosen bit of each file in turn and restore: (counts per file kind and outcome,
    bytes per kind, one example per failing kind and outcome, flips)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    sizes: dict[str, int] = collections.Counter()
    examples: dict[str, str] = {}
    total = 0
    for path in files:
        kind = file_kind(path, directory)
        size = path.stat().st_size
        sizes[kind] += size
        for position in positions(size, args.every, args.quick):
            for bit in range(8) if args.all_bits else (position % 8,):
                outcome = flip_outcome(directory, path, position, bit, *want)
                key = outcome if not outcome.startswith("RAW") else "RAW " + outcome.split(":")[0][4:]
                counts[kind][key] += 1
                total += 1
                if key in ("SILENT",) or key.startswith("RAW"):
                    examples.setdefault(f"{kind} {key}", f"{path.relative_to(directory)} byte {position} bit {bit}: "
                                                         f"{outcome}")
        print(f"  {str(path.relative_to(directory)):<44} {kind:<34} {dict(counts[kind])}", file=sys.stderr,
              flush=True)
    return counts, sizes, examples, total


def report(counts: dict, sizes: dict, examples: dict, total: int, files: int, seconds: float) -> int:
    outcomes = sorted({k for c in counts.values() for k in c})
    print(f"\n{total} flips over {files} files ({sum(sizes.values())} bytes) in {seconds:.0f} s "
          f"({1000 * seconds / max(total, 1):.1f} ms per restore)\n")
    print("| file | bytes | " + " | ".join(outcomes) + " |")
    print("|---|---:|" + "---:|" * len(outcomes))
    for kind in sorted(counts):
        print(f"| {kind} | {sizes[kind]} | " + " | ".join(str(counts[kind].get(o, 0)) for o in outcomes) + " |")
    totals = collections.Counter()
    for c in counts.values():
        totals.update(c)
    print("| **all** | " + str(sum(sizes.values())) + " | " + " | ".join(f"**{totals.get(o, 0)}**" for o in outcomes)
          + " |")
    bad = {k: v for k, v in totals.items() if k == "SILENT" or k.startswith("RAW")}
    for line in examples.values():
        print("FAIL", line)
    print("\nresult:", "FAIL " + str(bad) if bad else "every flip was detected or harmless")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_BYTES_PER_FILE} bytes per file in a temporary directory: checks the script runs "
                             "(CI); counts meaningless")
    parser.add_argument("--dir", default=None, help="where the checkpoint is written (default /tmp/easykv-flips; "
                                                    "--quick: a temporary directory, removed afterwards)")
    parser.add_argument("--all-bits", action="store_true", help="flip each of the 8 bits of every byte")
    parser.add_argument("--every", type=int, default=1, help="attack every N-th byte only")
    args = parser.parse_args()
    logging.getLogger("absl").setLevel(logging.CRITICAL)  # orbax logs each damaged file it meets
    sys.unraisablehook = lambda _: None  # ...and drops coroutines that would print their errors
    scratch = args.dir is None and args.quick
    directory = Path(tempfile.mkdtemp(prefix="easykv-flips-") if scratch else args.dir or "/tmp/easykv-flips")
    try:
        shutil.rmtree(directory, ignore_errors=True)
        cache, manager, mesh, pm = flip_fixture()
        save_cache(directory, cache, manager)
        want = (mesh, pm, raw_leaves(cache), manager.state_dict(), cache.metadata)
        files = sum(1 for p in directory.rglob("*") if p.is_file())
        start = time.perf_counter()
        counts, sizes, examples, total = sweep(directory, args, want)
        return report(counts, sizes, examples, total, files, time.perf_counter() - start)
    finally:
        if scratch:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
