"""A real ``redis-server`` for the store tests: started on a free loopback port with no
persistence (no RDB, no AOF), ready once it answers PING; `RedisServer.kill` SIGKILLs it and
`RedisServer.restart` starts it again on the same port (fault tests). When the binary is missing
the test fails with the line that installs it (never a silent skip)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest

INSTALL_LINE = "apt-get install -y redis-server"
_START_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process of the test's own (see the module docstring).

    Attributes:
      port: its loopback port (kept across `restart`).
      url: ``redis://127.0.0.1:PORT/0``.
      log_path: its log file (read when it fails to start).
    """

    def __init__(self, binary: str, workdir: str, *, extra_args: tuple[str, ...] = ()):
        self._binary = binary
        self._workdir = workdir
        self._extra_args = extra_args
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = os.path.join(workdir, "redis.log")
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it and wait until it answers PING (fails the test after 10 s)."""
        assert self._process is None, "already running"
        args = [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self._workdir, "--daemonize", "no", "--logfile", self.log_path, *self._extra_args]
        self._process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _answers_ping(self.port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                with open(self.log_path, errors="replace") as log:
                    tail = log.read()[-2000:]
                pytest.fail(f"redis-server on port {self.port} did not answer PING within {_START_TIMEOUT_S:g} s; "
                            f"its log:\n{tail}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the server (a crash: no shutdown, no goodbye to clients) and reap it."""
        assert self._process is not None, "not running"
        self._process.send_signal(signal.SIGKILL)
        self._process.wait(timeout=10)
        self._process = None

    def pause(self) -> None:
        """SIGSTOP the server: its port still accepts connections, nothing answers (a hung server)."""
        assert self._process is not None, "not running"
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        assert self._process is not None, "not running"
        self._process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Start it again on the same port (empty: nothing was persisted)."""
        self.start()

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after 5 s); nothing when it is not running."""
        if self._process is None:
            return
        process, self._process = self._process, None
        process.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def redis_binary() -> str:
    """The ``redis-server`` path; fails the test naming the install line when there is none."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(f"redis-server is not installed; the store tests need a real one: {INSTALL_LINE}", pytrace=False)
    return binary


@contextlib.contextmanager
def redis_server(*extra_args: str) -> Iterator[RedisServer]:
    """A started `RedisServer` (``extra_args`` go to ``redis-server``, e.g. ``"--maxmemory",
    "1mb"``), stopped and its directory removed afterwards."""
    binary = redis_binary()
    with tempfile.TemporaryDirectory(prefix="easykv-redis-") as workdir:
        server = RedisServer(binary, workdir, extra_args=extra_args)
        server.start()
        try:
            yield server
        finally:
            server.stop()


def redis_server_fixture(*extra_args: str, scope: str = "function") -> Callable[[], Iterator[RedisServer]]:
    """A pytest fixture of a `redis_server` (assign it to a name in a test module)."""

    @pytest.fixture(scope=scope)
    def fixture() -> Iterator[RedisServer]:
        with redis_server(*extra_args) as server:
            yield server

    return fixture
