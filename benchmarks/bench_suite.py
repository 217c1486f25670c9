"""How long the test suite takes: the README's test command (the fast tier), the full suite and
CI's steps, each on a clean clone of the committed tree, in a fresh virtual environment.

    python benchmarks/bench_suite.py                    # fast tier cold and warm, full suite
    python benchmarks/bench_suite.py --baseline e53412b # also that commit's whole suite, in the same session
    python benchmarks/bench_suite.py --ci               # also .ci/run end to end, on a clone of its own
    python benchmarks/bench_suite.py --ci --no-suite    # .ci/run only
    python benchmarks/bench_suite.py --quick            # one test file in this checkout (CI's smoke run)

"Cold" is a clone's first run: its compilation cache (.jax_cache) is empty; "warm" runs the same
command again. Timings depend on the machine's load: quote a baseline measured in the same session.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(argv: list[str], cwd: Path, env: dict | None = None) -> tuple[float, str]:
    """Wall seconds and the output of a command that must succeed."""
    start = time.monotonic()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed in {cwd} (exit {done.returncode}):\n"
                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return seconds, done.stdout + done.stderr


def passed(output: str) -> str:
    found = re.findall(r"(\d+) passed", output)
    return found[-1] if found else "?"


def clone(rev: str, where: Path) -> Path:
    target = where / rev.replace("/", "_")
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(target)], check=True)
    subprocess.run(["git", "checkout", "--quiet", rev], cwd=target, check=True)
    return target


def install(checkout: Path) -> tuple[float, Path]:
    """A fresh virtual environment with the checkout's `.[test]` (the README's install)."""
    venv = checkout / ".venv-bench"
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    timed([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], checkout)
    timed([str(python), "-m", "pip", "install", "--quiet", "-e", ".[test]"], checkout)
    return time.monotonic() - start, python


def suite_rows(checkout: Path, python: Path) -> list[tuple[str, float, str]]:
    pytest = [str(python), "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider"]
    rows = []
    for label, extra in (("fast tier, cold compilation cache (the README command)", []),
                         ("fast tier again, warm cache", []),
                         ("full suite (-m \"\"), cache warm from the fast tier", ["-m", ""])):
        seconds, out = timed(pytest + extra, checkout)
        rows.append((label, seconds, passed(out)))
    return rows


def ci_rows(checkout: Path) -> list[tuple[str, float, str]]:
    seconds, out = timed(["bash", ".ci/run"], checkout)
    rows = []
    for line in out.split("=== summary", 1)[1].splitlines()[1:]:
        m = re.match(r"(.+?)\s+(ok|FAILED)\s+(\d+) s$", line)
        if m:
            rows.append((f".ci/run: {m.group(1)}", float(m.group(3)), m.group(2)))
    rows.append((".ci/run end to end, installs included", seconds, "ok"))
    return rows


def quick_rows() -> list[tuple[str, float, str]]:
    """tests/storage/test_writes.py in this checkout with a compilation cache of its own: cold, then warm."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache}
        argv = [sys.executable, "-m", "pytest", "tests/storage/test_writes.py", "-q", "-p", "no:cacheprovider",
                "-n", "0"]
        rows = []
        for label in ("tests/storage/test_writes.py, cold cache", "tests/storage/test_writes.py, warm cache"):
            seconds, out = timed(argv, REPO, env)
            rows.append((label, seconds, passed(out)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one test file in this checkout, cold and warm")
    parser.add_argument("--rev", default="HEAD", help="the commit to measure (default HEAD: commit first)")
    parser.add_argument("--baseline", help="also time this commit's whole suite (python -m pytest tests -q)")
    parser.add_argument("--ci", action="store_true", help="also run .ci/run, step by step, on a clone of its own")
    parser.add_argument("--no-suite", action="store_true", help="skip the suite's own runs (with --ci or --baseline)")
    args = parser.parse_args()

    if args.quick:
        rows = quick_rows()
    else:
        with tempfile.TemporaryDirectory() as where:
            rows = []
            if not args.no_suite:
                checkout = clone(args.rev, Path(where) / "suite")
                seconds, python = install(checkout)
                rows = [("install: fresh venv, pip install -e '.[test]'", seconds, "")] + suite_rows(checkout, python)
            if args.baseline:
                old = clone(args.baseline, Path(where) / "baseline")
                _, old_python = install(old)
                seconds, out = timed([str(old_python), "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider"], old)
                rows.append((f"whole suite of {args.baseline} (python -m pytest tests -q)", seconds, passed(out)))
            if args.ci:  # a clone of its own: CI starts with an empty compilation cache
                rows += ci_rows(clone(args.rev, Path(where) / "ci"))

    print(f"test suite timings ({os.cpu_count()} cores)\n")
    print("| run | time | tests passed |\n|---|---|---|")
    for label, seconds, count in rows:
        print(f"| {label} | {seconds // 60:.0f} min {seconds % 60:02.0f} s | {count} |")


if __name__ == "__main__":
    main()
