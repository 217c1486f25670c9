"""Every script in examples/ runs to completion in a fresh process."""

import os
import subprocess
import sys

import pytest

from tests.support.devices import REPO

EXAMPLES = sorted((REPO / "examples").glob("*.py"))


@pytest.mark.slow
@pytest.mark.examples
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # and the test session's XLA flags and compilation cache
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, f"{script.name} failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"{script.name} printed nothing"
