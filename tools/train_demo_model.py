"""Train the tiny byte-level model behind `easykv demo`, so its sample is text a person can read.

What it does: builds a corpus of English text that is the project's own, the prose (`prose`:
code blocks, tables and hard wraps taken out) of README.md, any docs/*.md, and every module,
class and function docstring of the easykv package, read with `ast`, in sorted file order
(about 370 KB); holds out every 25th 4 KiB block of it (3-4%); and trains
`easykv.demo.run.MODELS[--model]` with Adam (optax) on random 256-byte windows of the rest,
starting from the model's own seeded initialisation. The model is the demo's
`easykv.demo.model.DemoModel` itself, run through the demo's dense reference step (`_dense_step`:
causal attention, each sliding layer masked to its window), so the weights are trained for
exactly the function the demo serves. At the end it prints the corpus size and sha256, the
steps, the train and held-out loss in bits per byte and the time, and writes the weights with
`easykv.demo.weights.save_weights` (float16, the config and this record inside).

How long: about six minutes per model on 2 CPU cores (300 steps of 4096 bytes, some 1.1 s
each, and the evaluations; measured while other jobs shared the cores); `--quick` runs 3 steps
on a 16 KiB slice in well under a minute (the test's smoke run; its file is junk).

How to rerun (from the repository root, after the model's config or the docs changed):

    python tools/train_demo_model.py --model hybrid   # writes easykv/demo/weights/hybrid.npz
    python tools/train_demo_model.py --model uniform  # writes easykv/demo/weights/uniform.npz

then run `easykv demo` (and its tests) and commit the .npz files. The run is deterministic
for a given corpus, seed and jax build: the data order comes from numpy's seeded generator and
XLA on CPU computes the same sums in the same order.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: the easykv beside it, not another install

from easykv.demo.model import DemoModel, _dense_step  # noqa: E402
from easykv.demo.run import MODELS  # noqa: E402
from easykv.demo.weights import save_weights, shipped_weights  # noqa: E402

SEQ_LEN = 256  # the demo's max length: every position the demo uses is trained
BATCH = 16
BLOCK = 4096  # held-out text is whole blocks spread over the corpus, not its tail (README vs docstrings)
HOLD_OUT_EVERY = 25  # 4%
PEAK_LR, WARMUP = 3e-3, 30


_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")  # [text](target) -> text
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_ITEM = re.compile(r"(?:[-*+]|\d+\.) ")  # a list item starts a paragraph of its own


def prose(text: str) -> str:
    """The running text of a markdown page or a docstring: paragraphs, each on one line (the
    source's hard wraps joined), separated by a blank line; code (fenced, indented 4+ spaces or
    ``>>>``), tables, HTML comments, heading marks and link targets left out. A model of the
    raw files learns where a 100-column wrap and an indented code block go, and continues a
    sentence with a newline and runs of spaces; this is the text a person reads."""
    paragraphs: list[list[str]] = []
    current: list[str] = []
    fenced = False
    for raw in _LINK.sub(r"\1", _COMMENT.sub("", text)).splitlines():
        line = raw.rstrip()
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        indent = len(line) - len(line.lstrip())
        body = line.strip()
        if fenced or indent >= 4 or body.startswith((">>>", "...", "|")) or not body:
            if current:  # code, a table or a blank line ends the paragraph
                paragraphs.append(current)
                current = []
            continue
        if body.startswith("#") or _ITEM.match(body):
            if current:
                paragraphs.append(current)
            current = [body.lstrip("#").strip()]
            continue
        current.append(body)
    if current:
        paragraphs.append(current)
    return "\n\n".join(" ".join(p) for p in paragraphs if any(c.isalpha() for c in " ".join(p)))


def build_corpus(root: Path = ROOT) -> bytes:
    """The `prose` of README.md, docs/*.md, then of the docstrings of easykv/**/*.py (module,
    class, function), each piece separated by a blank line, as UTF-8."""
    pieces = [prose((root / "README.md").read_text(encoding="utf-8"))]
    pieces += [prose(p.read_text(encoding="utf-8")) for p in sorted((root / "docs").glob("*.md"))]
    for path in sorted((root / "easykv").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    pieces.append(prose(doc))
    return "\n\n".join(p for p in pieces if p).encode("utf-8")


def every_block(data: np.ndarray, period: int, offset: int) -> np.ndarray:
    """The BLOCK-byte blocks ``i`` of ``data`` with ``i % period == offset``, concatenated."""
    blocks = [data[i : i + BLOCK] for i in range(0, data.size, BLOCK)]
    picked = [b for i, b in enumerate(blocks) if i % period == offset]
    return np.concatenate(picked) if picked else data[-BLOCK:]  # a slice too short (--quick): its tail


def split_corpus(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(train, held out) byte arrays: every HOLD_OUT_EVERY-th BLOCK-byte block is held out."""
    arr = np.frombuffer(data, np.uint8)
    train = [arr[i : i + BLOCK] for i in range(0, arr.size, BLOCK) if i // BLOCK % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
    return np.concatenate(train), every_block(arr, HOLD_OUT_EVERY, HOLD_OUT_EVERY - 1)


def make_row_loss(graphdef: Any, seq_len: int) -> Any:
    """``row_loss(params, batch)``: each row's mean next-byte cross-entropy (nats) for a batch
    (B, seq_len + 1), under the demo model's dense reference step: the row written from position
    0 into an empty dense cache, attending causally (sliding layers to their window)."""
    def one(params: Any, seq: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, params)
        cfg = model.cfg
        empty = jnp.zeros((cfg.layers, seq_len, cfg.kv_heads, cfg.head_dim), jnp.float32)
        logits, _, _ = _dense_step(model, empty, empty, seq[:-1], jnp.int32(0))
        return optax.softmax_cross_entropy_with_integer_labels(logits, seq[1:]).mean()

    return jax.vmap(one, in_axes=(None, 0))


def windows(data: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping (seq_len + 1)-byte windows covering ``data`` (each predicts seq_len bytes)."""
    n = (data.size - 1) // seq_len
    return np.stack([data[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int32)


def evaluate(row_loss: Any, params: Any, data: np.ndarray, seq_len: int, batch: int) -> float:
    """Bits per byte over ``data``'s windows (a last short batch padded with repeats, uncounted)."""
    rows = windows(data, seq_len)
    total = 0.0
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        padded = np.concatenate([chunk, np.repeat(chunk[-1:], batch - len(chunk), axis=0)])
        total += float(np.asarray(row_loss(params, jnp.asarray(padded)))[: len(chunk)].sum())
    return total / len(rows) / math.log(2)


def train(name: str, steps: int, data: np.ndarray, held: np.ndarray, *, seq_len: int, batch: int,
          seed: int, log_every: int) -> tuple[DemoModel, dict[str, float]]:  # fmt: skip
    """Adam on random windows of ``data``; returns the model and its train/held-out bits per byte."""
    model = DemoModel(MODELS[name])
    graphdef, params = nnx.split(model)
    row_loss = jax.jit(make_row_loss(graphdef, seq_len))
    schedule = optax.warmup_cosine_decay_schedule(0.0, PEAK_LR, min(WARMUP, max(1, steps // 4)), max(steps, 2),
                                                  end_value=PEAK_LR / 20)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.99, weight_decay=0.01))
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params: Any, opt_state: Any, tokens: jax.Array) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(lambda p: row_loss(p, tokens).mean())(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for i in range(steps):
        starts = rng.integers(0, data.size - seq_len - 1, batch)
        tokens = np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int32)
        params, opt_state, value = step(params, opt_state, jnp.asarray(tokens))
        if (i + 1) % log_every == 0 or i + 1 == steps:
            print(f"  step {i + 1}/{steps}: train loss {float(value) / math.log(2):.3f} bits/byte, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    # The train loss on a sixth of the training text, blocks spread over the corpus as the
    # held-out ones are: a few held-out KB of one kind of page would make a noisy comparison.
    seen = every_block(data, 6, 0)
    losses = {"train_bits_per_byte": evaluate(row_loss, params, seen, seq_len, batch),
              "heldout_bits_per_byte": evaluate(row_loss, params, held, seq_len, batch)}
    return nnx.merge(graphdef, params), losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="hybrid", choices=sorted(MODELS), help="which demo model to train")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300; --quick: 3)")
    parser.add_argument("--out", default=None,
                        help="where the .npz goes (default: the shipped easykv/demo/weights/<model>.npz)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 3 steps on a 16 KiB slice, short windows (needs --out; the file is junk)")
    parser.add_argument("--seed", type=int, default=0, help="the data order's seed")
    args = parser.parse_args(argv)
    if args.quick and args.out is None:
        parser.error("--quick writes junk weights: give --out (the shipped file stays as it is)")
    steps = args.steps if args.steps is not None else 3 if args.quick else 300
    if steps < 1:
        parser.error(f"--steps {steps} must be at least 1")
    out = Path(args.out) if args.out else shipped_weights(args.model)
    t0 = time.perf_counter()
    corpus = build_corpus()
    if args.quick:
        corpus = corpus[: 4 * BLOCK]
    digest = hashlib.sha256(corpus).hexdigest()  # of the text trained on (and held out)
    data, held = split_corpus(corpus)
    seq_len, batch = (32, 4) if args.quick else (SEQ_LEN, BATCH)
    print(f"corpus: {len(corpus):,} bytes (the prose of README.md, docs/*.md, easykv's docstrings), sha256 {digest}; "
          f"{data.size:,} train, {held.size:,} held out", flush=True)
    print(f"model {args.model}: {MODELS[args.model]}", flush=True)
    model, losses = train(args.model, steps, data, held, seq_len=seq_len, batch=batch, seed=args.seed,
                          log_every=max(1, steps // 10))  # fmt: skip
    seconds = time.perf_counter() - t0
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    record = {"corpus_bytes": len(corpus), "corpus_sha256": digest, "steps": steps, "seq_len": seq_len,
              "batch": batch, "seed": args.seed, "seconds": round(seconds, 1), "quick": args.quick,
              "params": params, **{k: round(v, 4) for k, v in losses.items()}}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    save_weights(out, model, record)
    print(f"steps: {steps}, parameters: {params:,}; final loss: train {losses['train_bits_per_byte']:.3f}, "
          f"held out {losses['heldout_bits_per_byte']:.3f} bits/byte; {seconds:.0f} s")
    print(f"wrote {out} ({out.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
