"""The shared prefix store end to end (`easykv.tiers.store.PrefixStore` through `easykv.Runner`): a writer and
readers on other meshes share pages bit for bit and read exactly their own tokens; quantized pages and layer
groups round trip; the write and read policies; namespaces, salts and weight versions never share; the metrics
count exactly; refusals change nothing."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

from easykv.tiers.store import PrefixStore, StoreNamespace, open_backend
from tests.support.redis_server import redis_server_fixture
from tests.tiers.store.harness import PS, TWO_GROUPS, GatedBackend, Replica, same_reads

redis = redis_server_fixture(scope="module")
PROMPT = list(range(1, 18))  # 17 tokens: 4 full pages looked up


def memory_backend():
    return open_backend(f"memory://{uuid.uuid4().hex}")


@pytest.fixture(params=["memory", "redis"])
def backend(request):
    if request.param == "memory":
        b = memory_backend()
    else:
        b = open_backend(request.getfixturevalue("redis").url)
        b.delete_many(b.list_keys())
    yield b
    b.close()


def store_of(backend, **kw):
    kw.setdefault("model_id", "test/model")
    return PrefixStore(backend, **kw)


def written(replica, prompt=PROMPT, **kw):
    seq, found = replica.prefill(prompt, **kw)
    assert replica.store.flush(10)
    return seq, found


@pytest.mark.parametrize("writer_layout, reader_layout", [("tp8", "dp2tp4"), ("dp2tp4", "one"), ("one", "tp8")])
def test_readers_on_other_meshes_read_the_writers_pages(backend, writer_layout, reader_layout):
    writer = Replica(writer_layout, store_of(backend))
    w, found = written(writer)
    assert found == 0
    reader = Replica(reader_layout, store_of(backend, read="wait"))
    r, found = reader.prefill(PROMPT)
    assert found == 16
    for got, want in zip(reader.page_leaves(r), writer.page_leaves(w)):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    reference = Replica(reader_layout)
    same_reads(reader.read(r), reference.read(reference.prefill(PROMPT)[0]))
    reader.check_own_tokens(r)
    for t in (40, 41, 42, 43):  # decoding on after the store's pages
        reader.decode(r, t)
    reader.check_own_tokens(r)


@pytest.mark.parametrize("what", ["int8", "groups"])
def test_quantized_pages_and_layer_groups_round_trip(what):
    backend = memory_backend()
    kw = {"quantizer": "int8", "dtype": "bfloat16"} if what == "int8" else {"groups": TWO_GROUPS}
    writer = Replica("tp8", store_of(backend), **kw)
    w, _ = written(writer)
    reader = Replica("dp2tp4", store_of(backend, read="wait"), **kw)
    r, found = reader.prefill(PROMPT)
    assert found == 16
    for g in range(len(writer.cache.metadata.groups)):
        leaves = writer.page_leaves(w, g)
        assert len(leaves[0]) == (4 if what == "int8" else 2)  # K, V (and their scales)
        for got, want in zip(reader.page_leaves(r, g), leaves):
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)
    reference = Replica("dp2tp4", **kw)
    same_reads(reader.read(r), reference.read(reference.prefill(PROMPT)[0]))
    if what == "groups":
        reader.check_own_tokens(r)


def keys_of(store, replica, digests):
    ns = store.namespace
    return sorted(ns.key(g, d, h) for g, group in enumerate(replica.cache.metadata.groups) for d in digests
                  for h in range(group.num_kv_heads))


def test_write_through_writes_each_page_at_its_commit():
    backend = memory_backend()
    writer = Replica("tp8", store_of(backend))
    seq, _ = written(writer, PROMPT[:10])  # 2 full pages
    digests = writer.manager.prompt_digests(PROMPT)
    assert backend.list_keys() == keys_of(writer.store, writer, digests[:2])
    writer.decode(seq, PROMPT[10])
    assert writer.store.flush(10) and backend.list_keys() == keys_of(writer.store, writer, digests[:2])
    writer.decode(seq, PROMPT[11])  # the third page is full now
    assert writer.store.flush(10) and backend.list_keys() == keys_of(writer.store, writer, digests[:3])
    assert writer.store.metrics().values_written == 3 * 8


def test_write_back_writes_only_what_the_host_tier_evicts():
    backend = memory_backend()
    writer = Replica("tp8", store_of(backend, write="write_back"), pages=8, host_pages=2)
    prompts = [[100 * i + j for j in range(9)] for i in range(1, 7)]
    evicted = []
    for p in prompts:
        seq, _ = writer.prefill(p)
        writer.release(seq)
        assert writer.store.flush(10)
    stored = backend.list_keys()
    assert len(stored) == writer.store.metrics().values_written
    # what is in the store are exactly the pages the host tier let go: each checked against its tokens
    for p in prompts:
        reader = Replica("one", store_of(backend, read="wait", write="write_back"), pages=8, host_pages=4)
        seq, found = reader.prefill(p)
        reader.check_own_tokens(seq)
        evicted.append(reader.manager.prompt_digests(p)[: found // PS])
    assert evicted[0] and not evicted[-1]  # the oldest went to the store, the newest is still cached
    every_page = keys_of(writer.store, writer, [d for p in prompts for d in writer.manager.prompt_digests(p)])
    assert set(keys_of(writer.store, writer, [d for chain in evicted for d in chain])) <= set(stored)
    assert set(stored) < set(every_page)  # (a chain's tail may go first: its head still cached)
    first = Replica("tp8", store_of(memory_backend(), write="write_back"), pages=8, host_pages=2)
    written(first)
    assert first.store.backend.list_keys() == []  # nothing evicted, nothing written


def test_read_best_effort_takes_only_what_arrived():
    inner = memory_backend()
    written(Replica("tp8", store_of(inner)))
    gated = GatedBackend(inner)
    reader = Replica("tp8", store_of(gated, read="best_effort"))
    started = time.monotonic()
    seq, found = reader.prefill(PROMPT)
    assert found == 0 and time.monotonic() - started < 5
    reader.check_own_tokens(seq)
    assert reader.store.metrics().pages_read == 0
    gated.gate.set()
    # a prefetch that arrived is used in full
    other = Replica("tp8", store_of(gated, read="best_effort"))
    other.runner.prefetch(PROMPT)
    deadline = time.monotonic() + 10
    while other.store.metrics().values_read < 32 and time.monotonic() < deadline:
        time.sleep(0.01)
    seq, found = other.prefill(PROMPT)
    assert found == 16
    other.check_own_tokens(seq)


def test_read_wait_waits_for_every_page():
    inner = memory_backend()
    written(Replica("tp8", store_of(inner)))
    gated = GatedBackend(inner)
    reader = Replica("tp8", store_of(gated, read="wait", timeout_s=0.01))
    threading.Timer(0.5, gated.gate.set).start()
    started = time.monotonic()
    seq, found = reader.prefill(PROMPT)
    assert found == 16 and time.monotonic() - started >= 0.5
    reader.check_own_tokens(seq)


def test_read_timeout_gives_up_after_timeout_s():
    inner = memory_backend()
    written(Replica("tp8", store_of(inner)))
    gated = GatedBackend(inner)
    reader = Replica("tp8", store_of(gated, read="timeout", timeout_s=0.3))
    try:
        started = time.monotonic()
        seq, found = reader.prefill(PROMPT)
        took = time.monotonic() - started
    finally:
        gated.gate.set()
    assert found == 0 and 0.3 <= took < 3
    reader.check_own_tokens(seq)
    assert reader.store.metrics().pages_read == 0


@pytest.mark.parametrize("other", ["model_id", "page_size", "dtype"])
def test_namespaces_never_share(other):
    backend = memory_backend()
    writer = Replica("tp8", store_of(backend))
    written(writer)
    kw, store_kw = {}, {}
    if other == "model_id":
        store_kw["model_id"] = "test/model@other"
    elif other == "page_size":
        kw["page_size"] = 2
    else:
        kw["dtype"] = "bfloat16"
    reader = Replica("tp8", store_of(backend, read="wait", **store_kw), **kw)
    seq, found = reader.prefill(PROMPT)
    assert found == 0 and reader.store.metrics().values_read == 0
    assert reader.store.namespace.group_prefix(0) != writer.store.namespace.group_prefix(0)
    assert not any(key.startswith(reader.store.namespace.group_prefix(0)) for key in backend.list_keys()[:32])


def test_salts_and_weight_versions_never_share():
    backend = memory_backend()
    writer = Replica("tp8", store_of(backend))
    written(writer, salt="tenant-a")
    writer.manager.set_weight_version(7)
    written(writer, PROMPT[:9])
    for salt, version, want in [("tenant-b", None, 0), (None, None, 0), ("tenant-a", None, 16),
                                ("tenant-a", 7, 0), (None, 7, 8), (None, 8, 0)]:
        reader = Replica("dp2tp4", store_of(backend, read="wait"))
        if version is not None:
            reader.manager.set_weight_version(version)
        seq, found = reader.prefill(PROMPT, salt=salt)
        assert found == want, (salt, version)
        reader.check_own_tokens(seq)


def test_metrics_count_exactly():
    backend = memory_backend()
    writer = Replica("tp8", store_of(backend))
    written(writer)
    m = writer.store.metrics()
    assert (m.values_written, m.values_present, m.pages_read, m.refused, m.dropped, m.failures) == (32, 0, 0, 0, 0, 0)
    assert m.available and m.queued == 0
    gated = GatedBackend(backend)  # reads stall: the second writer finds nothing and writes the same pages
    second = Replica("dp2tp4", store_of(gated, read="best_effort"))
    written(second)
    gated.gate.set()
    m = second.store.metrics()
    assert (m.values_written, m.values_present, m.pages_read) == (0, 32, 0)
    reader = Replica("one", store_of(backend, read="wait"))
    reader.prefill(PROMPT)
    m = reader.store.metrics()
    assert (m.pages_read, m.tokens_served, m.values_read, m.refused) == (4, 16, 32, 0)
    reader.prefill(PROMPT)  # on the device now: nothing more read
    m = reader.store.metrics()
    assert (m.pages_read, m.tokens_served, m.values_read, m.values_written) == (4, 16, 32, 0)


def test_attach_refusals_change_nothing():
    backend = memory_backend()
    store = store_of(backend)
    hostless = Replica("one", host=False)
    with pytest.raises(ValueError, match=r"host-memory tier.*host_memory_bytes"):
        store.attach(hostless.manager, None)
    hostless.prefill(PROMPT)  # not watched: nothing kept for a store
    assert hostless.manager.take_prefix_events().empty
    first = Replica("one", store)  # the store is still free
    second = Replica("one")
    with pytest.raises(ValueError, match="one PrefixStore per cache"):
        store.attach(second.manager, second.host)
    second.prefill(PROMPT)
    assert second.manager.take_prefix_events().empty
    written(first)
    assert first.store.metrics().values_written == 32 and len(backend.list_keys()) == 32


def test_bring_in_reads_nothing_while_the_device_holds_the_pages():
    inner = memory_backend()
    written(Replica("tp8", store_of(inner)))
    gated = GatedBackend(inner)
    gated.gate.set()
    replica = Replica("tp8", store_of(gated, read="wait"))
    seq, found = replica.prefill(PROMPT)
    assert found == 16 and gated.gets == 1
    replica.release(seq)
    seq, found = replica.prefill(PROMPT)
    assert found == 16 and gated.gets == 1
    assert replica.store.metrics().values_read == 32
    replica.check_own_tokens(seq)


def test_pages_read_from_the_store_are_not_written_back():
    backend = memory_backend()
    written(Replica("tp8", store_of(backend)))
    reader = Replica("one", store_of(backend, read="wait", write="write_back"), pages=8, host_pages=4)
    seq, found = reader.prefill(PROMPT)
    assert found == 16
    reader.release(seq)
    for i in range(1, 9):  # the store's pages go down the tiers and out; other prompts' pages with them
        seq, _ = reader.prefill([100 * i + j for j in range(9)])
        reader.release(seq)
    assert reader.store.flush(10)
    m = reader.store.metrics()
    assert m.values_written > 0 and m.values_present == 0


def test_a_store_detached_and_attached_to_another_format_forgets_the_old_one():
    backend = memory_backend()
    written(Replica("tp8", store_of(backend)))
    store = store_of(backend, read="wait")
    first = Replica("one", store)
    first.runner.prefetch(PROMPT)  # read under the float32 namespace, never matched
    store.flush(10)
    deadline = time.monotonic() + 10
    while store.metrics().values_read < 32 and time.monotonic() < deadline:
        time.sleep(0.01)
    store.detach()
    second = Replica("one", store, dtype="bfloat16")  # the same digests, another namespace: nothing there
    seq, found = second.prefill(PROMPT)
    assert found == 0
    reference = Replica("one", dtype="bfloat16")
    same_reads(second.read(seq), reference.read(reference.prefill(PROMPT)[0]))


def test_an_engine_that_holds_the_store_queues_its_own_pages_and_no_runner_attaches_meanwhile():
    """`PrefixStore.hold` / `queue_device_pages` / `release`: the surface an engine with its own page bookkeeping
    (EasyDeL's eSurge) writes through. Its pages land under the namespace it holds, exactly once each; a runner is
    refused while it holds the store, and attaches after `release`."""
    backend = memory_backend()
    filler = Replica("tp8")  # computes the pages, without a store
    seq, _ = filler.prefill(PROMPT)
    store = store_of(backend)
    holder = object()
    store.hold(holder, StoreNamespace.of(filler.manager.metadata, "test/model"))
    assert store.serving
    with pytest.raises(ValueError, match="serves another engine or runner already"):
        store.hold(object(), store.namespace)
    other = Replica("one")
    with pytest.raises(ValueError, match="one PrefixStore per cache"):
        store.attach(other.manager, other.host)
    digests = filler.manager.prompt_digests(PROMPT)
    pages = list(zip(filler.manager.pages(seq)[:4], digests, strict=True))
    store.queue_device_pages(filler.cache, 0, pages)
    store.queue_device_pages(filler.cache, 0, pages)  # known now: not gathered or written again
    assert store.flush(10) and store.metrics().values_written == 4 * 8 and store.metrics().values_present == 0
    assert backend.list_keys() == sorted(store.namespace.keys(0, d, range(8))[h] for d in digests[:4] for h in range(8))
    store.release(object())  # not the holder: nothing
    assert store.serving
    store.release(holder)
    store.read = "wait"
    reader = Replica("dp2tp4", store)  # attaches now, and reads what the holder wrote
    r, found = reader.prefill(PROMPT)
    assert found == 16 and store.metrics().pages_read == 4
    for got, want in zip(reader.page_leaves(r), filler.page_leaves(seq)):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    reader.check_own_tokens(r)
