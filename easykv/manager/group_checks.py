"""The invariants of one layer group's table (`GroupTable`) against the sequence table: window
holes, ownership, the pool, the prefix map, copy-on-write and pending work. `check_consistency`
runs them for every group; a broken rule raises `Broken` naming the state field.

Reads the table and the sequences, changes nothing. Imports of the manager: ``broken`` (and the
two parts' types); it never imports ``storage``, ``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from easykv.errors import InvariantError
from easykv.manager.broken import Broken
from easykv.step.metadata import PAD_PAGE

if TYPE_CHECKING:
    from easykv.manager.group_table import GroupTable
    from easykv.manager.sequences import SequenceTable


def _fields(table: GroupTable) -> tuple[str, str, str]:
    """(`` in layer group g``, the pool's state field, the copies' state field)."""
    if table.grouped:
        g = table.index
        return f" in layer group {g}", f"pool[{g}]", f"copies[{g}]"
    return "", "pool", "copies"


def _expected_start(table: GroupTable, seqs: SequenceTable, swapped: np.ndarray) -> np.ndarray:
    """Per row, the columns a sequence has released here: those wholly before the first
    position its next query reads (none for full attention), or before a resumed
    sequence's floor; none of a swapped-out sequence (its row holds nothing)."""
    released = np.minimum(table.released_columns(seqs.lens), seqs.npages)
    start: np.ndarray = np.maximum(released, seqs.floor // table.page_size).astype(table.start.dtype)
    start[swapped] = 0
    return start


def _check_reads(table: GroupTable, seqs: SequenceTable, swapped: np.ndarray) -> None:
    """No page the next query of a claimed sequence reads was released: its first held column
    is at most the first column that query reads, and every column from there to its last
    holds a page. A resumed sequence whose floor still lies inside the window is left out
    (the manager vouches for none of its reads until the window passes the floor)."""
    rows = np.flatnonzero(seqs.active & ~swapped)
    if not rows.size:
        return
    of, _, _ = _fields(table)
    lens, start, npages = seqs.lens[rows], table.start[rows], seqs.npages[rows]
    first = table.first_needed(lens.astype(np.int64))
    need = table.released_columns(lens)
    early = (seqs.floor[rows] <= first) & (start > need)
    if early.any():
        i = int(np.argmax(early))
        row = int(rows[i])
        raise Broken(f"sequences[id={row}].pages",
                     f"sequence {row} of length {int(lens[i])} has released its first {int(start[i])} pages{of}, "
                     f"but its window releases exactly {int(need[i])}: its next query reads from position "
                     f"{int(first[i])} on, in column {int(need[i])}, whose page is gone")
    cols = np.arange(table.table.shape[1])
    gap = (cols >= start[:, None]) & (cols < npages[:, None]) & (table.table[rows] == PAD_PAGE)
    if gap.any():
        i, col = (int(x) for x in np.argwhere(gap)[0])
        raise Broken(f"sequences[id={int(rows[i])}].pages",
                     f"sequence {int(rows[i])} holds no page{of} at column {col}, inside the columns "
                     f"{int(start[i])}..{int(npages[i]) - 1} its queries read")


def check_group(table: GroupTable, seqs: SequenceTable, swapped: np.ndarray, *, caching: bool, scrub: bool) -> None:
    """Raise `Broken` unless ``table``'s pages agree with the sequences ``seqs`` (``swapped``: the
    swapped-out rows): window holes, ownership, the pool, the prefix map, copy-on-write and pending
    work. ``caching``: prefix caching is on; ``scrub``: released pages are zeroed."""
    ps, n, pool = table.page_size, seqs.npages, table.pool
    of, pool_field, _ = _fields(table)
    _check_reads(table, seqs, swapped)
    start = _expected_start(table, seqs, swapped)
    if np.any(table.start != start):
        row = int(np.argmax(table.start != start))
        raise Broken(f"sequences[id={row}].pages", f"sequence {row} of length {int(seqs.lens[row])} has released "
                                                   f"its first {int(table.start[row])} pages{of}, but its window "
                                                   f"releases exactly {int(start[row])}")
    cols = np.arange(table.table.shape[1])
    held = (cols[None, :] < n[:, None]) & (cols[None, :] >= start[:, None])
    if np.any(held != (table.table != PAD_PAGE)):
        raise Broken("sequences", f"a block-table row{of} disagrees with its page count: "
                                  f"{np.argwhere(held != (table.table != PAD_PAGE))[0].tolist()}")
    pages = table.table[held]
    owner_rows = np.nonzero(held)[0]
    if pages.size and np.any(pages // pool.pages_per_replica != seqs.replica[owner_rows]):
        raise Broken("sequences", f"a sequence holds a page{of} outside its data-parallel replica's slice")
    for r in np.flatnonzero(n > 1):
        if np.unique(table.table[r, start[r]: n[r]]).size != n[r] - start[r]:
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
        page = int(table.table[row, col])
        if pool.digest_of(page) is not None and (col + 1) * ps > seqs.lens[row]:
            raise Broken(f"{pool_field}.digests", f"page {page}{of} is in the prefix cache but sequence {row} has "
                                                  "not filled it")
        if pool.digest_of(page) is not None and pool.tag_of(page) != seqs.version[row]:
            raise Broken(f"{pool_field}.versions", f"prefix page {page}{of} was written under another weight "
                                                   f"version than sequence {row}, which holds it")
    if not table.fork_shared(seqs) <= table.shared_partial:
        raise Broken("sequences", f"a partly filled page{of} is shared but copy-on-write does not know it")
    _check_pending(table, seqs, held, caching=caching)


def _check_pending(table: GroupTable, seqs: SequenceTable, held: np.ndarray, *, caching: bool) -> None:
    """Pages joined between sequences continue one history (`SequenceTable.check_joined`): every
    shared page, and every pending copy-on-write, whose destination is the unfinished page of
    every sequence holding it (nothing else reads it yet). A page to scrub is free, or
    reserved by one sequence that has written nothing into it."""
    ps, pool, block_table, lens = table.page_size, table.pool, table.table, seqs.lens
    _, pool_field, copies_field = _fields(table)
    where: dict[int, list[tuple[int, int]]] = {}  # page -> [(row, col)] over every holder
    for row, col in np.argwhere(held).tolist():
        where.setdefault(int(block_table[row, col]), []).append((row, col))
    checked: dict[tuple[int, int], int] = {}
    for page, holders in where.items():
        if len(holders) > 1:
            seqs.check_joined(holders, checked, None, f"page {page} is shared between sequences of different "
                                                      "histories", caching=caching)
    scrub = set(pool.pending_scrubs().tolist())
    for dst, src in table.copies.items():
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
        refilled = table.awaits_data(src)
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


__all__ = ["check_group"]
