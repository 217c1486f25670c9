"""Which cases of a parametrized test run in the fast tier.

``python -m pytest tests`` runs the fast tier (pyproject.toml deselects ``slow``); every case a
test file leaves out of it is marked ``slow`` here and still runs with ``-m ""``: a case moves
tiers, it never disappears."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

import pytest

SLOW = pytest.mark.slow


def tiered(cases: Iterable[Any], *, fast: Collection[Any] | Callable[[Any], bool], ids=None) -> list:
    """``cases`` as ``pytest.param`` (a tuple case gives one argument per entry), those not in
    ``fast`` (a collection of cases, or a predicate) marked slow. ``ids``: as parametrize's."""
    cases = list(cases)
    keep = fast if callable(fast) else fast.__contains__
    if not callable(fast):
        unknown = [c for c in fast if c not in cases]
        if unknown:
            raise ValueError(f"fast names cases that are not among the cases: {unknown!r}")
    if ids is not None and not callable(ids):
        ids = list(ids)
    out = []
    for i, case in enumerate(cases):
        values = case if isinstance(case, tuple) else (case,)
        name = (ids(case) if callable(ids) else ids[i]) if ids is not None else None
        out.append(pytest.param(*values, id=name, marks=() if keep(case) else SLOW))
    return out
