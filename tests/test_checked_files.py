"""`easykv.checked_files`' zip bound and path checks (issue 42): a zip's end records are read, as
``zipfile`` finds them, before ``zipfile`` parses its central directory, so a 17 MB file of
300,000 directory entries (which cost 5 s and +145 MiB to parse before any loader could refuse
it) is refused in microseconds, whichever way its declared count lies; a path holding a NUL byte
is refused naming it (``os.open`` said only "embedded null byte"); names listed from a file are
cut to a few and their count. The zips are built byte by byte (`crafted_zip`), and each is also
handed to ``zipfile`` to show that what the check accepts is all ``zipfile`` parses."""

import io
import time
import tracemalloc
import zipfile

import pytest

from easykv.checked_files import check_zip_directory, open_regular, read_regular, show_names, zip_directory
from easykv.errors import FileRefusedError
from tests.support.hostile_files import crafted_zip

pytestmark = pytest.mark.numpy_only


def _reader(blob: bytes):
    return lambda offset, length: blob[offset:offset + length]


def _zipfile_members(blob: bytes) -> int:
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        return len(zf.infolist())


def _written_zip(members: int, comment: bytes = b"") -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for i in range(members):
            zf.writestr(f"m{i}.npy", b"x" * i)
        zf.comment = comment
    return out.getvalue()


TRUE_ZIPS = {
    "zipfile-written": lambda: _written_zip(5),
    "zipfile-written-with-comment": lambda: _written_zip(3, b"a comment, \x00 and all"),
    "zipfile-written-empty": lambda: _written_zip(0),
    "crafted": lambda: crafted_zip(7),
    "crafted-zip64": lambda: crafted_zip(7, zip64=True),
    "crafted-comment": lambda: crafted_zip(7, comment=b"c" * 1000),
    "crafted-zip64-longest-comment": lambda: crafted_zip(7, zip64=True, comment=b"c" * 0xFFFF),
}


@pytest.mark.parametrize("build", TRUE_ZIPS.values(), ids=TRUE_ZIPS.keys())
def test_the_end_records_say_what_zipfile_parses(build):
    blob = build()
    members, directory = zip_directory(_reader(blob), len(blob))
    assert members == _zipfile_members(blob)
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        assert directory == sum(46 + len(i.orig_filename.encode()) + len(i.extra) + len(i.comment)
                                for i in zf.infolist())  # fmt: skip


def _not_zips() -> dict[str, bytes]:
    blob = crafted_zip(3)
    return {"empty": b"", "21-bytes": blob[-21:], "text": b"just some text" * 10,
            "npy": b"\x93NUMPY\x01\x00" + b" " * 60, **{f"end-record-cut-{n}": blob[:-n] for n in (1, 2, 10, 21)}}


@pytest.mark.parametrize("name", sorted(_not_zips()))
def test_a_file_without_a_whole_end_record_is_no_zip_to_both(name):
    blob = _not_zips()[name]
    assert zip_directory(_reader(blob), len(blob)) is None
    with pytest.raises(zipfile.BadZipFile):
        _zipfile_members(blob)
    assert check_zip_directory(_reader(blob), len(blob), most_members=10, longest_name=20, what="f", expected="x") \
        is False


LIES = {  # (zip, what the message must say)
    "attack-300000-entries": (lambda: crafted_zip(300_000, zip64=True), "declares 300000 zip members"),
    "count-lies-low": (lambda: crafted_zip(300_000, zip64=True, declared=3), "declares a zip directory of 17400000"),
    "count-lies-low-plain": (lambda: crafted_zip(60_000, declared=3), "declares a zip directory of 3480000 bytes"),
    "count-lies-high": (lambda: crafted_zip(3, declared=60_000), "declares 60000 zip members"),
    "count-lies-high-zip64": (lambda: crafted_zip(3, zip64=True, declared=2**40), f"declares {2**40} zip members"),
    "size-lies-low": (lambda: crafted_zip(2000, declared=3, directory_bytes=100), None),  # zipfile parses 100 bytes
    "size-lies-high": (lambda: crafted_zip(3, directory_bytes=2**32 - 1), "declares a zip directory of 4294967295"),
    "comment-after-a-big-directory": (lambda: crafted_zip(50_000, comment=b"#" * 0xFFFF), "50000 zip members"),
}


@pytest.mark.parametrize("name", sorted(LIES))
def test_a_directory_past_the_bound_is_refused_from_the_end_records_whichever_way_they_lie(name):
    build, words = LIES[name]
    blob = build()
    tracemalloc.start()
    start = time.perf_counter()
    try:
        if words is None:
            assert check_zip_directory(_reader(blob), len(blob), most_members=10, longest_name=20, what="f.npz",
                                       expected="such a file") is True  # fmt: skip
        else:
            with pytest.raises(FileRefusedError) as caught:
                check_zip_directory(_reader(blob), len(blob), most_members=10, longest_name=20, what="f.npz",
                                    expected="such a file", path="f.npz")  # fmt: skip
            message = str(caught.value)
            assert message.startswith("f.npz declares ") and words in message, message
            assert "such a file" in message and "nothing was parsed" in message and caught.value.path == "f.npz"
        seconds, (_, peak) = time.perf_counter() - start, tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seconds < 2.0 and peak < 2**20, (seconds, peak)  # a few bytes from the end, not the directory


@pytest.mark.parametrize("name", sorted(set(TRUE_ZIPS) | set(LIES)))
def test_what_the_check_accepts_is_all_zipfile_parses(name):
    """The bound holds for what zipfile reads: it never parses more entries than the check admitted."""
    blob = (TRUE_ZIPS.get(name) or LIES[name][0])()
    try:
        accepted = check_zip_directory(_reader(blob), len(blob), most_members=10, longest_name=20, what="f",
                                       expected="x")  # fmt: skip
    except FileRefusedError:
        return
    assert accepted
    try:
        parsed = _zipfile_members(blob)
    except zipfile.BadZipFile:
        return
    assert parsed <= 10


def test_the_bound_admits_exactly_its_members_at_their_longest_names():
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for i in range(4):
            zf.writestr(f"{i}" * 16, b"data")
    blob = out.getvalue()
    assert check_zip_directory(_reader(blob), len(blob), most_members=4, longest_name=16, what="f", expected="x")
    with pytest.raises(FileRefusedError, match=r"^f declares 4 zip members, more than the 3 x may hold; nothing was "
                                               r"parsed$"):
        check_zip_directory(_reader(blob), len(blob), most_members=3, longest_name=16, what="f", expected="x")


@pytest.mark.parametrize("path", ["/tmp/a\x00b", b"/tmp/a\x00b", "\x00"])
def test_a_path_holding_a_nul_byte_is_refused_naming_it(path):
    """os.open said "ValueError: embedded null byte", naming neither the file nor the fix."""
    for read in (lambda: read_regular(path, max_bytes=10), lambda: open_regular(path).__enter__()):
        with pytest.raises(FileRefusedError) as caught:
            read()
        text = path.decode() if isinstance(path, bytes) else path
        assert str(caught.value) == (f"the path {text!r} holds a NUL byte, which no file name can hold; name the "
                                     "file without it")
        assert caught.value.path == text


def test_names_from_a_file_are_cut_to_a_few_and_their_count():
    assert show_names([]) == "[]"
    assert show_names(["a", "b"]) == "['a', 'b']"
    names = [f"m{i:07d}.npy" for i in range(136_234)]
    shown = show_names(names)
    assert shown.startswith("['m0000000.npy', 'm0000001.npy', ") and shown.endswith(
        "'m0000007.npy', ... and 136226 more, 136234 in all]"), shown
    assert len(show_names(["x" * 10_000] * 100)) < 1000
