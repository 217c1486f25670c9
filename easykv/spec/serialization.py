"""The frozen-dataclass base of easykv's metadata classes: exact, versioned JSON round trips.

A cache's metadata is saved beside checkpoints and shipped between hosts, so a round trip must
give back an equal (and equally hashable) object, and a JSON from another class, a newer easykv
or a hand edit with a typo must fail loudly with the fix rather than build a wrong cache.
Deliberately free of jax: dtypes go through numpy (with ml_dtypes for bfloat16 / float8).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import ml_dtypes  # noqa: F401  registers bfloat16 / float8 / int4 names with numpy.dtype
import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from easykv.errors import SerializationError
from easykv.validation import parse_json, show

_T = TypeVar("_T", bound="Serializable")
_SCHEMA_KEY = "__schema__"
_ARRAY_KEY = "__ndarray__"
_VERSION_KEY = "__version__"
_DTYPE_EXAMPLES = "float32, bfloat16, float16, float8_e4m3fn, float8_e5m2, int8, int4, uint8"


def _to_lists(value: Any) -> Any:
    """Tuples (at any depth) -> lists, numpy scalars -> Python scalars: what JSON can hold."""
    if isinstance(value, (tuple, list)):
        return [_to_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_lists(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _to_tuples(value: Any) -> Any:
    """Lists (at any depth) -> tuples, so decoded fields compare and hash like the originals."""
    if isinstance(value, (list, tuple)):
        return tuple(_to_tuples(v) for v in value)
    return value


def _check_json_safe(value: Any, where: str) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_json_safe(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise SerializationError(f"{where} has a non-string key {show(k)}; JSON needs str")
            _check_json_safe(v, f"{where}[{show(k)}]")
        return
    raise SerializationError(
        f"{where} holds {show(value)} of type {type(value).__name__}, which JSON cannot hold; "
        "give the field metadata={'codec': 'dtype'} or {'codec': 'tuple'}, or store a "
        "plain value")


def encode_dtype(value: DTypeLike, field: str = "dtype") -> str:
    """The canonical name of a numpy/jax dtype (``jnp.bfloat16`` -> ``"bfloat16"``)."""
    try:
        name = np.dtype(value).name
    except (TypeError, ValueError, RecursionError) as e:
        raise SerializationError(
            f"field {show(field)}: {show(value)} is not a dtype ({e}); use e.g. jnp.bfloat16") from None
    return name


def decode_dtype(name: object, field: str = "dtype") -> np.dtype:
    """``np.dtype`` from its name; bfloat16 / float8 names resolve through ml_dtypes."""
    if not isinstance(name, str):
        raise SerializationError(
            f"field {show(field)}: a dtype must be written as its name, got {show(name)}; "
            f"e.g. one of {_DTYPE_EXAMPLES}")
    try:
        return np.dtype(name)
    except (TypeError, ValueError):
        raise SerializationError(
            f"field {show(field)}: unknown dtype name {show(name)}; expected e.g. one of "
            f"{_DTYPE_EXAMPLES}") from None


def encode_array(value: ArrayLike, field: str = "array") -> dict[str, Any]:
    """An array as JSON: its dtype name, its shape and its bytes (C order, base64). Never
    ``str(array)``, which drops digits and elides the middle of large arrays."""
    try:
        arr = np.asarray(value)
    except Exception as err:  # noqa: BLE001  a jax array with shards on other processes, a deleted buffer
        raise SerializationError(
            f"field {field!r}: cannot bring the array to this host ({type(err).__name__}: {err}); JSON holds only "
            "small, fully addressable arrays: save real pools with easykv.save_cache") from None
    if arr.dtype.kind not in "biuf" or arr.dtype.hasobject:
        raise SerializationError(f"field {field!r}: arrays of dtype {arr.dtype} have no JSON form here")
    data = base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii")
    return {_ARRAY_KEY: data, "dtype": arr.dtype.name, "shape": list(arr.shape)}


def decode_array(data: object, field: str = "array") -> np.ndarray:
    """The array `encode_array` wrote; a SerializationError names what does not fit (the
    bytes must be exactly what dtype and shape imply, so nothing larger is ever allocated)."""
    if not isinstance(data, Mapping) or set(data) != {_ARRAY_KEY, "dtype", "shape"}:
        raise SerializationError(f"field {field!r} must be an encoded array {{{_ARRAY_KEY!r}, 'dtype', 'shape'}}, "
                                 f"got {show(data)}")
    dtype = decode_dtype(data["dtype"], field)
    shape = data["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape):
        raise SerializationError(f"field {field!r}: shape must be a list of non-negative ints, got {show(shape)}")
    try:
        raw = base64.b64decode(data[_ARRAY_KEY], validate=True) if isinstance(data[_ARRAY_KEY], str) else None
    except ValueError:
        raw = None
    if raw is None:
        raise SerializationError(f"field {field!r}: the array bytes are not base64 text")
    if dtype.hasobject or len(raw) != math.prod(shape) * dtype.itemsize:
        raise SerializationError(f"field {field!r}: {len(raw)} bytes do not hold a {dtype.name} array of shape "
                                 f"{tuple(shape)}")
    return np.frombuffer(raw, dtype).reshape(shape).copy()


def _plain(value: Any, name: str) -> Any:
    return value


# codec name (a field's ``metadata["codec"]``) -> (encode, decode), each ``(value, field name)``
_CODECS: dict[str | None, tuple[Callable[[Any, str], Any], Callable[[Any, str], Any]]] = {
    None: (lambda v, name: _to_lists(v), _plain),
    "tuple": (lambda v, name: _to_lists(v), lambda v, name: _to_tuples(v)),
    "dtype": (encode_dtype, decode_dtype),
    "array": (encode_array, decode_array),
}


def _coded(f: dataclasses.Field[Any], value: Any, direction: int) -> Any:
    """``value`` of field ``f`` encoded (``direction`` 0) or decoded (1) by its codec."""
    codec = f.metadata.get("codec")
    if codec == "serializables":  # a tuple of nested Serializable of one class (``metadata["type"]``)
        return None if value is None else _nested(f.metadata["type"], value, f.name, direction)
    if codec not in _CODECS:
        raise SerializationError(f"field {show(f.name)} has unknown codec {show(codec)}")
    return None if value is None else _CODECS[codec][direction](value, f.name)


def _nested(cls: Any, value: Any, name: str, direction: int) -> Any:
    if not isinstance(value, (list, tuple)):
        if direction:
            raise SerializationError(f"field {show(name)} must be a list of {cls.__name__} dicts, got {show(value)}")
        return value  # not a sequence: the class's own __post_init__ says what is wrong
    if direction == 0:
        return [item.to_dict() if isinstance(item, cls) else item for item in value]
    return tuple(cls.from_dict(item) for item in value)


class Serializable:
    """Mixin for ``@dataclass(frozen=True)`` classes: to/from dict and JSON, and ``replace``.

    Subclasses set ``SCHEMA`` (e.g. ``"easykv.PagedAttentionCacheMetaData"``) and
    ``SCHEMA_VERSION``; both are written into every dict so a JSON says what it is. Values are
    validated by the subclass's own ``__post_init__``; this base only checks the shape (schema,
    version, field names). Fields with ``init=False`` are derived and never written. A field
    added in version N (``metadata={"since": N}``, default None) is written only when set, and
    only then is the JSON marked version N: what older readers can read stays readable by them.
    """

    SCHEMA: ClassVar[str]
    SCHEMA_VERSION: ClassVar[int]
    if TYPE_CHECKING:  # every subclass is a dataclass (`_init_fields` checks): `dataclasses.replace` takes it
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @classmethod
    def _init_fields(cls) -> dict[str, dataclasses.Field[Any]]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a @dataclass(frozen=True) to be Serializable")
        schema, version = getattr(cls, "SCHEMA", None), getattr(cls, "SCHEMA_VERSION", None)
        if not isinstance(schema, str) or not schema:
            raise TypeError(f"{cls.__name__}.SCHEMA must be a non-empty str, got {show(schema)}")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise TypeError(
                f"{cls.__name__}.SCHEMA_VERSION must be a positive int, got {show(version)}")
        return {f.name: f for f in dataclasses.fields(cls) if f.init}

    @classmethod
    def _upgrade(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Turn an older or foreign dict into this class's current format.

        Called before any check. The default accepts only easykv JSON; a subclass overrides it
        to read e.g. EasyDeL's metadata (no ``__schema__``) or migrate an older
        ``__version__``, returning a dict of this class's fields (with or without the keys).
        """
        if _SCHEMA_KEY not in data:
            raise SerializationError(
                f"not an easykv JSON: missing {show(_SCHEMA_KEY)} (expected {show(cls.SCHEMA)}); "
                f"keys were {sorted(data)[:20]}")
        return data

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict: schema and version first, then every init field, encoded."""
        fields = self._init_fields()
        staged = any("since" in f.metadata for f in fields.values())
        out: dict[str, Any] = {_SCHEMA_KEY: self.SCHEMA, _VERSION_KEY: 1 if staged else self.SCHEMA_VERSION}
        for name, f in fields.items():
            since = f.metadata.get("since", 1)
            if since > 1 and getattr(self, name) is None:
                continue  # a field newer readers added, left at None: the JSON older readers read
            out[_VERSION_KEY] = max(out[_VERSION_KEY], since)
            out[name] = _coded(f, getattr(self, name), 0)
            _check_json_safe(out[name], f"{type(self).__name__}.{name}")
        return out

    @classmethod
    def from_dict(cls: type[_T], data: Mapping[str, Any]) -> _T:
        """Rebuild from ``to_dict`` output; unknown, missing or foreign data is an error."""
        fields = cls._init_fields()
        if not isinstance(data, Mapping):
            raise SerializationError(
                f"{cls.__name__}.from_dict needs a dict, got {type(data).__name__}")
        data = dict(cls._upgrade(dict(data)))
        valid = sorted(fields)
        if _SCHEMA_KEY in data:
            schema = data.pop(_SCHEMA_KEY)
            if schema != cls.SCHEMA:
                raise SerializationError(
                    f"JSON is a {show(schema)}, not a {show(cls.SCHEMA)}; load it with the class it "
                    "was written from")
            version = data.pop(_VERSION_KEY, None)
            if isinstance(version, bool) or not isinstance(version, int) or version < 1:
                raise SerializationError(
                    f"{cls.SCHEMA} JSON needs a positive int {show(_VERSION_KEY)}, got {show(version)}")
            if version > cls.SCHEMA_VERSION:
                raise SerializationError(
                    f"{cls.SCHEMA} JSON is version {version}, but this easykv reads up to "
                    f"version {cls.SCHEMA_VERSION}; upgrade easykv to load it")
            newer = sorted(n for n in data if n in fields and fields[n].metadata.get("since", 1) > version)
            if newer:
                raise SerializationError(
                    f"{cls.SCHEMA} JSON of version {version} holds {newer}, which version "
                    f"{max(fields[n].metadata['since'] for n in newer)} added; the file was edited or damaged")
        else:
            data.pop(_VERSION_KEY, None)
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise SerializationError(
                f"unknown field(s) {unknown} for {cls.__name__}; valid fields: {valid}")
        missing = sorted(
            n for n, f in fields.items()
            if n not in data and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING)
        if missing:
            raise SerializationError(
                f"missing required field(s) {missing} for {cls.__name__}; valid fields: {valid}")
        return cls(**{n: _coded(fields[n], v, 1) for n, v in data.items()})

    def to_json(self, **json_kwargs: Any) -> str:
        """``json.dumps(self.to_dict(), **json_kwargs)``; e.g. ``indent=2`` for files."""
        return json.dumps(self.to_dict(), **json_kwargs)

    @classmethod
    def from_json(cls: type[_T], text: str | bytes) -> _T:
        """Parse ``to_json`` output (or any JSON object ``_upgrade`` accepts)."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise SerializationError(
                f"{cls.__name__}.from_json needs JSON text, got {type(text).__name__}; "
                "use from_dict for a dict")
        data = parse_json(text, what=f"the JSON for {cls.__name__} (text starts {_head(text)})",
                          error=SerializationError)
        if not isinstance(data, dict):
            raise SerializationError(
                f"{cls.__name__} JSON must be an object, got {type(data).__name__}; "
                f"text starts {_head(text)}")
        return cls.from_dict(data)

    def replace(self: _T, **changes: object) -> _T:
        """A copy with ``changes`` applied; ``__post_init__`` re-validates the result."""
        fields = self._init_fields()
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise SerializationError(
                f"cannot replace unknown field(s) {unknown} of {type(self).__name__}; "
                f"valid fields: {sorted(fields)}")
        return dataclasses.replace(self, **changes)


def _head(text: str | bytes, n: int = 60) -> str:
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", "replace")
    return repr(text[:n] + ("..." if len(text) > n else ""))
