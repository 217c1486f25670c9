"""The host-memory tier: a second pool of pages per layer group in host memory, the tier right
below the device pool (a `lower_tier.LowerTier`: the core talks to it through that interface only).

- **Evicted prefixes are kept.** A full prefix page the device pool evicts (LRU) is copied to a
  host page instead of vanishing (an *offload*), unless the host tier holds its digest already;
  the host pool evicts its own least recently used pages when full. `match_prefix` continues
  into the host tier where the device's cached pages end: every page found there gets a fresh
  device page and an *onload* copy, and the hit counts as usual.
- **Preempted sequences are swapped.** `swap_out(seq)` moves a running sequence's written pages
  to host pages it owns there and frees its device pages (its id stays claimed); `swap_in(seq)`
  gives it device pages again and copies its pages back, so it continues as if never preempted.
  A full page whose digest a tier still holds is shared, not copied.

Transfers are pending device work, like copy-on-write copies: the plan's `DeviceWork` carries
them (its `TierWork` named ``"host"``) and the runner applies them (`easykv.tiers.HostTier` holds
the host pages) before the step's writes, all reads before any write: offloads read the device
pages before onloads and copies overwrite them, and onloads read host pages before the offloads of
the same call land. A transfer holds one reference to its host page until applied, so the host
pool never hands that page out meanwhile. With ``scrub_released``, host pages left unreferenced are
zeroed like device pages: their scrubs are pending work (`has_pending_work`: the runner needs the
tier for them), and the runner zeroes the pages the work's own transfers leave unreferenced in the
same call, so nothing of the host tier is pending after it. A host page to scrub is never an
offload's destination: allocating it for one drops its scrub (the offload overwrites all of it).

A `HostTier` serves one manager for its life: the runner attaches it (`attach`) with its token,
binding it to this layer's key, and a tier bound to another manager is refused, so two caches of
one shape cannot write into each other's host pages through a wrong ``host=``.

What the tier does not do: a manager state (and so a checkpoint) does not include it; `state_dict`
refuses while sequences are swapped out or transfers are pending, and leaves the host prefix
cache out (a restored manager starts with an empty host tier, and takes a new `HostTier`: the old
one stays bound to the manager that used it).

This module holds the `HostTierLayer` (who is swapped out, which `HostTier` holds the host pages,
the tier's counters, and one `HostGroupTier` per layer group: its host pool and pending transfers)
and its metrics. The `HostTier` is duck-typed: it never imports ``storage``, ``attention``,
``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from easykv.errors import CacheFullError, InvariantError
from easykv.manager.device_work import HOST_TIER
from easykv.manager.host_group_tier import HostGroupTier
from easykv.manager.lower_tier import DeviceGroup, Evicted, Hit, LowerTier, TierTransfers, TierWork

if TYPE_CHECKING:
    from easykv.manager.coordinator import GroupCoordinator
    from easykv.manager.sequences import SequenceTable

HOST_COUNTERS = ("host_hits", "host_hit_tokens", "offloaded_pages", "onloaded_pages", "swap_outs", "swap_ins")
Transfers: TypeAlias = tuple[tuple[np.ndarray, ...], ...]  # per group: offload src, dst; onload src, dst; host scrubs


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


def require_host(layer: HostTierLayer | None, what: str) -> HostTierLayer:
    """``layer``, the manager's host tier; ValueError naming ``what`` (the call) when it has none."""
    if layer is None:
        raise ValueError(f"{what} needs a host-memory tier, and this manager has none; create the metadata with "
                         "PagedAttentionCacheMetaData.create(..., host_memory_bytes=N) (or host_pages_per_layer=)")
    return layer


class HostTierLayer(LowerTier):
    """The host-memory tier of one manager (see the module doc), below its device pools.

    Owns ``parts`` (one `HostGroupTier` per layer group: its host pool and pending transfers),
    ``swapped`` (row -> `SwappedSequence` of every swapped-out sequence), ``tier_token`` (the token
    of the `HostTier` holding this manager's host pages: the tier itself stays with the runner),
    ``tier_key`` (what a `HostTier` is bound to) and ``counters`` (`HOST_COUNTERS`). Every method
    that touches device pages is handed the groups.

    Args:
      groups: the manager's layer groups (their device pools).
      host_pages: the host pages of each group.
    """

    name = HOST_TIER

    def __init__(self, groups: Sequence[DeviceGroup], host_pages: Sequence[int]):
        self.parts = tuple(HostGroupTier.fresh(table.index, table.grouped, n, table.pool)
                           for table, n in zip(groups, host_pages, strict=True))
        self.page_size = groups[0].page_size
        self.swapped: dict[int, SwappedSequence] = {}
        self.counters = dict.fromkeys(HOST_COUNTERS, 0)
        self.tier_token: object | None = None
        # This object, not the manager, is what a HostTier is bound to, so a clone (deep copy) or a
        # manager rebuilt from a state gets its own and cannot write into this one's tier.
        self.tier_key = _TierKey()

    # ---- LowerTier: prefix pages -------------------------------------------------------------------
    def lookup(self, group: int, replica: int, digest: bytes) -> int:
        return self.parts[group].pool.lookup(replica, digest)

    def attach_hit(self, replica: int, hits: Sequence[list[Hit]],
                   groups: Sequence[DeviceGroup]) -> tuple[list[int], ...]:
        """Fresh device pages with pending onloads for the host pages of a hit (see `LowerTier`)."""
        out: list[list[int]] = []
        columns: set[int] = set()
        for table, part, group_hits in zip(groups, self.parts, hits, strict=True):
            hosts = [h for _, h in group_hits]
            if not hosts:
                out.append([])
                continue
            if any(part.pool.digest_of(h) is None for h in hosts):  # a hit's host page is in the host prefix map
                raise InvariantError(f"a host page{table.label} of a prefix hit has no digest: {hosts}")
            part.pool.share(hosts)  # pinned until applied: no eviction below takes them
            pages = table.allocate(replica, len(hosts), overwritten=True)
            for h, page in zip(hosts, pages):
                part.onload(page, h)  # enters the device's prefix map under the host page's digest
            out.append(pages)
            columns.update(c for c, _ in group_hits)
        if columns:
            self.counters["host_hits"] += 1
            self.counters["host_hit_tokens"] += len(columns) * self.page_size
        return tuple(out)

    def keep_evicted(self, group: int, evicted: list[Evicted]) -> None:
        self.parts[group].keep_evicted(evicted)

    def forget_prefixes(self) -> int:
        return sum(part.forget_prefixes() for part in self.parts)

    def demote(self, version: bytes | None) -> None:
        for part in self.parts:
            part.pool.demote(version)

    # ---- LowerTier: transfers ------------------------------------------------------------------------
    def pending_into(self, group: int, page: int) -> bool:
        return page in self.parts[group].onloads

    def refill(self, group: int, dst: int, page: int) -> None:
        self.parts[group].refill(dst, page)

    def drop_into(self, group: int, pages: list[int]) -> None:
        self.parts[group].drop_into(pages)

    def moving(self, group: int) -> Collection[int]:
        return self.parts[group].moving()

    def has_transfers(self) -> bool:
        """Offloads or onloads wait (they read or write device pages)."""
        return any(part.has_transfers() for part in self.parts)

    def has_work(self) -> bool:
        """Transfers, or scrubs of released host pages: the work only the tier can do."""
        return any(part.has_work() for part in self.parts)

    def pending_transfers(self) -> Transfers:
        """Per group ``(offload src, offload dst, onload src, onload dst, host scrubs)`` pending."""
        return tuple(part.pending_transfers() for part in self.parts)

    def transfers_done(self) -> None:
        """The pending transfers were applied (`HostGroupTier.transfers_done`), counted."""
        for part in self.parts:
            offloaded, onloaded = part.transfers_done()
            self.counters["offloaded_pages"] += offloaded
            self.counters["onloaded_pages"] += onloaded

    def take_work(self) -> TierWork:
        """The pending transfers and host scrubs, then counted as done: offloaded prefix pages
        enter the host prefix map, and the host pages the transfers leave unreferenced are the
        work's ``scrubs_after``, so nothing of the host tier stays pending."""
        transfers = [part.pending_transfers() for part in self.parts]
        self.transfers_done()
        return TierWork(HOST_TIER, tuple(
            TierTransfers(offload_src=off_src, offload_dst=off_dst, onload_src=on_src, onload_dst=on_dst,
                          scrubs=scrubs, scrubs_after=part.pool.take_scrubs())
            for part, (off_src, off_dst, on_src, on_dst, scrubs) in zip(self.parts, transfers)))

    # ---- LowerTier: checks, metrics, state ----------------------------------------------------------
    def check(self, group: int, table: DeviceGroup, seqs: SequenceTable) -> None:
        """Raise `Broken` unless group ``group``'s host pool agrees with its holders (swapped-out
        sequences and pending transfers), swapped sequences hold what their length needs, and
        transfers stay in a replica and touch pages they may."""
        swapped = [(row, int(seqs.lens[row]), r.npages, r.starts[group], r.replica, r.pages[group])
                   for row, r in self.swapped.items()]
        self.parts[group].check(swapped, table.copies, table.page_size)

    def metrics(self) -> HostTierMetrics:
        hosts = [part.pool for part in self.parts]
        return HostTierMetrics(
            total_pages=sum(h.num_pages for h in hosts), free_pages=sum(h.num_free() for h in hosts),
            cached_pages=sum(h.num_cached() for h in hosts), used_pages=sum(h.num_used() for h in hosts),
            swapped_sequences=len(self.swapped), dropped_pages=sum(part.dropped for part in self.parts),
            evictions=sum(h.evictions for h in hosts), **self.counters)

    def lockstep_state(self) -> dict[str, Any]:
        """The tier's bookkeeping as JSON (a fingerprint for `assert_lockstep`; nothing reads it back)."""
        pools, offloads, onloads = zip(*(part.lockstep_pieces() for part in self.parts))
        return {
            "pools": list(pools),
            "swapped": [[row, r.npages, r.replica, list(r.starts), [list(p) for p in r.pages]]
                        for row, r in sorted(self.swapped.items())],
            "offloads": list(offloads),
            "onloads": list(onloads),
            "counters": dict(self.counters)}

    def set_scrub_released(self, scrub: bool) -> None:
        for part in self.parts:
            part.pool.set_scrub_released(scrub)

    def cached_tags(self) -> Iterable[bytes | None]:
        return [tag for part in self.parts for tag in part.pool.cached_tags()]

    # ---- LowerTier: swapped-out sequences -------------------------------------------------------------
    def holds(self, row: int) -> bool:
        return row in self.swapped

    def held_rows(self) -> Collection[int]:
        return self.swapped.keys()

    def refuse_held(self, rows: int | np.ndarray, what: str) -> None:
        """ValueError when one of ``rows`` is swapped out (``what``: what it may not do then)."""
        if not self.swapped:
            return
        for row in np.atleast_1d(rows).tolist():
            if row in self.swapped:
                raise ValueError(f"sequence {row} is swapped out; swap_in({row}) before {what}")

    def release_held(self, row: int) -> None:
        """`release` of a swapped-out sequence: its host pages lose its reference."""
        record = self.swapped.pop(row)
        for part, pages in zip(self.parts, record.pages):
            part.pool.release(list(pages)[::-1])

    def refuse_state(self) -> None:
        if self.swapped or self.has_transfers():
            what = (f"sequences {sorted(self.swapped)} are swapped out" if self.swapped
                    else "host-tier transfers are pending")
            raise ValueError(f"a manager state does not hold the host-memory tier, and {what}; swap_in (or release) "
                             "them and easykv.apply_pending(manager, cache, host=...) first")

    # ---- a shared prefix store above (`PageManager.adopt_host_prefixes`) --------------------------------
    def adopt(self, groups: GroupCoordinator, replica: int, digests: Sequence[bytes],
              tag: bytes | None) -> tuple[list[int], ...]:
        """Host pages of ``replica`` for the pages of a prefix chain a shared store holds: per group, for the
        longest run ``digests[:k]`` that fits in every group's host pool, a fresh host page entered in the host
        prefix map under its digest and ``tag`` (cached: its data is written by the caller before any work reads
        it), or -1 where the device or host pool of ``replica`` holds that digest already. The host pages of the
        chain the pool holds are kept from eviction while the fresh ones are taken; the chain is released tail
        first, so its tail is evicted before its head."""
        plans = []
        k = len(digests)
        for table, part in zip(groups, self.parts):
            host = part.pool
            held = [host.lookup(replica, d) for d in digests]
            need = np.array([h < 0 and table.pool.lookup(replica, d) < 0 for h, d in zip(held, digests)], bool)
            pinned = sum(1 for h in set(held) if h >= 0 and host.refcount[h] == 0)
            room = host.num_available(replica) - pinned
            k = min(k, int(np.searchsorted(np.cumsum(need), room, side="right")))
            plans.append((held, need))
        # Checked: nothing below fails.
        out = []
        for part, (held, need) in zip(self.parts, plans):
            host = part.pool
            kept = [h for h in held[:k] if h >= 0]
            host.share(kept)  # first: no allocation below may evict them
            fresh = iter(host.allocate(replica, int(need[:k].sum()), overwritten=True))
            pages = [next(fresh) if need[i] else -1 for i in range(k)]
            for page, digest in zip(pages, digests):
                if page >= 0:
                    host.commit(page, digest, tag)
            chain = [p if p >= 0 else h for p, h in zip(pages, held[:k])]
            host.release([p for p in reversed(chain) if p >= 0])
            out.append(pages)
        return tuple(out)

    def watch_evictions(self, on: bool) -> None:
        """Whether the host pages evicted from now on are kept for `take_evicted` (a store writes them back)."""
        for part in self.parts:
            part.pool.set_keep_evicted(on)

    def take_evicted(self) -> tuple[list[tuple[int, bytes, bytes | None]], ...]:
        """Per group, ``(host page, digest, tag)`` of every host page evicted since the last call (while
        `watch_evictions`): their data stay in the `HostTier` until the next work lands there."""
        return tuple(part.pool.take_evicted() for part in self.parts)

    # ---- the HostTier -------------------------------------------------------------------------------
    def forget(self) -> int:
        """`PageManager.forget_host_tier`: the host prefix cache emptied (the pages it held become
        pending host scrubs, for the tier being detached) and no tier attached."""
        if self.swapped or self.has_transfers():
            raise ValueError("sequences are swapped out or host transfers are pending; swap_in and apply the pending "
                             "work (easykv.Runner.apply_pending) first")
        held = sum(part.pool.forget_prefixes() for part in self.parts)
        self.tier_token = None
        return held

    def attach(self, token: object, owner: object | None) -> object:
        """`PageManager.attach_host_tier`."""
        if token is None:
            raise ValueError("attach_host_tier takes the tier's token (easykv.HostTier(cache).token), got None")
        if owner is not None and owner is not self.tier_key:
            raise ValueError("host= is a HostTier bound to another PageManager (the first one that attached it; a "
                             "clone() cannot write into its original's tier): its host pages hold that manager's "
                             "sequences. Use this manager's own tier, or make one for this cache with "
                             "easykv.HostTier(cache)")
        attached = self.tier_token is not None
        if token is not self.tier_token and any(part.holds_data_elsewhere(attached) for part in self.parts):
            raise ValueError("host= is not the HostTier this manager's host pages live in (another tier was attached "
                             "before); use that one, or forget_host_tier() to start an empty tier")
        self.tier_token = token
        return self.tier_key

    # ---- swapping sequences out and in ---------------------------------------------------------------
    def swap_out(self, row: int, seqs: SequenceTable, groups: GroupCoordinator, *, stale: bool) -> None:
        """`PageManager.swap_out` of the claimed, not swapped-out ``row`` (``stale``: it runs
        under an older weight version)."""
        cols = seqs.written_columns(row)
        replica = int(seqs.replica[row])
        plans = []
        for table, part in zip(groups, self.parts):
            host = part.pool
            held = table.held(row, cols)
            for page in held:
                if table.awaits_data(page):
                    raise ValueError(f"sequence {row}'s page {page}{table.label} still waits for a pending copy; "
                                     "call easykv.apply_pending(manager, cache, host=...) before swapping it out")
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
        for table, part, (held, shared) in zip(groups, self.parts, plans):
            host = part.pool
            host.share([h for h in shared if h >= 0])  # first: no allocation below may evict them
            fresh = iter(host.allocate(replica, shared.count(-1), overwritten=True))
            out = []
            for page, h in zip(held, shared):
                if h < 0:
                    h = next(fresh)
                    part.offload(h, page)
                    host.share([h])  # the sequence's reference; the offload holds the other
                out.append(h)
            starts.append(int(table.start[row]))
            pages.append(tuple(out))
        groups.release_row(row, int(seqs.npages[row]), stale=stale)
        self.swapped[row] = SwappedSequence(npages=cols, replica=replica, starts=tuple(starts), pages=tuple(pages))
        seqs.keep_columns(row, 0)
        self.counters["swap_outs"] += 1

    def swap_in(self, row: int, seqs: SequenceTable, groups: GroupCoordinator) -> None:
        """`PageManager.swap_in` of the claimed ``row``."""
        record = self.swapped.get(row)
        if record is None:
            raise ValueError(f"sequence {row} is not swapped out; swap_in takes a sequence swap_out preempted")
        r = record.replica
        plans = []
        for table, part, host_pages in zip(groups, self.parts, record.pages):
            if any(h in part.offloads for h in host_pages):
                raise ValueError(f"sequence {row}'s swap-out is still pending; apply it (runner.apply_pending(), or "
                                 "easykv.apply_pending(manager, cache, host=...)) between swap_out and swap_in")
            found = [table.pool.lookup(r, d) if (d := part.pool.digest_of(h)) is not None else -1 for h in host_pages]
            need = found.count(-1)
            cached = sum(1 for p in found if p >= 0 and table.pool.refcount[p] == 0)
            if need > table.pool.num_available(r) - cached:
                table.raise_full(r, need + cached)
            plans.append(found)
        # Checked: nothing below fails.
        for table, part, host_pages, found, start in zip(groups, self.parts, record.pages, plans, record.starts):
            table.pool.share([p for p in found if p >= 0])
            fresh = iter(table.allocate(r, found.count(-1), overwritten=True))
            row_pages = []
            for h, page in zip(host_pages, found):
                if page < 0:
                    page = next(fresh)
                    part.onload(page, h)  # the sequence's host reference passes to the onload
                else:
                    part.pool.release([h])
                row_pages.append(page)
            table.hold(row, start, row_pages)
        seqs.hold_columns(row, record.npages, r)
        del self.swapped[row]
        self.counters["swap_ins"] += 1


class _TierKey:
    """A manager's token for binding its `HostTier` (see `HostTierLayer.attach`); copying
    makes a new one."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<PageManager tier key {id(self):#x}>"


__all__ = ["HOST_COUNTERS", "HostTierLayer", "HostTierMetrics", "SwappedSequence", "Transfers", "require_host"]
