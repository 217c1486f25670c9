"""Tokens held per GiB of device memory by each preset's layer groups, against the same model
with every layer full attention.

Issue 12's target: the Gemma-3 pattern (5 x 1024-token sliding : 1 full) at 32k context holds
>= 4x the tokens per GiB of a uniform cache. The figures come from the sizing `create` uses: the
pages a sequence keeps in each group once pages that left its windows are released (bf16, page
size 16, tp=8 on an abstract mesh with a 16 GiB budget per device (``--memory-gib``), so no
devices are needed).

For presets with a sliding or chunked group, the figure is also measured with a running
`PageManager` (pure numpy, no devices; one pool per group): sequences are admitted one after another and prefilled
in chunks of ``--chunk`` tokens up to the context, the manager releasing pages as they leave
the window, until the pool cannot take one more; measured = those sequences' tokens per GiB of
the pool. Transient pages of the chunk being written make it a little lower than the sizing.

    python benchmarks/bench_groups.py [--context 32768] [--chunk 512] [--memory-gib 16]
    python benchmarks/bench_groups.py --quick    # 8k context, 1 GiB per device (CI)
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jax.sharding import AbstractMesh, AxisType  # noqa: E402

from easykv.errors import CacheFullError  # noqa: E402
from easykv.manager.manager import PageManager  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager  # noqa: E402
from easykv.spec.metadata import PagedAttentionCacheMetaData  # noqa: E402
from easykv.spec.presets import PRESETS  # noqa: E402
from easykv.spec.sizing import tokens_per_gib  # noqa: E402

PATTERNED = ("gemma-2-9b", "gemma-3-27b", "gpt-oss-20b", "llama-4-scout", "mistral-7b-v0.1", "deepseek-v3")


def measured_tokens_per_gib(meta: PagedAttentionCacheMetaData, context: int, chunk: int) -> tuple[int, float]:
    """(sequences held at ``context`` tokens, their tokens per GiB of the pool) with a running
    manager; see the module doc."""
    manager = PageManager(meta, enable_prefix_caching=False)
    held = 0
    while manager.slots_remaining:
        [seq] = manager.claim(1)
        try:
            while manager.length(seq) < context:
                n = min(chunk, context - manager.length(seq))
                manager.commit(manager.schedule([seq], [n]))
        except CacheFullError:
            manager.release(seq)
            break
        held += 1
    manager.check_invariants()
    return held, held * context / (meta.bytes_per_device / 2**30)


def preset_rows(name: str, mesh, pm, context: int, chunk: int, memory: int) -> None:
    """Print a preset's sizing row, and for a patterned one the running manager's row."""
    p = PRESETS[name]
    with warnings.catch_warnings(record=True) as adjusted:  # e.g. one latent head replicated over tp
        warnings.simplefilter("always")
        meta = PagedAttentionCacheMetaData.create(
            mesh, 8, p.layers, context, 16, p.num_kv_heads, p.head_dim, 0.9, "bfloat16",
            partition_manager=pm, memory_bytes_per_device=memory, layer_groups=p.layer_groups())
    held, full = tokens_per_gib(meta, context), tokens_per_gib(meta, context, uniform=True)
    kinds = " + ".join(f"{g.num_layers} {g.attention}{'' if g.window is None else ' ' + str(g.window)}"
                       f"{' latent' if g.latent else ''}" for g in meta.groups)
    print(f"{name:<18} {kinds:<44} {held:>12,.0f} {full:>12,.0f} {held / full:>6.2f}x"
          f"{'  (heads replicated over tp)' if adjusted else ''}")
    if any(g.attention != "full" for g in meta.groups):
        run = meta.replace(batch_size=4 * meta.max_full_sequences, memory_bytes_per_device=None)
        n, measured = measured_tokens_per_gib(run, context, chunk)
        print(f"{'':<18} {'measured, running manager: ' + f'{n} sequences of {context:,}':<44} "
              f"{measured:>12,.0f} {full:>12,.0f} {measured / full:>6.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="8192-token context, 1024-token chunks, 1 GiB per device: checks the script runs (CI); "
                             "numbers meaningless")
    parser.add_argument("--context", type=int, default=None, help="default 32768; --quick: 8192")
    parser.add_argument("--chunk", type=int, default=None, help="prefill chunk of the measured run (default 512; "
                                                                "--quick: 1024)")
    parser.add_argument("--memory-gib", type=float, default=None, help="per device (default 16; --quick: 1)")
    args = parser.parse_args()
    context = args.context or (8192 if args.quick else 32768)
    chunk = args.chunk or (1024 if args.quick else 512)
    memory = int((args.memory_gib or (1 if args.quick else 16)) * 2**30)
    mesh = AbstractMesh((8,), ("tp",), axis_types=(AxisType.Auto,))
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp"))
    print(f"tokens per GiB per device at {context:,} context (bf16, page 16, tp=8, {memory / 2**30:g} GiB per device)")
    print(f"{'preset':<18} {'groups':<44} {'grouped':>12} {'all full':>12} {'ratio':>7}")
    for name in PATTERNED:
        preset_rows(name, mesh, pm, context, chunk, memory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
