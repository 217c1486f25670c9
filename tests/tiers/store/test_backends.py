"""Every `StoreBackend` method on a ``file://`` store, a ``memory://`` store and a real
``redis-server`` (tests/support/redis_server.py): batched answers in order, misses as None, one
atomic put-if-absent under racing threads (no torn value), gc oldest first, stats, and the faults:
a file store's directory removed or replaced, a path it cannot write, a Redis server killed,
paused or out of memory -> StoreUnavailableError quickly, then recovery."""

import itertools
import os
import random
import shutil
import threading
import time

import pytest
import redis
import tensorstore as ts

from easykv.errors import StoreUnavailableError
from easykv.tiers.store.backend import GcResult, StoreStats
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
    backend.put_if_absent([("p/a", b"1" * 10), ("p/b", b"2" * 30), ("q/c", b"3" * 5)])
    stats = backend.stats("p/")
    assert (stats.entries, stats.bytes) == (2, 40)
    total = backend.stats()
    assert (total.entries, total.bytes) == (3, 45)
    if "file" in request.node.callspec.id:
        assert stats.oldest is not None and stats.oldest <= stats.newest <= time.time() + 1
    else:  # memory and Redis keep no times
        assert stats.oldest is None and stats.newest is None
    assert backend.stats("none/") == StoreStats(entries=0, bytes=0)


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
    assert again.stats() == StoreStats(entries=2, bytes=2)
    with pytest.raises(ValueError, match="only a file:// store"):
        again.gc(0)


def _aged_file_store(tmp_path):
    """A file store of 5 values of 100 bytes, k0 the newest ... k4 the oldest (mtimes set)."""
    store = open_backend(f"file://{tmp_path}/aged")
    store.put_if_absent([(f"g/k{i}", bytes([i]) * 100) for i in range(5)])
    for i in range(5):
        os.utime(tmp_path / "aged" / "g" / f"k{i}", (1_000_000 - i * 1000,) * 2)
    return store


def test_gc_deletes_the_oldest_first_until_at_most_max_bytes_are_left(tmp_path):
    store = _aged_file_store(tmp_path)
    assert store.stats() == StoreStats(entries=5, bytes=500, oldest=996_000.0, newest=1_000_000.0)
    assert store.gc(250) == GcResult(removed_entries=3, removed_bytes=300, kept_entries=2, kept_bytes=200)
    assert store.list_keys() == ["g/k0", "g/k1"]
    assert store.gc(200) == GcResult(0, 0, 2, 200)  # already small enough: nothing removed
    assert store.gc(0, prefix="g/k1") == GcResult(1, 100, 0, 0)
    assert store.list_keys() == ["g/k0"]


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


def test_a_removed_file_store_directory_is_unavailable_until_it_returns(tmp_path):
    # tensorstore alone would read a removed directory as empty and recreate it on the next write;
    # the backend reports it instead (a shared file system that went away is not an empty store).
    root = tmp_path / "gone"
    store = open_backend(f"file://{root}")
    store.put_if_absent([("a/k", b"v")])
    shutil.rmtree(root)
    _every_call_is_unavailable(store, "is gone or is not a directory")
    assert not root.exists()  # nothing recreated it
    root.mkdir()
    assert store.get_many(["a/k"]) == [None] and store.put_if_absent([("a/k", b"w")]) == [True]


def test_a_file_store_root_replaced_by_a_file_is_unavailable(tmp_path):
    # Read-only, the honest way as root (chmod does not stop root): the root is a file now.
    root = tmp_path / "ro"
    store = open_backend(f"file://{root}")
    shutil.rmtree(root)
    root.write_bytes(b"not a directory")
    _every_call_is_unavailable(store, "is gone or is not a directory")


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
        _every_call_is_unavailable(store, f"store {server.url} did not answer: ConnectionError")
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
