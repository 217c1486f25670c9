"""The page manager's arguments against hostile values (tests/support/hostile.py says what
every call must do): garbage of every type, integers of any size, and the cases the attack
found. The deprecated names are public calls too (for one release): they get the same values,
their own warning expected (`tests.support.deprecation.old_name`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from easykv import PageManager
from easykv.validation import INT32_MAX
from tests.support.deprecation import old_name
from tests.support.hostile import ALLOWED, GARBAGE, INTS, META, check_range, exact
from tests.support.pools import MAX_LEN, PAGES, setup


def manager() -> tuple[PageManager, int, int]:
    """batch 4, 24 pages of 4, sequences of <= 16 tokens; a: 5 tokens (room for 3 more), b: none."""
    _, _, meta = setup("heads")
    pm = PageManager(meta, scrub_released=True)
    a, b = pm.claim(2)
    pm.commit(pm.schedule([a], [5]), [[1, 2, 3, 4, 5]])
    return pm, a, b


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
    ("schedule(id)", lambda pm, a, b, x: pm.schedule([x], [1]), (0, 3)),
    ("schedule(count)", lambda pm, a, b, x: pm.schedule([a], x), (0, MAX_LEN)),
    ("schedule([count])", lambda pm, a, b, x: pm.schedule([a], [x]), (0, MAX_LEN)),
    ("schedule(pad_tokens_to)", lambda pm, a, b, x: pm.schedule([a], [1], pad_tokens_to=x), (1, 4 * MAX_LEN)),
    ("schedule(pad_seqs_to)", lambda pm, a, b, x: pm.schedule([a], [1], pad_seqs_to=x), (1, 4)),
    ("step(token)", lambda pm, a, b, x: pm.step([a], [x]), (0, INT32_MAX)),
    ("step([[token]])", lambda pm, a, b, x: pm.step([a], [[x]]), (0, INT32_MAX)),
    ("step(id)", lambda pm, a, b, x: pm.step([x], [1]), (0, 3)),
    ("sequence(id)", lambda pm, a, b, x: pm.sequence(x), (0, 3)),
    ("length(id)", lambda pm, a, b, x: pm.length(x), (0, 3)),
    ("pages(id)", lambda pm, a, b, x: pm.pages(x), (0, 3)),
    ("page_table([id])", lambda pm, a, b, x: pm.page_table([x]), (0, 3)),
    ("contains(id)", lambda pm, a, b, x: pm.contains(x), None),
    ("from_state_dict", lambda pm, a, b, x: PageManager.from_state_dict(META, x), None),
    ("PageManager(flag)", lambda pm, a, b, x: PageManager(META, scrub_released=x), None),
]
# The deprecated names (each runs its replacement): the same registry, run by `old_name`.
DEPRECATED_CALLS: list[tuple[str, Callable[..., Any], tuple[int, int] | None]] = [
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
    ("append_tokens(token)", lambda pm, a, b, x: pm.append_tokens(a, [x]), (0, INT32_MAX)),
    ("advance(count)", lambda pm, a, b, x: pm.advance(a, x), (0, MAX_LEN)),
    ("advance(id)", lambda pm, a, b, x: pm.advance(x, 0), (0, 3)),
    ("pending_copies(pad_to)", lambda pm, a, b, x: pm.pending_copies(x), (0, PAGES)),
    ("take_scrubs(pad_to)", lambda pm, a, b, x: pm.take_scrubs(x), (0, PAGES)),
    ("capacity(id)", lambda pm, a, b, x: pm.capacity(x), (0, 3)),
    ("first_kept_position(id)", lambda pm, a, b, x: pm.first_kept_position(x), (0, 3)),
]
ALL_CALLS = MANAGER_CALLS + DEPRECATED_CALLS


def run_manager_call(call, x, name=""):
    """Whether ``call`` accepted ``x``; on an error, only an allowed one, with nothing changed.
    ``name``: the registry's name of the call (a deprecated one's warning is expected)."""
    pm, a, b = manager()
    before = json.dumps(pm.state_dict())
    try:
        with old_name(name.split("(")[0]):
            call(pm, a, b, x)
    except ALLOWED:
        assert json.dumps(pm.state_dict()) == before, "an error changed the manager"
        return False
    pm.check_invariants()
    return True


@pytest.mark.parametrize("name,call,bounds", ALL_CALLS, ids=[c[0] for c in ALL_CALLS])
def test_manager_arguments_refuse_garbage(name, call, bounds):
    for x in GARBAGE:
        accepted = run_manager_call(call, x, name)
        check_range(accepted, x, bounds, name)


@pytest.mark.parametrize("name,call,bounds", [c for c in ALL_CALLS if c[2]],
                         ids=[c[0] for c in ALL_CALLS if c[2]])
@given(x=INTS)
def test_manager_integers_of_any_size_are_bounded_before_use(name, call, bounds, x):
    check_range(run_manager_call(call, x, name), x, bounds, name)


# ---- the cases the attack found ------------------------------------------------------------------------
def test_a_count_that_wraps_to_negative_never_moves_a_sequence_back():
    pm, a, b = manager()
    [c] = pm.claim(1)
    pm.match_prefix(c, [1, 2, 3, 4, 5])  # c shares a's first page through the prefix cache
    assert pm.pages(c) == pm.pages(a)[:1]
    before = pm.state_dict()
    for bad in (2**64 - 5, np.uint64(2**64 - 5), np.uint64(2**63), 2**63 + 1):
        for ids, counts in (([c], bad), ([a], [bad]), ([c, a], [1, bad])):
            with pytest.raises(ValueError, match=r"num_tokens"):
                pm.schedule(ids, counts)
        with pytest.warns(DeprecationWarning, match=r"PageManager\.advance is deprecated"), \
                pytest.raises(ValueError, match=r"num_tokens"):
            pm.advance(c, bad)
        with pytest.warns(DeprecationWarning, match=r"PageManager\.reserve is deprecated"), \
                pytest.raises(ValueError, match=r"num_tokens"):
            pm.reserve(a, bad)
        with pytest.warns(DeprecationWarning, match=r"PageManager\.build_step_metadata is deprecated"), \
                pytest.raises(ValueError, match=r"num_tokens"):
            pm.build_step_metadata([a], [bad])
    assert pm.state_dict() == before


@given(x=st.one_of(INTS, st.sampled_from(GARBAGE)))
def test_salts_are_none_str_bytes_or_64_bit_ints(x):
    accepted = run_manager_call(lambda pm, a, b, x: pm.match_prefix(b, [1, 2], salt=x), x)
    ok = x is None or isinstance(x, (str, bytes, bytearray)) or (
        exact(x) is not None and -(2**63) <= exact(x) < 2**64)
    assert accepted == ok, x
