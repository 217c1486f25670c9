"""Byte-flip attack on a checkpoint: flip one bit of every byte of every file, restore, classify.

    python benchmarks/attack_checkpoint_flips.py [--all-bits] [--every N] [--dir /tmp/easykv-flips]

The checkpoint is the test suite's flip fixture (tests/checkpoint_helpers.py `flip_fixture`: 2
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
outcome. tests/test_checkpoint_integrity.py runs a sample of the same flips in the suite.
About 30 ms per restore: the default sweep (~12,000 flips) takes a few minutes.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from checkpoint_helpers import file_kind, flip_fixture, flip_outcome, raw_leaves  # noqa: E402
from easykv.checkpoint.checkpointer import save_cache  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/easykv-flips")
    parser.add_argument("--all-bits", action="store_true", help="flip each of the 8 bits of every byte")
    parser.add_argument("--every", type=int, default=1, help="attack every N-th byte only (quick runs)")
    args = parser.parse_args()
    logging.getLogger("absl").setLevel(logging.CRITICAL)  # orbax logs each damaged file it meets
    sys.unraisablehook = lambda _: None  # ...and drops coroutines that would print their errors
    directory = Path(args.dir)
    shutil.rmtree(directory, ignore_errors=True)
    cache, manager, mesh, pm = flip_fixture()
    save_cache(directory, cache, manager)
    want_bits, want_state, want_meta = raw_leaves(cache), manager.state_dict(), cache.metadata
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    sizes: dict[str, int] = collections.Counter()
    examples: dict[str, str] = {}
    start = time.perf_counter()
    total = 0
    for path in files:
        kind = file_kind(path, directory)
        size = path.stat().st_size
        sizes[kind] += size
        for position in range(0, size, args.every):
            for bit in range(8) if args.all_bits else (position % 8,):
                outcome = flip_outcome(directory, path, position, bit, mesh, pm, want_bits, want_state, want_meta)
                key = outcome if not outcome.startswith("RAW") else "RAW " + outcome.split(":")[0][4:]
                counts[kind][key] += 1
                total += 1
                if key in ("SILENT",) or key.startswith("RAW"):
                    examples.setdefault(f"{kind} {key}", f"{path.relative_to(directory)} byte {position} bit {bit}: "
                                                         f"{outcome}")
        print(f"  {str(path.relative_to(directory)):<44} {kind:<34} {dict(counts[kind])}", file=sys.stderr,
              flush=True)
    seconds = time.perf_counter() - start
    outcomes = sorted({k for c in counts.values() for k in c})
    print(f"\n{total} flips over {len(files)} files ({sum(sizes.values())} bytes) in {seconds:.0f} s "
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


if __name__ == "__main__":
    raise SystemExit(main())
