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
- ``host``: the group's pool in the host-memory tier (None without one), with its pending
  transfers: ``offloads`` (host page -> (device page, digest, weight version): the device page's
  contents go to the host page; a digest enters the host prefix map once the copy is applied)
  and ``onloads`` (device page -> host page). A pending transfer holds one reference to its
  host page, so the host pool never hands that page to anyone else meanwhile.

What depends on the attention kind (which columns a window releases) is left to the subclasses.
Imports of the manager: ``page_pool``, ``broken`` and the sequence table it reads; it never imports
``storage``, ``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from easykv.errors import CacheFullError, InvariantError
from easykv.manager.broken import Broken
from easykv.manager.page_pool import PagePool
from easykv.spec.groups import known_size
from easykv.step.metadata import PAD_PAGE

if TYPE_CHECKING:
    from easykv.manager.sequences import SequenceTable
    from easykv.spec.groups import LayerGroup


@dataclasses.dataclass(eq=False)
class GroupTable(abc.ABC):
    """One layer group's pages of every sequence (see the module doc). Owns ``pool``, ``table``,
    ``start``, ``copies``, ``shared_partial``, ``host``, ``offloads``, ``onloads`` and
    ``offloads_dropped`` (evicted prefix pages the host tier had no page for). ``index`` is the
    group's place in the metadata, ``grouped`` whether there are several (for messages)."""

    group: LayerGroup
    page_size: int
    index: int
    grouped: bool
    pool: PagePool
    table: np.ndarray  # (batch_size, pages_per_sequence) int32
    start: np.ndarray  # (batch_size,) int32
    copies: dict[int, int] = dataclasses.field(default_factory=dict)
    shared_partial: set[int] = dataclasses.field(default_factory=set)
    host: PagePool | None = None
    offloads: dict[int, tuple[int, bytes | None, bytes | None]] = dataclasses.field(default_factory=dict)
    onloads: dict[int, int] = dataclasses.field(default_factory=dict)
    offloads_dropped: int = 0

    windowed: ClassVar[bool] = False  # whether the group releases pages that left its window

    @classmethod
    def fresh(cls, group: LayerGroup, *, index: int, grouped: bool, page_size: int, batch_size: int,
              pages_per_sequence: int, page_shards: int, scrub_released: bool, host_pages: int = 0) -> GroupTable:
        """``host_pages``: pages of the group's host tier (0: none)."""
        pool = PagePool(known_size(group.num_pages), int(page_shards), scrub_released=scrub_released)
        host = None
        if host_pages:
            pool.keep_evicted = True
            host = PagePool(int(host_pages), int(page_shards), scrub_released=scrub_released)
        return cls(group=group, page_size=page_size, index=index, grouped=grouped, pool=pool,
                   table=np.full((batch_size, pages_per_sequence), PAD_PAGE, np.int32),
                   start=np.zeros(batch_size, np.int32), host=host)

    @property
    def label(self) -> str:
        """`` of layer group g`` in messages of a manager of several groups."""
        return f" of layer group {self.index}" if self.grouped else ""

    @property
    def host_pool(self) -> PagePool:
        """`host`, where the caller knows the group has a host tier (pending transfers, the
        host-tier policy); InvariantError without one."""
        host = self.host
        if host is None:
            raise InvariantError(f"layer group {self.index} has no host-memory tier")
        return host

    def set_scrub_released(self, scrub: bool) -> None:
        """Whether released pages are zeroed, in the device pool and the host tier alike."""
        for pool in (self.pool, self.host):
            if pool is not None:
                pool.scrub_released = scrub

    # ---- what the attention kind decides (the subclasses) ---------------------------------------
    @abc.abstractmethod
    def first_needed(self, lens: np.ndarray) -> np.ndarray:
        """Per length, the first position a query at that position or later reads."""

    def released_columns(self, lens: np.ndarray) -> np.ndarray:
        """Per length, the block-table columns wholly before what the next query reads."""
        return (self.first_needed(np.asarray(lens, np.int64)) // self.page_size).astype(np.int32)

    @abc.abstractmethod
    def release_out_of_window(self, rows: np.ndarray, lens: np.ndarray, version: list[bytes | None],
                              current: bytes | None) -> np.ndarray:
        """Release the pages of ``rows`` (of lengths ``lens``) no query reads again; returns the
        columns released per row. ``version``: each row's weight version (``current``: the
        current one; older ones' pages are evicted first)."""

    @abc.abstractmethod
    def first_kept_position(self, length: int, floor: int) -> int:
        """The first position of a sequence of ``length`` tokens (resumed at ``floor``) whose
        K/V the group holds and its next query may read."""

    # ---- pages ------------------------------------------------------------------------------------
    def held(self, row: int, npages: int) -> list[int]:
        """The pages ``row`` holds in this group, in column order."""
        pages: list[int] = self.table[row, self.start[row]:npages].tolist()  # numpy types tolist() as Any
        return pages

    def allocate(self, replica: int, n: int, *, overwritten: bool = False) -> list[int]:
        """`PagePool.allocate`, saving the prefix pages it evicts to the host tier (if any)."""
        pages = self.pool.allocate(replica, n, overwritten=overwritten)
        if self.host is not None:
            self.offload_evicted()
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

    def offload_evicted(self) -> None:
        """A pending offload for every prefix page the device pool evicted whose digest the host
        tier does not hold yet; dropped (counted) when every host page of the replica is held.
        An evicted page still waiting for its onload never got its data: the onload is dropped
        (the host page keeps the digest)."""
        host = self.host_pool
        pending = {d for _, d, _ in self.offloads.values()} if self.offloads else ()
        for page, digest, tag in self.pool.take_evicted():
            if page in self.onloads:
                host.release([self.onloads.pop(page)])
                continue
            replica = self.pool.replica_of(page)
            if host.lookup(replica, digest) >= 0 or digest in pending:
                continue
            if not host.num_available(replica):
                self.offloads_dropped += 1
                continue
            self.offloads[host.allocate(replica, 1, overwritten=True)[0]] = (page, digest, tag)

    def copy_into(self, dst: int, page: int) -> bool:
        """A pending copy-on-write of ``page`` into the fresh page ``dst``. A page whose own data is
        still pending (a copy's destination, an onload's) is filled from where that data is: the
        copy's source (copies run before onloads, so it still holds it) or the onload's host page.
        Returns whether any work was recorded."""
        if page in self.onloads:
            h = self.onloads[page]
            self.host_pool.share([h])
            self.onloads[dst] = h
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

    def host_lookup(self, replica: int, digest: bytes) -> int:
        """The device page holding ``digest`` in ``replica``; else ``-2 - h`` for host page
        ``h`` holding it; else -1."""
        page = self.pool.lookup(replica, digest)
        if page >= 0 or self.host is None:
            return page
        h = self.host.lookup(replica, digest)
        return -1 if h < 0 else -2 - h

    def tier_map(self, replica: int) -> _TierMap:
        """A prefix map of ``replica`` over both tiers (`host_lookup` as ``.get``)."""
        return _TierMap(self, replica)

    def drop_freed_onloads(self) -> None:
        """Drop the pending onloads into pages that became free (the prefix cache was emptied)."""
        for page in [p for p in self.onloads if self.pool.refcount[p] == 0 and self.pool.digest_of(p) is None]:
            self.host_pool.release([self.onloads.pop(page)])

    def release_pages(self, pages: list[int], *, stale: bool = False) -> None:
        """Drop one reference from each page (``stale``: of an older weight version, see
        `PagePool.release`); a pending copy or onload into a page that became free is dropped
        (nobody will read its destination)."""
        sources = set(self.copies.values()) if self.copies else ()
        for page in self.pool.release(pages, stale=stale, sources=sources):
            self.copies.pop(page, None)
            if self.onloads and page in self.onloads:
                self.host_pool.release([self.onloads.pop(page)])

    def reset_row(self, row: int) -> None:
        self.table[row] = PAD_PAGE
        self.start[row] = 0

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
                    f"{self.label}, which it shares since a fork; reserve (build_step_metadata) after "
                    "forking so it gets a private copy, then write")
        if self.copies or self.pool.has_pending_scrubs() or self.offloads or self.onloads:
            self._check_no_pending_work(rows, lens, counts)

    def _check_no_pending_work(self, rows: np.ndarray, lens: np.ndarray, counts: np.ndarray) -> None:
        """Tokens committed into a page a pending copy or scrub touches were written before that
        device work: it would overwrite them, or carry them into another sequence's page."""
        ps = self.page_size
        copied = set(self.copies) | set(self.copies.values())
        moved = set(self.onloads) | {src for src, _, _ in self.offloads.values()}
        pending = copied | moved | set(self.pool.pending_scrubs().tolist())
        for i in np.flatnonzero(counts > 0).tolist():
            row, first, last = int(rows[i]), int(lens[i]) // ps, (int(lens[i]) + int(counts[i]) - 1) // ps
            for page in self.table[row, first : last + 1].tolist():
                if page in pending:
                    work = ("copy-on-write copy" if page in copied else "host-tier transfer" if page in moved
                            else "scrub")
                    raise ValueError(
                        f"sequence {row} commits tokens in page {page}{self.label}, whose {work} is still "
                        "pending: the device would overwrite them. Call apply_pending(cache, host=...) after "
                        "build_step_metadata and before the step's writes")

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
        self.set_scrub_released(scrub)
        held = self.table != PAD_PAGE
        self.start[:] = np.where(held.any(axis=1), np.argmax(held, axis=1), seqs.npages)
        self.pool.load_state(**pool, refcount=np.bincount(self.table[held], minlength=self.pool.num_pages))
        self.copies = copies
        self.shared_partial = self.fork_shared(seqs)

    # ---- invariants --------------------------------------------------------------------------------
    def _fields(self) -> tuple[str, str, str]:
        """(`` in layer group g``, the pool's state field, the copies' state field)."""
        if self.grouped:
            g = self.index
            return f" in layer group {g}", f"pool[{g}]", f"copies[{g}]"
        return "", "pool", "copies"

    def expected_start(self, seqs: SequenceTable, swapped: np.ndarray) -> np.ndarray:
        """Per row, the columns a sequence has released here: those wholly before the first
        position its next query reads (none for full attention), or before a resumed
        sequence's floor; none of a swapped-out sequence (its row holds nothing)."""
        released = np.minimum(self.released_columns(seqs.lens), seqs.npages)
        start: np.ndarray = np.maximum(released, seqs.floor // self.page_size).astype(self.start.dtype)
        start[swapped] = 0
        return start

    def check_reads(self, seqs: SequenceTable, swapped: np.ndarray) -> None:
        """No page the next query of a claimed sequence reads was released: its first held column
        is at most the first column that query reads, and every column from there to its last
        holds a page. A resumed sequence whose floor still lies inside the window is left out
        (the manager vouches for none of its reads until the window passes the floor)."""
        rows = np.flatnonzero(seqs.active & ~swapped)
        if not rows.size:
            return
        of, _, _ = self._fields()
        lens, start, npages = seqs.lens[rows], self.start[rows], seqs.npages[rows]
        first = self.first_needed(lens.astype(np.int64))
        need = first // self.page_size
        early = (seqs.floor[rows] <= first) & (start > need)
        if early.any():
            i = int(np.argmax(early))
            row = int(rows[i])
            raise Broken(f"sequences[id={row}].pages",
                         f"sequence {row} of length {int(lens[i])} has released its first {int(start[i])} pages{of}, "
                         f"but its window releases exactly {int(need[i])}: its next query reads from position "
                         f"{int(first[i])} on, in column {int(need[i])}, whose page is gone")
        cols = np.arange(self.table.shape[1])
        gap = (cols >= start[:, None]) & (cols < npages[:, None]) & (self.table[rows] == PAD_PAGE)
        if gap.any():
            i, col = (int(x) for x in np.argwhere(gap)[0])
            raise Broken(f"sequences[id={int(rows[i])}].pages",
                         f"sequence {int(rows[i])} holds no page{of} at column {col}, inside the columns "
                         f"{int(start[i])}..{int(npages[i]) - 1} its queries read")

    def check(self, seqs: SequenceTable, swapped: np.ndarray, *, caching: bool, scrub: bool) -> None:
        """Raise `Broken` unless this group's pages agree with the sequences: window holes,
        ownership, the pool, the prefix map, copy-on-write and pending work."""
        ps, n, pool = self.page_size, seqs.npages, self.pool
        of, pool_field, _ = self._fields()
        self.check_reads(seqs, swapped)
        start = self.expected_start(seqs, swapped)
        if np.any(self.start != start):
            row = int(np.argmax(self.start != start))
            raise Broken(f"sequences[id={row}].pages", f"sequence {row} of length {int(seqs.lens[row])} has released "
                                                       f"its first {int(self.start[row])} pages{of}, but its window "
                                                       f"releases exactly {int(start[row])}")
        cols = np.arange(self.table.shape[1])
        held = (cols[None, :] < n[:, None]) & (cols[None, :] >= start[:, None])
        if np.any(held != (self.table != PAD_PAGE)):
            raise Broken("sequences", f"a block-table row{of} disagrees with its page count: "
                                      f"{np.argwhere(held != (self.table != PAD_PAGE))[0].tolist()}")
        pages = self.table[held]
        owner_rows = np.nonzero(held)[0]
        if pages.size and np.any(pages // pool.pages_per_replica != seqs.replica[owner_rows]):
            raise Broken("sequences", f"a sequence holds a page{of} outside its data-parallel replica's slice")
        for r in np.flatnonzero(n > 1):
            if np.unique(self.table[r, start[r]: n[r]]).size != n[r] - start[r]:
                raise Broken(f"sequences[id={r}].pages", f"sequence {r} holds a page{of} twice")
        try:
            pool.check(np.bincount(pages, minlength=pool.num_pages).astype(np.int32))
        except InvariantError as err:
            raise Broken(pool_field, err.detail) from None
        if not caching and (pool.num_cached() or any(pool.digest_of(p) is not None for p in range(pool.num_pages))):
            raise Broken(f"{pool_field}.digests", "prefix caching is off but pages carry digests")
        if not scrub and pool.has_pending_scrubs():
            raise Broken(f"{pool_field}.scrub",
                         "pages are to be scrubbed but the manager does not scrub released pages")
        for row, col in np.argwhere(held):
            page = int(self.table[row, col])
            if pool.digest_of(page) is not None and (col + 1) * ps > seqs.lens[row]:
                raise Broken(f"{pool_field}.digests", f"page {page}{of} is in the prefix cache but sequence {row} has "
                                                      "not filled it")
            if pool.digest_of(page) is not None and pool.tag_of(page) != seqs.version[row]:
                raise Broken(f"{pool_field}.versions", f"prefix page {page}{of} was written under another weight "
                                                       f"version than sequence {row}, which holds it")
        if not self.fork_shared(seqs) <= self.shared_partial:
            raise Broken("sequences", f"a partly filled page{of} is shared but copy-on-write does not know it")
        self._check_pending(seqs, held, caching=caching)

    def _check_pending(self, seqs: SequenceTable, held: np.ndarray, *, caching: bool) -> None:
        """Pages joined between sequences continue one history (`SequenceTable.check_joined`): every
        shared page, and every pending copy-on-write, whose destination is the unfinished page of
        every sequence holding it (nothing else reads it yet). A page to scrub is free, or
        reserved by one sequence that has written nothing into it."""
        ps, pool, table, lens = self.page_size, self.pool, self.table, seqs.lens
        _, pool_field, copies_field = self._fields()
        where: dict[int, list[tuple[int, int]]] = {}  # page -> [(row, col)] over every holder
        for row, col in np.argwhere(held).tolist():
            where.setdefault(int(table[row, col]), []).append((row, col))
        checked: dict[tuple[int, int], int] = {}
        for page, holders in where.items():
            if len(holders) > 1:
                seqs.check_joined(holders, checked, None, f"page {page} is shared between sequences of different "
                                                          "histories", caching=caching)
        scrub = set(pool.pending_scrubs().tolist())
        for dst, src in self.copies.items():
            field = f"{copies_field}[dst={dst}]"
            if src == dst:
                raise Broken(field, f"copy {src} -> {dst} copies a page onto itself")
            if pool.replica_of(src) != pool.replica_of(dst):
                raise Broken(field, f"copy {src} -> {dst} crosses data-parallel replicas")
            if dst in scrub:
                raise Broken(field, f"page {dst} is both a copy destination and a page to scrub")
            if pool.digest_of(src) is not None and not where.get(src):
                raise Broken(field, f"copy {src} -> {dst} reads page {src}, a page of the prefix cache no sequence "
                                    "holds; a copy reads a page of a sequence whose history it continues")
            holders = where.get(dst, [])
            if not holders or pool.digest_of(dst) is not None:
                raise Broken(field, f"copy {src} -> {dst} targets page {dst}, which no sequence holds as its own "
                                    "unfinished page")
            first = holders[0][0]
            length = int(lens[first])
            if length % ps == 0 or any(int(lens[row]) != length or c != length // ps for row, c in holders):
                raise Broken(field, f"copy {src} -> {dst} would overwrite page {dst}, which sequence {first} "
                                    f"holds with {length} tokens written (not an unfinished page of every holder)")
            # A copy is pending from the moment a sequence that shared a partly filled page (a fork)
            # reserves room in it, or a truncated sequence ends inside a page it shares, until it is
            # applied: the destination's holders and the source's writers shared the source then.
            # (A source freed and taken again as another copy's or an onload's destination is read
            # before that one writes it: its new holders' tokens are not in it yet.)
            refilled = src in self.copies or src in self.onloads
            writers = [] if refilled else [(r, c) for r, c in where.get(src, []) if c * ps < int(lens[r])]
            seqs.check_joined(holders + writers, checked, field,
                              f"copy {src} -> {dst} joins pages of sequences with different histories", caching=caching)
        for page in sorted(scrub):
            holders = where.get(page, [])
            if not holders:
                continue  # free: zeroing it harms nobody
            (row, col), *others = holders
            if others or pool.digest_of(page) is not None or col * ps < int(lens[row]):
                raise Broken(f"{pool_field}.scrub", f"page {page} is to be zeroed but holds written tokens of sequence "
                                                    f"{row} (column {col}){' and is shared' if others else ''}")


class _TierMap:
    """``.get(digest, -1)`` of a prefix map spanning the device and host tiers (`host_lookup`)."""

    __slots__ = ("table", "replica")

    def __init__(self, table: GroupTable, replica: int):
        self.table, self.replica = table, replica

    def get(self, digest: bytes, default: int = -1) -> int:
        return self.table.host_lookup(self.replica, digest)


__all__ = ["GroupTable"]
