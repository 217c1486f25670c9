"""Hostile values for the tests of every public argument: integers of any size and garbage of
any type, the rule every call must follow against them, and the small manager, cache and step
those calls run on.

A registry in each package's ``test_attack_inputs.py`` names each argument of that package's
public calls with the exact range it accepts. Against integers drawn from the whole int/uint
range (Python ints of any size, numpy int8..uint64) and against values of every other type
(bools, floats, strings, None, nested and deep lists, objects), each call must

* raise only easykv's documented errors: ValueError (UnknownSequenceError, ManagerStateError,
  SerializationError are ValueErrors) or CacheFullError, never TypeError, OverflowError,
  IndexError, KeyError, AttributeError or RecursionError;
* on an error, leave the manager and the cache exactly as they were;
* refuse every integer outside the argument's range (an out-of-range integer is never accepted,
  whatever its width: the uint64 that wraps to a negative int64 included).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from hypothesis import strategies as st

from easykv import CacheFullError, PagedAttentionMetadata
from easykv.sharding import ShardingAdjustedWarning
from tests.support.pools import assert_unchanged, new_cache, setup, snapshot

ALLOWED = (ValueError, CacheFullError)
DEEP: list = []
for _ in range(3000):
    DEEP = [DEEP]


class Weird:
    """An object that is not a number whatever it is asked."""

    def __repr__(self) -> str:
        return "Weird()"


GARBAGE = [None, "3", b"3", "", 2.0, 2.7, float("nan"), float("inf"), True, False, np.bool_(True), np.float32(1.0),
           np.float64(-0.0), 1 + 2j, [1], [[1]], [], (), {}, {"a": 1}, {1, 2}, Weird(), DEEP, np.array([1.5]),
           np.array(["1"]), np.zeros((2, 2), np.int32), bytearray(b"\x01"), range(3)]

INTS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 5, 2**64, 2**200,
                     -(2**31), -(2**63) - 1]),
    st.integers(0, 2**64 - 1).map(np.uint64),
    st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.integers(0, 2**32 - 1).map(np.uint32),
    st.integers(-(2**31), 2**31 - 1).map(np.int32),
    st.integers(-128, 127).map(np.int8),
)


def exact(x: Any) -> int | None:
    """The integer ``x`` stands for, or None when it is not an int (bools are not)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        return None
    return int(x)


# Arguments that also take a sequence of values (one per sequence; their entries are checked by
# the hypothesis tests on ints), and arguments for which None means "not given".
ONE_OR_MANY = {"reserve(id)", "advance(id)", "reserve(count)", "advance(count)", "step(token)", "schedule(count)"}
OPTIONAL = {"schedule(pad_tokens_to)", "schedule(pad_seqs_to)",
            "build_step_metadata(pad_tokens_to)", "build_step_metadata(pad_seqs_to)",
            "build_decode_metadata(pad_seqs_to)", "pending_copies(pad_to)", "take_scrubs(pad_to)",
            "for_prefill(padded_length)", "for_mixed(pad_tokens_to)", "for_mixed(pad_seqs_to)",
            "increment_cache_lengths(num_pages)", "view_attention(sliding_window)", "view_attention(pages_per_block)",
            "view_attention(query_block)"}


def check_range(accepted: bool, x: Any, bounds: tuple[int, int] | None, what: str) -> None:
    value = exact(x)
    if bounds is None or not accepted or (what in OPTIONAL and x is None):
        return
    if what in ONE_OR_MANY and isinstance(x, (list, tuple, np.ndarray, range)):
        return
    lo, hi = bounds
    assert value is not None and lo <= value <= hi, f"{what} accepted {x!r} ({type(x).__name__})"


def check_refused_or_in_range(call, x, bounds, name) -> None:
    """A call that takes only ``x``: it refuses it with an allowed error, or ``x`` is in range."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        try:
            call(x)
        except ALLOWED:
            return
    check_range(True, x, bounds, name)


# ---- what the calls run on: a step's metadata and one cache, kept across calls --------------------
META = setup("heads")[2]
DECODE = PagedAttentionMetadata.for_mixed([[3, -1, -1, -1]], [2], [1], cache_metadata=META)


_CACHE = {}


def cache():
    if "cache" not in _CACHE or any(leaf.is_deleted() for v in _CACHE["cache"]
                                    for leaf in (v.key_pages, v.value_pages)):
        _CACHE["cache"] = new_cache("heads")
    return _CACHE["cache"]


DONATING = {"copy_pages(src)", "zero_pages(ids)"}


def run_cache_call(name, call, x):
    c = cache()
    before = snapshot(c)
    try:
        out = call(c, x)
    except ALLOWED:
        assert_unchanged(c, before)
        return False
    if name in DONATING:
        _CACHE["cache"] = out
    return True
