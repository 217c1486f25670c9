"""A/B timings of the working tree against an earlier revision, interleaved in one run.

What it measures, the way a user waits for it (medians over interleaved rounds, each revision in
its own process, the processes alternating so that a noisy neighbour hits both alike):

- ``manager``: one decode step's host work in the page manager for 256 running sequences of
  random lengths (16..1023 prompt tokens, 16-token pages, 512-page rows): the step's metadata
  built and its tokens committed. A revision with `PageManager.schedule` is timed on the plan
  (``schedule`` + ``commit``), one without on ``build_decode_metadata`` + ``step``.
- ``tunix``: generated tokens per second of the Tunix rollout engine
  (`easykv.integrations.tunix.TunixPagedEngine`, the model and requests of
  ``benchmarks/bench_tunix.py``), at k = 1 and 16 decode steps per device loop (needs Tunix: run
  it with the Tunix environment's python).

How to run (from the repository root)::

    python tools/ab_revisions.py manager --against f2fbdfc            # the table and the ratio
    .venv-ci-tunix/bin/python tools/ab_revisions.py tunix --against f2fbdfc --alternations 3
    python tools/ab_revisions.py manager --against HEAD --quick        # a smoke run

The earlier revision is checked out with ``git worktree add`` into a temporary directory (removed
at the end) and imported from there through PYTHONPATH; the working tree is imported from here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MANAGER_CASE = r"""
import json, statistics, sys, time
import numpy as np
from easykv.manager.manager import PageManager
from easykv.spec.metadata import PagedAttentionCacheMetaData
SEQS, WIDTH, PAGE = 256, 512, 16
rounds = int(sys.argv[1])
meta = PagedAttentionCacheMetaData(batch_size=SEQS, num_hidden_layers=32, num_pages_per_layer=SEQS * WIDTH,
    num_pages_per_sequence=WIDTH, max_sequences=WIDTH * PAGE, page_size=PAGE, num_kv_heads=8, kv_head_dim_size=128,
    hbm_utilization=0.9)
rng = np.random.default_rng(0)
pm = PageManager(meta)
ids = pm.claim(SEQS)
planned = hasattr(pm, "schedule")
for s in ids:
    prompt = rng.integers(0, 32000, int(rng.integers(16, 1024)))
    if planned:
        pm.commit(pm.schedule([s], [prompt.size]), [prompt])
    else:
        pm.build_step_metadata([s], [prompt.size])
        pm.step([s], [prompt])
ids = np.asarray(ids)
tokens = rng.integers(0, 32000, (rounds, SEQS))
times = []
for i in range(rounds):
    t0 = time.perf_counter()
    if planned:
        pm.commit(pm.schedule(ids, 1), tokens[i])
    else:
        pm.build_decode_metadata(ids)
        pm.step(ids, tokens[i])
    times.append(time.perf_counter() - t0)
print(json.dumps({"decode step build + commit, 256 sequences (ms)": 1e3 * statistics.median(times)}))
"""

TUNIX_CASE = r"""
import json, os, statistics, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, sys.argv[2])
from benchmarks.bench_tunix import tiny_qwen3, prompts, PROMPT
from easykv.integrations.tunix import TunixPagedEngine
rounds, batch, new = int(sys.argv[1]), 4, int(sys.argv[3])
model = tiny_qwen3()
out = {}
for k in (1, 16):
    engine = TunixPagedEngine(model, max_length=1024, batch_size=16, page_size=16, num_pages=512, decode_steps=k,
                              prefill_tokens=PROMPT * batch)
    ids = prompts(batch, 0)
    engine.generate(ids, new)  # compile
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        engine.generate(ids, new)
        times.append(time.perf_counter() - t0)
    out[f"tunix engine {batch} x {new}, k={k} (tokens/s)"] = batch * new / statistics.median(times)
print(json.dumps(out))
"""


def run_case(code: str, path: Path, args: list[str]) -> dict[str, float]:
    """One process of one revision: its JSON line of medians."""
    env = {"PYTHONPATH": str(path), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=path, env=env, capture_output=True, text=True,
                          check=False, timeout=3600)
    if done.returncode:
        raise SystemExit(f"the case failed in {path}:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", choices=("manager", "tunix"))
    parser.add_argument("--against", required=True, help="the earlier revision (a commit, tag or branch)")
    parser.add_argument("--alternations", type=int, default=5, help="processes per revision, alternating")
    parser.add_argument("--quick", action="store_true", help="one alternation of few rounds: a smoke run")
    args = parser.parse_args()
    alternations = 1 if args.quick else args.alternations
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old), args.against], cwd=ROOT, check=True)
        try:
            if args.case == "manager":
                code, argv = MANAGER_CASE, ["40" if args.quick else "400"]
            else:
                code, argv = TUNIX_CASE, ["2" if args.quick else "5", "", "32" if args.quick else "160"]
            medians: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
            for _ in range(alternations):
                for name, path in (("old", old), ("new", ROOT)):
                    case_args = [argv[0], str(path), *argv[2:]] if args.case == "tunix" else argv
                    for key, value in run_case(code, path, case_args).items():
                        medians[name].setdefault(key, []).append(value)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    print(f"| {args.case}: {alternations} alternating processes per revision | {args.against} | working tree | "
          "new / old |")
    print("|---|---|---|---|")
    for key, olds in medians["old"].items():
        a, b = statistics.median(olds), statistics.median(medians["new"][key])
        print(f"| {key} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
