"""Faults under the shared prefix store: a Redis server SIGKILLed mid-run and restarted, a file store's
directory removed or replaced by a file, damaged values, two writers of one key at once, a full write queue.
Every step runs, lookups become misses, failures are counted and logged once, no damaged value reaches a
page, and the store is used again when it returns."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid

import pytest

from easykv.tiers.store import PrefixStore, open_backend
from tests.support.redis_server import redis_server
from tests.tiers.store.harness import GatedBackend, Replica

PROMPT = list(range(1, 18))  # 4 full pages looked up


def prompt(i, n=17):
    return [100 * i + j for j in range(n)]


def store_of(backend, **kw):
    kw.setdefault("model_id", "test/model")
    return PrefixStore(backend, **kw)


def outage_warnings(caplog):
    return [r for r in caplog.records if r.name == "easykv.store" and "did not answer" in r.getMessage()]


def wait_until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_redis_killed_mid_run_then_restarted(caplog):
    caplog.set_level(logging.WARNING, logger="easykv.store")
    with redis_server() as server:
        writer = Replica("tp8", store_of(open_backend(server.url, timeout_s=1.0), retry_s=0.3))
        reader = Replica("dp2tp4", store_of(open_backend(server.url, timeout_s=1.0), read="wait", retry_s=0.3))
        writer.prefill(prompt(1))
        assert writer.store.flush(10)
        server.kill()
        for i in (2, 3, 4):  # every step runs; writes dropped and counted
            seq, found = writer.prefill(prompt(i))
            writer.check_own_tokens(seq)
            writer.release(seq)
            assert writer.store.flush(10)
        w = writer.store.metrics()
        assert w.dropped >= 4 and w.failures >= 1 and not w.available and w.values_written == 32
        seq, found = reader.prefill(prompt(1))  # a miss, not an error
        assert found == 0
        reader.check_own_tokens(seq)
        r = reader.store.metrics()
        assert r.failures == 1 and not r.available and r.pages_read == 0
        reader.prefill(prompt(5))  # skipped (within retry_s): no second failure, no second warning
        assert reader.store.metrics().failures == 1
        assert len(outage_warnings(caplog)) == 2  # once per store that saw the outage
        server.restart()
        time.sleep(0.35)
        # used again: the pages dropped while it was down are written when filled again
        writer.manager.reset_prefix_cache()
        seq, found = writer.prefill(prompt(2))
        assert found == 0 and writer.store.flush(10)
        assert writer.store.metrics().available and writer.store.metrics().values_written == 64
        fresh = Replica("one", store_of(open_backend(server.url), read="wait"))
        seq, found = fresh.prefill(prompt(2))
        assert found == 16
        fresh.check_own_tokens(seq)
        assert len(outage_warnings(caplog)) == 2
        assert any("answers again" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("fault", ["removed", "replaced_by_a_file"])
def test_file_store_directory_gone_mid_run(tmp_path, caplog, fault):
    caplog.set_level(logging.WARNING, logger="easykv.store")
    root = tmp_path / "store"
    url = f"file://{root}"
    writer = Replica("tp8", store_of(open_backend(url), retry_s=0.2))
    reader = Replica("dp2tp4", store_of(open_backend(url), read="wait", write="write_back", retry_s=0.2))
    writer.prefill(prompt(1))
    assert writer.store.flush(10)
    shutil.rmtree(root)
    if fault == "replaced_by_a_file":
        root.write_bytes(b"not a store")
    seq, _ = writer.prefill(prompt(2))
    writer.check_own_tokens(seq)
    assert writer.store.flush(10)
    assert writer.store.metrics().dropped == 4 and writer.store.metrics().failures == 1
    seq, found = reader.prefill(prompt(1))
    assert found == 0
    reader.check_own_tokens(seq)
    assert reader.store.metrics().failures == 1
    assert len(outage_warnings(caplog)) == 2
    if root.is_file():
        os.remove(root)
    root.mkdir()  # the store returns (empty)
    time.sleep(0.25)
    writer.manager.reset_prefix_cache()
    writer.prefill(prompt(2))
    assert writer.store.flush(10) and writer.store.metrics().values_written == 64
    seq, found = Replica("one", store_of(open_backend(url), read="wait")).prefill(prompt(2))
    assert found == 16


def damage(kind, backend, key, other_key, foreign):
    value = backend.get_many([key])[0]
    if kind == "flipped_byte":
        value = value[:-9] + bytes([value[-9] ^ 0x10]) + value[-8:]
    elif kind == "truncated":
        value = value[: len(value) // 2]
    elif kind == "other_key":
        value = backend.get_many([other_key])[0]
    else:
        value = foreign
    backend.delete_many([key])
    assert backend.put_if_absent([(key, value)]) == [True]


@pytest.mark.parametrize("kind", ["flipped_byte", "truncated", "other_key", "other_model", "other_format"])
def test_damaged_values_are_refused(kind, caplog):
    caplog.set_level(logging.WARNING, logger="easykv.store")
    backend = open_backend(f"memory://{uuid.uuid4().hex}")
    writer = Replica("tp8", store_of(backend))
    writer.prefill(PROMPT)
    assert writer.store.flush(10)
    digests = writer.manager.prompt_digests(PROMPT)
    ns = writer.store.namespace
    key, other_key = ns.key(0, digests[1], 3), ns.key(0, digests[2], 3)
    foreign = None
    if kind in ("other_model", "other_format"):
        scratch = open_backend(f"memory://{uuid.uuid4().hex}")
        other = Replica("tp8", store_of(scratch, model_id="test/other") if kind == "other_model"
                        else store_of(scratch), dtype="bfloat16" if kind == "other_format" else "float32")
        other.prefill(PROMPT)
        assert other.store.flush(10)
        foreign = scratch.get_many([other.store.namespace.key(0, digests[1], 3)])[0]
        assert foreign is not None
    damage(kind, backend, key, other_key, foreign)
    reader = Replica("dp2tp4", store_of(backend, read="wait", write="write_back"))
    seq, found = reader.prefill(PROMPT)
    assert found == 4  # the first page; the damaged second ends the chain there
    reader.check_own_tokens(seq)
    m = reader.store.metrics()
    assert (m.refused, m.pages_read, m.tokens_served) == (1, 1, 4)
    assert any("refused" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("engine", ["file", "redis"])
def test_two_writers_of_one_key_leave_one_whole_value(engine, tmp_path):
    def run(url):
        writers = [open_backend(url), open_backend(url)]
        reader = open_backend(url)
        keys = [f"easykv-v1/race/{i:04d}" for i in range(40)]
        values = [[bytes([w]) * 20000 + key.encode() for key in keys] for w in range(2)]
        barrier = threading.Barrier(3)
        results: list = [None, None]
        seen: list = []

        def write(w):
            barrier.wait()
            results[w] = writers[w].put_if_absent(list(zip(keys, values[w])))

        def read():
            barrier.wait()
            for _ in range(20):
                seen.extend(zip(keys, reader.get_many(keys)))

        threads = [threading.Thread(target=write, args=(0,)), threading.Thread(target=write, args=(1,)),
                   threading.Thread(target=read)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        final = reader.get_many(keys)
        for i, key in enumerate(keys):
            assert results[0][i] != results[1][i], key  # exactly one writer wrote it
            winner = 0 if results[0][i] else 1
            assert final[i] == values[winner][i]
        for key, value in seen:  # never a torn value: none, or one writer's whole value
            i = keys.index(key)
            assert value is None or value in (values[0][i], values[1][i])
        for b in (*writers, reader):
            b.close()

    if engine == "file":
        run(f"file://{tmp_path}")
    else:
        with redis_server() as server:
            run(server.url)


class BlockedPuts(GatedBackend):
    """Writes wait on ``puts`` (a store that stalls on writes)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate.set()
        self.puts = threading.Event()

    def put_if_absent(self, items):
        self.puts.wait()
        return super().put_if_absent(items)


def test_full_write_queue_drops_pages_not_the_step():
    backend = BlockedPuts(open_backend(f"memory://{uuid.uuid4().hex}"))
    writer = Replica("tp8", store_of(backend, queue_pages=4))
    writer.prefill(prompt(9, 5))  # compiled; 1 page queued, blocked
    started = time.monotonic()
    writer.prefill(prompt(1))  # 4 pages: do not fit next to the blocked one
    writer.prefill(prompt(2, 13))  # 3 pages: fit
    assert time.monotonic() - started < 5
    m = writer.store.metrics()
    assert (m.dropped, m.queued, m.values_written) == (4, 4, 0)
    backend.puts.set()
    assert writer.store.flush(10)
    assert writer.store.metrics().values_written == 32
    # the dropped pages are written when a sequence fills them again
    writer.manager.reset_prefix_cache()
    writer.prefill(prompt(1))
    assert writer.store.flush(10)
    assert writer.store.metrics().values_written == 64
    seq, found = Replica("dp2tp4", store_of(backend, read="wait")).prefill(prompt(1))
    assert found == 16


def test_a_backend_error_neither_kills_the_workers_nor_hangs(caplog):
    class Broken(GatedBackend):
        def exists_many(self, keys):
            raise RuntimeError("engine bug")

        def get_many(self, keys):  # a fetch's one lookup is its batched reads
            raise RuntimeError("engine bug")

        def put_if_absent(self, items):
            raise RuntimeError("engine bug")

    caplog.set_level(logging.WARNING, logger="easykv.store")
    inner = open_backend(f"memory://{uuid.uuid4().hex}")
    store = store_of(Broken(inner), read="wait", retry_s=0.0)
    replica = Replica("one", store)
    for _ in range(2):
        started = time.monotonic()
        seq, found = replica.prefill(PROMPT)
        assert found == 0 and time.monotonic() - started < 5
        assert store.flush(5)
        replica.release(seq)
        replica.manager.reset_prefix_cache()
    m = store.metrics()
    assert m.dropped == 8 and m.failures == 4
    assert any("engine bug" in (r.exc_text or "") or r.exc_info for r in caplog.records)
