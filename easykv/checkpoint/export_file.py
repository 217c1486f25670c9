"""What every sequence export shares: the checks of its fields and its ``.npz`` file.

`ExportFile` is the base of `SequenceExport` (``sequence_export``: a cache of one layer
geometry) and `GroupedSequenceExport` (``grouped_export``: several layer groups): equality
(every field, arrays bit for bit), ``nbytes``, `save` / `to_bytes`, and the one loader
(`load` / `from_bytes`), which opens the file, checks its zip directory and header and hands the
header to the class's ``_from_header``. An export file is input like any other: nothing is
allocated for a shape the file cannot hold, and every problem is a ValueError naming it. Before
``zipfile`` parses the zip's directory, its end records are read and a file declaring more members
than any export holds (`MOST_MEMBERS`) is refused (`easykv.checked_files.check_zip_directory`). A path
is opened once and checked on that descriptor (`easykv.checked_files`): a FIFO, a device, a
directory, a file holding more than its members account for, or one that changes while read is
refused as `FileRefusedError` (a ValueError) naming it, never read until it blocks or fills
memory. Members are stored uncompressed, as `save` writes them, so what a read allocates is
bounded by the file's own size.

File format versions: 1 (every position), 2 (a window's positions: ``first_position`` > 0; an
older easykv refuses it by its format instead of reading its arrays from position 0), 3 (a cache
of several layer groups, each with its own geometry and window).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import zipfile
from collections.abc import Callable, Mapping
from typing import IO, Any, Generic, Self, TypeAlias, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from easykv.checked_files import check_zip_directory, open_regular, show_names
from easykv.errors import FileRefusedError
from easykv.quantization import QuantizedPages, Quantizer, get_quantizer, is_compressing, scale_dtype, scales_per_page
from easykv.spec.dtypes import SUPPORTED_DTYPES, canonical_dtype
from easykv.validation import INT32_MAX, integer_array, parse_json

EXPORT_FORMAT = "easykv.SequenceExport/1"
WINDOW_FORMAT = "easykv.SequenceExport/2"
GROUPED_FORMAT = "easykv.SequenceExport/3"
# What save writes is a few hundred bytes, and about 260 more per layer group: MOST_GROUPS groups
# of a model of a few hundred layers fit (a 64 KiB bound refused any export of over ~250 groups).
_MAX_HEADER_BYTES = 1 << 20
# What a zip spends beside each member's stored bytes, names and extras counted apart: its local
# header (30 bytes), a ZIP64 field numpy always asks for, a data descriptor (written to a stream
# that cannot seek back) and its central directory entry (46 bytes), rounded up generously.
_ZIP_BYTES_PER_MEMBER = 256
_ZIP_END_BYTES = 22 + 56 + 20  # end of central directory, its ZIP64 record and locator
#: The most layer groups a grouped export's header may describe.
MOST_GROUPS = 1024
# The most members an export file holds: per group its keys and values, each raw codes and scales
# (member_specs: 4 arrays) or dense (2), then the header and the token ids.
MOST_MEMBERS = MOST_GROUPS * 4 + 2
_LONGEST_MEMBER_NAME = len(f"group_{MOST_GROUPS - 1:03d}.values.scales.npy")
TOKEN_HINT = "token ids"  # the hint of a bad token_ids array (export and import)
_Loaded = TypeVar("_Loaded", bound="ExportFile[Any]")
#: ``check(shape, stored dtype)``: why a file member is not what the header implies (None: it is).
MemberCheck = Callable[[tuple[int, ...], np.dtype], "str | None"]
#: ``read(name, check)``: the file's member ``name`` as stored, once ``check`` accepts it.
MemberReader = Callable[[str, MemberCheck], np.ndarray]
#: An export's keys or values: dense values, or a raw export's codes and scales
#: (``{"values": ..., "scales": ...}``).
ExportPart: TypeAlias = np.ndarray | dict[str, np.ndarray]


class ExportFile(Generic[_Loaded]):
    """The base of the two export classes (see the module doc). A subclass is a frozen
    dataclass with ``token_ids`` and gives: ``_scalars`` (every field but the arrays, for
    equality), ``_arrays`` (a pytree of its arrays), ``_members`` (each array under its file
    name), ``_header`` (the file's header) and ``_from_header`` (the export a file holds).
    ``_Loaded``: what the subclass's `load` returns (`SequenceExport.load` reads either kind)."""

    __hash__ = None  # type: ignore[assignment]  # holds arrays
    token_ids: np.ndarray | None

    def _scalars(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def _arrays(self) -> Any:
        raise NotImplementedError

    def _members(self) -> list[tuple[str, Any]]:
        raise NotImplementedError

    def _header(self, dtypes: dict[str, str]) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _from_header(cls, header: dict[str, Any], members: Any, read: MemberReader, source: str) -> _Loaded:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, type(self)):
            return NotImplemented
        if self._scalars() != other._scalars():
            return False
        ids, other_ids = self.token_ids, other.token_ids
        if (ids is None) != (other_ids is None) or (
                ids is not None and other_ids is not None and not np.array_equal(ids, other_ids)):
            return False
        mine, theirs = jax.tree.leaves(self._arrays()), jax.tree.leaves(other._arrays())
        return len(mine) == len(theirs) and all(_bits_equal(a, b) for a, b in zip(mine, theirs))

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in jax.tree.leaves(self._arrays()))

    def save(self, file: str | os.PathLike[str] | IO[bytes]) -> None:
        """Write to a path or binary file (numpy .npz of the export's format version; bf16/fp8
        stored as their raw bits). ValueError, with nothing written, for an export that `load`
        would refuse for its size: more members than `MOST_MEMBERS` or a header over its bound."""
        arrays: dict[str, np.ndarray] = {}
        dtypes: dict[str, str] = {}
        for name, arr in self._members():
            arr = np.asarray(arr)
            dtypes[name] = arr.dtype.name
            arrays[name] = arr.view(stored_dtype(arr.dtype))
        if self.token_ids is not None:
            arrays["token_ids"] = np.asarray(self.token_ids, np.int32)
        header = json.dumps(self._header(dtypes)).encode()
        if len(arrays) + 1 > MOST_MEMBERS or len(header) > _MAX_HEADER_BYTES:
            raise ValueError(f"this {type(self).__name__} would be a file of {len(arrays) + 1} members with a header "
                             f"of {len(header)} bytes, but a load reads at most {MOST_MEMBERS} members and a "
                             f"{_MAX_HEADER_BYTES}-byte header; export fewer layer groups (at most {MOST_GROUPS}); "
                             "nothing was written")
        arrays["header"] = np.frombuffer(header, np.uint8)
        # The ignore: numpy's stub checks the ** entries against savez's allow_pickle (bool) too.
        np.savez(file, **arrays)  # type: ignore[arg-type]

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        self.save(buf)
        return buf.getvalue()

    @classmethod
    def load(cls, file: str | bytes | os.PathLike[str] | IO[bytes]) -> _Loaded:
        """Read what `save` wrote (a path or a binary file): `SequenceExport.load` reads an
        export of either kind, `GroupedSequenceExport.load` only a grouped one. Everything in
        the file is checked before it is used: ValueError names what is wrong when the file is
        not a sequence export, is truncated or damaged, or holds fields or arrays that do not
        fit together; `FileRefusedError` (a ValueError) when a path holds a NUL byte or is not a
        regular file (a FIFO, a device, a directory), when a file declares more zip members than
        an export holds (`MOST_MEMBERS`: refused before its directory is parsed), holds more than
        its members account for, or changes while read."""
        if isinstance(file, (str, bytes, os.PathLike)):
            return cls._load_path(os.fsdecode(file), f"sequence export file {os.fsdecode(file)!r:.200}")
        if callable(getattr(file, "read", None)) and callable(getattr(file, "seek", None)):
            return cls._load(file, "the sequence export file object", size=None)
        raise ValueError(f"SequenceExport.load takes a path or a binary file opened for reading, got "
                         f"{type(file).__name__}")

    @classmethod
    def from_bytes(cls, blob: bytes) -> _Loaded:
        """`load` from what `to_bytes` returned."""
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise ValueError(f"{cls.__name__}.from_bytes takes bytes (from to_bytes), got {type(blob).__name__}")
        data = bytes(blob)
        return cls._load(io.BytesIO(data), f"the {len(data)} bytes given", size=len(data))

    @classmethod
    def _load_path(cls, path: str, source: str) -> _Loaded:
        """The export in the file at ``path``, read through the one descriptor that was checked
        (never a check of the path followed by a second open of it)."""
        with contextlib.ExitStack() as stack:
            try:
                fd, info = stack.enter_context(open_regular(path))
            except FileRefusedError as err:
                raise FileRefusedError(f"{err}; a sequence export is the regular .npz file SequenceExport.save "
                                       "writes", path=path) from None
            except OSError as err:  # missing, unreadable
                raise ValueError(f"{source} is not a readable easykv sequence export ({type(err).__name__}: "
                                 f"{err})") from None
            stream = stack.enter_context(os.fdopen(fd, "rb", closefd=False))  # open_regular closes fd
            loaded = cls._load(stream, source, size=info.st_size, path=path)
            after = os.fstat(fd)
            if (after.st_size, after.st_mtime_ns) != (info.st_size, info.st_mtime_ns):
                raise FileRefusedError(f"{source} changed while it was read (it held {info.st_size} bytes, now "
                                       f"{after.st_size}); load it once nothing writes to it", path=path)
        return loaded

    @classmethod
    def _load(cls, file: Any, source: str, *, size: int | None, path: str | None = None) -> _Loaded:
        """The export in ``file`` (``size`` bytes long when known: a file holding more than its
        members account for is refused; ``path``: where it was read from, if a path)."""
        _check_zip_end(file, source, path)
        try:  # a zip, read as one: np.load would read a .npy (of any declared size) or a pickle too
            npz = np.lib.npyio.NpzFile(file, allow_pickle=False)
        except Exception as err:  # truncated, a damaged directory, ...
            raise ValueError(f"{source} is not a readable easykv sequence export ({type(err).__name__}: "
                             f"{err})") from None
        with npz:
            members, read, header = _npz_parts(npz, source, size=size, path=path)
            return cls._from_header(header, members, read, source)

    @classmethod
    def _from_file(cls, source: str, **fields: Any) -> Self:
        """The export of ``fields`` read from ``source``; its checks' errors name the file."""
        try:
            return cls(**fields)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None


def _check_zip_end(file: Any, source: str, path: str | None) -> None:
    """Refuse ``file`` (read from its end, then left where it was) unless it ends as a zip whose
    directory fits `MOST_MEMBERS` members, from its end records alone (`check_zip_directory`): before this,
    ``zipfile`` parsed 300,000 entries of a 17 MB file (5 s, +145 MiB) before any check ran."""
    try:
        start = file.tell()
        end = file.seek(0, os.SEEK_END)

        def read_at(offset: int, length: int) -> bytes:
            file.seek(offset)
            return bytes(file.read(length))

        is_zip = check_zip_directory(read_at, end, most_members=MOST_MEMBERS, longest_name=_LONGEST_MEMBER_NAME,
                                     what=source, expected="a sequence export", path=path)
        file.seek(start)
    except FileRefusedError:
        raise
    except Exception as err:  # a file object that cannot seek or read
        raise ValueError(f"{source} is not a readable easykv sequence export ({type(err).__name__}: {err})") from None
    if not is_zip:
        raise ValueError(f"{source} is not a readable easykv sequence export (it is no zip: no end of central "
                         "directory record; SequenceExport.save writes an .npz)")


def unknown_format(fmt: object, source: str) -> ValueError:
    return ValueError(f"{source} is not an easykv sequence export: header format {fmt!r:.80}, expected "
                      f"{EXPORT_FORMAT!r}, {WINDOW_FORMAT!r} or {GROUPED_FORMAT!r}")


# ---- fields ----------------------------------------------------------------------------------------
def member_specs(tokens: int, layers: int, heads: int, head_dim: int, dtype: np.dtype, quantizer: Quantizer,
                 raw: bool) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``"keys.dense"`` / ``"values.scales"`` ... -> (shape, dtype) that the other fields imply:
    the one description of an export's arrays, used by the constructors and by the loader."""
    base = (layers, tokens, heads)
    if raw:
        if not is_compressing(quantizer):  # the exports check this first, naming their field
            raise ValueError(f"a raw export holds codes and scales, which quantizer {quantizer.name!r} has not")
        value_tail, value_dtype = quantizer.value_shape(head_dim)
        parts = {"values": (base + tuple(value_tail), np.dtype(value_dtype)),
                 "scales": (base + tuple(quantizer.scale_shape(head_dim)), scale_dtype(quantizer))}
    else:
        parts = {"dense": (base + (head_dim,), dtype)}
    return {f"{part}.{sub}": spec for part in ("keys", "values") for sub, spec in parts.items()}


def check_raw_exportable(quantizer: Quantizer, what: str) -> None:
    """A raw export holds codes and scales token by token; a quantizer whose scales are per page
    (``int4-ch``) has no such form: ValueError naming ``what`` asked for one."""
    if scales_per_page(quantizer):
        raise ValueError(f"{what}: {quantizer.name} pages keep one scale per page and channel, which a token-major "
                         "raw export cannot carry; export with dequantize=True (the import quantizes the tokens again)")


def stored_dtype(dtype: np.dtype) -> np.dtype:
    """How `save` stores an array of ``dtype``: ints as they are, floats as their raw bits."""
    return dtype if dtype.kind in "iu" else np.dtype(f"u{dtype.itemsize}")


def cache_dtype(name: str, value: object) -> np.dtype:
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


def quantizer_for(name: str, value: object, head_dim: int, dtype: np.dtype) -> Quantizer:
    """The quantizer named ``value`` (field ``name``), checked for ``head_dim`` and ``dtype``."""
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


def checked_part(name: str, data: object, specs: Mapping[str, tuple[tuple[int, ...], np.dtype]], prefix: str,
                 raw: bool, what: str) -> ExportPart:
    """Keys or values (field ``name``) as ``specs`` says member ``prefix`` must be: one dense
    array, or (``raw``) a dict of the codes and scales."""
    if not raw:
        return _checked_array(name, data, *specs[f"{prefix}.dense"], what)
    if not isinstance(data, Mapping) or set(data) != {"values", "scales"}:
        got = sorted(map(repr, data)) if isinstance(data, Mapping) else type(data).__name__
        raise ValueError(f"{name} of a raw export must be a dict with exactly the entries 'values' and 'scales', "
                         f"got {got}")
    return {sub: _checked_array(f"{name}[{sub!r}]", data[sub], *specs[f"{prefix}.{sub}"], what)
            for sub in ("values", "scales")}


def checked_token_ids(owner: str, token_ids: object, length: int) -> np.ndarray | None:
    """An export's ``token_ids``: None, or one int32 id per token of its ``length``."""
    if token_ids is None:
        return None
    ids = integer_array(f"{owner}.token_ids", token_ids, ndim=1, lo=0, hi=INT32_MAX, hint=TOKEN_HINT)
    if ids.shape != (length,):
        raise ValueError(f"{owner}.token_ids holds {ids.size} ids but the sequence has length={length} "
                         "tokens; pass exactly one id per token (or None)")
    return ids


def dense_part(part: ExportPart, quantizer: Quantizer, dtype: np.dtype) -> np.ndarray:
    """An export's keys or values as dense values in ``dtype``: dense ones as they are (checked in
    it when the export was built), raw codes and scales (a dict) dequantized."""
    if isinstance(part, np.ndarray):
        return part
    if not is_compressing(quantizer):  # a raw export's quantizer, checked when it was built
        raise ValueError(f"raw codes and scales need a compressing quantizer, not {quantizer.name!r}")
    return np.asarray(QuantizedPages(jnp.asarray(part["values"]), jnp.asarray(part["scales"]),
                                     quantizer).dequantize(dtype))


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.size == 0 or np.array_equal(a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}"))


# ---- the file --------------------------------------------------------------------------------------
def header_dtype(header: Mapping[str, Any], field: str) -> np.dtype:
    """The header's 'dtype': a cache dtype, written as its name."""
    if not isinstance(header["dtype"], str):
        raise ValueError(f"{field} 'dtype' must be a dtype name, got {header['dtype']!r:.60}")
    return cache_dtype(f"{field} 'dtype'", header["dtype"])


def read_arrays(header: Mapping[str, Any], members: Mapping[str, zipfile.ZipInfo], read: MemberReader,
                specs: Mapping[str, tuple[tuple[int, ...], np.dtype]], source: str, field: str, *,
                shown: int) -> dict[str, np.ndarray]:
    """The arrays ``specs`` names, once the header's 'dtypes' (quoted up to ``shown``
    characters in an error) and the file's members are what the header's other fields imply."""
    names = {name: dt.name for name, (_, dt) in specs.items()}
    if header["dtypes"] != names:
        raise ValueError(f"{field} 'dtypes' is {header['dtypes']!r:.{shown}}, but the other fields imply {names}")
    expected = set(specs) | {"header"} | ({"token_ids"} & set(members))
    if set(members) != expected:
        extra, missing = sorted(set(members) - expected), sorted(expected - set(members))
        raise ValueError(f"{source} " + " and ".join(
            ([f"holds the arrays {show_names(extra)}, which its header does not imply"] if extra else [])
            + ([f"lacks the arrays {show_names(missing)}, which its header implies"] if missing else [])))
    return {name: _read_array(read, name, shape, dt) for name, (shape, dt) in specs.items()}


def _read_array(read: MemberReader, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Member ``name`` as saved (floats as raw bits), checked against ``shape`` and viewed as ``dtype``."""
    stored = stored_dtype(dtype)

    def check(got_shape: tuple[int, ...], got: np.dtype) -> str | None:
        if got_shape != shape or got != stored:
            return f"has shape {got_shape} dtype {got}, but the header implies shape {shape} stored as {stored.name}"
        return None

    return read(name, check).view(dtype)


def read_token_ids(read: MemberReader, members: Mapping[str, zipfile.ZipInfo], length: int) -> np.ndarray | None:
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
                            ([f"has unknown entries {show_names(unknown)}"] if unknown else []))
        extra = f" (and may hold {list(optional)})" if optional else ""
        raise ValueError(f"the header of {source} {what}; an {fmt} header holds exactly {list(fields)}{extra}")


def _npz_parts(npz: Any, source: str, *, size: int | None, path: str | None
               ) -> tuple[dict[str, zipfile.ZipInfo], MemberReader, dict[str, Any]]:
    """The members of an export file, a checked reader of one member (``read(name, check)``)
    and its parsed header (a dict; its fields are for the export class to check). ``size``:
    the file's bytes when known (a file holding more than its members account for is refused);
    ``path``: the file's, if it was read from one."""
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
        if info.compress_type != zipfile.ZIP_STORED:  # a few compressed bytes could claim any size
            raise ValueError(f"{source} holds the member {name!r:.80} compressed (zip method {info.compress_type}); "
                             "SequenceExport.save stores every member uncompressed")
        members[name[:-4]] = info
    _check_file_size(infos, npz.zip.comment, size, path, source)
    if "header" not in members:
        raise ValueError(f"{source} has no 'header' member; it is not an easykv sequence export")

    def read(name: str, check: MemberCheck) -> np.ndarray:
        return _read_member(npz, members[name], name, source, check)

    def header_check(shape: tuple[int, ...], dtype: np.dtype) -> str | None:
        if dtype != np.uint8 or len(shape) != 1 or shape[0] > _MAX_HEADER_BYTES:
            return f"must be at most {_MAX_HEADER_BYTES} bytes (uint8), got shape {shape} dtype {dtype}"
        return None

    header = parse_json(read("header", header_check).tobytes(), what=f"the header of {source}")
    if not isinstance(header, dict):
        raise ValueError(f"the header of {source} must be a JSON object, got {type(header).__name__}")
    return members, read, header


def _check_file_size(infos: list[zipfile.ZipInfo], comment: bytes, size: int | None, path: str | None,
                     source: str) -> None:
    """FileRefusedError when a file of ``size`` bytes holds more than the zip of ``infos``
    accounts for: a gap or a tail (a huge sparse file) is no part of what `save` wrote."""
    if size is None:
        return
    bound = _ZIP_END_BYTES + len(comment) + sum(
        info.compress_size + _ZIP_BYTES_PER_MEMBER + 2 * (len(info.filename.encode()) + len(info.extra))
        + len(info.comment) for info in infos)  # fmt: skip
    if size > bound:
        raise FileRefusedError(f"{source} holds {size} bytes, but its {len(infos)} members account for at most "
                               f"{bound}; the rest is not part of a sequence export (SequenceExport.save writes "
                               "the zip alone)", path=path)


def _read_member(npz: Any, info: zipfile.ZipInfo, name: str, source: str, check: MemberCheck) -> np.ndarray:
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
    if info.file_size != size or info.compress_size != size:  # stored: _npz_parts refused compressed members
        raise ValueError(f"{where} declares {size} bytes but the zip entry holds {info.file_size} "
                         f"({info.compress_size} stored); the file is truncated or damaged")
    try:
        arr = npz[name]
    except Exception as err:  # CRC mismatch, short data, bad compression, ...
        raise ValueError(f"{where} is unreadable ({type(err).__name__}: {err}); the file is damaged") from None
    if not isinstance(arr, np.ndarray) or arr.shape != tuple(shape) or arr.dtype != dtype:
        raise ValueError(f"{where} changed while it was read; the file is damaged")
    return arr


__all__ = ["ExportFile"]
