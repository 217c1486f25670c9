"""Paths that attack a reader, and a runner that turns a hang into a failing test.

A FIFO blocks an ordinary open until a writer comes (forever, in a test), ``/dev/zero`` never
ends, a directory is no file, and a sparse file claims any size on no disk. A reader that checks
the descriptor it reads (`easykv.checked_files`) refuses each at once; one that does not hangs,
so every call goes through `finishes_within`: a regression fails the test instead of hanging the
suite.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HANG_S = 20.0  # a refusal takes milliseconds; this only bounds a regression (a loaded CI machine included)


def hostile_paths(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """``name -> (path, what a refusal must call it)``: a FIFO, ``/dev/zero``, a directory, and
    links to a FIFO and to ``/dev/zero`` (a link a user names is followed: what it leads to decides)."""
    fifo = tmp_path / "weights.fifo"
    os.mkfifo(fifo)
    (tmp_path / "a-directory").mkdir()
    (tmp_path / "link-to-fifo").symlink_to(fifo)
    (tmp_path / "link-to-dev-zero").symlink_to("/dev/zero")
    return {"fifo": (fifo, "is a FIFO"), "dev-zero": (Path("/dev/zero"), "is a character device"),
            "directory": (tmp_path / "a-directory", "is a directory"),
            "link-to-fifo": (tmp_path / "link-to-fifo", "is a FIFO"),
            "link-to-dev-zero": (tmp_path / "link-to-dev-zero", "is a character device")}  # fmt: skip


def sparse_file(path: Path, size: int, *, head: bytes = b"") -> Path:
    """``path`` holding ``head`` and then nothing but a hole up to ``size`` bytes (no disk used)."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def finishes_within(fn: Callable[[], Any], *, seconds: float = HANG_S, fifos: tuple[Path, ...] = ()) -> Any:
    """What ``fn()`` returned, or the exception it raised, within ``seconds``; a call still
    running then fails the test. Before failing, each of ``fifos`` is opened for writing and
    closed, so a reader blocked on one sees its end and the thread does not outlive the test."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as err:  # noqa: BLE001 (handed to the test, which checks it)
            outcome.append(err)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass  # no reader blocked on it
        pytest.fail(f"{fn} was still running after {seconds} s: the reader blocks on a FIFO or reads without end")
    return outcome[0]
