"""The shared store's read path and its exit: a chain's lookup is its batched reads (no existence query), a fetch
reads only the heads of the replica its pages will land in, a refused value is deleted so a writer can replace it,
and queued writes land at interpreter exit (bounded, logged)."""

from __future__ import annotations

import gc
import logging
import threading
import uuid
import weakref

from easykv.tiers.store import PrefixStore, open_backend
from easykv.tiers.store.prefix_store import _flush_at_exit
from tests.tiers.store.harness import GatedBackend, Replica

PROMPT = list(range(1, 18))  # 4 full pages looked up


def store_of(backend, **kw):
    kw.setdefault("model_id", "test/model")
    return PrefixStore(backend, **kw)


class CountingBackend(GatedBackend):
    """The gate open; counts the existence queries and the keys read."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate.set()
        self.exists_calls = 0
        self.keys_read: list[str] = []

    def exists_many(self, keys):
        self.exists_calls += 1
        return super().exists_many(keys)

    def get_many(self, keys):
        self.keys_read += list(keys)
        return super().get_many(keys)


class BlockedWrites(GatedBackend):
    """Writes wait on ``writes`` (a store that takes its time); reads pass."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate.set()
        self.writes = threading.Event()

    def put_if_absent(self, items):
        self.writes.wait()
        return super().put_if_absent(items)


def written_store():
    backend = open_backend(f"memory://{uuid.uuid4().hex}")
    writer = Replica("tp8", store_of(backend))
    writer.prefill(PROMPT)
    assert writer.store.flush(10)
    return backend, writer


def test_a_chain_is_looked_up_by_its_batched_reads_alone():
    backend, _ = written_store()
    counting = CountingBackend(backend)
    reader = Replica("dp2tp4", store_of(counting, read="wait"))
    seq, found = reader.prefill(PROMPT)
    assert found == 16
    reader.check_own_tokens(seq)
    assert counting.exists_calls == 0 and counting.gets == 1  # one batch for the chain: no round trip before it
    assert len(counting.keys_read) == 4 * 8  # 4 pages x 8 heads, each once: one replica's, not both


def test_a_fetch_reads_only_the_heads_of_its_replica_this_process_holds():
    backend, writer = written_store()
    counting = CountingBackend(backend)
    reader = Replica("dp2tp4", store_of(counting, read="wait"))
    store, manager = reader.store, reader.manager
    digests = manager.prompt_digests(PROMPT)
    fetch = store._fetch(manager, digests, 0)  # a fresh pool: replica 0 has the most pages (ties: the first)
    assert fetch.replica == 0 and fetch.slots == [(0, h) for h in range(8)]
    # as a process of a multi-process program holding only replica 1's pages would see its heads
    store._heads = [{1: list(range(8))}]
    fetch = store._fetcher.start(store._fetch(manager, digests, 0))
    assert fetch.slots == [] and fetch.done.is_set() and fetch.arrived == len(digests)  # never holds others back
    assert counting.gets == 0


def test_a_refused_value_is_deleted_and_written_again(caplog):
    caplog.set_level(logging.WARNING, logger="easykv.store")
    backend, writer = written_store()
    digests = writer.manager.prompt_digests(PROMPT)
    key = writer.store.namespace.key(0, digests[1], 3)
    value = backend.get_many([key])[0]
    backend.delete_many([key])
    assert backend.put_if_absent([(key, value[:-9] + bytes([value[-9] ^ 0x10]) + value[-8:])]) == [True]
    reader = Replica("dp2tp4", store_of(backend, read="wait", write="write_back"))  # writes nothing here
    seq, found = reader.prefill(PROMPT)
    assert found == 4  # the damaged second page ends the chain
    reader.check_own_tokens(seq)
    m = reader.store.metrics()
    assert (m.refused, m.deleted) == (1, 1)
    assert backend.exists_many([key]) == [False]
    assert any("refused" in r.getMessage() and "deleted" in r.getMessage() for r in caplog.records)
    again = Replica("tp8", store_of(backend))  # a cache that fills the page writes its value again
    again.prefill(PROMPT)
    assert again.store.flush(10) and again.store.metrics().values_written >= 1
    third = Replica("tp8", store_of(backend, read="wait"))
    seq, found = third.prefill(PROMPT)
    assert found == 16 and third.store.metrics().refused == 0
    third.check_own_tokens(seq)


def test_queued_writes_land_at_exit_and_the_unwritten_are_logged(caplog):
    caplog.set_level(logging.WARNING, logger="easykv.store")
    inner = open_backend(f"memory://{uuid.uuid4().hex}")
    blocked = BlockedWrites(inner)
    writer = Replica("tp8", store_of(blocked))
    writer.prefill(PROMPT)
    ref = weakref.ref(writer.store)
    assert _flush_at_exit(ref, timeout_s=0.2) == 4  # the writes wait: 4 pages not written, said so
    assert any("4 pages were not written" in r.getMessage() for r in caplog.records)
    blocked.writes.set()
    assert _flush_at_exit(ref, timeout_s=10) == 0  # exit waits until they landed
    assert len(inner.list_keys()) == 4 * 8


def test_the_exit_hook_neither_keeps_a_store_alive_nor_outlives_close():
    store = store_of(open_backend(f"memory://{uuid.uuid4().hex}"))
    hook = store._at_exit
    ref = weakref.ref(store)
    del store
    gc.collect()
    assert ref() is None and hook() == 0  # collected: the hook finds nothing to flush
