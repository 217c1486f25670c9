"""The fenced code blocks of the README and the docs pages, and running a page's blocks.

A block runs unless the line before its fence is ``<!-- not-run: REASON -->``; a page's running
blocks share one namespace, in order, as a reader types them, in a fresh process with 8
simulated CPU devices and a temporary working directory."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!-- not-run: (.{10,}) -->$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_run: str | None  # the reason, for a block that is not run


def blocks(path: pathlib.Path) -> list[Block]:
    path = path.resolve()
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: a code fence that is never closed")
        before = lines[i - 1].strip() if i else ""
        reason = NOT_RUN.match(before)
        found.append(Block(str(path.relative_to(ROOT)), i + 1, m.group(1), "\n".join(lines[i + 1:end]),
                           reason.group(1) if reason else None))
        i = end + 1
    return found


def pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "api" not in p.parts)]


_RUNNER = """
import jax, sys
jax.config.update("jax_num_cpu_devices", 8)
ns = {"__name__": "__docs__"}
for name, code in BLOCKS:
    exec(compile(code, name, "exec"), ns)
print("ran", len(BLOCKS), "blocks")
"""


def run_page(path: pathlib.Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the page's running blocks; a traceback names ``page:line`` of the failing block's code."""
    todo = [(f"{b.page}:{b.line + 1}", "\n" * b.line + b.code) for b in blocks(path) if b.not_run is None]
    script = f"BLOCKS = {todo!r}\n{_RUNNER}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
