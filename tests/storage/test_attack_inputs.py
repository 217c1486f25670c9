"""The cache's arguments against hostile values (tests/support/hostile.py says what every call
must do): garbage of every type and integers of any size; a refused call leaves every page as it
was and donates nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import pytest
from hypothesis import given

from easykv import gather_kv
from tests.support.hostile import GARBAGE, INTS, check_range, run_cache_call
from tests.support.pools import LAYERS, MAX_LEN, PAGE_SIZE, PAGES

KV = jnp.zeros((1, 8, 8), jnp.bfloat16)

CACHE_CALLS: list[tuple[str, Callable[[Any, Any], Any], tuple[int, int] | None]] = [
    ("cache[layer]", lambda c, x: c[x], (-LAYERS, LAYERS - 1)),
    ("gather_kv(layer)", lambda c, x: gather_kv(c, x, [0], 1), (-LAYERS, LAYERS - 1)),
    ("gather_kv(page)", lambda c, x: gather_kv(c, 0, [x], 1), (0, PAGES - 1)),
    ("gather_kv(length)", lambda c, x: gather_kv(c, 0, [0, 1, 2, 3], x), (0, MAX_LEN)),
    ("copy_pages(src)", lambda c, x: c.copy_pages([x], [5]), (-1, PAGES - 1)),
    ("zero_pages(ids)", lambda c, x: c.zero_pages([x]), (-1, PAGES - 1)),
    ("write_tokens(slot)", lambda c, x: c[0].write_tokens(KV, KV, [x]), (-1, PAGES * PAGE_SIZE - 1)),
]


@pytest.mark.parametrize("name,call,bounds", CACHE_CALLS, ids=[c[0] for c in CACHE_CALLS])
def test_cache_arguments_refuse_garbage(name, call, bounds):
    for x in GARBAGE:
        accepted = run_cache_call(name, call, x)
        check_range(accepted, x, bounds, name)


@pytest.mark.parametrize("name,call,bounds", CACHE_CALLS, ids=[c[0] for c in CACHE_CALLS])
@given(x=INTS)
def test_cache_integers_of_any_size_are_bounded_before_use(name, call, bounds, x):
    check_range(run_cache_call(name, call, x), x, bounds, name)
