"""Tunix rollouts: Tunix's own ``Sampler`` (its dense per-call cache) vs easykv's engine over pages
(``easykv.integrations.tunix``), the same model and requests, multi-step decode at k = 1, 4, 16, 64.

    python benchmarks/bench_tunix.py [--rounds 7]
    python benchmarks/bench_tunix.py --quick      # 4 x 32 tokens, k = 1 and 16, small scoring, 2 rounds (CI)

Tunix is an optional extra (``pip install -e '.[tunix]'``): without it ``--quick`` says it skipped
and exits 0; a full run fails. The model: Tunix's Qwen3 (2 layers, embed 64, 4 q / 2 kv heads of
16 dims, vocabulary 256, float32, random weights) on one CPU device. Requests: B prompts of 24
tokens, each continued by exactly N tokens (greedy; no end token can occur), as B x N = 4 x 160
and 16 x 160. Tunix's ``Sampler`` at the rollout default ``kv_cache_size=1024`` and
``max_prompt_length=32``; easykv's engine with pages of 16 and a pool of 512. Every case is run once
to compile, then ``--rounds`` times, cases interleaved; reported: the median generated tokens per
second and its ratio to Tunix's in the same run, and how many requests got Tunix's greedy tokens
(and how many differ only after Tunix generated its pad id, a token its ``Sampler`` masks from
then on while the model without a cache, and easykv, attend to it).

A GRPO group (G = 8 samples of a 256-token prompt, 256 generated each): the peak cache bytes easykv
holds (its one prefill's pages shared by the 8 forks), in float32 and int8 pages, against the dense
cache Tunix's ``Sampler`` allocates for the group at ``kv_cache_size=1024``, and the prompt tokens
each prefills. Exact float32 pages cannot go below (256 + 8 x 256) / (8 x 1024) = 0.281x of it.

LoRA rollouts: the same model with a qwix LoRA on every projection (rank 8, adapters randomized so they
act), applied as Tunix's GRPO scripts apply it; Tunix's ``Sampler`` on that LoRA model vs easykv's
engine on it, at 4 x 160 and 16 x 160 tokens, k = 16 and 64.

GRPO scoring: the per-token log-probabilities of G completions of 256 tokens for each of 4 prompts of
1,024 tokens (G = 4, 8, 16), Tunix's ``compute_per_token_logps`` (one dense forward over
``4G x 1,280`` tokens, jitted) vs ``TunixPagedEngine.score`` (each prompt prefilled once and forked
per completion, ``score_tokens=2048``), on the same model and batch. The wall time of the call until
its result is ready; easykv's prefix cache is emptied before each call, so every prompt is computed
(cold), and a second line gives a call whose prompts are cached (a rollout's own scoring after it
generated them). Tokens/s count the completion tokens scored. The arithmetic alone allows
``4G x 1,280 / (4 x 1,023 + 4G x 256)`` = 3.33x at G = 8.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

VOCAB, PROMPT = 256, 24


def tiny_qwen3(seed: int = 0):
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3

    cfg = qwen3.ModelConfig(num_layers=2, vocab_size=VOCAB, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
                            num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-6)
    model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    nnx.update(model, jax.tree.unflatten(tree, [a + 0.05 * jax.random.normal(k, a.shape)
                                                for a, k in zip(leaves, keys)]))
    return model


class Tokens:
    """A tokenizer that is the identity on ids: prompts are given as text of the ids' characters."""

    def encode(self, text, **kw):
        return [ord(c) for c in text]

    def decode(self, ids, **kw):
        return "".join(map(chr, ids))

    def bos_id(self):
        return 0  # no BOS added

    def eos_id(self):
        return 1 << 20  # never sampled: every request runs its N tokens

    def pad_id(self):
        return 0


def prompts(batch: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, PROMPT).tolist() for _ in range(batch)]


def tunix_runner(model, batch: int, new: int):
    from tunix.generate import sampler as sampler_lib

    c = model.config
    sampler = sampler_lib.Sampler(model, Tokens(), sampler_lib.CacheConfig(
        cache_size=1024, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim))
    text = ["".join(map(chr, p)) for p in prompts(batch, 0)]

    def run():
        out = sampler(text, max_generation_steps=new, max_prompt_length=32, temperature=0.0)
        return [np.asarray(t) for t in out.tokens]

    return run


def easykv_runner(model, batch: int, new: int, k: int):
    from easykv.integrations.tunix import TunixPagedEngine

    engine = TunixPagedEngine(model, max_length=1024, batch_size=max(16, batch), page_size=16, num_pages=512,
                              decode_steps=k, prefill_tokens=PROMPT * batch)
    ids = prompts(batch, 0)

    def run():
        return engine.generate(ids, new)[0]

    return run


def throughput(cases: dict[str, object], batch: int, new: int, rounds: int) -> tuple[dict[str, float], dict]:
    outputs = {name: run() for name, run in cases.items()}  # compile
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    return {name: batch * new / statistics.median(t) for name, t in times.items()}, outputs


def agreement(outputs: list[np.ndarray], reference: list[list[int]]) -> tuple[int, int]:
    """(rows equal to Tunix's, rows that differ only after Tunix's own output generated the pad id:
    Tunix's Sampler masks a generated pad token from then on, the model without a cache does not)."""
    same = after_pad = 0
    for out, ref in zip(outputs, reference):
        out = out.tolist()
        if out == ref:
            same += 1
            continue
        first = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        after_pad += Tokens().pad_id() in ref[:first]
    return same, after_pad


def grpo_memory(model, group: int, prompt: int, new: int, quantizer: str | None = None) -> tuple[int, int, int]:
    """(easykv's peak cache bytes, Tunix's dense cache bytes, easykv's prefilled prompt tokens)."""
    from easykv.integrations.tunix import TunixPagedEngine

    engine = TunixPagedEngine(model, max_length=1024, batch_size=group, page_size=16, num_pages=256, decode_steps=64,
                              prefill_tokens=prompt, quantizer=quantizer)
    engine.generate([[3 + i % (VOCAB - 3) for i in range(prompt)]] * group, new)
    meta = engine.manager.metadata
    c = model.config
    dense_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # Tunix's K and V, float32
    # a page id stands for one page in every layer of the (only) layer group; scales included
    g = meta.groups[0]
    return engine.peak_pages * meta.group_page_bytes(g) * g.num_layers, group * 1024 * dense_per_token, prompt


def lora(model, seed: int = 7):
    """``model`` with a qwix LoRA on every projection, as Tunix's GRPO scripts apply it; the adapters
    randomized (qwix starts B at zero, which would leave the model unchanged)."""
    import qwix
    from flax import nnx

    provider = qwix.LoraProvider(module_path=".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj|.*up_proj",
                                 rank=8, alpha=16.0)
    adapted = qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(seed), **model.get_model_input())
    leaves, tree = jax.tree.flatten(nnx.state(adapted, nnx.LoRAParam))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(adapted, jax.tree.unflatten(tree, [a + 0.05 * jax.random.normal(k, a.shape)
                                                  for a, k in zip(leaves, keys)]))
    return adapted


def scoring_cases(model, prompts: int, prompt_len: int, group: int, new: int) -> dict[str, object]:
    """Tunix's dense scoring and easykv's, cold and with the prompts cached, on one batch."""
    import jax.numpy as jnp
    from flax import nnx
    from tunix.rl import common

    from easykv.integrations.tunix import TunixPagedEngine

    rng = np.random.default_rng(1)
    prompt_ids = np.repeat(rng.integers(3, VOCAB, (prompts, prompt_len)), group, axis=0).astype(np.int32)
    completion_ids = rng.integers(3, VOCAB, (prompts * group, new)).astype(np.int32)
    graphdef, state = nnx.split(model)
    pages = prompts * (prompt_len // 16 + 1) + prompts * group * (new // 16 + 2) + 64
    engine = TunixPagedEngine(model, max_length=prompt_len + new + 16, batch_size=max(16, prompts * group),
                              page_size=16, num_pages=pages, score_tokens=2048)

    def tunix():
        return np.asarray(common.compute_per_token_logps(graphdef, state, prompt_tokens=jnp.asarray(prompt_ids),
                                                         completion_tokens=jnp.asarray(completion_ids), pad_id=0,
                                                         eos_id=1))

    def cold():
        engine.manager.reset_prefix_cache()
        return np.asarray(engine.score(prompt_ids, completion_ids, pad_id=0, eos_id=1))

    def cached():
        return np.asarray(engine.score(prompt_ids, completion_ids, pad_id=0, eos_id=1))

    return {"Tunix compute_per_token_logps": tunix, "easykv score, cold": cold, "easykv score, prompts cached": cached}


def scoring(model, quick: bool, rounds: int) -> None:
    prompts, prompt_len, new = (2, 64, 32) if quick else (4, 1024, 256)
    print(f"\nGRPO scoring: {prompts} prompts of {prompt_len} tokens, G completions of {new} tokens each")
    print(f"{'G':>3} {'scorer':<30} {'tokens/s':>9} {'x Tunix':>8} {'max |diff|':>11}")
    for group in (4,) if quick else (4, 8, 16):
        rates, outputs = throughput(scoring_cases(model, prompts, prompt_len, group, new), prompts * group, new,
                                    rounds)
        base, ref = rates["Tunix compute_per_token_logps"], outputs["Tunix compute_per_token_logps"]
        for name, rate in rates.items():
            diff = float(np.abs(outputs[name] - ref).max())
            print(f"{group:>3} {name:<30} {rate:9.0f} {rate / base:8.2f} {diff:11.2e}")


def rollout_table(model, shapes: list[tuple[int, int]], steps: tuple[int, ...], rounds: int) -> None:
    """Tunix's ``Sampler`` against easykv's engine at each decode-loop length of ``steps``, on ``model``."""
    print(f"{'B x N':>9} {'engine':<18} {'tokens/s':>9} {'x Tunix':>8} {'same tokens':>12}")
    for batch, new in shapes:
        cases = {"Tunix Sampler": tunix_runner(model, batch, new)}
        cases |= {f"easykv k={k}": easykv_runner(model, batch, new, k) for k in steps}
        rates, outputs = throughput(cases, batch, new, rounds)
        base = rates["Tunix Sampler"]
        ref = [t.tolist() for t in outputs["Tunix Sampler"]]
        for name, rate in rates.items():
            same, after_pad = agreement(outputs[name], ref)
            note = f" (+{after_pad} after a pad id)" if after_pad else ""
            print(f"{batch:>4} x {new:<3} {name:<18} {rate:9.0f} {rate / base:8.2f} {same:>6}/{batch}{note}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 x 32 tokens, k = 1 and 16, 2 rounds (CI)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if importlib.util.find_spec("tunix") is None:
        if args.quick:
            print("bench_tunix: Tunix is not installed (pip install -e '.[tunix]'); skipped")
            return 0
        print("bench_tunix: needs Tunix: pip install -e '.[tunix]'", file=sys.stderr)
        return 1
    model = tiny_qwen3()
    shapes = [(4, 32)] if args.quick else [(4, 160), (16, 160)]
    steps = (1, 16) if args.quick else (1, 4, 16, 64)
    rounds = 2 if args.quick else args.rounds
    rollout_table(model, shapes, steps, rounds)
    print("\nLoRA rollouts (qwix LoRA, rank 8, on every projection):")
    rollout_table(lora(model), shapes, (16,) if args.quick else (16, 64), rounds)
    scoring(model, args.quick, rounds)
    group, prompt, new = (8, 64, 32) if args.quick else (8, 256, 256)
    print(f"\nGRPO group of {group} samples, {prompt}-token prompt, {new} generated each:")
    for quantizer in (None, "int8"):
        paged, dense, prefilled = grpo_memory(model, group, prompt, new, quantizer)
        print(f"  easykv {quantizer or 'float32'} pages: peak cache {paged / 2**20:.2f} MiB vs Tunix's dense float32 "
              f"{dense / 2**20:.2f} MiB ({paged / dense:.3f}x); prompt tokens prefilled {prefilled} vs "
              f"{group * prompt} ({group}x fewer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
