"""The shared prefix store (`PrefixStore`): a tier below the host-memory tier, shared by every cache of the
same model and format, in any process, on any mesh, across restarts.

It sits over the host tier as SGLang's hierarchical cache sits over its radix cache: it keeps no page of
the manager's. A runner with a store (``easykv.Runner(manager, cache, host=tier, store=store)``):

- **reads**: `Runner.prefetch` starts reading a prompt's pages that neither the device nor the host tier
  holds (batched reads of the chain, which are its lookup, in a background thread), for the replica the pages
  will land in (decided then, as the adoption will place them): only that replica's heads this process holds;
  `Runner.match_prefix` takes what arrived (by the read policy), writes it into fresh host pages
  (`PageManager.adopt_host_prefixes`), and the manager's own lookup finds them there and onloads them
  through the host tier's transfers.
- **writes**: ``write_through`` queues every page a sequence fills when its step is committed (gathered
  on the device, copied to host memory asynchronously, encoded and written by a background thread);
  ``write_back`` queues each page the host tier evicts. The queue holds at most ``queue_pages`` pages;
  what does not fit is dropped and counted, so a step never waits on the store. At interpreter exit queued
  writes still land (`EXIT_FLUSH_S` at most); the pages not written are logged.

A value is one layer group's page for one kv head (every layer, keys, values and scales: raw stored bits;
`codec`), under a key of the page's digest in a namespace of the model and the page format (`namespace`):
a process reads and writes only the heads its devices hold. A store that does not answer makes lookups
misses and drops writes (counted, logged once) until it answers again.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from easykv.manager.manager import PageManager
from easykv.storage.cache import PagedAttentionCache
from easykv.tiers.host import HostTier
from easykv.tiers.store import codec
from easykv.tiers.store.backend import StoreBackend
from easykv.tiers.store.device_pages import gather_pages, gathered_blocks
from easykv.tiers.store.namespace import StoreNamespace
from easykv.tiers.store.namespace import _model_id as check_model_id
from easykv.tiers.store.store_io import Fetch, StoreFetcher, StoreHealth, StoreWriter, WriteJob
from easykv.tiers.store.url import open_backend
from easykv.validation import positive_int, real

WRITE_POLICIES = ("write_through", "write_back")
READ_POLICIES = ("best_effort", "wait", "timeout")
KNOWN_LIMIT = 1 << 16  # page keys remembered as in the store (not written again)
EXIT_FLUSH_S = 30.0  # how long interpreter exit waits for queued writes

log = logging.getLogger("easykv.store")

Blocks = list[tuple[int, int, int, list[np.ndarray]]]  # (replica, first head, end head, per-leaf arrays)


@dataclasses.dataclass(frozen=True)
class StoreMetrics:
    """What a `PrefixStore` did (``easykv demo --store`` reports it).

    Attributes:
      url: the store.
      pages_read: pages brought from the store into host pages (every group and head this process holds).
      tokens_served: prompt tokens `Runner.match_prefix` found in pages read from the store.
      values_read: values read and accepted.
      values_written: values this process wrote.
      values_present: values another writer had written first (not written again).
      refused: values refused by their header or checksum (treated as misses).
      deleted: refused values deleted from the store, so that a writer can put a good value under the key again.
      refused_paths: keys of a ``file`` store whose path was no regular file (a FIFO, a directory, a link), read
        as missing without being opened (0 for other backends).
      dropped: pages not written: the queue was full or the store down.
      failures: calls to the store that failed (it did not answer).
      available: whether the store answered its last call.
      queued: pages waiting to be written now.
    """

    url: str
    pages_read: int
    tokens_served: int
    values_read: int
    values_written: int
    values_present: int
    refused: int
    dropped: int
    failures: int
    available: bool
    queued: int
    deleted: int = 0
    refused_paths: int = 0


class PrefixStore:
    """A shared prefix store at ``url`` (see the module doc); serves one `Runner` (`attach`).

    Args:
      url: where: ``file:///dir`` (one machine, or a shared file system), ``memory://name``, ``gs://bucket/dir``,
        ``s3://bucket/dir`` (tensorstore's kvstore drivers), ``redis://host:port/db`` (Redis or Valkey); or a
        `StoreBackend`.
      model_id: the name and revision of the weights (required: easykv never guesses it); caches of other models
        never share a value.
      write: ``"write_through"`` (each full page when its step is committed) or ``"write_back"`` (when the host
        tier evicts it).
      read: ``"best_effort"`` (what arrived by the step), ``"wait"`` (every page found), or ``"timeout"`` (what
        arrived within ``timeout_s``).
      timeout_s: the ``timeout`` policy's wait, seconds.
      queue_pages: pages that may wait to be written; more are dropped (counted).
      retry_s: after a failed call the store is skipped this long.
      io_timeout_s: a backend call's own time limit (opening from a URL only).
    """

    def __init__(self, url: str | StoreBackend, *, model_id: str, write: str = "write_through",
                 read: str = "timeout", timeout_s: float = 1.0, queue_pages: int = 4096, retry_s: float = 1.0,
                 io_timeout_s: float = 5.0):
        if write not in WRITE_POLICIES:
            raise ValueError(f"write={write!r} is not a write policy; use one of {WRITE_POLICIES}")
        if read not in READ_POLICIES:
            raise ValueError(f"read={read!r} is not a read policy; use one of {READ_POLICIES}")
        self.timeout_s = real("timeout_s", timeout_s, lo=0, hi=86400)
        queue_pages = positive_int("queue_pages", queue_pages)
        retry_s = real("retry_s", retry_s, lo=0, hi=86400)
        self.model_id = check_model_id(model_id)
        self.write, self.read = write, read
        self.backend = url if isinstance(url, StoreBackend) else open_backend(url, timeout_s=io_timeout_s)
        self.health = StoreHealth(self.backend.url, retry_s)
        self._writer = StoreWriter(self.backend, self.health, queue_pages)
        self._fetcher = StoreFetcher(self.backend, self.health)
        self._namespace: StoreNamespace | None = None
        self._owner: object | None = None  # the attached runner's PageManager, or an integration's engine (`hold`)
        self._layouts: list[codec.ValueLayout] = []  # per group: the leaves of its values
        self._heads: list[dict[int, list[int]]] = []  # per group, per replica: the heads this process holds
        self._known: OrderedDict[tuple[int, bytes], None] = OrderedDict()  # (group, digest) in the store
        self.pages_read = 0
        self.tokens_served = 0
        self._closed = False
        # Queued writes land at interpreter exit (bounded); a weak reference: the store may be collected before.
        self._at_exit = functools.partial(_flush_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)

    # ---- binding ------------------------------------------------------------------------------------
    def attach(self, manager: PageManager, host: HostTier | None) -> None:
        """Serve ``manager``'s cache from now on (`easykv.Runner` calls it): its namespace is computed, the manager
        keeps the pages the write policy writes. ValueError, nothing changed: no host tier (the store's pages
        land in host pages), or the store serves another manager.

        Args:
          manager: the runner's `PageManager`.
          host: its cache's `HostTier` (required)."""
        self._refuse_closed("attach")
        if self._owner is manager:
            return
        if not manager.enable_prefix_caching:
            raise ValueError("the manager runs without prefix caching (enable_prefix_caching=False): the store serves "
                             "prefix pages, and none would be found or written; make the PageManager with prefix "
                             "caching, or leave the store out")
        if manager.scrub_released:
            raise ValueError("the manager scrubs released pages (scrub_released=True: no tenant's K/V outlives its "
                             "sequence); a shared store keeps pages beyond their sequences, for any cache of the same "
                             "model: use one or the other")
        if self._owner is not None:
            raise ValueError("this PrefixStore serves another runner's manager already; open one PrefixStore per "
                             "cache (they share the store's values through its URL)")
        if host is None or not manager.has_host_tier:
            raise ValueError("a PrefixStore brings pages in through the host-memory tier; create the metadata with "
                             "one (PagedAttentionCacheMetaData.create(..., host_memory_bytes=N)) and pass "
                             "host=easykv.HostTier(cache) to the runner")
        namespace = StoreNamespace.of(manager.metadata, self.model_id)
        layouts, heads = [], []
        for g in range(len(manager.metadata.groups)):
            blocks = host.page_blocks(g)
            layouts.append(codec.ValueLayout([((a.shape[1], *a.shape[3:]), codec.raw_dtype(a.dtype))
                                              for a in blocks[0][3]]))
            per_replica: dict[int, set[int]] = {}
            for replica, start, stop, _ in blocks:
                per_replica.setdefault(replica, set()).update(range(start, stop))
            heads.append({r: sorted(h) for r, h in per_replica.items()})
        manager.watch_prefixes(written=self.write == "write_through", host_evicted=self.write == "write_back")
        self._bind_namespace(namespace)
        self._layouts, self._heads, self._owner = layouts, heads, manager

    def _bind_namespace(self, namespace: StoreNamespace) -> None:
        """Keys from now on under ``namespace``: what was known or fetched under another one (a detach) is forgotten."""
        if namespace != self._namespace:
            self._known.clear()
            self._fetcher.forget()
        self._namespace = namespace

    def detach(self) -> None:
        """Stop serving the manager `attach` bound (its runner is done: an engine restored a checkpoint and goes on
        with another manager); the queued writes still land. The manager stops keeping pages for the store."""
        if isinstance(self._owner, PageManager):
            self._owner.watch_prefixes(written=False, host_evicted=False)
            self._owner = None

    def _expected_of(self, key: str) -> list[tuple[tuple[int, ...], np.dtype]]:
        """The leaves the value under ``key`` (a key of this store's namespace) must hold."""
        group_prefix = key.rsplit("/", 2)[0] + "/"
        [group] = [g for g in range(len(self._layouts)) if self.namespace.group_prefix(g) == group_prefix]
        return self._layouts[group].leaves

    @property
    def namespace(self) -> StoreNamespace:
        if self._namespace is None:
            raise ValueError("this PrefixStore is not attached yet; pass it to easykv.Runner(..., store=store)")
        return self._namespace

    # ---- reads --------------------------------------------------------------------------------------
    def prefetch(self, manager: PageManager, token_ids: Any, salt: Any = None) -> None:
        """Start reading the pages of ``token_ids`` neither the device nor the host tier holds.

        Args:
          manager: the runner's `PageManager`.
          token_ids: the prompt, ``(prompt_len,)`` ints.
          salt: the prefix namespace, as `PageManager.match_prefix`'s."""
        self._refuse_closed("prefetch")
        digests = manager.prompt_digests(token_ids, salt=salt)
        start = manager.cached_prefix_length(token_ids, salt=salt) // manager.page_size
        if start < len(digests):
            self._fetcher.start(self._fetch(manager, digests, start))

    def bring_in(self, manager: PageManager, host: HostTier, cache: PagedAttentionCache, token_ids: Any,
                 salt: Any = None) -> int:
        """Put the prompt's pages that arrived from the store (by the read policy) into fresh host pages, before
        `PageManager.match_prefix` looks them up; returns how many pages.

        Args:
          manager: the runner's `PageManager`.
          host: its cache's `HostTier`, whose pages the values are written into.
          cache: the live cache (pages the adoption evicts are written back from it first).
          token_ids: the prompt, ``(prompt_len,)`` ints.
          salt: the prefix namespace."""
        self._refuse_closed("match_prefix")
        digests = manager.prompt_digests(token_ids, salt=salt)
        start = manager.cached_prefix_length(token_ids, salt=salt) // manager.page_size
        fetch = self._fetcher.pop(digests)
        if start >= len(digests):  # the same on every process: no collective below
            return 0
        arrived, skip = 0, 0
        if self.health.usable():  # may differ between processes: every one reaches `_agree`
            replica = adoption_replica(manager)
            # begun now, or anew: the cache lost pages since a prefetch, or new sequences now go to another replica
            if fetch is None or fetch.start > start or fetch.replica != replica:
                fetch = self._fetch(manager, digests, start)
                self._fetcher.start(fetch)
                self._fetcher.pop(digests)
            stalled = self._fetcher.queued_behind_stall(fetch, self.timeout_s)  # cannot arrive in time: no wait
            if self.read == "wait" and not stalled:
                fetch.done.wait()
            elif self.read == "timeout" and not stalled:
                fetch.done.wait(self.timeout_s)
            skip = start - fetch.start  # pages the cache holds now that the fetch read too
            arrived = max(fetch.arrived - skip, 0)
        n = _agree(arrived)
        if not n or fetch is None:
            return 0
        pages = fetch.take(skip + n)[skip:]
        host.flush()  # every offload landed: the pages adopted may be ones an offload just filled
        adopted = manager.adopt_host_prefixes(digests[start: start + n], replica=fetch.replica)
        self.sync(manager, cache, host)  # write back what the adoption evicted, before it is overwritten
        blocks = [host.page_blocks(g) for g in range(len(adopted))]
        per_replica = host.host_pages_per_replica
        slot_of = {slot: i for i, slot in enumerate(fetch.slots)}
        for g, group_pages in enumerate(adopted):
            for i, page in enumerate(group_pages):
                if page >= 0:
                    _write_page(blocks[g], page // per_replica[g], page % per_replica[g], pages[i], g, slot_of)
        placed = [i for i in range(len(adopted[0])) if any(group_pages[i] >= 0 for group_pages in adopted)]
        for g in range(len(adopted)):  # in the store: never written back from here
            self._remember(g, [(-1, digests[start + i]) for i in range(len(adopted[g]))])
        self.pages_read += len(placed)
        return len(placed)

    def _fetch(self, manager: PageManager, digests: tuple[bytes, ...], start: int) -> Fetch:
        """A fetch of ``digests[start:]`` for the replica the adoption will place them in: only the heads of that
        replica this process holds (none: nothing is read, see `Fetch`)."""
        ns = self.namespace
        replica = adoption_replica(manager)
        heads = [self._heads[g].get(replica, []) for g in range(len(self._heads))]
        slots = [(g, h) for g, group_heads in enumerate(heads) for h in group_heads]

        def keys(digest: bytes) -> list[str]:
            return [key for g, group_heads in enumerate(heads) for key in ns.keys(g, digest, group_heads)]

        return Fetch(digests, start, replica, slots, keys, [self._layouts[g] for g, _ in slots])

    # ---- writes -------------------------------------------------------------------------------------
    def sync(self, manager: PageManager, cache: PagedAttentionCache, host: HostTier | None) -> None:
        """Queue what the write policy writes since the last call: pages sequences filled (gathered from
        ``cache``) or host pages evicted (copied from ``host`` now, before any work overwrites them).

        Args:
          manager: the runner's `PageManager` (its prefix events are taken).
          cache: the live cache the filled pages are gathered from.
          host: its `HostTier` (None: no host pages to write back)."""
        self._refuse_closed("a step's writes")
        self._forget_lost()
        events = manager.take_prefix_events()
        if events.empty:
            return
        ns = self.namespace
        for g, written in enumerate(events.written):
            self.queue_device_pages(cache, g, written)
        if host is None:
            return
        per_replica = host.host_pages_per_replica
        if any(events.host_evicted):
            host.flush()  # an evicted page's own offload may be in flight still: it lands before the page is read
        for g, evicted in enumerate(events.host_evicted):
            fresh = self._unknown(g, evicted)
            if fresh and self._writer.room(len(fresh)):
                self._remember(g, fresh)
                blocks = host.page_blocks(g)
                # Copied now (the next work may overwrite the host pages), encoded by the writer's stager.
                copies = [(ns.key(g, digest, head), [leaf.copy() for leaf in leaves])
                          for page, digest in fresh
                          for head, leaves in _page_heads(blocks, page // per_replica[g], page % per_replica[g])]
                self._writer.submit(WriteJob(len(fresh), functools.partial(_encoded, copies),
                                             [(g, d) for _, d in fresh]))

    def queue_device_pages(self, cache: PagedAttentionCache, group: int, pages: Sequence[tuple[int, bytes]]) -> None:
        """Queue device pages to be written: those whose digest this store has not written or read yet are gathered
        from ``cache`` (their copy to host memory started, the step never waits) and encoded and written by the writer
        thread; when the queue has no room they are dropped (counted). `sync` calls it for the pages sequences filled;
        an integration whose engine keeps its own page bookkeeping (EasyDeL's eSurge) calls it for the pages its
        engine filled.

        Args:
          cache: the live cache holding the pages (of the attached namespace's metadata).
          group: the layer group.
          pages: ``(device page, digest)`` of each page, its digest the page's chained digest."""
        self._refuse_closed("queue_device_pages")
        self._forget_lost()
        fresh = self._unknown(group, pages)
        if not fresh or not self._writer.room(len(fresh)):
            return
        self._remember(group, fresh)
        gathered = gather_pages(cache, group, np.array([p for p, _ in fresh]))
        replicas = gathered.pages.shape[0]
        per_replica = int(cache.metadata.groups[group].num_pages or cache.metadata.num_pages_per_layer) // replicas
        digests = [[d for p, d in fresh if p // per_replica == r] for r in range(replicas)]
        self._writer.submit(WriteJob(len(fresh), _device_items(gathered, digests, group, self.namespace),
                                     [(group, d) for _, d in fresh]))

    def count_served(self, pages: int, tokens: int) -> None:
        """Count what an admission took from the store: ``pages`` placed (a caller that places pages itself, as
        EasyDeL's eSurge hook does; 0 when `bring_in` counted them) and ``tokens`` of a prompt found in them.

        Args:
          pages: pages of the store placed by the caller, ``>= 0``.
          tokens: prompt tokens served from the store's pages, ``>= 0``."""
        self.pages_read += pages
        self.tokens_served += tokens

    def _forget_lost(self) -> None:
        """Pages the writer did not write after all (dropped, failed) are written again when a page holds them again."""
        for key in self._writer.take_lost():
            self._known.pop(key, None)

    @property
    def serving(self) -> bool:
        """Whether a runner's manager is attached (`attach`), or an integration holds the store (`hold`)."""
        return self._owner is not None

    def hold(self, holder: object, namespace: StoreNamespace) -> None:
        """Serve ``holder``, an integration's engine that keeps its own page bookkeeping (EasyDeL's eSurge), under
        ``namespace`` (its cache's): no runner may attach until `release`. ValueError, nothing changed, when the store
        serves already.

        Args:
          holder: the engine (any object; `release` takes the same one).
          namespace: the `StoreNamespace` of its cache's metadata and the store's ``model_id``."""
        self._refuse_closed("hold")
        if self._owner is not None:
            raise ValueError("this PrefixStore serves another engine or runner already; open one PrefixStore per "
                             "cache (they share the store's values through its URL)")
        self._bind_namespace(namespace)
        self._owner = holder

    def release(self, holder: object) -> None:
        """Stop serving ``holder`` (`hold`); the queued writes still land. Nothing when it is not the holder.

        Args:
          holder: the engine `hold` took."""
        if self._owner is holder:
            self._owner = None

    @property
    def fetcher(self) -> StoreFetcher:
        """The background reader: an integration that looks prompts up outside a runner begins a `Fetch` on it, waits
        by the read policy and takes the values that arrived (as `bring_in` does)."""
        return self._fetcher

    def _unknown(self, group: int, pages: Sequence[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """The pages whose digest this store has not written or read yet (each once)."""
        out, seen = [], set()
        for page, digest in pages:
            if (group, digest) not in self._known and digest not in seen:
                seen.add(digest)
                out.append((page, digest))
        return out

    def _remember(self, group: int, pages: Sequence[tuple[int, bytes]]) -> None:
        """Remember ``pages`` as in the store (queued or read), the newest `KNOWN_LIMIT` kept."""
        for _, digest in pages:
            self._known[(group, digest)] = None
            self._known.move_to_end((group, digest))
            if len(self._known) > KNOWN_LIMIT:
                self._known.popitem(last=False)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued page is written (or dropped); False when ``timeout_s`` passed first.

        Args:
          timeout_s: seconds to wait at most, ``0 .. 86400``; None: until the queue is empty."""
        if timeout_s is not None:
            timeout_s = real("timeout_s", timeout_s, lo=0, hi=86400, hint="seconds, or None to wait until written")
        return self._writer.flush(timeout_s)

    @property
    def closed(self) -> bool:
        """Whether `close` ran (every call but `metrics` and `close` is refused then)."""
        return self._closed

    def _refuse_closed(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what} on a PrefixStore that was closed ({self.backend.url}); open a new one")

    def close(self) -> None:
        """Write what is queued, stop the workers, let go of the manager and close the backend. A second call does
        nothing."""
        if self._closed:
            return
        atexit.unregister(self._at_exit)
        self.detach()
        self._closed = True
        self._writer.flush()
        self._writer.close()
        self._fetcher.close()
        self.backend.close()

    def metrics(self) -> StoreMetrics:
        """What this store did so far (`StoreMetrics`): pages read, values written, dropped, refused, failures."""
        return StoreMetrics(url=self.backend.url, pages_read=self.pages_read, tokens_served=self.tokens_served,
                            values_read=self._fetcher.read, values_written=self._writer.written,
                            values_present=self._writer.present, refused=self._fetcher.refused,
                            dropped=self._writer.dropped, failures=self.health.failures,
                            available=not self.health.down, queued=self._writer.waiting,
                            deleted=self._fetcher.deleted,
                            refused_paths=self.backend.refused_paths)


def adoption_replica(manager: PageManager) -> int:
    """The data-parallel replica `PageManager.adopt_host_prefixes` places a chain in, and a new sequence is admitted
    to: the one with the most available device pages (the same on every process: the manager is deterministic)."""
    return manager.admission_replica


def _encoded(copies: list[tuple[str, list[np.ndarray]]]) -> list[tuple[str, bytes]]:
    """Each ``(key, leaves)`` as ``(key, value)`` (`codec.encode`)."""
    return [(key, codec.encode(key, leaves)) for key, leaves in copies]


def _page_heads(blocks: Blocks, replica: int, local: int) -> list[tuple[int, list[np.ndarray]]]:
    """``(head, leaves)`` of one page of ``replica`` in ``blocks`` (row ``local``), each head once."""
    out: dict[int, list[np.ndarray]] = {}
    for r, start, stop, arrays in blocks:
        if r == replica:
            for head in range(start, stop):
                if head not in out:
                    out[head] = [a[local, :, head - start] for a in arrays]
    return sorted(out.items())


def _write_page(blocks: Blocks, replica: int, local: int, values: list[list[np.ndarray]], group: int,
                slot_of: dict[tuple[int, int], int]) -> None:
    """Copy a fetched page's heads (``values``: per slot of the fetch, ``slot_of`` its index) into every block of
    ``replica`` holding them (replicated heads: each copy): one copy of the stored bits, no temporary."""
    for r, start, stop, arrays in blocks:
        if r != replica:
            continue
        for head in range(start, stop):
            leaves = values[slot_of[group, head]]
            for a, leaf in zip(arrays, leaves):
                np.copyto(a[local, :, head - start], leaf.view(a.dtype))


def _device_items(gathered: Any, digests: list[list[bytes]], group: int, ns: StoreNamespace) -> Any:
    """The writer thread's work for pages gathered from the device (``digests``: per replica, its pages' in
    gathered order): wait for their copy, encode each head."""

    def items() -> list[tuple[str, bytes]]:
        blocks = gathered_blocks(gathered)
        out = []
        for replica, replica_digests in enumerate(digests):
            for local, digest in enumerate(replica_digests):
                for head, leaves in _page_heads(blocks, replica, local):
                    key = ns.key(group, digest, head)
                    out.append((key, codec.encode(key, leaves)))
        return out

    return items


def _flush_at_exit(ref: weakref.ReferenceType[PrefixStore], timeout_s: float = EXIT_FLUSH_S) -> int:
    """At interpreter exit: write what a store still queues, waiting ``timeout_s`` at most, and log how many pages
    were not written (still queued, or dropped since it opened); returns that count (0: nothing lost)."""
    store = ref()
    if store is None:
        return 0
    writer = store._writer
    drained = writer.flush(timeout_s)
    lost = writer.waiting + writer.dropped
    if lost:
        log.warning("easykv store %s: %d pages were not written (%d still queued after %.0f s at exit%s, %d dropped "
                    "while it ran: the queue was full or the store down); they are written again when a cache fills "
                    "them", store.backend.url, lost, writer.waiting, timeout_s, "" if drained else ": gave up",
                    writer.dropped)
    return lost


def _agree(n: int) -> int:
    """The pages every process has: the least over processes (one small collective when there are several)."""
    import jax

    if jax.process_count() == 1:
        return n
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int32(n))))


__all__ = ["READ_POLICIES", "WRITE_POLICIES", "PrefixStore", "StoreMetrics"]
