"""A manager's lower tiers together (`LowerTiers`, nearest the device first) and how a manager
builds them (`build_tiers`): every rule that spans the tiers (the hit code, what an eviction hands
down, which tier a pending transfer belongs to, their state and metrics) is written here once;
what one tier must do is `lower_tier.LowerTier`'s contract.

Imports the manager's ``lower_tier`` only; never ``storage``, ``attention``, ``checkpoint`` or
``tiers``.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from easykv.errors import InvariantError
from easykv.manager.lower_tier import DeviceGroup, Evicted, Hit, LowerTier, TierWork
from easykv.step.metadata import PAD_PAGE

if TYPE_CHECKING:
    from easykv.manager.sequences import SequenceTable


class LowerTiers(tuple[LowerTier, ...]):
    """A manager's lower tiers, nearest the device first, and how the core asks them: each rule
    that spans them (the hit code, what an eviction hands down, which tier a pending transfer
    belongs to) is written here once. Empty (falsy) without tiers, so the core's hot paths test it
    once."""

    def __new__(cls, tiers: Iterable[LowerTier] = ()) -> Self:
        """The tiers, as a tuple.

        Args:
          tiers: the tiers, nearest the device first (`build_tiers` checks them).
        """
        return super().__new__(cls, tiers)

    # ---- the hit code -------------------------------------------------------------------------------
    def hit_code(self, tier: int, page: int) -> int:
        """Tier ``tier``'s page ``page`` as an entry of a lookup's answer, among device pages.

        Args:
          tier: the tier's place, ``0 <= tier < len(self)``.
          page: the tier's page, ``>= 0``.

        Returns:
          ``-2 - (page * len(self) + tier)``: below ``PAD_PAGE`` (-1), so no device page or hole.
        """
        return -2 - (page * len(self) + tier)

    def split_code(self, code: int) -> tuple[int, int]:
        """The tier and page a hit code names (`hit_code` undone).

        Args:
          code: a hit code, ``code < PAD_PAGE``.

        Returns:
          ``(tier, page)``.
        """
        tier_page, tier = divmod(-2 - code, len(self))
        return tier, tier_page

    def lookup(self, group: int, replica: int, digest: bytes) -> int:
        """Ask each tier, nearest first (`LowerTier.lookup`).

        Args:
          group: the layer group.
          replica: the data-parallel replica whose prefix map is asked.
          digest: the chained digest of the page sought.

        Returns:
          the hit code (`hit_code`) of the nearest tier holding ``digest``, or -1.
        """
        for t, tier in enumerate(self):
            page = tier.lookup(group, replica, digest)
            if page >= 0:
                return self.hit_code(t, page)
        return -1

    def attach_hit(self, replica: int, pages: list[list[int]], groups: Sequence[DeviceGroup]) -> None:
        """Replace, in place, the hit codes of a lookup's answer by fresh device pages with pending
        onloads, tier by tier, nearest first (`LowerTier.attach_hit`; the caller checked the room).

        Args:
          replica: the data-parallel replica the answer was looked up in.
          pages: per layer group, the answer's block-table row: device pages, holes
            (``PAD_PAGE``) and hit codes; changed in place to hold device pages and holes only.
          groups: the manager's layer groups, one per entry of ``pages``.

        Raises:
          InvariantError: a tier gave a group another number of pages than its hits there.
        """
        for t, tier in enumerate(self):
            hits = [self._hits_of(t, group_pages) for group_pages in pages]
            if not any(hits):
                continue
            fresh = tier.attach_hit(replica, hits, groups)
            for group_pages, group_hits, group_fresh in zip(pages, hits, fresh, strict=True):
                if len(group_fresh) != len(group_hits):
                    raise InvariantError(f"the {tier.name} tier gave {len(group_fresh)} device pages for a hit of "
                                         f"{len(group_hits)}")
                for (i, _), page in zip(group_hits, group_fresh):
                    group_pages[i] = page

    def _hits_of(self, tier: int, group_pages: list[int]) -> list[Hit]:
        """``(column, page)`` of tier ``tier``'s pages among one group's answer, in column order."""
        out = []
        for column, code in enumerate(group_pages):
            if code < PAD_PAGE:
                owner, page = self.split_code(code)
                if owner == tier:
                    out.append((column, page))
        return out

    # ---- evictions and transfers into device pages ---------------------------------------------------
    def evicted(self, group: int, evicted: list[Evicted]) -> None:
        """The device pool of ``group`` evicted these prefix pages, in this order: a page whose
        data a tier still owes it drops that transfer (it never held the prefix); each run of the
        others is offered to every tier (`LowerTier.keep_evicted`). In order, so a tier's own
        pages freed by a drop are free for the pages kept after it, not before.

        Args:
          group: the layer group.
          evicted: ``(device page, digest, tag)`` per evicted page, in eviction order
            (`PagePool.take_evicted`); may be empty.
        """
        run: list[Evicted] = []
        for entry in evicted:
            owing = [tier for tier in self if tier.pending_into(group, entry[0])]
            if not owing:
                run.append(entry)
                continue
            self._keep(group, run)
            run = []
            for tier in owing:
                tier.drop_into(group, [entry[0]])
        self._keep(group, run)

    def _keep(self, group: int, run: list[Evicted]) -> None:
        if run:
            for tier in self:
                tier.keep_evicted(group, run)

    def awaits(self, group: int, page: int) -> bool:
        """Whether device ``page``'s data is still to come from a tier (`LowerTier.pending_into`).

        Args:
          group: the layer group.
          page: a device page of the group.
        """
        return any(tier.pending_into(group, page) for tier in self)

    def refill(self, group: int, dst: int, page: int) -> bool:
        """``dst`` gets what a tier still owes ``page`` (`LowerTier.refill`).

        Args:
          group: the layer group.
          dst: a fresh device page of ``page``'s replica, a copy-on-write's destination.
          page: the device page copied.

        Returns:
          whether a tier owed ``page`` its data (False: nothing was recorded).
        """
        for tier in self:
            if tier.pending_into(group, page):
                tier.refill(group, dst, page)
                return True
        return False

    def drop_into(self, group: int, pages: list[int]) -> None:
        """These device pages became free: every tier drops its transfers into them.

        Args:
          group: the layer group.
          pages: device pages a release left with no reference and no digest, in any order.
        """
        for tier in self:
            tier.drop_into(group, pages)

    def moving(self, group: int) -> dict[int, str]:
        """The device pages pending transfers read or write (`LowerTier.moving`).

        Args:
          group: the layer group.

        Returns:
          device page -> the name of the tier whose transfer touches it (the nearest such tier).
        """
        return {page: tier.name for tier in reversed(self) for page in tier.moving(group)}

    def has_transfers(self) -> bool:
        """Whether a tier's transfer is pending (`LowerTier.has_transfers`)."""
        return any(tier.has_transfers() for tier in self)

    def has_work(self) -> bool:
        """Whether a tier has work to hand over (`LowerTier.has_work`)."""
        return any(tier.has_work() for tier in self)

    def take_work(self) -> tuple[TierWork, ...]:
        """Every tier's work, then counted done by each.

        Returns:
          each tier's `LowerTier.take_work`, nearest first (empty ones included).
        """
        return tuple(tier.take_work() for tier in self)

    # ---- prefixes and versions ------------------------------------------------------------------------
    def forget_prefixes(self) -> int:
        """Every tier forgets its prefixes (`LowerTier.forget_prefixes`; the device's first).

        Returns:
          how many pages the tiers' lookups could find before, together.
        """
        return sum(tier.forget_prefixes() for tier in self)

    def demote(self, version: bytes | None) -> None:
        """Every tier evicts pages of other weight versions first (`LowerTier.demote`).

        Args:
          version: the tag of the current weight version (None: no version).
        """
        for tier in self:
            tier.demote(version)

    def set_scrub_released(self, scrub: bool) -> None:
        """Every tier's `LowerTier.set_scrub_released`.

        Args:
          scrub: whether pages released from now on are zeroed.
        """
        for tier in self:
            tier.set_scrub_released(scrub)

    def cached_tags(self) -> list[bytes | None]:
        """Every tier's `LowerTier.cached_tags`, nearest first.

        Returns:
          the tag of every prefix page the tiers keep.
        """
        return [tag for tier in self for tag in tier.cached_tags()]

    # ---- sequences held below the device ----------------------------------------------------------------
    def holds(self, row: int) -> bool:
        """Whether a tier holds sequence ``row`` off the device (`LowerTier.holds`).

        Args:
          row: a row of the manager's sequence table.
        """
        return any(tier.holds(row) for tier in self)

    def held_mask(self, batch_size: int) -> np.ndarray:
        """The rows a tier holds (their device rows hold nothing).

        Args:
          batch_size: the rows of the manager's sequence table.

        Returns:
          ``(batch_size,)`` bool, True at each row a tier holds.
        """
        mask = np.zeros(batch_size, bool)
        for tier in self:
            mask[list(tier.held_rows())] = True
        return mask

    def refuse_held(self, rows: int | np.ndarray, what: str) -> None:
        """Refuse a call on sequences a tier holds (`LowerTier.refuse_held`).

        Args:
          rows: one row, or an int array of rows, of the manager's sequence table.
          what: the refused call or action, words that follow "before" in the message.

        Raises:
          ValueError: the holding tier's, when one of ``rows`` is held by a tier.
        """
        for tier in self:
            tier.refuse_held(rows, what)

    def release_held(self, row: int) -> None:
        """``row`` is released: the tier holding it (if any) lets its pages go.

        Args:
          row: a row of the manager's sequence table.
        """
        for tier in self:
            if tier.holds(row):
                tier.release_held(row)

    # ---- checks, metrics, state -----------------------------------------------------------------------
    def check(self, group: int, table: DeviceGroup, seqs: SequenceTable) -> None:
        """Every tier's `LowerTier.check` of ``group``.

        Args:
          group: the layer group.
          table: that group's device side.
          seqs: the manager's sequence table.

        Raises:
          Broken: a tier's share of the group disagrees with the device side.
        """
        for tier in self:
            tier.check(group, table, seqs)

    def refuse_state(self) -> None:
        """Every tier's `LowerTier.refuse_state`.

        Raises:
          ValueError: a tier holds what a manager state would lose.
        """
        for tier in self:
            tier.refuse_state()

    def metrics(self) -> tuple[object, ...]:
        """Every tier's `LowerTier.metrics`, nearest first (`PageManagerMetrics.tiers`)."""
        return tuple(tier.metrics() for tier in self)

    def lockstep_state(self) -> dict[str, Any]:
        """Each tier's `LowerTier.lockstep_state` under its name."""
        return {tier.name: tier.lockstep_state() for tier in self}


# every tier a manager was built with, by identity (a tier need not be hashable)
_SERVING: weakref.WeakValueDictionary[int, LowerTier] = weakref.WeakValueDictionary()


def build_tiers(groups: Sequence[DeviceGroup], nearest: LowerTier | None, factories: Any,
                reserved: Collection[str]) -> LowerTiers:
    """The tiers of a manager whose layer groups are ``groups``: ``nearest``, then one tier made by
    each of ``factories``, in order; each registered as serving this manager.

    Args:
      groups: the manager's layer groups (its `GroupCoordinator`), each factory's argument.
      nearest: the host-memory tier (`HostTierLayer`), or None without one; not checked.
      factories: ``PageManager(tiers=...)``: a tuple or list of callables, each taking ``groups``
        and returning a new `LowerTier`.
      reserved: names no made tier may take (a manager state's keys and ``"host"``).

    Returns:
      the tiers, nearest first.

    Raises:
      ValueError: ``factories`` is not a tuple or list of callables, a factory returns no
        `LowerTier` or one another manager was built with, or a tier's name is not an identifier,
        repeats one, or is in ``reserved``.
    """
    if not isinstance(factories, (tuple, list)):
        raise ValueError(f"tiers={factories!r} must be a tuple of tier factories (each called with the manager's "
                         "layer groups, returning a LowerTier); pass () for none")
    for i, factory in enumerate(factories):
        if not callable(factory):
            raise ValueError(f"tiers[{i}]={factory!r} is not callable; pass a factory: a function or class taking the "
                             "manager's layer groups (a sequence of DeviceGroup) and returning a LowerTier")
    made: list[LowerTier] = [] if nearest is None else [nearest]
    for i, factory in enumerate(factories):
        tier = factory(groups)
        if not isinstance(tier, LowerTier):
            raise ValueError(f"tiers[{i}] made a {type(tier).__name__}, not a LowerTier; implement "
                             "easykv.manager.lower_tier.LowerTier")
        name = getattr(tier, "name", None)
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"tiers[{i}] ({type(tier).__name__}) has name={name!r}; give the class a name that "
                             "is an identifier (name = 'store')")
        if _SERVING.get(id(tier)) is tier:
            raise ValueError(f"tiers[{i}] ({type(tier).__name__}) serves another PageManager already; make a new tier "
                             "in the factory (its pages and transfers are that manager's)")
        taken = {t.name for t in made}
        if name in taken or name in reserved:
            raise ValueError(f"tiers[{i}] ({type(tier).__name__}) is named {name!r}, which "
                             f"{'another tier has' if name in taken else 'is reserved'} "
                             f"({sorted(taken | set(reserved))}); give each tier a name of its own")
        made.append(tier)
    _SERVING.update((id(tier), tier) for tier in made)
    return LowerTiers(made)


__all__ = ["LowerTiers", "build_tiers"]
