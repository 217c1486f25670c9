"""How the page manager of a sliding-window or chunked cache keeps only what queries still read.

After every commit (and prefix match), the full pages wholly before the first position the
sequence's next query sees are released: they return to the pool, or stay findable in the prefix
cache when hashed. Their block-table columns become holes (``PAD_PAGE``): a row is holes in
``[0, _start)``, pages in ``[_start, _npages)``. So a sequence holds about its window's pages
however long it grows; reading its table needs the window (`HostChecked.covers`).

A sequence can also start in the middle (`resume`): a sequence moved from another cache with
only its window's tokens. Its positions before ``_floor`` have no K/V; the table holds no page
for them, and until its window has moved past the floor the manager vouches for none of its
reads.

``_Windows`` is a mixin of `PageManager` (manager.py), never used alone.
"""

from __future__ import annotations

import numpy as np

from easykv.manager.prefix_hash import ROOT_DIGEST, iter_page_digests
from easykv.runtime import PAD_PAGE
from easykv.validation import integer


class _Windows:
    """`PageManager`'s out-of-window release and mid-sequence start (see the module doc)."""

    def _released_columns(self, lens: np.ndarray) -> np.ndarray:
        """Per length, the block-table columns wholly before what the next query reads."""
        if self.window_group is None:
            return np.zeros(np.shape(lens), np.int32)
        first = self.window_group.first_needed_position(np.asarray(lens, np.int64))
        return (first // self.page_size).astype(np.int32)

    def _release_out_of_window(self, rows: np.ndarray) -> None:
        """Release the pages no query of these sequences can read again; forget a resumed
        sequence's floor once its window has passed it."""
        if self.window_group is None or not rows.size:
            return
        cols = self._released_columns(self._lens[rows])
        for i in np.flatnonzero(cols > self._start[rows]).tolist():
            row, stop = int(rows[i]), int(cols[i])
            start = int(self._start[row])
            self._release_pages(self._table[row, start:stop][::-1].tolist())
            self._table[row, start:stop] = PAD_PAGE
            self._start[row] = stop
        passed = self._floor[rows] <= cols * self.page_size
        self._floor[rows[passed]] = 0

    def _lookup_window(self, tokens: np.ndarray, salt: bytes, replicas: list[int]) -> tuple[int, list[int], bytes]:
        """`_lookup` for a sliding or chunked cache: a hit of ``k`` pages needs only the pages
        the window of a sequence of ``k`` pages still reads, so the longest ``k`` whose window
        pages are all cached wins, even where older pages were evicted. A hit needs at least one
        cached page (a chunk boundary alone is no hit)."""
        pool, ps = self._pool, self.page_size
        digests = list(iter_page_digests(tokens, ps, (tokens.size - 1) // ps, salt))
        ks = np.arange(1, len(digests) + 1)
        first = self._released_columns(ks * ps).astype(np.int64)  # the first column each hit needs
        avail = pool.available_per_replica()
        best = (0, 0, 0, replicas[0], [])
        for r in replicas:
            found = np.array([pool.lookup(r, d) for d in digests], np.int64)
            cached = np.concatenate([[0], np.cumsum(found >= 0)])
            whole = (first < ks) & (cached[ks] - cached[first] == ks - first)
            k = int(ks[whole].max()) if whole.any() else 0
            pages = [PAD_PAGE] * int(first[k - 1]) + found[first[k - 1]:k].tolist() if k else []
            best = max(best, (k, int(avail[r]), -r, r, pages), key=lambda t: t[:3])
        k, _, _, r, pages = best
        return r, pages, digests[k - 1] if k else ROOT_DIGEST

    def first_kept_position(self, seq_id: int) -> int:
        """The first position whose K/V the sequence holds and its next query may read: 0 in a
        full-attention cache; in a sliding or chunked one, where its window starts (or a
        resumed sequence's first position, while its window still reaches before it)."""
        row = self._row(seq_id)
        if self.window_group is None:
            return 0
        first = int(self.window_group.first_needed_position(int(self._lens[row])))
        return max(first, int(self._floor[row]))

    def resume(self, seq_id: int, first_position: int) -> None:
        """Start the freshly claimed ``seq_id`` at ``first_position``: a sequence whose earlier
        tokens this cache will never hold (one moved here with only its window's tokens, see
        `import_sequence`). It holds no pages for them: its length becomes ``first_position``
        rounded down to a page, and the tokens from there on are reserved, written and
        committed as usual (`build_step_metadata`, then `advance`; they are not entered in the
        prefix cache, whose keys need every token from the first). Write up to a length whose
        window starts at or after ``first_position`` before attention reads the sequence.

        ValueError for a full-attention cache (its queries read every position), a sequence
        that already holds tokens or pages, or a position outside ``0 .. max_sequences - 1``."""
        row = self._row(seq_id)
        pos = integer("first_position", first_position, lo=0, hi=self.max_length - 1,
                      hint=f"a position of a sequence of at most max_sequences={self.max_length} tokens")
        if self._lens[row] or self._npages[row]:
            raise ValueError(f"sequence {row} already holds {int(self._lens[row])} tokens in "
                             f"{int(self._npages[row])} pages; resume right after claim")
        if pos and self.window_group is None:
            raise ValueError(f"resume(first_position={pos}) needs a sliding or chunked cache: in this full-attention "
                             "cache every query reads from position 0, so a sequence must hold all its tokens")
        col = pos // self.page_size
        if not col:
            return
        self._table[row, :col] = PAD_PAGE
        self._npages[row] = self._start[row] = col
        self._lens[row] = self._floor[row] = col * self.page_size
        self._hashes.hashable[row] = False
        avail = self._pool.available_per_replica()
        self._replica[row] = int(np.argmax(avail))  # a row with columns is bound; the emptiest slice
