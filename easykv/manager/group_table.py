"""One layer group's share of the page manager: its pool, its block table, its window.

Every layer group has its own pool of page ids (its pages have their own size), so the manager
keeps one `GroupTable` per group. What a sequence *is* (its length, the columns it has reserved,
its data-parallel replica, its token hashes) is one thing for all groups and stays in the
`PageManager`; what a sequence *holds* differs per group:

- ``table[row, col]``: the group's page at block-table column ``col`` (``PAD_PAGE`` where none);
  every group reserves the same columns, so a row holds pages in ``[start[row], npages[row])``.
- ``start[row]``: columns before it were released because they left the group's window (always
  0 in a full-attention group): a sliding group's memory follows its window, not the sequence.
- ``copies``: pending copy-on-write copies of this pool (dst page -> src page).
- ``shared_partial``: partly filled pages of this pool a fork left shared.
- ``host``: the group's pool in the host-memory tier (None without one), with its pending
  transfers: ``offloads`` (host page -> (device page, digest, weight version): the device page's
  contents go to the host page; a digest enters the host prefix map once the copy is applied)
  and ``onloads`` (device page -> host page). A pending transfer holds one reference to its
  host page, so the host pool never hands that page to anyone else meanwhile.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from easykv.manager.page_pool import PagePool
from easykv.step.metadata import PAD_PAGE


@dataclasses.dataclass(eq=False)
class GroupTable:
    """One layer group's pages of every sequence (see the module doc)."""

    group: Any  # LayerGroup (the spec is not imported at module level: the manager's import stays light)
    pool: PagePool
    table: np.ndarray  # (batch_size, pages_per_sequence) int32
    start: np.ndarray  # (batch_size,) int32
    copies: dict[int, int] = dataclasses.field(default_factory=dict)
    shared_partial: set[int] = dataclasses.field(default_factory=set)
    host: PagePool | None = None
    offloads: dict[int, tuple[int, bytes | None, bytes | None]] = dataclasses.field(default_factory=dict)
    onloads: dict[int, int] = dataclasses.field(default_factory=dict)
    offloads_dropped: int = 0  # evicted prefix pages the host tier had no page for

    @classmethod
    def fresh(cls, group: Any, *, batch_size: int, pages_per_sequence: int, page_shards: int,
              scrub_released: bool, host_pages: int = 0) -> GroupTable:
        """``host_pages``: pages of the group's host tier (0: none)."""
        pool = PagePool(int(group.num_pages), int(page_shards), scrub_released=scrub_released)
        host = None
        if host_pages:
            pool.keep_evicted = True
            host = PagePool(int(host_pages), int(page_shards), scrub_released=scrub_released)
        return cls(group=group, pool=pool, table=np.full((batch_size, pages_per_sequence), PAD_PAGE, np.int32),
                   start=np.zeros(batch_size, np.int32), host=host)

    def set_scrub_released(self, scrub: bool) -> None:
        """Whether released pages are zeroed, in the device pool and the host tier alike."""
        for pool in (self.pool, self.host):
            if pool is not None:
                pool.scrub_released = scrub

    @property
    def windowed(self) -> bool:
        """Whether the group releases pages that left its window (sliding or chunked)."""
        return self.group.attention != "full"

    def released_columns(self, lens: Any, page_size: int) -> np.ndarray:
        """Per length, the block-table columns wholly before what the next query reads."""
        if not self.windowed:
            return np.zeros(np.shape(lens), np.int32)
        first = self.group.first_needed_position(np.asarray(lens, np.int64))
        return (first // page_size).astype(np.int32)

    def held(self, row: int, npages: int) -> list[int]:
        """The pages ``row`` holds in this group, in column order."""
        return self.table[row, self.start[row]:npages].tolist()

    def allocate(self, replica: int, n: int, *, overwritten: bool = False) -> list[int]:
        """`PagePool.allocate`, saving the prefix pages it evicts to the host tier (if any)."""
        pages = self.pool.allocate(replica, n, overwritten=overwritten)
        if self.host is not None:
            self.offload_evicted()
        return pages

    def offload_evicted(self) -> None:
        """A pending offload for every prefix page the device pool evicted whose digest the host
        tier does not hold yet; dropped (counted) when every host page of the replica is held.
        An evicted page still waiting for its onload never got its data: the onload is dropped
        (the host page keeps the digest)."""
        host = self.host
        pending = {d for _, d, _ in self.offloads.values()} if self.offloads else ()
        for page, digest, tag in self.pool.take_evicted():
            if page in self.onloads:
                host.release([self.onloads.pop(page)])
                continue
            replica = self.pool.replica_of(page)
            if host.lookup(replica, digest) >= 0 or digest in pending:
                continue
            if not host.num_available(replica):
                self.offloads_dropped += 1
                continue
            self.offloads[host.allocate(replica, 1, overwritten=True)[0]] = (page, digest, tag)

    def copy_into(self, dst: int, page: int) -> bool:
        """A pending copy-on-write of ``page`` into the fresh page ``dst``. A page whose own data is
        still pending (a copy's destination, an onload's) is filled from where that data is: the
        copy's source (copies run before onloads, so it still holds it) or the onload's host page.
        Returns whether any work was recorded."""
        if page in self.onloads:
            h = self.onloads[page]
            self.host.share([h])
            self.onloads[dst] = h
            return True
        origin = self.copies.get(page, page)
        if origin == dst:  # dst is that origin, freed and taken again: it still holds the data
            return False
        self.copies[dst] = origin
        return True

    def host_lookup(self, replica: int, digest: bytes) -> int:
        """The device page holding ``digest`` in ``replica``; else ``-2 - h`` for host page
        ``h`` holding it; else -1."""
        page = self.pool.lookup(replica, digest)
        if page >= 0 or self.host is None:
            return page
        h = self.host.lookup(replica, digest)
        return -1 if h < 0 else -2 - h

    def tier_map(self, replica: int) -> _TierMap:
        """A prefix map of ``replica`` over both tiers (`host_lookup` as ``.get``)."""
        return _TierMap(self, replica)

    def drop_freed_onloads(self) -> None:
        """Drop the pending onloads into pages that became free (the prefix cache was emptied)."""
        for page in [p for p in self.onloads if self.pool.refcount[p] == 0 and self.pool.digest_of(p) is None]:
            self.host.release([self.onloads.pop(page)])

    def release_pages(self, pages: list[int], *, stale: bool = False) -> None:
        """Drop one reference from each page (``stale``: of an older weight version, see
        `PagePool.release`); a pending copy or onload into a page that became free is dropped
        (nobody will read its destination)."""
        sources = set(self.copies.values()) if self.copies else ()
        for page in self.pool.release(pages, stale=stale, sources=sources):
            self.copies.pop(page, None)
            if self.onloads and page in self.onloads:
                self.host.release([self.onloads.pop(page)])

    def reset_row(self, row: int) -> None:
        self.table[row] = PAD_PAGE
        self.start[row] = 0

    def fork_shared_pages(self, rows: np.ndarray, cols: np.ndarray) -> set[int]:
        """Of the pages at ``(rows, cols)`` (the unfinished pages of sequences), those this
        group holds with more than one owner (only a fork makes these)."""
        pages = self.table[rows, cols]
        pages = pages[pages != PAD_PAGE]
        return set(pages[self.pool.refcount[pages] > 1].tolist())


class _TierMap:
    """``.get(digest, -1)`` of a prefix map spanning the device and host tiers (`host_lookup`)."""

    __slots__ = ("gt", "replica")

    def __init__(self, gt: GroupTable, replica: int):
        self.gt, self.replica = gt, replica

    def get(self, digest: bytes, default: int = -1) -> int:
        return self.gt.host_lookup(self.replica, digest)


__all__ = ["GroupTable"]
