"""One layer group's share of the page manager: its pool, its block table, its pending work; the
base of the per-attention-kind allocators (`allocators`).

Every layer group has its own pool of page ids (its pages have their own size), so the manager
keeps one allocator per group. What a sequence *is* (its length, the columns it has reserved,
its data-parallel replica, its token hashes) is one thing for all groups and lives in the
`SequenceTable`; what a sequence *holds* differs per group, and is this module's:

- ``table[row, col]``: the group's page at block-table column ``col`` (``PAD_PAGE`` where none);
  every group reserves the same columns, so a row holds pages in ``[start[row], npages[row])``.
- ``start[row]``: columns before it were released because they left the group's window (always
  0 in a full-attention group): a sliding group's memory follows its window, not the sequence.
- ``copies``: pending copy-on-write copies of this pool (dst page -> src page).
- ``shared_partial``: partly filled pages of this pool a fork left shared.
- ``tiers``: the manager's tiers below the device pool (`lower_tier.LowerTiers`; none by
  default). The table keeps device pages only: what its pool evicts goes down to them, and where
  its own rules depend on a tier (a copy of a page whose data a tier still owes it, a freed page
  a transfer would fill, a commit into a page a transfer reads or writes) it asks them, here once.

What a query reads (its window) is the group's window rule (`easykv.spec.windows`), asked here;
how a window's pages leave is the per-kind subclasses' (`allocators`). The invariants against the
sequence table are `group_checks`'. Imports of the manager: ``page_pool``, ``lower_tier`` and the
sequence table's type; it never imports ``storage``, ``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Self

import numpy as np

from easykv.errors import CacheFullError
from easykv.manager.page_pool import PagePool
from easykv.manager.tier_set import LowerTiers
from easykv.spec.groups import known_size
from easykv.step.metadata import PAD_PAGE

if TYPE_CHECKING:
    from easykv.manager.sequences import SequenceTable
    from easykv.spec.groups import AttentionKind, LayerGroup
    from easykv.spec.windows import AttentionRule


@dataclasses.dataclass(eq=False)
class GroupTable(abc.ABC):
    """One layer group's pages of every sequence (see the module doc). Owns ``pool``, ``table``,
    ``start``, ``copies``, ``shared_partial`` and ``tiers`` (the tiers below, asked through their
    interface); every change to them is one of its methods. ``index`` is the group's place in the
    metadata, ``grouped`` whether there are several (for messages). A subclass per attention kind
    (`allocators`) says what leaves its window; what a query reads is the group's window rule
    (`rule`)."""

    group: LayerGroup
    page_size: int
    index: int
    grouped: bool
    pool: PagePool
    table: np.ndarray  # (batch_size, pages_per_sequence) int32
    start: np.ndarray  # (batch_size,) int32
    copies: dict[int, int] = dataclasses.field(default_factory=dict)
    shared_partial: set[int] = dataclasses.field(default_factory=set)
    tiers: LowerTiers = dataclasses.field(default_factory=LowerTiers)

    kind: ClassVar[AttentionKind]  # the attention kind of the groups a subclass keeps
    windowed: ClassVar[bool] = False  # whether the group releases pages that left its window

    @classmethod
    def fresh(cls, group: LayerGroup, *, index: int, grouped: bool, page_size: int, batch_size: int,
              pages_per_sequence: int, page_shards: int, scrub_released: bool) -> Self:
        """An empty table of ``group``, which must be of this class's kind (`allocator_for` picks
        the class), with no tier below (`set_tiers`).

        Raises:
          ValueError: ``group`` is of another attention kind.
        """
        if group.attention is not cls.kind:
            raise ValueError(f"{cls.__name__} keeps the pages of a {cls.kind.value} layer group, but layers "
                             f"{group.span} are {group.attention.value}; build a group's table with "
                             "allocator_for(group)")
        pool = PagePool(known_size(group.num_pages), int(page_shards), scrub_released=scrub_released)
        return cls(group=group, page_size=page_size, index=index, grouped=grouped, pool=pool,
                   table=np.full((batch_size, pages_per_sequence), PAD_PAGE, np.int32),
                   start=np.zeros(batch_size, np.int32))

    @property
    def label(self) -> str:
        """`` of layer group g`` in messages of a manager of several groups."""
        return f" of layer group {self.index}" if self.grouped else ""

    def set_tiers(self, tiers: LowerTiers) -> None:
        """The tiers below this group's pool from now on (the manager's, nearest first): the pool
        keeps what it evicts for them (`allocate` hands it down) only when there are any."""
        self.tiers = tiers
        self.pool.set_keep_evicted(bool(tiers))

    # ---- what a query reads: the group's window rule ---------------------------------------------
    @functools.cached_property
    def rule(self) -> AttentionRule:
        """The group's window rule (`LayerGroup.rule`), kept: every commit asks it."""
        return self.group.rule

    def first_needed(self, lens: np.ndarray) -> np.ndarray:
        """Per length, the first position a query at that position or later reads."""
        return self.rule.first_needed_position(lens)

    def released_columns(self, lens: np.ndarray) -> np.ndarray:
        """Per length, the block-table columns (int32) wholly before what the next query reads."""
        return self.rule.released_columns(lens, self.page_size)

    def first_kept_position(self, length: int, floor: int) -> int:
        """The first position of a sequence of ``length`` tokens (resumed at ``floor``) whose
        K/V the group holds and its next query may read."""
        return self.rule.first_kept_position(length, floor)

    @abc.abstractmethod
    def release_out_of_window(self, rows: np.ndarray, lens: np.ndarray, version: list[bytes | None],
                              current: bytes | None) -> np.ndarray:
        """Release the pages of ``rows`` (of lengths ``lens``) no query reads again; returns the
        columns released per row. ``version``: each row's weight version (``current``: the
        current one; older ones' pages are evicted first)."""

    def prefix_hits(self, digests: Sequence[bytes], replica: int, *, tiers: bool) -> tuple[np.ndarray, np.ndarray]:
        """The prefix lookup of this group alone, for the chained page digests of a prompt.

        Returns ``(hits, found)``: ``hits[k - 1]`` says whether this group can serve a hit of the
        first ``k`` pages, i.e. has every page a sequence of ``k`` pages still reads here cached
        (all ``k`` under full attention, the window's under a sliding or chunked one; at least one:
        a chunk boundary alone is no hit); ``found[i]`` is the page holding ``digests[i]`` in
        ``replica`` (-1: none; below ``PAD_PAGE``: a lower tier's page, `LowerTiers.hit_code`,
        looked up only with ``tiers``). `hit_row` turns a hit into its block-table row.

        Args:
          digests: the chained digests of the prompt's full pages, in order.
          replica: the data-parallel replica whose prefix map is read.
          tiers: whether the lower tiers' prefix maps are read too.
        """
        ks = np.arange(1, len(digests) + 1)
        first = self.released_columns(ks * self.page_size).astype(np.int64)  # the first column each hit needs
        find = self.find if tiers else self.pool.lookup
        found = np.array([find(replica, d) for d in digests], np.int64)
        cached = np.concatenate([[0], np.cumsum(found != PAD_PAGE)])
        return (first < ks) & (cached[ks] - cached[first] == ks - first), found

    def hit_row(self, found: np.ndarray, k: int) -> list[int]:
        """The block-table row of a prefix hit of ``k`` pages (``k >= 1``; ``found`` from
        `prefix_hits`): holes (``PAD_PAGE``) where the window needs no page, then the pages found."""
        first = int(self.released_columns(np.array([k * self.page_size]))[0])
        pages: list[int] = found[first:k].tolist()  # numpy types tolist() as Any
        return [PAD_PAGE] * first + pages

    # ---- pages ------------------------------------------------------------------------------------
    def held(self, row: int, npages: int) -> list[int]:
        """The pages ``row`` holds in this group, in column order."""
        pages: list[int] = self.table[row, self.start[row]:npages].tolist()  # numpy types tolist() as Any
        return pages

    def allocate(self, replica: int, n: int, *, overwritten: bool = False) -> list[int]:
        """`PagePool.allocate`, handing the prefix pages it evicts down to the tiers (if any)."""
        pages = self.pool.allocate(replica, n, overwritten=overwritten)
        if self.tiers:
            self.tiers.evicted(self.index, self.pool.take_evicted())
        return pages

    def raise_full(self, replica: int, needed: int) -> None:
        """CacheFullError: ``needed`` pages of ``replica`` are more than the pool can give."""
        pool = self.pool
        split = pool.num_replicas > 1
        raise CacheFullError(
            f"the step needs {needed} page{'s' * (needed != 1)}{self.label}"
            f"{f' in data-parallel replica {replica}' if split else ''} but only "
            f"{pool.num_available(replica)} are free or evictable ({pool.num_used(replica)} in use by running "
            "sequences); release or preempt sequences, or give the cache more pages",
            resource="pages", needed=needed, available=pool.num_available(replica), replica=replica if split else None)

    def copy_into(self, dst: int, page: int) -> bool:
        """A pending copy-on-write of ``page`` into the fresh page ``dst``. A page whose own data is
        still pending (a copy's destination, a tier's transfer's) is filled from where that data
        is: the copy's source (copies run before onloads, so it still holds it) or the tier that owes
        it (`LowerTiers.refill`). Returns whether any work was recorded."""
        if self.tiers and self.tiers.refill(self.index, dst, page):
            return True
        origin = self.copies.get(page, page)
        if origin == dst:  # dst is that origin, freed and taken again: it still holds the data
            return False
        self.copies[dst] = origin
        return True

    def copy_on_write_rows(self, rows: np.ndarray, lens: np.ndarray, new: np.ndarray) -> list[int]:
        """Indices of ``rows`` that write into a partly filled page another sequence shares.
        Processed in batch order, the last writer of a page keeps the original. Only forks share
        partly filled pages, so without live forks this costs nothing."""
        live = self.shared_partial
        if live:
            live.difference_update([p for p in live if self.pool.refcount[p] <= 1])
        if not live:
            return []
        ps = self.page_size
        idx = np.flatnonzero((new > 0) & (lens % ps != 0))
        pages = self.table[rows[idx], lens[idx] // ps]
        refs = self.pool.refcount[pages]
        out: list[int] = []
        left: dict[int, int] = {}  # page -> its references not yet claimed by a writer
        for j in np.flatnonzero(refs > 1):
            page = int(pages[j])
            count = left.get(page, int(refs[j]))
            if count > 1:
                out.append(int(idx[j]))
                left[page] = count - 1
        return out

    def copy_on_write(self, row: int, col: int, replica: int) -> int:
        """``row`` gets a fresh page of ``replica`` at ``col``, filled from the shared page there
        before the next write (`copy_into`); returns the copies recorded (0 or 1). The caller
        checked the pool has a page; the shared page keeps its other holders, so releasing
        ``row``'s reference frees nothing."""
        src = int(self.table[row, col])
        dst = self.allocate(replica, 1, overwritten=True)[0]
        self.table[row, col] = dst
        self.pool.release([src])
        return int(self.copy_into(dst, src))

    def take_copies(self) -> dict[int, int]:
        """The pending copy-on-write copies (dst page -> src page), then none: handed to the device."""
        copies, self.copies = self.copies, {}
        return copies

    def awaits_data(self, page: int) -> bool:
        """Whether ``page``'s data is still to come: it is a pending copy's destination, or a tier
        owes it (a pending onload)."""
        return page in self.copies or (bool(self.tiers) and self.tiers.awaits(self.index, page))

    def find(self, replica: int, digest: bytes) -> int:
        """The device page holding ``digest`` in ``replica``; else the hit code of the nearest
        lower tier holding it (`LowerTiers.hit_code`, below ``PAD_PAGE``); else -1."""
        page = self.pool.lookup(replica, digest)
        if page >= 0 or not self.tiers:
            return page
        return self.tiers.lookup(self.index, replica, digest)

    def tier_map(self, replica: int) -> _TierMap:
        """A prefix map of ``replica`` over the device and the tiers below (`find` as ``.get``)."""
        return _TierMap(self, replica)

    def forget_prefixes(self) -> int:
        """Empty the group's prefix cache (the tiers below forget theirs on their own, after it);
        returns the pages it held."""
        return self.pool.forget_prefixes()

    def release_pages(self, pages: list[int], *, stale: bool = False) -> None:
        """Drop one reference from each page (``stale``: of an older weight version, see
        `PagePool.release`); a pending copy or a tier's transfer into a page that became free is
        dropped (nobody will read its destination)."""
        sources = set(self.copies.values()) if self.copies else ()
        freed = self.pool.release(pages, stale=stale, sources=sources)
        for page in freed:
            self.copies.pop(page, None)
        if freed and self.tiers:
            self.tiers.drop_into(self.index, freed)

    def reset_row(self, row: int) -> None:
        """``row`` holds nothing (its pages were released)."""
        self.table[row] = PAD_PAGE
        self.start[row] = 0

    def hold(self, row: int, start: int, pages: Sequence[int] | np.ndarray) -> None:
        """``row`` (holding nothing) holds ``pages`` from column ``start`` on, holes (``PAD_PAGE``)
        before: a prefix hit, a resumed sequence, a swap-in or a fork. The caller took their
        references."""
        self.table[row, :start] = PAD_PAGE
        self.table[row, start : start + len(pages)] = pages
        self.start[row] = start

    def new_pages(self, rows: np.ndarray, held: np.ndarray, counts: np.ndarray, replicas: np.ndarray | None) -> None:
        """``counts[i]`` new pages for ``rows[i]`` after its ``held[i]`` columns, from replica 0
        (``replicas`` None) or each row's replica, handed out in batch order. The caller checked
        the pool has them."""
        total = int(counts.sum())
        pages: list[int] | np.ndarray
        if replicas is None:
            pages = self.allocate(0, total)
        else:  # one allocation per replica
            pages = np.empty(total, np.int32)
            owner = np.repeat(replicas, counts)
            for r in np.unique(owner).tolist():
                mask = owner == r
                pages[mask] = self.allocate(r, int(mask.sum()))
        if total == rows.size:  # one page each: the decode case
            self.table[rows, held] = pages
        else:
            starts = np.cumsum(counts) - counts
            cols = np.arange(total) - np.repeat(starts - held, counts)
            self.table[np.repeat(rows, counts), cols] = pages

    def fork_row(self, row: int, child: int, columns: int, *, partial: bool) -> None:
        """``child`` (holding nothing) shares the pages ``row`` holds in its first ``columns``
        columns; ``partial``: the last of them is partly filled, so whichever of the two writes
        into it first gets a private copy (`copy_on_write_rows`)."""
        start = min(int(self.start[row]), columns)  # pages before it left the window: holes in both rows
        if partial and start < columns:
            self.shared_partial.add(int(self.table[row, columns - 1]))
        pages = self.table[row, start:columns]
        self.pool.share(pages.tolist())
        self.hold(child, start, pages)

    def drop_columns(self, row: int, keep: int, held: int, *, stale: bool) -> None:
        """``row`` gives back the pages of its columns ``keep .. held - 1``, last column first (as
        `GroupCoordinator.release_row`), and holds holes there. ``stale``: they are of an older
        weight version (evicted first)."""
        first = max(keep, int(self.start[row]))
        self.release_pages(self.table[row, first:held][::-1].tolist(), stale=stale)
        self.table[row, keep:held] = PAD_PAGE

    def fork_shared(self, seqs: SequenceTable) -> set[int]:
        """Partly filled pages of this pool with more than one owner (only a fork makes these)."""
        rows = np.flatnonzero(seqs.active & (seqs.lens % self.page_size != 0))
        pages = self.table[rows, seqs.lens[rows] // self.page_size]
        pages = pages[pages != PAD_PAGE]
        return set(pages[self.pool.refcount[pages] > 1].tolist())

    # ---- committing into pages -------------------------------------------------------------------
    def check_commit(self, rows: np.ndarray, lens: np.ndarray, counts: np.ndarray) -> None:
        """ValueError unless ``counts`` tokens of ``rows`` (of lengths ``lens``) may be committed
        into their pages here: none into a page shared since a fork, none into a page whose copy,
        transfer or scrub is still pending."""
        ps = self.page_size
        if self.shared_partial:
            writing = np.flatnonzero(counts > 0)
            first = self.table[rows[writing], lens[writing] // ps]
            shared = (first != PAD_PAGE) & (self.pool.refcount[first] > 1)
            if shared.any():
                j = int(np.argmax(shared))
                raise ValueError(
                    f"sequence {int(rows[writing[j]])} commits tokens into page {int(first[j])}"
                    f"{self.label}, which it shares since a fork; schedule its step after "
                    "forking so it gets a private copy, then write")
        moved = self.tiers.moving(self.index) if self.tiers else None
        if self.copies or self.pool.has_pending_scrubs() or moved:
            self._check_no_pending_work(rows, lens, counts, moved or {})

    def _check_no_pending_work(self, rows: np.ndarray, lens: np.ndarray, counts: np.ndarray,
                               moved: dict[int, str]) -> None:
        """Tokens committed into a page a pending copy, scrub or tier transfer (``moved``: page ->
        the tier's name) touches were written before that device work: it would overwrite them, or
        carry them into another sequence's page."""
        ps = self.page_size
        copied = set(self.copies) | set(self.copies.values())
        pending = copied | moved.keys() | set(self.pool.pending_scrubs().tolist())
        for i in np.flatnonzero(counts > 0).tolist():
            row, first, last = int(rows[i]), int(lens[i]) // ps, (int(lens[i]) + int(counts[i]) - 1) // ps
            for page in self.table[row, first : last + 1].tolist():
                if page in pending:
                    work = ("copy-on-write copy" if page in copied else f"{moved[page]}-tier transfer"
                            if page in moved else "scrub")
                    raise ValueError(
                        f"sequence {row} commits tokens in page {page}{self.label}, whose {work} is still "
                        "pending: the device would overwrite them. Apply the pending work (a runner's run or "
                        "apply_pending) after reserving and before the step's writes")

    # ---- state -------------------------------------------------------------------------------------
    def row_pages(self, row: int, npages: int) -> list[int]:
        """``row``'s block-table row up to its last column (holes included), as a state writes it."""
        pages: list[int] = self.table[row, :npages].tolist()  # numpy types tolist() as Any
        return pages

    def state(self) -> tuple[dict[str, Any], list[list[int]]]:
        """(the pool's state, the pending copies as [src, dst] pairs)."""
        return self.pool.state_dict(), [[src, dst] for dst, src in self.copies.items()]

    def load(self, rows: list[tuple[int, np.ndarray]], seqs: SequenceTable, *, pool: dict[str, Any],
             copies: dict[int, int], scrub: bool) -> None:
        """A fresh table filled from a loaded state (values checked for type and range; ``seqs``
        already loaded): each ``(row, pages)``, the pool's fields (`PagePool.load_state` but the
        reference counts, which the rows give) and the pending copies."""
        for row, pages in rows:
            self.table[row, : pages.size] = pages
        self.pool.set_scrub_released(scrub)
        held = self.table != PAD_PAGE
        self.start[:] = np.where(held.any(axis=1), np.argmax(held, axis=1), seqs.npages)
        self.pool.load_state(**pool, refcount=np.bincount(self.table[held], minlength=self.pool.num_pages))
        self.copies = copies
        self.shared_partial = self.fork_shared(seqs)


class _TierMap:
    """``.get(digest, -1)`` of a prefix map spanning the device and the tiers below (`find`)."""

    __slots__ = ("table", "replica")

    def __init__(self, table: GroupTable, replica: int):
        self.table, self.replica = table, replica

    def get(self, digest: bytes, default: int = -1) -> int:
        return self.table.find(self.replica, digest)


__all__ = ["GroupTable"]
