"""Multi-process helpers: start JAX's multi-controller runtime, check that hosts stay in
lock-step, and run several processes on one machine that fail fast.

Every process runs the same program. The page manager runs on every host and must make the same
decisions everywhere (it is deterministic); ``assert_lockstep`` all-gathers a fingerprint of its
state and names the processes that diverged, so a divergence is caught at the step it happens
instead of surfacing later as silently mixed-up pages.

Why a failing process skips JAX's shutdown barrier (``initialize(fail_fast=True)``, which
``initialize_from_env`` uses). ``import jax`` registers an atexit hook that calls
``jax.distributed.shutdown()``, and that waits in a barrier until every process has reached it,
for up to ``shutdown_timeout_seconds`` (300 s by default). A process that fails mid-run enters the
barrier while its peers wait for it in a collective, so it waits out the whole timeout; and, as
we measured with JAX 0.10, a barrier that times out makes the coordination service abort *every*
process (SIGABRT), the healthy ones too. A short timeout is therefore no fix: a healthy process
that finishes a few seconds before the others would bring the run down. So a clean exit keeps the
barrier (it keeps the coordinator, which lives in process 0, up until everyone is done), and only
a failing exit skips it: our own atexit hook runs before JAX's (atexit is last in, first out) and
detaches JAX's client and service, so the shutdown finds nothing to wait for. They are leaked on
purpose: freeing them runs their C++ destructor, which enters the same barrier. Python then ends
as usual, so the exit status is Python's own: 1 for an uncaught exception, 3 for ``sys.exit(3)``
or ``raise SystemExit(3)``. The peers learn of it from the launcher, which stops them, or from
JAX itself within its heartbeat timeout.

An atexit hook is not told the exit status, so the hook reads it off the ``__main__`` module's
frame, kept from the time of ``initialize``: a script that ran to its end stopped on its final
return, anything else was unwound by an exception. That exception is a failure unless it came
from ``sys.exit()`` with status 0 or None, which a thin wrapper of ``sys.exit`` records. So a worker
ends cleanly by running off the end of its script or by ``sys.exit(0)``; a bare
``raise SystemExit(0)`` or ``exit()`` counts as a failure: it skips the barrier, so peers still
running are aborted by JAX. Should JAX's internals move, the hook finds nothing to detach and the
old behaviour (the barrier) stays.

Who failed first. A worker that raises takes its peers down with it: JAX's atexit hook frees its
backend, which closes the connections of the collectives they wait in, so they raise too and exit
with the same code, often before it (freeing the backend is slow). Neither exit codes nor exit order
tell them apart, but our hook can: it runs before JAX's, so before any peer can fail because of this
process, and under ``launch_local`` it records that moment (a monotonic clock, one for the whole
machine) in a file the launcher reads. The launcher names the worker with the earliest moment; one
that recorded none (killed by a signal, failed before ``initialize``) counts from the last time the
launcher saw it running.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dis
import hashlib
import json
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
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from easykv.errors import LockstepError, MultiProcessError
from easykv.validation import boolean, positive_int, real


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_devices_per_process: int | None = None,
    initialization_timeout: int = 300,
    heartbeat_timeout_seconds: int = 100,
    shutdown_timeout_seconds: int = 300,
    fail_fast: bool = False,
) -> None:
    """``jax.distributed.initialize`` with what a CPU run needs as well.

    On TPU pods and GPU clusters the arguments may be left out (JAX detects the cluster).
    ``cpu_devices_per_process`` simulates that many CPU devices in this process and selects the
    gloo collectives, which is how the tests run several hosts on one machine. ``fail_fast``
    makes a failing exit of this process skip JAX's shutdown barrier (see the module docstring).
    Call it before any other JAX work.
    """
    if boolean("fail_fast", fail_fast):
        _install_fail_fast()  # first: a failure inside jax.distributed.initialize is covered too
    if cpu_devices_per_process is not None:
        cpu_devices_per_process = positive_int("cpu_devices_per_process", cpu_devices_per_process)
        jax.config.update("jax_num_cpu_devices", cpu_devices_per_process)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        shutdown_timeout_seconds=shutdown_timeout_seconds,
    )


def fingerprint(state: Mapping[str, Any]) -> bytes:
    """sha256 of a JSON-safe state in canonical form (sorted keys, no whitespace)."""
    try:
        text = json.dumps(state, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as err:  # objects, mixed key types, NaN, cycles
        raise ValueError(f"the state to compare across processes is not plain JSON ({err}); pass a PageManager "
                         "or a mapping of str keys to JSON values") from None
    return hashlib.sha256(text.encode()).digest()


def assert_lockstep(manager: Any, *, what: str = "page manager") -> bytes:
    """Raise ``LockstepError`` unless every process holds the same state.

    ``manager`` is anything with ``state_dict()`` (the PageManager) or a JSON-safe mapping.
    Returns this process's fingerprint. Every process must call it at the same point.
    """
    if hasattr(manager, "lockstep_state"):  # the PageManager: its host tier included
        state = manager.lockstep_state()
    else:
        state = manager.state_dict() if hasattr(manager, "state_dict") else manager
    if not isinstance(state, Mapping):
        raise ValueError(f"assert_lockstep needs an object with state_dict() or a mapping, got {type(manager).__name__}")
    digest = fingerprint(state)
    if jax.process_count() == 1:
        return digest
    from jax.experimental import multihost_utils

    local = np.frombuffer(digest, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(local))  # (processes, 32)
    rows = [bytes(r) for r in gathered.reshape(jax.process_count(), -1)]
    if len(set(rows)) > 1:
        groups: dict[bytes, list[int]] = {}
        for pid, row in enumerate(rows):
            groups.setdefault(row, []).append(pid)
        majority = max(groups.values(), key=lambda g: (len(g), -g[0]))
        differ = sorted(p for p in range(len(rows)) if p not in majority)
        raise LockstepError(
            f"the {what} state differs between processes: processes {differ} disagree with "
            f"processes {majority} (fingerprints "
            + ", ".join(f"{pid}:{row.hex()[:12]}" for pid, row in enumerate(rows))
            + "); every host must make the same calls in the same order"
        )
    return digest


# ---- leaving a run: a failing process skips JAX's shutdown barrier (module docstring) ----
_NO_STATUS = object()
_MARK_ENV = "EASYKV_FAILURE_MARK"  # set by launch_local: where a failing worker records when it failed
_RETURNS = {"RETURN_VALUE", "RETURN_CONST"}  # how a module's code ends (3.11; 3.12 and later)


class _FailFast:
    def __init__(self, main_frame: Any, mark_path: str | None):
        self.main_frame = main_frame
        self.mark_path = mark_path
        self.exit_status: Any = _NO_STATUS
        self.sys_exit = sys.exit

    def record_exit(self, status: Any = None, /) -> None:
        """Stands in for ``sys.exit``: remembers the status, then exits as ``sys.exit`` does."""
        if threading.current_thread() is threading.main_thread():  # elsewhere it ends a thread only
            self.exit_status = status
        self.sys_exit(status)

    def failing(self) -> bool:
        frame = self.main_frame
        try:
            if dis.opname[frame.f_code.co_code[frame.f_lasti]] in _RETURNS:
                return False  # the script ran to its end
        except (IndexError, ValueError):  # frames we cannot read (another interpreter): keep the barrier
            return False
        status = self.exit_status
        return not (status is None or (isinstance(status, int) and status == 0))

    def at_exit(self) -> None:
        if self.failing():
            if self.mark_path:  # first: the launcher's evidence that this process failed before its peers
                try:
                    _write_mark(self.mark_path, time.monotonic())
                except OSError as err:
                    print(f"easykv: cannot record this failure for launch_local ({err}); it may name a peer "
                          "that failed because of this process instead", file=sys.stderr, flush=True)  # fmt: skip
            print("easykv: this process is exiting with an error; it skips JAX's shutdown barrier",
                  file=sys.stderr, flush=True)  # fmt: skip
            _detach_jax_shutdown()


_fail_fast: _FailFast | None = None


def _install_fail_fast() -> None:
    global _fail_fast
    if _fail_fast is not None:
        return
    # The main thread's outermost frame of the __main__ module, found from any thread.
    main = sys.modules.get("__main__")
    frame, found = sys._current_frames().get(threading.main_thread().ident), None
    while frame is not None:
        if main is not None and frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            found = frame
        frame = frame.f_back
    if found is None:  # no script (an embedded interpreter): keep JAX's behaviour
        return
    _fail_fast = _FailFast(found, os.environ.get(_MARK_ENV))
    sys.exit = _fail_fast.record_exit
    atexit.register(_fail_fast.at_exit)  # after `import jax` registered its hook, so it runs first


def _write_mark(path: str, moment: float) -> None:
    staged = f"{path}.{os.getpid()}"
    with open(staged, "w") as f:
        f.write(repr(moment))
    try:
        # Whole or absent for the launcher; and should a child of the worker fail too, the first stays.
        os.link(staged, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(staged)


def _read_mark(path: str) -> float | None:
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):  # none recorded (or not by _write_mark): the launcher's own view decides
        return None


def _detach_jax_shutdown() -> None:
    from jax._src import distributed as jax_distributed  # the state jax.distributed.shutdown() reads

    state = jax_distributed.global_state
    for name in ("preemption_sync_manager", "client", "service"):
        held = getattr(state, name, None)
        if held is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(held))  # never freed: its destructor waits too
            setattr(state, name, None)


# ---- running several processes on one machine (tests, examples, trying multi-host locally) ----
_ENV = ("EASYKV_COORDINATOR", "EASYKV_NUM_PROCESSES", "EASYKV_PROCESS_ID", "EASYKV_CPU_DEVICES")
_MAX_LOCAL_PROCESSES = 256
# The last words of a process that JAX aborted because *another* one failed.
_JAX_FOLLOWER = "JAX distributed service detected fatal errors"
_POLL_S = 0.02
# How long after the first failure is seen the launcher waits for the worker that failed first to exit
# (it may be freeing JAX's backend), or for the real culprit when only workers JAX aborted are seen.
_GRACE_S = 5.0


def initialize_from_env(**timeouts: int) -> int:
    """In a worker started by ``launch_local``: join the run; returns this process's id.

    A failing exit skips JAX's shutdown barrier (``fail_fast``), so the launcher hears of it at once.
    """
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise RuntimeError(f"not started by easykv.distributed.launch_local: {missing} not set")
    pid = int(os.environ["EASYKV_PROCESS_ID"])
    initialize(
        os.environ["EASYKV_COORDINATOR"],
        int(os.environ["EASYKV_NUM_PROCESSES"]),
        pid,
        cpu_devices_per_process=int(os.environ["EASYKV_CPU_DEVICES"]),
        fail_fast=True,
        **timeouts,
    )
    return pid


def launch_local(
    argv: Sequence[str],
    *,
    num_processes: int = 2,
    cpu_devices_per_process: int = 4,
    timeout: float = 180.0,
    log_dir: str | os.PathLike[str],
) -> list[str]:
    """Run ``argv`` as ``num_processes`` workers on 127.0.0.1 forming one JAX runtime.

    Each worker calls ``initialize_from_env()``. Output goes to ``log_dir/process-<i>.log``.
    Returns every worker's output once all exited with 0. Otherwise raises ``MultiProcessError``
    naming the first worker to fail (its exit code or signal and the end of its log; first by when
    it began to fail, not by exit order: see the module docstring), or at
    ``timeout`` seconds the workers still running. Every worker runs in its own session; whatever
    happens, each worker's whole process group is killed before this returns or raises, also when
    SIGTERM or SIGINT stops the launcher (its handlers are restored and the signal passed on to
    them afterwards). On Linux a worker is also killed when the launcher dies by SIGKILL.
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
    env.update(JAX_PLATFORMS="cpu", EASYKV_COORDINATOR=f"127.0.0.1:{port}", EASYKV_NUM_PROCESSES=str(num_processes),
               EASYKV_CPU_DEVICES=str(cpu_devices_per_process), PYTHONUNBUFFERED="1")  # fmt: skip
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
        self.procs: list[subprocess.Popen] = []
        self.started = time.monotonic()

    def start(self, argv: list[str], env: dict[str, str], guard: _SignalGuard) -> None:
        argv = _wrapped(argv)
        for i, path in enumerate(self.paths):
            with open(path, "wb") as log, guard.held():
                self.procs.append(subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env={**env, "EASYKV_PROCESS_ID": str(i), _MARK_ENV: self.marks[i]},
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
        marks = [_read_mark(path) for path in self.marks]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0) or (c is None and marks[i] is not None)]

        def order(i: int) -> tuple[bool, float, int]:
            follower = marks[i] is None and self._follower(i, codes[i])
            return follower, running_at[i] if marks[i] is None else marks[i], i

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


def _exit_status(proc: subprocess.Popen) -> int | None:
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
