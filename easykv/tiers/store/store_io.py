"""The shared store's two background workers: the writer (`StoreWriter`: a bounded queue of pages
to write, one thread, so a step never waits on a write; what does not fit is dropped and counted)
and the fetcher (`StoreFetcher`: batched reads of a prompt's chain -- its one lookup, no existence query
before them -- the next batch read while one is checked, values decoded as views as they arrive).
Both share one `StoreHealth`: a store that did not answer is skipped (misses, writes dropped and
counted) until ``retry_s`` passed, logged once per outage.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from easykv.errors import StoreUnavailableError
from easykv.tiers.store import codec
from easykv.tiers.store.backend import StoreBackend

log = logging.getLogger("easykv.store")

READ_BATCH_PAGES = 32  # pages read per batched call: a long chain arrives in parts a best-effort step can use
MAX_FETCHES = 256  # fetches kept waiting for their match; the oldest is forgotten beyond


class StoreHealth:
    """Whether the store answers: after a failure it is skipped for ``retry_s`` seconds, then tried again."""

    def __init__(self, url: str, retry_s: float):
        self.url = url
        self.retry_s = retry_s
        self.failures = 0  # calls that failed
        self._down_until = 0.0
        self._down = False
        self._lock = threading.Lock()

    def usable(self) -> bool:
        """Whether a call may be tried now."""
        return not self._down or time.monotonic() >= self._down_until

    @property
    def down(self) -> bool:
        """The last call failed (and none succeeded since)."""
        return self._down

    def failed(self, err: BaseException) -> None:
        with self._lock:
            self.failures += 1
            if not self._down:
                log.warning("easykv store %s did not answer (%s); lookups are misses and writes are dropped until it "
                            "answers again (retried every %.1f s)", self.url, err, self.retry_s)
            self._down = True
            self._down_until = time.monotonic() + self.retry_s

    def answered(self) -> None:
        with self._lock:
            if self._down:
                log.warning("easykv store %s answers again", self.url)
            self._down = False


@dataclasses.dataclass
class WriteJob:
    """Pages to write: ``items()`` (run on the writer thread) gives their ``(key, value)`` pairs; ``keys``
    names the pages, ``(layer group, digest)``, handed back by `StoreWriter.take_lost` when they are dropped."""

    pages: int
    items: Callable[[], list[tuple[str, bytes]]]
    keys: list[tuple[int, bytes]] = dataclasses.field(default_factory=list)
    ready: list[tuple[str, bytes]] | None = None  # `items()`, once the stager made them


class StoreWriter:
    """Two threads: a stager that turns each `WriteJob` into its values as soon as it is queued (a job of pages
    gathered on the device waits for their copy to host memory, then encodes: the device buffers are let go at the
    pace of that copy, never of the store), and a writer writing them in order (`StoreBackend.put_if_absent`); at
    most ``max_pages`` pages wait in all, so a slow store holds at most that many encoded pages of host memory."""

    def __init__(self, backend: StoreBackend, health: StoreHealth, max_pages: int):
        self._backend = backend
        self._health = health
        self.max_pages = max_pages
        self.waiting = 0  # pages queued or being written
        self.written = 0  # values this store wrote
        self.present = 0  # values another writer had written first
        self.dropped = 0  # pages dropped: the queue was full or the store down
        self._lost: list[tuple[int, bytes]] = []  # pages of jobs dropped on the writer thread (`take_lost`)
        self.closed = False
        self._lock = threading.Condition()
        self._staging: queue.Queue[WriteJob | None] = queue.Queue()
        self._queue: queue.Queue[WriteJob | None] = queue.Queue()
        self._stager = threading.Thread(target=self._stage_loop, name="easykv-store-stager", daemon=True)
        self._thread = threading.Thread(target=self._loop, name="easykv-store-writer", daemon=True)
        self._stager.start()
        self._thread.start()

    def room(self, pages: int) -> bool:
        """Whether ``pages`` more fit (the store answering); else they are counted as dropped."""
        with self._lock:
            if self.waiting + pages > self.max_pages or not self._health.usable():
                self.dropped += pages
                return False
            return True

    def submit(self, job: WriteJob) -> None:
        """Queue ``job`` (after `room` said yes). RuntimeError once `close` ran."""
        with self._lock:
            if self.closed:
                raise RuntimeError("this store's writer was closed; open a new PrefixStore")
            self.waiting += job.pages
        self._staging.put(job)

    def take_lost(self) -> list[tuple[int, bytes]]:
        """The ``keys`` of the jobs dropped since the last call (the store did not answer): not in the store."""
        with self._lock:
            out, self._lost = self._lost, []
        return out

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued page is written or dropped; returns False when ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self.waiting:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def close(self) -> None:
        """Stop both threads once what is queued was written or dropped; `submit` refuses from now on."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self._staging.put(None)
        self._stager.join()
        self._thread.join()

    def _stage_loop(self) -> None:
        while (job := self._staging.get()) is not None:
            try:
                job.ready = job.items()
            except Exception as err:  # the gathered pages could not be read: dropped, counted, written again later
                log.error("easykv store %s: staging %d pages failed", self._health.url, job.pages, exc_info=True)
                self._health.failed(err)
                self._drop(job)
                with self._lock:
                    self.waiting -= job.pages
                    self._lock.notify_all()
                continue
            job.items = _staged  # the device arrays the closure held are let go now
            self._queue.put(job)
        self._queue.put(None)

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._write(job)
            except Exception as err:  # a backend's unexpected error: the thread lives on (else `flush` would hang)
                log.error("easykv store %s: writing %d pages failed", self._health.url, job.pages, exc_info=True)
                self._health.failed(err)
                self._drop(job)
            finally:
                with self._lock:
                    self.waiting -= job.pages
                    self._lock.notify_all()

    def _write(self, job: WriteJob) -> None:
        if not self._health.usable():
            self._drop(job)
            return
        items = job.ready if job.ready is not None else job.items()
        job.ready = None
        try:
            done = self._backend.put_if_absent(items) if items else []
        except StoreUnavailableError as err:
            self._health.failed(err)
            self._drop(job)
            return
        self._health.answered()
        with self._lock:
            self.written += sum(done)
            self.present += len(done) - sum(done)

    def _drop(self, job: WriteJob) -> None:
        with self._lock:
            self.dropped += job.pages
            self._lost.extend(job.keys)


def _staged() -> list[tuple[str, bytes]]:
    """A staged job's ``items`` (its values are in ``ready``)."""
    return []


class Fetch:
    """One prompt's pages being read from the store for data-parallel ``replica`` (decided when it began, as
    `PageManager.adopt_host_prefixes` will place them): ``values[i]`` of the chain ``digests`` (from ``start``, the
    pages the cache held when it began) holds, once arrived, per slot of ``slots`` (``(layer group, kv head)``:
    the heads of ``replica`` this process holds) the decoded leaves. A process holding none of the replica's heads
    reads nothing: every page counts as arrived at once, so it never holds the others back (`_agree`)."""

    def __init__(self, digests: tuple[bytes, ...], start: int, replica: int, slots: list[tuple[int, int]],
                 keys: Callable[[bytes], list[str]], layouts: list[codec.ValueLayout]):
        self.digests = digests
        self.start = start
        self.replica = replica
        self.slots = slots
        self.keys = keys  # a page digest's value keys, slot by slot (built on the fetcher's thread)
        self.layouts = layouts  # per slot, the leaves its value holds
        self.values: list[list[list[np.ndarray]]] = []
        self.refused = 0
        self.done = threading.Event()
        self._lock = threading.Lock()
        if not slots:  # nothing of this replica here: the whole chain is "arrived"
            self.values = [[] for _ in digests[start:]]
            self.done.set()

    @property
    def arrived(self) -> int:
        """Pages of the chain (from ``start``) whose every value arrived, in order."""
        with self._lock:
            return len(self.values)

    def take(self, n: int) -> list[list[list[np.ndarray]]]:
        with self._lock:
            return self.values[:n]

    def add(self, pages: list[list[list[np.ndarray]]]) -> None:
        with self._lock:
            self.values.extend(pages)


class StoreFetcher:
    """One thread answering `Fetch`es in order: batched reads of the chain (`READ_BATCH_PAGES` pages a call; the
    reads of a whole chain are its one lookup, no separate existence query), the next batch read on a second
    thread while this one is checked and decoded (`codec.ValueLayout`: views, no copy); a missing, damaged or
    refused value ends the chain there. A refused value is deleted from the store (`StoreBackend.delete_many`,
    counted in ``deleted``) so that a writer can put a good one under its key again: a value another writer
    put between the read and the delete is deleted too, and written again by the next cache that fills it."""

    def __init__(self, backend: StoreBackend, health: StoreHealth):
        self._backend = backend
        self._health = health
        self.refused = 0  # values refused by their header or checksum
        self.deleted = 0  # refused values deleted from the store
        self.read = 0  # values read and accepted
        self._fetches: OrderedDict[tuple[bytes, ...], Fetch] = OrderedDict()
        self._lock = threading.Lock()
        self._queue: queue.Queue[Fetch | None] = queue.Queue()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="easykv-store-reader")  # the batch read ahead
        self._current: tuple[Fetch, float] | None = None  # the fetch being answered, since when
        self._thread = threading.Thread(target=self._loop, name="easykv-store-fetcher", daemon=True)
        self._thread.start()

    def start(self, fetch: Fetch) -> Fetch:
        """Begin ``fetch`` (or return the one begun for the same chain)."""
        with self._lock:
            known = self._fetches.get(fetch.digests)
            if known is not None:
                return known
            self._fetches[fetch.digests] = fetch
            if len(self._fetches) > MAX_FETCHES:
                self._fetches.popitem(last=False)
        if not fetch.done.is_set():
            self._queue.put(fetch)
        return fetch

    def pop(self, digests: tuple[bytes, ...]) -> Fetch | None:
        """The fetch begun for ``digests``, forgotten here."""
        with self._lock:
            return self._fetches.pop(digests, None)

    def forget(self) -> None:
        """Forget every fetch begun (their pages are not asked for again; one in flight still ends)."""
        with self._lock:
            self._fetches.clear()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._reader.shutdown()

    def queued_behind_stall(self, fetch: Fetch, limit_s: float) -> bool:
        """Whether ``fetch`` waits behind another fetch whose answer has taken longer than ``limit_s`` (a store that
        stopped answering: the wait would end at the backend's own timeout, so waiting ``limit_s`` for ``fetch`` is
        wasted)."""
        current = self._current
        return current is not None and current[0] is not fetch and time.monotonic() - current[1] > limit_s

    def _loop(self) -> None:
        while (fetch := self._queue.get()) is not None:
            self._current = (fetch, time.monotonic())
            try:
                self._answer(fetch)
            except Exception as err:  # a backend's unexpected error: a miss, and the thread lives on (no reader hangs)
                log.error("easykv store %s: a lookup failed", self._health.url, exc_info=True)
                self._health.failed(err)
            finally:
                self._current = None
                fetch.done.set()

    def _answer(self, fetch: Fetch) -> None:
        if not self._health.usable():
            return
        chain = fetch.digests[fetch.start:]
        batches = [[fetch.keys(d) for d in chain[i: i + READ_BATCH_PAGES]]
                   for i in range(0, len(chain), READ_BATCH_PAGES)]
        if not batches:
            return
        try:
            ahead: Future[list[bytes | None]] | None = self._read(batches[0])
            for i, pages in enumerate(batches):
                assert ahead is not None
                values = ahead.result()
                ahead = self._read(batches[i + 1]) if i + 1 < len(batches) else None
                if not self._decode(fetch, pages, values):
                    break
            if ahead is not None and not ahead.cancel():  # a read begun for nothing: its failure still counts
                ahead.result()
        except StoreUnavailableError as err:
            self._health.failed(err)
            return
        self._health.answered()

    def _read(self, pages: list[list[str]]) -> Future[list[bytes | None]]:
        return self._reader.submit(self._backend.get_many, [key for page in pages for key in page])

    def _decode(self, fetch: Fetch, pages: list[list[str]], values: list[bytes | None]) -> bool:
        """Add each page whose values all check out, in order; False at the first that does not."""
        it = iter(values)
        layouts = fetch.layouts
        done: list[list[list[np.ndarray]]] = []
        whole = True
        for page in pages:
            decoded = []
            try:
                for key, layout in zip(page, layouts):
                    value = next(it)
                    if value is None:  # never written, or evicted by the engine: a miss
                        whole = False
                        break
                    decoded.append(layout.decode(key, value))
            except codec.StoreValueError as err:
                self._refuse(fetch, key, err)
                whole = False
            if not whole:
                break
            done.append(decoded)
        fetch.add(done)  # before it is counted: a count seen means the page is there
        self.read += sum(len(page) for page in done)
        return whole

    def _refuse(self, fetch: Fetch, key: str, err: codec.StoreValueError) -> None:
        """Count a damaged value and delete it, so that a writer can put a good one (a delete that fails
        raises StoreUnavailableError: the store is counted as down, as for a read)."""
        self.refused += 1
        fetch.refused += 1
        log.warning("easykv store %s: refused the value of %s (%s); treated as a miss and deleted",
                    self._health.url, key, err)
        self.deleted += self._backend.delete_many([key])


__all__ = ["MAX_FETCHES", "READ_BATCH_PAGES", "Fetch", "StoreFetcher", "StoreHealth", "StoreWriter", "WriteJob"]
