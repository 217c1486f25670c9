"""Quantizers on real-looking activations: error per data family, bytes, and decode time.

    python benchmarks/bench_quantizer_families.py
    python benchmarks/bench_quantizer_families.py --quick    # 1 draw of 64 tokens, tiny decode, 2 rounds (CI)
    python benchmarks/bench_quantizer_families.py --bounds-only --head-dims 64,576    # the bound tables alone

Families and errors are defined in tests/support/quant_families.py (the tests' bounds use the same
code): Gaussian, outlier channels (1 of 16 channels x50; 1 channel x100), Student-t with 3 degrees
of freedom. Each cell is "all channels / ordinary channels / attention" (512 tokens x 8 kv heads,
32 Gaussian queries per head, K and V from the family).

The first table is the mean of five draws on the families as they were first defined (head_dim
128, the x50 family at head_dim 64: 4 of 64 channels), with bytes and decode times. Then one table
per head_dim of --head-dims (default 64,128,256,512,576; with --quick 128) of the error bounds
docs/quantization.md states and tests/quantization/test_quantization_families.py asserts: the
largest of the draws plus 15%, rounded up to two significant digits (int4-ol only up to head_dim
256: it stores a channel index in one byte).

Decode time: attention of 32 sequences x 512 tokens (8 kv heads on tp=8, 32 q heads, head_dim
128, page_size 16) over each quantizer's pages, timed interleaved (one call per quantizer per
round, 30 rounds, median), with the rotated quantizer's time divided by its plain twin's in the
same rounds. Decode write: one token per sequence into those pages (cache.write's jitted body,
donated), timed in the same rounds; int4-ch rereads and requantizes the page each token lands in.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # for tests.support

from bench_quantization import DIM, FULL, HEADS, PAGE, QHEADS, QUICK, QUICK_HELP, decode_workload  # noqa: E402
from bench_quantization import Sizes as DecodeSizes  # noqa: E402

import easykv  # noqa: E402
from easykv.quantization import page_head_bytes  # noqa: E402
from easykv.quantization._outlier import MAX_HEAD_DIM as OUTLIER_MAX_HEAD_DIM  # noqa: E402
from easykv.storage.cache import write_all  # noqa: E402
from easykv.storage.writes import token_slots  # noqa: E402
from tests.support.quant_families import DEFAULT_DIM, FAMILIES, errors  # noqa: E402

# "int4-ch:decode": int4-ch pages filled one token per write (their scales grow as they fill).
QUANTS = ("int8", "int8-rot", "fp8", "fp8-rot", "int4", "int4-rot", "int4-asym", "int4-asym-rot", "int4-g32",
          "int4-g32-rot", "int4-g32-asym-rot", "int4-ch", "int4-ch:decode", "int4-ol", "int4-ol8")
HEAD_DIMS = (64, 128, 256, 512, 576)
MARGIN = 1.15  # a bound is the largest draw plus 15%
TIMED = ("none", "int8", "int8-rot", "int4", "int4-rot", "int4-asym", "int4-asym-rot", "int4-ch", "int4-ol")


@dataclasses.dataclass(frozen=True)
class Sizes:
    decode: DecodeSizes  # the decode workload timed
    rounds: int
    draws: int  # error draws per cell (seeds)
    tokens: int  # tokens per draw


FULL_SIZES = Sizes(FULL, rounds=30, draws=5, tokens=512)
QUICK_SIZES = Sizes(QUICK, rounds=2, draws=1, tokens=64)


@functools.cache
def draws(name: str, fam: str, head_dim: int, draws: int, tokens: int) -> tuple[dict, ...]:
    """The errors of ``draws`` draws (seeds 0, 1, ...) of quantizer ``name`` (``int4-ch:decode``:
    int4-ch filled one token per write) on family ``fam`` at ``head_dim``."""
    quant, _, mode = name.partition(":")
    return tuple(errors(easykv.get_quantizer(quant), fam, tokens=tokens, seed=seed, decode=mode == "decode",
                        head_dim=head_dim) for seed in range(draws))


KINDS = ("all", "ordinary", "attention")


def error_cells(name: str, sizes: Sizes) -> list[str]:
    cells = []
    for fam in FAMILIES:
        runs = draws(name, fam, DEFAULT_DIM[fam], sizes.draws, sizes.tokens)  # shared with the bound tables
        mean = {k: float(np.mean([r[k] for r in runs])) for k in KINDS}
        cells.append(f"{mean['all']:.3f} / {mean['ordinary']:.3f} / {mean['attention']:.3f}")
    return cells


def defined(name: str, head_dim: int) -> bool:
    """Whether quantizer ``name`` takes ``head_dim`` (int4-ol: a channel index is one byte)."""
    return not name.startswith("int4-ol") or head_dim <= OUTLIER_MAX_HEAD_DIM


def bound(x: float) -> float:
    """``x`` plus the margin, rounded up to two significant digits."""
    x *= MARGIN
    unit = 10.0 ** (math.floor(math.log10(x)) - 1)
    return float(f"{math.ceil(round(x / unit, 9)) * unit:.3g}")


def bound_cells(name: str, head_dim: int, sizes: Sizes) -> list[tuple[float, float, float]]:
    """Per family in FAMILIES order: the (all, ordinary, attention) bounds of ``name`` at ``head_dim``."""
    runs = [draws(name, fam, head_dim, sizes.draws, sizes.tokens) for fam in FAMILIES]
    return [tuple(bound(max(r[k] for r in fam_runs)) for k in KINDS) for fam_runs in runs]


def bound_table(head_dim: int, sizes: Sizes) -> None:
    """The bound table of ``head_dim`` as docs/quantization.md shows it."""
    print(f"head_dim {head_dim}: largest of {sizes.draws} draws of {sizes.tokens} tokens plus 15% "
          f"(x50 family: {head_dim // 16} of {head_dim} channels)\n")
    print("| quantizer | Gaussian | outliers 1/16 x50 | outliers 1 x100 | Student-t3 |")
    print("|---|---|---|---|---|")
    for name in QUANTS:
        if defined(name, head_dim):
            cells = [" / ".join(f"{b:g}" for b in cell) for cell in bound_cells(name, head_dim, sizes)]
            print(f"| {LABELS.get(name, f'`{name}`')} | " + " | ".join(cells) + " |")
    print()


LABELS = {"int4-ch": "`int4-ch`, pages written whole", "int4-ch:decode": "`int4-ch`, one token per write"}


def timed_calls(name: str, workload: tuple, d: DecodeSizes) -> tuple:
    """(decode attention, decode write) of quantizer ``name``, compiled: the attention reads the
    pages of the workload's tokens; the write puts one token per sequence (cache.write's jitted
    body, donated: each call writes into the last call's pages)."""
    mesh, pm, table, k, v, q, num_pages = workload
    n, length = d.seqs, d.length
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, n, 1, length, PAGE, HEADS, DIM, 0.9, jnp.bfloat16, partition_manager=pm, quantizer=name,
        num_pages_per_layer=num_pages)  # fmt: skip
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm, quantizer=name)
    cache, _ = cache.write(k, v, easykv.PagedAttentionMetadata.for_mixed(table, [0] * n, [length] * n,
                                                                         cache_metadata=meta))
    decode = easykv.PagedAttentionMetadata.for_decode(table, [length - 1] * n, cache_metadata=meta)
    view = cache[0]

    def attend():
        return easykv.view_attention(q, view, decode)

    step = easykv.PagedAttentionMetadata.for_decode(table, [length - 2] * n, cache_metadata=meta)
    slots = (jax.device_put(np.asarray(token_slots(step, meta))),)
    held = [easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm, quantizer=name)]
    new_token = jnp.asarray(np.random.default_rng(9).normal(size=(1, n, HEADS, DIM)), jnp.bfloat16)

    def write():
        held[0], _ = write_all(held[0], new_token, new_token, slots)
        return held[0]

    jax.block_until_ready((attend(), write()))  # compile
    return attend, write


def decode_times(sizes: Sizes) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms of decode attention, and of a decode step's write, per quantizer in TIMED, every
    round timing each once, in turn."""
    workload = decode_workload(1, sizes.decode)
    fns = {name: timed_calls(name, workload, sizes.decode) for name in TIMED}
    samples: dict[str, list[float]] = {name: [] for name in TIMED}
    written: dict[str, list[float]] = {name: [] for name in TIMED}
    for _ in range(sizes.rounds):
        for name, (attend, write) in fns.items():
            for fn, into in ((attend, samples[name]), (write, written[name])):
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                into.append(time.perf_counter() - t0)
    median = lambda d: {name: float(np.median(s)) * 1e3 for name, s in d.items()}  # noqa: E731
    return median(samples), median(written)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    parser.add_argument("--head-dims", type=lambda s: [int(d) for d in s.split(",")],
                        help=f"head_dims of the bound tables, comma-separated (default "
                             f"{','.join(map(str, HEAD_DIMS))}; with --quick 128)")
    parser.add_argument("--bounds-only", action="store_true",
                        help="only the bound tables (no bytes, decode times or mean table)")
    args = parser.parse_args()
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    head_dims = args.head_dims or ((128,) if args.quick else HEAD_DIMS)
    if not args.bounds_only:
        main_table(sizes)
        print()
    for head_dim in head_dims:
        bound_table(head_dim, sizes)


def main_table(sizes: Sizes) -> None:
    times, write_times = decode_times(sizes)
    d = sizes.decode
    print(f"errors: all / ordinary / attention, mean of {sizes.draws} draws of {sizes.tokens} tokens; decode: "
          f"{d.seqs} x {d.length} tokens, {HEADS} kv heads (tp=8), {QHEADS} q heads, head_dim {DIM}, median of "
          f"{sizes.rounds} interleaved rounds\n")
    print("| quantizer | bytes per token-head (head_dim 128, page_size 16) | tokens vs bf16 | "
          + " | ".join(FAMILIES) + " | decode attention | decode write |")
    print("|---" * (5 + len(FAMILIES)) + "|")
    bf16 = 2 * DIM
    for name in ("none",) + QUANTS:
        q = easykv.get_quantizer(name.partition(":")[0])
        per = page_head_bytes(q, PAGE, DIM, np.dtype("bfloat16")) / PAGE
        cells = ["0 / 0 / 0"] * len(FAMILIES) if name == "none" else error_cells(name, sizes)
        timed = [f"{t[name]:.2f} ms" if name in t else "" for t in (times, write_times)]
        label = "bf16" if name == "none" else name
        print(f"| {label} | {per:g} B | {bf16 / per:.2f}x | " + " | ".join(cells) + f" | {' | '.join(timed)} |")
    print()
    for plain in ("int8", "int4", "int4-asym"):
        print(f"decode time {plain}-rot / {plain}: {times[plain + '-rot'] / times[plain]:.2f}x (target <= 1.3x)")
    print(f"int4-ch / int4: decode attention {times['int4-ch'] / times['int4']:.2f}x, decode write "
          f"{write_times['int4-ch'] / write_times['int4']:.2f}x "
          f"(a write rereads and requantizes the pages it lands in)")
    print(f"int4-ol / int4: decode attention {times['int4-ol'] / times['int4']:.2f}x, decode write "
          f"{write_times['int4-ol'] / write_times['int4']:.2f}x (outliers found per token, decoded elementwise)")


if __name__ == "__main__":
    main()
