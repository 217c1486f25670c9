"""The physical page pool: reference counts, free pages, the prefix-cache map and its LRU.

Kept apart from the `PageManager` (which knows sequences) the way vLLM keeps its block pool
apart from its scheduler-facing manager: the pool only knows pages. Every page is in exactly
one of three states:

* free: unreferenced and holding nothing reusable; kept in a min-heap so the lowest id is
  handed out first (deterministic on every host, and compact ids are easy to read in tests);
* cached: unreferenced but holding a full page whose digest is in the prefix map; kept in
  least-recently-released order and evicted only when no free page is left;
* used: referenced by at least one sequence (a used page may also be in the prefix map).

A prefix page carries the weight version of the sequence that filled it (a tag; None before any
version was set): cached pages of a version other than the current one are evicted first.

With data-parallel replicas the pool is split into equal slices, ``[r * n, (r + 1) * n)`` for
replica ``r``; each slice has its own free heap, LRU and prefix map, so a page never crosses
replicas and prefixes are only shared within one.

A leaf of the manager: it imports none of its other modules, and never ``storage``, ``attention``,
``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from easykv.errors import InvariantError

JOURNAL_LIMIT = 1 << 16  # entries a journal (`take_written`, `take_evicted`) keeps for an owner that does not take them


class PagePool:
    """Pages ``0 .. num_pages - 1`` split into ``num_replicas`` equal slices.

    Callers (the manager) check capacity before allocating: `allocate` never fails half way.
    """

    def __init__(self, num_pages: int, num_replicas: int = 1, *, scrub_released: bool = False,
                 keep_evicted: bool = False):
        """``keep_evicted``: keep what each eviction evicted for `take_evicted` (a tier below saves it)."""
        if num_pages <= 0 or num_replicas <= 0 or num_pages % num_replicas:
            raise ValueError(
                f"num_pages={num_pages} must be a positive multiple of num_replicas={num_replicas}"
            )
        self.num_pages = int(num_pages)
        self.num_replicas = int(num_replicas)
        self.pages_per_replica = self.num_pages // self.num_replicas
        self.scrub_released = bool(scrub_released)
        self.refcount = np.zeros(self.num_pages, np.int32)
        self._digest: list[bytes | None] = [None] * self.num_pages
        self._tag: list[bytes | None] = [None] * self.num_pages  # weight version of a prefix page
        n = self.pages_per_replica
        self._free: list[list[int]] = [list(range(r * n, (r + 1) * n)) for r in range(self.num_replicas)]
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(self.num_replicas)]
        self._by_digest: list[dict[bytes, int]] = [{} for _ in range(self.num_replicas)]
        self._scrub: dict[int, None] = {}  # ordered set of pages to zero on the device
        # (page, digest, tag) of pages evicted since the owner last took them (`take_evicted`);
        # kept only when a tier below wants to save them (`keep_evicted`).
        self.keep_evicted = bool(keep_evicted)
        self._evicted: list[tuple[int, bytes, bytes | None]] = []
        self.evictions = 0
        self.scrubs = 0
        # (page, digest) of pages sequences filled and entered in the prefix map since the owner last
        # took them (`take_written`); kept only while a shared store wants to write them (`set_journal`).
        self._written: list[tuple[int, bytes]] | None = None
        self.journal_dropped = 0  # journal entries dropped when nobody took them for `JOURNAL_LIMIT` entries

    def set_scrub_released(self, scrub: bool) -> None:
        """Whether pages released from now on are zeroed (a loaded state says)."""
        self.scrub_released = bool(scrub)

    def set_keep_evicted(self, keep: bool) -> None:
        """Whether what is evicted from now on is kept for `take_evicted` (a tier below keeps it)."""
        self.keep_evicted = bool(keep)

    def set_journal(self, on: bool) -> None:
        """Whether pages sequences fill (`commit` with ``written``) are kept for `take_written` from now on
        (a shared store writes them); off drops what was kept."""
        self._written = [] if on else None

    # ---- counts ----------------------------------------------------------------------------
    def replica_of(self, page: int) -> int:
        return int(page) // self.pages_per_replica

    def num_free(self, replica: int | None = None) -> int:
        return sum(len(h) for h in self._free) if replica is None else len(self._free[replica])

    def num_cached(self, replica: int | None = None) -> int:
        return sum(len(q) for q in self._lru) if replica is None else len(self._lru[replica])

    def num_available(self, replica: int | None = None) -> int:
        """Pages an allocation can take: free ones, then cached ones (evicting them)."""
        return self.num_free(replica) + self.num_cached(replica)

    def num_used(self, replica: int | None = None) -> int:
        total = self.num_pages if replica is None else self.pages_per_replica
        return total - self.num_available(replica)

    def available_per_replica(self) -> np.ndarray:
        return np.array([len(h) + len(q) for h, q in zip(self._free, self._lru)], np.int64)

    # ---- allocation and references ------------------------------------------------------------
    def allocate(self, replica: int, n: int, *, overwritten: bool = False) -> list[int]:
        """``n`` pages of ``replica`` with one reference each: lowest free ids first, then the
        least recently released cached pages (evicted from the prefix map).

        ``overwritten``: the pages will be wholly overwritten (copy-on-write destinations), so
        a pending scrub of them is dropped rather than racing the copy.
        """
        free, lru = self._free[replica], self._lru[replica]
        if n > len(free) + len(lru):
            raise InvariantError(
                f"allocate({n}) on replica {replica} with {len(free)} free and {len(lru)} cached pages; "
                "the manager must check capacity first"
            )
        out = [heapq.heappop(free) for _ in range(min(n, len(free)))]
        while len(out) < n:
            page, _ = lru.popitem(last=False)
            digest = self._digest[page]
            if digest is None:  # every cached page is in the prefix map
                raise InvariantError(f"cached page {page} has no digest")
            del self._by_digest[replica][digest]
            if self.keep_evicted:
                self._evicted.append((page, digest, self._tag[page]))
                self._bound(self._evicted)
            self._digest[page] = self._tag[page] = None
            self.evictions += 1
            self._mark_scrub(page)
            out.append(page)
        self.refcount[out] = 1
        if overwritten and self._scrub:
            for page in out:
                self._scrub.pop(page, None)
        return out

    def _bound(self, journal: list[Any]) -> None:
        """Keep a journal nobody takes from growing without bound: past `JOURNAL_LIMIT` entries its older half
        is dropped, counted in ``journal_dropped``."""
        if len(journal) > JOURNAL_LIMIT:
            half = len(journal) // 2
            del journal[:half]
            self.journal_dropped += half

    def take_written(self) -> list[tuple[int, bytes]]:
        """``(page, digest)`` of every page a sequence filled and entered in the prefix map since the last call, in
        commit order (only while `set_journal` is on; else empty)."""
        if not self._written:
            return []
        out, self._written = self._written, []
        return out

    def take_evicted(self) -> list[tuple[int, bytes, bytes | None]]:
        """``(page, digest, weight version)`` of every page evicted since the last call, in
        eviction order (only while `keep_evicted`): their contents are still on the device until
        the step that overwrites them."""
        out, self._evicted = self._evicted, []
        return out

    def share(self, pages: Iterable[int]) -> None:
        """Add a reference to each page; a cached page becomes used again (prefix hit, fork)."""
        for page in pages:
            if self.refcount[page] == 0:
                if self._digest[page] is None:
                    raise InvariantError(f"share() of page {page}, which is free")
                del self._lru[self.replica_of(page)][page]
            self.refcount[page] += 1

    def release(self, pages: Iterable[int], *, stale: bool = False, sources: Any = ()) -> list[int]:
        """Drop one reference from each page, in order. Pages left unreferenced become cached
        (if in the prefix map; the first released is the first evicted) or free. ``stale``:
        the pages belong to an older weight version, so cached ones go ahead of every other
        cached page (evicted first). ``sources``: pages a pending copy still reads; one left
        unreferenced leaves the prefix map and is freed (scrubbed after the copy read it), so a
        copy reads a prefix page only while a sequence holds it. Returns the pages that became
        free."""
        freed, front = [], []
        for page in pages:
            count = self.refcount[page] - 1
            if count < 0:
                raise InvariantError(f"release() of page {page}, which has no reference")
            self.refcount[page] = count
            if count == 0:
                if (digest := self._digest[page]) is not None and page in sources:
                    del self._by_digest[self.replica_of(page)][digest]
                    self._digest[page] = self._tag[page] = None
                if self._digest[page] is not None:
                    self._lru[self.replica_of(page)][page] = None
                    if stale:
                        front.append(page)
                else:
                    heapq.heappush(self._free[self.replica_of(page)], page)
                    self._mark_scrub(page)
                    freed.append(page)
        for page in reversed(front):  # ahead of the others, in release order among themselves
            self._lru[self.replica_of(page)].move_to_end(page, last=False)
        return freed

    def demote(self, current: bytes | None) -> None:
        """Put cached pages of weight versions other than ``current`` ahead of the others in
        every LRU (evicted first), keeping the order within each kind."""
        for r, lru in enumerate(self._lru):
            stale = [p for p in lru if self._tag[p] != current]
            if stale and len(stale) < len(lru):
                self._lru[r] = OrderedDict.fromkeys(stale + [p for p in lru if self._tag[p] == current])

    def forget_prefixes(self) -> int:
        """Empty the prefix map: cached pages become free (scrubbed when the pool scrubs), pages
        in use keep their contents but can no longer be found. Returns the pages it held."""
        held = sum(len(m) for m in self._by_digest)
        for r, lru in enumerate(self._lru):
            for page in lru:
                heapq.heappush(self._free[r], page)
                self._mark_scrub(page)
            lru.clear()
            self._by_digest[r].clear()
        self._digest = [None] * self.num_pages
        self._tag = [None] * self.num_pages
        return held

    def _mark_scrub(self, page: int) -> None:
        if self.scrub_released and page not in self._scrub:
            self._scrub[page] = None
            self.scrubs += 1

    # ---- prefix map -------------------------------------------------------------------------
    def lookup(self, replica: int, digest: bytes) -> int:
        """The page holding ``digest`` in ``replica``, or -1."""
        return self._by_digest[replica].get(digest, -1)

    def digest_map(self, replica: int) -> dict[bytes, int]:
        """Replica ``replica``'s prefix map (digest -> page), for lookups in a loop; read only."""
        return self._by_digest[replica]

    def digest_of(self, page: int) -> bytes | None:
        return self._digest[page]

    def tag_of(self, page: int) -> bytes | None:
        """The weight version of a prefix page (None: none was set)."""
        return self._tag[page]

    def cached_tags(self) -> list[bytes | None]:
        """The weight version of every cached page (metrics)."""
        return [self._tag[p] for lru in self._lru for p in lru]

    def uncommit(self, page: int) -> None:
        """Take a used page out of the prefix map (a truncated sequence will overwrite its tail)."""
        digest = self._digest[page]
        if self.refcount[page] < 1 or digest is None:
            raise InvariantError(f"uncommit() of page {page}, which is not a used prefix page")
        del self._by_digest[self.replica_of(page)][digest]
        self._digest[page] = self._tag[page] = None

    def commit(self, page: int, digest: bytes, tag: bytes | None = None, *, written: bool = False) -> bool:
        """Enter a used, just-filled page in the prefix map, of weight version ``tag``. When
        another page of the replica already holds that digest (two sequences filled the same
        prefix at once), this one stays private and is freed normally; returns whether it was
        entered. ``written``: a sequence filled it (not a tier's copy), so it enters the journal
        (`take_written`) when entered and a journal is kept."""
        by_digest = self._by_digest[self.replica_of(page)]
        if digest in by_digest or self._digest[page] is not None:
            return False
        by_digest[digest] = page
        self._digest[page] = digest
        self._tag[page] = tag
        if written and self._written is not None:
            self._written.append((page, digest))
            self._bound(self._written)
        return True

    # ---- device work to report ---------------------------------------------------------------
    def pending_scrubs(self) -> np.ndarray:
        return np.fromiter(self._scrub, np.int32, len(self._scrub))

    def has_pending_scrubs(self) -> bool:
        return bool(self._scrub)

    def take_scrubs(self) -> np.ndarray:
        out = self.pending_scrubs()
        self._scrub.clear()
        return out

    # ---- persistence --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        hashed = [[p, d.hex()] for p, d in enumerate(self._digest) if d is not None]
        out = {
            "free": [sorted(h) for h in self._free],
            "lru": [list(q) for q in self._lru],
            "digests": hashed,
            "scrub": list(self._scrub),
            "evictions": self.evictions,
            "scrubs": self.scrubs,
        }
        tags = [[p, t.hex()] for p, t in enumerate(self._tag) if t is not None]
        if tags:  # only once weight versions are in use: other states keep their form
            out["versions"] = tags
        return out

    def load_state(self, *, free: list[Any], lru: list[Any], digests: list[tuple[int, bytes]], scrub: list[int],
                   evictions: int, scrubs: int, refcount: np.ndarray,
                   versions: Sequence[tuple[int, bytes]] = ()) -> None:
        """Replace this (fresh) pool's state with values already checked for type and range
        (`state.read_state`); ``refcount`` comes from the owners. Whether they agree
        with each other is for `check`."""
        self.refcount = np.asarray(refcount, np.int32).copy()
        self._free = [sorted(int(p) for p in h) for h in free]
        self._lru = [OrderedDict((int(p), None) for p in q) for q in lru]
        self._digest = [None] * self.num_pages
        self._by_digest = [{} for _ in range(self.num_replicas)]
        for page, digest in digests:
            self._digest[page] = digest
            self._by_digest[self.replica_of(page)][digest] = page
        self._tag = [None] * self.num_pages
        for page, tag in versions:
            self._tag[page] = tag
        self._scrub = dict.fromkeys(scrub)
        self.evictions = evictions
        self.scrubs = scrubs

    # ---- invariants ----------------------------------------------------------------------------
    def check(self, owners: np.ndarray) -> None:
        """Raise InvariantError unless the pool agrees with ``owners`` (references per page
        counted from the sequences' block tables) and with itself."""
        if not np.array_equal(self.refcount, owners):
            bad = int(np.flatnonzero(self.refcount != owners)[0])
            raise InvariantError(
                f"page {bad} has refcount {int(self.refcount[bad])} but {int(owners[bad])} owners"
            )
        state = np.zeros(self.num_pages, np.int8)  # 0 used, 1 free, 2 cached
        n = self.pages_per_replica
        for r in range(self.num_replicas):
            for kind, pages in ((1, self._free[r]), (2, self._lru[r])):
                for page in pages:
                    if not r * n <= page < (r + 1) * n:
                        raise InvariantError(f"page {page} is listed in replica {r}'s pool but lies outside it")
                    if state[page]:
                        raise InvariantError(f"page {page} is listed twice among free/cached pages")
                    state[page] = kind
            heap = self._free[r]
            if any(heap[(i - 1) // 2] > heap[i] for i in range(1, len(heap))):
                raise InvariantError(f"replica {r}'s free heap is out of order")
            for held, page in self._by_digest[r].items():
                if self._digest[page] != held or self.replica_of(page) != r:
                    raise InvariantError(f"prefix map entry of replica {r} -> page {page} disagrees with the page")
        hashed = sum(d is not None for d in self._digest)
        if hashed != sum(len(m) for m in self._by_digest):
            raise InvariantError(f"{hashed} pages carry digests but the prefix maps hold a different count")
        for page in range(self.num_pages):
            ref, kind, digest = int(self.refcount[page]), int(state[page]), self._digest[page]
            if (ref > 0) != (kind == 0):
                raise InvariantError(f"page {page} has refcount {ref} but is {('used', 'free', 'cached')[kind]}")
            if kind == 1 and digest is not None:
                raise InvariantError(f"free page {page} still carries a digest")
            if digest is None and self._tag[page] is not None:
                raise InvariantError(f"page {page} carries a weight version but is not in the prefix cache")
            if kind == 2 and digest is None:
                raise InvariantError(f"cached page {page} has no digest")
        if self.num_free() + self.num_cached() + int(np.count_nonzero(self.refcount)) != self.num_pages:
            raise InvariantError("free + cached + used pages do not add up to the pool size")


__all__ = ["PagePool"]
