"""A worker that does no JAX work, for the tests of launch_local itself: records its pid (and, with
``with-child``, starts a child of its own and records that one's) in $EASYKV_TEST_PID_DIR, then
sleeps until it is killed.

    python tests/multihost/sleeper.py alone|with-child
"""

import os
import subprocess
import sys
import time


def record(pid: int) -> None:
    open(os.path.join(os.environ["EASYKV_TEST_PID_DIR"], f"pid-{pid}"), "w").close()


if sys.argv[1] == "with-child":  # in the worker's process group: the launcher must kill it too
    record(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid)
record(os.getpid())
time.sleep(600)
