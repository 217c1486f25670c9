"""Every test runs on 8 simulated CPU devices; this must happen before jax creates a backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


import pytest  # noqa: E402

from sharding import create_mesh  # noqa: E402


@pytest.fixture(scope="session")
def tp8():
    """The tensor-parallel mesh of every sharded test: kv heads over 8 devices."""
    return create_mesh({"dp": 1, "tp": 8})


@pytest.fixture(scope="session")
def dp2tp4():
    """Two data-parallel replicas of 4 tensor-parallel devices (pages split over dp)."""
    return create_mesh({"dp": 2, "tp": 4})
