"""Hostile arguments while a decode plan is open, and the decode plan's own arguments (issue 42
attack; tests/support/hostile.py says what every call must do).

The open-plan guard reads the sequences a call names before the call runs. It must read them
exactly as the call does: every call of the manager's hostile registry (test_attack_inputs.py),
given garbage, integers of any width and 0-d numpy and jax ids, behaves the same (the same
result and state, or the same error and message) with a plan open over a sequence it does not
name as with no plan. Before, a 0-d numpy or jax id was refused with "seq_ids must have 1
dimension(s)" whenever any plan was open. Then the arguments of ``schedule_decode``,
``commit``, ``truncate``, ``fork`` and ``resume``, which that registry does not hold:
only ValueError or CacheFullError, nothing changed on an error, and no integer out of range
accepted (``commit(plan, ids, 2**80)`` raised OverflowError before)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from tests.manager.test_attack_inputs import ALL_CALLS, manager
from tests.support.deprecation import old_name
from tests.support.hostile import ALLOWED, GARBAGE, INTS, exact
from tests.support.pools import MAX_LEN

PLANNED = 2  # the sequence the plan holds (claimed third): no value below names it
INT_IDS = [0, 1, 3, -1, 4, 2**31, 2**63, 2**64 - 1, 2**80, -(2**63) - 1, np.uint64(2**64 - 1), np.int64(-1),
           np.uint8(3), np.int32(1)]
SCALAR_IDS = [np.array(0), np.array(1), np.array(3, np.uint8), np.array(-1), np.array(2**64 - 1, np.uint64),
              jnp.int32(1), jnp.arange(4)[3], jnp.asarray(0, jnp.uint8), np.array(1.0), jnp.asarray(True)]


def names_planned(x: Any) -> bool:
    """Whether ``x`` names the planned sequence (its refusal is the guard's, not the call's)."""
    try:
        return bool(np.isin(PLANNED, np.asarray(x, dtype=object).ravel().tolist()))
    except Exception:  # noqa: BLE001  garbage numpy cannot read names nothing
        return False


def outcome(call: Callable[..., Any], x: Any, plan: bool, name: str = "") -> tuple[Any, str]:
    """(error type and message, or "ran") and the state after, of ``call`` on a manager with
    ``PLANNED`` claimed, held by an open plan or not; ``name``: the registry's (a deprecated
    call's warning is expected)."""
    pm, a, b = manager()
    [c] = pm.claim(1)
    assert c == PLANNED
    if plan:
        pm.schedule_decode([c], 1, max_tokens=0)
    try:
        with old_name(name.split("(")[0]):
            call(pm, a, b, x)
        result: Any = "ran"
    except Exception as err:  # noqa: BLE001  compared whole
        result = (type(err), str(err))
    return result, json.dumps(pm.state_dict())


@pytest.mark.parametrize("name,call,bounds", ALL_CALLS, ids=[c[0] for c in ALL_CALLS])
def test_every_call_reads_its_arguments_alike_with_a_plan_open_over_another_sequence(name, call, bounds):
    for x in GARBAGE + INT_IDS + SCALAR_IDS:
        if names_planned(x):
            continue
        with_plan, without = outcome(call, x, True, name), outcome(call, x, False, name)
        assert with_plan == without, f"{name} on {x!r} ({type(x).__name__}): {with_plan[0]} with a plan open, " \
                                     f"{without[0]} without"


# ---- the decode plan's own arguments -----------------------------------------------------------------
def plan_env():
    """``manager()`` (a: 5 tokens, b: none) with a plan over ``a`` of 2 steps open."""
    pm, a, b = manager()
    return pm, a, b, pm.schedule_decode([a], 2)


PLAN_CALLS: list[tuple[str, Callable[..., Any], tuple[int, int] | None]] = [
    ("schedule_decode(num_steps)", lambda pm, a, b, plan, x: pm.schedule_decode([b], x), (1, MAX_LEN)),
    ("schedule_decode(max_tokens)", lambda pm, a, b, plan, x: pm.schedule_decode([b], 3, max_tokens=x), (0, 3)),
    ("schedule_decode([max_tokens])", lambda pm, a, b, plan, x: pm.schedule_decode([b], 3, max_tokens=[x]), (0, 3)),
    ("schedule_decode(pad_seqs_to)", lambda pm, a, b, plan, x: pm.schedule_decode([b], 1, pad_seqs_to=x), (1, 4)),
    ("schedule_decode(id)", lambda pm, a, b, plan, x: pm.schedule_decode([x], 1), (0, 3)),
    ("commit(num_tokens)", lambda pm, a, b, plan, x: pm.commit(plan, [[1, 1]], x), (0, 2)),
    ("commit([num_tokens])", lambda pm, a, b, plan, x: pm.commit(plan, [[1, 1]], [x]), (0, 2)),
    ("commit(token)", lambda pm, a, b, plan, x: pm.commit(plan, [[1, x]]), (0, 2**31 - 1)),
    ("truncate(length)", lambda pm, a, b, plan, x: pm.truncate(pm.fork(a), x), (0, 5)),
    ("truncate(id)", lambda pm, a, b, plan, x: pm.truncate(x, 0), (0, 3)),
    ("fork(n)", lambda pm, a, b, plan, x: pm.fork(b, n=x), (1, 4)),
    ("resume(first_position)", lambda pm, a, b, plan, x: pm.resume(b, x), (0, MAX_LEN - 1)),
]
# A count here also takes a list (one per sequence): the hypothesis test checks its entries. None
# means "not given" for these.
LISTS_TOO = {"schedule_decode(max_tokens)", "commit(num_tokens)"}
OPTIONAL = LISTS_TOO | {"schedule_decode(pad_seqs_to)", "fork(n)"}


def run_plan_call(call: Callable[..., Any], x: Any) -> bool:
    """Whether ``call`` accepted ``x``; on an error, only an allowed one, with nothing changed."""
    pm, a, b, plan = plan_env()
    before = json.dumps(pm.state_dict(host_tier=True))
    try:
        call(pm, a, b, plan, x)
    except ALLOWED:
        assert json.dumps(pm.state_dict(host_tier=True)) == before, "an error changed the manager"
        return False
    pm.check_invariants()
    return True


def check_bounds(accepted: bool, x: Any, bounds: tuple[int, int] | None, name: str) -> None:
    if not accepted or bounds is None or (x is None and name in OPTIONAL):
        return
    if name in LISTS_TOO and isinstance(x, (list, tuple, np.ndarray, range)) and np.ndim(x) == 1:
        return
    value = exact(x) if exact(x) is not None else (int(x) if getattr(x, "ndim", None) == 0 else None)
    assert value is not None and bounds[0] <= value <= bounds[1], f"{name} accepted {x!r} ({type(x).__name__})"


@pytest.mark.parametrize("name,call,bounds", PLAN_CALLS, ids=[c[0] for c in PLAN_CALLS])
def test_plan_arguments_refuse_garbage_and_scalars_out_of_range(name, call, bounds):
    for x in GARBAGE + INT_IDS + SCALAR_IDS:
        check_bounds(run_plan_call(call, x), x, bounds, name)


@pytest.mark.parametrize("name,call,bounds", PLAN_CALLS, ids=[c[0] for c in PLAN_CALLS])
@given(x=INTS)
def test_plan_integers_of_any_size_are_bounded_before_use(name, call, bounds, x):
    check_bounds(run_plan_call(call, x), x, bounds, name)


@pytest.mark.parametrize("form", [int, np.int64, np.array, lambda s: jnp.arange(4)[s]],
                         ids=["int", "numpy-int", "numpy-0d", "jax-0d"])
def test_one_id_reads_alike_in_every_call_that_takes_one_or_a_list_plan_or_no_plan(form):
    """``reserve`` and ``advance`` (deprecated now) take one id or a list: one numpy or jax 0-d id is
    one id there as in every single-id call (before: "seq_ids must have 1 dimension(s)", even with no
    plan open); ``schedule`` takes a list of such ids; ``external_claim``, which takes a list only,
    names the one id it got and the list to pass."""
    pm, a, b = manager()
    with pytest.warns(DeprecationWarning, match=r"PageManager\.reserve is deprecated"):
        pm.reserve(form(a), 1)
    with pytest.warns(DeprecationWarning, match=r"PageManager\.advance is deprecated"):
        pm.advance(form(a), 1)
    assert pm.length(a) == 6 and pm.sequence(a).capacity == 8
    pm.commit(pm.schedule([form(a)], 1))
    assert pm.length(a) == 7 and pm.sequence(a).capacity == 8
    before = pm.state_dict()
    with pytest.raises(ValueError, match=r"external_claim takes a list of ids, got the one id 3; pass \[3\]"):
        pm.external_claim(form(3))
    assert pm.state_dict() == before
    pm.check_invariants()
