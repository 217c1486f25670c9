"""How the page manager of a sliding-window or chunked cache keeps only what queries still read.

After every commit (and prefix match), in every sliding or chunked layer group, the full pages
wholly before the first position the sequence's next query sees there are released: they return
to the group's pool, or stay findable in its prefix cache when hashed. Their block-table columns
become holes (``PAD_PAGE``): a row of a group's table is holes in ``[0, start)``, pages in
``[start, _npages)`` (`group_table`). So a sequence holds about its window's pages however long
it grows; reading its table needs the window (`HostChecked.covers`). Full-attention groups of the
same cache keep every page.

A sequence can also start in the middle (`resume`): a sequence moved from another cache with
only its window's tokens. Its positions before ``_floor`` have no K/V; the table holds no page
for them, and until its window has moved past the floor the manager vouches for none of its
reads.

``_Windows`` is a mixin of `PageManager` (manager.py), never used alone.
"""

from __future__ import annotations

import numpy as np

from easykv.manager.prefix_hash import iter_page_digests
from easykv.step.metadata import PAD_PAGE
from easykv.validation import integer


class _Windows:
    """`PageManager`'s out-of-window release and mid-sequence start (see the module doc)."""

    def _release_out_of_window(self, rows: np.ndarray) -> None:
        """Release the pages no query of these sequences can read again, in every sliding or
        chunked group; forget a resumed sequence's floor once every window has passed it."""
        windowed = [gt for gt in self._groups if gt.windowed]
        if not windowed or not rows.size:
            return
        lens = self._lens[rows]
        passed = np.ones(rows.size, bool)
        for gt in windowed:
            cols = gt.released_columns(lens, self.page_size)
            for i in np.flatnonzero(cols > gt.start[rows]).tolist():
                row, stop = int(rows[i]), int(cols[i])
                start = int(gt.start[row])
                gt.release_pages(gt.table[row, start:stop][::-1].tolist(), stale=self._is_stale(row))
                gt.table[row, start:stop] = PAD_PAGE
                gt.start[row] = stop
            passed &= self._floor[rows] <= cols * self.page_size
        self._floor[rows[passed]] = 0

    def _lookup_window(self, tokens: np.ndarray, salt: bytes, replicas: list[int], *,
                       host: bool = False) -> tuple[int, list[list[int]], bytes]:
        """`_lookup` when a group is sliding or chunked: a hit of ``k`` pages needs, in every
        group, only the pages a sequence of ``k`` pages still reads there (all of them in a
        full group), so the longest ``k`` whose needed pages are all cached wins, even where a
        window's older pages were evicted. A hit needs at least one cached page in each group
        (a chunk boundary alone is no hit)."""
        ps = self.page_size
        root = self._root()
        digests = list(iter_page_digests(tokens, ps, (tokens.size - 1) // ps, salt, root))
        ks = np.arange(1, len(digests) + 1)
        firsts = [gt.released_columns(ks * ps, ps).astype(np.int64) for gt in self._groups]  # the first column each hit needs
        avail = self._available_per_replica()
        best = (0, 0, 0, replicas[0], [[] for _ in self._groups])
        for r in replicas:
            whole = np.ones(ks.size, bool)
            found = []
            for gt, first in zip(self._groups, firsts):
                find = gt.host_lookup if host else gt.pool.lookup
                pages = np.array([find(r, d) for d in digests], np.int64)
                cached = np.concatenate([[0], np.cumsum(pages != PAD_PAGE)])
                whole &= (first < ks) & (cached[ks] - cached[first] == ks - first)
                found.append(pages)
            k = int(ks[whole].max()) if whole.any() else 0
            pages = [[PAD_PAGE] * int(first[k - 1]) + f[first[k - 1]:k].tolist() if k else []
                     for f, first in zip(found, firsts)]
            best = max(best, (k, int(avail[r]), -r, r, pages), key=lambda t: t[:3])
        k, _, _, r, pages = best
        return r, pages, digests[k - 1] if k else root

    def first_kept_position(self, seq_id: int, *, group: int | None = None) -> int:
        """The first position whose K/V the sequence holds in layer group ``group`` (needed
        when there are several) and its next query may read: 0 in a full-attention group; in a
        sliding or chunked one, where its window starts (or a resumed sequence's first
        position, while a window still reaches before it)."""
        gt = self._groups[self._group_index(group)]
        row = self._row(seq_id)
        if not gt.windowed:
            return 0
        first = int(gt.group.first_needed_position(int(self._lens[row])))
        return max(first, int(self._floor[row]))

    def resume(self, seq_id: int, first_position: int) -> None:
        """Start the freshly claimed ``seq_id`` at ``first_position``: a sequence whose earlier
        tokens this cache will never hold (one moved here with only its window's tokens, see
        `import_sequence`). It holds no pages for them: its length becomes ``first_position``
        rounded down to a page, and the tokens from there on are reserved, written and
        committed as usual (`build_step_metadata`, then `advance`; they are not entered in the
        prefix cache, whose keys need every token from the first). Write up to a length whose
        window starts at or after ``first_position`` before attention reads the sequence.

        ValueError when a layer group attends fully (its queries read every position), for a
        sequence that already holds tokens or pages, or a position outside
        ``0 .. max_sequences - 1``."""
        row = self._row(seq_id)
        self._refuse_swapped(row, "resume")
        pos = integer("first_position", first_position, lo=0, hi=self.max_length - 1,
                      hint=f"a position of a sequence of at most max_sequences={self.max_length} tokens")
        if self._lens[row] or self._npages[row]:
            raise ValueError(f"sequence {row} already holds {int(self._lens[row])} tokens in "
                             f"{int(self._npages[row])} pages; resume right after claim")
        full = [g for g, gt in enumerate(self._groups) if not gt.windowed]
        if pos and full:
            single = len(self._groups) == 1
            where = "this full-attention cache" if single else f"layer group {full[0]} (full attention)"
            raise ValueError(f"resume(first_position={pos}) needs a sliding or chunked cache"
                             f"{'' if single else ' in every layer group'}: in {where} every query reads from "
                             "position 0, so a sequence must hold all its tokens")
        col = pos // self.page_size
        if not col:
            return
        for gt in self._groups:
            gt.table[row, :col] = PAD_PAGE
            gt.start[row] = col
        self._npages[row] = col
        self._lens[row] = self._floor[row] = col * self.page_size
        self._hashes.hashable[row] = False
        self._replica[row] = int(np.argmax(self._available_per_replica()))  # a row with columns is bound; the emptiest slice
