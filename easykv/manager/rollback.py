"""Dropping a sequence's tail: `truncate` (speculative decoding's rejected draft tokens, beam
pruning, a rollout rewound to its prompt).

The pages wholly past the new length go back to their pool (or the prefix cache, as on release).
The page the new length ends inside becomes the sequence's unfinished page again, and the next
write goes into it; pages the sequence shares stay untouched:

- shared with another sequence (a fork, a prefix hit): the sequence gets a private page now,
  with a pending copy of the shared one (`apply_pending` makes it before the next write), so
  truncation needs one free page there (CacheFullError otherwise, nothing changed);
- a prefix-cache page only this sequence holds: it leaves the prefix cache (its tail will be
  overwritten, so its digest would lie).

The hash state follows: the digest of the last full page kept and the ids of the unfinished page
come from the token log (`SequenceHashes`), so pages filled again are cached under their real
content. A sequence whose ids there are not known (committed with `advance`, or ids before a
loaded state's unfinished page) stops entering the prefix cache.

``_Rollback`` is a mixin of `PageManager` (manager.py).
"""

from __future__ import annotations

import numpy as np

from easykv.manager.prefix_hash import iter_page_digests, version_root
from easykv.step.metadata import PAD_PAGE
from easykv.validation import integer


class _Rollback:
    """`PageManager.truncate` (see the module doc)."""

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` committed tokens of ``seq_id`` and drop the rest, with the
        pages reserved ahead (see the module doc). ValueError, with nothing changed, for a
        length past the committed one, or one whose tokens the sequence no longer holds (before
        its sliding or chunked window's first kept page, or before a resumed sequence's first)."""
        row = self._row(seq_id)
        self._refuse_swapped(row, "truncate")
        ps, cur = self.page_size, int(self._lens[row])
        new = integer("length", length, lo=0, hi=cur,
                      hint=f"sequence {row} holds {cur} committed tokens; truncate keeps a prefix of them")
        if new < self._floor[row]:
            raise ValueError(f"sequence {row} holds no tokens before position {int(self._floor[row])} (it was resumed "
                             f"there); truncate it to at least that, or release it")
        for g, gt in enumerate(self._groups):
            need = max(int(gt.released_columns(np.array([new]), ps)[0]), int(self._floor[row]) // ps)
            if need < gt.start[row]:
                where = "" if len(self._groups) == 1 else f" of layer group {g}"
                raise ValueError(
                    f"truncating sequence {row} to {new} tokens needs its pages{where} from position {need * ps} on, "
                    f"but its {gt.group.attention} window released those before position {int(gt.start[row]) * ps}; "
                    "truncate to a length whose window starts after them, or release the sequence")
        col, replica = new // ps, int(self._replica[row])
        inside = bool(new % ps) and new < cur  # ends inside a page it wrote past: that page is written again
        shared = [inside and gt.pool.refcount[gt.table[row, col]] > 1 for gt in self._groups]
        for gt, copy in zip(self._groups, shared):
            if copy and not gt.pool.num_available(replica):
                self._raise_full(gt, replica, 1)
        chain = self._chain_at(row, col) if self._hashes.hashable[row] and self.enable_prefix_caching else None
        # Checked: nothing below fails.
        keep, stale = -(-new // ps), self._is_stale(row)
        held = int(self._npages[row])
        for gt, copy in zip(self._groups, shared):
            first = max(keep, int(gt.start[row]))
            gt.release_pages(gt.table[row, first:held][::-1].tolist(), stale=stale)
            gt.table[row, keep:held] = PAD_PAGE
            if not inside:
                continue
            page = int(gt.table[row, col])
            if copy:  # a private page now, filled from the shared one before the next write
                dst = gt.allocate(replica, 1, overwritten=True)[0]
                gt.table[row, col] = dst
                self._counters["copies"] += gt.copy_into(dst, page)
                gt.release_pages([page], stale=stale)
            elif gt.pool.digest_of(page) is not None:
                gt.pool.uncommit(page)
        self._npages[row] = keep
        self._lens[row] = new
        if not keep:  # a sequence is bound to a replica while it holds pages
            self._replica[row] = -1
        if self._hashes.hashable[row] and self.enable_prefix_caching:  # without caching no row knows its ids
            self._hashes.rewind(row, new, chain)

    def _chain_at(self, row: int, full: int) -> bytes | None:
        """The digest of the row's page ``full - 1`` (its version's root for 0): the current
        chain when no full page is dropped, the prefix cache's digest of that page, or computed
        from the logged ids; None when none of these knows it."""
        if full == int(self._lens[row]) // self.page_size:
            return self._hashes.chain[row]
        if full == 0:
            return version_root(self._row_version[row])
        for gt in self._groups:  # the digest the row gave it when it filled it (or matched it)
            page = int(gt.table[row, full - 1])
            if page != PAD_PAGE and gt.pool.digest_of(page) is not None:
                return gt.pool.digest_of(page)
        tokens = self._hashes.ids(row, 0, full * self.page_size)
        if tokens is None:
            return None
        *_, chain = iter_page_digests(tokens, self.page_size, full, self._hashes.salt[row],
                                      version_root(self._row_version[row]))
        return chain


__all__: list[str] = []
