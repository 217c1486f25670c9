"""Dropping a sequence's tail: `truncate` (speculative decoding's rejected draft tokens, beam
pruning, a rollout rewound to its prompt), and `give_back_reserved` (pages reserved ahead that
a multi-step decode plan's stopped sequence never wrote).

The pages wholly past the new length go back to their pool (or the prefix cache, as on release).
The page the new length ends inside becomes the sequence's unfinished page again, and the next
write goes into it; pages the sequence shares stay untouched:

- shared with another sequence (a fork, a prefix hit): the sequence gets a private page now,
  with a pending copy of the shared one (the next plan's work carries it before the next write), so
  truncation needs one free page there (CacheFullError otherwise, nothing changed);
- a prefix-cache page only this sequence holds: it leaves the prefix cache (its tail will be
  overwritten, so its digest would lie).

The hash state follows: the digest of the last full page kept and the ids of the unfinished page
come from the token log (`SequenceHashes`), so pages filled again are cached under their real
content. A sequence whose ids there are not known (committed without ids, or ids before a
loaded state's unfinished page) stops entering the prefix cache.

Coordinator code over the parts it is handed (the sequence table, the group allocators, the pending
work). Imports ``prefix_hash`` of the manager; never ``storage``, ``attention``, ``checkpoint`` or
``tiers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from easykv.manager.prefix_hash import iter_page_digests, version_root
from easykv.step.metadata import PAD_PAGE
from easykv.validation import integer

if TYPE_CHECKING:
    from easykv.manager.coordinator import GroupCoordinator
    from easykv.manager.device_work import CopyCounter
    from easykv.manager.sequences import SequenceTable


def truncate(seqs: SequenceTable, groups: GroupCoordinator, counter: CopyCounter, row: int, length: int, *,
             caching: bool, current: bytes | None) -> None:
    """`PageManager.truncate` of the claimed, not swapped-out ``row`` (see the module doc);
    ``current``: the current weight version."""
    ps, cur = seqs.page_size, int(seqs.lens[row])
    new = integer("length", length, lo=0, hi=cur,
                  hint=f"sequence {row} holds {cur} committed tokens; truncate keeps a prefix of them")
    floor = int(seqs.floor[row])
    if new < floor:
        raise ValueError(f"sequence {row} holds no tokens before position {floor} (it was resumed "
                         f"there); truncate it to at least that, or release it")
    for table in groups:
        need = max(int(table.released_columns(np.array([new]))[0]), floor // ps)
        if need < table.start[row]:
            raise ValueError(
                f"truncating sequence {row} to {new} tokens needs its pages{table.label} from position {need * ps} on, "
                f"but its {table.group.attention} window released those before position {int(table.start[row]) * ps}; "
                "truncate to a length whose window starts after them, or release the sequence")
    col, replica = new // ps, int(seqs.replica[row])
    inside = bool(new % ps) and new < cur  # ends inside a page it wrote past: that page is written again
    shared = [inside and table.pool.refcount[table.table[row, col]] > 1 for table in groups]
    for table, copy in zip(groups, shared):
        if copy and not table.pool.num_available(replica):
            table.raise_full(replica, 1)
    hashing = bool(seqs.hashes.hashable[row]) and caching  # without caching no row knows its ids
    chain = _chain_at(seqs, groups, row, col) if hashing else None
    # Checked: nothing below fails.
    keep, stale = -(-new // ps), seqs.version[row] != current
    held = int(seqs.npages[row])
    for table, copy in zip(groups, shared):
        table.drop_columns(row, keep, held, stale=stale)
        if not inside:
            continue
        page = int(table.table[row, col])
        if copy:  # a private page now, filled from the shared one before the next write
            counter.count(table.copy_on_write(row, col, replica))
        elif table.pool.digest_of(page) is not None:
            table.pool.uncommit(page)
    seqs.rewind(row, new, keep)
    if hashing:
        seqs.hashes.rewind(row, new, chain)


def give_back_reserved(seqs: SequenceTable, groups: GroupCoordinator, rows: np.ndarray, *,
                       current: bytes | None, keep: np.ndarray) -> None:
    """Return the pages ``rows`` reserved ahead but never wrote into (those wholly past each row's
    length, and past its ``keep`` columns) to their pools: a multi-step decode plan's steps that
    a stopped sequence did not run (``keep``: the columns it held before the plan)."""
    ps = seqs.page_size
    keep = np.maximum(-(-seqs.lens[rows] // ps), keep)
    for i in np.flatnonzero(seqs.npages[rows] > keep).tolist():
        row, kept, held = int(rows[i]), int(keep[i]), int(seqs.npages[rows[i]])
        stale = seqs.version[row] != current
        for table in groups:
            table.drop_columns(row, kept, held, stale=stale)
        seqs.keep_columns(row, kept)


def _chain_at(seqs: SequenceTable, groups: GroupCoordinator, row: int, full: int) -> bytes | None:
    """The digest of the row's page ``full - 1`` (its version's root for 0): the current
    chain when no full page is dropped, the prefix cache's digest of that page, or computed
    from the logged ids; None when none of these knows it."""
    ps, hashes = seqs.page_size, seqs.hashes
    if full == int(seqs.lens[row]) // ps:
        return hashes.chain[row]
    if full == 0:
        return version_root(seqs.version[row])
    for table in groups:  # the digest the row gave it when it filled it (or matched it)
        page = int(table.table[row, full - 1])
        if page != PAD_PAGE and table.pool.digest_of(page) is not None:
            return table.pool.digest_of(page)
    tokens = hashes.ids(row, 0, full * ps)
    if tokens is None:
        return None
    *_, chain = iter_page_digests(tokens, ps, full, hashes.salt[row], version_root(seqs.version[row]))
    return chain


__all__ = ["give_back_reserved", "truncate"]
