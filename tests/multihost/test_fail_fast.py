"""The fail-fast exit hook on its own, in one process and no JAX runtime: which exits count as
failing, and that a failing process ends with the status Python itself would have ended with."""

import os
import signal
import subprocess
import sys

import pytest

# Each case starts a Python that imports JAX; the launcher's runs are in test_multihost.py.
pytestmark = pytest.mark.slow

SCRIPT = """
import atexit, sys
atexit.register(print, "EARLIER ATEXIT HOOK RAN", flush=True)  # as JAX's own hook: registered first
{install}
{end}
"""
INSTALL = "from easykv.multihost.fail_fast import install_fail_fast; install_fail_fast()"  # one line: same tracebacks

# how the script ends, whether that fails, the exit status Python gives it (None: the same under the hook)
ENDS = [
    ("pass", False, None),
    ("sys.exit(0)", False, None),
    ("sys.exit()", False, None),
    ("sys.exit(False)", False, None),
    ("sys.exit(3)", True, None),
    ("def f():\n    sys.exit(4)\nf()", True, None),
    ("sys.exit(256)", True, None),  # 0 for the system: C's exit() keeps the low 8 bits
    ("sys.exit(-1)", True, None),
    ("sys.exit(2**70)", True, None),  # beyond a C long
    ("sys.exit('a message')", True, None),
    ("raise RuntimeError('x')", True, None),
    ("raise KeyboardInterrupt", True, None),  # ends by SIGINT
    ("try:\n    sys.exit(3)\nexcept SystemExit:\n    pass\nraise ValueError", True, None),  # the later one counts
    ("import threading\nthreading.Thread(target=sys.exit, args=(3,)).start()", False, None),  # ends a thread only
    ("print('said')\nimport ctypes\nctypes.CDLL(None).printf(b'said in C\\n')\nsys.exit(3)", True, None),
    ("sys.stdout = open('/dev/full', 'w')\nprint('lost')\nsys.exit(3)", True, None),  # 120: stdout not flushed
    ("raise SystemExit(3)", True, 1),  # its code is out of the hook's reach
    ("raise SystemExit(0)", True, 1),
    ("exit()", True, 1),
]


def run(end, install, tmp_path):
    mark = tmp_path / f"mark-{install}"
    code = SCRIPT.format(install=INSTALL if install else "pass", end=end)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # C's stdout buffered, as usual
    env.update(EASYKV_FAILURE_MARK=str(mark), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return done, mark


@pytest.mark.parametrize("end, fails, status", ENDS, ids=[e[0].splitlines()[-1] for e in ENDS])
def test_a_failing_exit_skips_the_rest_of_shutdown_with_pythons_own_status(end, fails, status, tmp_path):
    plain, _ = run(end, False, tmp_path)
    hooked, mark = run(end, True, tmp_path)
    assert hooked.returncode == (plain.returncode if status is None else status), (plain, hooked)
    if end == "raise KeyboardInterrupt":
        assert hooked.returncode == -signal.SIGINT
    assert ("skips JAX's shutdown barrier" in hooked.stderr) == fails, hooked.stderr
    assert mark.exists() == fails  # the moment launch_local goes by
    if "/dev/full" in end:  # nothing reaches stdout; Python reports the failed flush, the hook does not
        return
    ran = "EARLIER ATEXIT HOOK RAN\n"
    assert ran in plain.stdout and (ran in hooked.stdout) != fails, hooked.stdout  # os._exit: no hook after ours
    assert hooked.stdout.replace(ran, "") == plain.stdout.replace(ran, ""), (plain.stdout, hooked.stdout)  # flushed
    assert hooked.stderr.startswith(plain.stderr.rstrip("\n")), (plain.stderr, hooked.stderr)  # its words first
