"""The device work the page manager hands to the cache: host-tier transfers (offloads of
evicted prefix pages and swapped-out sequences, onloads of host hits and swapped-in ones),
copy-on-write copies (after a fork or a truncation) and scrubs of released pages (device and
host pages alike), in the order they must run, before a step's writes.

This module holds `PendingWork`, the plumbing that collects that work from the groups and the
host-tier policy and applies it. The cache and the `HostTier` are duck-typed: it never imports
``storage``, ``attention``, ``checkpoint`` or ``tiers``. It hands them the work unpadded: they pad
every call's page ids to a power-of-two bucket themselves (``easykv.storage.page_work``), the one
place every copy, scrub and transfer goes through, so the programs compiled stay logarithmic in
the pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from easykv.manager.coordinator import PerGroup
from easykv.validation import non_negative_int

if TYPE_CHECKING:
    from easykv.manager.coordinator import GroupCoordinator
    from easykv.manager.group_table import GroupTable
    from easykv.manager.host_tier import HostTierPolicy
    from easykv.spec.metadata import PagedAttentionCacheMetaData

# The fields that say which pool a cache is: a manager schedules exactly one.
POOL_FIELDS = ("page_size", "num_pages_per_layer", "page_shards", "batch_size", "max_sequences",
               "num_pages_per_sequence")


class PendingWork:
    """Copies and scrubs on their way to the device. Owns ``copies``: how many copy-on-write
    copies were recorded since creation (the manager's ``copies`` counter); the pending copies
    and scrubs themselves stay with each group's allocator and pool, where a release drops what
    nobody will read, and the transfers with the host-tier policy's groups."""

    def __init__(self) -> None:
        self.copies = 0

    def load(self, *, copies: int) -> None:
        """The counter of a loaded state."""
        self.copies = copies

    def copy_on_write(self, table: GroupTable, dst: int, src: int) -> None:
        """``dst`` (fresh) gets ``src``'s contents before the next write (`GroupTable.copy_into`)."""
        self.copies += table.copy_into(dst, src)

    def pending_copies(self, groups: GroupCoordinator, pad_to: int | None = None
                       ) -> tuple[PerGroup[np.ndarray], PerGroup[np.ndarray]]:
        """`PageManager.pending_copies`."""
        srcs, dsts = [], []
        for table in groups:
            most, n = table.pool.num_pages, len(table.copies)
            srcs.append(_padded(table.copies.values(), n, pad_to, "copies", most))
            dsts.append(_padded(table.copies.keys(), n, pad_to, "copies", most))
        return tuple(srcs), tuple(dsts)

    def pending_scrubs(self, groups: GroupCoordinator, pad_to: int | None = None) -> PerGroup[np.ndarray]:
        """`PageManager.pending_scrubs`."""
        out = []
        for table in groups:
            pages = table.pool.pending_scrubs()
            out.append(_padded(pages, pages.size, pad_to, "scrubs", table.pool.num_pages))
        return tuple(out)

    def has_pending(self, groups: GroupCoordinator, host: HostTierPolicy) -> bool:
        """`PageManager.has_pending_work`."""
        return host.has_work(groups) or any(table.copies or table.pool.has_pending_scrubs() for table in groups)

    def refuse_transfers(self, what: str, groups: GroupCoordinator, host: HostTierPolicy) -> None:
        # Only offloads and onloads must run before copies and device scrubs; the host scrubs a
        # take_transfers leaves stay pending for the next one and touch no device page.
        if host.has_pending_transfers(groups):
            raise ValueError(f"{what}: host-tier transfers are pending and must run first (an offload reads a page a "
                             "copy or scrub overwrites); call apply_pending(cache, host=...) instead")

    @staticmethod
    def forget_copies(groups: GroupCoordinator) -> None:
        for table in groups:
            table.copies.clear()

    @staticmethod
    def forget_scrubs(groups: GroupCoordinator) -> None:
        for table in groups:
            table.pool.take_scrubs()

    def apply(self, cache: Any, groups: GroupCoordinator) -> tuple[Any, int]:
        """`PageManager.apply_pending` without a `HostTier` (checked: no host-tier work is pending)."""
        src, dst = self.pending_copies(groups)
        copies = sum(a.size for a in src)
        if copies:
            cache = cache.copy_pages(src, dst)
        self.forget_copies(groups)
        scrubs = self.pending_scrubs(groups)
        if sum(a.size for a in scrubs):
            cache = cache.zero_pages(scrubs)
        self.forget_scrubs(groups)
        return cache, copies

    def apply_through(self, cache: Any, host: Any, groups: GroupCoordinator, policy: HostTierPolicy,
                      metadata: PagedAttentionCacheMetaData) -> tuple[Any, int]:
        """`apply_pending` with a `HostTier` that passed `check_host`: every piece of work in one
        call of it (see `easykv.tiers.host` for the order)."""
        if not self.has_pending(groups, policy):
            policy.bind(host)
            return cache, 0  # nothing to run: no program dispatched this step
        copies = tuple(zip(*self.pending_copies(groups)))
        cache = host.apply(cache, policy.pending_transfers(groups), copies=copies,
                           scrubs=self.pending_scrubs(groups), manager_metadata=metadata)
        policy.bind(host)
        policy.transfers_done(groups)  # the tier has taken them (offloads land in its host pages later)
        # The host pages those transfers left unreferenced: the tier has read them (onload
        # sources) or drops their landing (offload destinations), so they are zeroed now and
        # nothing of the host tier stays pending.
        host.scrub(tuple(table.host_pool.take_scrubs() for table in groups))
        copied = sum(len(table.copies) for table in groups)
        self.forget_copies(groups)
        self.forget_scrubs(groups)
        return cache, copied

    @staticmethod
    def check_cache(cache: Any, metadata: PagedAttentionCacheMetaData, what: str) -> PagedAttentionCacheMetaData:
        """`PageManager.check_cache`."""
        # The cache is duck-typed: its metadata (if any) is held to the manager's below.
        meta: PagedAttentionCacheMetaData | None = getattr(cache, "metadata", None)
        if not callable(getattr(cache, "copy_pages", None)) or meta is None:
            raise ValueError(f"{what} must be the PagedAttentionCache this manager schedules, "
                             f"got {type(cache).__name__}")
        diff = [f"{k}: cache {getattr(meta, k, None)}, manager {getattr(metadata, k)}" for k in POOL_FIELDS
                if getattr(meta, k, None) != getattr(metadata, k)]
        groups = getattr(meta, "groups", None)
        pools = [(g.attention, g.window, g.num_pages) for g in groups] if isinstance(groups, tuple) else None
        theirs = [(g.attention, g.window, g.num_pages) for g in metadata.groups]
        if pools != theirs:
            diff.append(f"layer groups (attention, window, pages): cache {pools}, manager {theirs}")
        if diff:
            raise ValueError(f"{what} is a cache of another pool than this manager's (" + "; ".join(diff) + "); pass "
                             "the cache of the metadata the PageManager was created with")
        if any(getattr(leaf, "is_deleted", lambda: False)() for leaf in jax.tree.leaves(cache)):
            raise ValueError(f"{what} holds deleted arrays: it was donated to an earlier call (cache.write, "
                             "import_sequence, apply_pending, sleep, ...); pass the cache that call returned")
        return meta


def _padded(values: Iterable[int], n: int, pad_to: int | None, what: str, most: int) -> np.ndarray:
    """``values`` padded with -1 to ``pad_to`` entries; never more than ``most`` (the pool's
    pages: no more copies or scrubs can be pending), so a huge pad allocates nothing."""
    size = n if pad_to is None else non_negative_int("pad_to", pad_to, hi=most,
                                                     hint=f"at most one entry per page of the pool of {most}")
    if size < n:
        raise ValueError(f"pad_to={pad_to} is below the {n} pending {what}; pass at least {n} (or None)")
    out = np.full(size, -1, np.int32)
    out[:n] = np.fromiter(values, np.int32, n)
    return out


__all__ = ["POOL_FIELDS", "PendingWork"]
