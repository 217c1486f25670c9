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

``_HostTier`` is a mixin of `PageManager` (manager.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from easykv.errors import CacheFullError
from easykv.step.metadata import PAD_PAGE

HOST_COUNTERS = ("host_hits", "host_hit_tokens", "offloaded_pages", "onloaded_pages", "swap_outs", "swap_ins")


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
    back from the host and their tokens (also counted in the manager's ``prefix_hits``)."""

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


class _HostTier:
    """`PageManager`'s host-memory tier and swapping (see the module doc)."""

    def _init_host_tier(self) -> None:
        self._swapped: dict[int, SwappedSequence] = {}
        self._host_counters = dict.fromkeys(HOST_COUNTERS, 0)
        self._tier: Any = None  # the HostTier holding this manager's host pages (set by apply_pending)
        # What a HostTier is bound to: this object, not the manager, so a clone (deep copy) or a
        # manager rebuilt from a state gets its own and cannot write into this one's tier.
        self._tier_key = _TierKey()

    def forget_host_tier(self) -> int:
        """Empty the host tier's prefix cache and detach its `HostTier` (the cache moved to another
        placement, whose new tier holds nothing yet); returns the cached pages forgotten. With
        ``scrub_released`` the pages it leaves (forgotten ones, released ones not zeroed yet) are
        zeroed in the detached tier now; that tier stays bound to this manager (no other manager
        takes it). ValueError while sequences are swapped out or transfers are pending."""
        self._require_host_tier("forget_host_tier")
        if self._swapped or self.has_pending_transfers():
            raise ValueError("sequences are swapped out or host transfers are pending; swap_in and apply_pending first")
        held = sum(gt.host.forget_prefixes() for gt in self._groups)
        if self._tier is not None:  # no later apply reaches the detached tier: zero what it keeps now
            self._tier.scrub(tuple(gt.host.take_scrubs() for gt in self._groups))
        self._tier = None
        return held

    def check_host(self, cache: Any, host: Any) -> None:
        """ValueError unless ``host`` may carry this manager's host-tier work on ``cache``: None
        while none is pending, else the `easykv.HostTier` of ``cache`` that holds this manager's
        host pages. A tier is bound to the first manager whose `apply_pending` takes it, for
        life: a tier bound to another manager (the original of a `clone` included) is refused,
        and a tier other than the current one is taken only while no host page holds data
        elsewhere (`forget_host_tier` detaches the current one). `apply_pending` and
        `import_sequence` check this before anything changes."""
        if not self.has_host_tier:
            if host is not None:
                raise ValueError("host= was given but this manager has no host-memory tier; leave it out, or create "
                                 "the metadata with a host tier (PagedAttentionCacheMetaData.create(..., "
                                 "host_memory_bytes=N))")
            return
        if host is None:
            if self._has_host_work():
                raise ValueError("host-tier work (transfers, or scrubs of released host pages) is pending; pass the "
                                 "cache's tier: apply_pending(cache, host=tier) with tier = easykv.HostTier(cache)")
            return
        if not all(callable(getattr(host, name, None)) for name in ("apply", "check", "bind", "scrub")):
            raise ValueError(f"host= must be the easykv.HostTier of this cache (tier = easykv.HostTier(cache), made "
                             f"once and passed to every apply_pending), got {type(host).__name__}")
        host.check(cache, self.metadata)
        owner = getattr(host, "owner", None)
        if owner is not None and owner is not self._tier_key:
            raise ValueError("host= is a HostTier bound to another PageManager (the first one whose apply_pending "
                             "took it; a clone() cannot write into its original's tier): its host pages hold that "
                             "manager's sequences. Pass this manager's own tier, or make one for this cache with "
                             "easykv.HostTier(cache)")
        if host is not self._tier and self._host_data_elsewhere():
            raise ValueError("host= is not the HostTier this manager's host pages live in (apply_pending took "
                             "another one, or take_transfers moved them); pass that one, or forget_host_tier() "
                             "to start an empty tier")

    def _host_data_elsewhere(self) -> bool:
        """Whether some host page holds data a newly taken tier would lack: any held page but a
        pending offload's destination (its data comes with the call), or a released page the
        current tier has not zeroed yet."""
        return any(gt.host.num_pages - gt.host.num_free() > len(gt.offloads)
                   or (self._tier is not None and gt.host.has_pending_scrubs()) for gt in self._groups)

    def _bind_tier(self, host: Any) -> None:
        """``host`` passed `check_host`: it holds this manager's host pages from now on."""
        host.bind(self._tier_key)
        self._tier = host

    @property
    def has_host_tier(self) -> bool:
        """Whether this manager keeps evicted prefixes and swapped sequences in host memory."""
        return self._groups[0].host is not None

    def _require_host_tier(self, what: str) -> None:
        if not self.has_host_tier:
            raise ValueError(f"{what} needs a host-memory tier, and this manager has none; create the metadata with "
                             "PagedAttentionCacheMetaData.create(..., host_memory_bytes=N) (or host_pages_per_layer=)")

    # ---- swapping -------------------------------------------------------------------------------
    def is_swapped(self, seq_id: int) -> bool:
        """Whether ``seq_id`` is swapped out (`swap_out`)."""
        return self._row(seq_id) in self._swapped

    @property
    def swapped_ids(self) -> list[int]:
        return sorted(self._swapped)

    def swap_out(self, seq_id: int) -> None:
        """Preempt ``seq_id``: its written pages go to host pages it owns there (pending
        offloads; `apply_pending(cache, host=...)` before the device pages are written again), its
        device pages and pages reserved ahead are released, its id stays claimed. Until `swap_in`,
        nothing may reserve, write, fork or truncate it. CacheFullError when the host tier lacks
        pages for it; ValueError when device work into its pages is still pending; nothing
        changes then."""
        self._require_host_tier("swap_out")
        row = self._row(seq_id)
        self._refuse_swapped(row, "swap_out")
        cols = -(-int(self._lens[row]) // self.page_size)
        replica = int(self._replica[row])
        plans = []
        for gt in self._groups:
            held = gt.table[row, gt.start[row]:cols].tolist()
            for page in held:
                if page in gt.copies or page in gt.onloads:
                    raise ValueError(f"sequence {row}'s page {page}{self._in_group(gt)} still waits for a pending copy; "
                                     "call apply_pending(cache, host=...) before swapping it out")
            shared = [gt.host.lookup(replica, d) if (d := gt.pool.digest_of(p)) is not None else -1 for p in held]
            plans.append((held, shared))
            need = shared.count(-1)
            pinned = sum(1 for h in shared if h >= 0 and gt.host.refcount[h] == 0)
            if need and need > gt.host.num_available(replica) - pinned:
                raise CacheFullError(
                    f"swap_out({row}) needs {need} host pages{self._in_group(gt)} but the host tier has "
                    f"{gt.host.num_available(replica) - pinned} free or evictable; release or swap in sequences, or "
                    "give the host tier more memory", resource="host pages", needed=need,
                    available=gt.host.num_available(replica) - pinned, replica=replica if self._num_replicas > 1 else None)
        # Checked: nothing below fails.
        starts, pages = [], []
        stale = self._is_stale(row)
        for gt, (held, shared) in zip(self._groups, plans):
            host = gt.host
            host.share([h for h in shared if h >= 0])  # first: no allocation below may evict them
            fresh = iter(host.allocate(replica, shared.count(-1), overwritten=True))
            out = []
            for page, h in zip(held, shared):
                if h < 0:
                    h = next(fresh)
                    digest = gt.pool.digest_of(page)
                    gt.offloads[h] = (page, digest, gt.pool.tag_of(page) if digest is not None else None)
                    host.share([h])  # the sequence's reference; the offload holds the other
                out.append(h)
            starts.append(int(gt.start[row]))
            pages.append(tuple(out))
            gt.release_pages(gt.held(row, int(self._npages[row]))[::-1], stale=stale)
            gt.reset_row(row)
        self._swapped[row] = SwappedSequence(npages=cols, replica=replica, starts=tuple(starts), pages=tuple(pages))
        self._npages[row] = 0
        self._replica[row] = -1
        self._host_counters["swap_outs"] += 1

    def swap_in(self, seq_id: int) -> None:
        """Give the swapped-out ``seq_id`` device pages again in its replica: a page whose
        digest the device's prefix cache holds is shared, every other one gets a fresh page and
        a pending onload (`apply_pending(cache, host=...)` before the next step's writes).
        CacheFullError when the device pool lacks pages (nothing changes; it stays swapped
        out); ValueError when it is not swapped out or its swap-out was not applied yet."""
        row = self._row(seq_id)
        record = self._swapped.get(row)
        if record is None:
            raise ValueError(f"sequence {row} is not swapped out; swap_in takes a sequence swap_out preempted")
        r = record.replica
        plans = []
        for gt, host_pages in zip(self._groups, record.pages):
            if any(h in gt.offloads for h in host_pages):
                raise ValueError(f"sequence {row}'s swap-out is still pending; call apply_pending(cache, host=...) "
                                 "between swap_out and swap_in")
            found = [gt.pool.lookup(r, d) if (d := gt.host.digest_of(h)) is not None else -1 for h in host_pages]
            need = found.count(-1)
            cached = sum(1 for p in found if p >= 0 and gt.pool.refcount[p] == 0)
            if need > gt.pool.num_available(r) - cached:
                self._raise_full(gt, r, need + cached)
            plans.append(found)
        # Checked: nothing below fails.
        for gt, host_pages, found, start in zip(self._groups, record.pages, plans, record.starts):
            gt.pool.share([p for p in found if p >= 0])
            fresh = iter(gt.allocate(r, found.count(-1), overwritten=True))
            row_pages = []
            for h, page in zip(host_pages, found):
                if page < 0:
                    page = next(fresh)
                    gt.onloads[page] = h  # the sequence's host reference passes to the onload
                    digest = gt.host.digest_of(h)
                    if digest is not None:
                        gt.pool.commit(page, digest, gt.host.tag_of(h))
                else:
                    gt.host.release([h])
                row_pages.append(page)
            gt.table[row, start:record.npages] = row_pages
            gt.start[row] = start
        self._npages[row] = record.npages
        self._replica[row] = r if record.npages else -1
        del self._swapped[row]
        self._host_counters["swap_ins"] += 1

    def _release_swapped(self, row: int) -> None:
        """`release` of a swapped-out sequence: its host pages lose its reference."""
        record = self._swapped.pop(row)
        for gt, pages in zip(self._groups, record.pages):
            gt.host.release(list(pages)[::-1])

    def _refuse_swapped(self, rows: Any, what: str) -> None:
        if not self._swapped:
            return
        for row in np.atleast_1d(rows).tolist():
            if row in self._swapped:
                raise ValueError(f"sequence {row} is swapped out; swap_in({row}) before {what}")

    # ---- prefix hits in the host tier ------------------------------------------------------------
    def _attach_host_hits(self, row: int, replica: int, pages: list[list[int]]) -> int:
        """Turn the host pages of a lookup's hit (``-2 - h``) into device pages with pending
        onloads, in place; returns how many block-table columns came from the host tier (in
        any group). The caller has shared the device pages of the hit and checked there is room
        (`_host_hit_room`)."""
        moved: set[int] = set()
        for gt, group_pages in zip(self._groups, pages):
            cols = [i for i, p in enumerate(group_pages) if p < PAD_PAGE]
            if not cols:
                continue
            hosts = [-2 - group_pages[i] for i in cols]
            gt.host.share(hosts)  # pinned until applied: no eviction below takes them
            for i, h, page in zip(cols, hosts, gt.allocate(replica, len(cols), overwritten=True)):
                gt.onloads[page] = h
                gt.pool.commit(page, gt.host.digest_of(h), gt.host.tag_of(h))
                group_pages[i] = page
            moved.update(cols)
        return len(moved)

    def _host_hit_room(self, replica: int, pages: list[list[int]]) -> bool:
        """Whether every group has device pages for the host part of a hit, once its device part
        (cached pages among them) is shared."""
        for gt, group_pages in zip(self._groups, pages):
            onloads = sum(p < PAD_PAGE for p in group_pages)
            cached = sum(1 for p in group_pages if p >= 0 and gt.pool.refcount[p] == 0)
            if onloads and onloads > gt.pool.num_available(replica) - cached:
                return False
        return True

    # ---- pending transfers ------------------------------------------------------------------------
    def has_pending_transfers(self) -> bool:
        """Whether offloads or onloads wait for `apply_pending(cache, host=...)` (or
        `take_transfers`): the host-tier work that reads or writes device pages, and holds pages
        a manager state cannot (scrubs of released host pages touch neither: see
        `has_pending_work`)."""
        return self.has_host_tier and any(gt.offloads or gt.onloads for gt in self._groups)

    def _has_host_work(self) -> bool:
        """Transfers, or scrubs of released host pages: the work only the tier can do."""
        return self.has_host_tier and any(gt.offloads or gt.onloads or gt.host.has_pending_scrubs()
                                          for gt in self._groups)

    def pending_transfers(self) -> tuple[tuple[np.ndarray, ...], ...]:
        """Per layer group, ``(offload_src, offload_dst, onload_src, onload_dst, host_scrubs)``
        int32 page ids: device pages to copy to host pages, host pages to copy to device pages,
        and released host pages to zero (``scrub_released``)."""
        out = []
        for gt in self._groups:
            off = np.array([[src, dst] for dst, (src, _, _) in gt.offloads.items()], np.int32).reshape(-1, 2)
            on = np.array([[src, dst] for dst, src in gt.onloads.items()], np.int32).reshape(-1, 2)
            out.append((off[:, 0], off[:, 1], on[:, 0], on[:, 1], gt.host.pending_scrubs()))
        return tuple(out)

    def take_transfers(self) -> tuple[tuple[np.ndarray, ...], ...]:
        """`pending_transfers`, then count them as done (offloaded prefix pages enter the host
        prefix map): for an engine that moves the pages itself, first thing before the copies
        and scrubs (`apply_pending` does all of it with a `HostTier`). All reads before any write:
        offload sources and onload sources are read before any destination is written, and host
        scrubs land before the offloads. Host pages these transfers leave unreferenced are the
        next call's host scrubs (`has_pending_work` says so meanwhile)."""
        self._require_host_tier("take_transfers")
        out = self.pending_transfers()
        self._transfers_done()
        return out

    def _transfers_done(self) -> None:
        """The pending transfers were applied: offloaded prefix pages enter the host prefix map,
        every transfer's host reference is dropped."""
        for gt in self._groups:
            host = gt.host
            self._host_counters["offloaded_pages"] += len(gt.offloads)
            self._host_counters["onloaded_pages"] += len(gt.onloads)
            host.take_scrubs()
            for h, (_, digest, tag) in gt.offloads.items():
                if digest is not None:
                    host.commit(h, digest, tag)
            host.release(list(gt.offloads))
            host.release(list(gt.onloads.values()))
            gt.offloads.clear()
            gt.onloads.clear()

    def _host_metrics(self) -> HostTierMetrics | None:
        if not self.has_host_tier:
            return None
        hosts = [gt.host for gt in self._groups]
        return HostTierMetrics(
            total_pages=sum(h.num_pages for h in hosts), free_pages=sum(h.num_free() for h in hosts),
            cached_pages=sum(h.num_cached() for h in hosts), used_pages=sum(h.num_used() for h in hosts),
            swapped_sequences=len(self._swapped), dropped_pages=sum(gt.offloads_dropped for gt in self._groups),
            evictions=sum(h.evictions for h in hosts), **self._host_counters)


class _TierKey:
    """A manager's token for binding its `HostTier` (see `_HostTier.check_host`); copying makes
    a new one."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<PageManager tier key {id(self):#x}>"


__all__ = ["HOST_COUNTERS", "HostTierMetrics", "SwappedSequence"]
