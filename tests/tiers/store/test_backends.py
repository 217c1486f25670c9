"""Every `StoreBackend` method on a ``file://`` store, a ``memory://`` store and a real
``redis-server`` (tests/support/redis_server.py): batched answers in order, misses as None, one
atomic put-if-absent under racing threads (no torn value), gc oldest first, stats, and the faults:
a file store's directory removed or replaced, a path it cannot write, a Redis server killed,
paused or out of memory -> StoreUnavailableError quickly, then recovery."""

import itertools
import os
import random
import shutil
import stat
import threading
import time

import numpy as np
import pytest
import redis
import tensorstore as ts

from easykv.errors import StoreUnavailableError
from easykv.tiers.store.backend import GcResult, StoreStats
from easykv.tiers.store.key_syntax import is_store_key
from easykv.tiers.store.tensorstore_kv import NO_VALUE_GENERATION
from easykv.tiers.store.url import open_backend
from tests.support.redis_server import redis_server, redis_server_fixture

ENGINES = ["file", "memory", "redis"]
_names = itertools.count()
shared_redis = redis_server_fixture(scope="module")


@pytest.fixture(params=ENGINES)
def backend(request, tmp_path):
    if request.param == "file":
        store = open_backend(f"file://{tmp_path}/store", timeout_s=2.0)
    elif request.param == "memory":
        store = open_backend(f"memory://backends-{os.getpid()}-{next(_names)}", timeout_s=2.0)
    else:
        server = request.getfixturevalue("shared_redis")
        redis.Redis.from_url(server.url).flushdb()
        store = open_backend(server.url, timeout_s=2.0)
    yield store
    store.close()


def _key(i: int) -> str:
    return f"easykv-v1/ns/00/{i:064x}/0"


def _store_key(i: int, model: str = "m-0", head: int = 0) -> str:
    """A key of the shape easykv writes (key_syntax.is_store_key): what stats and gc count."""
    return f"easykv-v1/{model}/{'ab' * 16}/{i:064x}/{head}"


def test_batched_answers_come_in_the_order_asked_with_misses(backend):
    values = {_key(i): bytes([i]) * (i + 1) for i in range(0, 20, 2)}
    assert backend.put_if_absent(list(values.items())) == [True] * 10
    asked = [_key(i) for i in random.Random(0).sample(range(20), 20)]
    assert backend.get_many(asked) == [values.get(k) for k in asked]
    assert backend.exists_many(asked) == [k in values for k in asked]
    assert backend.get_many([]) == [] and backend.exists_many([]) == [] and backend.put_if_absent([]) == []


def test_a_second_put_loses_and_the_first_value_stays(backend):
    assert backend.put_if_absent([(_key(1), b"first"), (_key(2), b"two")]) == [True, True]
    assert backend.put_if_absent([(_key(3), b"three"), (_key(1), b"second")]) == [True, False]
    assert backend.get_many([_key(1), _key(2), _key(3)]) == [b"first", b"two", b"three"]


def test_delete_counts_what_was_there_and_list_is_sorted_by_prefix(backend):
    backend.put_if_absent([("b/2", b"x"), ("a/1", b"y"), ("a/0", b"z"), ("ab", b"w")])
    assert backend.list_keys("a/") == ["a/0", "a/1"]
    assert backend.list_keys("a") == ["a/0", "a/1", "ab"]
    assert backend.list_keys() == ["a/0", "a/1", "ab", "b/2"]
    assert backend.delete_many(["a/1", "missing", "b/2"]) == 2
    assert backend.list_keys() == ["a/0", "ab"] and backend.delete_many([]) == 0


def test_stats_count_entries_and_bytes_under_a_prefix(backend, request):
    backend.put_if_absent([(_store_key(1, "p"), b"1" * 10), (_store_key(2, "p"), b"2" * 30),
                           (_store_key(3, "q"), b"3" * 5)])
    stats = backend.stats("easykv-v1/p/")
    assert (stats.entries, stats.bytes) == (2, 40)
    total = backend.stats()
    assert (total.entries, total.bytes) == (3, 45)
    if "file" in request.node.callspec.id:
        assert stats.oldest is not None and stats.oldest <= stats.newest <= time.time() + 1
    else:  # memory and Redis keep no times
        assert stats.oldest is None and stats.newest is None
    none = backend.stats("none/")
    assert (none.entries, none.bytes, none.oldest, none.newest) == (0, 0, None, None)


def test_the_store_key_shape_is_the_one_namespace_builds():
    from easykv.spec.metadata import PagedAttentionCacheMetaData
    from easykv.tiers.store.namespace import StoreNamespace

    meta = PagedAttentionCacheMetaData(batch_size=2, num_hidden_layers=2, num_pages_per_layer=8,
                                       num_pages_per_sequence=4, max_sequences=16, page_size=4, num_kv_heads=2,
                                       kv_head_dim_size=8, hbm_utilization=0.5, dtype="bfloat16")
    key = StoreNamespace.of(meta, "Qwen/Qwen3-8B@main").key(0, bytes(range(32)), 1)
    assert is_store_key(key) and is_store_key(_store_key(7, head=12))
    for foreign in (key + "x", key.replace("easykv-v1", "easykv-v2"), key.rpartition("/")[0] + "/01",
                    key.rpartition("/")[0], "easykv-v1/linkdir", "notes.txt", _key(1)):
        assert not is_store_key(foreign), foreign


@pytest.mark.parametrize("bad", [["a/../b"], ["ok", "/abs"], ["sp ace"]])
def test_bad_keys_are_refused_before_anything_is_written(backend, bad):
    for call in (backend.get_many, backend.exists_many, backend.delete_many,
                 lambda keys: backend.put_if_absent([(k, b"v") for k in keys])):
        with pytest.raises(ValueError, match="store key"):
            call(bad)
    assert backend.list_keys() == []


def test_put_refuses_a_repeated_key_and_a_value_that_is_not_bytes(backend):
    with pytest.raises(ValueError, match="given twice"):
        backend.put_if_absent([("a", b"1"), ("b", b"2"), ("a", b"3")])
    with pytest.raises(TypeError, match="'b' is a str; give bytes"):
        backend.put_if_absent([("a", b"1"), ("b", "text")])
    assert backend.list_keys() == []


def test_racing_writers_of_one_key_one_wins_and_no_reader_sees_a_torn_value(backend):
    # Two writers put different 1 MiB values under each key at the same moment while a reader
    # loops: exactly one write wins, and every value read is None or one writer's whole value.
    size, rounds = 1 << 20, 6
    values = (b"A" * size, b"B" * size)
    seen: list[bytes | None] = []
    stop = threading.Event()

    def read_loop(key):
        while not stop.is_set():
            seen.extend(backend.get_many([key]))

    for r in range(rounds):
        key, wins, barrier = _key(1000 + r), [None, None], threading.Barrier(3)

        def write(i, key=key, wins=wins, barrier=barrier):
            barrier.wait()
            wins[i] = backend.put_if_absent([(key, values[i])])[0]

        stop.clear()
        reader = threading.Thread(target=read_loop, args=(key,))
        writers = [threading.Thread(target=write, args=(i,)) for i in range(2)]
        reader.start()
        for w in writers:
            w.start()
        barrier.wait()
        for w in writers:
            w.join()
        stop.set()
        reader.join()
        assert sorted(wins) == [False, True], wins
        assert backend.get_many([key]) == [values[wins.index(True)]]
    assert seen and all(v is None or v in values for v in seen)


# ---- tensorstore -------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [{"driver": "memory"}, {"driver": "file"},
                                  {"driver": "ocdbt", "base": {"driver": "memory"}}])
def test_the_no_value_generation_is_what_tensorstore_reports_for_a_missing_key(spec, tmp_path):
    if spec["driver"] == "file":
        spec = {**spec, "path": f"{tmp_path}/"}
    kv = ts.KvStore.open(spec).result()
    assert kv.read("absent").result().stamp.generation == NO_VALUE_GENERATION


def test_ocdbt_store_round_trip(tmp_path):
    store = open_backend(f"file+ocdbt://{tmp_path}/o")
    assert store.put_if_absent([("a/1", b"x"), ("a/2", b"y")]) == [True, True]
    assert store.put_if_absent([("a/1", b"z")]) == [False]
    again = open_backend(f"file+ocdbt://{tmp_path}/o")  # a second process's view: the same files
    assert again.get_many(["a/2", "a/1", "a/3"]) == [b"y", b"x", None]
    assert again.stats() == StoreStats(entries=0, bytes=0, foreign_entries=2)  # a/1, a/2: no easykv values
    again.put_if_absent([(_store_key(1), b"v")])
    assert again.stats() == StoreStats(entries=1, bytes=1, foreign_entries=2)
    with pytest.raises(ValueError, match="only a file:// store"):
        again.gc(0)


def _aged_file_store(tmp_path):
    """A file store of 5 values of 100 bytes, k0 the newest ... k4 the oldest (mtimes set)."""
    store = open_backend(f"file://{tmp_path}/aged")
    store.put_if_absent([(_store_key(i), bytes([i]) * 100) for i in range(5)])
    for i in range(5):
        os.utime(tmp_path / "aged" / _store_key(i), (1_000_000 - i * 1000,) * 2)
    return store


def test_gc_deletes_the_oldest_first_until_at_most_max_bytes_are_left(tmp_path):
    store = _aged_file_store(tmp_path)
    assert store.stats() == StoreStats(entries=5, bytes=500, oldest=996_000.0, newest=1_000_000.0)
    assert store.gc(250) == GcResult(removed_entries=3, removed_bytes=300, kept_entries=2, kept_bytes=200)
    assert store.list_keys() == [_store_key(0), _store_key(1)]
    assert store.gc(200) == GcResult(0, 0, 2, 200)  # already small enough: nothing removed
    assert store.gc(0, prefix=_store_key(1)) == GcResult(1, 100, 0, 0)
    assert store.list_keys() == [_store_key(0)]


def _plant_foreign_entries(root, outside):
    """Under ``root``'s easykv-v1/: a project directory, a file with a non-ASCII name, a name of the
    key syntax that no cache writes, a directory link, and, under store-key names, a link to a file
    outside, a FIFO and a directory. Returns the paths planted."""
    (outside / "precious.txt").write_bytes(b"x" * 5000)
    scheme = root / "easykv-v1"
    (scheme / "project" / "src").mkdir(parents=True)
    (scheme / "project" / "src" / "main.py").write_bytes(b"print()\n" * 100)
    (scheme / "r\u00e9sum\u00e9.txt").write_bytes(b"x" * 70)
    (scheme / "notes.txt").write_bytes(b"n" * 300)
    os.symlink(outside, scheme / "linkdir")
    for i, make in ((90, lambda p: os.symlink(outside / "precious.txt", p)), (91, os.mkfifo), (92, os.mkdir)):
        (root / _store_key(i)).parent.mkdir(parents=True, exist_ok=True)
        make(root / _store_key(i))
    return [scheme / "project" / "src" / "main.py", scheme / "r\u00e9sum\u00e9.txt", scheme / "notes.txt",
            scheme / "linkdir"] + [root / _store_key(i) for i in (90, 91, 92)]


def test_stats_and_gc_count_and_delete_only_easykv_values(tmp_path):
    (tmp_path / "outside").mkdir()
    store = open_backend(f"file://{tmp_path}/s", timeout_s=2.0)
    store.put_if_absent([(_store_key(1), b"a" * 10), (_store_key(2), b"b" * 20)])
    planted = _plant_foreign_entries(tmp_path / "s", tmp_path / "outside")
    stats = store.stats()
    assert (stats.entries, stats.bytes) == (2, 30)
    # main.py, résumé.txt, notes.txt, linkdir (listed, not entered), and the link and the FIFO under store-key
    # names (an empty directory is not listed)
    assert stats.foreign_entries == 6
    result = store.gc(0)
    assert (result.removed_entries, result.removed_bytes, result.kept_entries) == (2, 30, 0)
    assert result.foreign_entries == stats.foreign_entries
    assert all(os.path.lexists(path) for path in planted)
    assert (tmp_path / "outside" / "precious.txt").read_bytes() == b"x" * 5000
    assert not (tmp_path / "s" / _store_key(1)).exists() and os.path.islink(tmp_path / "s" / _store_key(90))


def test_a_store_opened_without_create_refuses_a_missing_directory_and_creates_nothing(tmp_path):
    missing = tmp_path / "typo" / "never" / "made"
    with pytest.raises(StoreUnavailableError, match=f"its directory {missing} does not exist .*never creates") as info:
        open_backend(f"file://{missing}", create=False)
    assert info.value.url == f"file://{missing}" and not (tmp_path / "typo").exists()
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(StoreUnavailableError, match="does not exist or is not a directory"):
        open_backend(f"file://{tmp_path}/file", create=False)
    assert open_backend(f"file://{missing}").stats().entries == 0 and missing.is_dir()  # a cache's store: created


def test_a_fifo_under_a_key_reads_as_missing_at_once_and_starves_nothing(tmp_path):
    # tensorstore's file I/O thread blocks in open() on a FIFO for good; a few such reads used to
    # exhaust the process-wide pool and hang every file read, checkpoints included.
    store = open_backend(f"file://{tmp_path}/s", timeout_s=0.5)
    store.put_if_absent([(_key(1), b"good")])
    fifo = tmp_path / "s" / _key(2)
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    started = time.monotonic()
    for _ in range(12):  # more reads than the I/O pool has threads
        assert store.get_many([_key(2), _key(1)]) == [None, b"good"]
        assert store.exists_many([_key(2)]) == [False]
    assert time.monotonic() - started < 2.0 and store.refused_paths == 24
    assert store.delete_many([_key(2)]) == 0 and stat.S_ISFIFO(os.lstat(fifo).st_mode)  # never opened nor removed
    other = open_backend(f"file://{tmp_path}/other", timeout_s=2.0)
    assert other.put_if_absent([(_key(3), b"v")]) == [True] and other.refused_paths == 0
    array = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": f"{tmp_path}/zarr"}}, create=True,
                    dtype=ts.int32, shape=[4]).result(timeout=5)
    array.write(np.arange(4, dtype=np.int32)).result(timeout=5)
    assert array.read().result(timeout=5).tolist() == [0, 1, 2, 3]


def test_each_file_store_has_its_own_io_pool(tmp_path):
    # Its own context: a store stuck on its file system (a FIFO that appeared after the check, a hung
    # mount) holds only its own threads, never the default context's that checkpoints use.
    first = open_backend(f"file://{tmp_path}/a")._kv.spec(retain_context=True).to_json()
    second = open_backend(f"file://{tmp_path}/b")._kv.spec(retain_context=True).to_json()
    assert first["context"]["file_io_concurrency"] == {"limit": 8} == second["context"]["file_io_concurrency"]


@pytest.mark.parametrize("max_bytes", [-1, 1.5, True, "10"])
def test_gc_refuses_a_bad_size_and_deletes_nothing(tmp_path, max_bytes):
    store = _aged_file_store(tmp_path)
    with pytest.raises(ValueError, match=r"max_bytes=.* must be an int >= 0"):
        store.gc(max_bytes)
    assert len(store.list_keys()) == 5


def test_gc_is_refused_where_the_engine_keeps_no_times(shared_redis):
    for url in ("memory://gc-refused", shared_redis.url):
        with pytest.raises(ValueError) as info:
            open_backend(url).gc(0)
        expected = "maxmemory-policy allkeys-lru" if url.startswith("redis") else "only a file:// store"
        assert expected in str(info.value)


def _every_call_is_unavailable(store, match):
    calls = [lambda: store.get_many(["a/k"]), lambda: store.exists_many(["a/k"]),
             lambda: store.put_if_absent([("a/new", b"v")]), lambda: store.delete_many(["a/k"]),
             lambda: store.list_keys(), lambda: store.stats()]
    for call in calls:
        with pytest.raises(StoreUnavailableError, match=match) as info:
            call()
        assert info.value.url == store.url
    return len(calls)


def test_a_removed_file_store_directory_is_unavailable_until_it_returns(tmp_path):
    # tensorstore alone would read a removed directory as empty and recreate it on the next write;
    # the backend reports it instead (a shared file system that went away is not an empty store).
    root = tmp_path / "gone"
    store = open_backend(f"file://{root}")
    store.put_if_absent([("a/k", b"v")])
    shutil.rmtree(root)
    assert _every_call_is_unavailable(store, "is gone or is not a directory") == 6
    assert not root.exists()  # nothing recreated it
    root.mkdir()
    assert store.get_many(["a/k"]) == [None] and store.put_if_absent([("a/k", b"w")]) == [True]


def test_a_file_store_root_replaced_by_a_file_is_unavailable(tmp_path):
    # Read-only, the honest way as root (chmod does not stop root): the root is a file now.
    root = tmp_path / "ro"
    store = open_backend(f"file://{root}")
    shutil.rmtree(root)
    root.write_bytes(b"not a directory")
    assert _every_call_is_unavailable(store, "is gone or is not a directory") == 6


def test_a_write_tensorstore_refuses_is_unavailable_not_a_crash(tmp_path):
    # A path the engine cannot write under (a file where the key's directory goes): tensorstore's
    # own FAILED_PRECONDITION surfaces as StoreUnavailableError naming the cause.
    store = open_backend(f"file://{tmp_path}/s")
    (tmp_path / "s" / "blocked").write_bytes(b"a file")
    with pytest.raises(StoreUnavailableError, match="put failed: .*Not a directory"):
        store.put_if_absent([("blocked/key", b"v")])
    assert store.put_if_absent([("free/key", b"v")]) == [True]


def test_opening_a_file_store_under_a_file_is_unavailable(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(StoreUnavailableError, match="cannot create its directory"):
        open_backend(f"file://{tmp_path}/f/store")


def test_a_closed_backend_says_so(tmp_path):
    store = open_backend(f"file://{tmp_path}/c")
    store.close()
    with pytest.raises(RuntimeError, match="was closed; open it again"):
        store.get_many(["a"])


# ---- Redis -------------------------------------------------------------------------------------
def _command_calls(client, command):
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_redis_batches_are_one_round_trip(shared_redis):
    store, probe = open_backend(shared_redis.url), redis.Redis.from_url(shared_redis.url)
    probe.flushdb()
    keys = [_key(i) for i in range(64)]
    store.put_if_absent([(k, b"v") for k in keys[:32]])

    def reads_for(call):  # the server's socket read events while `call` runs (INFO's own included)
        before = int(probe.info("stats")["total_reads_processed"])
        call()
        return int(probe.info("stats")["total_reads_processed"]) - before - 1

    mgets = _command_calls(probe, "mget")
    assert reads_for(lambda: store.get_many(keys)) <= 2
    assert _command_calls(probe, "mget") == mgets + 1
    assert reads_for(lambda: store.exists_many(keys)) <= 2  # 64 EXISTS in one pipeline, not 64 trips
    assert reads_for(lambda: store.put_if_absent([(k, b"w") for k in keys])) <= 2
    assert reads_for(lambda: store.delete_many(keys)) <= 2


def test_a_killed_redis_is_unavailable_quickly_then_used_again_after_restart():
    with redis_server() as server:
        store = open_backend(server.url, timeout_s=1.0)
        store.put_if_absent([("a/k", b"v")])
        server.kill()
        start = time.monotonic()
        assert _every_call_is_unavailable(store, f"store {server.url} did not answer: ConnectionError") == 6
        assert time.monotonic() - start < 6 * (1.0 + 1.0)  # six calls, each under timeout + 1 s
        server.restart()  # empty: the server persists nothing
        assert store.get_many(["a/k"]) == [None]
        assert store.put_if_absent([("a/k", b"w")]) == [True] and store.get_many(["a/k"]) == [b"w"]


def test_a_restarted_redis_serves_the_first_call_on_a_stale_pooled_connection():
    with redis_server() as server:
        store = open_backend(server.url, timeout_s=1.0)
        assert store.put_if_absent([("a/k", b"v")]) == [True]  # a pooled connection now
        server.kill()
        server.restart()
        assert store.exists_many(["a/k"]) == [False]  # no call failed in between


def test_a_hung_redis_times_out_within_the_timeout():
    with redis_server() as server:
        store = open_backend(server.url, timeout_s=1.0)
        store.put_if_absent([("a/k", b"v")])
        server.pause()
        try:
            start = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="TimeoutError"):
                store.get_many(["a/k"])
            assert time.monotonic() - start < 1.0 + 0.9  # one timeout: no retry doubles it
        finally:
            server.resume()
        assert store.get_many(["a/k"]) == [b"v"]


def test_a_redis_out_of_memory_refusal_is_unavailable():
    with redis_server("--maxmemory", "3mb", "--maxmemory-policy", "noeviction") as server:
        store = open_backend(server.url)
        value = b"x" * (512 << 10)
        with pytest.raises(StoreUnavailableError, match="OutOfMemoryError: .*command not allowed when used memory"):
            store.put_if_absent([(f"big/{i}", value) for i in range(16)])
        read = store.get_many([f"big/{i}" for i in range(16)])  # reads still answer
        assert all(v in (None, value) for v in read) and None in read
