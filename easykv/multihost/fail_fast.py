"""The fail-fast exit: a process that fails ends itself before JAX's shutdown barrier.

Nothing here acts until ``install_fail_fast()`` is called, which ``initialize(fail_fast=True)``
does, and so does ``initialize_from_env()`` in a worker of ``launch_local`` (the launcher asks for
it with ``EASYKV_FAIL_FAST=1`` in each worker's environment; ``initialize_from_env(fail_fast=False)``
declines). Installed, it replaces ``sys.exit`` with a thin wrapper that records the status, and
registers an atexit hook.

Why a failing process skips the barrier. ``import jax`` registers an atexit hook that calls
``jax.distributed.shutdown()``, and that waits in a barrier until every process has reached it,
for up to ``shutdown_timeout_seconds`` (300 s by default). A process that fails mid-run enters the
barrier while its peers wait for it in a collective, so it waits out the whole timeout; and, as
we measured with JAX 0.10, a barrier that times out makes the coordination service abort *every*
process (SIGABRT), the healthy ones too. A short timeout is therefore no fix: a healthy process
that finishes a few seconds before the others would bring the run down. So a clean exit keeps the
barrier (it keeps the coordinator, which lives in process 0, up until everyone is done), and only
a failing exit skips it.

How. atexit hooks run last in, first out, and this module imports JAX (which registers its
shutdown hook) before it registers its own, so ours runs before JAX's. On a failing exit it records the failure for
``launch_local`` (below), says on stderr that it skips the barrier, flushes ``sys.stdout``,
``sys.stderr`` and the C library's stdio buffers, and ends the process with ``os._exit``. So
JAX's hook never runs, nor do the destructors of JAX's distributed client and service (they
would enter the same barrier); nor, therefore, any other atexit hook registered before this one,
nor the finalizers of live objects (a buffered file other than the standard streams is not
flushed). Only public interfaces are used: nothing of JAX's internals is read or changed.

Clean or failing. An atexit hook is not told how the interpreter ends, so the hook works it out.
It keeps the ``__main__`` module's frame from the time it was installed: a script that ran to its
end stopped on its final return, and that exit is clean; anything else was unwound by an
exception. That exception is clean only if it came from ``sys.exit()`` with status 0 or None
(the last call in the main thread; in another thread ``sys.exit`` ends only that thread). A frame
the hook cannot read (another interpreter) or no ``__main__`` script at all keeps JAX's
behaviour. The status of a failing exit is the one Python itself would have ended with:

* an uncaught exception, which Python has printed and left in ``sys.last_value``: 1; an uncaught
  ``KeyboardInterrupt`` ends the process by SIGINT, as Python does;
* ``sys.exit(n)``: ``n`` as C's ``exit()`` takes it (its low 8 bits; 255 for an int beyond a C
  ``long``); 1 for a value that is not an int (Python has printed it);
* a ``SystemExit`` that did not come through ``sys.exit()``, as from ``raise SystemExit(n)``,
  ``exit()`` or ``quit()``: Python has consumed its code before atexit hooks run, and no public
  interface shows it to them, so the hook counts it as a failure with status 1 (even a code of
  0) and says so on stderr. A worker ends cleanly by running off the end of its script or by
  ``sys.exit(0)``;
* 120 in any case but SIGINT when ``sys.stdout`` cannot be flushed, as Python does.

The peers learn of the failure from the launcher, which stops them, or from JAX, whose
connections to this process close as it ends.

Under ``launch_local`` the hook also records the moment it found the failure (a monotonic clock,
one for the whole machine) in the file named by ``EASYKV_FAILURE_MARK``: it runs before this
process ends, so before any peer can fail because of it, and the launcher names the worker with
the earliest moment as the one that failed first (``easykv.multihost.launch``).
"""

from __future__ import annotations

import atexit
import ctypes
import dis
import os
import signal
import struct
import sys
import threading
import time
from typing import Any, NoReturn

import jax  # noqa: F401 (JAX's atexit hook must be registered before ours, so that ours runs first)

MARK_ENV = "EASYKV_FAILURE_MARK"  # set by launch_local: where a failing worker records when it failed
_RETURNS = {"RETURN_VALUE", "RETURN_CONST"}  # how a module's code ends (3.11; 3.12 and later)
_NO_STATUS = object()
_LONG_BITS = 8 * struct.calcsize("l")
_STDOUT_UNFLUSHED = 120  # Python's status when it cannot flush sys.stdout at exit


class _ExitHook:
    def __init__(self, main_frame: Any, mark_path: str | None):
        self.main_frame = main_frame
        self.mark_path = mark_path
        self.exit_status: Any = _NO_STATUS
        # An exception printed before this point did not end the run: only a newer one counts.
        self.seen_uncaught = getattr(sys, "last_value", None)
        self.sys_exit = sys.exit

    def record_exit(self, status: Any = None, /) -> NoReturn:
        """Stands in for ``sys.exit``: remembers the status, then exits as ``sys.exit`` does."""
        if threading.current_thread() is threading.main_thread():  # elsewhere it ends a thread only
            self.exit_status = status
            self.seen_uncaught = getattr(sys, "last_value", None)
        self.sys_exit(status)

    def failure(self) -> tuple[int, str] | None:
        """The exit status and what ended the run, or None for a clean exit (the module docstring)."""
        frame = self.main_frame
        try:
            if dis.opname[frame.f_code.co_code[frame.f_lasti]] in _RETURNS:
                return None  # the script ran to its end
        except (IndexError, ValueError):  # frames we cannot read (another interpreter): keep the barrier
            return None
        uncaught = getattr(sys, "last_value", None)
        if uncaught is not None and uncaught is not self.seen_uncaught:
            if type(uncaught) is KeyboardInterrupt:  # Python checks the exact type, not subclasses
                return -signal.SIGINT, "an uncaught KeyboardInterrupt"
            return 1, f"an uncaught {type(uncaught).__name__}"
        status = self.exit_status
        if status is _NO_STATUS:
            return 1, ("a SystemExit raised other than by sys.exit(), whose code an exit hook cannot read, "
                       "so its status is 1; end a worker with sys.exit(code)")  # fmt: skip
        if status is None or (isinstance(status, int) and status == 0):
            return None
        if isinstance(status, int):
            return _c_exit_status(int(status)), f"sys.exit({status!r})"
        return 1, "sys.exit() with a message"

    def at_exit(self) -> None:
        failure = self.failure()
        if failure is None:
            return
        status, why = failure
        if self.mark_path:  # first: the launcher's evidence that this process failed before its peers
            try:
                write_mark(self.mark_path, time.monotonic())
            except OSError as err:
                print(f"easykv: cannot record this failure for launch_local ({err}); it may name a peer "
                      "that failed because of this process instead", file=sys.stderr, flush=True)  # fmt: skip
        print(f"easykv: this process is exiting with an error ({why}); it skips JAX's shutdown barrier",
              file=sys.stderr, flush=True)  # fmt: skip
        _end(status)


def _c_exit_status(code: int) -> int:
    # Python hands C's exit() the int it gets from PyLong_AsLong, which is -1 on overflow.
    if not -(1 << (_LONG_BITS - 1)) <= code < 1 << (_LONG_BITS - 1):
        return 255
    return code & 0xFF


def _flushed(stream: Any) -> bool:
    if stream is None or getattr(stream, "closed", False):
        return True  # Python skips these too
    try:
        stream.flush()
    except Exception:  # a broken stream must not keep the process from ending
        return False
    return True


def _end(status: int) -> NoReturn:
    """Ends the process as Python would with ``status`` (negative: by that signal), skipping the
    rest of its shutdown."""
    if not _flushed(sys.stdout) and status != -signal.SIGINT:
        status = _STDOUT_UNFLUSHED
    _flushed(sys.stderr)
    try:
        ctypes.CDLL(None).fflush(None)  # what C++ code wrote to stdout; exit() would flush it
    except (OSError, AttributeError, TypeError):  # no C library to ask (not POSIX)
        pass
    if status < 0:
        try:
            signal.signal(-status, signal.SIG_DFL)
            os.kill(os.getpid(), -status)
        except (OSError, ValueError):  # not allowed here: fall back to the shell's code for it
            pass
        status = 128 - status
    os._exit(status)


_hook: _ExitHook | None = None


def install_fail_fast() -> None:
    """From now on a failing exit of this process skips JAX's shutdown barrier (the module
    docstring); a clean one keeps it. Replaces ``sys.exit`` with a recording wrapper. Idempotent."""
    global _hook
    if _hook is not None:
        return
    # The main thread's outermost frame of the __main__ module, found from any thread.
    main = sys.modules.get("__main__")
    main_ident = threading.main_thread().ident  # None only before the thread starts, never for the main one
    frame = sys._current_frames().get(main_ident) if main_ident is not None else None
    found = None
    while frame is not None:
        if main is not None and frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            found = frame
        frame = frame.f_back
    if found is None:  # no script (an embedded interpreter): keep JAX's behaviour
        return
    _hook = _ExitHook(found, os.environ.get(MARK_ENV))
    sys.exit = _hook.record_exit
    atexit.register(_hook.at_exit)  # after `import jax` registered its hook, so it runs first


def write_mark(path: str, moment: float) -> None:
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


def read_mark(path: str) -> float | None:
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):  # none recorded (or not by write_mark): the launcher's own view decides
        return None
