"""The device work the page manager hands to the cache: host-tier transfers (offloads of
evicted prefix pages and swapped-out sequences, onloads of host hits and swapped-in ones),
copy-on-write copies (after a fork or a truncation) and scrubs of released pages (device and
host pages alike), in the order they must run, before a step's writes.

``_DeviceWork`` is a mixin of `PageManager` (manager.py): it reads the manager's group tables
and duck-types the cache (the manager never imports the storage layer).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from easykv.validation import non_negative_int


class _DeviceWork:
    """`PageManager`'s pending copies and scrubs (see the module doc)."""

    def pending_copies(self, pad_to: int | None = None) -> tuple[Any, Any]:
        """(src, dst) int32 page ids the cache must copy, in every layer, before the next write
        (with several layer groups, a tuple of one array per group each); ``pad_to`` pads them
        with -1 (a fixed shape for the jitted copy)."""
        srcs, dsts = [], []
        for gt in self._groups:
            most, n = gt.pool.num_pages, len(gt.copies)
            srcs.append(_padded(gt.copies.values(), n, pad_to, "copies", most))
            dsts.append(_padded(gt.copies.keys(), n, pad_to, "copies", most))
        return self._per_group(srcs), self._per_group(dsts)

    def has_pending_work(self) -> bool:
        """Whether `apply_pending` has anything to run: copy-on-write copies, scrubs of released
        device pages, or host-tier work (transfers, scrubs of released host pages)."""
        return self._has_host_work() or any(gt.copies or gt.pool.has_pending_scrubs() for gt in self._groups)

    def _refuse_transfers(self, what: str) -> None:
        # Only offloads and onloads must run before copies and device scrubs; the host scrubs a
        # take_transfers leaves stay pending for the next one and touch no device page.
        if self.has_pending_transfers():
            raise ValueError(f"{what}: host-tier transfers are pending and must run first (an offload reads a page a "
                             "copy or scrub overwrites); call apply_pending(cache, host=...) instead")

    def take_copies(self, pad_to: int | None = None) -> tuple[Any, Any]:
        """`pending_copies`, then forget them: apply with ``cache.copy_pages(src, dst)`` before the
        step's writes (sources are read before destinations are written)."""
        self._refuse_transfers("take_copies")
        out = self.pending_copies(pad_to)
        for gt in self._groups:
            gt.copies.clear()
        return out

    def pending_scrubs(self, pad_to: int | None = None) -> Any:
        """Released pages to zero (``scrub_released=True``), int32, padded with -1 to ``pad_to``
        (with several layer groups, a tuple of one array per group)."""
        out = []
        for gt in self._groups:
            pages = gt.pool.pending_scrubs()
            out.append(_padded(pages, pages.size, pad_to, "scrubs", gt.pool.num_pages))
        return self._per_group(out)

    def take_scrubs(self, pad_to: int | None = None) -> np.ndarray:
        """`pending_scrubs`, then forget them: apply with ``cache.zero_pages(pages)`` after the
        copies and before the step's writes."""
        self._refuse_transfers("take_scrubs")
        out = self.pending_scrubs(pad_to)
        for gt in self._groups:
            gt.pool.take_scrubs()
        return out

    def apply_pending(self, cache: Any, *, host: Any = None) -> tuple[Any, int]:
        """Apply the pending device work to ``cache`` in the required order: host-tier
        transfers (through ``host``, the `easykv.tiers.HostTier` of this cache; needed while
        any host-tier work is pending), copy-on-write copies, then scrubs of released pages,
        device and host. Call after building a step's metadata, before its writes. Returns the
        updated cache (the one passed in is donated) and the number of pages copied on the device.

        The work is forgotten only once the device has taken it: when ``cache`` is not a live
        cache of this pool (deleted by an earlier donation, another pool), or ``host`` is
        missing, of another cache or bound to another manager (`check_host`), nothing is
        applied and everything stays pending, so a retry with the right arguments still copies
        and scrubs (a lost copy would leave a fork reading whatever its page held before)."""
        self.check_cache(cache, what="apply_pending's cache")  # else nothing is applied: the work stays pending
        self.check_host(cache, host)
        if host is not None:
            return self._apply_through(cache, host)
        src, dst = self.pending_copies()
        copies = sum(a.size for a in self._as_groups(src))
        if copies:
            cache = cache.copy_pages(src, dst)
        for gt in self._groups:
            gt.copies.clear()
        scrubs = self.pending_scrubs()
        if sum(a.size for a in self._as_groups(scrubs)):
            cache = cache.zero_pages(scrubs)
        for gt in self._groups:
            gt.pool.take_scrubs()
        return cache, copies

    def _apply_through(self, cache: Any, host: Any) -> tuple[Any, int]:
        """`apply_pending` with a `HostTier` that passed `check_host`: every piece of work in one
        call of it (see `easykv.tiers.host` for the order)."""
        if not self.has_pending_work():
            self._bind_tier(host)
            return cache, 0  # nothing to run: no program dispatched this step
        copies = tuple(zip(*map(self._as_groups, self.pending_copies())))
        cache = host.apply(cache, self.pending_transfers(), copies=copies,
                           scrubs=self._as_groups(self.pending_scrubs()), manager_metadata=self.metadata)
        self._bind_tier(host)
        self._transfers_done()  # the tier has taken them (offloads land in its host pages later)
        # The host pages those transfers left unreferenced: the tier has read them (onload
        # sources) or drops their landing (offload destinations), so they are zeroed now and
        # nothing of the host tier stays pending.
        host.scrub(tuple(gt.host.take_scrubs() for gt in self._groups))
        copied = sum(len(gt.copies) for gt in self._groups)
        for gt in self._groups:
            gt.copies.clear()
            gt.pool.take_scrubs()
        return cache, copied

    def _as_groups(self, value: Any) -> tuple[Any, ...]:
        return value if len(self._groups) > 1 else (value,)

    # The fields that say which pool a cache is: a manager schedules exactly one.
    _POOL_FIELDS = ("page_size", "num_pages_per_layer", "page_shards", "batch_size", "max_sequences",
                    "num_pages_per_sequence")

    def check_cache(self, cache: Any, *, what: str = "the cache") -> Any:
        """The metadata of ``cache``, once it is a live cache of this manager's pool (the same
        pages, page split, sequences and layer groups, every buffer alive); ValueError naming
        the difference otherwise. ``what`` names the call in the message. (Duck-typed: the
        manager does not import the storage layer.)"""
        meta = getattr(cache, "metadata", None)
        if not callable(getattr(cache, "copy_pages", None)) or meta is None:
            raise ValueError(f"{what} must be the PagedAttentionCache this manager schedules, got {type(cache).__name__}")
        mine = self.metadata
        diff = [f"{k}: cache {getattr(meta, k, None)}, manager {getattr(mine, k)}" for k in self._POOL_FIELDS
                if getattr(meta, k, None) != getattr(mine, k)]
        groups = getattr(meta, "groups", None)
        pools = [(g.attention, g.window, g.num_pages) for g in groups] if isinstance(groups, tuple) else None
        theirs = [(g.attention, g.window, g.num_pages) for g in mine.groups]
        if pools != theirs:
            diff.append(f"layer groups (attention, window, pages): cache {pools}, manager {theirs}")
        if diff:
            raise ValueError(f"{what} is a cache of another pool than this manager's (" + "; ".join(diff) + "); pass "
                             "the cache of the metadata the PageManager was created with")
        if any(getattr(leaf, "is_deleted", lambda: False)() for leaf in jax.tree.leaves(cache)):
            raise ValueError(f"{what} holds deleted arrays: it was donated to an earlier call (cache.write, "
                             "import_sequence, apply_pending, sleep, ...); pass the cache that call returned")
        return meta


def _padded(values: Any, n: int, pad_to: int | None, what: str, most: int) -> np.ndarray:
    """``values`` padded with -1 to ``pad_to`` entries; never more than ``most`` (the pool's
    pages: no more copies or scrubs can be pending), so a huge pad allocates nothing."""
    size = n if pad_to is None else non_negative_int("pad_to", pad_to, hi=most,
                                                     hint=f"at most one entry per page of the pool of {most}")
    if size < n:
        raise ValueError(f"pad_to={pad_to} is below the {n} pending {what}; pass at least {n} (or None)")
    out = np.full(size, -1, np.int32)
    out[:n] = np.fromiter(values, np.int32, n)
    return out


__all__: list[str] = []
