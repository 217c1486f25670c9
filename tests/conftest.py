"""The test session: 8 simulated CPU devices (tests/support/devices.py), the Hypothesis profile,
and the two tiers.

Tiers: ``python -m pytest tests`` runs the fast tier (``addopts`` in pyproject.toml deselects
tests marked ``slow``); ``python -m pytest tests -m ""`` runs everything.

Hypothesis profiles, chosen by ``EASYKV_HYPOTHESIS_PROFILE``: ``fast`` (few examples, the
default when slow tests are deselected), ``full`` (the default when they run: at least as many
examples and steps as any test asked for before the tiers existed) and ``deep`` (a soak run).
"""

import os

from tests.support.devices import configure

configure()  # before any test module imports jax

import pytest  # noqa: E402
from _pytest.mark.expression import Expression  # noqa: E402  pytest's own -m semantics
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.errors import InvalidArgument  # noqa: E402

from easykv.sharding import create_mesh  # noqa: E402

PROFILE_VARIABLE = "EASYKV_HYPOTHESIS_PROFILE"
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("fast", max_examples=15, stateful_step_count=25, **_COMMON)
settings.register_profile("full", max_examples=150, stateful_step_count=40, **_COMMON)
settings.register_profile("deep", max_examples=2000, stateful_step_count=80, **_COMMON)


def _runs_slow_tests(config) -> bool:
    expression = config.getoption("markexpr") or ""
    return not expression.strip() or Expression.compile(expression).evaluate(lambda mark, **_: mark == "slow")


def pytest_configure(config):
    # Before collection: a state machine's TestCase takes its settings when its module is imported.
    name = os.environ.get(PROFILE_VARIABLE) or ("full" if _runs_slow_tests(config) else "fast")
    try:
        settings.load_profile(name)
    except InvalidArgument as err:
        raise pytest.UsageError(f"{PROFILE_VARIABLE}={name!r} names no Hypothesis profile; "
                                "use fast, full or deep") from err


def pytest_report_header(config):
    return f"hypothesis profile: {settings.get_current_profile_name()} (set {PROFILE_VARIABLE} to change it)"


@pytest.fixture(scope="session")
def tp8():
    """The tensor-parallel mesh of every sharded test: kv heads over 8 devices."""
    return create_mesh({"dp": 1, "tp": 8})


@pytest.fixture(scope="session")
def dp2tp4():
    """Two data-parallel replicas of 4 tensor-parallel devices (pages split over dp)."""
    return create_mesh({"dp": 2, "tp": 4})
