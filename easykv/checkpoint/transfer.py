"""Moving one sequence between caches: a prefill host hands a sequence to a decode host.

    exported = export_sequence(cache, manager, seq_id, token_ids=prompt)   # host numpy arrays
    exported.save("seq.npz"); exported = SequenceExport.load("seq.npz")    # across hosts
    cache, new_id = import_sequence(other_cache, other_manager, exported)

The export holds the sequence's K/V token-major, ``(layers, length, kv_heads, head_dim)``, either
dense in the source's logical dtype (``dequantize=True``) or raw (quantized values in their value
dtype plus compact scales, per token and head: independent of the page layout). The importing
cache may have another mesh, page size, pool size or batch size; the manager there allocates
the pages (reusing cached prefix pages when the token ids are known) and one jitted, donating
write fills them. A raw export imported into a cache with the same quantizer is bit-exact;
otherwise the values are dequantized and re-encoded by the target (cast to its dtype).

Token ids: the PageManager keeps digests, not token ids, so pass ``token_ids=`` to
`export_sequence` (or give the manager a ``token_ids(seq_id)`` method). Without them the
import commits the tokens with ``manager.advance`` (no prefix caching for that sequence).

An export is input like any other: a `SequenceExport` checks every field when it is built
(also by `load`, from a file that may have been crafted), and `import_sequence` checks the
export, the cache, the manager and its own arguments before it changes anything. A failed
call leaves the manager (``state_dict()`` equal), the cache (not donated) and the export as
they were.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import zipfile
from collections.abc import Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from easykv.storage.cache import PagedAttentionCache
from easykv.errors import CacheFullError, InvariantError
from easykv.manager.manager import PageManager
from easykv.spec.metadata import SUPPORTED_DTYPES, canonical_dtype
from easykv.storage.pages import from_storage, read_pages, run_local, to_storage
from easykv.manager.prefix_hash import salt_digest
from easykv.quantization import SCALE_DTYPE, QuantizedPages, get_quantizer, is_compressing
from easykv.validation import INT32_MAX, boolean, integer, integer_array, optional_int, parse_json, positive_int
from easykv.storage.writes import scatter_encoded_local  # the encoded-token scatter every write uses

_EXPORT_FORMAT = "easykv.SequenceExport/1"
_HEADER_FIELDS = ("format", "length", "num_hidden_layers", "num_kv_heads", "kv_head_dim_size", "dtype",
                  "quantization", "raw", "source_page_size", "dtypes")
_MAX_HEADER_BYTES = 1 << 16  # what save writes is a few hundred bytes
_TOKEN_HINT = "token ids"


def _member_specs(length: int, layers: int, heads: int, head_dim: int, dtype: np.dtype, quantizer: Any,
                  raw: bool) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``"keys.dense"`` / ``"values.scales"`` ... -> (shape, dtype) that the other fields imply:
    the one description of an export's arrays, used by the constructor and by `load`."""
    base = (layers, length, heads)
    if raw:
        value_tail, value_dtype = quantizer.value_shape(head_dim)
        parts = {"values": (base + tuple(value_tail), np.dtype(value_dtype)),
                 "scales": (base + tuple(quantizer.scale_shape(head_dim)), np.dtype(SCALE_DTYPE))}
    else:
        parts = {"dense": (base + (head_dim,), dtype)}
    return {f"{part}.{sub}": spec for part in ("keys", "values") for sub, spec in parts.items()}


def _stored_dtype(dtype: np.dtype) -> np.dtype:
    """How `save` stores an array of ``dtype``: ints as they are, floats as their raw bits."""
    return dtype if dtype.kind in "iu" else np.dtype(f"u{dtype.itemsize}")


def _cache_dtype(name: str, value: Any) -> np.dtype:
    choices = ", ".join(SUPPORTED_DTYPES)
    if not isinstance(value, (str, np.dtype, type)):
        raise ValueError(f"{name} must be a cache dtype ({choices}), got {value!r:.60} of type {type(value).__name__}")
    try:
        dtype = canonical_dtype(value)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    except Exception as err:  # numpy's dtype parser on odd strings or types
        raise ValueError(f"{name} must be a cache dtype ({choices}), got {value!r:.60} ({err})") from None
    if not dtype.isnative:
        raise ValueError(f"{name} is {dtype.str}, a byte order other than this machine's; use {dtype.name}")
    return dtype


def _quantizer(name: str, value: Any, head_dim: int, dtype: np.dtype) -> Any:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a quantizer name (e.g. 'none', 'int8', 'fp8', 'int4'), got {value!r:.60} "
                         f"of type {type(value).__name__}")
    try:
        quantizer = get_quantizer(value)
        quantizer.validate(head_dim, dtype)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    return quantizer


def _host_array(name: str, value: Any) -> np.ndarray:
    if isinstance(value, jax.Array):
        try:
            value = np.asarray(value)
        except Exception as err:  # a tracer, a deleted buffer
            raise ValueError(f"{name} must be a concrete host array, got {type(value).__name__} ({err})") from None
    if not isinstance(value, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {value!r:.60} of type {type(value).__name__}")
    return np.asarray(value)


def _checked_array(name: str, value: Any, shape: tuple[int, ...], dtype: np.dtype, what: str) -> np.ndarray:
    arr = _host_array(name, value)
    if arr.dtype != dtype:
        raise ValueError(f"{name} has dtype {arr.dtype}, but {what} implies {dtype.name}; export and load "
                         "sequences with export_sequence and SequenceExport.load")
    if arr.shape != shape:
        raise ValueError(f"{name} has shape {arr.shape}, but {what} implies {shape} "
                         "(layers, length, kv_heads, ...)")
    return arr


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.size == 0 or np.array_equal(a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}"))


@dataclasses.dataclass(frozen=True, eq=False)
class SequenceExport:
    """One sequence's tokens and K/V, on the host.

    keys / values: dense ``(layers, length, kv_heads, head_dim)`` arrays in ``dtype``, or, when
    ``raw``, dicts ``{"values": (layers, length, kv_heads, packed), "scales": (layers, length,
    kv_heads[, groups])}`` of the ``quantization`` format. Every field is checked when the
    export is built (ValueError naming the field); ints and names are normalized (``dtype`` a
    numpy dtype, ``quantization`` the quantizer's name, ``token_ids`` int32). Two exports are
    equal when every field is, arrays bit for bit.
    """

    length: int
    num_hidden_layers: int
    num_kv_heads: int
    kv_head_dim_size: int
    dtype: np.dtype
    quantization: str
    raw: bool
    keys: Any
    values: Any
    token_ids: np.ndarray | None = None
    source_page_size: int | None = None

    def __post_init__(self) -> None:
        put = partial(object.__setattr__, self)
        length = positive_int("SequenceExport.length", self.length, hint="committed tokens of the sequence")
        layers = positive_int("SequenceExport.num_hidden_layers", self.num_hidden_layers)
        heads = positive_int("SequenceExport.num_kv_heads", self.num_kv_heads)
        head_dim = positive_int("SequenceExport.kv_head_dim_size", self.kv_head_dim_size)
        dtype = _cache_dtype("SequenceExport.dtype", self.dtype)
        quantizer = _quantizer("SequenceExport.quantization", self.quantization, head_dim, dtype)
        raw = boolean("SequenceExport.raw", self.raw)
        if raw and not is_compressing(quantizer):
            raise ValueError(f"SequenceExport.raw=True needs a compressing quantizer (int8, fp8, int4, ...), but "
                             f"quantization is {quantizer.name!r}; an export of an unquantized cache has raw=False")
        specs = _member_specs(length, layers, heads, head_dim, dtype, quantizer, raw)
        what = (f"{length} tokens x {layers} layers x {heads} kv heads of head_dim {head_dim} "
                + (f"in the raw {quantizer.name} format" if raw else f"in {dtype.name}"))
        for part in ("keys", "values"):
            data = getattr(self, part)
            if raw:
                if not isinstance(data, Mapping) or set(data) != {"values", "scales"}:
                    got = sorted(map(repr, data)) if isinstance(data, Mapping) else type(data).__name__
                    raise ValueError(f"SequenceExport.{part} of a raw export must be a dict with exactly the entries "
                                     f"'values' and 'scales', got {got}")
                data = {sub: _checked_array(f"SequenceExport.{part}[{sub!r}]", data[sub], *specs[f"{part}.{sub}"], what)
                        for sub in ("values", "scales")}
            else:
                data = _checked_array(f"SequenceExport.{part}", data, *specs[f"{part}.dense"], what)
            put(part, data)
        token_ids = self.token_ids
        if token_ids is not None:
            token_ids = integer_array("SequenceExport.token_ids", token_ids, ndim=1, lo=0, hi=INT32_MAX,
                                      hint=_TOKEN_HINT)
            if token_ids.shape != (length,):
                raise ValueError(f"SequenceExport.token_ids holds {token_ids.size} ids but the sequence has length="
                                 f"{length} tokens; pass exactly one id per token (or None)")
        source_page_size = optional_int("SequenceExport.source_page_size", self.source_page_size, lo=1)
        for name, value in (("length", length), ("num_hidden_layers", layers), ("num_kv_heads", heads),
                            ("kv_head_dim_size", head_dim), ("dtype", dtype), ("quantization", quantizer.name),
                            ("raw", raw), ("token_ids", token_ids), ("source_page_size", source_page_size)):
            put(name, value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SequenceExport):
            return NotImplemented
        scalars = ("length", "num_hidden_layers", "num_kv_heads", "kv_head_dim_size", "dtype", "quantization", "raw",
                   "source_page_size")
        if any(getattr(self, f) != getattr(other, f) for f in scalars):
            return False
        if (self.token_ids is None) != (other.token_ids is None) or (
                self.token_ids is not None and not np.array_equal(self.token_ids, other.token_ids)):
            return False
        mine, theirs = jax.tree.leaves((self.keys, self.values)), jax.tree.leaves((other.keys, other.values))
        return len(mine) == len(theirs) and all(_bits_equal(a, b) for a, b in zip(mine, theirs))

    __hash__ = None  # type: ignore[assignment]  # holds arrays

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in jax.tree.leaves((self.keys, self.values)))

    def dense(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) as dense ``(layers, length, kv_heads, head_dim)`` in ``dtype``."""
        if not self.raw:
            return self.keys, self.values
        q = get_quantizer(self.quantization)
        out = []
        for part in (self.keys, self.values):
            pages = QuantizedPages(jnp.asarray(part["values"]), jnp.asarray(part["scales"]), q)
            out.append(np.asarray(pages.dequantize(self.dtype)))
        return out[0], out[1]

    # ---- files ---------------------------------------------------------------------------------
    def save(self, file: Any) -> None:
        """Write to a path or binary file (numpy .npz; bf16/fp8 stored as their raw bits)."""
        arrays: dict[str, np.ndarray] = {}
        dtypes: dict[str, str] = {}
        for part in ("keys", "values"):
            data = getattr(self, part)
            items = data.items() if self.raw else [("dense", data)]
            for sub, arr in items:
                arr = np.asarray(arr)
                dtypes[f"{part}.{sub}"] = arr.dtype.name
                arrays[f"{part}.{sub}"] = arr.view(_stored_dtype(arr.dtype))
        if self.token_ids is not None:
            arrays["token_ids"] = np.asarray(self.token_ids, np.int32)
        header = {"format": _EXPORT_FORMAT, "length": self.length, "num_hidden_layers": self.num_hidden_layers,
                  "num_kv_heads": self.num_kv_heads, "kv_head_dim_size": self.kv_head_dim_size,
                  "dtype": self.dtype.name, "quantization": self.quantization, "raw": self.raw,
                  "source_page_size": self.source_page_size, "dtypes": dtypes}
        arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
        np.savez(file, **arrays)

    @classmethod
    def load(cls, file: Any) -> SequenceExport:
        """Read what `save` wrote (a path or a binary file). Everything in the file is checked
        before it is used: ValueError names what is wrong when the file is not a sequence
        export, is truncated or damaged, or holds fields or arrays that do not fit together."""
        if isinstance(file, (str, bytes, os.PathLike)):
            source = f"sequence export file {os.fsdecode(file)!r:.200}"
        elif callable(getattr(file, "read", None)) and callable(getattr(file, "seek", None)):
            source = "the sequence export file object"
        else:
            raise ValueError(f"SequenceExport.load takes a path or a binary file opened for reading, got "
                             f"{type(file).__name__}")
        return cls._load(file, source)

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        self.save(buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes) -> SequenceExport:
        """`load` from what `to_bytes` returned."""
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise ValueError(f"SequenceExport.from_bytes takes bytes (from to_bytes), got {type(blob).__name__}")
        return cls._load(io.BytesIO(bytes(blob)), f"the {len(blob)} bytes given")

    @classmethod
    def _load(cls, file: Any, source: str) -> SequenceExport:
        try:
            npz = np.load(file, allow_pickle=False)
        except Exception as err:  # missing file, not a zip, truncated, ...
            why = (f"{type(err).__name__}: {err}" if "allow_pickle" not in str(err)  # numpy's last guess
                   else "it is neither a zip (.npz) nor a .npy file")
            raise ValueError(f"{source} is not a readable easykv sequence export ({why})") from None
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise ValueError(f"{source} holds a single numpy array, not an easykv sequence export (the .npz "
                             "written by SequenceExport.save)")
        with npz:
            return cls._from_npz(npz, source)

    @classmethod
    def _from_npz(cls, npz: Any, source: str) -> SequenceExport:
        try:
            infos = npz.zip.infolist()
        except Exception as err:
            raise ValueError(f"{source} has an unreadable zip directory ({type(err).__name__}: {err})") from None
        members: dict[str, zipfile.ZipInfo] = {}
        for info in infos:
            name = info.filename
            if not name.endswith(".npy") or name[:-4] in members:
                raise ValueError(f"{source} holds the member {name!r:.80}, which "
                                 f"{'is not a .npy array' if not name.endswith('.npy') else 'appears twice'}; "
                                 "it is not a sequence export written by SequenceExport.save")
            members[name[:-4]] = info
        if "header" not in members:
            raise ValueError(f"{source} has no 'header' member; it is not an easykv sequence export")

        def read(name: str, check: Any) -> np.ndarray:
            return _read_member(npz, members[name], name, source, check)

        def header_check(shape: tuple[int, ...], dtype: np.dtype) -> str | None:
            if dtype != np.uint8 or len(shape) != 1 or shape[0] > _MAX_HEADER_BYTES:
                return f"must be at most {_MAX_HEADER_BYTES} bytes (uint8), got shape {shape} dtype {dtype}"
            return None

        header = parse_json(read("header", header_check).tobytes(), what=f"the header of {source}")
        if not isinstance(header, dict):
            raise ValueError(f"the header of {source} must be a JSON object, got {type(header).__name__}")
        if header.get("format") != _EXPORT_FORMAT:
            raise ValueError(f"{source} is not an easykv sequence export: header format {header.get('format')!r:.80}, "
                             f"expected {_EXPORT_FORMAT!r}")
        missing = [k for k in _HEADER_FIELDS if k not in header]
        unknown = sorted(k for k in header if k not in _HEADER_FIELDS)
        if missing or unknown:
            what = " and ".join(([f"lacks {missing}"] if missing else []) +
                                ([f"has unknown entries {unknown!r:.200}"] if unknown else []))
            raise ValueError(f"the header of {source} {what}; an {_EXPORT_FORMAT} header holds exactly "
                             f"{list(_HEADER_FIELDS)}")
        field = f"the header of {source}: field"
        length = positive_int(f"{field} 'length'", header["length"])
        layers = positive_int(f"{field} 'num_hidden_layers'", header["num_hidden_layers"])
        heads = positive_int(f"{field} 'num_kv_heads'", header["num_kv_heads"])
        head_dim = positive_int(f"{field} 'kv_head_dim_size'", header["kv_head_dim_size"])
        if not isinstance(header["dtype"], str):
            raise ValueError(f"{field} 'dtype' must be a dtype name, got {header['dtype']!r:.60}")
        dtype = _cache_dtype(f"{field} 'dtype'", header["dtype"])
        quantizer = _quantizer(f"{field} 'quantization'", header["quantization"], head_dim, dtype)
        raw = boolean(f"{field} 'raw'", header["raw"])
        if raw and not is_compressing(quantizer):
            raise ValueError(f"{field} 'raw' is true but quantization {quantizer.name!r} stores no raw format")
        source_page_size = optional_int(f"{field} 'source_page_size'", header["source_page_size"], lo=1)
        specs = _member_specs(length, layers, heads, head_dim, dtype, quantizer, raw)
        names = {name: dt.name for name, (_, dt) in specs.items()}
        if header["dtypes"] != names:
            raise ValueError(f"{field} 'dtypes' is {header['dtypes']!r:.200}, but the other fields imply {names}")
        expected = set(specs) | {"header"} | ({"token_ids"} & set(members))
        if set(members) != expected:
            raise ValueError(f"{source} holds the arrays {sorted(set(members) - {'header'})}, but its header implies "
                             f"{sorted(expected - {'header'})}")
        arrays = {}
        for name, (shape, dtype_) in specs.items():
            stored = _stored_dtype(dtype_)

            def check(got_shape: tuple[int, ...], got: np.dtype, shape=shape, stored=stored) -> str | None:
                if got_shape != shape or got != stored:
                    return (f"has shape {got_shape} dtype {got}, but the header implies shape {shape} stored as "
                            f"{stored.name}")
                return None

            arrays[name] = read(name, check).view(dtype_)
        token_ids = None
        if "token_ids" in members:

            def token_check(got_shape: tuple[int, ...], got: np.dtype) -> str | None:
                if got_shape != (length,) or got.kind not in "iu":
                    return f"must be {length} integer ids (one per token), got shape {got_shape} dtype {got}"
                return None

            token_ids = read("token_ids", token_check)
        parts = {p: ({s: arrays[f"{p}.{s}"] for s in ("values", "scales")} if raw else arrays[f"{p}.dense"])
                 for p in ("keys", "values")}
        try:
            return cls(length=length, num_hidden_layers=layers, num_kv_heads=heads, kv_head_dim_size=head_dim,
                       dtype=dtype, quantization=quantizer.name, raw=raw, keys=parts["keys"],
                       values=parts["values"], token_ids=token_ids, source_page_size=source_page_size)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None


def _read_member(npz: Any, info: zipfile.ZipInfo, name: str, source: str, check: Any) -> np.ndarray:
    """One .npy member, after its npy header passed ``check(shape, dtype) -> problem | None``
    and its size matches that header (nothing is allocated for a shape the file cannot hold)."""
    where = f"{source}: array {name!r}"
    try:
        with npz.zip.open(info) as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"npy format version {version} is not one SequenceExport.save writes")
            offset = f.tell()
    except Exception as err:
        raise ValueError(f"{where} is unreadable ({type(err).__name__}: {err}); the file is damaged or not an "
                         "easykv sequence export") from None
    if dtype.hasobject:
        raise ValueError(f"{where} holds Python objects; a sequence export holds only numbers")
    problem = check(tuple(shape), dtype)
    if problem:
        raise ValueError(f"{where} {problem}")
    size = offset + math.prod(shape) * dtype.itemsize
    if info.file_size != size or (info.compress_type == zipfile.ZIP_STORED and info.compress_size != size):
        raise ValueError(f"{where} declares {size} bytes but the zip entry holds {info.file_size} "
                         f"({info.compress_size} stored); the file is truncated or damaged")
    try:
        arr = npz[name]
    except Exception as err:  # CRC mismatch, short data, bad compression, ...
        raise ValueError(f"{where} is unreadable ({type(err).__name__}: {err}); the file is damaged") from None
    if not isinstance(arr, np.ndarray) or arr.shape != tuple(shape) or arr.dtype != dtype:
        raise ValueError(f"{where} changed while it was read; the file is damaged")
    return arr


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _tokens_major(x: jax.Array) -> jax.Array:
    """(heads, n, page_size, *tail) -> (n * page_size, heads, *tail)."""
    perm = (1, 2, 0) + tuple(range(3, x.ndim))
    y = jnp.transpose(x, perm)
    return y.reshape((-1,) + y.shape[2:])


@partial(jax.jit, static_argnames=("dequantize",))
def _gather_sequence(cache: PagedAttentionCache, ids: jax.Array, dequantize: bool) -> Any:
    meta = cache.metadata
    out: dict[str, list[Any]] = {"k": [], "v": []}
    for view in cache.views:
        for name, pages in (("k", view.key_pages), ("v", view.value_pages)):
            if isinstance(pages, QuantizedPages) and not dequantize:
                value_dtype = pages.quantizer.value_shape(2)[1]
                vals = from_storage(jnp.take(pages.values, ids, axis=1), value_dtype)
                out[name].append({"values": _tokens_major(vals),
                                  "scales": _tokens_major(jnp.take(pages.scales, ids, axis=1))})
            else:
                out[name].append(_tokens_major(read_pages(pages, ids, meta.dtype)))
    return jax.tree.map(lambda *xs: jnp.stack(xs), *out["k"]), jax.tree.map(lambda *xs: jnp.stack(xs), *out["v"])


_PAIRED = ("page_size", "num_pages_per_layer", "page_shards", "batch_size", "max_sequences", "num_pages_per_sequence")


def _check_pair(cache: Any, manager: Any) -> Any:
    """The cache's metadata, once ``cache`` is a live PagedAttentionCache and ``manager`` the
    PageManager of its pool; ValueError otherwise."""
    if not isinstance(cache, PagedAttentionCache):
        raise ValueError(f"cache must be a PagedAttentionCache, got {type(cache).__name__}")
    if not isinstance(manager, PageManager):
        raise ValueError(f"manager must be the easykv.PageManager of the cache's pool, got {type(manager).__name__}")
    meta, mine = cache.metadata, manager.metadata
    diff = [f"{k}: cache {getattr(meta, k)}, manager {getattr(mine, k)}" for k in _PAIRED
            if getattr(meta, k) != getattr(mine, k)]
    if diff:
        raise ValueError("the manager does not manage this cache's pool (" + "; ".join(diff) + "); pass the "
                         "PageManager created with the cache's metadata")
    if any(callable(getattr(leaf, "is_deleted", None)) and leaf.is_deleted() for leaf in jax.tree.leaves(cache)):
        raise ValueError("cache holds deleted arrays: it was donated to an earlier call (cache.write, "
                         "import_sequence, apply_pending, ...); pass the cache that call returned")
    return meta


def _manager_token_ids(manager: Any, seq_id: int) -> Any:
    fn = getattr(manager, "token_ids", None)
    return fn(seq_id) if callable(fn) else None


def export_sequence(cache: PagedAttentionCache, manager: PageManager, seq_id: int, *, token_ids: Any = None,
                    dequantize: bool = True) -> SequenceExport:
    """Sequence ``seq_id``'s committed tokens (``manager.length``) read from ``cache`` into host
    arrays; only its pages are read. ``dequantize=False`` keeps a quantized cache's values and
    scales as stored (bit-exact into a cache with the same quantizer). Reads only: the cache
    and the manager are unchanged. The manager's pending copies and scrubs of the sequence's
    pages must have been applied (``cache, _ = manager.apply_pending(cache)``)."""
    meta = _check_pair(cache, manager)
    dequantize = boolean("dequantize", dequantize)
    seq = integer("seq_id", seq_id, lo=0, hi=meta.batch_size - 1,
                  hint=f"a sequence id of this manager, batch_size={meta.batch_size}")
    length = manager.length(seq)  # UnknownSequenceError when not claimed
    if length == 0:
        raise ValueError(f"sequence {seq} has no committed tokens to export; commit them first (manager.step)")
    ps = meta.page_size
    ids = np.asarray(manager.pages(seq), np.int64)[: -(-length // ps)]
    if ids.size * ps < length or np.any((ids < 0) | (ids >= meta.num_pages_per_layer)):
        raise InvariantError(f"sequence {seq} holds pages {ids.tolist()} that cannot hold its {length} tokens in a "
                             f"pool of {meta.num_pages_per_layer} pages")
    pending = set(manager.pending_copies()[1].tolist()) | set(manager.pending_scrubs().tolist())
    if pending:
        late = [p for p in ids.tolist() if p in pending]
        if late:
            raise ValueError(f"sequence {seq}'s page {late[0]} has a pending copy-on-write copy or scrub, so the "
                             "cache does not hold its tokens yet; apply it first: "
                             "cache, _ = manager.apply_pending(cache)")
    if token_ids is None:
        token_ids = _manager_token_ids(manager, seq)
    if token_ids is not None:
        token_ids = integer_array("token_ids", token_ids, ndim=1, lo=0, hi=INT32_MAX, hint=_TOKEN_HINT)
        if token_ids.shape != (length,):
            raise ValueError(f"token_ids must be {length} integer ids (the sequence's committed tokens), got "
                             f"{token_ids.size} ids")
    padded = np.zeros(_pow2(ids.size), np.int32)  # few shapes for jit; page 0 is a valid filler
    padded[: ids.size] = ids
    raw = meta.quantizer.name != "none" and not dequantize
    keys, values = jax.device_get(_gather_sequence(cache, jnp.asarray(padded), dequantize=not raw))
    cut = lambda a: np.ascontiguousarray(np.asarray(a)[:, :length])  # noqa: E731
    return SequenceExport(length=length, num_hidden_layers=meta.num_hidden_layers, num_kv_heads=meta.num_kv_heads,
                          kv_head_dim_size=meta.kv_head_dim_size, dtype=meta.dtype, quantization=meta.quantization,
                          raw=raw, keys=jax.tree.map(cut, keys), values=jax.tree.map(cut, values),
                          token_ids=token_ids, source_page_size=ps)


@partial(jax.jit, donate_argnums=0)
def _write_raw(cache: PagedAttentionCache, keys: Any, values: Any, slots: jax.Array) -> PagedAttentionCache:
    views = []
    for i, view in enumerate(cache.views):
        kp, vp = view.key_pages, view.value_pages
        new = tuple(
            QuantizedPages(to_storage(part["values"][i], pages.values.dtype), part["scales"][i], pages.quantizer)
            for part, pages in ((keys, kp), (values, vp)))
        layout = view.layout

        def local(pages: Any, upd: Any, s: jax.Array, layout: Any = layout) -> Any:
            return scatter_encoded_local(pages, upd, s, layout=layout)

        kp, vp = run_local(local, layout, (kp, vp), new, (slots,), token_major=True)
        views.append(dataclasses.replace(view, key_pages=kp, value_pages=vp))
    return PagedAttentionCache(tuple(views))


def _checked_export(exported: Any) -> SequenceExport:
    """``exported`` checked again, as a new SequenceExport: its fields may have been changed
    (``object.__setattr__``, arrays reshaped in place) since it was built."""
    if not isinstance(exported, SequenceExport):
        raise ValueError(f"exported must be a SequenceExport (from export_sequence or SequenceExport.load), got "
                         f"{type(exported).__name__}")
    try:
        fields = {f.name: getattr(exported, f.name) for f in dataclasses.fields(SequenceExport)}
    except AttributeError as err:
        raise ValueError(f"exported is an incomplete SequenceExport ({err})") from None
    return SequenceExport(**fields)


def _check_import(meta: Any, exported: SequenceExport) -> None:
    fields = ("num_hidden_layers", "num_kv_heads", "kv_head_dim_size")
    diff = [f"{f}: export {getattr(exported, f)}, cache {getattr(meta, f)}"
            for f in fields if getattr(exported, f) != getattr(meta, f)]
    if diff:
        raise ValueError("the sequence comes from a model of another shape (" + "; ".join(diff) + "); import it into "
                         "a cache of the same model")
    if exported.length > meta.max_sequences:
        raise ValueError(f"the sequence holds {exported.length} tokens but the target cache allows at most "
                         f"max_sequences={meta.max_sequences}")


def _available_per_replica(manager: PageManager, meta: Any) -> np.ndarray:
    """Pages each data-parallel replica can hand out now (free or evictable): its slice minus
    the pages running sequences hold (a page is in use exactly while a sequence holds it)."""
    if meta.page_shards == 1:
        m = manager.metrics
        return np.array([m.free_pages + m.cached_pages], np.int64)
    per = meta.num_pages_per_layer // meta.page_shards
    ids = manager.active_ids
    table = manager.page_table(ids) if ids else np.zeros((0, 1), np.int32)
    held = np.unique(table[table >= 0])
    return per - np.bincount(held // per, minlength=meta.page_shards).astype(np.int64)


def _room(manager: PageManager, meta: Any, length: int, tokens: np.ndarray | None, salt: Any) -> bool:
    """Raise CacheFullError when no replica has the pages the sequence needs beyond its cached
    prefix. Returns True when every replica surely has them (whatever the prefix match
    shares); False when only the manager itself can tell (then it is asked on a copy)."""
    ps = meta.page_size
    total = -(-length // ps)
    matched = manager.cached_prefix_length(tokens, salt=salt) // ps if tokens is not None else 0
    need = total - matched
    avail = _available_per_replica(manager, meta)
    best = int(avail.max())
    if need > best:
        split = meta.page_shards > 1
        raise CacheFullError(
            f"importing a sequence of {length} tokens needs {need} new pages"
            f"{' in one data-parallel replica' if split else ''} ({matched} of its {total} pages are cached) but "
            f"only {best} are free or evictable{' in the emptiest replica' if split else ''}; release or preempt "
            "sequences first", resource="pages", needed=need, available=best,
            replica=int(avail.argmax()) if split else None)
    return total <= int(avail.min())


def _admit(manager: PageManager, seq_id: int | None, tokens: np.ndarray | None, salt: Any,
           length: int) -> tuple[int, int, int, Any]:
    """Claim, match the cached prefix, reserve: (seq, tokens matched, tokens to write, step
    metadata). On any failure the claimed id is released again."""
    if seq_id is None:
        [seq] = manager.claim(1)
    else:
        manager.external_claim([seq_id])
        seq = seq_id
    try:
        done = manager.match_prefix(seq, tokens, salt=salt) if tokens is not None else 0
        n = length - done
        step_meta = manager.build_step_metadata([seq], [n], pad_tokens_to=_pow2(n))
    except BaseException:
        manager.release(seq)
        raise
    return seq, done, n, step_meta


def import_sequence(cache: PagedAttentionCache, manager: PageManager, exported: SequenceExport, *,
                    seq_id: int | None = None, salt: Any = None,
                    reuse_prefix: bool = True) -> tuple[PagedAttentionCache, int]:
    """Give ``exported`` a sequence id in ``manager`` (``seq_id``, or the lowest free one), pages in
    ``cache``, and write its K/V. Returns ``(cache, seq_id)``; like ``cache.write`` the cache
    passed in is donated. With token ids and ``reuse_prefix``, pages already cached for the
    same prefix (same ``salt``) are shared instead of written; the written pages enter the
    prefix cache under ``salt`` (with ``reuse_prefix=False`` and a salt they stay out of it).
    The manager's pending copy-on-write copies and scrubs are applied first (they must precede
    any write).

    Everything is checked before anything changes: on ValueError (bad export, arguments, or a
    manager that is not the cache's) or CacheFullError (no sequence slot, or too few pages in
    the pool or in the data-parallel replica the sequence would live in), the manager is as
    before (``state_dict()`` equal) and the cache is neither donated nor written."""
    meta = _check_pair(cache, manager)
    exported = _checked_export(exported)
    _check_import(meta, exported)
    reuse_prefix = boolean("reuse_prefix", reuse_prefix)
    salt_digest(salt)  # ValueError for a salt the prefix cache cannot key
    if seq_id is not None:
        seq_id = integer("seq_id", seq_id, lo=0, hi=meta.batch_size - 1,
                         hint=f"a free sequence id of this manager, batch_size={meta.batch_size}, or None")
        if manager.contains(seq_id):
            raise ValueError(f"seq_id {seq_id} is already claimed; release it first, pick a free id or pass "
                             "seq_id=None")
    elif not manager.slots_remaining:
        raise CacheFullError(f"importing a sequence needs a free sequence slot but all batch_size={meta.batch_size} "
                             "are claimed; release finished sequences first", resource="sequence slots", needed=1,
                             available=0)
    tokens = exported.token_ids
    match = tokens if (tokens is not None and reuse_prefix) else None
    # Without the prefix match, written pages would be keyed under no salt: commit their ids
    # only when that is the namespace asked for.
    commit_ids = tokens is not None and (reuse_prefix or salt is None)
    raw_exact = exported.raw and exported.quantization == meta.quantization
    if raw_exact:
        keys, values = exported.keys, exported.values
    else:
        keys, values = exported.dense()
        keys, values = np.asarray(keys).astype(meta.dtype), np.asarray(values).astype(meta.dtype)

    if not _room(manager, meta, exported.length, match, salt):
        # Only the manager knows whether the pages its prefix match shares leave room in that
        # replica; ask it on a copy so that a refusal leaves the real one untouched (a release
        # after match_prefix would not restore its counters and LRU order).
        probe = PageManager.from_state_dict(manager.metadata, manager.state_dict())
        _admit(probe, seq_id, match, salt, exported.length)
    # Checked: from here on nothing fails for a reason the caller could have avoided.
    seq, done, n, step_meta = _admit(manager, seq_id, match, salt, exported.length)
    pad = _pow2(n) - n

    def window(a: np.ndarray) -> np.ndarray:
        a = np.asarray(a)[:, done:]
        return np.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) if pad else a

    try:
        cache, _ = manager.apply_pending(cache)
        if raw_exact:
            slots = jnp.asarray(step_meta.slot_mapping, jnp.int32)
            cache = _write_raw(cache, jax.tree.map(window, keys), jax.tree.map(window, values), slots)
        else:
            cache, dropped = cache.write(window(keys), window(values), step_meta)
            if int(dropped):
                raise InvariantError(f"import_sequence dropped {int(dropped)} of {n} tokens of sequence {seq}",
                                     where="import_sequence")
    except BaseException:
        manager.release(seq)
        raise
    if commit_ids:
        manager.step([seq], [tokens[done:]])
    else:
        manager.advance(seq, n)
    return cache, seq


__all__ = ["SequenceExport", "export_sequence", "import_sequence"]
