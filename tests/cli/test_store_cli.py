"""`easykv store stats` and `easykv store gc`: the table and JSON a store operator reads, gc
oldest first end to end, and one-line errors (exit 2: a bad URL, prefix or size, gc where the
engine evicts by itself; exit 1: a store that does not answer)."""

import json
import os
import re

import pytest

from easykv.cli import main
from easykv.tiers.store.url import open_backend
from tests.support.redis_server import redis_server


def _run(capsys, *argv):
    code = main(["store", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _row(out: str, key: str) -> str:
    m = re.search(rf"^  {re.escape(key)}\s+(.*)$", out, re.M)
    assert m, f"row {key!r} missing from:\n{out}"
    return m.group(1)


def _file_store(tmp_path):
    """5 values of 1 KiB under ``g/``, k0 the newest ... k4 the oldest, and one under ``h/``."""
    url = f"file://{tmp_path}/store"
    store = open_backend(url)
    store.put_if_absent([(f"g/k{i}", bytes([i]) * 1024) for i in range(5)] + [("h/x", b"12345")])
    for i in range(5):
        os.utime(tmp_path / "store" / "g" / f"k{i}", (1_700_000_000 - i * 60,) * 2)
    os.utime(tmp_path / "store" / "h" / "x", (1_700_000_100,) * 2)
    return url, store


def test_stats_prints_a_table(capsys, tmp_path):
    url, _ = _file_store(tmp_path)
    code, out, err = _run(capsys, "stats", url, "--prefix", "g/")
    assert code == 0 and err == ""
    assert out.splitlines()[0] == f"easykv store stats {url} (prefix 'g/')"
    assert _row(out, "entries") == "5"
    assert _row(out, "bytes") == "5.00 KiB (5,120)"
    assert _row(out, "oldest") == "2023-11-14 22:09:20 UTC"  # 1_700_000_000 - 240
    assert _row(out, "newest") == "2023-11-14 22:13:20 UTC"


def test_stats_json(capsys, tmp_path):
    url, _ = _file_store(tmp_path)
    code, out, _ = _run(capsys, "stats", url, "--json")
    assert code == 0
    assert json.loads(out) == {"url": url, "prefix": "", "entries": 6, "bytes": 5125,
                               "oldest": 1_699_999_760.0, "newest": 1_700_000_100.0}


def test_gc_removes_the_oldest_until_the_size_fits(capsys, tmp_path):
    url, store = _file_store(tmp_path)
    code, out, err = _run(capsys, "gc", url, "--max-bytes", "2KiB", "--prefix", "g/")
    assert code == 0 and err == ""
    assert _row(out, "removed") == "3 entries, 3.00 KiB"
    assert _row(out, "kept") == "2 entries, 2.00 KiB (at most 2.00 KiB asked)"
    assert store.list_keys() == ["g/k0", "g/k1", "h/x"]
    code, out, _ = _run(capsys, "gc", url, "--max-bytes", "0")
    assert code == 0 and _row(out, "kept") == "0 entries, 0 B (at most 0 B asked)" and store.list_keys() == []


def test_stats_of_a_redis_server(capsys):
    with redis_server() as server:
        open_backend(server.url).put_if_absent([("a/1", b"xy"), ("a/2", b"z")])
        code, out, _ = _run(capsys, "stats", server.url)
        assert code == 0 and _row(out, "entries") == "2" and _row(out, "bytes") == "3 B (3)"
        assert _row(out, "oldest") == "-"


@pytest.mark.parametrize("argv, words", [
    (["stats", "file://relative/dir"], "file:///abs/dir"),
    (["stats", "ftp://x"], "unknown scheme 'ftp'"),
    (["stats", "memory://cli", "--prefix", "/abs"], "store key prefix '/abs'"),
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
    assert code == 1 and "cannot create its directory" in err
