"""Serializable: exact round trips, versioned schema checks, and errors that name the fix."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np
import pytest

from easykv.errors import SerializationError
from easykv.spec.serialization import Serializable


@dataclass(frozen=True)
class Meta(Serializable):
    SCHEMA: ClassVar[str] = "easykv.TestMeta"
    SCHEMA_VERSION: ClassVar[int] = 2

    num_pages: int
    dtype: Any = field(metadata={"codec": "dtype"})
    scale_dtype: Any = field(default=jnp.float8_e4m3fn, metadata={"codec": "dtype"})
    shape: tuple = field(default=((1, 2), (3, (4, 5))), metadata={"codec": "tuple"})
    name: str = "cache"
    derived: int = field(init=False, default=0)

    def __post_init__(self):
        # Canonical dtypes, so jnp.bfloat16 and np.dtype("bfloat16") give equal hashes.
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "scale_dtype", np.dtype(self.scale_dtype))
        if self.num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {self.num_pages!r}")
        object.__setattr__(self, "derived", self.num_pages * 2)


@dataclass(frozen=True)
class Foreign(Serializable):
    """Reads a foreign format (no __schema__, other key names) through _upgrade."""

    SCHEMA: ClassVar[str] = "easykv.Foreign"
    SCHEMA_VERSION: ClassVar[int] = 1

    pages: int
    dtype: Any = field(default=np.float32, metadata={"codec": "dtype"})

    @classmethod
    def _upgrade(cls, data: dict) -> dict:
        if "__schema__" in data:
            return super()._upgrade(data)
        return {"pages": data["num_pages"], "dtype": data.get("kv_dtype", "float32")}


def make() -> Meta:
    return Meta(num_pages=7, dtype=jnp.bfloat16)


def test_dict_round_trip_is_exact():
    m = make()
    d = m.to_dict()
    assert d["__schema__"] == "easykv.TestMeta" and d["__version__"] == 2
    assert d["dtype"] == "bfloat16" and d["scale_dtype"] == "float8_e4m3fn"
    assert d["shape"] == [[1, 2], [3, [4, 5]]]
    assert "derived" not in d
    back = Meta.from_dict(d)
    assert back == m and hash(back) == hash(m)
    assert back.shape == ((1, 2), (3, (4, 5))) and isinstance(back.shape[1][1], tuple)
    assert back.dtype == jnp.bfloat16 and back.scale_dtype == jnp.float8_e4m3fn
    assert back.derived == 14


def test_json_round_trip_is_exact():
    m = make()
    text = m.to_json(indent=2)
    assert json.loads(text) == m.to_dict()
    back = Meta.from_json(text)
    assert back == m and hash(back) == hash(m)
    assert Meta.from_json(text.encode()) == m
    assert back.to_json(indent=2) == text


def test_to_dict_is_json_safe_with_numpy_scalars():
    m = Meta(num_pages=3, dtype=np.float16, shape=(np.int32(4), np.int64(5)))
    d = m.to_dict()
    assert d["shape"] == [4, 5] and type(d["shape"][0]) is int
    json.dumps(d)


def test_unknown_field_is_named_with_valid_fields():
    d = make().to_dict() | {"page_sise": 16}
    with pytest.raises(SerializationError) as e:
        Meta.from_dict(d)
    msg = str(e.value)
    assert "page_sise" in msg and "num_pages" in msg and "derived" not in msg


def test_missing_required_field_is_named():
    d = make().to_dict()
    del d["num_pages"], d["name"]  # name has a default: not missing
    with pytest.raises(SerializationError, match=r"missing required field\(s\) \['num_pages'\]"):
        Meta.from_dict(d)


def test_wrong_schema():
    d = make().to_dict() | {"__schema__": "easykv.Other"}
    with pytest.raises(SerializationError, match="JSON is a 'easykv.Other', not a 'easykv.TestMeta'"):
        Meta.from_dict(d)


def test_newer_version_refused_older_accepted():
    d = make().to_dict()
    with pytest.raises(SerializationError, match="version 3.*reads up to version 2"):
        Meta.from_dict(d | {"__version__": 3})
    assert Meta.from_dict(d | {"__version__": 1}) == make()
    for bad in ("2", None, True, 0):
        with pytest.raises(SerializationError, match="__version__"):
            Meta.from_dict(d | {"__version__": bad})


def test_missing_schema_rejected_by_default():
    d = make().to_dict()
    del d["__schema__"]
    with pytest.raises(SerializationError, match="not an easykv JSON: missing '__schema__'"):
        Meta.from_dict(d)


@pytest.mark.parametrize("text", ["{not json", "", '{"a": 1,}'])
def test_bad_json_quotes_text(text):
    with pytest.raises(SerializationError, match="is not valid JSON") as e:
        Meta.from_json(text)
    assert repr(text[:60]) in str(e.value)


@pytest.mark.parametrize("text", ["[1, 2]", '"hello"', "3", "null"])
def test_non_object_json(text):
    with pytest.raises(SerializationError, match="must be an object") as e:
        Meta.from_json(text)
    assert repr(text) in str(e.value)


def test_from_dict_and_from_json_type_errors():
    with pytest.raises(SerializationError, match="needs a dict"):
        Meta.from_dict([1, 2])
    with pytest.raises(SerializationError, match="from_dict"):
        Meta.from_json({"a": 1})


@pytest.mark.parametrize("bad", ["bfloat17", 16, ""])
def test_unknown_dtype_name(bad):
    d = make().to_dict() | {"dtype": bad}
    with pytest.raises(SerializationError) as e:
        Meta.from_dict(d)
    msg = str(e.value)
    assert repr(bad) in msg and "'dtype'" in msg and "bfloat16" in msg


def test_encoding_a_non_dtype_fails_clearly():
    m = make()
    object.__setattr__(m, "dtype", object())
    with pytest.raises(SerializationError, match="'dtype'.*not a dtype"):
        m.to_dict()


def test_non_json_value_without_codec_fails_clearly():
    m = make()
    object.__setattr__(m, "name", {1, 2})
    with pytest.raises(SerializationError, match="Meta.name.*codec"):
        m.to_dict()


def test_values_validated_by_post_init():
    with pytest.raises(ValueError, match="num_pages must be positive"):
        Meta.from_dict(make().to_dict() | {"num_pages": 0})


def test_replace():
    m = make()
    r = m.replace(num_pages=9, dtype=jnp.float32)
    assert (r.num_pages, r.dtype, r.derived) == (9, np.dtype("float32"), 18)
    assert m.num_pages == 7  # frozen original untouched
    with pytest.raises(SerializationError, match=r"\['num_page'\].*valid fields: \[") as e:
        m.replace(num_page=9)
    assert "num_pages" in str(e.value)
    with pytest.raises(SerializationError, match="derived"):
        m.replace(derived=1)


def test_upgrade_hook_reads_foreign_format():
    f = Foreign.from_json('{"num_pages": 12, "kv_dtype": "bfloat16"}')
    assert f == Foreign(pages=12, dtype=np.dtype("bfloat16"))
    assert Foreign.from_dict(f.to_dict()) == f  # own format still works
    with pytest.raises(SerializationError, match="not a 'easykv.Foreign'"):
        Foreign.from_dict(make().to_dict())


def test_class_without_schema_is_a_type_error():
    @dataclass(frozen=True)
    class NoSchema(Serializable):
        x: int = 1

    with pytest.raises(TypeError, match="SCHEMA"):
        NoSchema().to_dict()
