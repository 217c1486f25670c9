"""Tokens held per GiB of device memory by each preset's layer groups, against the same model
with every layer full attention.

Issue 12's target: the Gemma-3 pattern (5 x 1024-token sliding : 1 full) at 32k context holds
>= 4x the tokens per GiB of a uniform cache. The figures come from the sizing `create` uses: the
pages a sequence keeps in each group once pages that left its windows are released (bf16, page
size 16, tp=8 on an abstract mesh with a 16 GiB budget per device, so no devices are needed).

For presets with a sliding or chunked group, the figure is also measured with a running
`PageManager` (pure numpy, no devices; one pool per group): sequences are admitted one after another and prefilled
in chunks of ``--chunk`` tokens up to the context, the manager releasing pages as they leave
the window, until the pool cannot take one more; measured = those sequences' tokens per GiB of
the pool. Transient pages of the chunk being written make it a little lower than the sizing.

    python benchmarks/bench_groups.py [--context 32768] [--chunk 512]
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
from easykv.spec.metadata import PagedAttentionCacheMetaData  # noqa: E402
from easykv.spec.presets import PRESETS  # noqa: E402
from easykv.spec.sizing import tokens_per_gib  # noqa: E402
from sharding import PartitionAxis, PartitionManager  # noqa: E402

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
                manager.build_step_metadata([seq], [n])
                manager.advance(seq, n)
        except CacheFullError:
            manager.release(seq)
            break
        held += 1
    manager.check_invariants()
    return held, held * context / (meta.bytes_per_device / 2**30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk of the measured run")
    args = parser.parse_args()
    mesh = AbstractMesh((8,), ("tp",), axis_types=(AxisType.Auto,))
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp"))
    print(f"tokens per GiB per device at {args.context:,} context (bf16, page 16, tp=8)")
    print(f"{'preset':<18} {'groups':<44} {'grouped':>12} {'all full':>12} {'ratio':>7}")
    for name in PATTERNED:
        p = PRESETS[name]
        with warnings.catch_warnings(record=True) as adjusted:  # e.g. one latent head replicated over tp
            warnings.simplefilter("always")
            meta = PagedAttentionCacheMetaData.create(
                mesh, 8, p.layers, args.context, 16, p.num_kv_heads, p.head_dim, 0.9, "bfloat16",
                partition_manager=pm, memory_bytes_per_device=16 * 2**30, layer_groups=p.layer_groups())
        held, full = tokens_per_gib(meta, args.context), tokens_per_gib(meta, args.context, uniform=True)
        kinds = " + ".join(f"{g.num_layers} {g.attention}{'' if g.window is None else ' ' + str(g.window)}"
                           f"{' latent' if g.latent else ''}" for g in meta.groups)
        print(f"{name:<18} {kinds:<44} {held:>12,.0f} {full:>12,.0f} {held / full:>6.2f}x"
              f"{'  (heads replicated over tp)' if adjusted else ''}")
        if any(g.attention != "full" for g in meta.groups):
            run = meta.replace(batch_size=4 * meta.max_full_sequences, memory_bytes_per_device=None)
            n, measured = measured_tokens_per_gib(run, args.context, args.chunk)
            print(f"{'':<18} {'measured, running manager: ' + f'{n} sequences of {args.context:,}':<44} "
                  f"{measured:>12,.0f} {full:>12,.0f} {measured / full:>6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
