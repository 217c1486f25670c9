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

A manager of one layer group writes format 1 (``pages`` a list per sequence, one ``pool``, one
``copies`` list); one of several groups writes format 2, where each of those is a list with one
entry per group (groups have their own pools) and ``config.groups`` names each group's pool.
Once a weight version was set (`PageManager.set_weight_version`), either format adds
``versions`` (the current one and every one known, with its lookups), each sequence's
``version`` (where it has one) and each pool's prefix pages' ``versions``; a manager that never
set one writes neither, so its state keeps the form older easykv reads.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from easykv.errors import InvariantError, ManagerStateError
from easykv.manager.group_table import GroupTable
from easykv.manager.prefix_hash import DIGEST_BYTES, ROOT_DIGEST, version_digest, version_root
from easykv.manager.versions import VERSION_COUNTERS
from easykv.runtime import PAD_PAGE
from easykv.validation import INT32_MAX, INT64_MAX, boolean, integer, integer_array, show

if TYPE_CHECKING:
    from easykv.manager.manager import PageManager

STATE_FORMAT = "easykv.PageManager/1"
GROUPED_STATE_FORMAT = "easykv.PageManager/2"
_GROUP_KEYS = ("attention", "window", "num_pages")
_CONFIG_INTS = ("batch_size", "num_pages_per_layer", "num_pages_per_sequence", "max_sequences", "page_size",
                "page_shards")
_CONFIG_FLAGS = ("enable_prefix_caching", "scrub_released")
COUNTERS = ("prefix_queries", "prefix_hits", "prefix_query_tokens", "prefix_hit_tokens", "copies")
_SEQUENCE_KEYS = ("id", "length", "pages", "replica", "hashable", "chain", "salt", "partial")
_POOL_KEYS = ("free", "lru", "digests", "scrub", "evictions", "scrubs")
_STATE_KEYS = ("format", "config", "sequences", "pool", "copies", "counters")
_VERSION_KEYS = ("digest", "version", "counters")
_HEX_DIGEST = re.compile(f"[0-9a-f]{{{2 * DIGEST_BYTES}}}")


class Broken(Exception):
    """A consistency rule does not hold; ``field`` names the part of the state it concerns."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def config(metadata: Any, enable_prefix_caching: bool, scrub_released: bool) -> dict[str, Any]:
    """The pool(s) a state belongs to. One group: a sliding or chunked cache adds its window
    (absent for full attention, so the states of uniform caches keep their form); several
    groups: ``groups`` lists each one's attention, window and pool size."""
    out = {**{k: int(getattr(metadata, k)) for k in _CONFIG_INTS},
           "enable_prefix_caching": bool(enable_prefix_caching), "scrub_released": bool(scrub_released)}
    groups = metadata.groups
    if len(groups) > 1:
        out["groups"] = [{"attention": g.attention, "window": None if g.window is None else int(g.window),
                          "num_pages": int(g.num_pages)} for g in groups]
    elif groups[0].attention != "full":
        out.update(attention=groups[0].attention, window=int(groups[0].window))
    return out


# ---- writing -----------------------------------------------------------------------------------
def write_state(m: PageManager) -> dict[str, Any]:
    """The canonical JSON-safe state of ``m`` (see the module doc)."""
    ps, grouped = m.page_size, len(m._groups) > 1
    sequences = []
    for r in m.active_ids:
        length = int(m._lens[r])
        hashable = bool(m._hashes.hashable[r])
        # A row that stopped hashing keeps stale chain and partial tokens in memory; they are
        # never read again, so the state writes neutral values and stays canonical.
        chain = m._hashes.chain[r] if hashable else ROOT_DIGEST
        partial = m._hashes.partial[r, : length % ps].tolist() if hashable else [0] * (length % ps)
        pages = [gt.table[r, : m._npages[r]].tolist() for gt in m._groups]
        sequences.append({"id": r, "length": length, "pages": pages if grouped else pages[0],
                          "replica": int(m._replica[r]), "hashable": hashable, "chain": chain.hex(),
                          "salt": m._hashes.salt[r].hex(), "partial": partial})
        if m._floor[r]:  # a resumed sequence (only then: other states keep their form)
            sequences[-1]["floor"] = int(m._floor[r])
        if m._row_version[r] is not None:
            sequences[-1]["version"] = m._row_version[r].hex()
    pools = [gt.pool.state_dict() for gt in m._groups]
    copies = [[[src, dst] for dst, src in gt.copies.items()] for gt in m._groups]
    out = {
        "format": GROUPED_STATE_FORMAT if grouped else STATE_FORMAT,
        "config": config(m.metadata, m.enable_prefix_caching, m.scrub_released),
        "sequences": sequences,
        "pool": pools if grouped else pools[0],
        "copies": copies if grouped else copies[0],
        "counters": dict(m._counters),
    }
    if len(m._versions) > 1:  # a weight version was set
        out["versions"] = {"current": None if m._version is None else m._version.hex(),
                           "known": [{"digest": None if d is None else d.hex(), "version": _label(label),
                                      "counters": dict(m._version_counters[d])} for d, label in m._versions.items()]}
    return out


def _label(version: Any) -> Any:
    """A weight version as JSON: its type kept (``1``, ``"1"`` and ``b"1"`` are three versions)."""
    if version is None:
        return None
    if isinstance(version, str):
        return {"str": version}
    if isinstance(version, (bytes, bytearray, memoryview)):
        return {"bytes": bytes(version).hex()}
    return {"int": int(version)}


# ---- reading -----------------------------------------------------------------------------------
def _fail(field: str, message: str) -> ManagerStateError:
    return ManagerStateError(message, field=field)


def _mapping(value: Any, field: str, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(field, f"must be an object with keys {list(keys)}, got {type(value).__name__}")
    missing = [k for k in keys if k not in value]
    unknown = sorted(str(k) for k in value if k not in keys + optional)
    if missing or unknown:
        also = f" (and may have {list(optional)})" if optional else ""
        raise _fail(field, f"must have exactly the keys {list(keys)}{also}; missing {missing}, unknown {unknown[:8]}")
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
    pages: list[np.ndarray]  # one row per layer group
    replica: int
    hashable: bool
    chain: bytes
    salt: bytes
    partial: np.ndarray
    floor: int
    version: bytes | None


def _per_group(value: Any, field: str, n: int) -> list[tuple[Any, str]]:
    """A format-2 field's list of one entry per group (with each entry's field name), or a
    format-1 field as the one group's entry."""
    if n == 1:
        return [(value, field)]
    items = _list(value, field)
    if len(items) != n:
        raise _fail(field, f"has {len(items)} entries for {n} layer groups; give one per group")
    return [(item, f"{field}[{g}]") for g, item in enumerate(items)]


def _read_config(m: PageManager, raw: Any) -> dict[str, Any]:
    """The saved config, type-checked, and compared with the one ``m``'s metadata gives."""
    grouped = len(m._groups) > 1
    windowed = not grouped and isinstance(raw, Mapping) and "attention" in raw
    extra = ("groups",) if grouped else ("attention", "window") if windowed else ()
    cfg = _mapping(raw, "config", _CONFIG_INTS + _CONFIG_FLAGS + extra)
    got = {**{k: _int(cfg[k], f"config.{k}", 1, INT64_MAX) for k in _CONFIG_INTS + (("window",) if windowed else ())},
           **{k: _flag(cfg[k], f"config.{k}") for k in _CONFIG_FLAGS}}
    if windowed:
        got["attention"] = cfg["attention"]
    if grouped:
        got["groups"] = []
        for entry, field in _per_group(cfg["groups"], "config.groups", len(m._groups)):
            entry = _mapping(entry, field, _GROUP_KEYS)
            window = entry["window"]
            got["groups"].append({"attention": entry["attention"],
                                  "window": None if window is None else _int(window, f"{field}.window", 1, INT64_MAX),
                                  "num_pages": _int(entry["num_pages"], f"{field}.num_pages", 1, INT64_MAX)})
    want = config(m.metadata, got["enable_prefix_caching"], got["scrub_released"])
    if got != want:
        diff = {k: (got.get(k), want.get(k)) for k in {**got, **want} if got.get(k) != want.get(k)}
        raise _fail("config", f"the state was saved for another pool (saved, given): {diff}; restore with the "
                              "metadata it was saved with")
    return got


def read_state(m: PageManager, state: Any) -> None:
    """Load ``state`` into the fresh manager ``m`` after checking every field's type and range
    (ManagerStateError). Cross-references are checked by `check_consistency` afterwards."""
    state = _mapping(state, "(top level)", _STATE_KEYS, optional=("versions",))
    groups = m._groups
    want_format = GROUPED_STATE_FORMAT if len(groups) > 1 else STATE_FORMAT
    if state["format"] != want_format:
        raise _fail("format", f"is {show(state['format'])}, expected {want_format!r} for a manager of "
                              f"{len(groups)} layer group(s)")
    got = _read_config(m, state["config"])
    m.enable_prefix_caching, m.scrub_released = got["enable_prefix_caching"], got["scrub_released"]
    b, replicas = m.batch_size, m._num_replicas
    sequences = [_read_sequence(m, entry, i) for i, entry in enumerate(_list(state["sequences"], "sequences", b))]
    seen: set[int] = set()
    for seq in sequences:
        if seq.id in seen:
            raise _fail("sequences", f"lists sequence id {seq.id} twice")
        seen.add(seq.id)
    pools = [_read_pool(raw, field, gt.pool.num_pages, replicas)
             for gt, (raw, field) in zip(groups, _per_group(state["pool"], "pool", len(groups)))]
    copies = [_read_copies(raw, field, gt.pool.num_pages)
              for gt, (raw, field) in zip(groups, _per_group(state["copies"], "copies", len(groups)))]
    counters_in = _mapping(state["counters"], "counters", COUNTERS)
    counters = {k: _int(counters_in[k], f"counters.{k}", 0, INT64_MAX) for k in COUNTERS}
    current, known = _read_versions(state.get("versions"))
    for i, seq in enumerate(sequences):
        if seq.version not in known:
            raise _fail(f"sequences[{i}].version", "names a weight version the state's versions.known does not list")
    for pool, (_, field) in zip(pools, _per_group(state["pool"], "pool", len(groups))):
        for page, tag in pool["versions"]:
            if tag not in known:
                raise _fail(f"{field}.versions", f"gives page {page} a weight version versions.known does not list")

    # Every field is well-formed: fill the manager (ids and pages are in range, so no write can fail).
    for seq in sequences:
        r, k = seq.id, seq.pages[0].size
        m._active[r] = True
        for gt, pages in zip(groups, seq.pages):
            gt.table[r, :k] = pages
        m._npages[r], m._lens[r], m._replica[r], m._floor[r] = k, seq.length, seq.replica, seq.floor
        hashes = m._hashes
        hashes.hashable[r], hashes.chain[r], hashes.salt[r] = seq.hashable, seq.chain, seq.salt
        hashes.partial[r, : seq.partial.size] = seq.partial
        m._row_version[r] = seq.version
        if not seq.hashable:  # canonical: see write_state
            hashes.chain[r] = ROOT_DIGEST
            hashes.partial[r] = 0
    for gt, pool, pending in zip(groups, pools, copies):
        gt.pool.scrub_released = m.scrub_released
        held = gt.table != PAD_PAGE
        gt.start[:] = np.where(held.any(axis=1), np.argmax(held, axis=1), m._npages)
        gt.pool.load_state(**pool, refcount=np.bincount(gt.table[held], minlength=gt.pool.num_pages))
        gt.copies = pending
    m._counters = counters
    m._version, m._versions = current, {d: label for d, (label, _) in known.items()}
    m._version_counters = {d: c for d, (_, c) in known.items()}
    for gt in groups:
        gt.shared_partial = m._fork_shared_pages(gt)


def _read_versions(raw: Any) -> tuple[bytes | None, dict[bytes | None, tuple[Any, dict[str, int]]]]:
    """(the current version's digest, digest -> (version, lookup counters) of every known one);
    a state without ``versions`` knows only the unversioned None. Each version must hash to its
    digest: a crafted pair would make lookups of one version find another's pages."""
    if raw is None:
        return None, {None: (None, dict.fromkeys(VERSION_COUNTERS, 0))}
    raw = _mapping(raw, "versions", ("current", "known"))
    known: dict[bytes | None, tuple[Any, dict[str, int]]] = {}
    for i, entry in enumerate(_list(raw["known"], "versions.known", 1 << 20)):
        where = f"versions.known[{i}]"
        entry = _mapping(entry, where, _VERSION_KEYS)
        digest = None if entry["digest"] is None else _digest(entry["digest"], f"{where}.digest")
        version = _read_label(entry["version"], f"{where}.version")
        if version_digest(version) != digest:
            raise _fail(where, f"version {show(version)} does not hash to its digest; the state was edited or damaged")
        if digest in known:
            raise _fail(where, f"lists version {show(version)} twice")
        counters_in = _mapping(entry["counters"], f"{where}.counters", VERSION_COUNTERS)
        known[digest] = (version, {k: _int(counters_in[k], f"{where}.counters.{k}", 0, INT64_MAX)
                                   for k in VERSION_COUNTERS})
    if None not in known or len(known) < 2:
        raise _fail("versions.known", "must list the unversioned None and every version set; a state of a manager "
                                      "that never set one has no versions")
    current = None if raw["current"] is None else _digest(raw["current"], "versions.current")
    if current not in known:
        raise _fail("versions.current", "names a version versions.known does not list")
    return current, known


def _read_label(raw: Any, field: str) -> Any:
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or len(raw) != 1 or next(iter(raw)) not in ("int", "str", "bytes"):
        raise _fail(field, f"must be null or one of {{'int': n}}, {{'str': s}}, {{'bytes': hex}}, got {show(raw)}")
    kind, value = next(iter(raw.items()))
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(field, f"an int version must be a JSON integer, got {show(value)}")
        return value
    if not isinstance(value, str):
        raise _fail(field, f"a {kind} version must be a JSON string, got {show(value)}")
    if kind == "str":
        return value
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise _fail(field, f"a bytes version must be hex digits, got {show(value)}") from None


def _read_pool(raw: Any, field: str, n: int, replicas: int) -> dict[str, Any]:
    """One pool's fields (`PagePool.load_state`'s keywords but the reference counts)."""
    raw = _mapping(raw, field, _POOL_KEYS, optional=("versions",))
    free = [_ints(h, f"{field}.free[{r}]", 0, n - 1, unique=True) for r, h in enumerate(_list(raw["free"], f"{field}.free"))]
    lru = [_ints(q, f"{field}.lru[{r}]", 0, n - 1, unique=True) for r, q in enumerate(_list(raw["lru"], f"{field}.lru"))]
    for name, lists in ((f"{field}.free", free), (f"{field}.lru", lru)):
        if len(lists) != replicas:
            raise _fail(name, f"has {len(lists)} lists for {replicas} data-parallel replica(s)")
    digests: list[tuple[int, bytes]] = []
    for i, entry in enumerate(_list(raw["digests"], f"{field}.digests", n)):
        if not isinstance(entry, list) or len(entry) != 2:
            raise _fail(f"{field}.digests[{i}]", f"must be a [page, digest] pair, got {show(entry)}")
        digests.append((_int(entry[0], f"{field}.digests[{i}][0]", 0, n - 1),
                        _digest(entry[1], f"{field}.digests[{i}][1]")))
    if len({p for p, _ in digests}) != len(digests):
        raise _fail(f"{field}.digests", "gives one page two digests")
    versions: list[tuple[int, bytes]] = []
    for i, entry in enumerate(_list(raw.get("versions", []), f"{field}.versions", n)):
        if not isinstance(entry, list) or len(entry) != 2:
            raise _fail(f"{field}.versions[{i}]", f"must be a [page, version digest] pair, got {show(entry)}")
        versions.append((_int(entry[0], f"{field}.versions[{i}][0]", 0, n - 1),
                         _digest(entry[1], f"{field}.versions[{i}][1]")))
    if "versions" in raw and not versions:
        raise _fail(f"{field}.versions", "is empty; a pool without versioned pages writes no versions")
    if len({p for p, _ in versions}) != len(versions) or [p for p, _ in versions] != sorted(p for p, _ in versions):
        raise _fail(f"{field}.versions", "must name each page once, in page order")
    return {"free": free, "lru": lru, "digests": digests, "versions": versions,
            "scrub": _ints(raw["scrub"], f"{field}.scrub", 0, n - 1, unique=True).tolist(),
            "evictions": _int(raw["evictions"], f"{field}.evictions", 0, INT64_MAX),
            "scrubs": _int(raw["scrubs"], f"{field}.scrubs", 0, INT64_MAX)}


def _read_copies(raw: Any, field: str, n: int) -> dict[int, int]:
    copies: dict[int, int] = {}
    for i, pair in enumerate(_list(raw, field, n)):
        if not isinstance(pair, list) or len(pair) != 2:
            raise _fail(f"{field}[{i}]", f"must be a [src, dst] page pair, got {show(pair)}")
        src, dst = (_int(p, f"{field}[{i}][{j}]", 0, n - 1) for j, p in enumerate(pair))
        if dst in copies:
            raise _fail(field, f"names destination page {dst} twice")
        copies[dst] = src
    return copies


def _read_sequence(m: PageManager, entry: Any, i: int) -> _Sequence:
    ps = m.page_size
    resumed = isinstance(entry, Mapping) and "floor" in entry
    entry = _mapping(entry, f"sequences[{i}]", _SEQUENCE_KEYS + (("floor",) if resumed else ()), optional=("version",))
    where = f"sequences[{i}]"
    sid = _int(entry["id"], f"{where}.id", 0, m.batch_size - 1)
    length = _int(entry["length"], f"{where}.length", 0, m.max_length)
    floor = _int(entry["floor"], f"{where}.floor", 1, length) if resumed else 0
    rows = []
    for gt, (raw, field) in zip(m._groups, _per_group(entry["pages"], f"{where}.pages", len(m._groups))):
        pages = _ints(raw, field, PAD_PAGE, gt.pool.num_pages - 1, max_len=m.pages_per_sequence)
        holes = int(np.argmax(pages != PAD_PAGE)) if np.any(pages != PAD_PAGE) else pages.size
        if np.any(pages[holes:] == PAD_PAGE):
            raise _fail(field, "has a released page (-1) after a held one; only the pages before a window are "
                               "released")
        if np.unique(pages[holes:]).size != pages.size - holes:
            raise _fail(field, "names a page twice")
        if pages.size * ps < length:
            raise _fail(field, f"holds {pages.size} pages of {ps} tokens, too few for length {length}")
        if rows and pages.size != rows[0].size:
            raise _fail(field, f"holds {pages.size} block-table columns but group 0 holds {rows[0].size}; every "
                               "group reserves the same columns")
        rows.append(pages)
    replica = _int(entry["replica"], f"{where}.replica", -1, m._num_replicas - 1)
    partial = _ints(entry["partial"], f"{where}.partial", 0, INT32_MAX, max_len=ps)
    if partial.size != length % ps:
        raise _fail(f"{where}.partial", f"holds {partial.size} token ids; a sequence of length {length} has "
                                        f"{length % ps} in its unfinished page")
    return _Sequence(id=sid, length=length, pages=rows, replica=replica,
                     hashable=_flag(entry["hashable"], f"{where}.hashable"),
                     chain=_digest(entry["chain"], f"{where}.chain"), salt=_digest(entry["salt"], f"{where}.salt"),
                     partial=partial, floor=floor,
                     version=_digest(entry["version"], f"{where}.version") if "version" in entry else None)


# ---- the consistency rules -------------------------------------------------------------------------
def check_consistency(m: PageManager) -> None:
    """Raise `Broken` unless ``m``'s bookkeeping is consistent (see `PageManager.check_invariants`)."""
    ps, n = m.page_size, m._npages
    cols = np.arange(m.pages_per_sequence)
    columns = cols[None, :] < n[:, None]
    if np.any(columns & ~m._active[:, None]) or np.any(m._lens[~m._active]):
        raise Broken("sequences", "a released sequence id still holds pages or tokens")
    _check_floors(m)
    if np.any(m._lens > n * ps) or np.any(m._lens > m.max_length):
        raise Broken("sequences", "a sequence holds more tokens than its pages or max_sequences allow")
    bound = m._replica >= 0
    if np.any(bound != (n > 0)):
        row = int(np.argmax(bound != (n > 0)))
        raise Broken(f"sequences[id={row}].replica", f"sequence {row} holds {int(n[row])} pages but replica "
                                                     f"{int(m._replica[row])}; a sequence is bound to a replica "
                                                     "exactly when it holds pages")
    for g, gt in enumerate(m._groups):
        _check_group(m, g, gt, columns)
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
    salt_of: dict[int, bytes] = {}
    for row, col in np.argwhere(held):
        page = int(gt.table[row, col])
        if pool.digest_of(page) is not None and (col + 1) * ps > m._lens[row]:
            raise Broken(f"{pool_field}.digests", f"page {page}{of} is in the prefix cache but sequence {row} has not "
                                                  "filled it")
        if salt_of.setdefault(page, m._hashes.salt[row]) != m._hashes.salt[row]:
            raise Broken(f"sequences[id={row}].salt", f"page {page}{of} is shared between sequences with different "
                                                      "salts")
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
    return np.maximum(released, m._floor // m.page_size).astype(gt.start.dtype)


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
    prefix cache holds that page), or the root before its first full page."""
    ps = m.page_size
    for row in np.flatnonzero(m._active & m._hashes.hashable).tolist():
        full = int(m._lens[row]) // ps
        chain = m._hashes.chain[row]
        if full == 0:
            if chain != version_root(m._row_version[row]):
                raise Broken(f"sequences[id={row}].chain", f"sequence {row} has no full page but a chain digest "
                                                          "other than the root of its weight version")
            continue
        for gt in m._groups:
            last = int(gt.table[row, full - 1])
            digest = gt.pool.digest_of(last) if last != PAD_PAGE else None  # released from the window: not checkable
            if digest is not None and digest != chain:
                raise Broken(f"sequences[id={row}].chain", f"sequence {row}'s chain digest differs from the digest "
                                                          f"of its last full page {last}")


def _check_pending(m: PageManager, gt: GroupTable, held: np.ndarray, copies_field: str, pool_field: str) -> None:
    """Pending device work touches only pages it may: a copy-on-write destination is the
    unfinished page of every sequence holding it (nothing else reads it yet); a page to scrub
    is free, or reserved by one sequence that has written nothing into it."""
    ps, pool, table = m.page_size, gt.pool, gt.table
    where = {}  # page -> [(row, col)] over every holder
    for row, col in np.argwhere(held).tolist():
        where.setdefault(int(table[row, col]), []).append((row, col))
    scrub = set(pool.pending_scrubs().tolist())
    for dst, src in gt.copies.items():
        field = f"{copies_field}[dst={dst}]"
        if src == dst:
            raise Broken(field, f"copy {src} -> {dst} copies a page onto itself")
        if pool.replica_of(src) != pool.replica_of(dst):
            raise Broken(field, f"copy {src} -> {dst} crosses data-parallel replicas")
        if dst in scrub:
            raise Broken(field, f"page {dst} is both a copy destination and a page to scrub")
        if pool.digest_of(src) is not None:  # a source is an unfinished page: commits into it wait for the copy
            raise Broken(field, f"copy {src} -> {dst} reads page {src}, a full page of the prefix cache; a "
                                "copy-on-write source is an unfinished page")
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
        before = table[holders[0][0], :col]
        if length % ps == 0:
            raise Broken(field, f"copy {src} -> {dst} would overwrite page {dst}, which sequence {holders[0][0]} "
                                f"holds with {length} tokens written (a full page, not an unfinished one)")
        writers = [] if src in gt.copies else [(r, c) for r, c in where.get(src, []) if c * ps < int(m._lens[r])]
        partial = None  # the unfinished page's token ids, where the sequences know them
        for row, c in holders + writers:
            if int(m._lens[row]) != length or c != col or not np.array_equal(table[row, :col], before):
                raise Broken(field, f"copy {src} -> {dst} joins pages of sequences with different histories "
                                    f"(sequence {row} holds page {table[row, c]} at column {c} with "
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
            raise Broken(f"{pool_field}.scrub", f"page {page} is to be zeroed but holds written tokens of sequence {row} "
                                       f"(column {col}){' and is shared' if others else ''}")



# ---- what a checkpoint records of a state ------------------------------------------------------
def summarize_state(state: Any) -> dict[str, int] | None:
    """The counts a checkpoint records (and ``inspect_checkpoint`` shows) of a state: active
    sequences, committed tokens, free, cached and prefix-cached pages (over every group's
    pool). None when the state is too malformed to count (`PageManager.from_state_dict` then
    names the bad field)."""
    try:
        seqs, pools = state["sequences"], state["pool"]
        pools = pools if isinstance(pools, list) else [pools]
        out = {"active_sequences": len(seqs), "tokens": sum(s["length"] for s in seqs),
               "free_pages": sum(len(h) for pool in pools for h in pool["free"]),
               "cached_pages": sum(len(q) for pool in pools for q in pool["lru"]),
               "prefix_pages": sum(len(pool["digests"]) for pool in pools)}
    except (KeyError, TypeError, IndexError, AttributeError):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in out.values()):
        return None
    return out


def max_state_bytes(meta: Any) -> int:
    """The most bytes a state of ``meta``'s pools can take in JSON: every page id a few times
    (tables, free and cached lists, digests) plus a sequence's fields per slot."""
    groups = meta.groups
    return (1 << 20) + 256 * (sum(g.num_pages for g in groups)
                              + meta.batch_size * (meta.num_pages_per_sequence * len(groups) + 64))


__all__ = ["Broken", "COUNTERS", "GROUPED_STATE_FORMAT", "STATE_FORMAT", "check_consistency", "config",
           "max_state_bytes", "read_state", "summarize_state", "write_state"]
