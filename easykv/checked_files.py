"""Reading a file that may be hostile: opened once, checked on the descriptor that reads it.

A check on a path followed by an open of the same path is a race: the file may be replaced in
between by a FIFO (the read blocks forever), a link to ``/dev/zero`` (it never ends) or a huge
sparse file (it fills memory). Every file easykv reads back (checkpoint records and page
chunks, orbax's metadata, sequence exports, the demo's weights) is therefore opened here once,
non-blocking (opening a FIFO does not wait for a writer), optionally without following a link,
and ``fstat`` of that descriptor decides: only a regular file of an acceptable size is read,
through the same descriptor. A file that shrinks or grows while read is refused too, never
returned short or long.

A zip (``.npz``) is parsed by ``zipfile`` whole before any member is looked at: a small file
whose central directory holds 300,000 entries costs seconds and hundreds of MiB before a loader
can refuse it. `check_zip_directory` reads the end-of-central-directory records first (a few
bytes from the file's end) and refuses a directory larger than the members the loader can
accept, before ``zipfile`` parses anything. Messages that list names read from a file show the
first few and how many there are (`show_names`): a file of 100,000 names is not a 1.6 MB message.

This module imports only ``easykv.errors`` and the standard library (no jax, no numpy).
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from easykv.errors import FileRefusedError

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

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
      FileRefusedError: a path holding a NUL byte, a link (with ``follow_links=False``), a FIFO,
        device, socket or directory, or a size outside what was asked; nothing was read.
      OSError: the open or ``fstat`` itself failed (permissions, I/O)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= os.O_NOFOLLOW
    if "\x00" in os.fsdecode(path):  # os.open would say "embedded null byte", naming neither file nor fix
        raise FileRefusedError(f"the path {os.fsdecode(path)!r:.200} holds a NUL byte, which no file name can hold; "
                               "name the file without it", path=os.fsdecode(path))
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


def read_into(fd: int, offset: int, buffer: WriteableBuffer, path: str | os.PathLike[str]) -> None:
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


def show_names(names: Iterable[str], *, most: int = 8) -> str:
    """Names read from a file, for a message: the first ``most`` (each cut to 60 characters) and,
    when there are more, how many in all (``['a.npy', 'b.npy', ... and 136226 more, 136234 in all]``)."""
    listed = list(names)
    shown = ", ".join(f"{name!r:.60}" for name in listed[:most])
    more = f", ... and {len(listed) - most} more, {len(listed)} in all" if len(listed) > most else ""
    return f"[{shown}{more}]"


# ---- zip files -------------------------------------------------------------------------------------
# The records at a zip's end (APPNOTE 4.3.14-16), as zipfile reads them: the end of central
# directory (22 bytes and a comment of at most 64 KiB), and before it, for a ZIP64 archive, a
# locator (20 bytes) preceded by the ZIP64 end record (56 bytes).
_END = struct.Struct("<4s4H2LH")  # signature, disk, directory disk, entries here, entries, size, offset, comment
_END_SIGNATURE = b"PK\x05\x06"
_LOCATOR = struct.Struct("<4sLQL")  # signature, disk of the ZIP64 record, its offset, disks
_LOCATOR_SIGNATURE = b"PK\x06\x07"
_END64 = struct.Struct("<4sQ2H2L4Q")  # signature, size, versions, disks, entries here, entries, size, offset
_END64_SIGNATURE = b"PK\x06\x06"
_MOST_COMMENT = 0xFFFF
# One central directory entry: 46 fixed bytes and its name, plus room for what a writer adds to a
# member it saved (a ZIP64 extra field of sizes and offset takes 28 bytes).
_ENTRY_BYTES = 46
_ENTRY_EXTRA_BYTES = 64

#: ``read_at(offset, length)``: up to ``length`` bytes of the file from ``offset`` (fewer at its end).
ReadAt = Callable[[int, int], bytes]


def zip_directory(read_at: ReadAt, size: int) -> tuple[int, int] | None:
    """``(members, directory bytes)`` that a zip file of ``size`` bytes declares at its end, or
    None when it has no end-of-central-directory record (it is no zip).

    The records are found as ``zipfile`` finds them: the end record in the last 22 bytes when they
    are one without a comment, else at the last signature in the final 64 KiB; a ZIP64 end record
    (whose figures replace the plain record's, which then may say 0xFFFF) where a locator right
    before the end record leads. Python 3.11's ``zipfile`` reads the ZIP64 record right before the
    locator, the ZIP format names the one at the locator's offset: each reading's figures are
    taken and the larger returned, so what ``zipfile`` parses is never more than this.
    ``zipfile`` does not count entries, it parses the directory's bytes: those bound its work, and
    the count is what the file admits to."""
    if size < _END.size:
        return None
    at, record = size - _END.size, read_at(size - _END.size, _END.size)
    if not (len(record) == _END.size and record.startswith(_END_SIGNATURE) and record.endswith(b"\0\0")):
        start = max(size - _MOST_COMMENT - 1 - _END.size, 0)
        tail = read_at(start, size - start)
        found = tail.rfind(_END_SIGNATURE)
        if found < 0 or len(tail) - found < _END.size:  # zipfile: "File is not a zip file"
            return None
        at, record = start + found, tail[found:found + _END.size]
    _, _, _, here, total, directory, _, _ = _END.unpack(record)
    plain = (max(here, total), directory)
    figures = [plain]
    locator = read_at(at - _LOCATOR.size, _LOCATOR.size) if at >= _LOCATOR.size else b""
    if len(locator) == _LOCATOR.size and locator.startswith(_LOCATOR_SIGNATURE):
        _, _, named_offset, _ = _LOCATOR.unpack(locator)
        # Each reading takes its ZIP64 record when it finds one there, else the plain figures.
        figures = [_zip64_figures(read_at, size, offset) or plain
                   for offset in (at - _LOCATOR.size - _END64.size, named_offset)]  # fmt: skip
    return max(members for members, _ in figures), max(directory for _, directory in figures)


def _zip64_figures(read_at: ReadAt, size: int, offset: int) -> tuple[int, int] | None:
    """``(members, directory bytes)`` of a ZIP64 end record at ``offset``; None when there is none."""
    record = read_at(offset, _END64.size) if 0 <= offset <= size - _END64.size else b""
    if len(record) != _END64.size or not record.startswith(_END64_SIGNATURE):
        return None
    _, _, _, _, _, _, here, total, directory, _ = _END64.unpack(record)
    return max(here, total), directory


def check_zip_directory(read_at: ReadAt, size: int, *, most_members: int, longest_name: int, what: str,
                        expected: str, path: str | os.PathLike[str] | None = None) -> bool:
    """Refuse a zip whose end records declare more members, or a larger central directory, than
    ``most_members`` entries with names of at most ``longest_name`` bytes take: in microseconds,
    from a few bytes at its end (`zip_directory`), before ``zipfile`` parses the directory.

    Args:
      read_at: reads the file (`ReadAt`).
      size: the file's bytes.
      most_members: the most members a file the caller accepts holds.
      longest_name: the longest member name (in bytes) such a file holds.
      what: the file, for the message (e.g. ``"sequence export file 'e.npz'"``).
      expected: what such a file is, for the message (e.g. ``"a sequence export"``).
      path: the file's path, if it has one (`FileRefusedError.path`).

    Returns:
      False when the file has no end-of-central-directory record (it is no zip; the caller says
      what it expected), True when its directory is within the bound.

    Raises:
      FileRefusedError: more members, or a larger directory, than the bound; nothing was parsed.
    """
    declared = zip_directory(read_at, size)
    if declared is None:
        return False
    members, directory_bytes = declared
    most_bytes = most_members * (_ENTRY_BYTES + longest_name + _ENTRY_EXTRA_BYTES)
    if members > most_members:
        raise FileRefusedError(f"{what} declares {members} zip members, more than the {most_members} {expected} may "
                               "hold; nothing was parsed", path=path)
    if directory_bytes > most_bytes:
        raise FileRefusedError(f"{what} declares a zip directory of {directory_bytes} bytes, more than the "
                               f"{most_bytes} that the {most_members} members {expected} may hold take; nothing was "
                               "parsed", path=path)
    return True


__all__ = ["ReadAt", "check_zip_directory", "file_kind", "open_regular", "read_exactly", "read_into", "read_regular",
           "show_names", "zip_directory"]
