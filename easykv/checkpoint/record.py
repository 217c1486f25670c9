"""The JSON record of a checkpoint step and the saved PageManager state: sealing, reading, and
the one schema check (used by format.py, checkpointer.py, restore.py and inspect.py).

Every byte easykv persists is verified on load. orbax keeps no checksum, and the page arrays
carry their own fingerprints (`checkpoint_integrity`); this module covers the two JSON files:

* ``manager.json`` is written once, as exact bytes, and the record carries their sha256
  (``manager_sha256``; null when no manager was saved). A missing file the record says was
  saved, or a file the record says was not, is damage, not "no manager".
* ``checkpoint.json`` carries ``record_sha256``: the sha256 of its own canonical content,
  ``json.dumps(record_without_that_field, sort_keys=True, separators=(",", ":"))``. Canonical
  content (not bytes) so that the file stays readable by eye; a flipped byte changes the
  content or breaks the JSON. A record that carries ``record_sha256`` is verified whatever
  its ``format_version`` says: one flipped bit turns ``2`` into ``3`` or ``0``, and the version
  is read only after the seal holds.
* A verified record is then checked field by field (`check_record`): every field restore and
  inspect read, its type and range, and its agreement with the cache metadata (array names,
  paths, shapes, stored dtypes, sizes). A crafted record with a recomputed seal therefore
  raises `CheckpointIntegrityError` naming the field, never a TypeError or KeyError later.

Format version 1 (easykv 0.1) has neither hash: such a step still restores, with a warning
that its record and manager state were checked for consistency only (schema, the manager
summary against the state, the arrays' own fingerprints). Versions 1 and 2 hold one array per
layer (``layer_007.key_pages``); version 3, written from now on, one stacked array per layer
group (``group_000.key_pages``, ``(layers, heads, pages, page_size, head_dim)``), as the cache
stores them. Older steps restore by stacking their layers (a migration).
All JSON goes through `validation.parse_json` (nesting limit, NaN refused).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias, overload

import jax
import numpy as np
from etils import epath

from easykv.checked_files import read_regular
from easykv.checkpoint.integrity import KNOWN_FINGERPRINT_ALGORITHMS
from easykv.checkpoint.orbax_types import EPath
from easykv.errors import CheckpointIntegrityError, CheckpointMismatchError, FileRefusedError, SerializationError
from easykv.manager.state import max_state_bytes, summarize_state
from easykv.spec.metadata import PagedAttentionCacheMetaData, known_dtype
from easykv.storage.pages import PageTemplate, StoredPages, group_templates, page_template
from easykv.validation import INT32_MAX, INT64_MAX, JSON_MAX_DEPTH, integer, parse_json, show

FORMAT = "easykv.checkpoint"
FORMAT_VERSION = 3
LEGACY_VERSION = 1  # easykv 0.1: no record or manager hash
STACKED_VERSION = 3  # from here on, one stacked array per layer group; before, one per layer
STATE_ITEM = "easykv"
RECORD_FILE = "checkpoint.json"
MANAGER_FILE = "manager.json"
RECORD_SEAL = "record_sha256"
MANAGER_SEAL = "manager_sha256"
# extra_metadata sits one level below the record, so it may nest one level less than any JSON.
EXTRA_MAX_DEPTH = JSON_MAX_DEPTH - 1

_KEYS_V1 = frozenset({"format", "format_version", "easykv_version", "step", "created", "metadata", "storage",
                      "mesh", "arrays", "fingerprint_algorithm", "manager", "extra_metadata"})
_KEYS = {1: _KEYS_V1, 2: _KEYS_V1 | {MANAGER_SEAL, RECORD_SEAL}, 3: _KEYS_V1 | {MANAGER_SEAL, RECORD_SEAL}}
_ARRAY_KEYS = frozenset({"name", "path", "role", "shape", "stored_dtype", "nbytes", "fingerprint"})
_SUMMARY_KEYS = ("active_sequences", "tokens", "free_pages", "cached_pages", "prefix_pages")
_MESH_KEYS = frozenset({"platform", "device_kind", "num_devices", "process_count"})
_MESH_LAYOUT_KEYS = frozenset({"axis_names", "shape", "kv_head_mesh_axes", "page_mesh_axes"})
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_ARRAY_FP = re.compile(r"[0-9a-f]{32}")


# ---- names of the saved arrays ----------------------------------------------------------------
def layer_key(i: int) -> str:
    return f"layer_{i:03d}"


def group_key(g: int) -> str:
    return f"group_{g:03d}"


def group_index(key: str) -> int:
    """The group of a path's first part (``group_key``'s inverse; paths are checked against the
    metadata before anything reads them)."""
    return int(key.removeprefix("group_"))


_KINDS = ("key_pages", "value_pages")


def is_stacked(version: int) -> bool:
    """Whether a record of ``version`` holds stacked group arrays (else one array per layer)."""
    return version >= STACKED_VERSION


#: One item's (K pages, V pages; None for a latent group): stored arrays, or their templates.
PagePair: TypeAlias = tuple[StoredPages, StoredPages | None]
TemplatePair: TypeAlias = tuple[PageTemplate, PageTemplate | None]


@overload
def page_leaves(pairs: Sequence[PagePair], *, stacked: bool = True) -> list[tuple[str, tuple[str, ...], jax.Array]]: ...


@overload
def page_leaves(pairs: Sequence[TemplatePair], *, stacked: bool = True
                ) -> list[tuple[str, tuple[str, ...], jax.ShapeDtypeStruct]]: ...


def page_leaves(pairs: Sequence[PagePair] | Sequence[TemplatePair], *, stacked: bool = True
                ) -> (list[tuple[str, tuple[str, ...], jax.Array]]
                      | list[tuple[str, tuple[str, ...], jax.ShapeDtypeStruct]]):
    """(name, path, leaf) of every saved array of ``pairs``, one (K pages, V pages) per layer
    group (``stacked``, format 3) or per layer (formats 1-2), each an array or `QuantizedPages`
    (of arrays or ShapeDtypeStructs).

    The one definition of the order the record lists (and restore rebuilds) the arrays in: group
    by group (or layer by layer), K before V, a quantized page array's values before its scales
    -- the order ``jax.tree_util`` flattens ``pairs`` in. A path is ``(group_000, key_pages)``
    (``layer_007`` before format 3), or ``(group_000, key_pages, values|scales)`` for quantized
    pages; its name joins it with dots.
    """
    key = group_key if stacked else layer_key
    out = []
    for keys, leaf in jax.tree_util.tree_flatten_with_path(list(pairs))[0]:
        item, kind, *part = keys  # list index, tuple index, then QuantizedPages' field
        path = (key(item.idx), _KINDS[kind.idx], *(k.name for k in part))
        out.append((".".join(path), path, leaf))
    return out


def page_pairs(templates: Sequence[TemplatePair], leaves: Sequence[jax.Array]) -> list[PagePair]:
    """The inverse of `page_leaves`: ``leaves`` (in its order) as (K pages, V pages) per item,
    with the structure of ``templates`` (`expected_templates`; V None for a latent group)."""
    pairs: list[PagePair] = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(list(templates)), leaves)
    return pairs


def stored_template(meta: PagedAttentionCacheMetaData, platform: str) -> PageTemplate:
    """Shapes and storage dtypes of one layer's page array (K or V) of ``meta`` on ``platform``,
    as checkpoint formats 1-2 hold them (uniform caches only)."""
    shape = (meta.num_kv_heads, meta.num_pages_per_layer, meta.page_size, meta.kv_head_dim_size)
    return page_template(shape, known_dtype(meta.dtype), meta.quantizer, platform)


def expected_templates(meta: PagedAttentionCacheMetaData, platform: str, version: int) -> list[TemplatePair]:
    """The (K, V) page templates of each item of a record of ``version``: per layer group in its
    own geometry (stacked), or per layer (formats 1-2, uniform caches only)."""
    if is_stacked(version):
        return group_templates(meta, platform)
    return [(stored_template(meta, platform),) * 2] * meta.num_hidden_layers


def leaf_role(path: Sequence[str]) -> str:
    """``"pages"``, or ``"values"`` / ``"scales"`` for a quantized page array's parts."""
    return path[-1] if len(path) == 3 else "pages"


def nest(leaves: Iterable[tuple[Sequence[str], object]]) -> dict[str, Any]:
    """The nested dict (the PyTree orbax saves) holding each leaf at its path."""
    tree: dict[str, Any] = {}
    for path, leaf in leaves:
        node = tree
        *parents, last = path
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return tree


def expected_leaves(meta: PagedAttentionCacheMetaData, platform: str,
                    version: int = FORMAT_VERSION) -> list[tuple[str, tuple[str, ...], jax.ShapeDtypeStruct]]:
    """(name, path, ShapeDtypeStruct in ``platform`` storage) of every array of ``meta`` in a
    record of ``version``."""
    return page_leaves(expected_templates(meta, platform, version), stacked=is_stacked(version))


# ---- sealing (save side) -------------------------------------------------------------------------
def canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def record_digest(record: Mapping[str, Any]) -> str:
    """sha256 of the record's canonical content without its own seal."""
    return hashlib.sha256(canonical({k: v for k, v in record.items() if k != RECORD_SEAL})).hexdigest()


def seal(record: dict[str, Any], manager_state: Mapping[str, Any] | None) -> tuple[bytes, bytes | None]:
    """(record bytes, manager bytes or None) to write: the record gets the manager's hash and
    its own seal. The manager bytes are hashed exactly as written."""
    manager_bytes = None if manager_state is None else json.dumps(manager_state, separators=(",", ":")).encode()
    record[MANAGER_SEAL] = None if manager_bytes is None else hashlib.sha256(manager_bytes).hexdigest()
    record[RECORD_SEAL] = record_digest(record)
    return json.dumps(record, indent=1).encode(), manager_bytes


# ---- reading ---------------------------------------------------------------------------------------
def _damaged(message: str, step: int, directory: EPath, **kw: Any) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(f"{message}; step {step} of {directory} is damaged — restore another step",
                                    step=step, directory=str(directory), **kw)


RECORD_MAX_BYTES = 16 << 20  # a record lists a few hundred bytes per array


def read_small_file(path: EPath, limit: int, step: int, directory: EPath) -> bytes | None:
    """A small file of a step (JSON, orbax's metadata), or None when it does not exist;
    `CheckpointIntegrityError` saying why it cannot be read (`small_file`)."""
    data, problem = small_file(path, limit)
    if problem is not None:
        raise _damaged(problem, step, directory)
    return data


def small_file(path: EPath, limit: int) -> tuple[bytes | None, str | None]:
    """(the bytes of a small file of a step, None) or (None, None) when it does not exist, or
    (None, why it cannot be read).

    A local file is opened once, without following a link and without waiting for a writer,
    and only a regular file of at most ``limit`` bytes is read, through that descriptor
    (`easykv.checked_files`): a FIFO, a link to /dev/zero, a device or a huge file is damage, not
    input to block on or read until memory runs out, and checking the path before opening it
    would leave room to swap the file in between. An object store's file (``://``) holds no such
    thing; its read is bounded by ``limit`` too."""
    text = os.fspath(path)
    try:
        if "://" not in text:
            return read_regular(text, max_bytes=limit, follow_links=False), None
        if not path.exists():
            return None, None
        with path.open("rb") as f:
            data: bytes = f.read(limit + 1)
    except FileNotFoundError:
        return None, None
    except FileRefusedError as err:
        return None, refused(text, err, f"not a regular file of at most {limit} bytes")
    except OSError as err:
        return None, f"{path} cannot be read ({type(err).__name__}: {err})"
    if len(data) > limit:
        return None, f"{path} holds more than the {limit} bytes such a file can hold"
    return data, None


def refused(path: str, err: FileRefusedError, what: str) -> str:
    """``path is <what>: it <why>``, the why of `checked_files`' refusal without its path."""
    why = str(err)
    return f"{path} is {what}: it {why.removeprefix(path + ' ')}" if why.startswith(path + " ") else f"{path}: {why}"


def _read_json(path: EPath, data: bytes, step: int, directory: EPath) -> Any:
    try:
        return parse_json(data.decode("utf-8"), what=str(path))
    except (ValueError, UnicodeDecodeError) as err:
        raise _damaged(str(err) if isinstance(err, ValueError) else f"{path} is not UTF-8 text ({err})", step,
                       directory) from None


def read_record(directory: EPath, step: int) -> dict[str, Any]:
    """The record of ``step``: parsed, its seal verified, every field checked (`check_record`).
    CheckpointIntegrityError for damage, CheckpointMismatchError for a newer format."""
    path = epath.Path(directory) / str(step) / STATE_ITEM / RECORD_FILE
    data = read_small_file(path, RECORD_MAX_BYTES, step, directory)
    if data is None:
        raise _damaged(f"the step lacks {STATE_ITEM}/{RECORD_FILE}", step, directory)
    record = _read_json(path, data, step, directory)
    if not isinstance(record, dict):
        raise _damaged(f"{path} holds a JSON {type(record).__name__}, not an easykv checkpoint record", step,
                       directory)
    if RECORD_SEAL in record:  # verified before any field is trusted, the version included
        want, got = record[RECORD_SEAL], record_digest(record)  # parse_json: finite, shallow
        if want != got:
            raise _damaged(f"{path} does not match its {RECORD_SEAL} (recorded {show(want)}, content hashes "
                           f"to {got})", step, directory)
    if record.get("format") != FORMAT:
        raise _damaged(f"{path} is not an easykv checkpoint record (format {show(record.get('format'))}, "
                       f"expected {FORMAT!r})", step, directory)
    version = _int(record.get("format_version"), "format_version", step, directory, lo=1, hi=INT32_MAX)
    if version > FORMAT_VERSION:
        raise CheckpointMismatchError(
            f"step {step} in {directory} has checkpoint format version {version}; this easykv reads versions "
            f"<= {FORMAT_VERSION}: upgrade easykv")
    if version >= 2 and RECORD_SEAL not in record:
        raise _damaged(f"{path} (format version {version}) lacks its {RECORD_SEAL}", step, directory)
    if version == LEGACY_VERSION and RECORD_SEAL in record:
        raise _damaged(f"{path} says format version 1 but carries a {RECORD_SEAL} (only version >= 2 does)",
                       step, directory)
    check_record(record, step, directory)
    return record


def is_legacy(record: Mapping[str, Any]) -> bool:
    """True for a version-1 record: no hash of the record or manager state to verify."""
    legacy: bool = record["format_version"] == LEGACY_VERSION
    return legacy


def legacy_note(step: int, directory: EPath) -> str:
    return (f"step {step} in {directory} has checkpoint format version 1 (easykv 0.1): its record and page-"
            "manager state carry no fingerprints and were checked for consistency only (the page arrays are "
            "verified); save it again with this easykv to fingerprint every byte")


def read_manager_state(directory: EPath, step: int, record: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The saved PageManager state of ``step`` (None when the record says none was saved),
    verified against the record: its bytes' sha256 (version >= 2), its presence, and the
    manager summary. The state's own fields are checked by `PageManager.from_state_dict`."""
    record = read_record(directory, step) if record is None else record
    path = epath.Path(directory) / str(step) / STATE_ITEM / MANAGER_FILE
    saved = record[MANAGER_SEAL] is not None if not is_legacy(record) else record["manager"] is not None
    data = read_small_file(path, max_state_bytes(saved_metadata(record, step, directory)), step, directory)
    if data is None:
        if saved:
            raise _damaged(f"the record says a page manager was saved but {path} is missing", step, directory)
        return None
    if not saved:
        raise _damaged(f"the record says no page manager was saved but {path} exists", step, directory)
    if not is_legacy(record):
        got = hashlib.sha256(data).hexdigest()
        if got != record[MANAGER_SEAL]:
            raise _damaged(f"{path} does not match the {MANAGER_SEAL} in the record (recorded "
                           f"{record[MANAGER_SEAL]}, file hashes to {got})", step, directory)
    state = _read_json(path, data, step, directory)
    if not isinstance(state, dict):
        raise _damaged(f"{path} holds a JSON {type(state).__name__}, not a PageManager state", step, directory)
    summary = summarize_state(state)
    if summary is not None and summary != record["manager"]:
        raise _damaged(f"the page-manager state in {path} ({summary}) does not match the record's summary "
                       f"({record['manager']})", step, directory)
    return state


def saved_metadata(record: Mapping[str, Any], step: int, directory: EPath) -> PagedAttentionCacheMetaData:
    """The cache metadata of a record; CheckpointIntegrityError when it cannot be rebuilt."""
    try:
        meta = PagedAttentionCacheMetaData.from_dict(record["metadata"])
        if not is_stacked(record["format_version"]):  # one array per layer: written before layer groups
            meta.require_uniform(f"a checkpoint of format {record['format_version']}", windows=True)
        return meta
    except (SerializationError, ValueError, TypeError, KeyError, AttributeError, OverflowError,
            NotImplementedError) as err:
        raise _damaged(f"field 'metadata' of the record cannot be rebuilt: {err}", step, directory) from err


# ---- the schema ------------------------------------------------------------------------------------
def _bad(field: str, problem: str, step: int, directory: EPath, **kw: Any) -> CheckpointIntegrityError:
    return _damaged(f"record field {field} {problem}", step, directory, **kw)


def _int(value: Any, field: str, step: int, directory: EPath, *, lo: int | None = 0, hi: int | None = INT64_MAX) -> int:
    try:
        return integer(f"record field {field}", value, lo=lo, hi=hi)
    except ValueError as err:
        raise _damaged(str(err), step, directory) from None


def _dict(value: Any, field: str, step: int, directory: EPath, keys: frozenset[str] | None = None,
          optional: frozenset[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(field, f"must be a JSON object, got {show(value)}", step, directory)
    if keys is not None:
        missing, unknown = sorted(keys - set(value)), sorted(set(value) - keys - optional)
        if missing or unknown:
            raise _bad(field, f"must have the keys {sorted(keys)} (missing {missing}, unknown {unknown})", step,
                       directory)
    return value


def _list(value: Any, field: str, step: int, directory: EPath, *, max_len: int = 1 << 20) -> list[Any]:
    if not isinstance(value, list) or len(value) > max_len:
        raise _bad(field, f"must be a list of at most {max_len} items, got {show(value)}", step, directory)
    return value


def _str(value: Any, field: str, step: int, directory: EPath, *, pattern: re.Pattern[str] | None = _NAME,
         max_len: int = 64, allowed: Any = None) -> str:
    ok = isinstance(value, str) and len(value) <= max_len and (pattern is None or pattern.fullmatch(value))
    if ok and allowed is not None:
        ok = value in allowed
    if not ok:
        what = f"one of {sorted(allowed)}" if allowed is not None else "a short name" if pattern is _NAME else \
            f"a string matching {pattern.pattern}" if pattern is not None else f"a string of <= {max_len} characters"
        raise _bad(field, f"must be {what}, got {show(value)}", step, directory)
    text: str = value
    return text


def _optional(value: Any, check: Any, *args: Any, **kw: Any) -> Any:
    return None if value is None else check(value, *args, **kw)


def check_record(record: Mapping[str, Any], step: int, directory: EPath) -> PagedAttentionCacheMetaData:
    """Every field of a parsed record, its type, range and agreement with the metadata;
    CheckpointIntegrityError names the first bad field (CheckpointMismatchError for an
    unknown fingerprint algorithm, which a newer easykv may write). Returns the metadata."""
    at = (step, directory)
    version = record["format_version"]
    _dict(record, "(top level)", *at, keys=_KEYS[version])
    _str(record["easykv_version"], "easykv_version", *at)
    if _int(record["step"], "step", *at) != step:
        raise _bad("step", f"is {record['step']} but the record lies in step directory {step}", *at)
    _str(record["created"], "created", *at, pattern=None)
    _dict(record["extra_metadata"], "extra_metadata", *at)
    _dict(record["metadata"], "metadata", *at)
    meta = saved_metadata(record, *at)
    for field in ("dtype", "kv_head_mesh_axes"):  # a cache's metadata leaves nothing to init_cache
        if getattr(meta, field) is None:
            raise _bad(f"metadata.{field}", "is null, but the metadata of a saved cache is complete", *at)
    dtype = known_dtype(meta.dtype)  # checked just above

    storage = _dict(record["storage"], "storage", *at, keys=frozenset({"platform", "logical_dtype", "quantization"}))
    platform = _str(storage["platform"], "storage.platform", *at)
    if storage["logical_dtype"] != dtype.name:
        raise _bad("storage.logical_dtype", f"is {show(storage['logical_dtype'])} but the metadata says "
                   f"{dtype.name!r}", *at)
    if storage["quantization"] != meta.quantization:
        raise _bad("storage.quantization", f"is {show(storage['quantization'])} but the metadata says "
                   f"{meta.quantization!r}", *at)

    _check_mesh(record["mesh"], meta, platform, at)
    algorithm = record["fingerprint_algorithm"]
    if algorithm is not None:
        _str(algorithm, "fingerprint_algorithm", *at, pattern=None)
        if algorithm not in KNOWN_FINGERPRINT_ALGORITHMS:
            raise CheckpointMismatchError(
                f"record field fingerprint_algorithm of step {step} in {directory} is {show(algorithm)}; this "
                f"easykv knows {list(KNOWN_FINGERPRINT_ALGORITHMS)}: a newer easykv wrote this step; upgrade "
                "easykv to read it")
    _check_arrays(record["arrays"], meta, platform, algorithm is not None, version, at)

    summary = record["manager"]
    if summary is not None:
        _dict(summary, "manager", *at, keys=frozenset(_SUMMARY_KEYS))
        for key in _SUMMARY_KEYS:
            _int(summary[key], f"manager.{key}", *at)
    if version >= 2:
        digest = _optional(record[MANAGER_SEAL], _str, MANAGER_SEAL, *at, pattern=_SHA256)
        if (digest is None) != (summary is None):
            raise _bad(MANAGER_SEAL, f"is {show(digest)} but the manager summary is {show(summary)}: both or "
                       "neither must be set", *at)
    return meta


def _check_mesh(mesh: Any, meta: PagedAttentionCacheMetaData, platform: str, at: tuple[int, Any]) -> None:
    """The mesh the cache was saved from (shown by inspect, returned as ``saved_mesh``): types,
    and agreement with the storage platform and the metadata's layout axes."""
    mesh = _dict(mesh, "mesh", *at, keys=_MESH_KEYS, optional=_MESH_LAYOUT_KEYS)
    if _str(mesh["platform"], "mesh.platform", *at) != platform:
        raise _bad("mesh.platform", f"is {mesh['platform']!r} but storage.platform is {platform!r}", *at)
    _str(mesh["device_kind"], "mesh.device_kind", *at, pattern=None, max_len=256)
    devices = _int(mesh["num_devices"], "mesh.num_devices", *at, lo=1, hi=1 << 24)
    _int(mesh["process_count"], "mesh.process_count", *at, lo=1, hi=1 << 24)
    if not set(mesh) & _MESH_LAYOUT_KEYS:
        return
    _dict(mesh, "mesh", *at, keys=_MESH_KEYS | _MESH_LAYOUT_KEYS)
    axes = {}
    for key in ("axis_names", "kv_head_mesh_axes", "page_mesh_axes"):
        axes[key] = [_str(name, f"mesh.{key}[{i}]", *at)
                     for i, name in enumerate(_list(mesh[key], f"mesh.{key}", *at, max_len=64))]
    sizes = [_int(size, f"mesh.shape[{show(name)}]", *at, lo=1, hi=1 << 24)
             for name, size in _dict(mesh["shape"], "mesh.shape", *at).items()]
    if list(mesh["shape"]) != axes["axis_names"] or math.prod(sizes) != devices:
        raise _bad("mesh.shape", f"is {show(mesh['shape'])} but axis_names is {axes['axis_names']} and "
                   f"num_devices {devices}", *at)
    for key in ("kv_head_mesh_axes", "page_mesh_axes"):
        if axes[key] != list(getattr(meta, key)):
            raise _bad(f"mesh.{key}", f"is {axes[key]} but the metadata says {list(getattr(meta, key))}", *at)


def _check_arrays(entries: Any, meta: PagedAttentionCacheMetaData, platform: str, fingerprinted: bool,
                  version: int, at: tuple[int, Any]) -> None:
    """The array list matches what the metadata implies, entry by entry."""
    expected = expected_leaves(meta, platform, version)
    # Stored as the saving platform stores them, or natively (a cache restored with
    # storage_platform="gpu" on CPU devices and saved again): same width either way.
    other = expected_leaves(meta, "gpu" if platform == "cpu" else "cpu", version)
    entries = _list(entries, "arrays", *at)
    if len(entries) != len(expected):
        raise _bad("arrays", f"lists {len(entries)} arrays but the metadata implies {len(expected)}", *at)
    for i, (entry, (name, path, sds), (_, _, alt)) in enumerate(zip(entries, expected, other)):
        field = f"arrays[{i}]"
        _dict(entry, field, *at, keys=_ARRAY_KEYS)
        if entry["name"] != name:
            raise _bad(f"{field}.name", f"is {show(entry['name'])}, expected {name!r}", *at)
        if entry["path"] != list(path):
            raise _bad(f"{field}.path", f"is {show(entry['path'])}, expected {list(path)}", *at, array=name)
        role = leaf_role(path)
        if entry["role"] != role:
            raise _bad(f"{field}.role", f"is {show(entry['role'])}, expected {role!r}", *at, array=name)
        shape = [_int(d, f"{field}.shape[{j}]", *at) for j, d in
                 enumerate(_list(entry["shape"], f"{field}.shape", *at, max_len=8))]
        if shape != list(sds.shape):
            raise _bad(f"{field}.shape", f"is {shape}, but the metadata implies {list(sds.shape)}", *at, array=name)
        dtypes = {np.dtype(sds.dtype).name, np.dtype(alt.dtype).name}
        stored = _str(entry["stored_dtype"], f"{field}.stored_dtype", *at, allowed=dtypes)
        nbytes = _int(entry["nbytes"], f"{field}.nbytes", *at)
        if nbytes != math.prod(shape) * np.dtype(stored).itemsize:
            raise _bad(f"{field}.nbytes", f"is {nbytes}, but {shape} {stored} holds "
                       f"{math.prod(shape) * np.dtype(stored).itemsize} bytes", *at, array=name)
        fingerprint = entry["fingerprint"]
        if fingerprinted:
            _str(fingerprint, f"{field}.fingerprint", *at, pattern=_ARRAY_FP)
        elif fingerprint is not None:
            raise _bad(f"{field}.fingerprint", f"is {show(fingerprint)} but fingerprint_algorithm is null", *at)


__all__ = [
    "EXTRA_MAX_DEPTH", "FORMAT", "FORMAT_VERSION", "LEGACY_VERSION", "MANAGER_FILE", "MANAGER_SEAL", "RECORD_FILE",
    "RECORD_SEAL", "STACKED_VERSION", "STATE_ITEM", "canonical", "check_record", "expected_leaves", "group_index",
    "expected_templates", "group_key", "is_legacy", "is_stacked", "layer_key", "leaf_role", "legacy_note", "nest",
    "page_leaves", "page_pairs", "read_manager_state", "read_record", "read_small_file", "record_digest", "refused",
    "saved_metadata", "seal", "small_file",
]
