"""Checkpoint throughput: easykv's orbax save/restore of a paged pool vs plain numpy, at several sizes.

    python benchmarks/bench_checkpoint.py [--gib 0.25,0.5,1,2,4] [--repeats 12] [--dir /tmp/easykv-bench-checkpoint]
    python benchmarks/bench_checkpoint.py --quick    # a 16 MiB pool, 2 repeats, a temporary directory (CI)

For each size, a bf16 pool of that many GiB (8 layers, 8 kv heads, head_dim 128, page_size 16)
on 8 simulated CPU devices, kv heads sharded over tp=8. A warm-up repeat (compiles, first
touches) is not counted; then per repeat, interleaved so that machine noise hits every row alike
(medians reported, with the 25th-75th percentiles: on a disk the times are bimodal, as the
kernel's writeback of earlier repeats sometimes overlaps a write; ``--dir /dev/shm/...`` takes the
disk out and leaves the CPU cost):

* save:    ``save_cache`` (blocking: until committed) with integrity on and off, and ``np.save``
           of every array (device -> host copy included) into its own file, with ``fsync``;
* restore: ``restore_cache`` onto the same mesh (verify on and off) vs ``np.load`` +
           ``jax.device_put`` with the cache's sharding (the two parts timed apart too: the
           baseline's speed per byte changes with the size, and the parts say where);
* async:   how long ``CacheCheckpointer.save`` takes to return, and until committed;
* fingerprints: computed alone, for reference.

What a user waits for is the wall time of the call: the integrity cost reported is a blocking
save with integrity on against the same save with it off (issue 42: within 10% at 512 MiB and
1 GiB), not the fingerprints timed alone. A summary table gives every size side by side.

Targets (issue 34): a verified restore and an async save's commit at least 0.8x the numpy
figures; a 4 GiB pool saved on dp=2 x tp=4 and restored onto tp=8 (``--reshard-gib``) staging at
most 1.2x its largest shard in host memory. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from easykv import PagedAttentionCache, PagedAttentionCacheMetaData  # noqa: E402
from easykv.checkpoint.checkpointer import CacheCheckpointer, restore_cache, save_cache  # noqa: E402
from easykv.checkpoint.integrity import fingerprints  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager, ShardingAdjustedWarning, create_mesh  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE_SIZE = 8, 8, 128, 16


def build_cache(gib: float, dims=None, axis=None):
    mesh = create_mesh(dims or {"dp": 1, "tp": 8})
    pm = PartitionManager(axis or PartitionAxis())
    page_bytes = 2 * HEADS * PAGE_SIZE * HEAD_DIM * 2  # K and V, bf16, one layer
    pages = max(8, int(gib * 2**30 / (page_bytes * LAYERS)) // 8 * 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        # max length capped at a data-parallel slice: create refuses a pool that cannot hold one sequence
        longest = min(4096, pages // mesh.shape.get("dp", 1) * PAGE_SIZE)
        meta = PagedAttentionCacheMetaData.create(
            mesh, 32, LAYERS, longest, PAGE_SIZE, HEADS, HEAD_DIM, 0.9, "bfloat16",
            partition_manager=pm, num_pages_per_layer=pages,
        )  # fmt: skip
        cache = PagedAttentionCache.init_cache(mesh, meta.dtype, meta, pm)
    # Random bits in every page (zeros would flatter any format that compresses), made on the
    # devices with the cache's own shardings.
    leaves = [jax.jit(lambda k, x=x: jax.random.bits(k, x.shape, x.dtype), out_shardings=x.sharding)(jax.random.key(i))
              for i, x in enumerate(jax.tree.leaves(cache))]
    cache = jax.tree.unflatten(jax.tree.structure(cache), leaves)
    jax.block_until_ready(cache)
    return mesh, pm, cache


def numpy_save(directory: str, leaves) -> None:
    os.makedirs(directory, exist_ok=True)
    for i, x in enumerate(leaves):
        with open(os.path.join(directory, f"{i}.npy"), "wb") as f:
            np.save(f, np.asarray(x))
            f.flush()
            os.fsync(f.fileno())


def numpy_load(directory: str, leaves) -> tuple[float, float]:
    """np.load of every array, then jax.device_put with the cache's sharding: the seconds of each part."""
    t0 = time.perf_counter()
    hosts = [np.load(os.path.join(directory, f"{i}.npy")) for i in range(len(leaves))]
    t1 = time.perf_counter()
    jax.block_until_ready([jax.device_put(h, x.sharding) for h, x in zip(hosts, leaves)])
    return t1 - t0, time.perf_counter() - t1


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


ROWS = ("np_save", "save", "save_noint", "async_return", "async_total", "np_load", "np_load_read", "np_load_put",
        "restore", "restore_noverify", "fingerprint")


def one_repeat(root: str, r: int, mesh, pm, cache, rows: dict[str, list[float]]) -> None:
    """Every operation once, appending its seconds to ``rows``; saves and loads rotate so that no
    row always follows the same one (this machine's disk is throttled: a 1 GiB write right after
    others can take 4x as long, so a fixed order would bill one row for the writes before it)."""
    leaves = jax.tree.leaves(cache)

    def async_save() -> float:  # the call's seconds recorded here; returns those until committed
        ckpt = CacheCheckpointer(f"{root}/ck_async")
        t0 = time.perf_counter()
        ckpt.save(cache, step=r)
        rows["async_return"].append(time.perf_counter() - t0)
        ckpt.wait_until_finished()
        total = time.perf_counter() - t0
        ckpt.close()
        return total

    saves = [
        ("np_save", lambda: numpy_save(f"{root}/np", leaves)),
        ("save", lambda: save_cache(f"{root}/ck", cache, step=r)),
        ("save_noint", lambda: save_cache(f"{root}/ck_noint", cache, step=r, integrity=False)),
        ("async_total", None),
    ]
    for name, fn in saves[r % 4:] + saves[: r % 4]:
        rows[name].append(async_save() if fn is None else timed(fn)[0])
    rows["fingerprint"].append(timed(lambda: fingerprints(leaves))[0])
    def np_load() -> float:
        read, put = numpy_load(f"{root}/np", leaves)
        rows["np_load_read"].append(read)
        rows["np_load_put"].append(put)
        return read + put

    loads = [
        ("np_load", None),
        ("restore", lambda: jax.block_until_ready(restore_cache(f"{root}/ck", mesh=mesh, partition_manager=pm,
                                                                 step=r).cache)),
        ("restore_noverify", lambda: jax.block_until_ready(restore_cache(
            f"{root}/ck", mesh=mesh, partition_manager=pm, step=r, verify=False).cache)),
    ]
    for name, fn in loads[r % 3:] + loads[: r % 3]:
        rows[name].append(np_load() if fn is None else timed(fn)[0])
    for d in ("ck", "ck_noint", "ck_async"):  # keep disk use to one copy per format
        shutil.rmtree(f"{root}/{d}/{r}", ignore_errors=True)


# ---- host memory of a restore onto another mesh ---------------------------------------------------
def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def restore_child(directory: str) -> None:
    """In a fresh process: restore ``directory`` onto tp=8 and print its host memory as JSON."""
    import json

    mesh, pm = create_mesh({"tp": 8}), PartitionManager(PartitionAxis())
    jax.block_until_ready(jax.device_put(np.zeros(8, np.float32)))  # the runtime up before the baseline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base, base_anon = _status_mib("VmRSS"), _status_mib("RssAnon")
    # VmHWM counts file pages mapped into the process (the runtime's libraries; easykv's reader
    # reads the chunk files with preadv, mapping none) with anonymous memory; a sampler finds the
    # peak of the anonymous part alone.
    peak_anon, done = [base_anon], threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak_anon[0] = max(peak_anon[0], _status_mib("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    restored = restore_cache(directory, mesh=mesh, partition_manager=pm)
    leaves = jax.block_until_ready(jax.tree.leaves(restored.cache))
    seconds = time.perf_counter() - t0
    anon = max(peak_anon[0], _status_mib("RssAnon"))  # the restored pages are still held: a floor
    vm_peak = _status_mib("VmHWM")
    held = sum(s.data.nbytes for x in leaves for s in x.addressable_shards) / 2**20
    shard = max(s.data.nbytes for x in leaves for s in x.addressable_shards) / 2**20
    # The first donated write after the restore (one value of every array): in place when the
    # restored buffers are XLA's own (a buffer XLA:CPU merely adopted would be copied here).
    del restored
    write = jax.jit(lambda t: [x.at[(0,) * x.ndim].set(jnp.zeros((), x.dtype)) for x in t], donate_argnums=0)
    leaves = jax.block_until_ready(write(leaves))
    done.set()
    sampler.join()
    anon_write = max(peak_anon[0], _status_mib("RssAnon"))
    print(json.dumps({"base": base, "peak": vm_peak, "final": _status_mib("VmRSS"), "held": held,
                      "anon": anon - base_anon, "anon_write": anon_write - base_anon, "shard": shard,
                      "seconds": seconds}))


def reshard_memory(root: str, gib: float) -> dict:
    """Save a ``gib`` pool from dp=2 x tp=4 (pages over dp), then restore it onto tp=8 in a fresh
    process; the child's host memory (MiB) and the largest chunk file of the step."""
    import json
    import subprocess

    _, _, cache = build_cache(gib, {"dp": 2, "tp": 4}, PartitionAxis(page_axis="dp"))
    save_cache(f"{root}/reshard", cache, step=0)
    del cache
    chunks = [p for p in Path(f"{root}/reshard/0/pages").rglob("*") if p.is_file() and p.name[0].isdigit()]
    out = subprocess.run([sys.executable, __file__, "--restore-child", f"{root}/reshard"], check=True,
                         capture_output=True, text=True).stdout
    mem = json.loads(out.strip().splitlines()[-1])
    mem["chunk"] = max(p.stat().st_size for p in chunks) / 2**20
    shutil.rmtree(f"{root}/reshard", ignore_errors=True)
    return mem


def report_memory(mem: dict, gib: float) -> None:
    staging = mem["peak"] - mem["base"] - mem["held"]
    largest = max(mem["shard"], mem["chunk"])
    print(f"\n### Restore of a {gib:.2f} GiB pool saved on dp=2 x tp=4 onto tp=8 (a fresh process)\n")
    print("| measure | MiB |")
    print("|---|---:|")
    print(f"| restored pages held (on CPU the devices' memory is the host's) | {mem['held']:.0f} |")
    print(f"| largest shard read: target shard / saved chunk file | {mem['shard']:.0f} / {mem['chunk']:.0f} |")
    print(f"| peak RSS growth during the restore | {mem['peak'] - mem['base']:.0f} |")
    print(f"| of it beyond the restored pages (staging) | {staging:.0f} ({staging / largest:.2f}x the largest "
          f"shard; target <= 1.2x) |")
    anon = mem["anon"] - mem["held"]
    print(f"| of the staging, anonymous memory (the rest: mapped files; sampled every 2 ms) | "
          f"{anon:.0f} ({anon / largest:.2f}x) |")
    print(f"| restore time | {mem['seconds']:.2f} s |")
    print(f"| anonymous memory through the first donated write after it (in place: 1.00x) | "
          f"{mem['anon_write']:.0f} ({mem['anon_write'] / mem['held']:.2f}x the restored pages) |")


def report(rows: dict[str, list[float]], nbytes: int, repeats: int) -> dict[str, float]:
    """The table of one pool size; returns the medians."""
    med = {k: statistics.median(v) for k, v in rows.items()}
    gb = nbytes / 1e9

    def row(label: str, key: str, base: str | None = None, target: str = "", digits: int = 2) -> None:
        q1, _, q3 = statistics.quantiles(rows[key], n=4) if len(rows[key]) > 1 else (med[key],) * 3
        ratio = f"{med[base] / med[key]:.2f}x" if base else ""
        speed = f"{gb / med[key]:.2f}" if key != "async_return" else ""  # the call moves no bytes
        print(f"| {label} | {med[key]:.{digits}f} | {q1:.{digits}f}-{q3:.{digits}f} | {speed} | {ratio} | {target} |")

    print(f"\n### Checkpoint of a {nbytes / 2**30:.2f} GiB pool (8 CPU devices, tp=8; median of {repeats})\n")
    print("| operation | time (s) | 25th-75th | GB/s | vs numpy | target |")
    print("|---|---:|---:|---:|---:|---|")
    row("np.save + fsync (baseline)", "np_save", "np_save")
    row("save_cache (blocking, integrity on)", "save", "np_save")
    row("save_cache, integrity off", "save_noint", "np_save")
    row("async save: call returns", "async_return", digits=3)
    row("async save: committed (integrity on)", "async_total", "np_save", ">= 0.8x")
    row("np.load + device_put (baseline)", "np_load", "np_load")
    row("of it np.load", "np_load_read")
    row("of it device_put", "np_load_put")
    row("restore_cache (verify on)", "restore", "np_load", ">= 0.8x")
    row("restore_cache, verify off", "restore_noverify", "np_load")
    row("fingerprints alone (all arrays)", "fingerprint", digits=3)
    print(f"\nintegrity cost, what a user waits for: a blocking save with integrity on vs off = "
          f"{integrity_cost(med):+.1f}% (target within 10%); the fingerprints alone take "
          f"{100 * med['fingerprint'] / med['save']:.1f}% of the save time; restore verify on vs off = "
          f"{100 * (med['restore'] - med['restore_noverify']) / med['restore_noverify']:+.1f}%")
    return med


def integrity_cost(med: dict[str, float]) -> float:
    """The wall time a blocking save gains with integrity on, in percent of the save with it off."""
    return 100 * (med["save"] - med["save_noint"]) / med["save_noint"]


def report_sizes(results: list[tuple[int, dict[str, float]]]) -> None:
    """Every pool size side by side: the integrity cost of a save and the restore against numpy."""
    print("\n### Across pool sizes (medians)\n")
    print("| pool | save on / off (s) | integrity cost | np.load + device_put (s) | of it np.load | "
          "baseline GB/s | verified restore (s) | restore vs numpy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for nbytes, med in results:
        print(f"| {nbytes / 2**30:.2f} GiB | {med['save']:.2f} / {med['save_noint']:.2f} | {integrity_cost(med):+.1f}% "
              f"| {med['np_load']:.2f} | {med['np_load_read']:.2f} | {nbytes / 1e9 / med['np_load']:.2f} | "
              f"{med['restore']:.2f} | {med['np_load'] / med['restore']:.2f}x |")


def sizes(text: str) -> list[float]:
    """``--gib``: one size or several, comma-separated, each > 0."""
    try:
        out = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of GiB (e.g. 0.25,0.5,1)") from None
    if not out or not all(0 < g < 1024 for g in out):
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be > 0 and < 1024 GiB")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a 16 MiB pool, 2 repeats, a temporary directory: checks the script runs (CI); numbers "
                         "meaningless")
    ap.add_argument("--gib", type=sizes, default=None,
                    help="pool sizes in GiB, comma-separated (default 0.25,0.5,1,2,4; --quick: 1/64)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="counted repeats per size (default 12: each save and load as often in every position of "
                         "the rotation; --quick: 2)")
    ap.add_argument("--reshard-gib", type=float, default=None,
                    help="pool saved on dp=2 x tp=4 and restored onto tp=8 in a fresh process, its host memory "
                         "measured (default 4.0; --quick: 1/64; 0 skips)")
    ap.add_argument("--restore-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help="scratch directory, removed afterwards (default "
                                                "/tmp/easykv-bench-checkpoint; --quick: a temporary one)")
    args = ap.parse_args(argv)
    if args.restore_child:
        restore_child(args.restore_child)
        return
    reshard_gib = args.reshard_gib if args.reshard_gib is not None else (1 / 64 if args.quick else 4.0)
    gibs = args.gib or ([1 / 64] if args.quick else [0.25, 0.5, 1.0, 2.0, 4.0])
    repeats = args.repeats or (2 if args.quick else 12)
    root = args.dir or (tempfile.mkdtemp(prefix="easykv-bench-checkpoint-") if args.quick
                        else "/tmp/easykv-bench-checkpoint")
    shutil.rmtree(root, ignore_errors=True)
    results = []
    try:
        for gib in gibs:
            mesh, pm, cache = build_cache(gib)
            leaves = jax.tree.leaves(cache)
            nbytes = sum(x.nbytes for x in leaves)
            print(f"pool: {nbytes / 2**30:.2f} GiB in {len(leaves)} arrays of {leaves[0].shape} {leaves[0].dtype}, "
                  f"{len(jax.devices())} CPU devices, {os.cpu_count()} cores", file=sys.stderr)
            one_repeat(root, repeats, mesh, pm, cache, {k: [] for k in ROWS})  # warm-up, not counted
            rows: dict[str, list[float]] = {k: [] for k in ROWS}
            for r in range(repeats):
                one_repeat(root, r, mesh, pm, cache, rows)
            results.append((nbytes, report(rows, nbytes, repeats)))
            del cache, leaves
            shutil.rmtree(root, ignore_errors=True)
        report_sizes(results)
        if reshard_gib > 0:
            report_memory(reshard_memory(root, reshard_gib), reshard_gib)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
