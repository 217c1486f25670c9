"""The suite's own contract (tests/conftest.py, pyproject.toml): the README's command runs the
fast tier with the fast Hypothesis profile, `-m ""` runs every test at full strength,
EASYKV_HYPOTHESIS_PROFILE overrides both, and a profile that does not exist is refused."""

import os
import subprocess
import sys

import pytest

from tests.support.devices import REPO

SOME_TESTS = "tests/spec/test_memory.py"  # no compile: the session's startup is all that is timed


def collect(*args, profile=None, where=SOME_TESTS):
    env = {k: v for k, v in os.environ.items() if k != "EASYKV_HYPOTHESIS_PROFILE"}
    if profile is not None:
        env["EASYKV_HYPOTHESIS_PROFILE"] = profile
    return subprocess.run([sys.executable, "-m", "pytest", where, "--collect-only", "-n", "0", "-p",
                           "no:cacheprovider", *args], cwd=REPO, env=env, capture_output=True, text=True)  # fmt: skip


@pytest.mark.parametrize("args, profile, want", [
    ((), None, "fast"),                      # the README's command: slow tests deselected
    (("-m", ""), None, "full"),              # every test
    (("-m", "slow or hypothesis"), None, "full"),
    (("-m", "not slow and not numpy_only"), None, "fast"),
    ((), "deep", "deep"),                    # the variable wins
], ids=["default", "everything", "slow-or-hypothesis", "fast-without-numpy-only", "variable"])  # fmt: skip
def test_the_profile_follows_the_tier_unless_the_variable_names_one(args, profile, want):
    done = collect(*args, profile=profile)
    assert done.returncode in (0, 5), done.stdout + done.stderr  # 5: the expression selects none of them
    assert f"hypothesis profile: {want} " in done.stdout, done.stdout


def test_a_profile_that_does_not_exist_is_refused_by_name():
    done = collect(profile="fastest")
    assert done.returncode == 4  # pytest's usage error
    assert "EASYKV_HYPOTHESIS_PROFILE='fastest' names no Hypothesis profile; use fast, full or deep" in done.stderr


def test_the_fast_tier_leaves_out_the_slow_tests_and_everything_runs_them():
    """tests/multihost: the multi-process runs and the exit hook's own runs (a process per case)
    are slow; the launcher's argument checks and the package's checks fast."""
    fast, everything = (
        {line.split("::")[0] for line in collect("-q", *args, where="tests/multihost").stdout.splitlines()
         if "::" in line}
        for args in ((), ("-m", "")))  # fmt: skip
    assert fast == {"tests/multihost/test_launch_arguments.py", "tests/multihost/test_package.py"}
    assert everything == fast | {"tests/multihost/test_fail_fast.py", "tests/multihost/test_multihost.py",
                                 "tests/multihost/test_store_multiprocess.py"}
