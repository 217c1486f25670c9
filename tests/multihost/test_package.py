"""easykv.multihost as a package: the old name still imports (with a DeprecationWarning), importing
it rewires nothing, and the launcher's request to fail fast is read exactly."""

import subprocess
import sys

import pytest

import easykv.multihost
from easykv.multihost import initialize_from_env
from tests.support.deprecation import warnings_on_import


def test_the_old_module_name_still_imports_the_same_objects_with_a_deprecation_warning():
    seen = warnings_on_import("import easykv.distributed\nfrom easykv.distributed import launch_local", """
import easykv.multihost
assert sorted(easykv.distributed.__all__) == sorted([*easykv.multihost.__all__, "LockstepError", "MultiProcessError"])
assert all(getattr(easykv.distributed, n) is getattr(easykv.multihost, n) for n in easykv.multihost.__all__)
assert launch_local is easykv.multihost.launch_local""")
    assert seen == [("DeprecationWarning", "easykv.distributed moved to easykv.multihost and will be removed in "
                                           "easykv 0.3; import from easykv.multihost instead", "<string>")]


def test_the_public_names():
    assert sorted(easykv.multihost.__all__) == ["assert_lockstep", "fingerprint", "initialize", "initialize_from_env",
                                                "launch_local"]  # fmt: skip


def test_importing_it_rewires_nothing():
    code = ("import sys\n"
            "exit = sys.exit\n"
            "import easykv.multihost, easykv.distributed\n"
            "assert sys.exit is exit\n"
            "raise RuntimeError('no exit hook is asked for')\n")
    done = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c", code], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 1 and "RuntimeError: no exit hook is asked for" in done.stderr, done.stderr
    assert "easykv:" not in done.stderr, done.stderr  # the fail-fast hook would say so as it ends the process


JOIN = {"EASYKV_COORDINATOR": "127.0.0.1:1", "EASYKV_NUM_PROCESSES": "2", "EASYKV_PROCESS_ID": "0",
        "EASYKV_CPU_DEVICES": "4"}  # fmt: skip


@pytest.mark.parametrize("asked", ["yes", "true", "", " 1"])
def test_a_request_to_fail_fast_that_is_neither_0_nor_1_is_refused_before_joining(asked, monkeypatch):
    for name, value in {**JOIN, "EASYKV_FAIL_FAST": asked}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"\$EASYKV_FAIL_FAST must be 0 or 1, got {asked!r}"):
        initialize_from_env()


def test_a_worker_not_started_by_the_launcher_is_told_so(monkeypatch):
    for name in JOIN:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"not started by easykv.multihost.launch_local: \['EASYKV_COORDINATOR'"):
        initialize_from_env()
