"""Every argument of `decode_loop` is checked before the loop is built (issue 42 attack): a bad one
is a TypeError or ValueError naming it, its value and what to pass, raised before the step
function runs (or, for what only the traced step shows, before the loop runs), with the plan and
its manager unchanged. Before: ``num_steps=2**31`` and ``eos_id=2**40`` raised OverflowError,
``num_pages=20`` a TypeError about ``len()``, list tokens or limits an AttributeError, and
``num_steps=10**9`` was accepted (two (rows, 10**9) arrays built before anything ran).

On a host-only manager with a constant step (vocabulary of 11, always token 3): no model needed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from easykv.step.loop import decode_loop, greedy
from easykv.step.ragged import stack_metadata
from tests.support.managers import make, prefill

VOCAB = 11
TOKEN = 3


class Step:
    """A step that counts its calls (traces) and always scores ``TOKEN`` highest."""

    def __init__(self, logits_shape=None, returns_pair=True):
        self.calls, self.logits_shape, self.returns_pair = 0, logits_shape, returns_pair

    def __call__(self, state, tokens, metadata):
        self.calls += 1
        logits = jnp.zeros(self.logits_shape or (tokens.shape[0], VOCAB)).at[..., TOKEN].set(1.0)
        return (logits, state) if self.returns_pair else logits


def planned():
    """A manager (max_len 32, page_size 4: a table of 8 columns, 32 positions) and an open plan of
    3 steps over one sequence padded to 2 rows."""
    m = make(batch=4, pages=20, max_len=32)
    a, b = m.claim(2)
    prefill(m, a, [1, 2, 3, 4, 5])
    return m, m.schedule_decode([a], 3, pad_seqs_to=2)


def good(plan):
    return dict(tokens=jnp.asarray([7, 0], jnp.int32), metadata=plan.metadata, num_steps=plan.num_steps,
                page_size=plan.page_size, num_pages=plan.num_pages, limits=jnp.asarray(plan.limits))


def run(plan, step=None, **changes):
    kw = {**good(plan), **changes}
    return decode_loop(step or Step(), None, kw.pop("tokens"), kw.pop("metadata"), **kw)


STEPS_BOUND = r"\(valid: 1\.\.32; the plan's plan\.num_steps, at most the 32 positions the page table holds per " \
              r"sequence\)"
BAD = [
    # (argument changes, exception, message)
    (dict(num_steps=0), ValueError, rf"num_steps must be a positive int, got 0 {STEPS_BOUND}"),
    (dict(num_steps=33), ValueError, rf"num_steps must be a positive int, got 33 {STEPS_BOUND}"),
    (dict(num_steps=2**31), ValueError, rf"num_steps must be a positive int, got 2147483648 {STEPS_BOUND}"),
    (dict(num_steps=2**40), ValueError, rf"num_steps must be a positive int, got 1099511627776 {STEPS_BOUND}"),
    (dict(num_steps=10**9), ValueError, rf"num_steps must be a positive int, got 1000000000 {STEPS_BOUND}"),
    (dict(num_steps=np.uint64(2**64 - 1)), ValueError, r"num_steps must be a positive int, got 18446744073709551615"),
    (dict(num_steps=True), ValueError, r"num_steps must be a positive int, got True \(a bool"),
    (dict(num_steps=2.0), ValueError, r"num_steps must be a positive int, got 2\.0 \(a float"),
    (dict(num_steps=None), ValueError, r"num_steps must be a positive int, got None \(a NoneType"),
    (dict(page_size=0), ValueError, r"page_size must be a positive int, got 0 \(valid: 1\.\.2147483647; tokens per "
                                    r"page, the plan's plan\.page_size\)"),
    (dict(page_size=2**40), ValueError, r"page_size must be a positive int, got 1099511627776"),
    (dict(page_size="4"), ValueError, r"page_size must be a positive int, got '4' \(a str"),
    (dict(num_pages=20), TypeError, r"num_pages must be a tuple of each layer group's pool size \(the plan's "
                                    r"plan\.num_pages\), got 20 of type int; pass plan\.num_pages \(one group: "
                                    r"\(20,\)\)"),
    (dict(num_pages=None), TypeError, r"num_pages must be a tuple .*got None of type NoneType; pass plan\.num_pages$"),
    (dict(num_pages=()), ValueError, r"num_pages=\(\) names no layer group; pass plan\.num_pages"),
    (dict(num_pages=(0,)), ValueError, r"num_pages\[0\] must be a positive int, got 0"),
    (dict(num_pages=(2**40,)), ValueError, r"num_pages\[0\] must be a positive int, got 1099511627776"),
    (dict(num_pages=(20, 20)), ValueError, r"this manager has 2 layer group\(s\): pass a tuple of 2 step metadata"),
    (dict(metadata=None), ValueError, r"pass a tuple of 1 step metadata.*got NoneType"),
    (dict(tokens=[7, 0]), TypeError, r"tokens must be a \(2,\) int array, jax or numpy \(each row's next token to "
                                     r"write\), got \[7, 0\] of type list; pass jnp\.asarray\(tokens, jnp\.int32\)"),
    (dict(tokens=7), TypeError, r"tokens must be a \(2,\) int array.*got 7 of type int"),
    (dict(tokens=jnp.zeros(3, jnp.int32)), ValueError, r"tokens has shape \(3,\); pass \(2,\): one per row of the "
                                                      r"plan"),
    (dict(tokens=jnp.zeros((2, 1), jnp.int32)), ValueError, r"tokens has shape \(2, 1\); pass \(2,\)"),
    (dict(tokens=jnp.zeros(2)), ValueError, r"tokens has dtype float32; pass ints that int32 holds exactly"),
    (dict(tokens=jnp.zeros(2, jnp.uint32)), ValueError, r"tokens has dtype uint32; pass ints that int32 holds"),
    (dict(tokens=np.array([7, -1])), ValueError, r"tokens\[1\] = -1 is out of range \(valid: 0\.\.2147483647"),
    (dict(tokens=np.array([2**40, 0])), ValueError, r"tokens\[0\] = 1099511627776 is out of range"),
    (dict(tokens=np.array([7.0, 0.0])), ValueError, r"tokens\[0\] must be a non-negative int, got np\.float64\(7\.0\)"),
    (dict(limits=[3, 0]), TypeError, r"limits must be a \(2,\) int array, jax or numpy \(the most tokens each row "
                                     r"may write, plan\.limits\), got \[3, 0\] of type list; pass "
                                     r"jnp\.asarray\(limits, jnp\.int32\)"),
    (dict(limits=jnp.ones(2)), ValueError, r"limits has dtype float32; pass ints that int32 holds exactly"),
    (dict(limits=np.array([-1, 0])), ValueError, r"limits\[0\] = -1 is out of range"),
    (dict(limits=jnp.ones(4, jnp.int32)), ValueError, r"limits has shape \(4,\); pass \(2,\)"),
    (dict(eos_id=2**40), ValueError, r"eos_id must be a non-negative int, got 1099511627776 \(valid: "
                                     r"0\.\.2147483647; a token id of the step's vocabulary, a static int\)"),
    (dict(eos_id=-1), ValueError, r"eos_id must be a non-negative int, got -1"),
    (dict(eos_id="1"), ValueError, r"eos_id must be a non-negative int, got '1' \(a str"),
    (dict(eos_id=()), ValueError, r"eos_id=\(\) names no token; pass None to stop rows at their limits only"),
    (dict(eos_id=(1, 2**40)), ValueError, r"eos_id\[1\] must be a non-negative int, got 1099511627776"),
    (dict(eos_id=np.array([1, 2])), TypeError, r"eos_id must be a token id or a tuple of them, got array\(\[1, 2\]\) "
                                               r"of type ndarray; pass a tuple of ints"),
    (dict(sample="greedy"), TypeError, r"sample must be a function sample\(logits, key\) -> \(tokens, logprobs\), "
                                       r"e\.g\. greedy, got 'greedy' of type str"),
    (dict(key=0), TypeError, r"key must be one PRNG key, e\.g\. jax\.random\.key\(seed\), got 0 of type int"),
    (dict(key=jax.random.split(jax.random.key(0))), TypeError, r"key must be one PRNG key.*and shape \(2,\)"),
]


@pytest.mark.parametrize("changes, exc, match", BAD, ids=[repr(c)[:60] for c, _, _ in BAD])
def test_a_bad_argument_is_named_before_the_step_runs_and_the_plan_is_untouched(changes, exc, match):
    m, plan = planned()
    before, step = m.state_dict(), Step()
    with pytest.raises(exc, match=match):
        run(plan, step, **changes)
    assert step.calls == 0  # refused before the step function was even traced
    assert m.state_dict() == before and not plan.committed
    m.commit(plan, np.full((1, 3), TOKEN), 3)  # the plan is as it was: it commits
    m.check_invariants()


@pytest.mark.parametrize("step, changes, exc, match", [
    (None, None, TypeError, r"step must be a function step\(state, tokens, metadata\) -> \(logits, state\), got None"),
    (Step(returns_pair=False), {}, TypeError, r"step must return \(logits, state\), got \w*Tracer"),
    (Step(logits_shape=(2, 1, VOCAB)), {}, ValueError, r"step returned logits of shape \(2, 1, 11\); it must return "
                                                       r"\(2 or more rows, vocab\) logits"),
    (Step(logits_shape=(1, VOCAB)), {}, ValueError, r"step returned logits of shape \(1, 11\)"),
    (Step(), dict(eos_id=VOCAB), ValueError, r"eos_id 11 is not a token of the step's vocabulary of 11 \(its logits "
                                             r"have shape \(2, 11\)\); pass an id below 11, or None"),
    (Step(), dict(eos_id=(1, 2**31 - 1)), ValueError, r"eos_id 2147483647 is not a token of the step's vocabulary"),
], ids=["not-callable", "no-pair", "3-d-logits", "too-few-rows", "eos-past-vocab", "eos-tuple-past-vocab"])
def test_a_step_or_eos_id_that_does_not_fit_is_named_when_the_step_is_traced_before_the_loop_runs(step, changes, exc,
                                                                                                   match):
    m, plan = planned()
    before = m.state_dict()
    with pytest.raises(exc, match=match):
        kw = {**good(plan), **(changes or {})}
        decode_loop(step, None, kw.pop("tokens"), kw.pop("metadata"), **kw)
    assert m.state_dict() == before and not plan.committed
    assert step is None or step.calls <= 1  # traced once at most; the loop never ran
    m.abort(plan)  # the plan is as it was: it ends
    m.check_invariants()


def test_a_stacked_metadata_is_refused_as_not_one_step():
    m = make(batch=4, pages=20, max_len=32)
    [a] = m.claim(1)
    prefill(m, a, [1, 2, 3])
    plan = m.schedule_decode([a], 2)
    # both steps of the plan stacked on a leading step axis: what a caller passing every step at once would give
    stacked = tuple(stack_metadata(steps) for steps in zip(plan.metadata, plan.next_metadata(plan.metadata)))
    with pytest.raises(ValueError, match=r"metadata\[0\] is not one decode step in the mixed form \(page_table of "
                                         r"shape \(2, 1, 8\)\); pass the plan's first step, plan\.metadata"):
        decode_loop(Step(), None, jnp.zeros(1, jnp.int32), stacked, num_steps=2, page_size=4, num_pages=(20,),
                    limits=jnp.ones(1, jnp.int32))
    m.abort(plan)


def test_every_accepted_form_runs_the_same_loop_in_and_out_of_jit():
    """numpy tokens and limits (their values checked), num_pages as a list, eos ids as a list, a
    raw key, numpy ints for the static ints, and traced tokens and limits inside jit: the same
    loop, the same outputs."""
    m, plan = planned()
    want = run(plan, eos_id=None)
    forms = [dict(tokens=np.array([7, 0]), limits=np.asarray(plan.limits, np.int64)),
             dict(num_pages=list(plan.num_pages), num_steps=np.int64(3), page_size=np.int32(4)),
             dict(eos_id=[VOCAB - 1]), dict(eos_id=np.int64(VOCAB - 1)), dict(key=jax.random.PRNGKey(0)),
             dict(tokens=jnp.asarray([7, 0], jnp.int8), limits=jnp.asarray([3, 0], jnp.uint8)),
             dict(sample=greedy)]
    for changes in forms:
        got = run(plan, **changes)
        for field in ("written", "sampled", "num_written", "steps"):
            np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), field)
    traced = jax.jit(lambda tokens, limits: run(plan, tokens=tokens, limits=limits).written)
    np.testing.assert_array_equal(traced(jnp.asarray([7, 0], jnp.int32), jnp.asarray(plan.limits)), want.written)
    assert np.asarray(want.num_written).tolist() == [3, 0]
    assert np.asarray(want.written)[0].tolist() == [7, TOKEN, TOKEN]
    m.commit(plan, want.written, want.num_written)
    assert m.length(plan.seq_ids[0]) == 8
