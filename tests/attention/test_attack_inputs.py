"""Attention's static options against garbage of every type (tests/support/hostile.py says what
every call must do); each accepted value compiles once, so no integers of any size here."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from easykv import view_attention
from easykv.validation import INT32_MAX
from tests.support.hostile import DECODE, GARBAGE, check_range, run_cache_call

Q = jnp.zeros((1, 8, 8), jnp.float32)
# Static options of attention (each accepted value compiles once: garbage only, no hypothesis).
ATTENTION_CALLS = [
    (f"view_attention({option})", (lambda o: lambda c, x: view_attention(Q, c[0], DECODE, **{o: x}))(option), bounds)
    for option, bounds in (("sliding_window", (1, INT32_MAX)), ("logit_soft_cap", None), ("scale", None),
                           ("pages_per_block", (1, INT32_MAX)), ("query_block", (1, INT32_MAX)),
                           ("implementation", None))
]


@pytest.mark.parametrize("name,call,bounds", ATTENTION_CALLS, ids=[c[0] for c in ATTENTION_CALLS])
def test_attention_options_refuse_garbage(name, call, bounds):
    for x in GARBAGE:
        accepted = run_cache_call(name, call, x)
        check_range(accepted, x, bounds, name)
