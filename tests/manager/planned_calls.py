"""How to call each public `PageManager` method that changes the sequences it is given, on a list
of claimed sequences whose last one an open decode plan holds: what the open-plan tests
(test_open_plans.py) and the decode-plan state machine (test_decode_plan_stateful.py) both throw at
a planned sequence. A method taking one id gets the last; one taking a list gets them all, so the
planned one is not always first. Each call is valid but for the plan (or refused by a later check
of its own), so the plan's refusal is what a test sees. The deprecated names are public members
too, guarded like the others: a call of one that runs is expected to warn (`warns_if_deprecated`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.deprecation import DEPRECATED

NAMED_CALLS: dict[str, Callable[[Any, list[int]], Any]] = {
    "release": lambda m, seqs: m.release(seqs[-1]),
    "match_prefix": lambda m, seqs: m.match_prefix(seqs[-1], [1, 2, 3, 4, 5], salt="tenant"),
    "resume": lambda m, seqs: m.resume(seqs[-1], 0),
    "reserve": lambda m, seqs: m.reserve(seqs, 1),
    "fork": lambda m, seqs: m.fork(seqs[-1]),
    "build_step_metadata": lambda m, seqs: m.build_step_metadata(seqs, 1),
    "build_decode_metadata": lambda m, seqs: m.build_decode_metadata(seqs, 2, stacked=True),
    "plan_decode": lambda m, seqs: m.plan_decode(seqs, 1, max_tokens=0),
    "schedule": lambda m, seqs: m.schedule(seqs, 1),
    "schedule_decode": lambda m, seqs: m.schedule_decode(seqs, 1, max_tokens=0),
    "step": lambda m, seqs: m.step(seqs, [[0]] * len(seqs)),
    "append_tokens": lambda m, seqs: m.append_tokens(seqs[-1], [0]),
    "advance": lambda m, seqs: m.advance(seqs, 0),
    "truncate": lambda m, seqs: m.truncate(seqs[-1], m.length(seqs[-1])),  # even to its own length
    "swap_out": lambda m, seqs: m.swap_out(seqs[-1]),
    "swap_in": lambda m, seqs: m.swap_in(seqs[-1]),
}


def refusal(name: str, seq: int, plan_seqs) -> str:
    """The refusal's message (a regex) for a call ``name`` on ``seq`` of an open plan over ``plan_seqs``."""
    listed = ", ".join(map(str, plan_seqs))
    return (rf"{name}\(\) would change sequence {seq}\b.*, which open plan #\d+ holds \(sequences "
            rf"\[{listed}\]: its step may be writing their pages\); end that plan first with "
            r"commit\(plan, token_ids, ...\) or abort\(plan\)")


def warns_if_deprecated(name: str):
    """The context a call of member ``name`` (``"reserve(one id)"`` names ``reserve``) runs in when it is
    expected to run: one of the deprecated names must warn that it is, the others run as they are."""
    member = name.split("(")[0]
    if member in DEPRECATED:
        return pytest.warns(DeprecationWarning, match=rf"PageManager\.{member} is deprecated; use ")
    return contextlib.nullcontext()
