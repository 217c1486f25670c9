"""Every public argument against hostile values: integers of any size, and garbage of any type.

A registry names each argument of the page manager, the runtime-metadata constructors, the
cache and the static metadata, with the exact range it accepts. Against integers drawn from the
whole int/uint range (Python ints of any size, numpy int8..uint64) and against values of every
other type (bools, floats, strings, None, nested and deep lists, objects), each call must

* raise only easykv's documented errors: ValueError (UnknownSequenceError, ManagerStateError,
  SerializationError are ValueErrors) or CacheFullError, never TypeError, OverflowError,
  IndexError, KeyError, AttributeError or RecursionError;
* on an error, leave the manager and the cache exactly as they were;
* refuse every integer outside the argument's range (an out-of-range integer is never accepted,
  whatever its width: the uint64 that wraps to a negative int64 included).
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_helpers import LAYERS, MAX_LEN, PAGE_SIZE, PAGES, assert_unchanged, new_cache, setup, snapshot
from easykv import (
    CacheFullError,
    PagedAttentionCacheMetaData,
    PagedAttentionMetadata,
    PageManager,
    gather_kv,
    increment_cache_lengths,
    view_attention,
)
from easykv.validation import INT32_MAX, INT64_MAX
from sharding import ShardingAdjustedWarning

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


# ---- fixtures -------------------------------------------------------------------------------------
def manager() -> tuple[PageManager, int, int]:
    """batch 4, 24 pages of 4, sequences of <= 16 tokens; a: 5 tokens (room for 3 more), b: none."""
    _, _, meta = setup("heads")
    pm = PageManager(meta, scrub_released=True)
    a, b = pm.claim(2)
    pm.build_step_metadata([a], [5])
    pm.step([a], [[1, 2, 3, 4, 5]])
    return pm, a, b


_CACHE = {}


def cache():
    if "cache" not in _CACHE or any(leaf.is_deleted() for v in _CACHE["cache"] for leaf in (v.key_pages, v.value_pages)):
        _CACHE["cache"] = new_cache("heads")
    return _CACHE["cache"]


META = setup("heads")[2]
DECODE = PagedAttentionMetadata.for_mixed([[3, -1, -1, -1]], [2], [1], cache_metadata=META)
KV = jnp.zeros((1, 8, 8), jnp.bfloat16)


# Each entry: (name, call(x), (lo, hi) of integers accepted, or None when x is not an integer
# argument). Manager calls get (pm, a, b, x); the others just x.
MANAGER_CALLS: list[tuple[str, Callable[..., Any], tuple[int, int] | None]] = [
    ("claim(n)", lambda pm, a, b, x: pm.claim(x), (0, INT32_MAX)),
    ("external_claim([id])", lambda pm, a, b, x: pm.external_claim([x]), (0, 3)),
    ("external_claim(ids)", lambda pm, a, b, x: pm.external_claim(x), None),
    ("release(id)", lambda pm, a, b, x: pm.release(x), (0, 3)),
    ("fork(id)", lambda pm, a, b, x: pm.fork(x), (0, 3)),
    ("match_prefix(id)", lambda pm, a, b, x: pm.match_prefix(x, [1, 2]), (0, 3)),
    ("match_prefix(token)", lambda pm, a, b, x: pm.match_prefix(b, [1, x]), (0, INT32_MAX)),
    ("reserve(id)", lambda pm, a, b, x: pm.reserve(x, 1), (0, 3)),
    ("reserve(count)", lambda pm, a, b, x: pm.reserve(a, x), (0, MAX_LEN)),
    ("reserve([count])", lambda pm, a, b, x: pm.reserve([a], [x]), (0, MAX_LEN)),
    ("build_step_metadata(count)", lambda pm, a, b, x: pm.build_step_metadata([a], [x]), (0, MAX_LEN)),
    ("build_step_metadata(id)", lambda pm, a, b, x: pm.build_step_metadata([x], [1]), (0, 3)),
    ("build_step_metadata(pad_tokens_to)",
     lambda pm, a, b, x: pm.build_step_metadata([a], [1], pad_tokens_to=x), (1, 4 * MAX_LEN)),
    ("build_step_metadata(pad_seqs_to)", lambda pm, a, b, x: pm.build_step_metadata([a], [1], pad_seqs_to=x), (1, 4)),
    ("build_decode_metadata(num_steps)", lambda pm, a, b, x: pm.build_decode_metadata([a], num_steps=x), (1, MAX_LEN)),
    ("build_decode_metadata(pad_seqs_to)",
     lambda pm, a, b, x: pm.build_decode_metadata([a], pad_seqs_to=x), (1, 4)),
    ("build_decode_metadata(stacked)", lambda pm, a, b, x: pm.build_decode_metadata([a], stacked=x), None),
    ("step(token)", lambda pm, a, b, x: pm.step([a], [x]), (0, INT32_MAX)),
    ("step([[token]])", lambda pm, a, b, x: pm.step([a], [[x]]), (0, INT32_MAX)),
    ("step(id)", lambda pm, a, b, x: pm.step([x], [1]), (0, 3)),
    ("append_tokens(token)", lambda pm, a, b, x: pm.append_tokens(a, [x]), (0, INT32_MAX)),
    ("advance(count)", lambda pm, a, b, x: pm.advance(a, x), (0, MAX_LEN)),
    ("advance(id)", lambda pm, a, b, x: pm.advance(x, 0), (0, 3)),
    ("pending_copies(pad_to)", lambda pm, a, b, x: pm.pending_copies(x), (0, PAGES)),
    ("take_scrubs(pad_to)", lambda pm, a, b, x: pm.take_scrubs(x), (0, PAGES)),
    ("length(id)", lambda pm, a, b, x: pm.length(x), (0, 3)),
    ("pages(id)", lambda pm, a, b, x: pm.pages(x), (0, 3)),
    ("page_table([id])", lambda pm, a, b, x: pm.page_table([x]), (0, 3)),
    ("contains(id)", lambda pm, a, b, x: pm.contains(x), None),
    ("from_state_dict", lambda pm, a, b, x: PageManager.from_state_dict(META, x), None),
    ("PageManager(flag)", lambda pm, a, b, x: PageManager(META, scrub_released=x), None),
]

OTHER_CALLS: list[tuple[str, Callable[[Any], Any], tuple[int, int] | None]] = [
    ("for_prefill(page)", lambda x: PagedAttentionMetadata.for_prefill([x], 1, cache_metadata=META), (0, PAGES - 1)),
    ("for_prefill(length)", lambda x: PagedAttentionMetadata.for_prefill([0, 1, 2, 3], x, cache_metadata=META),
     (0, MAX_LEN)),
    ("for_prefill(start)", lambda x: PagedAttentionMetadata.for_prefill([0, 1, 2, 3], 1, start=x, cache_metadata=META),
     (0, MAX_LEN - 1)),
    ("for_prefill(padded_length)",
     lambda x: PagedAttentionMetadata.for_prefill([0], 1, padded_length=x, cache_metadata=META), (1, MAX_LEN)),
    ("for_decode(page)", lambda x: PagedAttentionMetadata.for_decode([[x]], [0], cache_metadata=META), (0, PAGES - 1)),
    ("for_decode(position)",
     lambda x: PagedAttentionMetadata.for_decode([[0, 1, 2, 3]], [x], cache_metadata=META), (-1, MAX_LEN - 1)),
    ("for_mixed(page)", lambda x: PagedAttentionMetadata.for_mixed([[x]], [0], [1], cache_metadata=META),
     (0, PAGES - 1)),
    ("for_mixed(cached)", lambda x: PagedAttentionMetadata.for_mixed([[0, 1, 2, 3]], [x], [1], cache_metadata=META),
     (0, MAX_LEN - 1)),
    ("for_mixed(new)", lambda x: PagedAttentionMetadata.for_mixed([[0, 1, 2, 3]], [0], [x], cache_metadata=META),
     (0, MAX_LEN)),
    ("for_mixed(pad_tokens_to)",
     lambda x: PagedAttentionMetadata.for_mixed([[0]], [0], [1], pad_tokens_to=x, cache_metadata=META),
     (1, 4 * MAX_LEN)),
    ("for_mixed(pad_seqs_to)",
     lambda x: PagedAttentionMetadata.for_mixed([[0]], [0], [1], pad_seqs_to=x, cache_metadata=META), (1, 4)),
    ("increment_cache_lengths(page_size)", lambda x: increment_cache_lengths(DECODE, page_size=x), (1, INT32_MAX)),
    ("increment_cache_lengths(num_pages)",
     lambda x: increment_cache_lengths(DECODE, page_size=4, num_pages=x), (1, INT32_MAX)),
    *[(f"metadata.{field}", (lambda f: lambda x: META.replace(**{f: x}))(field), None)
      for field in ("batch_size", "num_hidden_layers", "num_pages_per_layer", "page_size", "num_kv_heads",
                    "kv_head_dim_size", "kv_head_shards", "page_shards", "memory_bytes_per_device", "hbm_utilization",
                    "dtype", "quantization", "kv_head_mesh_axes")],
    ("metadata.from_json", lambda x: PagedAttentionCacheMetaData.from_json(json.dumps(
        {**META.to_dict(), "batch_size": exact(x)}) if exact(x) is not None else x), (1, INT32_MAX)),
]

CACHE_CALLS: list[tuple[str, Callable[[Any, Any], Any], tuple[int, int] | None]] = [
    ("cache[layer]", lambda c, x: c[x], (-LAYERS, LAYERS - 1)),
    ("gather_kv(layer)", lambda c, x: gather_kv(c, x, [0], 1), (-LAYERS, LAYERS - 1)),
    ("gather_kv(page)", lambda c, x: gather_kv(c, 0, [x], 1), (0, PAGES - 1)),
    ("gather_kv(length)", lambda c, x: gather_kv(c, 0, [0, 1, 2, 3], x), (0, MAX_LEN)),
    ("copy_pages(src)", lambda c, x: c.copy_pages([x], [5]), (-1, PAGES - 1)),
    ("zero_pages(ids)", lambda c, x: c.zero_pages([x]), (-1, PAGES - 1)),
    ("write_tokens(slot)", lambda c, x: c[0].write_tokens(KV, KV, [x]), (-1, PAGES * PAGE_SIZE - 1)),
]

DONATING = {"copy_pages(src)", "zero_pages(ids)"}

Q = jnp.zeros((1, 8, 8), jnp.float32)
# Static options of attention (each accepted value compiles once: garbage only, no hypothesis).
ATTENTION_CALLS = [
    (f"view_attention({option})", (lambda o: lambda c, x: view_attention(Q, c[0], DECODE, **{o: x}))(option), bounds)
    for option, bounds in (("sliding_window", (1, INT32_MAX)), ("logit_soft_cap", None), ("scale", None),
                           ("pages_per_block", (1, INT32_MAX)), ("query_block", (1, INT32_MAX)),
                           ("implementation", None))
]


def run_manager_call(call, x, rng=None):
    pm, a, b = manager()
    before = json.dumps(pm.state_dict())
    try:
        call(pm, a, b, x)
    except ALLOWED:
        assert json.dumps(pm.state_dict()) == before, "an error changed the manager"
        return False
    pm.check_invariants()
    return True


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


# Arguments that also take a sequence of values (one per sequence; their entries are checked by
# the hypothesis tests on ints), and arguments for which None means "not given".
ONE_OR_MANY = {"reserve(id)", "advance(id)", "reserve(count)", "advance(count)", "step(token)"}
OPTIONAL = {"build_step_metadata(pad_tokens_to)", "build_step_metadata(pad_seqs_to)",
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


# ---- garbage of every type ----------------------------------------------------------------------------
@pytest.mark.parametrize("name,call,bounds", MANAGER_CALLS, ids=[c[0] for c in MANAGER_CALLS])
def test_manager_arguments_refuse_garbage(name, call, bounds):
    for x in GARBAGE:
        accepted = run_manager_call(call, x)
        check_range(accepted, x, bounds, name)


@pytest.mark.parametrize("name,call,bounds", OTHER_CALLS, ids=[c[0] for c in OTHER_CALLS])
def test_runtime_and_metadata_arguments_refuse_garbage(name, call, bounds):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        for x in GARBAGE:
            try:
                call(x)
            except ALLOWED:
                continue
            check_range(True, x, bounds, name)


@pytest.mark.parametrize("name,call,bounds", CACHE_CALLS + ATTENTION_CALLS, ids=[c[0] for c in CACHE_CALLS + ATTENTION_CALLS])
def test_cache_arguments_refuse_garbage(name, call, bounds):
    for x in GARBAGE:
        accepted = run_cache_call(name, call, x)
        check_range(accepted, x, bounds, name)


# ---- integers of any size -------------------------------------------------------------------------------
INT_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name,call,bounds", [c for c in MANAGER_CALLS if c[2]], ids=[c[0] for c in MANAGER_CALLS if c[2]])
@INT_SETTINGS
@given(x=INTS)
def test_manager_integers_of_any_size_are_bounded_before_use(name, call, bounds, x):
    check_range(run_manager_call(call, x), x, bounds, name)


@pytest.mark.parametrize("name,call,bounds", [c for c in OTHER_CALLS if c[2]], ids=[c[0] for c in OTHER_CALLS if c[2]])
@INT_SETTINGS
@given(x=INTS)
def test_runtime_integers_of_any_size_are_bounded_before_use(name, call, bounds, x):
    try:
        call(x)
    except ALLOWED:
        return
    check_range(True, x, bounds, name)


@pytest.mark.parametrize("name,call,bounds", CACHE_CALLS, ids=[c[0] for c in CACHE_CALLS])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=INTS)
def test_cache_integers_of_any_size_are_bounded_before_use(name, call, bounds, x):
    check_range(run_cache_call(name, call, x), x, bounds, name)


# ---- the cases the attack found ------------------------------------------------------------------------
def test_a_count_that_wraps_to_negative_never_moves_a_sequence_back():
    pm, a, b = manager()
    [c] = pm.claim(1)
    pm.match_prefix(c, [1, 2, 3, 4, 5])  # c shares a's first page through the prefix cache
    assert pm.pages(c) == pm.pages(a)[:1]
    before = pm.state_dict()
    for bad in (2**64 - 5, np.uint64(2**64 - 5), np.uint64(2**63), 2**63 + 1):
        with pytest.raises(ValueError, match=r"num_tokens"):
            pm.advance(c, bad)
        with pytest.raises(ValueError, match=r"num_tokens"):
            pm.reserve(a, bad)
        with pytest.raises(ValueError, match=r"num_tokens"):
            pm.build_step_metadata([a], [bad])
    assert pm.state_dict() == before


def test_integer_arrays_with_uint64_entries_are_exact():
    with pytest.raises(ValueError, match=r"new_lens\[0\] = 18446744073709551611 is out of range"):
        PagedAttentionMetadata.for_mixed([[0]], [0], np.array([2**64 - 5], np.uint64), cache_metadata=META)
    with pytest.raises(ValueError, match=r"page_table\[0, 0\] = 9223372036854775808 is out of range"):
        PagedAttentionMetadata.for_decode(np.array([[2**63]], np.uint64), [0], cache_metadata=META)
    assert INT64_MAX == 2**63 - 1


@settings(max_examples=60, deadline=None)
@given(x=st.one_of(INTS, st.sampled_from(GARBAGE)))
def test_salts_are_none_str_bytes_or_64_bit_ints(x):
    accepted = run_manager_call(lambda pm, a, b, x: pm.match_prefix(b, [1, 2], salt=x), x)
    ok = x is None or isinstance(x, (str, bytes, bytearray)) or (
        exact(x) is not None and -(2**63) <= exact(x) < 2**64)
    assert accepted == ok, x
