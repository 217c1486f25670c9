"""The interface of a tier below the device pool (`LowerTier`); how the core asks the tiers a
manager has is `tier_set.LowerTiers`: as SGLang's ``HiRadixCache`` sits on its ``RadixCache``, a lower tier
sits on the device pools and their prefix index, and the core never knows what kind of tier it
talks to.

A lower tier keeps prefix pages the device pool evicts and gives them back on a prefix hit. What
the core asks of it, per layer group and data-parallel replica:

- **Lookups.** `LowerTier.lookup`: the tier's page holding a digest. The coordinator's prefix
  lookup looks in the device pool first, then in each tier, nearest first; a hit in tier ``t``'s
  page ``h`` is the code ``-2 - (h * n + t)`` among the device pages of a lookup's answer (``n``
  tiers; with one tier, ``-2 - h``), `LowerTiers.hit_code` and `LowerTiers.split_code` the one
  place that knows it.
- **Hits.** `LowerTier.attach_hit`: fresh device pages for the tier's part of a hit (from the
  group tables' `allocate`), each with a pending onload from the tier's page and the page's digest
  entered in the device's prefix map; the tier counts the hit.
- **Evictions.** Every prefix page a device pool evicts goes down (`LowerTiers.evicted`): one whose
  own data a tier has not delivered yet is no prefix any more (that transfer is dropped); every
  other is offered to each tier (`LowerTier.keep_evicted`), which keeps it (a pending offload) or
  drops it (counted).
- **Pending transfers into device pages.** A group's table asks, written once in the table: a
  copy-on-write of a page whose data is still coming from a tier gets the same data
  (`pending_into`, `refill`); a page that became free drops what was coming into it
  (`drop_into`); no token is committed into a page a transfer reads or writes (`moving`).
- **Device work.** `take_work` hands the tier's pending transfers over as a `TierWork` of the
  plan's `DeviceWork`, counted as done; `has_work` / `has_transfers` say whether any waits.
- **Prefixes, versions, checks, metrics, lock-step state.** `forget_prefixes`, `demote`,
  `check` (raises `Broken`), `metrics` (a snapshot in `PageManagerMetrics.tiers`),
  `lockstep_state` (the tier's bookkeeping under its `name` in ``state_dict(host_tier=True)``).

A tier may also hold whole sequences off the device (the host tier's swap-out): `holds`,
`held_rows`, `refuse_held`, `release_held`; the default holds none. A manager state never includes
a tier (`refuse_state` refuses a state while the tier holds what it would lose).

The manager builds its tiers when it is made: the host-memory tier first (when the metadata has
one), then each factory of ``PageManager(..., tiers=...)``, called with the manager's layer groups
(its `GroupCoordinator`, a sequence of `DeviceGroup`: `tier_set.build_tiers`). A tier sees the device side
through `DeviceGroup` only, so this module imports neither the group tables nor the coordinator:
they import it. What a tier hands over is a `TierWork` (one `TierTransfers` per group), defined
here with the interface; `device_work.DeviceWork` carries them. Imports of the manager: the page
pool's and the sequence table's types; it never imports ``storage``, ``attention``,
``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np

from easykv.errors import InvariantError

if TYPE_CHECKING:
    from easykv.manager.page_pool import PagePool
    from easykv.manager.sequences import SequenceTable

Evicted: TypeAlias = tuple[int, bytes, bytes | None]  # (device page, digest, weight version) a pool evicted
Hit: TypeAlias = tuple[int, int]  # (block-table column, the tier's page) of a prefix hit

NO_PAGES = np.zeros(0, np.int32)  # no pages: one shared read-only array
NO_PAGES.setflags(write=False)


def page_ids(values: object) -> np.ndarray:
    """Page ids as a read-only 1-d int32 array (`TierTransfers` keeps its fields so).

    Args:
      values: an int, a sequence of ints or an array of any shape, each id in ``0 .. 2**31 - 1``
        (int32: a larger id would wrap).

    Returns:
      ``values`` flattened, a ``(n,)`` int32 read-only copy (an array given stays writable and
        unchanged).
    """
    wide = np.asarray(values, np.int64).reshape(-1)
    if wide.size and (wide.min() < 0 or wide.max() > 2**31 - 1):
        bad = int(wide[(wide < 0) | (wide > 2**31 - 1)][0])
        raise ValueError(f"page id {bad} is outside 0 .. 2**31 - 1; a tier numbers its pages from 0 (int32 ids)")
    out = wide.astype(np.int32)
    out.setflags(write=False)
    return out


def _no_pages() -> np.ndarray:
    """A field defaulting to no pages (`NO_PAGES`)."""
    return dataclasses.field(default_factory=lambda: NO_PAGES)  # a dataclass field


@dataclasses.dataclass(frozen=True)
class TierTransfers:
    """One layer group's share of a lower tier's work (`TierWork`): int32 page ids, device pages of
    the group's pool and pages (or slots) of the tier's own, any sequence of ints given, kept as
    read-only arrays.

    Attributes:
      offload_src: ``(offloads,)`` device pages whose contents go into the tier.
      offload_dst: ``(offloads,)`` the tier's pages they go into.
      onload_src: ``(onloads,)`` the tier's pages whose contents come back to the device.
      onload_dst: ``(onloads,)`` the device pages they fill.
      scrubs: ``(scrubs,)`` released tier pages zeroed before these transfers land.
      scrubs_after: ``(n,)`` tier pages these transfers leave unreferenced (onload sources read,
        offloads whose landing is dropped), zeroed once the transfers have read them.
    """

    offload_src: np.ndarray = _no_pages()
    offload_dst: np.ndarray = _no_pages()
    onload_src: np.ndarray = _no_pages()
    onload_dst: np.ndarray = _no_pages()
    scrubs: np.ndarray = _no_pages()
    scrubs_after: np.ndarray = _no_pages()

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # a tier hands lists or arrays: kept as read-only int32
            value = getattr(self, field.name)
            if value is not NO_PAGES:
                object.__setattr__(self, field.name, page_ids(value))

    @property
    def has_transfers(self) -> bool:
        """Offloads or onloads: work that reads or writes device pages."""
        return bool(self.offload_src.size or self.onload_src.size)

    @property
    def empty(self) -> bool:
        """No transfer and no scrub (the core leaves such a tier's work out of a plan)."""
        return not (self.has_transfers or self.scrubs.size or self.scrubs_after.size)

    def as_tuple(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """This group's share in `HostTier.apply`'s form.

        Returns:
          ``(offload_src, offload_dst, onload_src, onload_dst, scrubs)`` (``scrubs_after`` is
            left out: the runner zeroes those pages apart, after).
        """
        return self.offload_src, self.offload_dst, self.onload_src, self.onload_dst, self.scrubs


@dataclasses.dataclass(frozen=True)
class TierWork:
    """What one lower tier (`lower_tier.LowerTier`) hands over as part of a plan's work: its
    transfers and scrubs, one `TierTransfers` per layer group.

    Attributes:
      name: the tier's name (``"host"``: the host-memory tier, which `easykv.HostTier` applies).
      groups: one `TierTransfers` per layer group.
    """

    name: str
    groups: tuple[TierTransfers, ...]

    @property
    def empty(self) -> bool:
        """No transfer and no scrub in any group."""
        return all(g.empty for g in self.groups)

    @property
    def has_transfers(self) -> bool:
        """An offload or onload in some group: work that reads or writes device pages."""
        return any(g.has_transfers for g in self.groups)


class DeviceGroup(Protocol):
    """What a lower tier uses of one layer group's device side (a `GroupTable` is one): its place
    and page size, its device pool (read; an onloaded page's digest committed through its
    methods), its pending copy-on-write copies (read) and `allocate` (fresh device pages for a hit:
    what the allocation evicts goes down to the tiers as usual)."""

    @property
    def index(self) -> int:
        """The group's place among the manager's layer groups (the ``group`` tiers are asked about)."""

    @property
    def grouped(self) -> bool:
        """Whether the manager has several layer groups (messages then name the group: `label`)."""

    @property
    def page_size(self) -> int:
        """Tokens per page (the same in every group)."""

    @property
    def pool(self) -> PagePool:
        """The group's device pool: pages ``0 .. pool.num_pages - 1`` in ``pool.num_replicas``
        equal slices, its references, prefix map and weight-version tags."""

    @property
    def copies(self) -> dict[int, int]:
        """The pending copy-on-write copies, destination device page -> source device page."""

    @property
    def label(self) -> str:
        """`` of layer group g`` in messages of a manager of several groups, else ``""``."""

    def allocate(self, replica: int, n: int, *, overwritten: bool = False) -> list[int]:
        """Fresh device pages: the free pages of lowest id first, then the least recently released
        cached ones, evicted. What it evicts goes down to the tiers before it returns
        (`LowerTiers.evicted`: to every tier's `LowerTier.keep_evicted`, the calling tier's included).

        Args:
          replica: the data-parallel replica whose slice the pages come from,
            ``0 <= replica < pool.num_replicas``.
          n: how many, ``0 <= n <= pool.num_available(replica)`` (the caller checked: more is an
            `InvariantError`).
          overwritten: the pages will be wholly overwritten by pending device work (an onload, a
            copy), so their pending scrubs are dropped (a scrub runs after onloads and copies and
            would zero what they bring).

        Returns:
          ``n`` device pages of ``replica``, one reference each (the caller's), out of the prefix map.
        """


class LowerTier(abc.ABC):
    """A tier below the device pool (see the module doc): what the core asks of it, each method's
    arguments and answers, is the contract a tier implements. A subclass sets ``name`` and
    implements the abstract methods; the others keep the defaults of a tier that holds no whole
    sequence. Every method taking ``group`` answers for that layer group alone.

    The terms of the arguments:

    - ``group``: a layer group's place, ``0 <= group < len(groups)`` of the groups the tier's
      factory was called with (``groups[group].index == group``).
    - ``replica``: a data-parallel replica, ``0 <= replica < pool.num_replicas`` (``pool``: the
      group's device pool, ``groups[group].pool``).
    - A device page: a page id of that pool, ``0 <= page < pool.num_pages``; replica ``r`` owns
      the slice ``pool.replica_of(page) == r``. A transfer never crosses replicas.
    - A tier page: the tier's own id of where it keeps one page's data, ``0 .. 2**31 - 1`` (int32
      in a `TierTransfers`), numbered per group and unique across its replicas (a transfer names
      no replica); "the tier's page" tells it from a device page.
    - A digest: a page's 32-byte chained sha256 (`prefix_hash`): an equal digest means the same
      tokens up to and including that page, the same salt and the same weight version.
    - A tag: the weight version a prefix page was written under, that version's 32-byte digest
      (None: written before any version was set).

    A tier answers alike on every host given the same calls (lock-step), and changes nothing in
    a query (`lookup`, `pending_into`, `moving`, `has_transfers`, `has_work`, `check`, `metrics`,
    `lockstep_state`, `cached_tags`, `holds`, `held_rows`). `PageManager.clone` deep-copies the
    manager with its tiers: a tier keeps the device side (`DeviceGroup`, its pool) in plain
    attributes, so the copy refers to the clone's.

    Attributes:
      name: a Python identifier (a class attribute, or set in ``__init__``), unique among the
        manager's tiers and none of a manager state's keys nor ``"host"`` (the host-memory
        tier's): it names the tier in messages, its `TierWork` and its key in
        ``state_dict(host_tier=True)``.
    """

    name: str

    # ---- prefix pages ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def lookup(self, group: int, replica: int, digest: bytes) -> int:
        """The tier's page holding ``digest`` for ``replica``, whose data has landed (an offload's
        page enters the lookup when `take_work` hands it over, never before: an onload in the same
        work would read the page before the offload lands). Asked for every page of a prompt, for
        every replica a sequence may take, and by queries that attach nothing
        (`PageManager.cached_prefix_length`): cheap, and changes nothing.

        Args:
          group: the layer group.
          replica: the data-parallel replica whose prefix map is asked.
          digest: the chained digest of the page sought (32 bytes).

        Returns:
          the tier's page (``>= 0``), or -1 when the tier holds no such page for ``replica``.
        """

    @abc.abstractmethod
    def attach_hit(self, replica: int, hits: Sequence[list[Hit]],
                   groups: Sequence[DeviceGroup]) -> tuple[list[int], ...]:
        """Bring the tier's part of a prefix hit back to the device: per group, for each
        ``(column, page)`` of ``hits[g]``, in order, a fresh device page from
        ``groups[g].allocate(replica, len(hits[g]), overwritten=True)`` (the caller checked there
        is room), with a pending onload from the tier's page (`pending_into` and `moving` report
        it; `take_work` hands it over), the tier's page held until then, and the page's digest
        and tag committed to the device's prefix map (``groups[g].pool.commit``). Counts one hit.

        The allocation hands what it evicts to `keep_evicted`, this tier's included: a tier that
        makes room by reusing its own pages holds the hit's pages before allocating. Nearer tiers
        attach their parts first: what their allocations evicted has reached `keep_evicted` by then.

        Args:
          replica: the data-parallel replica of the sequence that takes the hit (every page of
            ``hits`` was found by ``lookup(g, replica, ...)``).
          hits: one list per layer group, ``len(hits) == len(groups)``: the ``(column, page)``
            pairs of the hit's pages this tier holds, in column order (column: the block-table
            column, ``>= 0``; page: the tier's page `lookup` returned); empty for a group where
            the tier has none. At least one list is not empty.
          groups: the manager's layer groups, ``groups[g]`` the device side of group ``g``.

        Returns:
          one list per group: ``len(hits[g])`` fresh device pages of ``replica``, in the order of
            ``hits[g]`` (a different length is an `InvariantError`); the sequence holds them.
        """

    @abc.abstractmethod
    def keep_evicted(self, group: int, evicted: list[Evicted]) -> None:
        """The device pool evicted these prefix pages: keep each (a pending offload from the
        device page into a tier page, which `moving` reports and `take_work` hands over; its
        digest and tag enter `lookup` then) or drop it (counted in `metrics`). A device page's
        contents stay valid until the next work is applied: offloads read their device pages
        before anything writes them, even when the page is reallocated meanwhile. A tier may skip
        a digest it holds or has pending; to make room it may reuse a tier page of its own that
        no pending transfer reads or writes.

        Args:
          group: the layer group whose device pool evicted them.
          evicted: ``(device page, digest, tag)`` per evicted page, in eviction order, never
            empty; the device page's replica is ``pool.replica_of(page)``. No entry is a page
            whose own data a tier still owes (`LowerTiers.evicted` drops that transfer instead).
        """

    @abc.abstractmethod
    def forget_prefixes(self) -> int:
        """Forget every prefix: `lookup` finds nothing afterwards. The device's prefix map was
        emptied just before (its cached pages freed, with no `drop_into`): a pending onload into a
        device page left free (no reference, no digest) is dropped; one into a page a sequence
        holds stays; a pending offload still lands, but enters no lookup.

        Returns:
          how many pages `lookup` could find before (``PageManager.reset_prefix_cache`` adds them
            to the device's count).
        """

    @abc.abstractmethod
    def demote(self, version: bytes | None) -> None:
        """The current weight version changed: the tier's prefix pages of other tags are evicted
        before those of ``version`` (lookups under ``version`` cannot find them: a version's
        digests are its own). A tier that never evicts may do nothing.

        Args:
          version: the tag of the new current weight version (32 bytes; None: no version).
        """

    # ---- transfers into and out of device pages -------------------------------------------------------
    @abc.abstractmethod
    def pending_into(self, group: int, page: int) -> bool:
        """Whether device ``page``'s data is still to come from this tier: a pending onload
        (`attach_hit`, `refill`) not yet handed over by `take_work`. An offload reading the page
        does not count.

        Args:
          group: the layer group.
          page: a device page of the group.
        """

    @abc.abstractmethod
    def refill(self, group: int, dst: int, page: int) -> None:
        """A copy-on-write of a page whose data has not arrived: ``dst`` gets a pending onload of
        its own from the tier page ``page`` waits for, held once more (each onload lets go of it
        when handed over or dropped); ``page`` keeps its onload. No digest is committed for
        ``dst`` (its owner writes into it).

        Args:
          group: the layer group.
          dst: a fresh device page of ``page``'s replica (allocated with ``overwritten=True``,
            one reference), nothing pending into it.
          page: a device page this tier's pending onload fills (`pending_into` is True).
        """

    @abc.abstractmethod
    def drop_into(self, group: int, pages: list[int]) -> None:
        """Nobody will read what a pending onload brings into these device pages: drop each such
        onload and let go of the tier page it held. Pages the tier owes nothing are ignored; an
        offload reading one of them stays (it reads before anything writes the page).

        Args:
          group: the layer group.
          pages: device pages that became free (a release left them with no reference and no
            digest), or one page evicted while its data was still to come from this tier (then
            only the tiers owing it are called); in any order, possibly ones no tier owes.
        """

    @abc.abstractmethod
    def moving(self, group: int) -> Collection[int]:
        """The device pages pending transfers touch: offload sources (read) and onload
        destinations (written). The core refuses to commit tokens into one (ValueError naming the
        tier). Asked at every commit while the manager has tiers: cheap when nothing is pending.

        Args:
          group: the layer group.

        Returns:
          those device pages of ``group``, each once (empty when nothing is pending).
        """

    @abc.abstractmethod
    def has_transfers(self) -> bool:
        """Whether an offload or onload is pending in any group (they read or write device pages;
        the default `refuse_state` refuses then)."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """Whether `take_work` would hand anything over: a transfer, or a scrub of the tier's pages."""

    @abc.abstractmethod
    def take_work(self) -> TierWork:
        """Hand every pending transfer and scrub over, then count it done: nothing is pending
        after (`has_work` is False), offloaded pages with a digest enter `lookup`, and the tier
        pages the transfers held are let go. Called whenever the manager hands its device work over
        (`PageManager.schedule`, `take_work`), also when only another part has work.

        Whoever applies the work, before the step's writes (`easykv.Runner` applies only the host
        tier's), keeps the order the bookkeeping relies on: offloads read their device pages
        first; then copy-on-write copies, onloads (reading tier pages as they were before this
        work's offloads land) and device scrubs; the tier's ``scrubs`` are zeroed before its
        offloads land, its ``scrubs_after`` after.

        Returns:
          ``TierWork(name, groups)``: ``name`` the tier's `name`, ``groups`` one `TierTransfers`
            per layer group in group order (all empty when nothing was pending).
        """

    # ---- checks, metrics, state -----------------------------------------------------------------------
    @abc.abstractmethod
    def check(self, group: int, table: DeviceGroup, seqs: SequenceTable) -> None:
        """Check the tier's share of ``group`` against the device side, changing nothing (run by
        `PageManager.check_invariants`, and on a manager loaded from a state, whose tiers are
        empty): e.g. no onload fills a free device page (no reference, no digest) or a pending
        copy's destination, no transfer crosses replicas, the tier's own references add up.

        Args:
          group: the layer group.
          table: that group's device side (``table.index == group``).
          seqs: the manager's sequence table (each row's length, pages and replica).

        Raises:
          Broken: a rule does not hold; its ``field`` names the tier (e.g. its ``name``), its
            message the pages.
        """

    @abc.abstractmethod
    def metrics(self) -> object:
        """A snapshot of the tier's counts and counters.

        Returns:
          a frozen value (a frozen dataclass, say) later calls do not change:
            `PageManagerMetrics.tiers` holds it at the tier's place, nearest first.
        """

    @abc.abstractmethod
    def lockstep_state(self) -> dict[str, Any]:
        """The tier's bookkeeping, for `assert_lockstep` to compare across hosts (nothing reads it
        back).

        Returns:
          JSON values only (dicts with str keys, lists, str, int, bool, None; bytes as hex), the
            same on every host after the same calls; ``state_dict(host_tier=True)`` holds it under
            the tier's `name`.
        """

    # ---- optional: whole sequences, scrubbing, weight versions --------------------------------------
    def set_scrub_released(self, scrub: bool) -> None:  # noqa: B027 (a tier without pages of its own to zero)
        """Whether the tier's pages released from now on are zeroed, handed over as the
        ``scrubs`` / ``scrubs_after`` of its `TierTransfers` (the manager's ``scrub_released``).
        The default does nothing.

        Args:
          scrub: the flag, set when the manager is made and again when a state is loaded into it.
        """

    def cached_tags(self) -> Iterable[bytes | None]:
        """The weight versions of the tier's prefix pages (`VersionMetrics.host_cached_pages`
        counts them per version).

        Returns:
          the tag of every page `lookup` can find, once each, as the device pool gave it (an
            `Evicted` entry's: `VersionMetrics` counts versions the manager knows). The default: none.
        """
        return ()

    def holds(self, row: int) -> bool:
        """Whether the tier holds sequence ``row`` off the device (swapped out: its device pages
        were released, its id stays claimed). The default: False.

        Args:
          row: a row of the manager's sequence table (``0 <= row < batch_size``).
        """
        return False

    def held_rows(self) -> Collection[int]:
        """The rows of the sequences held here (each one `holds` says).

        Returns:
          those rows, each once. The default: none.
        """
        return ()

    def refuse_held(self, rows: int | np.ndarray, what: str) -> None:  # noqa: B027 (holds no sequence)
        """Refuse a call on sequences held here, before anything changes. The default refuses
        nothing.

        Args:
          rows: one row, or an int array of rows, of the manager's sequence table.
          what: the refused call or action, words that follow "before" in the message
            (``"truncate"``, ``"committing its tokens"``).

        Raises:
          ValueError: one of ``rows`` is held here; the message names it and how to get it back.
        """

    def release_held(self, row: int) -> None:
        """`PageManager.release` of a sequence held here: the tier lets go of its pages, and
        `holds` is False for ``row`` after.

        Args:
          row: a row `holds` says is held here (the core asks first).

        Raises:
          InvariantError: the default, which holds no sequence.
        """
        raise InvariantError(f"the {self.name} tier holds no sequence, and was asked to release sequence {row}")

    def refuse_state(self) -> None:
        """Refuse a manager state (``state_dict()``; a state never includes a tier) while the tier
        holds what it would lose.

        Raises:
          ValueError: transfers are pending (`has_transfers`); the message says to apply the
            pending work first. A tier that holds sequences refuses while it holds any too.
        """
        if self.has_transfers():
            raise ValueError(f"a manager state does not hold the {self.name} tier, and its transfers are pending; "
                             "apply the pending work (easykv.Runner.apply_pending) first")


TierFactory: TypeAlias = Callable[[Sequence[DeviceGroup]], LowerTier]


__all__ = ["NO_PAGES", "DeviceGroup", "Evicted", "Hit", "LowerTier", "TierFactory", "TierTransfers", "TierWork",
           "page_ids"]
