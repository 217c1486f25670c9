"""Argument checks shared by every public entry point: one rule, one function, one wording.

Integers are the dangerous inputs of a page cache: a count of ``2**64 - 5`` passes a ``>= 0``
check as uint64 and wraps to a negative int64 once it meets other numbers, and a page id of
``2**30`` wraps to page 0 when multiplied by the page size in int32. So every integer a caller
hands easykv goes through `integer` or `integer_array`, which convert it *exactly* (Python
ints of any size, numpy ints and uints; bools, floats and strings refused) and bound it before
any arithmetic sees it. Bounds default to int32, the width of every id and length on the device.

Free of jax on purpose (``spec`` uses it, and ``spec`` imports no array code): a traced value is
recognised by its failure to convert, not by its type.
"""

from __future__ import annotations

import json
import math
import operator
import reprlib
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# Deepest nesting of any JSON easykv reads: its own files nest 5 levels; EasyDeL's 2.
JSON_MAX_DEPTH = 32


_REPR = reprlib.Repr()  # keyword arguments need Python 3.12
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 48, 48, 48
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def show(value: object) -> str:
    """A short repr of a bad value for a message: an int of 10,000 digits or a list nested
    10,000 deep must neither flood the message nor exhaust the stack."""
    return _REPR.repr(value)


def _kind(lo: int | None) -> str:
    return "a non-negative int" if lo == 0 else "a positive int" if lo == 1 else "an int"


def _note(lo: int | None, hi: int | None, hint: str, extra: str = "") -> str:
    """`` (valid: lo..hi; hint)``: the bounds and the fix, in one closing parenthesis."""
    if lo is not None and hi is not None:
        valid = f"valid: {lo}..{hi}"
    elif lo is not None or hi is not None:
        valid = f"valid: {'>= ' + str(lo) if lo is not None else '<= ' + str(hi)}"
    else:
        valid = ""
    parts = [p for p in (extra, valid, hint) if p]
    return f" ({'; '.join(parts)})" if parts else ""


def integer(name: str, value: Any, *, lo: int | None = 0, hi: int | None = INT32_MAX, hint: str = "") -> int:
    """``value`` as an exact Python int in ``lo..hi`` (None: unbounded on that side).

    Accepts Python ints of any size, numpy integer scalars and 0-d integer arrays (anything
    with ``__index__``); refuses bools (``True`` is not a count), floats (even ``2.0``), strings
    and traced values. ``hint`` (plain words, no parentheses) says what the bound means.
    """
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be {_kind(lo)}, got {value!r}{_note(lo, hi, hint, 'a bool')}")
    try:
        number = operator.index(value)
    except Exception:  # noqa: BLE001  TypeError, or whatever a misbehaving __index__ raises
        kind = type(value).__name__
        if "Tracer" in kind:
            raise ValueError(f"{name} is a traced value ({kind}); pass a static Python int, known on the "
                             "host before jit") from None
        raise ValueError(f"{name} must be {_kind(lo)}, got {show(value)}{_note(lo, hi, hint, f'a {kind}')}") from None
    if (lo is not None and number < lo) or (hi is not None and number > hi):
        raise ValueError(f"{name} must be {_kind(lo)}, got {show(number)}{_note(lo, hi, hint)}")
    return number


def is_scalar(value: Any) -> bool:
    """Whether ``value`` is one value rather than a list or array of them, for an argument that takes
    either (one sequence id or a list; one count for all or one each): one reads through `integer`,
    the other through `integer_array`. One is what numpy counts as 0-d: a Python or numpy int, a
    0-d numpy or jax array (``np.array(3)``, ``jnp.arange(4)[3]``), and anything else not a
    sequence, which `integer` then names ("must be an int, got 'a' (a str)")."""
    if isinstance(value, (int, np.integer, list, tuple)):  # the common cases, without numpy
        return not isinstance(value, (list, tuple))
    ndim = getattr(value, "ndim", None)  # numpy and jax arrays (traced ones too): no conversion
    if isinstance(ndim, int):
        return ndim == 0
    try:
        return bool(np.ndim(value) == 0)
    except Exception:  # noqa: BLE001  ragged, or a misbehaving object: integer_array names the problem
        return False


def non_negative_int(name: str, value: object, *, hi: int | None = INT32_MAX, hint: str = "") -> int:
    return integer(name, value, lo=0, hi=hi, hint=hint)


def positive_int(name: str, value: object, *, hi: int | None = INT32_MAX, hint: str = "") -> int:
    return integer(name, value, lo=1, hi=hi, hint=hint)


def optional_int(name: str, value: object, *, lo: int | None = 0, hi: int | None = INT32_MAX,
                 hint: str = "") -> int | None:
    return None if value is None else integer(name, value, lo=lo, hi=hi, hint=hint)


def integer_array(name: str, value: object, *, ndim: int | None = None, lo: int | None = 0,
                  hi: int | None = INT32_MAX, dtype: DTypeLike = np.int32, hint: str = "") -> np.ndarray:
    """``value`` (a list, numpy array or concrete jax array of ints) as a new ``dtype`` array
    whose every entry lies in ``lo..hi`` (None: the dtype's own limit); a ValueError names the
    first bad entry. The bounds are checked on exact values (uint64 entries are not read as
    negative int64), so the conversion to ``dtype`` can never wrap.
    """
    kind = type(value).__name__
    if "Tracer" in kind:
        raise ValueError(f"{name} is a traced value ({kind}); build it on the host, outside jit")
    info = np.iinfo(dtype)  # an open bound is still the dtype's: the conversion must not wrap
    lo = info.min if lo is None else max(lo, int(info.min))
    hi = info.max if hi is None else min(hi, int(info.max))
    if isinstance(value, (str, bytes, bytearray, memoryview, dict, set, np.ma.MaskedArray)) or value is None:
        raise ValueError(f"{name} must be an array of ints, got {show(value)}{_note(lo, hi, hint, f'a {kind}')}")
    if isinstance(value, (list, tuple)):
        _refuse_bools(name, value, (), lo, hi, hint)
    try:
        arr = np.asarray(value)
    except Exception as err:  # noqa: BLE001  ragged, unconvertible, too deep, or a misbehaving object
        raise ValueError(f"{name} must be a regular array of ints, "
                         f"got {show(value)}{_note(None, None, hint, str(err))}") from None
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}{_note(None, None, hint)}")
    if arr.size == 0:
        return np.zeros(arr.shape, dtype)
    if arr.dtype.kind == "b":
        raise ValueError(f"{name} must hold ints, got bools{_note(lo, hi, hint)}")
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind not in "fO":
            raise ValueError(f"{name} must hold ints, got dtype {arr.dtype}{_note(lo, hi, hint)}")
        # A list mixing ints with floats, or ints too large for int64, comes back as float64
        # or object: look at the caller's own entries to name the first bad one exactly.
        entries = arr if isinstance(value, np.ndarray) else np.asarray(value, dtype=object)
        # The checked values themselves, never the objects converted again (an object may
        # answer __index__ and __int__ differently).
        checked = [integer(f"{name}[{', '.join(map(str, index))}]", entry, lo=lo, hi=hi, hint=hint)
                   for index, entry in zip(np.ndindex(entries.shape), entries.reshape(-1))]
        return np.array(checked, dtype).reshape(arr.shape)
    low, high = int(arr.min()), int(arr.max())
    for bad, ok in ((low, lo is None or low >= lo), (high, hi is None or high <= hi)):
        if not ok:
            index = tuple(int(i) for i in np.argwhere(arr == bad)[0])
            where = f"{name}[{', '.join(map(str, index))}]" if index else name
            raise ValueError(f"{where} = {show(bad)} is out of range{_note(lo, hi, hint)}")
    return arr.astype(dtype)


def page_ids(name: str, value: object, *, num_pages: int, ndim: int | None = None,
             pad: str = "for padding") -> np.ndarray:
    """Host page ids of a pool of ``num_pages``: each in ``0 .. num_pages - 1`` or -1 (``pad``
    says what -1 means where they are read), as int32."""
    return integer_array(name, value, ndim=ndim, lo=-1, hi=num_pages - 1,
                         hint=f"page ids of a pool of {num_pages} pages, -1 {pad}")


def _refuse_bools(name: str, items: list[Any] | tuple[Any, ...], where: tuple[int, ...], lo: int | None, hi: int | None,
                  hint: str) -> None:
    """numpy reads ``[1, True]`` as ints: find a bool among a list's entries before it does
    (a C-speed scan of the entries' types; nested lists are scanned row by row)."""
    kinds = set(map(type, items))
    if bool in kinds or np.bool_ in kinds:
        i = next(i for i, e in enumerate(items) if isinstance(e, (bool, np.bool_)))
        at = ", ".join(map(str, where + (i,)))
        raise ValueError(f"{name}[{at}] must be {_kind(lo)}, got {items[i]!r}{_note(lo, hi, hint, 'a bool')}")
    if list in kinds or tuple in kinds:
        if len(where) > JSON_MAX_DEPTH:
            raise ValueError(f"{name} nests deeper than {JSON_MAX_DEPTH} levels; pass an array of ints")
        for i, e in enumerate(items):
            if isinstance(e, (list, tuple)):
                _refuse_bools(name, e, where + (i,), lo, hi, hint)


def real(name: str, value: object, *, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False,
         hint: str = "") -> float:
    """``value`` as a finite Python float in the interval (bools, strings, nan refused)."""
    interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    suffix = f" ({hint})" if hint else ""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number in {interval}, got {show(value)} of type "
                         f"{type(value).__name__}{suffix}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        raise ValueError(f"{name} must be a number in {interval}, got {show(value)}{suffix}") from None
    below = number <= lo if lo_open else number < lo
    above = number >= hi if hi_open else number > hi
    if not math.isfinite(number) or below or above:
        raise ValueError(f"{name} must be a number in {interval}, got {show(value)}{suffix}")
    return number


def as_dtype(name: str, value: Any, *, choices: str = "") -> np.dtype:
    """``np.dtype(value)`` for a user's dtype argument, or a ValueError naming it (numpy's own
    parser raises TypeError, ValueError or, on a nested list, RecursionError)."""
    try:
        dtype: np.dtype = np.dtype(value)  # numpy's overloads give Any for an Any argument
    except (TypeError, ValueError, RecursionError):
        raise ValueError(f"{name}={show(value)} is not a dtype{'; use one of ' + choices if choices else ''}") from None
    return dtype


def boolean(name: str, value: object) -> bool:
    """A real bool (numpy's too); ``1``, ``"yes"`` and None are refused, not guessed."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {show(value)} of type {type(value).__name__}")
    return bool(value)


def parse_json(text: str | bytes, *, what: str, error: type[Exception] = ValueError,
               max_depth: int = JSON_MAX_DEPTH) -> Any:
    """Parse JSON that easykv reads (records, states, headers, metadata) or raise ``error``.

    Refuses what Python's json would accept but no easykv file holds (NaN, Infinity, numbers
    such as 1e999 that overflow to infinity) and nesting deeper than ``max_depth`` (which would
    otherwise surface as a RecursionError).
    """
    def no_constant(token: str) -> Any:
        raise ValueError(f"{token} is not allowed")

    def finite(token: str) -> float:
        number = float(token)
        if not math.isfinite(number):  # 1e999 parses as inf
            raise ValueError(f"{token} is not a finite number")
        return number

    try:
        data = json.loads(text, parse_constant=no_constant, parse_float=finite)
    except RecursionError:
        raise error(f"{what} nests deeper than {max_depth} levels; it is not a file easykv wrote") from None
    except (ValueError, UnicodeDecodeError, TypeError) as err:
        raise error(f"{what} is not valid JSON ({err})") from None
    stack = [(data, 1)] if isinstance(data, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise error(f"{what} nests deeper than {max_depth} levels; it is not a file easykv wrote")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return data


__all__ = [
    "INT32_MAX", "INT64_MAX", "JSON_MAX_DEPTH", "as_dtype", "boolean", "integer", "integer_array", "is_scalar",
    "non_negative_int", "optional_int", "page_ids", "parse_json", "positive_int", "real", "show",
]
