"""`easykv store stats` and `easykv store gc`: the table and JSON a store operator reads, gc
oldest first end to end, and one-line errors (exit 2: a bad URL, prefix or size, gc where the
engine evicts by itself; exit 1: a store that does not answer)."""

import json
import os

import pytest

from easykv.cli import main
from easykv.tiers.store.url import open_backend
from tests.cli.test_cli import _row
from tests.support.redis_server import redis_server


def _run(capsys, *argv):
    code = main(["store", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


G = "easykv-v1/g-0/"


def _key(model: str, i: int) -> str:
    return f"easykv-v1/{model}/{'cd' * 16}/{i:064x}/0"


def _file_store(tmp_path):
    """5 values of 1 KiB of model ``g-0``, k0 the newest ... k4 the oldest, and one of ``h-0``."""
    url = f"file://{tmp_path}/store"
    store = open_backend(url)
    store.put_if_absent([(_key("g-0", i), bytes([i]) * 1024) for i in range(5)] + [(_key("h-0", 0), b"12345")])
    for i in range(5):
        os.utime(tmp_path / "store" / _key("g-0", i), (1_700_000_000 - i * 60,) * 2)
    os.utime(tmp_path / "store" / _key("h-0", 0), (1_700_000_100,) * 2)
    return url, store


def test_stats_prints_a_table(capsys, tmp_path):
    url, _ = _file_store(tmp_path)
    code, out, err = _run(capsys, "stats", url, "--prefix", G)
    assert code == 0 and err == ""
    assert out.splitlines()[0] == f"easykv store stats {url} (prefix {G!r})"
    assert _row(out, "entries") == "5"
    assert _row(out, "bytes") == "5.00 KiB (5,120)"
    assert _row(out, "oldest") == "2023-11-14 22:09:20 UTC"  # 1_700_000_000 - 240
    assert _row(out, "newest") == "2023-11-14 22:13:20 UTC"


def test_stats_json(capsys, tmp_path):
    url, _ = _file_store(tmp_path)
    code, out, _ = _run(capsys, "stats", url, "--json")
    assert code == 0
    assert json.loads(out) == {"url": url, "prefix": "easykv-v1/", "entries": 6, "bytes": 5125,
                               "oldest": 1_699_999_760.0, "newest": 1_700_000_100.0, "foreign_entries": 0}


def test_gc_removes_the_oldest_until_the_size_fits(capsys, tmp_path):
    url, store = _file_store(tmp_path)
    code, out, err = _run(capsys, "gc", url, "--max-bytes", "2KiB", "--prefix", G)
    assert code == 0 and err == ""
    assert _row(out, "removed") == "3 entries, 3.00 KiB"
    assert _row(out, "kept") == "2 entries, 2.00 KiB (at most 2.00 KiB asked)"
    assert store.list_keys() == [_key("g-0", 0), _key("g-0", 1), _key("h-0", 0)]
    code, out, _ = _run(capsys, "gc", url, "--max-bytes", "0")
    assert code == 0 and _row(out, "kept") == "0 entries, 0 B (at most 0 B asked)" and store.list_keys() == []


def test_stats_of_a_redis_server(capsys):
    with redis_server() as server:
        open_backend(server.url).put_if_absent([(_key("a", 1), b"xy"), (_key("a", 2), b"z")])
        code, out, _ = _run(capsys, "stats", server.url)
        assert code == 0 and _row(out, "entries") == "2" and _row(out, "bytes") == "3 B (3)"
        assert _row(out, "oldest") == "-"


@pytest.mark.parametrize("argv, words", [
    (["stats", "file://relative/dir"], "file:///abs/dir"),
    (["stats", "ftp://x"], "unknown scheme 'ftp'"),
    (["stats", "memory://cli", "--prefix", "easykv-v1//abs"], "store key prefix 'easykv-v1//abs'"),
    (["stats", "memory://cli", "--prefix", "/abs"], "--prefix '/abs' is outside the store's keys"),
    (["gc", "memory://cli", "--max-bytes", "1GiB"], "only a file:// store"),
    (["gc", "redis://127.0.0.1:1/0", "--max-bytes", "1GiB"], "maxmemory-policy allkeys-lru"),
    (["gc", "memory://cli", "--max-bytes", "-5"], "argument --max-bytes: '-5' is not a size"),
    (["gc", "memory://cli", "--max-bytes", "lots"], "argument --max-bytes: 'lots' is not a size"),
    (["gc", "memory://cli"], "--max-bytes"),
    (["stats"], "url"),
    (["compact", "memory://cli"], "invalid choice"),
])  # fmt: skip
def test_bad_input_gives_one_line_and_exit_2(capsys, argv, words):
    code, out, err = _run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("easykv store") and "error:" in lines[0] and words in lines[0], lines[0]


def test_a_store_that_does_not_answer_gives_one_line_and_exit_1(capsys, tmp_path):
    with redis_server() as server:
        url = server.url
    code, out, err = _run(capsys, "stats", url)  # the server is stopped: connection refused
    assert code == 1 and out == ""
    assert err.strip() == err.strip().splitlines()[0]
    assert err.startswith(f"easykv store stats: store {url} did not answer: ConnectionError")
    (tmp_path / "file").write_bytes(b"x")
    code, _, err = _run(capsys, "gc", f"file://{tmp_path}/file/store", "--max-bytes", "1")
    assert code == 1 and f"its directory {tmp_path}/file/store does not exist" in err


def _plant(root):
    """A directory that is no store (a project, notes, a non-ASCII name, a directory link), part of
    it under the key scheme's directory; returns every path planted."""
    paths = [root / "project" / "src" / "main.py", root / "notes.txt", root / "easykv-v1" / "README.md",
             root / "easykv-v1" / "r\u00e9sum\u00e9.txt", root / "easykv-v1" / "g-0" / "notes.txt"]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"precious\n" * 100)
    os.symlink(root / "project", root / "easykv-v1" / "linkdir")
    return [*paths, root / "easykv-v1" / "linkdir"]


@pytest.mark.parametrize("prefix", [[], ["--prefix", G]])
def test_gc_of_a_directory_that_is_no_store_deletes_nothing_and_says_what_it_left(capsys, tmp_path, prefix):
    planted = _plant(tmp_path)
    code, out, err = _run(capsys, "gc", f"file://{tmp_path}", "--max-bytes", "0", *prefix)
    assert code == 0 and err == "" and _row(out, "removed") == "0 entries, 0 B"
    assert _row(out, "left alone") == f"{1 if prefix else 4} entries that are no easykv value (other files, links)"
    assert all(os.path.lexists(path) for path in planted)
    code, out, _ = _run(capsys, "stats", f"file://{tmp_path}", "--json")  # the non-ASCII name: skipped, counted
    assert code == 0 and json.loads(out)["entries"] == 0 and json.loads(out)["foreign_entries"] == 4


@pytest.mark.parametrize("prefix", ["", "g-0/", "easykv-v", "easykv-v2/"])
def test_a_prefix_outside_the_key_scheme_is_refused_before_anything_is_read(capsys, tmp_path, prefix):
    url, store = _file_store(tmp_path)
    planted = _plant(tmp_path / "store")
    code, out, err = _run(capsys, "gc", url, "--max-bytes", "0", "--prefix", prefix)
    assert code == 2 and out == ""
    assert err.strip() == (f"easykv store: error: --prefix {prefix!r} is outside the store's keys: every easykv "
                           "key starts with 'easykv-v1/'; write e.g. --prefix easykv-v1/<model slug>/ or leave "
                           "--prefix out")
    values = [_key("g-0", i) for i in range(5)] + [_key("h-0", 0)]
    assert store.exists_many(values) == [True] * 6 and all(os.path.lexists(path) for path in planted)


def test_stats_of_a_missing_directory_is_exit_1_and_creates_nothing(capsys, tmp_path):
    missing = tmp_path / "typo" / "never" / "made"
    for argv in (["stats", f"file://{missing}"], ["gc", f"file://{missing}", "--max-bytes", "0"]):
        code, out, err = _run(capsys, *argv)
        assert code == 1 and out == "" and len(err.strip().splitlines()) == 1
        assert err.startswith(f"easykv store {argv[0]}: store file://{missing}: its directory {missing} does not "
                              "exist or is not a directory: check the path; this command never creates a store"), err
    assert not (tmp_path / "typo").exists()
