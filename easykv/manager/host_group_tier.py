"""One layer group's share of the host-memory tier (`HostGroupTier`): its host pool and the
transfers pending between it and the group's device pool.

- ``pool``: the group's host pages (a `PagePool` of their own, split per data-parallel replica
  like the device pool: a transfer never crosses replicas), with the host prefix map.
- ``offloads``: host page -> (device page, digest, weight version): the device page's contents
  go to the host page; a digest enters the host prefix map once the copy is applied.
- ``onloads``: device page -> host page: the host page's contents come back to the device page.
- ``dropped``: evicted prefix pages the tier had no host page for.

A pending transfer holds one reference to its host page, so the host pool never hands that page
to anyone else meanwhile. The device pool is ``device``: read here (a page's digest, replica and
references), and written only through its own methods (an onloaded page's digest committed).

The host-tier layer (`host_tier.HostTierLayer`) holds one per group and answers the core's
questions (`lower_tier.LowerTier`) with them. Imports of the manager: ``page_pool``, ``broken``;
never ``storage``, ``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from easykv.errors import InvariantError
from easykv.manager.broken import Broken
from easykv.manager.page_pool import PagePool

if TYPE_CHECKING:
    from easykv.manager.lower_tier import Evicted


@dataclasses.dataclass(eq=False)
class HostGroupTier:
    """Layer group ``index``'s host pages and pending transfers (see the module doc). Owns
    ``pool``, ``offloads``, ``onloads`` and ``dropped``; every change to them is one of its
    methods. ``device`` is the group's device pool; ``grouped``: the manager has several groups
    (for messages)."""

    index: int
    grouped: bool
    pool: PagePool
    device: PagePool
    offloads: dict[int, tuple[int, bytes | None, bytes | None]] = dataclasses.field(default_factory=dict)
    onloads: dict[int, int] = dataclasses.field(default_factory=dict)
    dropped: int = 0

    @classmethod
    def fresh(cls, index: int, grouped: bool, host_pages: int, device: PagePool) -> HostGroupTier:
        """``host_pages`` empty host pages beside ``device``, split into its replicas."""
        return cls(index=index, grouped=grouped, pool=PagePool(int(host_pages), device.num_replicas), device=device)

    @property
    def label(self) -> str:
        """`` of layer group g`` in messages of a manager of several groups."""
        return f" of layer group {self.index}" if self.grouped else ""

    # ---- evicted prefix pages ------------------------------------------------------------------------
    def keep_evicted(self, evicted: list[Evicted]) -> None:
        """A pending offload for every evicted device page whose digest the host pool does not hold
        yet (nor a pending offload); dropped (counted) when every host page of its replica is held."""
        host = self.pool
        pending = {d for _, d, _ in self.offloads.values()} if self.offloads else ()
        for page, digest, tag in evicted:
            replica = self.device.replica_of(page)
            if host.lookup(replica, digest) >= 0 or digest in pending:
                continue
            if not host.num_available(replica):
                self.dropped += 1
                continue
            self.offloads[host.allocate(replica, 1, overwritten=True)[0]] = (page, digest, tag)

    # ---- transfers --------------------------------------------------------------------------------------
    def offload(self, host_page: int, page: int) -> None:
        """A pending offload of device ``page`` into the fresh ``host_page`` (which the caller
        allocated): the page's digest and weight version enter the host prefix map once applied."""
        digest = self.device.digest_of(page)
        self.offloads[host_page] = (page, digest, self.device.tag_of(page) if digest is not None else None)

    def onload(self, page: int, host_page: int) -> None:
        """A pending onload of ``host_page`` into the fresh device ``page``, which takes over one
        reference to the host page; a host page of the host prefix map enters the device's under
        its digest and weight version."""
        self.onloads[page] = host_page
        if (digest := self.pool.digest_of(host_page)) is not None:
            self.device.commit(page, digest, self.pool.tag_of(host_page))

    def refill(self, dst: int, page: int) -> None:
        """The fresh device page ``dst`` is filled from the host page ``page`` waits for (a copy of a
        page whose onload is pending): one more reference to that host page."""
        host_page = self.onloads[page]
        self.pool.share([host_page])
        self.onloads[dst] = host_page

    def drop_into(self, pages: list[int]) -> None:
        """Drop the pending onloads into these device pages (freed, or evicted before they ran)."""
        if self.onloads:
            for page in pages:
                if page in self.onloads:
                    self.pool.release([self.onloads.pop(page)])

    def moving(self) -> set[int]:
        """The device pages pending transfers read (offload sources) or write (onload destinations)."""
        if not (self.offloads or self.onloads):
            return set()
        return set(self.onloads) | {src for src, _, _ in self.offloads.values()}

    def has_transfers(self) -> bool:
        return bool(self.offloads or self.onloads)

    def has_work(self) -> bool:
        return bool(self.offloads or self.onloads or self.pool.has_pending_scrubs())

    def pending_transfers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(offload src, offload dst, onload src, onload dst, host scrubs)`` pending, int32 arrays."""
        off = np.array([[src, dst] for dst, (src, _, _) in self.offloads.items()], np.int32).reshape(-1, 2)
        on = np.array([[src, dst] for dst, src in self.onloads.items()], np.int32).reshape(-1, 2)
        return off[:, 0], off[:, 1], on[:, 0], on[:, 1], self.pool.pending_scrubs()

    def transfers_done(self) -> tuple[int, int]:
        """The pending transfers were applied: offloaded prefix pages enter the host prefix map,
        every transfer's host reference is dropped, the host scrubs were made. Returns how many
        pages were offloaded and onloaded."""
        host = self.pool
        done = len(self.offloads), len(self.onloads)
        host.take_scrubs()
        for h, (_, digest, tag) in self.offloads.items():
            if digest is not None:
                host.commit(h, digest, tag)
        host.release(list(self.offloads))
        host.release(list(self.onloads.values()))
        self.offloads.clear()
        self.onloads.clear()
        return done

    # ---- prefixes -----------------------------------------------------------------------------------------
    def forget_prefixes(self) -> int:
        """Empty the host prefix cache (the device's was emptied just before); returns the pages it
        held. Onloads into device pages that became free are dropped; offloads still pending land
        as plain pages (their digests are forgotten too)."""
        device = self.device
        self.drop_into([p for p in self.onloads if device.refcount[p] == 0 and device.digest_of(p) is None])
        held = self.pool.forget_prefixes()
        self.offloads = {h: (page, None, None) for h, (page, _, _) in self.offloads.items()}
        return held

    def holds_data_elsewhere(self, scrubs_pending_here: bool) -> bool:
        """Whether a host page holds data another `HostTier` would lack: any held page but a pending
        offload's destination (its data comes with the transfer), or (``scrubs_pending_here``) a
        released page the attached tier has not zeroed yet."""
        host = self.pool
        return host.num_pages - host.num_free() > len(self.offloads) or (scrubs_pending_here
                                                                        and host.has_pending_scrubs())

    # ---- state and invariants -------------------------------------------------------------------------------
    def lockstep_pieces(self) -> tuple[dict[str, Any], list[list[Any]], list[list[int]]]:
        """(the host pool's state, the offloads as [host page, device page, digest hex], the onloads
        as [device page, host page]) for the tier's lock-step state."""
        offloads = [[h, src, None if d is None else d.hex()] for h, (src, d, _) in self.offloads.items()]
        return self.pool.state_dict(), offloads, [[dst, h] for dst, h in self.onloads.items()]

    def check(self, swapped: list[tuple[int, int, int, int, int, tuple[int, ...]]], copies: dict[int, int],
              page_size: int) -> None:
        """Raise `Broken` unless the host pool agrees with its holders (``swapped``: per swapped-out
        sequence ``(row, length, columns, start, replica, its host pages here)``, holding columns
        ``start .. columns - 1`` here; and the pending transfers), and transfers stay in a replica
        and touch pages they may (``copies``: the group's pending copy-on-write copies, dst -> src)."""
        of = f" in layer group {self.index}" if self.grouped else ""
        host, pool = self.pool, self.device
        holders: list[int] = []
        for row, length, columns, start, replica, pages in swapped:
            if len(pages) != columns - start or columns != -(-length // page_size):
                raise Broken(f"sequences[id={row}].swapped", f"swapped-out sequence {row} of length {length} "
                                                             f"holds {len(pages)} host pages{of} for {columns} "
                                                             "columns")
            if any(host.replica_of(h) != replica for h in pages):
                raise Broken(f"sequences[id={row}].swapped", f"swapped-out sequence {row} holds a host page{of} "
                                                             f"outside replica {replica}")
            holders += pages
        for h, (src, _digest, _) in self.offloads.items():
            if host.replica_of(h) != pool.replica_of(src) or host.digest_of(h) is not None:
                raise Broken("host", f"offload {src} -> host page {h}{of} crosses replicas or targets a cached "
                                     "host page")
        for dst, h in self.onloads.items():
            if host.replica_of(h) != pool.replica_of(dst) or (pool.refcount[dst] == 0 and pool.digest_of(dst) is None):
                raise Broken("host", f"onload host page {h} -> {dst}{of} crosses replicas or fills a free page")
            if dst in copies or host.digest_of(h) != pool.digest_of(dst) and pool.digest_of(dst) is not None:
                raise Broken("host", f"onload host page {h} -> {dst}{of} disagrees with the device page's copy or "
                                     "digest")
        holders += list(self.offloads) + list(self.onloads.values())
        try:
            host.check(np.bincount(np.asarray(holders, np.int64), minlength=host.num_pages).astype(np.int32))
        except InvariantError as err:
            raise Broken("host", f"host tier{of}: {err.detail}") from None


__all__ = ["HostGroupTier"]
