"""The layer groups of one manager together: a tuple of their allocators (``groups[g]`` is group
``g``'s table, a per-kind `GroupTable`) with what spans them — the per-group answer's form,
capacity per replica, releasing a row everywhere, out-of-window releases, the prefix lookup over
every group's cache and the tiers below it (each group's window lookup is its table's own; each
table asks the tiers, `lower_tier.LowerTiers`, through their interface).

Like vLLM's kv-cache coordinator over one manager per attention kind: it owns no state of its own
beyond its allocators, and decides nothing a single group can. Imports of the manager: the
allocators (and the sequence table's type); it never imports ``storage``, ``attention``,
``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Self, TypeAlias, TypeVar

import numpy as np

from easykv.manager.group_table import GroupTable
from easykv.manager.prefix_hash import iter_page_digests
from easykv.validation import integer

if TYPE_CHECKING:
    from easykv.manager.sequences import SequenceTable
    from easykv.manager.tier_set import LowerTiers

T = TypeVar("T")
# Every per-group answer of the manager (step metadata, pending copies and scrubs): a tuple of one
# item per layer group, whatever the number of groups, so code written for one cache runs on all.
PerGroup: TypeAlias = tuple[T, ...]


def single_group(answer: tuple[T, ...]) -> T:
    """The one item of a per-group answer of a cache with one layer group (``meta =
    single_group(manager.schedule(...).metadata)``); ValueError for an answer of several
    groups, which are used per group (``answer[g]``) or as a whole (the cache's ``write``).

    Args:
      answer: a per-group answer of the manager, a tuple of one item per layer group.
    """
    if not isinstance(answer, tuple):
        raise ValueError(f"single_group takes a per-group answer (a tuple of one item per layer group, what "
                         f"a plan's metadata is), got {type(answer).__name__}")
    if len(answer) == 2 and all(type(item) is tuple for item in answer):
        raise ValueError("single_group takes one per-group answer; a plan's work.copies() gives two, "
                         "(src_per_group, dst_per_group): unpack each ((src,), (dst,) = plan.work.copies())")
    if len(answer) != 1:
        raise ValueError(f"single_group: the answer holds one item for each of {len(answer)} layer groups; index it "
                         "by group (answer[g]) or pass it whole (cache.write takes one metadata per group)")
    return answer[0]


class GroupCoordinator(tuple[GroupTable, ...]):
    """The allocators of every layer group. Owns nothing but them; ``windowed`` (the sliding and
    chunked ones), ``all_windowed`` and ``num_replicas`` are fixed at construction.

    A tuple, so ``manager._groups[g]`` stays group ``g``'s table for the code that reaches in
    (tests, the host-tier tests), and the hot loops iterate it as fast as a plain tuple."""

    def __new__(cls, tables: Iterable[GroupTable]) -> Self:
        return super().__new__(cls, tables)

    def __init__(self, tables: Iterable[GroupTable]):
        super().__init__()
        self.windowed = tuple(table for table in self if table.windowed)
        self.all_windowed = len(self.windowed) == len(self)
        self.num_replicas = self[0].pool.num_replicas

    def set_tiers(self, tiers: LowerTiers) -> None:
        """Every group's pool has ``tiers`` below it from now on (`GroupTable.set_tiers`)."""
        for table in self:
            table.set_tiers(tiers)

    def group_index(self, group: Any) -> int:
        """The checked ``group=`` argument of a public call (None: the only group)."""
        n = len(self)
        if group is None:
            if n > 1:
                raise ValueError(f"this manager has {n} layer groups, each with its own pages; pass group=0..{n - 1}")
            return 0
        return integer("group", group, lo=0, hi=n - 1, hint=f"a layer group of the {n} in the metadata")

    def available_per_replica(self) -> np.ndarray:
        """Per replica, the pages an allocation can take in its tightest group."""
        tightest: np.ndarray = np.min([table.pool.available_per_replica() for table in self], axis=0)
        return tightest

    # ---- rows in every group ---------------------------------------------------------------------
    def release_row(self, row: int, npages: int, *, stale: bool) -> None:
        """Drop ``row``'s reference to every page it holds, last column first (tail pages are
        evicted before head pages), and empty its row."""
        for table in self:
            table.release_pages(table.held(row, npages)[::-1], stale=stale)
            table.reset_row(row)

    def release_out_of_window(self, seqs: SequenceTable, rows: np.ndarray, current: bytes | None) -> None:
        """Release the pages no query of these sequences can read again, in every sliding or
        chunked group; forget a resumed sequence's floor once every window has passed it."""
        windowed = self.windowed  # a full group releases nothing: skipped, this runs every commit
        if not windowed or not rows.size:
            return
        lens = seqs.lens[rows]
        floor = seqs.floor[rows]
        passed = np.ones(rows.size, bool)
        for table in windowed:
            cols = table.release_out_of_window(rows, lens, seqs.version, current)
            passed &= floor <= cols * table.page_size
        seqs.forget_floors(rows[passed])

    def fewest_released(self, lens: np.ndarray) -> np.ndarray:
        """Per length, the fewest columns any group's window has released."""
        fewest: np.ndarray = np.min([table.released_columns(lens) for table in self], axis=0)
        return fewest

    # ---- the prefix caches ---------------------------------------------------------------------------
    def demote(self, version: bytes | None) -> None:
        """Cached device pages of versions other than ``version`` are evicted first."""
        for table in self:
            table.pool.demote(version)

    def forget_prefixes(self) -> int:
        """Empty every group's device prefix cache; returns the pages it held."""
        return sum(table.forget_prefixes() for table in self)

    def lookup(self, tokens: np.ndarray, salt: bytes, root: bytes, bound: int, *,
               tiers: bool = True) -> tuple[int, list[list[int]], bytes]:
        """The best replica (``bound``, or any while it is -1), its cached pages for the prompt in
        every group (``PAD_PAGE`` where a window does not need one; below it, a lower tier's page
        as `LowerTiers.hit_code` gives it, unless ``tiers`` is False), and the digest of the last
        one (``root``: that of none). A hit of ``k`` pages needs every group's pages for it. Best:
        most pages, then most available pages (in the tightest group), then lowest index."""
        replicas = [bound] if bound >= 0 else list(range(self.num_replicas))
        tiers = tiers and bool(self[0].tiers)
        if self.windowed:
            return self._lookup_window(tokens, salt, root, replicas, tiers=tiers)
        ps = self[0].page_size
        found: dict[int, list[Any]] = {r: [] for r in replicas}  # per replica, per page: its page in each group
        # (hits, the replica's prefix map in each group) per replica, bound once: this loop is the lookup's cost
        searches = [(found[r],
                     [table.tier_map(r) if tiers else table.pool.digest_map(r) for table in self]) for r in replicas]
        chain = root
        for k, digest in enumerate(iter_page_digests(tokens, ps, (tokens.size - 1) // ps, salt, root)):
            alive = False
            for hits, maps in searches:
                if len(hits) == k:  # one group (the common case) without a comprehension per page
                    pages = (maps[0].get(digest, -1),) if len(maps) == 1 else [m.get(digest, -1) for m in maps]
                    if -1 not in pages:
                        hits.append(pages)
                        alive = True
            if not alive:
                break
            chain = digest
        avail = self.available_per_replica()
        best = max(replicas, key=lambda r: (len(found[r]), avail[r], -r))
        return best, [list(column) for column in zip(*found[best])] or [[] for _ in self], chain

    def _lookup_window(self, tokens: np.ndarray, salt: bytes, root: bytes, replicas: list[int], *,
                       tiers: bool) -> tuple[int, list[list[int]], bytes]:
        """`lookup` when a group is sliding or chunked: a hit of ``k`` pages needs, in every
        group, only the pages a sequence of ``k`` pages still reads there (each table's
        `GroupTable.prefix_hits`), so the longest ``k`` every group serves wins, even where a
        window's older pages were evicted."""
        ps = self[0].page_size
        digests = list(iter_page_digests(tokens, ps, (tokens.size - 1) // ps, salt, root))
        avail = self.available_per_replica()
        best: tuple[int, int, int, int, list[list[int]]] = (0, 0, 0, replicas[0], [[] for _ in self])
        for r in replicas:
            served = np.ones(len(digests), bool)
            found = []
            for table in self:
                hits, pages_found = table.prefix_hits(digests, r, tiers=tiers)
                served &= hits
                found.append(pages_found)
            k = int(np.flatnonzero(served).max()) + 1 if served.any() else 0
            pages = [table.hit_row(f, k) if k else [] for table, f in zip(self, found)]
            best = max(best, (k, int(avail[r]), -r, r, pages), key=lambda t: t[:3])
        k, _, _, r, pages = best
        return r, pages, digests[k - 1] if k else root

__all__ = ["GroupCoordinator", "PerGroup", "single_group"]
