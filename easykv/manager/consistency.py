"""The one checker of a PageManager's consistency, for a live manager
(`PageManager.check_invariants`: a broken rule is an easykv bug) and for one built from a saved
state (`PageManager.from_state_dict`: a broken rule is bad input). `Broken` names the state field
a rule concerns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from easykv.errors import InvariantError
from easykv.manager.group_table import GroupTable
from easykv.manager.prefix_hash import iter_page_digests, version_root
from easykv.step.metadata import PAD_PAGE

if TYPE_CHECKING:
    from easykv.manager.manager import PageManager


class Broken(Exception):
    """A consistency rule does not hold; ``field`` names the part of the state it concerns."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def check_consistency(m: PageManager) -> None:
    """Raise `Broken` unless ``m``'s bookkeeping is consistent (see `PageManager.check_invariants`)."""
    ps, n = m.page_size, m._npages
    swapped = np.zeros(m.batch_size, bool)
    swapped[list(m._swapped)] = True
    if np.any(swapped & ((n > 0) | ~m._active)):
        raise Broken("sequences", "a swapped-out sequence holds device pages, or is not claimed")
    cols = np.arange(m.pages_per_sequence)
    columns = cols[None, :] < n[:, None]
    if np.any(columns & ~m._active[:, None]) or np.any(m._lens[~m._active]):
        raise Broken("sequences", "a released sequence id still holds pages or tokens")
    _check_floors(m)
    if np.any((m._lens > n * ps) & ~swapped) or np.any(m._lens > m.max_length):
        raise Broken("sequences", "a sequence holds more tokens than its pages or max_sequences allow")
    bound = m._replica >= 0
    if np.any(bound != (n > 0)):
        row = int(np.argmax(bound != (n > 0)))
        raise Broken(f"sequences[id={row}].replica", f"sequence {row} holds {int(n[row])} pages but replica "
                                                     f"{int(m._replica[row])}; a sequence is bound to a replica "
                                                     "exactly when it holds pages")
    for g, gt in enumerate(m._groups):
        _check_group(m, g, gt, columns)
        if gt.host is not None:
            _check_host(m, g, gt)
    _check_chains(m)


def _check_group(m: PageManager, g: int, gt: GroupTable, columns: np.ndarray) -> None:
    """The rules of one layer group's pages: window holes, ownership, the pool, the prefix map,
    copy-on-write and pending work."""
    ps, n, pool = m.page_size, m._npages, gt.pool
    grouped = len(m._groups) > 1
    of = f" in layer group {g}" if grouped else ""
    pool_field = f"pool[{g}]" if grouped else "pool"
    cols = np.arange(m.pages_per_sequence)
    start = _window_start(m, gt)
    if np.any(gt.start != start):
        row = int(np.argmax(gt.start != start))
        raise Broken(f"sequences[id={row}].pages", f"sequence {row} of length {int(m._lens[row])} has released its "
                                                   f"first {int(gt.start[row])} pages{of}, but its window releases "
                                                   f"exactly {int(start[row])}")
    held = columns & (cols[None, :] >= start[:, None])
    if np.any(held != (gt.table != PAD_PAGE)):
        raise Broken("sequences", f"a block-table row{of} disagrees with its page count: "
                                  f"{np.argwhere(held != (gt.table != PAD_PAGE))[0].tolist()}")
    pages = gt.table[held]
    owner_rows = np.nonzero(held)[0]
    if pages.size and np.any(pages // pool.pages_per_replica != m._replica[owner_rows]):
        raise Broken("sequences", f"a sequence holds a page{of} outside its data-parallel replica's slice")
    for row in np.flatnonzero(n > 1):
        if np.unique(gt.table[row, start[row]: n[row]]).size != n[row] - start[row]:
            raise Broken(f"sequences[id={row}].pages", f"sequence {row} holds a page{of} twice")
    try:
        pool.check(np.bincount(pages, minlength=pool.num_pages).astype(np.int32))
    except InvariantError as err:
        raise Broken(pool_field, err.detail) from None
    if not m.enable_prefix_caching and (pool.num_cached() or any(pool.digest_of(p) is not None for p in range(pool.num_pages))):
        raise Broken(f"{pool_field}.digests", "prefix caching is off but pages carry digests")
    if not m.scrub_released and pool.has_pending_scrubs():
        raise Broken(f"{pool_field}.scrub", "pages are to be scrubbed but the manager does not scrub released pages")
    for row, col in np.argwhere(held):
        page = int(gt.table[row, col])
        if pool.digest_of(page) is not None and (col + 1) * ps > m._lens[row]:
            raise Broken(f"{pool_field}.digests", f"page {page}{of} is in the prefix cache but sequence {row} has not "
                                                  "filled it")
        if pool.digest_of(page) is not None and pool.tag_of(page) != m._row_version[row]:
            raise Broken(f"{pool_field}.versions", f"prefix page {page}{of} was written under another weight version "
                                                   f"than sequence {row}, which holds it")
    if not m._fork_shared_pages(gt) <= gt.shared_partial:
        raise Broken("sequences", f"a partly filled page{of} is shared but copy-on-write does not know it")
    _check_pending(m, gt, held, f"copies[{g}]" if grouped else "copies", pool_field)


def _window_start(m: PageManager, gt: GroupTable) -> np.ndarray:
    """Per row, the columns a sequence has released in ``gt``: those wholly before the first
    position its next query reads there (none for full attention), or before a resumed
    sequence's floor."""
    released = np.minimum(gt.released_columns(m._lens, m.page_size), m._npages)
    start = np.maximum(released, m._floor // m.page_size).astype(gt.start.dtype)
    start[list(m._swapped)] = 0  # a swapped-out sequence's row holds nothing
    return start


def _check_floors(m: PageManager) -> None:
    """A floor (a resumed sequence's first position with K/V) is a page boundary at most its
    length, in a cache whose groups are all sliding or chunked, of a sequence that does not
    hash, and only while a window still reaches before it (then it is forgotten)."""
    ps = m.page_size
    for row in np.flatnonzero(m._floor).tolist():
        floor, length = int(m._floor[row]), int(m._lens[row])
        where = f"sequences[id={row}].floor"
        if not all(gt.windowed for gt in m._groups):
            raise Broken(where, f"sequence {row} has floor {floor}, but a full-attention layer group reads every "
                                "position")
        if floor % ps or floor > length or m._hashes.hashable[row]:
            raise Broken(where, f"floor {floor} of sequence {row} (length {length}) must be a multiple of "
                                f"page_size={ps}, at most its length, on a sequence that does not hash")
        if floor // ps <= min(int(gt.released_columns(np.array([length]), ps)[0]) for gt in m._groups):
            raise Broken(where, f"sequence {row}'s window (length {length}) has moved past its floor {floor}; the "
                                "floor is forgotten then")


def _check_chains(m: PageManager) -> None:
    """A hashing sequence's chain digest is its last full page's digest (in every group whose
    prefix cache holds that page), or the root of its weight version before its first full page.
    Where it knows its ids from position 0, they give its chain and name every full page it holds
    in the prefix cache."""
    ps = m.page_size
    for row in np.flatnonzero(m._active & m._hashes.hashable).tolist():
        full = int(m._lens[row]) // ps
        chain, root = m._hashes.chain[row], version_root(m._row_version[row])
        if full == 0 and chain != root:
            raise Broken(f"sequences[id={row}].chain", f"sequence {row} has no full page but a chain digest "
                                                      "other than the root of its weight version")
        digests = [None] * full
        if full:
            digests[-1] = chain
        if m.enable_prefix_caching and m._hashes.known[row] == 0:
            digests = list(iter_page_digests(m._hashes.log[row, : full * ps], ps, full, m._hashes.salt[row], root))
        for gt in m._groups:
            for col, want in enumerate(digests):
                page = int(gt.table[row, col])
                digest = gt.pool.digest_of(page) if want is not None and page != PAD_PAGE else None
                if digest is not None and digest != want:  # released from the window, or not cached: not checkable
                    raise Broken(f"sequences[id={row}].chain", f"sequence {row}'s chain digest differs from the digest "
                                                              f"of its full page {page} (column {col})")
        if full and digests[-1] != chain:
            raise Broken(f"sequences[id={row}].chain", f"sequence {row}'s chain digest is not the one its token ids "
                                                      "give")


def _check_pending(m: PageManager, gt: GroupTable, held: np.ndarray, copies_field: str, pool_field: str) -> None:
    """Pages joined between sequences continue one history (`_check_joined`): every shared
    page, and every pending copy-on-write, whose destination is the unfinished page of every
    sequence holding it (nothing else reads it yet). A page to scrub is free, or reserved by one
    sequence that has written nothing into it."""
    ps, pool, table = m.page_size, gt.pool, gt.table
    where = {}  # page -> [(row, col)] over every holder
    for row, col in np.argwhere(held).tolist():
        where.setdefault(int(table[row, col]), []).append((row, col))
    checked: dict[tuple[int, int], int] = {}
    for page, holders in where.items():
        if len(holders) > 1:
            _check_joined(m, holders, checked, None, f"page {page} is shared between sequences of different histories")
    scrub = set(pool.pending_scrubs().tolist())
    for dst, src in gt.copies.items():
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
        length = int(m._lens[first])
        if length % ps == 0 or any(int(m._lens[row]) != length or c != length // ps for row, c in holders):
            raise Broken(field, f"copy {src} -> {dst} would overwrite page {dst}, which sequence {first} "
                                f"holds with {length} tokens written (not an unfinished page of every holder)")
        # A copy is pending from the moment a sequence that shared a partly filled page (a fork)
        # reserves room in it, or a truncated sequence ends inside a page it shares, until it is
        # applied: the destination's holders and the source's writers shared the source then.
        # (A source freed and taken again as another copy's or an onload's destination is read
        # before that one writes it: its new holders' tokens are not in it yet.)
        refilled = src in gt.copies or src in gt.onloads
        writers = [] if refilled else [(r, c) for r, c in where.get(src, []) if c * ps < int(m._lens[r])]
        _check_joined(m, holders + writers, checked, field,
                      f"copy {src} -> {dst} joins pages of sequences with different histories")
    for page in sorted(scrub):
        holders = where.get(page, [])
        if not holders:
            continue  # free: zeroing it harms nobody
        (row, col), *others = holders
        if others or pool.digest_of(page) is not None or col * ps < int(m._lens[row]):
            raise Broken(f"{pool_field}.scrub", f"page {page} is to be zeroed but holds written tokens of sequence {row} "
                                       f"(column {col}){' and is shared' if others else ''}")


def _check_joined(m: PageManager, members: list[tuple[int, int]], checked: dict[tuple[int, int], int],
                  field: str | None, what: str) -> None:
    """Sequences joined at one page (``members``: (row, column) of each) continue one history,
    the one rule for sharing and copying alike, which a live manager and a loaded state both
    meet: the page at one column, one salt and one weight version, and the same token ids
    wherever two of them know them (a fork shares its parent's pages; a prefix hit or a swap-in
    shares a page by a digest that names its whole history). Their earlier pages may differ: a
    page filled while another already held its digest stays private, a later hit shares that
    one. ``checked``: (row, row) -> ids compared so far (a shared prefix compares once).
    ``field``: the state field to blame (None: the sequence's own field that differs)."""
    ps, hashes = m.page_size, m._hashes
    (first, col), *_ = members
    for row, c in members:
        differ = ("columns" if c != col else "salts" if hashes.salt[row] != hashes.salt[first]
                  else "weight versions" if m._row_version[row] != m._row_version[first] else None)
        if differ:
            own = {"columns": "pages", "salts": "salt", "weight versions": "version"}[differ]
            raise Broken(field or f"sequences[id={row}].{own}",
                         f"{what}: sequences {first} and {row} hold it with different {differ} (columns {col} and {c})")
    if not m.enable_prefix_caching:  # no row keeps its ids then
        return
    ends = {row: min(int(m._lens[row]), (col + 1) * ps) for row, _ in members}
    known = [row for row, _ in members if hashes.hashable[row] and int(hashes.known[row]) < ends[row]]
    if len(known) < 2:
        return
    ref = min(known, key=lambda r: (int(hashes.known[r]), -ends[r]))  # knows the most: spans every other's
    for row in known:
        lo, hi = max(int(hashes.known[row]), int(hashes.known[ref])), min(ends[row], ends[ref])
        if row == ref or hi <= lo or checked.get((ref, row), 0) >= hi:
            continue
        a, b = hashes.log[ref, lo:hi], hashes.log[row, lo:hi]
        if not np.array_equal(a, b):
            at = lo + int(np.argmax(a != b))
            own = "tokens" if hashes.known[row] == 0 else "partial"
            raise Broken(field or f"sequences[id={row}].{own}",
                         f"{what}: they hold different tokens (sequence {row} token {int(b[at - lo])} at position "
                         f"{at}, sequence {ref} token {int(a[at - lo])})")
        checked[ref, row] = hi


def _check_host(m: PageManager, g: int, gt: GroupTable) -> None:
    """The host tier of one group: its pool agrees with its holders (swapped-out sequences and
    pending transfers), swapped sequences hold what their length needs, transfers stay in a
    replica and touch pages they may."""
    of = f" in layer group {g}" if len(m._groups) > 1 else ""
    host, pool, ps = gt.host, gt.pool, m.page_size
    holders: list[int] = []
    for row, record in m._swapped.items():
        pages = record.pages[g]
        want = record.npages - record.starts[g]
        if len(pages) != want or record.npages != -(-int(m._lens[row]) // ps):
            raise Broken(f"sequences[id={row}].swapped", f"swapped-out sequence {row} of length {int(m._lens[row])} "
                                                         f"holds {len(pages)} host pages{of} for {record.npages} columns")
        if any(host.replica_of(h) != record.replica for h in pages):
            raise Broken(f"sequences[id={row}].swapped", f"swapped-out sequence {row} holds a host page{of} outside "
                                                         f"replica {record.replica}")
        holders += pages
    for h, (src, digest, _) in gt.offloads.items():
        if host.replica_of(h) != pool.replica_of(src) or host.digest_of(h) is not None:
            raise Broken("host", f"offload {src} -> host page {h}{of} crosses replicas or targets a cached host page")
    for dst, h in gt.onloads.items():
        if host.replica_of(h) != pool.replica_of(dst) or (pool.refcount[dst] == 0 and pool.digest_of(dst) is None):
            raise Broken("host", f"onload host page {h} -> {dst}{of} crosses replicas or fills a free page")
        if dst in gt.copies or host.digest_of(h) != pool.digest_of(dst) and pool.digest_of(dst) is not None:
            raise Broken("host", f"onload host page {h} -> {dst}{of} disagrees with the device page's copy or digest")
    holders += list(gt.offloads) + list(gt.onloads.values())
    try:
        host.check(np.bincount(np.asarray(holders, np.int64), minlength=host.num_pages).astype(np.int32))
    except InvariantError as err:
        raise Broken("host", f"host tier{of}: {err.detail}") from None


__all__ = ["Broken", "check_consistency"]
