"""Paths that attack a reader, and a runner that turns a hang into a failing test.

A FIFO blocks an ordinary open until a writer comes (forever, in a test), ``/dev/zero`` never
ends, a directory is no file, and a sparse file claims any size on no disk. A reader that checks
the descriptor it reads (`easykv.checked_files`) refuses each at once; one that does not hangs,
so every call goes through `finishes_within`: a regression fails the test instead of hanging the
suite.

`crafted_zip` builds, byte by byte, the zips that attack a reader through their directory: a
17 MB file can hold 300,000 central directory entries, which ``zipfile`` parsed whole (seconds,
hundreds of MiB) before a loader could refuse it.
"""

from __future__ import annotations

import os
import struct
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


_LOCAL = struct.Struct("<4s5H3L2H")  # local file header: 30 bytes and the name
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory entry: 46 bytes and the name
_END = struct.Struct("<4s4H2LH")  # end of central directory: 22 bytes and the comment
_END64 = struct.Struct("<4sQ2H2L4Q")  # ZIP64 end of central directory: 56 bytes
_LOCATOR = struct.Struct("<4sLQL")  # ZIP64 end of central directory locator: 20 bytes


def crafted_zip(entries: int, *, declared: int | None = None, directory_bytes: int | None = None,
                zip64: bool = False, comment: bytes = b"") -> bytes:
    """A zip of one empty stored member ``header.npy`` and ``entries`` central directory entries
    (``m0000000.npy``, ..., 58 bytes each) that all point at it, as the attack of issue 42 built it.
    Its end records declare ``declared`` members and a directory of ``directory_bytes`` bytes
    (default: the truth), with ``zip64`` in a ZIP64 end record and locator (the plain record then
    says 0xFFFF and 0xFFFFFFFF, as the attack's did), followed by ``comment``."""
    name = b"header.npy"
    local = _LOCAL.pack(b"PK\x03\x04", 20, 0, 0, 0, 0, 0, 0, 0, len(name), 0) + name
    names = (b"m%07d.npy" % i for i in range(entries))
    directory = b"".join(_CENTRAL.pack(b"PK\x01\x02", 20, 20, 0, 0, 0, 0, 0, 0, 0, len(n), 0, 0, 0, 0, 0, 0) + n
                         for n in names)  # fmt: skip
    members = entries if declared is None else declared
    size = len(directory) if directory_bytes is None else directory_bytes
    offset = len(local)
    if zip64:
        end64_at = offset + len(directory)
        tail = (_END64.pack(b"PK\x06\x06", 44, 45, 45, 0, 0, members, members, size, offset)
                + _LOCATOR.pack(b"PK\x06\x07", 0, end64_at, 1)
                + _END.pack(b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, len(comment)))
    else:
        tail = _END.pack(b"PK\x05\x06", 0, 0, members, members, size, offset, len(comment))
    return local + directory + tail + comment
