"""Reading a file that may be hostile: opened once, checked on the descriptor that reads it.

A check on a path followed by an open of the same path is a race: the file may be replaced in
between by a FIFO (the read blocks forever), a link to ``/dev/zero`` (it never ends) or a huge
sparse file (it fills memory). Every file easykv reads back (checkpoint records and page
chunks, orbax's metadata, sequence exports, the demo's weights) is therefore opened here once,
non-blocking (opening a FIFO does not wait for a writer), optionally without following a link,
and ``fstat`` of that descriptor decides: only a regular file of an acceptable size is read,
through the same descriptor. A file that shrinks or grows while read is refused too, never
returned short or long.

This module imports only ``easykv.errors`` and the standard library (no jax, no numpy).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from typing import Any

from easykv.errors import FileRefusedError

_KIND = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a link"}


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words (``"a FIFO"``, ``"a directory"``, ...)."""
    return _KIND.get(stat.S_IFMT(mode), f"not a regular file (mode {oct(stat.S_IFMT(mode))})")


@contextlib.contextmanager
def open_regular(path: str | os.PathLike[str], *, max_bytes: int | None = None, follow_links: bool = True,
                 size: int | None = None) -> Iterator[tuple[int, os.stat_result]]:
    """Open ``path`` for reading once and yield ``(descriptor, fstat of it)``, closed on exit.

    Args:
      path: the file.
      max_bytes: refuse a file larger than this (None: any size).
      follow_links: False refuses a link as the last component of ``path`` (``O_NOFOLLOW``).
      size: refuse a file that does not hold exactly this many bytes (None: any size).

    Raises:
      FileNotFoundError: ``path`` does not exist (the caller says what that means).
      FileRefusedError: a link (with ``follow_links=False``), a FIFO, device, socket or
        directory, or a size outside what was asked; nothing was read.
      OSError: the open or ``fstat`` itself failed (permissions, I/O)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as err:
        # O_NOFOLLOW on a link fails with ELOOP (Linux) or EMLINK (FreeBSD): say it is a link.
        if not follow_links and os.path.islink(path):
            raise FileRefusedError(f"{os.fspath(path)} is a link; a file easykv wrote is never one", path=path) from err
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileRefusedError(f"{os.fspath(path)} is {file_kind(info.st_mode)}, not a regular file", path=path)
        if max_bytes is not None and info.st_size > max_bytes:
            raise FileRefusedError(f"{os.fspath(path)} holds {info.st_size} bytes, more than the {max_bytes} such "
                                   "a file can hold", path=path)
        if size is not None and info.st_size != size:
            raise FileRefusedError(f"{os.fspath(path)} holds {info.st_size} bytes, not {size}", path=path)
        yield fd, info
    finally:
        os.close(fd)


def read_exactly(fd: int, size: int, path: str | os.PathLike[str]) -> bytes:
    """The ``size`` bytes of an open regular file, from its start; FileRefusedError when it holds
    fewer (it shrank) or more (it grew) than ``size`` by the end of the read."""
    chunks, got = [], 0
    while got < size:
        chunk = os.pread(fd, size - got, got)
        if not chunk:
            raise FileRefusedError(f"{os.fspath(path)} shrank to {got} bytes while read (it held {size})", path=path)
        chunks.append(chunk)
        got += len(chunk)
    if os.pread(fd, 1, size):
        raise FileRefusedError(f"{os.fspath(path)} grew past {size} bytes while read", path=path)
    return b"".join(chunks)


def read_regular(path: str | os.PathLike[str], *, max_bytes: int, follow_links: bool = True) -> bytes:
    """The whole of a regular file of at most ``max_bytes`` bytes, checked and read through one
    descriptor (`open_regular`, `read_exactly`); the same exceptions."""
    with open_regular(path, max_bytes=max_bytes, follow_links=follow_links) as (fd, info):
        return read_exactly(fd, info.st_size, path)


def read_into(fd: int, offset: int, buffer: Any, path: str | os.PathLike[str]) -> None:
    """Fill ``buffer`` (a writable, C-contiguous bytes-like object) from ``offset`` of an open
    regular file, all of it; FileRefusedError when the file ends first (it shrank while read).
    Unlike a memory map, a file truncated meanwhile cannot end the process (SIGBUS)."""
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise FileRefusedError(f"{os.fspath(path)} ends at {offset + done} bytes, before the "
                                   f"{offset + len(view)} it must hold (it shrank while read)", path=path)
        done += n


__all__ = ["file_kind", "open_regular", "read_exactly", "read_into", "read_regular"]
