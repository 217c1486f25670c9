"""The host-memory tier: a second pool of pages per layer group in host memory, behind the
device pool.

- **Evicted prefixes are kept.** A full prefix page the device pool evicts (LRU) is copied to a
  host page instead of vanishing (an *offload*), unless the host tier holds its digest already;
  the host pool evicts its own least recently used pages when full. `match_prefix` continues
  into the host tier where the device's cached pages end: every page found there gets a fresh
  device page and an *onload* copy, and the hit counts as usual.
- **Preempted sequences are swapped.** `swap_out(seq)` moves a running sequence's written pages
  to host pages it owns there and frees its device pages (its id stays claimed); `swap_in(seq)`
  gives it device pages again and copies its pages back, so it continues as if never preempted.
  A full page whose digest a tier still holds is shared, not copied.

Transfers are pending device work, like copy-on-write copies: `apply_pending(cache, host=tier)`
runs them (`easykv.tiers.HostTier` holds the host pages) before the step's writes, all reads
before any write: offloads read the device pages before onloads and copies overwrite them, and
onloads read host pages before the offloads of the same call land. A transfer holds one
reference to its host page until applied, so the host pool never hands that page out meanwhile.
With ``scrub_released``, host pages left unreferenced are zeroed like device pages: their scrubs
are pending work (`has_pending_work`: `apply_pending` needs the tier for them), and
`apply_pending` zeroes the pages its own transfers leave unreferenced in the same call, so
nothing of the host tier is pending after it.
A host page to scrub is never an offload's destination: allocating it for one drops its scrub
(the offload overwrites all of it).

A `HostTier` serves one manager for its life: the first `apply_pending` that takes it binds it
to this manager's token (`check_host`), and a tier bound to another manager is refused, so two
caches of one shape cannot write into each other's host pages through a wrong ``host=``.

What the tier does not do: a manager state (and so a checkpoint) does not include it; `state_dict`
refuses while sequences are swapped out or transfers are pending, and leaves the host prefix
cache out (a restored manager starts with an empty host tier, and takes a new `HostTier`: the old
one stays bound to the manager that used it).

This module holds the `HostTierPolicy` (who is swapped out, which `HostTier` holds the host pages,
the tier's counters) and its metrics; the host pools and pending transfers are each group's
(`group_table`). The `HostTier` is duck-typed: it never imports ``storage``, ``attention``,
``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np

from easykv.errors import CacheFullError, InvariantError
from easykv.manager.broken import Broken
from easykv.step.metadata import PAD_PAGE

if TYPE_CHECKING:
    from easykv.manager.coordinator import GroupCoordinator
    from easykv.manager.group_table import GroupTable
    from easykv.manager.sequences import SequenceTable
    from easykv.spec.metadata import PagedAttentionCacheMetaData

HOST_COUNTERS = ("host_hits", "host_hit_tokens", "offloaded_pages", "onloaded_pages", "swap_outs", "swap_ins")
Transfers: TypeAlias = tuple[tuple[np.ndarray, ...], ...]  # per group: offload src, dst; onload src, dst; host scrubs


class HostTierLike(Protocol):
    """What the policy calls on an `easykv.tiers.HostTier` (duck-typed: `check_host` checks
    these names; the manager never imports ``tiers``)."""

    @property
    def owner(self) -> object | None: ...
    def apply(self, cache: Any, transfers: Any, *, copies: Any = None, scrubs: Any = None,
              manager_metadata: Any = None) -> Any: ...
    def check(self, cache: Any, manager_metadata: Any = None) -> None: ...
    def bind(self, owner: object) -> None: ...
    def scrub(self, pages: Any) -> None: ...


@dataclasses.dataclass(frozen=True)
class SwappedSequence:
    """A swapped-out sequence's pages: ``pages[g]`` are its host pages of layer group ``g``
    for block-table columns ``starts[g] .. npages - 1`` (columns before ``starts[g]`` left a
    window), all in data-parallel replica ``replica``'s slice."""

    npages: int
    replica: int
    starts: tuple[int, ...]
    pages: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class HostTierMetrics:
    """A snapshot of the host tier (page counts over every layer group's host pool; counters are
    totals since creation): ``used_pages`` are held by swapped-out sequences and pending
    transfers; ``host_hits`` / ``host_hit_tokens`` count the prefix lookups that brought pages
    back from the host and their tokens (also counted in the manager's ``prefix_hits``).

    Attributes:
      total_pages: host pages.
      free_pages: host pages unreferenced and holding no cached prefix.
      cached_pages: unreferenced host pages kept for prefix reuse.
      used_pages: host pages referenced by swapped-out sequences or pending transfers.
      swapped_sequences: sequences swapped out now.
      host_hits: prefix lookups that brought pages back from the host.
      host_hit_tokens: tokens of those pages.
      offloaded_pages: applied device -> host copies (evicted prefix pages and swap-outs).
      onloaded_pages: applied host -> device copies (prefix hits and swap-ins).
      dropped_pages: evicted prefix pages not offloaded because no host page was free or
        evictable.
      evictions: host pages evicted from the host prefix cache.
      swap_outs: sequences swapped out (`swap_out`).
      swap_ins: sequences swapped back in (`swap_in`).
    """

    total_pages: int
    free_pages: int
    cached_pages: int
    used_pages: int
    swapped_sequences: int
    host_hits: int
    host_hit_tokens: int
    offloaded_pages: int  # device -> host copies (evicted prefix pages and swap-outs)
    onloaded_pages: int  # host -> device copies (prefix hits and swap-ins)
    dropped_pages: int  # evicted prefix pages the host tier had no page for
    evictions: int  # host pages evicted from the host prefix cache
    swap_outs: int
    swap_ins: int


class HostTierPolicy:
    """What the manager decides about its host-memory tier (see the module doc).

    Owns ``swapped`` (row -> `SwappedSequence` of every swapped-out sequence), ``tier`` (the
    `HostTier` holding this manager's host pages, set by `apply_pending`), ``tier_key`` (what a
    `HostTier` is bound to) and ``counters`` (`HOST_COUNTERS`). ``enabled``: whether the manager
    has a host tier at all. Every method that touches pages is handed the groups.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.swapped: dict[int, SwappedSequence] = {}
        self.counters = dict.fromkeys(HOST_COUNTERS, 0)
        self.tier: HostTierLike | None = None
        # This object, not the manager, is what a HostTier is bound to, so a clone (deep copy) or a
        # manager rebuilt from a state gets its own and cannot write into this one's tier.
        self.tier_key = _TierKey()

    def require(self, what: str) -> None:
        if not self.enabled:
            raise ValueError(f"{what} needs a host-memory tier, and this manager has none; create the metadata with "
                             "PagedAttentionCacheMetaData.create(..., host_memory_bytes=N) (or host_pages_per_layer=)")

    def refuse_swapped(self, rows: Any, what: str) -> None:
        """ValueError when one of ``rows`` is swapped out (``what``: what it may not do then)."""
        if not self.swapped:
            return
        for row in np.atleast_1d(rows).tolist():
            if row in self.swapped:
                raise ValueError(f"sequence {row} is swapped out; swap_in({row}) before {what}")

    def swapped_mask(self, batch_size: int) -> np.ndarray:
        mask = np.zeros(batch_size, bool)
        mask[list(self.swapped)] = True
        return mask

    # ---- the HostTier ------------------------------------------------------------------------------
    def forget(self, groups: GroupCoordinator) -> int:
        """`PageManager.forget_host_tier`."""
        self.require("forget_host_tier")
        if self.swapped or self.has_pending_transfers(groups):
            raise ValueError("sequences are swapped out or host transfers are pending; swap_in and apply_pending first")
        held = sum(table.host_pool.forget_prefixes() for table in groups)
        if self.tier is not None:  # no later apply reaches the detached tier: zero what it keeps now
            self.tier.scrub(tuple(table.host_pool.take_scrubs() for table in groups))
        self.tier = None
        return held

    def check_host(self, cache: Any, host: Any, metadata: PagedAttentionCacheMetaData,
                   groups: GroupCoordinator) -> None:
        """`PageManager.check_host`."""
        if not self.enabled:
            if host is not None:
                raise ValueError("host= was given but this manager has no host-memory tier; leave it out, or create "
                                 "the metadata with a host tier (PagedAttentionCacheMetaData.create(..., "
                                 "host_memory_bytes=N))")
            return
        if host is None:
            if self.has_work(groups):
                raise ValueError("host-tier work (transfers, or scrubs of released host pages) is pending; pass the "
                                 "cache's tier: apply_pending(cache, host=tier) with tier = easykv.HostTier(cache)")
            return
        if not all(callable(getattr(host, name, None)) for name in ("apply", "check", "bind", "scrub")):
            raise ValueError(f"host= must be the easykv.HostTier of this cache (tier = easykv.HostTier(cache), made "
                             f"once and passed to every apply_pending), got {type(host).__name__}")
        host.check(cache, metadata)
        owner = getattr(host, "owner", None)
        if owner is not None and owner is not self.tier_key:
            raise ValueError("host= is a HostTier bound to another PageManager (the first one whose apply_pending "
                             "took it; a clone() cannot write into its original's tier): its host pages hold that "
                             "manager's sequences. Pass this manager's own tier, or make one for this cache with "
                             "easykv.HostTier(cache)")
        if host is not self.tier and self._data_elsewhere(groups):
            raise ValueError("host= is not the HostTier this manager's host pages live in (apply_pending took "
                             "another one, or take_transfers moved them); pass that one, or forget_host_tier() "
                             "to start an empty tier")

    def _data_elsewhere(self, groups: GroupCoordinator) -> bool:
        """Whether some host page holds data a newly taken tier would lack: any held page but a
        pending offload's destination (its data comes with the call), or a released page the
        current tier has not zeroed yet."""
        return any((host := table.host_pool).num_pages - host.num_free() > len(table.offloads)
                   or (self.tier is not None and host.has_pending_scrubs()) for table in groups)

    def bind(self, host: HostTierLike) -> None:
        """``host`` passed `check_host`: it holds this manager's host pages from now on."""
        host.bind(self.tier_key)
        self.tier = host

    # ---- swapping -------------------------------------------------------------------------------
    def swap_out(self, row: int, seqs: SequenceTable, groups: GroupCoordinator, *, stale: bool) -> None:
        """`PageManager.swap_out` of the claimed, not swapped-out ``row`` (``stale``: it runs
        under an older weight version)."""
        cols = seqs.written_columns(row)
        replica = int(seqs.replica[row])
        plans = []
        for table in groups:
            host = table.host_pool
            held = table.held(row, cols)
            for page in held:
                if page in table.copies or page in table.onloads:
                    raise ValueError(f"sequence {row}'s page {page}{table.label} still waits for a pending copy; "
                                     "call apply_pending(cache, host=...) before swapping it out")
            shared = [host.lookup(replica, d) if (d := table.pool.digest_of(p)) is not None else -1 for p in held]
            plans.append((held, shared))
            need = shared.count(-1)
            pinned = sum(1 for h in shared if h >= 0 and host.refcount[h] == 0)
            if need and need > host.num_available(replica) - pinned:
                raise CacheFullError(
                    f"swap_out({row}) needs {need} host pages{table.label} but the host tier has "
                    f"{host.num_available(replica) - pinned} free or evictable; release or swap in sequences, or "
                    "give the host tier more memory", resource="host pages", needed=need,
                    available=host.num_available(replica) - pinned,
                    replica=replica if groups.num_replicas > 1 else None)
        # Checked: nothing below fails.
        starts, pages = [], []
        for table, (held, shared) in zip(groups, plans):
            host = table.host_pool
            host.share([h for h in shared if h >= 0])  # first: no allocation below may evict them
            fresh = iter(host.allocate(replica, shared.count(-1), overwritten=True))
            out = []
            for page, h in zip(held, shared):
                if h < 0:
                    h = next(fresh)
                    digest = table.pool.digest_of(page)
                    table.offloads[h] = (page, digest, table.pool.tag_of(page) if digest is not None else None)
                    host.share([h])  # the sequence's reference; the offload holds the other
                out.append(h)
            starts.append(int(table.start[row]))
            pages.append(tuple(out))
        groups.release_row(row, int(seqs.npages[row]), stale=stale)
        self.swapped[row] = SwappedSequence(npages=cols, replica=replica, starts=tuple(starts), pages=tuple(pages))
        seqs.npages[row] = 0
        seqs.replica[row] = -1
        self.counters["swap_outs"] += 1

    def swap_in(self, row: int, seqs: SequenceTable, groups: GroupCoordinator) -> None:
        """`PageManager.swap_in` of the claimed ``row``."""
        record = self.swapped.get(row)
        if record is None:
            raise ValueError(f"sequence {row} is not swapped out; swap_in takes a sequence swap_out preempted")
        r = record.replica
        plans = []
        for table, host_pages in zip(groups, record.pages):
            host = table.host_pool
            if any(h in table.offloads for h in host_pages):
                raise ValueError(f"sequence {row}'s swap-out is still pending; call apply_pending(cache, host=...) "
                                 "between swap_out and swap_in")
            found = [table.pool.lookup(r, d) if (d := host.digest_of(h)) is not None else -1 for h in host_pages]
            need = found.count(-1)
            cached = sum(1 for p in found if p >= 0 and table.pool.refcount[p] == 0)
            if need > table.pool.num_available(r) - cached:
                table.raise_full(r, need + cached)
            plans.append(found)
        # Checked: nothing below fails.
        for table, host_pages, found, start in zip(groups, record.pages, plans, record.starts):
            host = table.host_pool
            table.pool.share([p for p in found if p >= 0])
            fresh = iter(table.allocate(r, found.count(-1), overwritten=True))
            row_pages = []
            for h, page in zip(host_pages, found):
                if page < 0:
                    page = next(fresh)
                    table.onloads[page] = h  # the sequence's host reference passes to the onload
                    digest = host.digest_of(h)
                    if digest is not None:
                        table.pool.commit(page, digest, host.tag_of(h))
                else:
                    host.release([h])
                row_pages.append(page)
            table.table[row, start:record.npages] = row_pages
            table.start[row] = start
        seqs.npages[row] = record.npages
        seqs.replica[row] = r if record.npages else -1
        del self.swapped[row]
        self.counters["swap_ins"] += 1

    def release_swapped(self, row: int, groups: GroupCoordinator) -> None:
        """`release` of a swapped-out sequence: its host pages lose its reference."""
        record = self.swapped.pop(row)
        for table, pages in zip(groups, record.pages):
            table.host_pool.release(list(pages)[::-1])

    # ---- prefix hits in the host tier ------------------------------------------------------------
    def attach_hits(self, replica: int, pages: list[list[int]], groups: GroupCoordinator) -> int:
        """Turn the host pages of a lookup's hit (``-2 - h``) into device pages with pending
        onloads, in place; returns how many block-table columns came from the host tier (in
        any group). The caller has shared the device pages of the hit and checked there is room
        (`hit_room`)."""
        moved: set[int] = set()
        for table, group_pages in zip(groups, pages):
            cols = [i for i, p in enumerate(group_pages) if p < PAD_PAGE]
            if not cols:
                continue
            hosts = [-2 - group_pages[i] for i in cols]
            host = table.host_pool
            host.share(hosts)  # pinned until applied: no eviction below takes them
            for i, h, page in zip(cols, hosts, table.allocate(replica, len(cols), overwritten=True)):
                table.onloads[page] = h
                if (digest := host.digest_of(h)) is None:  # a hit's host page is in the host prefix map
                    raise InvariantError(f"host page {h}{table.label} of a prefix hit has no digest")
                table.pool.commit(page, digest, host.tag_of(h))
                group_pages[i] = page
            moved.update(cols)
        return len(moved)

    def hit_room(self, replica: int, pages: list[list[int]], groups: GroupCoordinator) -> bool:
        """Whether every group has device pages for the host part of a hit, once its device part
        (cached pages among them) is shared."""
        for table, group_pages in zip(groups, pages):
            onloads = sum(p < PAD_PAGE for p in group_pages)
            cached = sum(1 for p in group_pages if p >= 0 and table.pool.refcount[p] == 0)
            if onloads and onloads > table.pool.num_available(replica) - cached:
                return False
        return True

    def count_hit(self, columns: int, page_size: int) -> None:
        """A prefix hit brought ``columns`` block-table columns back from the host tier."""
        if columns:
            self.counters["host_hits"] += 1
            self.counters["host_hit_tokens"] += columns * page_size

    # ---- pending transfers ------------------------------------------------------------------------
    def has_pending_transfers(self, groups: Sequence[GroupTable]) -> bool:
        """Offloads or onloads wait (they read or write device pages; see `PageManager.has_pending_transfers`)."""
        return self.enabled and any(table.offloads or table.onloads for table in groups)

    def has_work(self, groups: Sequence[GroupTable]) -> bool:
        """Transfers, or scrubs of released host pages: the work only the tier can do."""
        return self.enabled and any(table.offloads or table.onloads or table.host_pool.has_pending_scrubs()
                                    for table in groups)

    def pending_transfers(self, groups: Sequence[GroupTable]) -> Transfers:
        """`PageManager.pending_transfers`."""
        out = []
        for table in groups:
            off = np.array([[src, dst] for dst, (src, _, _) in table.offloads.items()], np.int32).reshape(-1, 2)
            on = np.array([[src, dst] for dst, src in table.onloads.items()], np.int32).reshape(-1, 2)
            out.append((off[:, 0], off[:, 1], on[:, 0], on[:, 1], table.host_pool.pending_scrubs()))
        return tuple(out)

    def transfers_done(self, groups: Sequence[GroupTable]) -> None:
        """The pending transfers were applied: offloaded prefix pages enter the host prefix map,
        every transfer's host reference is dropped."""
        for table in groups:
            host = table.host_pool
            self.counters["offloaded_pages"] += len(table.offloads)
            self.counters["onloaded_pages"] += len(table.onloads)
            host.take_scrubs()
            for h, (_, digest, tag) in table.offloads.items():
                if digest is not None:
                    host.commit(h, digest, tag)
            host.release(list(table.offloads))
            host.release(list(table.onloads.values()))
            table.offloads.clear()
            table.onloads.clear()

    def metrics(self, groups: Sequence[GroupTable]) -> HostTierMetrics | None:
        if not self.enabled:
            return None
        hosts = [table.host_pool for table in groups]
        return HostTierMetrics(
            total_pages=sum(h.num_pages for h in hosts), free_pages=sum(h.num_free() for h in hosts),
            cached_pages=sum(h.num_cached() for h in hosts), used_pages=sum(h.num_used() for h in hosts),
            swapped_sequences=len(self.swapped), dropped_pages=sum(table.offloads_dropped for table in groups),
            evictions=sum(h.evictions for h in hosts), **self.counters)

    # ---- state and invariants ---------------------------------------------------------------------
    def lockstep_state(self, groups: Sequence[GroupTable]) -> dict[str, Any]:
        """The tier's bookkeeping as JSON (a fingerprint for `assert_lockstep`; nothing reads it back)."""
        return {
            "pools": [table.host_pool.state_dict() for table in groups],
            "swapped": [[row, r.npages, r.replica, list(r.starts), [list(p) for p in r.pages]]
                        for row, r in sorted(self.swapped.items())],
            "offloads": [[[h, src, None if d is None else d.hex()] for h, (src, d, _) in table.offloads.items()]
                         for table in groups],
            "onloads": [[[dst, h] for dst, h in table.onloads.items()] for table in groups],
            "counters": dict(self.counters)}

    def check_group(self, table: GroupTable, lens: np.ndarray) -> None:
        """Raise `Broken` unless ``table``'s host pool agrees with its holders (swapped-out sequences
        and pending transfers), swapped sequences hold what their length (``lens``) needs, and
        transfers stay in a replica and touch pages they may."""
        g, of = table.index, f" in layer group {table.index}" if table.grouped else ""
        host, pool, ps = table.host_pool, table.pool, table.page_size
        holders: list[int] = []
        for row, record in self.swapped.items():
            pages = record.pages[g]
            want = record.npages - record.starts[g]
            if len(pages) != want or record.npages != -(-int(lens[row]) // ps):
                raise Broken(f"sequences[id={row}].swapped", f"swapped-out sequence {row} of length {int(lens[row])} "
                                                             f"holds {len(pages)} host pages{of} for {record.npages} "
                                                             "columns")
            if any(host.replica_of(h) != record.replica for h in pages):
                raise Broken(f"sequences[id={row}].swapped", f"swapped-out sequence {row} holds a host page{of} "
                                                             f"outside replica {record.replica}")
            holders += pages
        for h, (src, _digest, _) in table.offloads.items():
            if host.replica_of(h) != pool.replica_of(src) or host.digest_of(h) is not None:
                raise Broken("host", f"offload {src} -> host page {h}{of} crosses replicas or targets a cached "
                                     "host page")
        for dst, h in table.onloads.items():
            if host.replica_of(h) != pool.replica_of(dst) or (pool.refcount[dst] == 0 and pool.digest_of(dst) is None):
                raise Broken("host", f"onload host page {h} -> {dst}{of} crosses replicas or fills a free page")
            if dst in table.copies or host.digest_of(h) != pool.digest_of(dst) and pool.digest_of(dst) is not None:
                raise Broken("host", f"onload host page {h} -> {dst}{of} disagrees with the device page's copy or "
                                     "digest")
        holders += list(table.offloads) + list(table.onloads.values())
        try:
            host.check(np.bincount(np.asarray(holders, np.int64), minlength=host.num_pages).astype(np.int32))
        except InvariantError as err:
            raise Broken("host", f"host tier{of}: {err.detail}") from None


class _TierKey:
    """A manager's token for binding its `HostTier` (see `HostTierPolicy.check_host`); copying
    makes a new one."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<PageManager tier key {id(self):#x}>"


__all__ = ["HOST_COUNTERS", "HostTierLike", "HostTierMetrics", "HostTierPolicy", "SwappedSequence", "Transfers"]
