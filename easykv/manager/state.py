"""The PageManager's persisted form: writing it, and reading it back strictly.

A manager state is JSON (a checkpoint's ``manager.json``, a lock-step fingerprint, a hand-off
between hosts), so it is input like any other: a crafted or damaged state must never become a
manager in which one sequence can touch another's pages. Reading is therefore strict: every
field is type- and range-checked on its own (`read_state`), then the manager built from it must
pass the same consistency rules a live manager is held to (`consistency.check_consistency`,
which `PageManager.check_invariants` runs as well; the manager runs it after `read_state`). A
broken rule raises `Broken` naming the field; a live manager reports it as an easykv bug
(`InvariantError`), a loaded state as bad input (`ManagerStateError`).

The state is canonical: the same history of calls gives the same state byte for byte, whether
or not the manager was restored on the way (what `assert_lockstep` compares across hosts).

A manager of one layer group writes format 1 (``pages`` a list per sequence, one ``pool``, one
``copies`` list); one of several groups writes format 2, where each of those is a list with one
entry per group (groups have their own pools) and ``config.groups`` names each group's pool.
Once a weight version was set (`PageManager.set_weight_version`), either format adds
``versions`` (the current one and every one known, with its lookups), each sequence's
``version`` (where it has one) and each pool's prefix pages' ``versions``; a manager that never
set one writes neither, so its state keeps the form older easykv reads.

A sequence that hashes keeps every committed token id (``tokens``), so a restored manager names
the pages of a truncated sequence again exactly as the one never restored does; a state of an
easykv that did not write them still loads, knowing the ids of each unfinished page only.

This module holds the JSON form; each part gives and takes its own values (`SequenceTable.row_state`
and ``load_row``, `GroupTable.state` and ``load``, `VersionLog.known` and ``load``). It imports the
parts' modules only: neither the manager (manager.py) nor ``consistency``, and never ``storage``,
``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from easykv.errors import ManagerStateError
from easykv.manager.prefix_hash import DIGEST_BYTES, version_digest
from easykv.manager.versions import LOOKUP_COUNTERS, VERSION_COUNTERS, WeightVersion
from easykv.spec.groups import known_size
from easykv.step.metadata import PAD_PAGE
from easykv.validation import INT32_MAX, INT64_MAX, boolean, integer, integer_array, show

if TYPE_CHECKING:
    from easykv.manager.parts import ManagerParts
    from easykv.spec.metadata import PagedAttentionCacheMetaData

STATE_FORMAT = "easykv.PageManager/1"
GROUPED_STATE_FORMAT = "easykv.PageManager/2"
_GROUP_KEYS = ("attention", "window", "num_pages")
_CONFIG_INTS = ("batch_size", "num_pages_per_layer", "num_pages_per_sequence", "max_sequences", "page_size",
                "page_shards")
_CONFIG_FLAGS = ("enable_prefix_caching", "scrub_released")
COUNTERS = (*LOOKUP_COUNTERS, "copies")
_SEQUENCE_KEYS = ("id", "length", "pages", "replica", "hashable", "chain", "salt", "partial")
_POOL_KEYS = ("free", "lru", "digests", "scrub", "evictions", "scrubs")
_STATE_KEYS = ("format", "config", "sequences", "pool", "copies", "counters")
STATE_KEYS = (*_STATE_KEYS, "versions")  # a state's top-level keys: no lower tier's lock-step state takes one
_VERSION_KEYS = ("digest", "version", "counters")
_HEX_DIGEST = re.compile(f"[0-9a-f]{{{2 * DIGEST_BYTES}}}")


def config(metadata: PagedAttentionCacheMetaData, enable_prefix_caching: bool, scrub_released: bool) -> dict[str, Any]:
    """The pool(s) a state belongs to. One group: a sliding or chunked cache adds its window
    (absent for full attention, so the states of uniform caches keep their form); several
    groups: ``groups`` lists each one's attention, window and pool size."""
    out: dict[str, Any] = {**{k: int(getattr(metadata, k)) for k in _CONFIG_INTS},
           "enable_prefix_caching": bool(enable_prefix_caching), "scrub_released": bool(scrub_released)}
    groups = metadata.groups
    if len(groups) > 1:
        out["groups"] = [{"attention": g.attention.value, "window": None if g.window is None else int(g.window),
                          "num_pages": known_size(g.num_pages)} for g in groups]
    elif groups[0].windowed:
        out.update(attention=groups[0].attention.value, window=known_size(groups[0].window))
    return out


# ---- writing -----------------------------------------------------------------------------------
def write_state(parts: ManagerParts, *, tiers: bool = False) -> dict[str, Any]:
    """The canonical JSON-safe state of a manager's ``parts`` (see the module doc). The tiers
    below the device (the host-memory tier) are not part of it: ValueError while a tier holds what
    the state would lose (a sequence swapped out, a transfer pending: `LowerTier.refuse_state`);
    their prefix caches are left out. ``tiers``: add each tier's bookkeeping under its name (the
    host tier's as ``host``: a fingerprint for `assert_lockstep`; no manager reads it back)."""
    seqs, groups, versions = parts.seqs, parts.groups, parts.versions
    if not tiers:
        parts.tiers.refuse_state()
    grouped = len(groups) > 1
    sequences = []
    for r in seqs.active_ids:
        pages = [table.row_pages(r, int(seqs.npages[r])) for table in groups]
        sequences.append(seqs.row_state(r, pages if grouped else pages[0], caching=parts.caching))
    pools, copies = zip(*(table.state() for table in groups))
    out = {
        "format": GROUPED_STATE_FORMAT if grouped else STATE_FORMAT,
        "config": config(parts.metadata, parts.caching, parts.scrub),
        "sequences": sequences,
        "pool": list(pools) if grouped else pools[0],
        "copies": list(copies) if grouped else copies[0],
        "counters": {**versions.lookups, "copies": parts.copies.copies},
    }
    if tiers:
        out.update(parts.tiers.lockstep_state())
    if versions.versioned:  # a weight version was set
        out["versions"] = {"current": None if versions.current is None else versions.current.hex(),
                           "known": [{"digest": None if d is None else d.hex(), "version": _label(label),
                                      "counters": dict(counters)} for d, label, counters in versions.known()]}
    return out


def _label(version: WeightVersion) -> dict[str, Any] | None:
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
    tokens: np.ndarray | None  # every committed id (None: a state that keeps those of the unfinished page only)


def _per_group(value: Any, field: str, n: int) -> list[tuple[Any, str]]:
    """A format-2 field's list of one entry per group (with each entry's field name), or a
    format-1 field as the one group's entry."""
    if n == 1:
        return [(value, field)]
    items = _list(value, field)
    if len(items) != n:
        raise _fail(field, f"has {len(items)} entries for {n} layer groups; give one per group")
    return [(item, f"{field}[{g}]") for g, item in enumerate(items)]


def _read_config(parts: ManagerParts, raw: Any) -> dict[str, Any]:
    """The saved config, type-checked, and compared with the one the parts' metadata gives."""
    grouped = len(parts.groups) > 1
    windowed = not grouped and isinstance(raw, Mapping) and "attention" in raw
    extra = ("groups",) if grouped else ("attention", "window") if windowed else ()
    cfg = _mapping(raw, "config", _CONFIG_INTS + _CONFIG_FLAGS + extra)
    got: dict[str, Any] = {
        **{k: _int(cfg[k], f"config.{k}", 1, INT64_MAX) for k in _CONFIG_INTS + (("window",) if windowed else ())},
        **{k: _flag(cfg[k], f"config.{k}") for k in _CONFIG_FLAGS}}
    if windowed:
        got["attention"] = cfg["attention"]
    if grouped:
        got["groups"] = []
        for entry, field in _per_group(cfg["groups"], "config.groups", len(parts.groups)):
            entry = _mapping(entry, field, _GROUP_KEYS)
            window = entry["window"]
            got["groups"].append({"attention": entry["attention"],
                                  "window": None if window is None else _int(window, f"{field}.window", 1, INT64_MAX),
                                  "num_pages": _int(entry["num_pages"], f"{field}.num_pages", 1, INT64_MAX)})
    want = config(parts.metadata, got["enable_prefix_caching"], got["scrub_released"])
    if got != want:
        diff = {k: (got.get(k), want.get(k)) for k in {**got, **want} if got.get(k) != want.get(k)}
        raise _fail("config", f"the state was saved for another pool (saved, given): {diff}; restore with the "
                              "metadata it was saved with")
    return got


def read_state(parts: ManagerParts, state: Any) -> tuple[bool, bool]:
    """Load ``state`` into a fresh manager's ``parts`` after checking every field's type and range
    (ManagerStateError); returns the state's (enable_prefix_caching, scrub_released).
    Cross-references are checked by `consistency.check_consistency` afterwards."""
    state = _mapping(state, "(top level)", _STATE_KEYS, optional=("versions",))
    seqs, groups = parts.seqs, parts.groups
    want_format = GROUPED_STATE_FORMAT if len(groups) > 1 else STATE_FORMAT
    if state["format"] != want_format:
        raise _fail("format", f"is {show(state['format'])}, expected {want_format!r} for a manager of "
                              f"{len(groups)} layer group(s)")
    got = _read_config(parts, state["config"])
    caching, scrub = got["enable_prefix_caching"], got["scrub_released"]
    sequences = [_read_sequence(parts, entry, i, caching=caching)
                 for i, entry in enumerate(_list(state["sequences"], "sequences", seqs.batch_size))]
    seen: set[int] = set()
    for seq in sequences:
        if seq.id in seen:
            raise _fail("sequences", f"lists sequence id {seq.id} twice")
        seen.add(seq.id)
    pool_fields = _per_group(state["pool"], "pool", len(groups))
    pools = [_read_pool(raw, field, table.pool.num_pages, groups.num_replicas)
             for table, (raw, field) in zip(groups, pool_fields)]
    copies = [_read_copies(raw, field, table.pool.num_pages)
              for table, (raw, field) in zip(groups, _per_group(state["copies"], "copies", len(groups)))]
    counters_in = _mapping(state["counters"], "counters", COUNTERS)
    counters = {k: _int(counters_in[k], f"counters.{k}", 0, INT64_MAX) for k in COUNTERS}
    current, known = _read_versions(state.get("versions"), counters)
    for i, seq in enumerate(sequences):
        if seq.version not in known:
            raise _fail(f"sequences[{i}].version", "names a weight version the state's versions.known does not list")
    for pool, (_, field) in zip(pools, pool_fields):
        for page, tag in pool["versions"]:
            if tag not in known:
                raise _fail(f"{field}.versions", f"gives page {page} a weight version versions.known does not list")

    # Every field is well-formed: fill the parts (ids and pages are in range, so no write can fail).
    for seq in sequences:
        seqs.load_row(seq.id, length=seq.length, npages=seq.pages[0].size, replica=seq.replica, floor=seq.floor,
                      version=seq.version, hashable=seq.hashable, chain=seq.chain, salt=seq.salt,
                      partial=seq.partial, tokens=seq.tokens)
    for g, (table, pool, pending) in enumerate(zip(groups, pools, copies)):
        table.load([(seq.id, seq.pages[g]) for seq in sequences], seqs, pool=pool, copies=pending, scrub=scrub)
    parts.versions.load(current, known, counters)
    parts.copies.load(copies=counters["copies"])
    return caching, scrub


def _read_versions(raw: Any, counters: dict[str, int]
                   ) -> tuple[bytes | None, dict[bytes | None, tuple[Any, dict[str, int]]]]:
    """(the current version's digest, digest -> (version, lookup counters) of every known one);
    a state without ``versions`` knows only the unversioned None, under which every lookup of
    the manager's ``counters`` ran. Each version must hash to its digest: a crafted pair would
    make lookups of one version find another's pages."""
    if raw is None:
        return None, {None: (None, {k: counters[k] for k in VERSION_COUNTERS})}
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


def _read_label(raw: Any, field: str) -> WeightVersion:
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
    free = [_ints(h, f"{field}.free[{r}]", 0, n - 1, unique=True)
            for r, h in enumerate(_list(raw["free"], f"{field}.free"))]
    lru = [_ints(q, f"{field}.lru[{r}]", 0, n - 1, unique=True)
           for r, q in enumerate(_list(raw["lru"], f"{field}.lru"))]
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


def _read_sequence(parts: ManagerParts, entry: Any, i: int, *, caching: bool) -> _Sequence:
    seqs, groups = parts.seqs, parts.groups
    ps = seqs.page_size
    resumed = isinstance(entry, Mapping) and "floor" in entry
    entry = _mapping(entry, f"sequences[{i}]", _SEQUENCE_KEYS + (("floor",) if resumed else ()),
                     optional=("version", "tokens"))
    where = f"sequences[{i}]"
    sid = _int(entry["id"], f"{where}.id", 0, seqs.batch_size - 1)
    length = _int(entry["length"], f"{where}.length", 0, seqs.max_length)
    floor = _int(entry["floor"], f"{where}.floor", 1, length) if resumed else 0
    rows: list[np.ndarray] = []
    for table, (raw, field) in zip(groups, _per_group(entry["pages"], f"{where}.pages", len(groups))):
        pages = _ints(raw, field, PAD_PAGE, table.pool.num_pages - 1, max_len=table.table.shape[1])
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
    replica = _int(entry["replica"], f"{where}.replica", -1, groups.num_replicas - 1)
    partial = _ints(entry["partial"], f"{where}.partial", 0, INT32_MAX, max_len=ps)
    if partial.size != length % ps:
        raise _fail(f"{where}.partial", f"holds {partial.size} token ids; a sequence of length {length} has "
                                        f"{length % ps} in its unfinished page")
    hashable = _flag(entry["hashable"], f"{where}.hashable")
    return _Sequence(id=sid, length=length, pages=rows, replica=replica, hashable=hashable,
                     chain=_digest(entry["chain"], f"{where}.chain"), salt=_digest(entry["salt"], f"{where}.salt"),
                     partial=partial, floor=floor,
                     version=_digest(entry["version"], f"{where}.version") if "version" in entry else None,
                     tokens=_read_tokens(entry, where, length, partial, hashable and caching,
                                         seqs.max_length))


def _read_tokens(entry: Mapping[str, Any], where: str, length: int, partial: np.ndarray, hashable: bool,
                 most: int) -> np.ndarray | None:
    """A sequence's committed ids, where the state keeps them: exactly ``length`` of them, ending
    in its ``partial`` ones, on a row that hashes (a row that does not knows no ids)."""
    if "tokens" not in entry:
        return None
    tokens = _ints(entry["tokens"], f"{where}.tokens", 0, INT32_MAX, max_len=most)
    if not hashable:
        raise _fail(f"{where}.tokens", "is given for a sequence that does not hash (its ids are not known, or prefix "
                                       "caching is off); a state keeps the ids of hashing sequences only")
    if tokens.size != length or not np.array_equal(tokens[length - partial.size:], partial):
        tail = tokens[max(0, tokens.size - partial.size):].tolist()
        raise _fail(f"{where}.tokens", f"holds {tokens.size} ids ending in {tail}; a sequence of length {length} "
                                       f"has {length} ending in its partial {partial.tolist()}")
    return tokens


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


def max_state_bytes(meta: PagedAttentionCacheMetaData) -> int:
    """The most bytes a state of ``meta``'s pools can take in JSON: every page id a few times
    (tables, free and cached lists, digests), a sequence's fields per slot, and its token ids
    (at most 12 bytes each: ten digits, a comma, a space)."""
    groups = meta.groups
    return (1 << 20) + 256 * (sum(known_size(g.num_pages) for g in groups)
                              + meta.batch_size * (meta.num_pages_per_sequence * len(groups) + 64)) \
        + 12 * meta.batch_size * meta.max_sequences


__all__ = ["COUNTERS", "GROUPED_STATE_FORMAT", "STATE_FORMAT", "STATE_KEYS", "config", "max_state_bytes", "read_state",
           "summarize_state", "write_state"]
