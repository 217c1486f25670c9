"""Running several processes on one machine that form one JAX runtime (tests, examples, trying
multi-host locally), and failing fast: ``launch_local`` stops every worker as soon as one fails
and names the one that failed first.

Each worker joins with ``initialize_from_env()``; the launcher asks it to fail fast
(``EASYKV_FAIL_FAST=1``), so a worker that fails ends at once instead of waiting in JAX's
shutdown barrier (``easykv.multihost.fail_fast``).

Who failed first. A worker that fails takes its peers down with it: as it ends, the connections
of the collectives they wait in close, so they raise too and exit with the same code, and the
launcher may see them exit in the same poll, or even first (a worker that does not fail fast
frees JAX's backend before it ends, which is slow). Neither exit codes nor exit order tell them apart, but the
fail-fast hook can: it runs before its process ends, so before any peer can fail because of it,
and it records that moment (a monotonic clock, one for the whole machine) in a file the launcher
names in ``EASYKV_FAILURE_MARK``. The launcher names the worker with the earliest moment; one
that recorded none (killed by a signal, failed before ``initialize``, not failing fast) counts
from the last time the launcher saw it running.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from easykv.errors import MultiProcessError
from easykv.multihost.fail_fast import MARK_ENV, read_mark
from easykv.multihost.startup import FAIL_FAST_ENV, JOIN_ENV
from easykv.validation import positive_int, real

_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID, _CPU_DEVICES = JOIN_ENV

_MAX_LOCAL_PROCESSES = 256
# The last words of a process that JAX aborted because *another* one failed.
_JAX_FOLLOWER = "JAX distributed service detected fatal errors"
_POLL_S = 0.02
# How long after the first failure is seen the launcher waits for the worker that failed first to exit
# (it may still be ending), or for the real culprit when only workers JAX aborted are seen.
_GRACE_S = 5.0


def launch_local(
    argv: Sequence[str],
    *,
    num_processes: int = 2,
    cpu_devices_per_process: int = 4,
    timeout: float = 180.0,
    log_dir: str | os.PathLike[str],
) -> list[str]:
    """Run ``argv`` as ``num_processes`` workers on 127.0.0.1 forming one JAX runtime.

    Each worker calls ``initialize_from_env()``, which makes it fail fast (the module docstring)
    unless it passes ``fail_fast=False``. Returns every worker's output once all exited with 0.
    Otherwise raises ``MultiProcessError`` naming the first worker to fail (its exit code or
    signal and the end of its log; first by when it began to fail, not by exit order: see the
    module docstring), or at ``timeout`` seconds the workers still running. Every worker runs in
    its own session; whatever happens, each worker's whole process group is killed before this
    returns or raises, also when SIGTERM or SIGINT stops the launcher (its handlers are restored
    and the signal passed on to them afterwards). On Linux a worker is also killed when the
    launcher dies by SIGKILL.

    Args:
      argv: the worker's command line, a non-empty list of strings (e.g.
        ``[sys.executable, "worker.py"]``), the same for every worker.
      num_processes: workers to start, ``1 .. 256`` (default 2).
      cpu_devices_per_process: CPU devices each worker simulates (default 4); the workers run
        with ``JAX_PLATFORMS=cpu``.
      timeout: seconds the whole run may take (default 180), > 0.
      log_dir: the directory (created when missing) for each worker's output,
        ``log_dir/process-<i>.log``.

    Returns:
      every worker's output, in process order.
    """
    argv = _command(argv)
    num_processes = positive_int("num_processes", num_processes, hi=_MAX_LOCAL_PROCESSES,
                                 hint="launch_local starts that many processes on this machine")  # fmt: skip
    cpu_devices_per_process = positive_int("cpu_devices_per_process", cpu_devices_per_process)
    timeout = real("timeout", timeout, lo=0, hi=math.inf, lo_open=True, hi_open=True,
                   hint="the seconds the whole run may take")  # fmt: skip
    if not isinstance(log_dir, (str, os.PathLike)):
        raise ValueError(f"log_dir must be a directory path, got {log_dir!r} of type {type(log_dir).__name__}")
    log_dir = os.fspath(log_dir)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(log_dir, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # PYTHONUNBUFFERED: a worker killed mid-run still leaves its last words in its log.
    env.update({"JAX_PLATFORMS": "cpu", _COORDINATOR: f"127.0.0.1:{port}", _NUM_PROCESSES: str(num_processes),
                _CPU_DEVICES: str(cpu_devices_per_process), FAIL_FAST_ENV: "1", "PYTHONUNBUFFERED": "1"})  # fmt: skip
    marks = tempfile.mkdtemp(prefix="easykv-launch-")  # where failing workers record when they failed
    workers = _Workers([os.path.join(log_dir, f"process-{i}.log") for i in range(num_processes)], marks)
    guard = _SignalGuard()
    error = None
    try:
        guard.install()
        workers.start(argv, env, guard)
        error = workers.wait(timeout)
    except _Stopped:
        pass
    finally:
        guard.raising = False  # a signal now is only noted: the cleanup below must run to its end
        workers.kill_all()
        shutil.rmtree(marks, ignore_errors=True)
        guard.restore()
    if guard.received is not None:
        name = signal.Signals(guard.received).name
        signal.raise_signal(guard.received)  # to the caller's handler, or the default action
        raise MultiProcessError(f"launch_local was stopped by {name}; every worker was killed")
    if error is not None:
        raise error
    outputs = []
    for path in workers.paths:
        with open(path, errors="replace") as f:
            outputs.append(f.read())
    return outputs


def _command(argv: Any) -> list[str]:
    if isinstance(argv, (str, bytes)) or not isinstance(argv, Sequence) or not argv:
        raise ValueError(f"argv must be a non-empty list of strings, such as [sys.executable, 'worker.py'], "
                         f"got {repr(argv):.80}")  # fmt: skip
    for i, arg in enumerate(argv):
        if not isinstance(arg, (str, os.PathLike)):
            raise ValueError(f"argv[{i}] must be a string or a path, got {repr(arg):.80} "
                             f"of type {type(arg).__name__}")
    command = [os.fspath(a) for a in argv]
    if shutil.which(command[0]) is None:
        raise ValueError(f"argv[0] = {command[0]!r} is neither an executable file nor a program on PATH")
    return command


class _Stopped(BaseException):
    """SIGTERM or SIGINT reached the launcher: unwinds launch_local to its cleanup."""


class _SignalGuard:
    """SIGTERM and SIGINT stop the run while launch_local runs (only the main thread may set handlers)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}
        self.received: int | None = None
        self.raising = True

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            if signal.getsignal(sig) not in (signal.SIG_IGN, None):  # respect a caller who ignores it
                self.previous[sig] = signal.signal(sig, self.handle)

    def handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
        if self.raising:
            self.raising = False
            raise _Stopped

    @contextlib.contextmanager
    def held(self) -> Any:
        """A signal inside the block acts at its end (a worker being forked must be on the list first)."""
        self.raising = False
        try:
            yield
        finally:
            self.raising = True
        if self.received is not None:
            raise _Stopped

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class _Workers:
    def __init__(self, paths: list[str], mark_dir: str):
        self.paths = paths
        self.marks = [os.path.join(mark_dir, f"process-{i}") for i in range(len(paths))]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.started = time.monotonic()

    def start(self, argv: list[str], env: dict[str, str], guard: _SignalGuard) -> None:
        argv = _wrapped(argv)
        for i, path in enumerate(self.paths):
            with open(path, "wb") as log, guard.held():
                self.procs.append(subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env={**env, _PROCESS_ID: str(i), MARK_ENV: self.marks[i]},
                    start_new_session=True,  # its own process group: killed as a whole, with its children
                ))  # fmt: skip

    def wait(self, timeout: float) -> MultiProcessError | None:
        """Until all exited with 0 (None), one failed or the time is up (the error to raise)."""
        deadline, grace = self.started + timeout, None
        running_at = [self.started] * len(self.procs)  # when the last poll that saw each one running began
        while True:
            now = time.monotonic()
            codes = [_exit_status(p) for p in self.procs]
            running_at = [now if c is None else t for c, t in zip(codes, running_at)]
            if any(c not in (None, 0) for c in codes):
                if grace is None:  # poll again at once: one that failed first may have exited during this poll
                    grace = now + _GRACE_S
                    continue
                first, marked, settled = self._first_failure(codes, running_at)
                if settled or now >= min(grace, deadline):
                    return self._failure(first, codes, marked)
            elif all(c == 0 for c in codes):
                return None
            if now >= deadline:
                return self._timeout(timeout, [i for i, c in enumerate(codes) if c is None])
            time.sleep(_POLL_S)

    def _first_failure(self, codes: list[int | None], running_at: list[float]) -> tuple[int, bool, bool]:
        """The worker that failed first, whether it recorded when, and whether that is settled.

        A worker that recorded its failure (module docstring) counts from that moment, also while it
        is still exiting; one that did not, from the last time it was seen running, which is before
        any peer could fail because of it. Not settled: it has not exited yet (so its exit status is
        unknown), or it is only a worker that JAX aborted because of another, which on a loaded
        machine can be seen before that one. Settled or not, the caller reports it after the grace.
        """
        marks = [read_mark(path) for path in self.marks]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0) or (c is None and marks[i] is not None)]

        def order(i: int) -> tuple[bool, float, int]:
            mark = marks[i]
            follower = mark is None and self._follower(i, codes[i])
            return follower, running_at[i] if mark is None else mark, i

        first = min(failed, key=order)
        return first, marks[first] is not None, codes[first] is not None and not order(first)[0]

    def _follower(self, i: int, code: int | None) -> bool:
        return code == -signal.SIGABRT and _JAX_FOLLOWER in _tail(self.paths[i], 200)

    def _failure(self, i: int, codes: list[int | None], marked: bool) -> MultiProcessError:
        code, elapsed = codes[i], f"{time.monotonic() - self.started:.1f} s after the start"
        if code is None:  # it recorded its failure but had not exited by the end of the grace
            how = f"failed and was still exiting {elapsed}"
        elif marked and code < 0:  # JAX aborts a failing process whose peer (the coordinator) exits first
            how = f"failed and, while exiting, {_how(code)} {elapsed}"
        else:
            how = f"{_how(code)} {elapsed}"
        others = ", ".join(f"process {j} {'was running' if c is None else _how(c)}"
                           for j, c in enumerate(codes) if j != i)  # fmt: skip
        message = (f"process {i} of {len(codes)} {how}; every worker was killed ({others or 'no others'}).\n"
                   f"--- {self.paths[i]} (last lines) ---\n{_tail(self.paths[i])}")  # fmt: skip
        return MultiProcessError(message, process=i, returncode=code, log_path=self.paths[i])

    def _timeout(self, timeout: float, hung: list[int]) -> MultiProcessError:
        logs = "\n".join(f"--- {self.paths[i]} (last lines) ---\n{_tail(self.paths[i])}" for i in hung)
        message = (f"processes {hung} of {len(self.procs)} still running after {timeout:g} s (the timeout of "
                   f"launch_local); every worker was killed.\n{logs}")  # fmt: skip
        return MultiProcessError(message, process=hung[0], log_path=self.paths[hung[0]], hung=tuple(hung))

    def kill_all(self) -> None:
        # Each worker leads its own process group; its pid is also the group's id, and it stays
        # reserved until the worker is reaped below (_exit_status does not reap), so no other
        # process can be hit by mistake.
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # the group is gone already
                pass
        for proc in self.procs:
            proc.wait()


def _exit_status(proc: subprocess.Popen[bytes]) -> int | None:
    """A worker's exit status (negative: killed by that signal), None while it runs; not reaped."""
    if not hasattr(os, "waitid"):
        return proc.poll()
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _how(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "unknown signal"
    return f"was killed by signal {-code} ({name})"


# Each worker first runs this in a bare interpreter, which then becomes the worker by exec (same pid,
# and the setting survives exec): the kernel SIGKILLs the worker when the launcher dies, even by
# SIGKILL. Doing it here rather than in a preexec_fn keeps subprocess from forking a process that
# has JAX loaded. The kernel ties it to the *thread* that started the worker: launch_local starts
# and waits in the same thread, which therefore lives exactly as long as the run.
_DIE_WITH_LAUNCHER = """\
import ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, 9) != 0:  # PR_SET_PDEATHSIG, SIGKILL
    print("easykv: prctl(PR_SET_PDEATHSIG) failed; this worker may outlive a killed launcher", file=sys.stderr)
if os.getppid() != int(sys.argv[1]):  # the launcher died before the line above took effect
    os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _wrapped(argv: list[str]) -> list[str]:
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-I", "-c", _DIE_WITH_LAUNCHER, str(os.getpid()), *argv]


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))  # a long log: its end is enough
            text = f.read().decode(errors="replace")
    except OSError as err:
        return f"(the log cannot be read: {err})"
    return "\n".join(text.splitlines()[-lines:])
