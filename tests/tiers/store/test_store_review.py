"""What an outside review of the shared prefix store found, each fixed at its cause: a manager the store cannot
serve is refused; a closed store refuses every call precisely (no hang, no write piling up); flush's argument is
checked; a slow store holds no device memory (gathered pages are staged to host memory at the pace of their copy,
not of the store); an admission queued behind a stalled lookup does not wait for it."""

from __future__ import annotations

import math
import time
import uuid

import jax
import pytest

from easykv import PageManager
from easykv.tiers.store import PrefixStore, open_backend
from tests.tiers.store.harness import GatedBackend, Replica

PROMPT = list(range(1, 18))  # 17 tokens: 4 full pages looked up


def memory_backend():
    return open_backend(f"memory://{uuid.uuid4().hex}")


def store_of(backend, **kw):
    kw.setdefault("model_id", "test/model")
    return PrefixStore(backend, **kw)


@pytest.mark.parametrize("flag, words", [
    ({"enable_prefix_caching": False}, "without prefix caching"),
    ({"scrub_released": True}, "no tenant's K/V outlives its sequence"),
])
def test_a_manager_the_store_cannot_serve_is_refused_with_nothing_changed(flag, words):
    base = Replica("one")
    manager = PageManager(base.manager.metadata, **flag)
    store = store_of(memory_backend())
    with pytest.raises(ValueError, match=words):
        store.attach(manager, base.host)
    assert not store.serving
    manager.watch_prefixes(written=False, host_evicted=False)  # nothing was watched: the call is a no-op
    assert manager.take_prefix_events().empty
    Replica("one", store)  # still free for a manager it can serve


def test_a_closed_store_refuses_every_call_and_closing_twice_is_nothing():
    backend = memory_backend()
    writer = Replica("one", store_of(backend, read="wait"))
    seq, _ = writer.prefill(PROMPT[:9])
    store = writer.store
    store.close()
    store.close()
    assert store.closed and not store.serving
    [fresh] = writer.manager.claim(1)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="closed"):
        writer.runner.match_prefix(fresh, PROMPT)
    assert time.monotonic() - started < 1  # refused, not a wait on a fetcher that is gone
    length = writer.manager.length(seq)
    plan = writer.manager.schedule([seq], [1])
    with pytest.raises(RuntimeError, match="PrefixStore was closed"):
        writer.runner.run(plan, lambda cache, p: (cache, None), token_ids=[[5]])
    assert plan.ended is None and writer.manager.length(seq) == length  # refused before anything ran: still open
    writer.manager.abort(plan)
    for call in (lambda: store.prefetch(writer.manager, PROMPT), lambda: store.hold(object(), store.namespace),
                 lambda: store.attach(writer.manager, writer.host)):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    assert store.metrics().queued == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1, "2", True])
def test_flush_checks_its_timeout(bad):
    store = store_of(memory_backend())
    with pytest.raises(ValueError, match="timeout_s"):
        store.flush(bad)
    assert store.flush(0) and store.flush(None)


class BlockedWrites(GatedBackend):
    """A store whose writes wait on ``gate`` (a store that stopped answering writes)."""

    def get_many(self, keys):
        return self.inner.get_many(keys)

    def put_if_absent(self, items):
        self.gate.wait()
        return self.inner.put_if_absent(items)


def test_a_slow_store_holds_no_gathered_device_pages():
    blocked = BlockedWrites(memory_backend())
    writer = Replica("tp8", store_of(blocked))
    try:
        writer.prefill(PROMPT)  # 4 pages filled, gathered, queued
        before = time.monotonic()
        while writer.store.metrics().queued and time.monotonic() - before < 10:
            stager = writer.store._writer._staging
            if stager.empty():
                break
            time.sleep(0.01)
        time.sleep(0.2)  # the stager has taken the job: its device arrays are let go once staged
        live = {id(a) for a in jax.live_arrays()}
        writer.prefill([p + 100 for p in PROMPT])  # 4 more pages, while the store still blocks
        time.sleep(0.5)
        grown = [a for a in jax.live_arrays() if id(a) not in live and a.ndim == 5 and a.shape[0] in (4, 8)]
        assert not grown, [a.shape for a in grown]  # no gathered (pages, layers, heads, ...) arrays kept alive
        assert writer.store.metrics().queued == 8
    finally:
        blocked.gate.set()
    assert writer.store.flush(10) and writer.store.metrics().values_written == 8 * 8


def test_an_admission_queued_behind_a_stalled_lookup_does_not_wait_for_it():
    inner = memory_backend()
    writer = Replica("tp8", store_of(inner))
    writer.prefill(PROMPT)
    writer.prefill([p + 100 for p in PROMPT])
    assert writer.store.flush(10)
    gated = GatedBackend(inner)  # reads hang (a paused server) until the gate opens
    reader = Replica("tp8", store_of(gated, read="timeout", timeout_s=0.3))
    try:
        reader.runner.prefetch(PROMPT)  # the fetcher is stuck in this one's read
        time.sleep(0.5)  # longer than timeout_s: a stall
        started = time.monotonic()
        _, found = reader.prefill([p + 100 for p in PROMPT])  # queued behind it: no wait
        took = time.monotonic() - started
    finally:
        gated.gate.set()
    assert found == 0 and took < 0.25


FULL_DISK = r'''
import resource, signal, sys, tempfile, time
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
import jax
jax.config.update("jax_num_cpu_devices", 8)
from easykv.tiers.store import PrefixStore
from tests.tiers.store.harness import Replica
root = tempfile.mkdtemp()
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
store = PrefixStore("file://" + root, model_id="test/model", retry_s=0)
writer = Replica("one", store)
resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))  # no value fits: the disk is full
seq, _ = writer.prefill(list(range(1, 18)))  # the step runs
writer.check_own_tokens(seq)
assert store.flush(10)
m = store.metrics()
assert m.values_written == 0 and m.dropped == 4 and m.failures >= 1 and not m.available, m
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again: the same pages are written when filled again
seq2, found = writer.prefill(list(range(101, 118)))
assert store.flush(10) and store.metrics().values_written == 4 * 8 and store.metrics().available, store.metrics()
print("ok")
'''


def test_a_full_disk_drops_writes_counted_and_the_store_is_used_again_when_there_is_room(tmp_path):
    """A file store on a full disk (every write fails: a file size limit makes each value's write fail with EFBIG,
    as ENOSPC would): the step runs, its pages are dropped and counted, the failure marks the store unavailable;
    once there is room, the next pages are written."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", FULL_DISK], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_a_fifo_under_a_key_is_a_miss_counted_in_the_store_metrics(tmp_path):
    import os

    root = tmp_path / "store"
    writer = Replica("one", store_of(open_backend(f"file://{root}")))
    writer.prefill(PROMPT)
    assert writer.store.flush(10)
    first_page = writer.manager.prompt_digests(PROMPT)[0].hex()
    value = next(p for p in root.rglob("*") if p.is_file() and p.parent.name == first_page)
    value.unlink()
    os.mkfifo(value)  # one head's value of the first page
    reader = Replica("one", store_of(open_backend(f"file://{root}"), read="wait"))
    started = time.monotonic()
    seq, found = reader.prefill(PROMPT)  # its write_through puts the same pages: the FIFO is not written either
    assert reader.store.flush(10)
    assert time.monotonic() - started < 5 and found == 0  # the first page's chain ends: nothing from the store
    reader.check_own_tokens(seq)
    m = reader.store.metrics()
    assert m.refused_paths >= 2 and m.failures == 0 and m.values_present == 4 * 8  # the rest were there already
    assert writer.store.metrics().refused_paths == 0
