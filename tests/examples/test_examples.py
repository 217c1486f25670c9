"""Every script in examples/ runs to completion in a fresh process (one that needs an optional
extra, saying ``easykv[extra]`` in its docstring, where that extra is installed: its own test
folder runs it too)."""

import importlib.util
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
    if "easykv[tunix]" in script.read_text() and importlib.util.find_spec("tunix") is None:
        pytest.skip("needs easykv[tunix]; tests_tunix runs it")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # and the test session's XLA flags and compilation cache
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, f"{script.name} failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"{script.name} printed nothing"
