"""The device work a step implies, as one value: copy-on-write copies (after a fork or a
truncation), scrubs of released pages, and the work of each tier below the device pool (the
host-memory tier's offloads of evicted prefix pages and swapped-out sequences, its onloads of
host hits and swapped-in ones, its host scrubs; a third tier's likewise).

The manager records that work where it arises, in the parts that own the pages (each group's
``copies``, its pool's scrubs, each lower tier's transfers), so a release can still drop what
nobody will read. `take_work` hands all of it over at once as a frozen `DeviceWork` and forgets it:
`PageManager.schedule` puts it in the step's plan, and the runner (`easykv.runner`) applies it to
the cache, in the order the bookkeeping relies on, before the step's writes. The manager never sees
the cache or the tier: this module holds page ids, not arrays. Each lower tier hands its share as a
`TierWork` (`lower_tier.LowerTier.take_work`), one `TierTransfers` per group.

Imports the manager's ``coordinator`` and ``lower_tier`` (its value types); never ``storage``,
``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import numpy as np

from easykv.manager.coordinator import PerGroup
from easykv.manager.lower_tier import NO_PAGES, TierTransfers, TierWork, page_ids

if TYPE_CHECKING:
    from easykv.manager.coordinator import GroupCoordinator
    from easykv.manager.tier_set import LowerTiers


def _no_pages() -> np.ndarray:
    """A field defaulting to no pages (one shared read-only array)."""
    return dataclasses.field(default_factory=lambda: NO_PAGES)  # a dataclass field


@dataclasses.dataclass(frozen=True)
class GroupWork:
    """One layer group's device work, int32 page ids of the group's device pool (read-only arrays).

    Attributes:
      copy_src: ``(copies,)`` device pages each copy reads.
      copy_dst: ``(copies,)`` fresh device pages that get ``copy_src``'s contents.
      scrubs: ``(scrubs,)`` released device pages to zero.
    """

    copy_src: np.ndarray = _no_pages()
    copy_dst: np.ndarray = _no_pages()
    scrubs: np.ndarray = _no_pages()

    @property
    def empty(self) -> bool:
        return not (self.copy_src.size or self.scrubs.size)


HOST_TIER = "host"  # the name of the host-memory tier's work, the one `DeviceWork.transfers` gives
_NO_TRANSFERS = TierTransfers()


@dataclasses.dataclass(frozen=True)
class DeviceWork:
    """Every piece of device work a plan carries, to run before the step's writes: each lower
    tier's transfers (every tier's offloads read the device before any onload, copy or scrub
    writes it), then the copy-on-write copies, then the scrubs.

    Attributes:
      groups: one `GroupWork` per layer group (copies and scrubs of the device pools).
      tiers: one `TierWork` per lower tier of the manager that has work, nearest the device first
        (the host-memory tier's is named ``"host"``).
    """

    groups: PerGroup[GroupWork]
    tiers: tuple[TierWork, ...] = ()

    @classmethod
    def none(cls, num_groups: int) -> DeviceWork:
        """No work.

        Args:
          num_groups: the layer groups (one empty `GroupWork` each).
        """
        return cls(tuple(GroupWork() for _ in range(num_groups)))

    @property
    def empty(self) -> bool:
        """Whether there is nothing to run."""
        return all(g.empty for g in self.groups) and all(t.empty for t in self.tiers)

    @property
    def num_copies(self) -> int:
        """Device pages copied (copy-on-write), over every group."""
        return sum(int(g.copy_src.size) for g in self.groups)

    @property
    def has_host_work(self) -> bool:
        """Whether a tier below the device must run part of it (transfers or scrubs of a tier): the
        runner needs the tier then."""
        return any(not t.empty for t in self.tiers)

    @property
    def has_transfers(self) -> bool:
        """Whether offloads or onloads of any tier are part of it."""
        return any(t.has_transfers for t in self.tiers)

    def tier(self, name: str) -> TierWork | None:
        """The work of the lower tier named ``name`` (None: it has none here).

        Args:
          name: the tier's name (``"host"``: the host-memory tier's).
        """
        return next((t for t in self.tiers if t.name == name), None)

    def copies(self) -> tuple[PerGroup[np.ndarray], PerGroup[np.ndarray]]:
        """``(src, dst)``, each a tuple of one ``(copies,)`` array per group (``cache.copy_pages``'s form)."""
        return tuple(g.copy_src for g in self.groups), tuple(g.copy_dst for g in self.groups)

    def scrubs(self) -> PerGroup[np.ndarray]:
        """One ``(scrubs,)`` array of device pages per group (``cache.zero_pages``' form)."""
        return tuple(g.scrubs for g in self.groups)

    def written_pages(self, group: int) -> np.ndarray:
        """The device pages this work writes (copy destinations, scrubs, every tier's onload
        destinations): what they hold is not theirs until the work has run.

        Args:
          group: the layer group, ``0 .. len(groups) - 1``.
        """
        return np.concatenate([self.groups[group].copy_dst, self.groups[group].scrubs,
                               *(tier.groups[group].onload_dst for tier in self.tiers)])

    def _host_groups(self) -> PerGroup[TierTransfers]:
        host = self.tier(HOST_TIER)
        return host.groups if host is not None else tuple(_NO_TRANSFERS for _ in self.groups)

    def transfers(self) -> PerGroup[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """The host-memory tier's work, per group ``(offload_src, offload_dst, onload_src, onload_dst, host_scrubs)``
        (`HostTier.apply`'s form; empty arrays where it has none)."""
        return tuple(g.as_tuple() for g in self._host_groups())

    def host_scrubs_after(self) -> PerGroup[np.ndarray]:
        """One array of host pages per group to zero after the transfers (`HostTier.scrub`'s form)."""
        return tuple(g.scrubs_after for g in self._host_groups())

    def __repr__(self) -> str:
        if self.empty:
            return "DeviceWork(none)"
        parts = {"copies": self.num_copies, "scrubs": sum(g.scrubs.size for g in self.groups)}
        for tier in self.tiers:
            parts[f"{tier.name} offloads"] = sum(g.offload_src.size for g in tier.groups)
            parts[f"{tier.name} onloads"] = sum(g.onload_src.size for g in tier.groups)
            parts[f"{tier.name} scrubs"] = sum(g.scrubs.size + g.scrubs_after.size for g in tier.groups)
        return "DeviceWork(" + ", ".join(f"{v} {k}" for k, v in parts.items() if v) + ")"


def has_pending(groups: GroupCoordinator, tiers: LowerTiers) -> bool:
    """Whether `take_work` would hand over anything."""
    return (bool(tiers) and tiers.has_work()) or any(table.copies or table.pool.has_pending_scrubs()
                                                     for table in groups)


def take_work(groups: GroupCoordinator, tiers: LowerTiers) -> DeviceWork:
    """Every piece of pending device work as one `DeviceWork`, then forgotten: each group's copies
    and scrubs, and each lower tier's work, counted as done by the tier (`LowerTier.take_work`)."""
    if not has_pending(groups, tiers):
        return _no_work(len(groups))  # the common decode step: nothing to copy, scrub or move
    tier_work = tuple(work for work in tiers.take_work() if not work.empty)
    out = []
    for table in groups:
        copies = table.take_copies()
        out.append(GroupWork(copy_src=page_ids(list(copies.values())), copy_dst=page_ids(list(copies.keys())),
                             scrubs=page_ids(table.pool.take_scrubs())))
    return DeviceWork(tuple(out), tier_work)


@functools.cache
def _no_work(num_groups: int) -> DeviceWork:
    """The one `DeviceWork` of no work for ``num_groups`` groups (frozen: shared by every plan)."""
    return DeviceWork.none(num_groups)


class CopyCounter:
    """How many copy-on-write copies were recorded since creation (the manager's ``copies``
    counter, persisted in its state). Owns ``copies``; the pending copies themselves stay with each
    group's allocator, where a release drops what nobody will read."""

    def __init__(self) -> None:
        self.copies = 0

    def load(self, *, copies: int) -> None:
        """The counter of a loaded state."""
        self.copies = copies

    def count(self, copies: int) -> None:
        """``copies`` more copy-on-write copies were recorded (`GroupTable.copy_on_write`)."""
        self.copies += copies


__all__ = ["HOST_TIER", "CopyCounter", "DeviceWork", "GroupWork", "has_pending", "take_work"]
