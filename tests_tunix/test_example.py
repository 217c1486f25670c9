"""examples/grpo_tunix.py runs to completion in a fresh process."""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("tunix")

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "grpo_tunix.py"


@pytest.mark.slow
def test_the_grpo_example_runs():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-4000:]}"
    assert "every step's rollouts ran on easykv pages" in done.stdout
