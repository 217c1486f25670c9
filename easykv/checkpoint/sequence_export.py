"""The file format of a sequence moved between caches: `SequenceExport`, its checks and its
``.npz`` file (`SequenceExport.save` / `SequenceExport.load`).

The export holds the sequence's K/V token-major, ``(layers, tokens, kv_heads, head_dim)``, either
dense in the source's logical dtype or raw (quantized values in their value dtype plus compact
scales, per token and head: independent of the page layout), for positions ``first_position ..
length - 1``: all of them, or (from a sliding or chunked cache) those its window still reads.
`easykv.checkpoint.transfer` makes and consumes exports (`export_sequence`, `import_sequence`).
A cache of several layer groups exports a `GroupedSequenceExport` (`grouped_export`, file
format version 3); `SequenceExport.load` reads files of every version.

An export is input like any other: a `SequenceExport` checks every field when it is built
(also by `load`, from a file that may have been crafted), naming the field in a ValueError.
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

from easykv.spec.metadata import SUPPORTED_DTYPES, canonical_dtype
from easykv.quantization import QuantizedPages, get_quantizer, is_compressing, scale_dtype, scales_per_page
from easykv.validation import INT32_MAX, boolean, integer, integer_array, optional_int, parse_json, positive_int

_EXPORT_FORMAT = "easykv.SequenceExport/1"
_HEADER_FIELDS = ("format", "length", "num_hidden_layers", "num_kv_heads", "kv_head_dim_size", "dtype",
                  "quantization", "raw", "source_page_size", "dtypes")
# Version 2: an export that holds only a window's tokens (first_position > 0); older easykv
# refuses it by its format instead of reading its arrays from position 0.
_WINDOW_FORMAT = "easykv.SequenceExport/2"
_WINDOW_FIELDS = _HEADER_FIELDS + ("first_position",)
# Version 3: a cache of several layer groups, each with its own geometry and window
# (`easykv.checkpoint.grouped_export`).
GROUPED_FORMAT = "easykv.SequenceExport/3"
_MAX_HEADER_BYTES = 1 << 16  # what save writes is a few hundred bytes
TOKEN_HINT = "token ids"  # the hint of a bad token_ids array (export and import)


def _member_specs(tokens: int, layers: int, heads: int, head_dim: int, dtype: np.dtype, quantizer: Any,
                  raw: bool) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``"keys.dense"`` / ``"values.scales"`` ... -> (shape, dtype) that the other fields imply:
    the one description of an export's arrays, used by the constructor and by `load`."""
    base = (layers, tokens, heads)
    if raw:
        value_tail, value_dtype = quantizer.value_shape(head_dim)
        parts = {"values": (base + tuple(value_tail), np.dtype(value_dtype)),
                 "scales": (base + tuple(quantizer.scale_shape(head_dim)), scale_dtype(quantizer))}
    else:
        parts = {"dense": (base + (head_dim,), dtype)}
    return {f"{part}.{sub}": spec for part in ("keys", "values") for sub, spec in parts.items()}


def check_raw_exportable(quantizer: Any, what: str) -> None:
    """A raw export holds codes and scales token by token; a quantizer whose scales are per page
    (``int4-ch``) has no such form: ValueError naming ``what`` asked for one."""
    if scales_per_page(quantizer):
        raise ValueError(f"{what}: {quantizer.name} pages keep one scale per page and channel, which a token-major "
                         "raw export cannot carry; export with dequantize=True (the import quantizes the tokens again)")


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


def checked_token_ids(owner: str, token_ids: Any, length: int) -> np.ndarray | None:
    """An export's ``token_ids``: None, or one int32 id per token of its ``length``."""
    if token_ids is None:
        return None
    token_ids = integer_array(f"{owner}.token_ids", token_ids, ndim=1, lo=0, hi=INT32_MAX, hint=TOKEN_HINT)
    if token_ids.shape != (length,):
        raise ValueError(f"{owner}.token_ids holds {token_ids.size} ids but the sequence has length={length} "
                         "tokens; pass exactly one id per token (or None)")
    return token_ids


def same_contents(ids: np.ndarray | None, other_ids: np.ndarray | None, arrays: Any, other_arrays: Any) -> bool:
    """Whether two exports hold the same token ids and, bit for bit, the same arrays."""
    if (ids is None) != (other_ids is None) or (ids is not None and not np.array_equal(ids, other_ids)):
        return False
    mine, theirs = jax.tree.leaves(arrays), jax.tree.leaves(other_arrays)
    return len(mine) == len(theirs) and all(_bits_equal(a, b) for a, b in zip(mine, theirs))


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.size == 0 or np.array_equal(a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}"))


@dataclasses.dataclass(frozen=True, eq=False)
class SequenceExport:
    """One sequence's tokens and K/V, on the host.

    keys / values: dense ``(layers, tokens, kv_heads, head_dim)`` arrays in ``dtype``, or, when
    ``raw``, dicts ``{"values": (layers, tokens, kv_heads, packed), "scales": (layers, tokens,
    kv_heads[, groups])}`` of the ``quantization`` format, where ``tokens = length -
    first_position``: the K/V of positions ``first_position .. length - 1`` (``first_position``
    > 0: a sliding or chunked cache's sequence, exported with the tokens its window still
    reads; ``token_ids`` then still names every token from the first). Every field is checked when the
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
    first_position: int = 0

    def __post_init__(self) -> None:
        put = partial(object.__setattr__, self)
        length = positive_int("SequenceExport.length", self.length, hint="committed tokens of the sequence")
        layers = positive_int("SequenceExport.num_hidden_layers", self.num_hidden_layers)
        heads = positive_int("SequenceExport.num_kv_heads", self.num_kv_heads)
        head_dim = positive_int("SequenceExport.kv_head_dim_size", self.kv_head_dim_size)
        first = integer("SequenceExport.first_position", self.first_position, lo=0, hi=length - 1,
                        hint="the first position whose K/V the export holds, below its length")
        dtype = _cache_dtype("SequenceExport.dtype", self.dtype)
        quantizer = _quantizer("SequenceExport.quantization", self.quantization, head_dim, dtype)
        raw = boolean("SequenceExport.raw", self.raw)
        if raw and not is_compressing(quantizer):
            raise ValueError(f"SequenceExport.raw=True needs a compressing quantizer (int8, fp8, int4, ...), but "
                             f"quantization is {quantizer.name!r}; an export of an unquantized cache has raw=False")
        if raw:
            check_raw_exportable(quantizer, "SequenceExport.raw=True")
        specs = _member_specs(length - first, layers, heads, head_dim, dtype, quantizer, raw)
        span = f" (positions {first}..{length - 1})" if first else ""
        what = (f"{length - first} tokens{span} x {layers} layers x {heads} kv heads of head_dim {head_dim} "
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
        token_ids = checked_token_ids("SequenceExport", self.token_ids, length)
        source_page_size = optional_int("SequenceExport.source_page_size", self.source_page_size, lo=1)
        for name, value in (("length", length), ("num_hidden_layers", layers), ("num_kv_heads", heads),
                            ("kv_head_dim_size", head_dim), ("dtype", dtype), ("quantization", quantizer.name),
                            ("raw", raw), ("token_ids", token_ids), ("source_page_size", source_page_size),
                            ("first_position", first)):
            put(name, value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SequenceExport):
            return NotImplemented
        scalars = ("length", "num_hidden_layers", "num_kv_heads", "kv_head_dim_size", "dtype", "quantization", "raw",
                   "source_page_size", "first_position")
        if any(getattr(self, f) != getattr(other, f) for f in scalars):
            return False
        return same_contents(self.token_ids, other.token_ids, (self.keys, self.values), (other.keys, other.values))

    __hash__ = None  # type: ignore[assignment]  # holds arrays

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in jax.tree.leaves((self.keys, self.values)))

    def dense(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) as dense ``(layers, length - first_position, kv_heads, head_dim)`` in ``dtype``."""
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
        if self.first_position:
            header.update(format=_WINDOW_FORMAT, first_position=self.first_position)
        arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
        np.savez(file, **arrays)

    @classmethod
    def load(cls, file: Any) -> Any:
        """Read what `save` (or `GroupedSequenceExport.save`, whose export it returns) wrote (a
        path or a binary file). Everything in the file is checked before it is used: ValueError
        names what is wrong when the file is not a sequence export, is truncated or damaged, or
        holds fields or arrays that do not fit together."""
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
    def _from_npz(cls, npz: Any, source: str) -> Any:
        members, read, header = _npz_parts(npz, source)
        if header.get("format") == GROUPED_FORMAT:  # a cache of several layer groups
            from easykv.checkpoint.grouped_export import GroupedSequenceExport

            return GroupedSequenceExport._from_header(header, members, read, source)
        fmt = header.get("format")
        if fmt not in (_EXPORT_FORMAT, _WINDOW_FORMAT):
            raise ValueError(f"{source} is not an easykv sequence export: header format {fmt!r:.80}, expected "
                             f"{_EXPORT_FORMAT!r}, {_WINDOW_FORMAT!r} or {GROUPED_FORMAT!r}")
        check_header_keys(header, _HEADER_FIELDS if fmt == _EXPORT_FORMAT else _WINDOW_FIELDS, fmt, source)
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
        if raw:
            check_raw_exportable(quantizer, f"{field} 'raw'")
        source_page_size = optional_int(f"{field} 'source_page_size'", header["source_page_size"], lo=1)
        first = 0
        if fmt == _WINDOW_FORMAT:  # version 2 exists for a window: first_position 0 is written as version 1
            first = integer(f"{field} 'first_position'", header["first_position"], lo=1, hi=length - 1,
                            hint="the first position the export holds, in 1..length - 1 in a version-2 header")
        specs = _member_specs(length - first, layers, heads, head_dim, dtype, quantizer, raw)
        names = {name: dt.name for name, (_, dt) in specs.items()}
        if header["dtypes"] != names:
            raise ValueError(f"{field} 'dtypes' is {header['dtypes']!r:.200}, but the other fields imply {names}")
        expected = set(specs) | {"header"} | ({"token_ids"} & set(members))
        if set(members) != expected:
            raise ValueError(f"{source} holds the arrays {sorted(set(members) - {'header'})}, but its header implies "
                             f"{sorted(expected - {'header'})}")
        arrays = {name: read_array(read, name, shape, dtype_) for name, (shape, dtype_) in specs.items()}
        token_ids = read_token_ids(read, members, length)
        parts = {p: ({s: arrays[f"{p}.{s}"] for s in ("values", "scales")} if raw else arrays[f"{p}.dense"])
                 for p in ("keys", "values")}
        try:
            return cls(length=length, num_hidden_layers=layers, num_kv_heads=heads, kv_head_dim_size=head_dim,
                       dtype=dtype, quantization=quantizer.name, raw=raw, keys=parts["keys"],
                       values=parts["values"], token_ids=token_ids, source_page_size=source_page_size,
                       first_position=first)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None


def _npz_parts(npz: Any, source: str) -> tuple[dict[str, zipfile.ZipInfo], Any, dict[str, Any]]:
    """The members of an export file, a checked reader of one member (``read(name, check)``)
    and its parsed header (a dict; its fields are for the export class to check)."""
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
    return members, read, header


def read_array(read: Any, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Member ``name`` as saved (floats as raw bits), checked against ``shape`` and viewed as ``dtype``."""
    stored = _stored_dtype(dtype)

    def check(got_shape: tuple[int, ...], got: np.dtype) -> str | None:
        if got_shape != shape or got != stored:
            return f"has shape {got_shape} dtype {got}, but the header implies shape {shape} stored as {stored.name}"
        return None

    return read(name, check).view(dtype)


def read_token_ids(read: Any, members: Mapping[str, Any], length: int) -> np.ndarray | None:
    """The ``token_ids`` member when the file has one: ``length`` integer ids."""
    if "token_ids" not in members:
        return None

    def check(got_shape: tuple[int, ...], got: np.dtype) -> str | None:
        if got_shape != (length,) or got.kind not in "iu":
            return f"must be {length} integer ids (one per token), got shape {got_shape} dtype {got}"
        return None

    return read("token_ids", check)


def check_header_keys(header: Mapping[str, Any], fields: tuple[str, ...], fmt: str, source: str, *,
                      optional: tuple[str, ...] = ()) -> None:
    """``header`` holds every one of ``fields``, any of ``optional`` and nothing else."""
    missing = [k for k in fields if k not in header]
    unknown = sorted(k for k in header if k not in fields + optional)
    if missing or unknown:
        what = " and ".join(([f"lacks {missing}"] if missing else []) +
                            ([f"has unknown entries {unknown!r:.200}"] if unknown else []))
        extra = f" (and may hold {list(optional)})" if optional else ""
        raise ValueError(f"the header of {source} {what}; an {fmt} header holds exactly {list(fields)}{extra}")


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


__all__ = ["SequenceExport"]
