"""EasyDeL 0.3's eSurge engine on EasyDeL's own ragged-page cache vs on easykv's (use_easykv).

    . /work/venv-easydel/bin/activate && python benchmarks/bench_easydel.py [--dtype bfloat16,float32] [--rounds 5]
    python benchmarks/bench_easydel.py --quick    # 4 requests x 8 tokens, 4 at once, 16-token steps, float32 (CI)

EasyDeL is an optional extra (``pip install -e '.[easydel]'``): without it, ``--quick`` says it
skipped and exits 0, so the CI environment without EasyDeL passes; a full run fails. With it,
``--quick`` still takes a minute or more: eSurge compiles every bucket of both engines, and each
serve ends with eSurge's terminate, which waits 5 s for its scheduler thread (see ``stop``).

The tiny EasyDeL Llama of tests_easydel (2 layers, 16 q / 8 kv heads of 8 dims, random weights
from seed 0) on 8 simulated CPU devices (kv heads over tp=8), ragged_page_attention_v3, the same
pool (256 pages of 16 tokens) and the same eSurge settings for both caches (8 sequences at once,
64-token step budget, max length 512). The same 16 requests (prompts of 4..60 tokens, 64 new
tokens each, greedy, EOS ignored, prefix caching off) are served ``--rounds`` times by each
engine after one warm-up round, rounds interleaved (EasyDeL, easykv, EasyDeL, ...; only the
serving engine's scheduler thread runs). Reported: median generated tokens / second over the
rounds (wall time of ``eSurge.generate``); compile time of ``eSurgeRunner.compile`` (every token
and request bucket of the model step, lm head and sampler), and of its model-step part alone (the
cache-dependent part), JAX's persistent compilation cache off; the warm-up round's time; and how
many requests got identical greedy tokens on both caches.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402

NUM_PAGES, PAGE_SIZE, MAX_LEN = 256, 16, 512


@dataclasses.dataclass(frozen=True)
class Workload:
    requests: int
    new_tokens: int
    seqs: int  # sequences at once
    step_tokens: int  # token budget of a step; eSurge compiles a model step per power of two up to it


FULL = Workload(requests=16, new_tokens=64, seqs=8, step_tokens=64)
QUICK = Workload(requests=4, new_tokens=8, seqs=4, step_tokens=16)
ed = None  # easydel, imported by import_easydel() only: it is an optional extra


def import_easydel():
    """EasyDeL and the tests_easydel helpers, imported; called only once EasyDeL is known to be
    installed (an installed EasyDeL that fails to import is an error, not a skip)."""
    global ed, easydel_pool_of, make_tokenizer, tiny_llama, use_easykv
    import easydel as ed
    jax.config.update("jax_enable_compilation_cache", False)  # importing EasyDeL turned it on
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests_easydel"))
    from helpers import easydel_pool_of, make_tokenizer, tiny_llama

    from easykv.integrations.easydel import use_easykv


def prompts(work: Workload) -> list[str]:
    lengths = [4 + (37 * i) % 57 for i in range(work.requests)]  # 4..60 tokens
    return [" ".join(f"w{4 + (7 * i + 3 * j) % 124}" for j in range(n)) for i, n in enumerate(lengths)]


def engine_for(model, tokenizer, dtype, work: Workload) -> tuple[ed.eSurge, float, float]:
    """An eSurge engine and its compile time: all of ``eSurgeRunner.compile``, and the part that
    compiles the model step (the only cache-dependent part; lm head and sampler are the same)."""
    engine = ed.eSurge(model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=MAX_LEN, max_num_seqs=work.seqs,
                       max_num_seq_buckets=[work.seqs], min_input_pad=8, max_num_batched_tokens=work.step_tokens,
                       page_size=PAGE_SIZE, hbm_utilization=0.5, enable_prefix_caching=False, compile_runner=False,
                       silent_mode=True)  # fmt: skip
    assert engine.runner.metadata.num_pages == NUM_PAGES
    stop(engine)  # eSurge starts its scheduler thread at once; its idle loop would compete for the 2 cores
    manager, step_seconds = engine.runner.executor_manager, [0.0]
    compile_step = manager._compile_backbone_variant  # timing instrumentation only

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return compile_step(*args, **kwargs)
        finally:
            step_seconds[0] += time.perf_counter() - t0

    manager._compile_backbone_variant = timed
    t0 = time.perf_counter()
    engine.runner.compile(max_num_batched_tokens=work.step_tokens)
    total = time.perf_counter() - t0
    manager._compile_backbone_variant = compile_step
    return engine, total, step_seconds[0]


def stop(engine: ed.eSurge) -> None:
    """eSurge.terminate, then wait until the scheduler thread has really ended: terminate holds the
    scheduler lock while it waits (5 s) for the thread, which needs that lock to finish its
    iteration, so the thread can outlive terminate and would run beside the next one."""
    thread = engine._scheduler_thread
    engine.terminate()
    if thread is not None:
        thread.join()


def serve(engine: ed.eSurge, work: Workload) -> tuple[float, list[list[int]]]:
    params = ed.SamplingParams(max_tokens=work.new_tokens, temperature=0.0, ignore_eos=True)
    engine.initiate()
    try:
        t0 = time.perf_counter()
        outs = engine.generate(prompts(work), params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    finally:
        stop(engine)  # one scheduler thread at a time on the 2 cores
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


def serve_rounds(engines: dict, rounds: int, work: Workload) -> tuple[dict, dict, dict]:
    """A warm-up round per engine, then ``rounds`` rounds interleaved: (warm-up seconds, tokens/s
    per round, greedy tokens) per engine."""
    first: dict[str, float] = {}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    generated = work.requests * work.new_tokens
    try:
        for name, engine in engines.items():  # warm-up: the first round runs a few one-time compiles
            first[name], tokens[name] = serve(engine, work)
        for _ in range(rounds):
            for name, engine in engines.items():
                seconds, out = serve(engine, work)
                assert out == tokens[name] and sum(map(len, out)) == generated
                rates[name].append(generated / seconds)
    finally:
        for engine in engines.values():
            engine._worker_manager.shutdown()  # eSurge's destructor does this: stop the tokenizer workers
    return first, rates, tokens


def bench(dtype_name: str, rounds: int, tokenizer, work: Workload) -> bool:
    dtype = jnp.dtype(dtype_name).type
    names = ("EasyDeL RaggedPagesCache", "easykv (use_easykv)")
    with easydel_pool_of(NUM_PAGES, dtype, PAGE_SIZE):
        theirs = engine_for(tiny_llama(dtype), tokenizer, dtype, work)
    ours = engine_for(use_easykv(tiny_llama(dtype), num_pages_per_layer=NUM_PAGES), tokenizer, dtype, work)
    compile_total = dict(zip(names, (theirs[1], ours[1])))
    compile_step = dict(zip(names, (theirs[2], ours[2])))
    first, rates, tokens = serve_rounds(dict(zip(names, (theirs[0], ours[0]))), rounds, work)

    base, mine = names
    same = sum(a == b for a, b in zip(tokens[base], tokens[mine]))
    print(f"\n{dtype_name}: greedy tokens identical for {same}/{work.requests} requests\n")
    print("| cache | generated tokens/s (median) | min..max | compile: model step | compile: eSurge total | "
          "first round |")
    print("|---|---|---|---|---|---|")
    for name in names:
        print(f"| {name} | {statistics.median(rates[name]):.1f} | {min(rates[name]):.1f}..{max(rates[name]):.1f} | "
              f"{compile_step[name]:.1f} s | {compile_total[name]:.1f} s | {first[name]:.1f} s |")
    print(f"| easykv / EasyDeL | {statistics.median(rates[mine]) / statistics.median(rates[base]):.2f}x | | "
          f"{compile_step[mine] / compile_step[base]:.2f}x | {compile_total[mine] / compile_total[base]:.2f}x | "
          f"{first[mine] / first[base]:.2f}x |")
    return same == work.requests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK.requests} requests x {QUICK.new_tokens} tokens, smaller steps, float32, 1 round: "
                             "checks the script runs (CI; skipped, exit 0, without EasyDeL); numbers meaningless")
    parser.add_argument("--dtype", default=None, help="comma-separated: bfloat16, float32 (default both; "
                                                      "--quick: float32)")
    parser.add_argument("--rounds", type=int, default=None, help="default 5; --quick: 1")
    args = parser.parse_args()
    if importlib.util.find_spec("easydel") is None:
        if args.quick:
            print("bench_easydel: skipped, EasyDeL is not installed (pip install -e '.[easydel]')")
            return 0
        parser.error("EasyDeL is not installed: pip install -e '.[easydel]' (or run with --quick to skip)")
    import_easydel()
    work = QUICK if args.quick else FULL
    rounds = args.rounds or (1 if args.quick else 5)
    dtypes = args.dtype or ("float32" if args.quick else "bfloat16,float32")
    from transformers import AutoTokenizer

    tokdir = tempfile.mkdtemp(prefix="bench_easydel_tok_")
    try:
        make_tokenizer(tokdir)
        tokenizer = AutoTokenizer.from_pretrained(tokdir)
        print(f"eSurge, tiny Llama, {work.requests} requests x {work.new_tokens} new tokens, {rounds} timed rounds "
              "interleaved after one warm-up round each; 8 CPU devices (tp=8)")
        for name in dtypes.split(","):
            bench(name.strip(), rounds, tokenizer, work)
    finally:
        shutil.rmtree(tokdir, ignore_errors=True)
    print("\ntargets: easykv tokens/s >= 1.00x EasyDeL; compile time <= 1.5x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
