"""How every test process runs JAX: on the CPU with 8 simulated devices, compiled without
XLA's backend optimisations, through a compilation cache on disk that the test processes share.

``tests/conftest.py`` calls ``configure()`` before any test module imports jax, and so do the
scripts the tests start that need the same devices. Processes the tests start inherit the
environment it sets, so the demo, the examples and multi-process workers compile the same way.
Benchmarks never call it: their timings are of XLA's default flags.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Inside the checkout (ignored by git), so a fresh clone starts cold and `git clean -xdf` empties it.
CACHE_DIR = REPO / ".jax_cache"
NUM_DEVICES = 8
# The tests check values, never speed. XLA:CPU's newer fusion emitters (MLIR) and LLVM's
# optimisation passes are most of a typical test's compile time and buy nothing here: without
# them a typical test file compiles in half the time (docs/benchmarks.md, "Test suite": 62 s -> 30 s).
FAST_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=0")


def configure(devices: int = NUM_DEVICES) -> None:
    """Set the environment and jax's device count; must run before jax creates a backend.

    A variable the caller has set already is kept: ``XLA_FLAGS`` (set it, even to an empty
    string, to run the tests with XLA's default flags), ``JAX_COMPILATION_CACHE_DIR``, or
    ``JAX_ENABLE_COMPILATION_CACHE=false`` to compile everything afresh."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", " ".join(FAST_COMPILE_FLAGS))
    # Identical programs compiled by two test processes (pytest-xdist workers, the demo and
    # example subprocesses) or by two runs are compiled once; keys include the jax version.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE_DIR))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

    import jax

    jax.config.update("jax_num_cpu_devices", devices)
