"""The PageManager's persisted form, and the one checker of its consistency.

A manager state is JSON (a checkpoint's ``manager.json``, a lock-step fingerprint, a hand-off
between hosts), so it is input like any other: a crafted or damaged state must never become a
manager in which one sequence can touch another's pages. Reading is therefore strict: every
field is type- and range-checked on its own (`read_state`), then the manager built from it must
pass the same consistency rules a live manager is held to (`check_consistency`, which
`PageManager.check_invariants` runs as well). A broken rule raises `Broken` naming the field; a
live manager reports it as an easykv bug (`InvariantError`), a loaded state as bad input
(`ManagerStateError`).

The state is canonical: the same history of calls gives the same state byte for byte, whether
or not the manager was restored on the way (what `assert_lockstep` compares across hosts).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from easykv.errors import ManagerStateError
from easykv.manager.prefix_hash import DIGEST_BYTES, ROOT_DIGEST
from easykv.runtime import PAD_PAGE
from easykv.validation import INT32_MAX, INT64_MAX, boolean, integer, integer_array, show

if TYPE_CHECKING:
    from easykv.manager.manager import PageManager

STATE_FORMAT = "easykv.PageManager/1"
_CONFIG_INTS = ("batch_size", "num_pages_per_layer", "num_pages_per_sequence", "max_sequences", "page_size",
                "page_shards")
_CONFIG_FLAGS = ("enable_prefix_caching", "scrub_released")
COUNTERS = ("prefix_queries", "prefix_hits", "prefix_query_tokens", "prefix_hit_tokens", "copies")
_SEQUENCE_KEYS = ("id", "length", "pages", "replica", "hashable", "chain", "salt", "partial")
_POOL_KEYS = ("free", "lru", "digests", "scrub", "evictions", "scrubs")
_HEX_DIGEST = re.compile(f"[0-9a-f]{{{2 * DIGEST_BYTES}}}")


class Broken(Exception):
    """A consistency rule does not hold; ``field`` names the part of the state it concerns."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def config(metadata: Any, enable_prefix_caching: bool, scrub_released: bool) -> dict[str, Any]:
    """The pool a state belongs to; a sliding or chunked cache adds its window (absent for full
    attention, so the states of uniform caches keep their form)."""
    out = {**{k: int(getattr(metadata, k)) for k in _CONFIG_INTS},
           "enable_prefix_caching": bool(enable_prefix_caching), "scrub_released": bool(scrub_released)}
    group = metadata.groups[0]
    if group.attention != "full":
        out.update(attention=group.attention, window=int(group.window))
    return out


# ---- writing -----------------------------------------------------------------------------------
def write_state(m: PageManager) -> dict[str, Any]:
    """The canonical JSON-safe state of ``m`` (see the module doc)."""
    ps = m.page_size
    sequences = []
    for r in m.active_ids:
        length = int(m._lens[r])
        hashable = bool(m._hashes.hashable[r])
        # A row that stopped hashing keeps stale chain and partial tokens in memory; they are
        # never read again, so the state writes neutral values and stays canonical.
        chain = m._hashes.chain[r] if hashable else ROOT_DIGEST
        partial = m._hashes.partial[r, : length % ps].tolist() if hashable else [0] * (length % ps)
        sequences.append({"id": r, "length": length, "pages": m._table[r, : m._npages[r]].tolist(),
                          "replica": int(m._replica[r]), "hashable": hashable, "chain": chain.hex(),
                          "salt": m._hashes.salt[r].hex(), "partial": partial})
        if m._floor[r]:  # a resumed sequence (only then: other states keep their form)
            sequences[-1]["floor"] = int(m._floor[r])
    return {
        "format": STATE_FORMAT,
        "config": config(m.metadata, m.enable_prefix_caching, m.scrub_released),
        "sequences": sequences,
        "pool": m._pool.state_dict(),
        "copies": [[src, dst] for dst, src in m._copies.items()],
        "counters": dict(m._counters),
    }


# ---- reading -----------------------------------------------------------------------------------
def _fail(field: str, message: str) -> ManagerStateError:
    return ManagerStateError(message, field=field)


def _mapping(value: Any, field: str, keys: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(field, f"must be an object with keys {list(keys)}, got {type(value).__name__}")
    missing = [k for k in keys if k not in value]
    unknown = sorted(str(k) for k in value if k not in keys)
    if missing or unknown:
        raise _fail(field, f"must have exactly the keys {list(keys)}; missing {missing}, unknown {unknown[:8]}")
    return value


def _list(value: Any, field: str, max_len: int | None = None) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(field, f"must be a list, got {type(value).__name__}")
    if max_len is not None and len(value) > max_len:
        raise _fail(field, f"holds {len(value)} entries, more than the {max_len} possible")
    return value


def _int(value: Any, field: str, lo: int, hi: int) -> int:
    try:
        return integer(field, value, lo=lo, hi=hi)
    except ValueError as err:
        raise _fail(field, str(err)) from None


def _ints(value: Any, field: str, lo: int, hi: int, *, unique: bool = False, max_len: int | None = None) -> np.ndarray:
    """A list of JSON ints (never floats or bools) in ``lo..hi`` as int64."""
    items = _list(value, field, max_len)
    for i, item in enumerate(items):  # JSON gives Python objects: refuse 2.0 and true exactly
        if isinstance(item, bool) or not isinstance(item, int):
            raise _fail(f"{field}[{i}]", f"must be an int, got {show(item)}")
    try:
        arr = integer_array(field, items, ndim=1, lo=lo, hi=hi, dtype=np.int64)
    except ValueError as err:
        raise _fail(field, str(err)) from None
    if unique and arr.size != np.unique(arr).size:
        raise _fail(field, f"names page {_first_repeat(arr)} twice")
    return arr


def _first_repeat(arr: np.ndarray) -> int:
    values, counts = np.unique(arr, return_counts=True)
    return int(values[np.argmax(counts > 1)])


def _digest(value: Any, field: str) -> bytes:
    # Lower-case hex only: what write_state writes, so a loaded state writes back identically.
    if not isinstance(value, str) or not _HEX_DIGEST.fullmatch(value):
        raise _fail(field, f"must be {2 * DIGEST_BYTES} lower-case hex digits (a {DIGEST_BYTES}-byte sha256), got "
                           f"{show(value)}")
    return bytes.fromhex(value)


def _flag(value: Any, field: str) -> bool:
    try:
        return boolean(field, value)
    except ValueError as err:
        raise _fail(field, str(err)) from None


@dataclasses.dataclass
class _Sequence:
    id: int
    length: int
    pages: np.ndarray
    replica: int
    hashable: bool
    chain: bytes
    salt: bytes
    partial: np.ndarray
    floor: int


def read_state(m: PageManager, state: Any) -> None:
    """Load ``state`` into the fresh manager ``m`` after checking every field's type and range
    (ManagerStateError). Cross-references are checked by `check_consistency` afterwards."""
    state = _mapping(state, "(top level)", ("format", "config", "sequences", "pool", "copies", "counters"))
    if state["format"] != STATE_FORMAT:
        raise _fail("format", f"is {show(state['format'])}, expected {STATE_FORMAT!r}")
    windowed = isinstance(state["config"], Mapping) and "attention" in state["config"]
    window_keys = ("attention", "window") if windowed else ()
    cfg = _mapping(state["config"], "config", _CONFIG_INTS + _CONFIG_FLAGS + window_keys)
    got = {**{k: _int(cfg[k], f"config.{k}", 1, INT64_MAX) for k in _CONFIG_INTS + (("window",) if windowed else ())},
           **{k: _flag(cfg[k], f"config.{k}") for k in _CONFIG_FLAGS}}
    if windowed:
        got["attention"] = cfg["attention"]
    want = config(m.metadata, got["enable_prefix_caching"], got["scrub_released"])
    if got != want:
        diff = {k: (got.get(k), want.get(k)) for k in {**got, **want} if got.get(k) != want.get(k)}
        raise _fail("config", f"the state was saved for another pool (saved, given): {diff}; restore with the "
                              "metadata it was saved with")
    m.enable_prefix_caching, m.scrub_released = got["enable_prefix_caching"], got["scrub_released"]
    m._pool.scrub_released = m.scrub_released

    pool, b = m._pool, m.batch_size
    n, replicas = pool.num_pages, pool.num_replicas
    sequences = [_read_sequence(m, entry, i) for i, entry in enumerate(_list(state["sequences"], "sequences", b))]
    seen: set[int] = set()
    for seq in sequences:
        if seq.id in seen:
            raise _fail("sequences", f"lists sequence id {seq.id} twice")
        seen.add(seq.id)

    raw_pool = _mapping(state["pool"], "pool", _POOL_KEYS)
    free = [_ints(h, f"pool.free[{r}]", 0, n - 1, unique=True)
            for r, h in enumerate(_list(raw_pool["free"], "pool.free"))]
    lru = [_ints(q, f"pool.lru[{r}]", 0, n - 1, unique=True)
           for r, q in enumerate(_list(raw_pool["lru"], "pool.lru"))]
    for name, lists in (("pool.free", free), ("pool.lru", lru)):
        if len(lists) != replicas:
            raise _fail(name, f"has {len(lists)} lists for {replicas} data-parallel replica(s)")
    digests: list[tuple[int, bytes]] = []
    for i, entry in enumerate(_list(raw_pool["digests"], "pool.digests", n)):
        if not isinstance(entry, list) or len(entry) != 2:
            raise _fail(f"pool.digests[{i}]", f"must be a [page, digest] pair, got {show(entry)}")
        digests.append((_int(entry[0], f"pool.digests[{i}][0]", 0, n - 1), _digest(entry[1], f"pool.digests[{i}][1]")))
    if len({p for p, _ in digests}) != len(digests):
        raise _fail("pool.digests", "gives one page two digests")
    scrub = _ints(raw_pool["scrub"], "pool.scrub", 0, n - 1, unique=True)
    evictions = _int(raw_pool["evictions"], "pool.evictions", 0, INT64_MAX)
    scrubs = _int(raw_pool["scrubs"], "pool.scrubs", 0, INT64_MAX)

    copies: dict[int, int] = {}
    for i, pair in enumerate(_list(state["copies"], "copies", n)):
        if not isinstance(pair, list) or len(pair) != 2:
            raise _fail(f"copies[{i}]", f"must be a [src, dst] page pair, got {show(pair)}")
        src, dst = (_int(p, f"copies[{i}][{j}]", 0, n - 1) for j, p in enumerate(pair))
        if dst in copies:
            raise _fail("copies", f"names destination page {dst} twice")
        copies[dst] = src
    counters_in = _mapping(state["counters"], "counters", COUNTERS)
    counters = {k: _int(counters_in[k], f"counters.{k}", 0, INT64_MAX) for k in COUNTERS}

    # Every field is well-formed: fill the manager (ids and pages are in range, so no write can fail).
    for seq in sequences:
        r, k = seq.id, seq.pages.size
        m._active[r] = True
        m._table[r, :k] = seq.pages
        m._npages[r], m._lens[r], m._replica[r], m._floor[r] = k, seq.length, seq.replica, seq.floor
        hashes = m._hashes
        hashes.hashable[r], hashes.chain[r], hashes.salt[r] = seq.hashable, seq.chain, seq.salt
        hashes.partial[r, : seq.partial.size] = seq.partial
        if not seq.hashable:  # canonical: see write_state
            hashes.chain[r] = ROOT_DIGEST
            hashes.partial[r] = 0
    m._start[:] = [int(np.argmax(m._table[r] != PAD_PAGE)) if np.any(m._table[r] != PAD_PAGE) else m._npages[r]
                   for r in range(m.batch_size)]
    held = m._table[m._table != PAD_PAGE]
    pool.load_state(free=free, lru=lru, digests=digests, scrub=scrub.tolist(), evictions=evictions, scrubs=scrubs,
                    refcount=np.bincount(held, minlength=n))
    m._copies = copies
    m._counters = counters
    m._shared_partial = m._fork_shared_pages()


def _read_sequence(m: PageManager, entry: Any, i: int) -> _Sequence:
    ps = m.page_size
    resumed = isinstance(entry, Mapping) and "floor" in entry
    entry = _mapping(entry, f"sequences[{i}]", _SEQUENCE_KEYS + (("floor",) if resumed else ()))
    where = f"sequences[{i}]"
    sid = _int(entry["id"], f"{where}.id", 0, m.batch_size - 1)
    length = _int(entry["length"], f"{where}.length", 0, m.max_length)
    floor = _int(entry["floor"], f"{where}.floor", 1, length) if resumed else 0
    pages = _ints(entry["pages"], f"{where}.pages", PAD_PAGE, m._pool.num_pages - 1, max_len=m.pages_per_sequence)
    holes = int(np.argmax(pages != PAD_PAGE)) if np.any(pages != PAD_PAGE) else pages.size
    if np.any(pages[holes:] == PAD_PAGE):
        raise _fail(f"{where}.pages", "has a released page (-1) after a held one; only the pages before a window "
                                      "are released")
    if np.unique(pages[holes:]).size != pages.size - holes:
        raise _fail(f"{where}.pages", "names a page twice")
    if pages.size * ps < length:
        raise _fail(f"{where}.pages", f"holds {pages.size} pages of {ps} tokens, too few for length {length}")
    replica = _int(entry["replica"], f"{where}.replica", -1, m._pool.num_replicas - 1)
    partial = _ints(entry["partial"], f"{where}.partial", 0, INT32_MAX, max_len=ps)
    if partial.size != length % ps:
        raise _fail(f"{where}.partial", f"holds {partial.size} token ids; a sequence of length {length} has "
                                        f"{length % ps} in its unfinished page")
    return _Sequence(id=sid, length=length, pages=pages, replica=replica,
                     hashable=_flag(entry["hashable"], f"{where}.hashable"),
                     chain=_digest(entry["chain"], f"{where}.chain"), salt=_digest(entry["salt"], f"{where}.salt"),
                     partial=partial, floor=floor)


# ---- the consistency rules -------------------------------------------------------------------------
def check_consistency(m: PageManager) -> None:
    """Raise `Broken` unless ``m``'s bookkeeping is consistent (see `PageManager.check_invariants`)."""
    ps, n, pool = m.page_size, m._npages, m._pool
    cols = np.arange(m.pages_per_sequence)
    columns = cols[None, :] < n[:, None]
    if np.any(columns & ~m._active[:, None]) or np.any(m._lens[~m._active]):
        raise Broken("sequences", "a released sequence id still holds pages or tokens")
    _check_floors(m)
    start = _window_start(m)
    if np.any(m._start != start):
        row = int(np.argmax(m._start != start))
        raise Broken(f"sequences[id={row}].pages", f"sequence {row} of length {int(m._lens[row])} has released its "
                                                   f"first {int(m._start[row])} pages, but its window releases "
                                                   f"exactly {int(start[row])}")
    held = columns & (cols[None, :] >= start[:, None])
    if np.any(held != (m._table != PAD_PAGE)):
        raise Broken("sequences", f"a block-table row disagrees with its page count: "
                                  f"{np.argwhere(held != (m._table != PAD_PAGE))[0].tolist()}")
    if np.any(m._lens > n * ps) or np.any(m._lens > m.max_length):
        raise Broken("sequences", "a sequence holds more tokens than its pages or max_sequences allow")
    bound = m._replica >= 0
    if np.any(bound != (n > 0)):
        row = int(np.argmax(bound != (n > 0)))
        raise Broken(f"sequences[id={row}].replica", f"sequence {row} holds {int(n[row])} pages but replica "
                                                     f"{int(m._replica[row])}; a sequence is bound to a replica "
                                                     "exactly when it holds pages")
    pages = m._table[held]
    owner_rows = np.nonzero(held)[0]
    if pages.size and np.any(pages // pool.pages_per_replica != m._replica[owner_rows]):
        raise Broken("sequences", "a sequence holds a page outside its data-parallel replica's slice")
    for row in np.flatnonzero(n > 1):
        if np.unique(m._table[row, start[row]: n[row]]).size != n[row] - start[row]:
            raise Broken(f"sequences[id={row}].pages", f"sequence {row} holds a page twice")
    pool.check(np.bincount(pages, minlength=pool.num_pages).astype(np.int32))
    if not m.enable_prefix_caching and (pool.num_cached() or any(pool.digest_of(p) is not None for p in range(pool.num_pages))):
        raise Broken("pool.digests", "prefix caching is off but pages carry digests")
    if not m.scrub_released and pool.has_pending_scrubs():
        raise Broken("pool.scrub", "pages are to be scrubbed but the manager does not scrub released pages")
    salt_of: dict[int, bytes] = {}
    for row, col in np.argwhere(held):
        page = int(m._table[row, col])
        if pool.digest_of(page) is not None and (col + 1) * ps > m._lens[row]:
            raise Broken("pool.digests", f"page {page} is in the prefix cache but sequence {row} has not filled it")
        if salt_of.setdefault(page, m._hashes.salt[row]) != m._hashes.salt[row]:
            raise Broken(f"sequences[id={row}].salt", f"page {page} is shared between sequences with different salts")
    _check_chains(m)
    if not m._fork_shared_pages() <= m._shared_partial:
        raise Broken("sequences", "a partly filled page is shared but copy-on-write does not know it")
    _check_pending(m, held)


def _window_start(m: PageManager) -> np.ndarray:
    """Per row, the columns a sequence has released: those wholly before the first position its
    next query reads (none for full attention), or before a resumed sequence's floor."""
    released = np.minimum(m._released_columns(m._lens), m._npages)
    return np.maximum(released, m._floor // m.page_size).astype(m._start.dtype)


def _check_floors(m: PageManager) -> None:
    """A floor (a resumed sequence's first position with K/V) is a page boundary at most its
    length, in a sliding or chunked cache, of a sequence that does not hash, and only while its
    window still reaches before it (then it is forgotten)."""
    ps = m.page_size
    for row in np.flatnonzero(m._floor).tolist():
        floor, length = int(m._floor[row]), int(m._lens[row])
        where = f"sequences[id={row}].floor"
        if m.window_group is None:
            raise Broken(where, f"sequence {row} has floor {floor}, but a full-attention cache reads every position")
        if floor % ps or floor > length or m._hashes.hashable[row]:
            raise Broken(where, f"floor {floor} of sequence {row} (length {length}) must be a multiple of "
                                f"page_size={ps}, at most its length, on a sequence that does not hash")
        if floor // ps <= int(m._released_columns(np.array([length]))[0]):
            raise Broken(where, f"sequence {row}'s window (length {length}) has moved past its floor {floor}; the "
                                "floor is forgotten then")


def _check_chains(m: PageManager) -> None:
    """A hashing sequence's chain digest is its last full page's digest (when that page is in
    the prefix cache), or the root before its first full page."""
    ps, pool = m.page_size, m._pool
    for row in np.flatnonzero(m._active & m._hashes.hashable).tolist():
        full = int(m._lens[row]) // ps
        chain = m._hashes.chain[row]
        if full == 0:
            if chain != ROOT_DIGEST:
                raise Broken(f"sequences[id={row}].chain", f"sequence {row} has no full page but a chain digest "
                                                          "other than the root")
            continue
        last = int(m._table[row, full - 1])
        digest = pool.digest_of(last) if last != PAD_PAGE else None  # released from the window: not checkable
        if digest is not None and digest != chain:
            raise Broken(f"sequences[id={row}].chain", f"sequence {row}'s chain digest differs from the digest of "
                                                      f"its last full page {int(m._table[row, full - 1])}")


def _check_pending(m: PageManager, held: np.ndarray) -> None:
    """Pending device work touches only pages it may: a copy-on-write destination is the
    unfinished page of every sequence holding it (nothing else reads it yet); a page to scrub
    is free, or reserved by one sequence that has written nothing into it."""
    ps, pool = m.page_size, m._pool
    where = {}  # page -> [(row, col)] over every holder
    for row, col in np.argwhere(held).tolist():
        where.setdefault(int(m._table[row, col]), []).append((row, col))
    scrub = set(pool.pending_scrubs().tolist())
    for dst, src in m._copies.items():
        field = f"copies[dst={dst}]"
        if src == dst:
            raise Broken(field, f"copy {src} -> {dst} copies a page onto itself")
        if pool.replica_of(src) != pool.replica_of(dst):
            raise Broken(field, f"copy {src} -> {dst} crosses data-parallel replicas")
        if dst in scrub:
            raise Broken(field, f"page {dst} is both a copy destination and a page to scrub")
        holders = where.get(dst, [])
        if not holders or pool.digest_of(dst) is not None:
            raise Broken(field, f"copy {src} -> {dst} targets page {dst}, which no sequence holds as its own "
                                "unfinished page")
        # A copy-on-write copy is pending from the moment a sequence that shared a partly filled
        # page (a fork) reserves room in it until the copy is applied, and no commit touches
        # either page meanwhile. So every holder of the destination, and every holder of the
        # source that has written into it, has the same length, the page at the same column,
        # and the same pages before it: anything else would copy one sequence's tokens into
        # another's page. (A source freed and taken again as another copy's destination is
        # read before that copy writes it: its new holders' tokens are not in it yet.)
        length = int(m._lens[holders[0][0]])
        col = length // ps
        before = m._table[holders[0][0], :col]
        if length % ps == 0:
            raise Broken(field, f"copy {src} -> {dst} would overwrite page {dst}, which sequence {holders[0][0]} "
                                f"holds with {length} tokens written (a full page, not an unfinished one)")
        writers = [] if src in m._copies else [(r, c) for r, c in where.get(src, []) if c * ps < int(m._lens[r])]
        partial = None  # the unfinished page's token ids, where the sequences know them
        for row, c in holders + writers:
            if int(m._lens[row]) != length or c != col or not np.array_equal(m._table[row, :col], before):
                raise Broken(field, f"copy {src} -> {dst} joins pages of sequences with different histories "
                                    f"(sequence {row} holds page {m._table[row, c]} at column {c} with "
                                    f"{int(m._lens[row])} tokens; sequence {holders[0][0]} holds page {dst} at "
                                    f"column {col} with {length})")
            if m._hashes.hashable[row]:
                tokens = m._hashes.partial[row, : length % ps]
                if partial is not None and not np.array_equal(tokens, partial):
                    raise Broken(field, f"copy {src} -> {dst} joins unfinished pages holding different tokens "
                                        f"(sequence {row}: {tokens.tolist()}, another: {partial.tolist()})")
                partial = tokens
    for page in sorted(scrub):
        holders = where.get(page, [])
        if not holders:
            continue  # free: zeroing it harms nobody
        (row, col), *others = holders
        if others or pool.digest_of(page) is not None or col * ps < int(m._lens[row]):
            raise Broken("pool.scrub", f"page {page} is to be zeroed but holds written tokens of sequence {row} "
                                       f"(column {col}){' and is shared' if others else ''}")


# ---- what a checkpoint records of a state ------------------------------------------------------
def summarize_state(state: Any) -> dict[str, int] | None:
    """The counts a checkpoint records (and ``inspect_checkpoint`` shows) of a state: active
    sequences, committed tokens, free, cached and prefix-cached pages. None when the state is too
    malformed to count (`PageManager.from_state_dict` then names the bad field)."""
    try:
        seqs, pool = state["sequences"], state["pool"]
        out = {"active_sequences": len(seqs), "tokens": sum(s["length"] for s in seqs),
               "free_pages": sum(len(h) for h in pool["free"]), "cached_pages": sum(len(q) for q in pool["lru"]),
               "prefix_pages": len(pool["digests"])}
    except (KeyError, TypeError, IndexError, AttributeError):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in out.values()):
        return None
    return out


def max_state_bytes(meta: Any) -> int:
    """The most bytes a state of ``meta``'s pool can take in JSON: every page id a few times
    (tables, free and cached lists, digests) plus a sequence's fields per slot."""
    return (1 << 20) + 256 * (meta.num_pages_per_layer + meta.batch_size * (meta.num_pages_per_sequence + 64))


# ---- re-splitting over data-parallel replicas -------------------------------------------------------
def reshard_state(state: Mapping[str, Any], new_shards: int) -> dict[str, Any]:
    """A (validated, canonical) state for ``new_shards`` page slices instead of its own.

    Each replica owns the slice ``[r * n, (r + 1) * n)`` of page ids; a sequence's pages (and a
    pending copy-on-write pair) must lie in one slice of the target, else ValueError. Free and
    cached pages move to the slice that now holds them; where two old slices cached the same
    prefix, the new slice keeps one page per digest (the lowest used page, else the least
    recently released cached one) and the others lose their digest (scrubbed before reuse when
    the manager scrubs).
    """
    state = copy.deepcopy(dict(state))
    old_shards, num_pages = state["config"]["page_shards"], state["config"]["num_pages_per_layer"]
    if old_shards == new_shards:
        return state
    per = num_pages // new_shards

    def replica(page: int) -> int:
        return int(page) // per

    what = (f"the target splits the pool of {num_pages} pages into {new_shards} data-parallel slices of {per} "
            f"pages (saved with {old_shards})")
    old_per = num_pages // old_shards
    for seq in state["sequences"]:
        reps = sorted({replica(p) for p in seq["pages"] if p != PAD_PAGE})  # holes: released from a window
        if len(reps) > 1:
            raise ValueError(
                f"{what}, which would put sequence {seq['id']}'s pages {seq['pages']} in replicas {reps}; a "
                f"sequence's pages must stay in one replica's slice. Use page_shards={old_shards} (or a divisor of "
                "it), or release/export that sequence first")
        if reps:
            seq["replica"] = reps[0]
        elif seq["replica"] >= 0:  # every page it held left the window: it stays where its slice now lies
            seq["replica"] = replica(seq["replica"] * old_per)
    for src, dst in state["copies"]:
        if replica(src) != replica(dst):
            raise ValueError(f"{what}, which would split the pending copy-on-write of page {src} -> {dst} across "
                             f"replicas; apply the manager's pending copies (apply_pending) first, or keep "
                             f"page_shards={old_shards}")
    pool = state["pool"]
    refcount = np.zeros(num_pages, np.int64)
    for seq in state["sequences"]:
        pages = np.asarray(seq["pages"], np.int64)
        np.add.at(refcount, pages[pages != PAD_PAGE], 1)
    digest_of = {int(p): d for p, d in pool["digests"]}
    lru_all = [int(p) for q in pool["lru"] for p in q]  # slice order, then each slice's LRU order
    lru_rank = {p: i for i, p in enumerate(lru_all)}
    keep: dict[tuple[int, str], int] = {}
    for page in sorted(digest_of, key=lambda p: (refcount[p] == 0, lru_rank.get(p, -1), p)):
        keep.setdefault((replica(page), digest_of[page]), page)
    kept = set(keep.values())
    lru = [p for p in lru_all if p in kept]
    freed = [p for p in lru_all if p not in kept]
    free = sorted([int(p) for h in pool["free"] for p in h] + freed)
    scrub = list(pool["scrub"])
    if state["config"]["scrub_released"]:  # like an eviction: zero before reuse
        known = set(scrub)
        scrub += [p for p in freed if p not in known]
    pool["free"] = [[p for p in free if replica(p) == r] for r in range(new_shards)]
    pool["lru"] = [[p for p in lru if replica(p) == r] for r in range(new_shards)]
    pool["digests"] = [[p, d] for p, d in sorted(digest_of.items()) if p in kept]
    pool["scrub"] = scrub
    state["config"]["page_shards"] = new_shards
    return state


__all__ = ["Broken", "COUNTERS", "STATE_FORMAT", "check_consistency", "config", "max_state_bytes", "read_state",
           "reshard_state", "summarize_state", "write_state"]
