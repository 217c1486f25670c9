"""Multi-step decode on the device: ``k`` decode steps of a plan (`PageManager.plan_decode`) in one
``lax.while_loop``, sampling on the device, so an engine goes back to the host once per ``k``
tokens instead of once per token.

Each step writes every row's current token at its next position (through the step function the
caller gives: its model's write and attention over the cache), samples the next token from the
logits, and derives the next step's metadata from this one (`increment_cache_lengths`, into the
pages the plan reserved). A row stops at its end-of-sequence token or its limit; the loop ends
when every row stopped or after ``num_steps``. A stopped row keeps being computed (shapes are
static) but writes nothing more: its slots are padding from then on, so no page, not even a page
it shares with a fork, holds anything it did not commit.

Call it inside the caller's jit (with the cache donated), so the whole loop is one compiled call.
Every argument is checked before the loop is built (its shapes and static values; a numpy array's
values too), so a bad one is a TypeError or ValueError naming it, never an error from inside jax.
This module imports jax, ``step.ragged`` and ``validation`` only: the loop runs on the ragged form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np

from easykv.step.ragged import PAD_SLOT, RaggedFields, increment_cache_lengths, is_ragged
from easykv.validation import INT32_MAX, integer, integer_array, is_scalar, show

# step(state, tokens: (rows,) int32, metadata: tuple of one per layer group) -> (logits: (rows, vocab), state)
StepFn = Callable[[Any, jax.Array, tuple[RaggedFields, ...]], tuple[jax.Array, Any]]
_Ragged = TypeVar("_Ragged", bound=RaggedFields)  # the class of the steps given (a RaggedStep, as a rule) is kept
# sample(logits: (rows, vocab), key) -> ((rows,) int32 token ids, (rows,) float32 log-probabilities of them)
SampleFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


class DecodeOutput(NamedTuple):
    """What `decode_loop` returns; ``rows`` is the plan's padded rows, ``k`` its steps."""

    written: jax.Array  # (rows, k) int32: the token each row wrote at each step (commit these)
    sampled: jax.Array  # (rows, k) int32: the token each step sampled (the row's output)
    logprobs: jax.Array  # (rows, k) float32: each sampled token's log-probability under the sampler
    num_written: jax.Array  # (rows,) int32: steps each row ran: tokens to commit, outputs to keep
    steps: jax.Array  # () int32: steps the loop ran (fewer than k when every row stopped early)
    state: Any  # the step function's state (the cache) after the last step


def log_prob(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """``log_softmax(logits)`` at ``tokens``, in float32.

    Args:
      logits: ``(rows, vocab)`` float logits.
      tokens: ``(rows,)`` int token ids, one per row.

    Returns:
      ``(rows,)`` float32 log-probabilities.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def greedy(logits: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The most likely token of each row and its log-probability (a `SampleFn`).

    Args:
      logits: ``(rows, vocab)`` float logits.
      key: a PRNG key, unused.

    Returns:
      ``(rows,)`` int32 token ids and their ``(rows,)`` float32 log-probabilities.
    """
    del key
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tokens, log_prob(logits, tokens)


def with_temperature(temperature: float) -> SampleFn:
    """A `SampleFn` sampling from ``softmax(logits / temperature)`` with the loop's key; the
    log-probabilities it returns are those of the scaled logits.

    Args:
      temperature: a number ``> 0`` (ValueError otherwise; use `greedy` for temperature 0).
    """
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be a number > 0; use greedy for temperature 0")

    def sample(logits: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        scaled = logits.astype(jnp.float32) / temperature
        tokens = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
        return tokens, log_prob(scaled, tokens)

    return sample


def per_group(metadata: _Ragged | tuple[_Ragged, ...], num_groups: int) -> tuple[_Ragged, ...]:
    """``metadata`` as a tuple of one step per layer group, each in the ragged form (a `RaggedStep`,
    or ``PagedAttentionMetadata.for_mixed``'s): the tuple itself, or, for a cache of one group,
    its one step given bare (wrapped here, once, for every use after).

    Args:
      metadata: a tuple of one step per layer group (the plan's ``plan.metadata``), or one bare for
        one group.
      num_groups: the cache's layer groups.

    Raises:
      ValueError: anything else, named, with the form to pass.
    """
    if num_groups == 1 and is_ragged(metadata):
        return (cast(_Ragged, metadata),)  # is_ragged: it holds the six fields
    if not isinstance(metadata, tuple) or len(metadata) != num_groups or not all(is_ragged(m) for m in metadata):
        got = type(metadata).__name__
        if isinstance(metadata, tuple):
            got = f"a tuple of {len(metadata)}: {', '.join(type(m).__name__ for m in metadata[:4])}"
        raise ValueError(f"this manager has {num_groups} layer group(s): pass a tuple of {num_groups} step metadata, "
                         "one RaggedStep per group (the plan's plan.metadata, what schedule_decode gives"
                         f"{'; or the one step bare' if num_groups == 1 else ''}), got {got}")
    return metadata


def increment_groups(metadata: _Ragged | tuple[_Ragged, ...], *, page_size: int,
                     num_pages: tuple[int, ...]) -> tuple[_Ragged, ...]:
    """`increment_cache_lengths` of each layer group's decode metadata (``num_pages``: each group's
    pool; numpy or jax, inside jit too); a cache of one group also takes its one metadata bare
    (`per_group`)."""
    metadata = per_group(metadata, len(num_pages))
    return tuple(increment_cache_lengths(m, page_size=page_size, num_pages=p) for m, p in zip(metadata, num_pages))


def _only_live(metadata: tuple[RaggedFields, ...], live: jax.Array) -> tuple[RaggedFields, ...]:
    """The step's metadata with the stopped rows' writes dropped (token ``i`` is row ``i``): a
    row that stopped writes nothing more, not even into its own pages."""
    def keep(m: RaggedFields) -> RaggedFields:
        slots = jnp.asarray(m.slot_mapping)  # a traced array inside the loop
        rows = live.shape[0]
        return m.replace(slot_mapping=slots.at[:rows].set(jnp.where(live, slots[:rows], PAD_SLOT)))

    return tuple(keep(m) for m in metadata)


def decode_loop(step: StepFn, state: Any, tokens: jax.Array,
                metadata: tuple[RaggedFields, ...] | RaggedFields, *,
                num_steps: int, page_size: int, num_pages: tuple[int, ...], limits: jax.Array,
                eos_id: int | tuple[int, ...] | None = None, sample: SampleFn = greedy,
                key: jax.Array | None = None) -> DecodeOutput:
    """Run up to ``num_steps`` decode steps of a plan in one device loop.

    Args:
      step: the model step, ``step(state, tokens, metadata) -> (logits, state)``: writes
        ``tokens`` ``(rows,)`` int32 with ``metadata`` (one per layer group) and returns
        ``(rows, vocab)`` logits (any rows beyond ``rows`` are ignored) and the new state.
      state: the step function's state (the cache), carried through the loop.
      tokens: ``(rows,)`` ints (a jax array, traced too, or numpy) each row's next token to write (the
        last one it sampled).
      metadata: the plan's first step, a tuple of one `RaggedStep` per layer group
        (``plan.metadata``; ``PagedAttentionMetadata.for_mixed``'s decode steps run too); a cache of
        one group also takes its one step bare (``step`` gets the one-tuple either way).
      num_steps: the plan's ``plan.num_steps``, a static int, ``1 ..`` the positions the page
        table holds per sequence (its columns times ``page_size``).
      page_size: the plan's ``plan.page_size``, static.
      num_pages: the plan's ``plan.num_pages``, each group's pool, a static tuple of ints.
      limits: ``(rows,)`` ints (as ``tokens``) the most tokens each row may still sample (0 for
        padding rows and rows that must not run), at most ``num_steps`` each (more is cut to it).
      eos_id: an end-of-sequence id (or a tuple of them), a static token id of the step's
        vocabulary: a row stops after sampling one (it is kept in ``sampled``, never written).
        None (default): rows stop at their limits only.
      sample: the `SampleFn`, ``sample(logits, key) -> (tokens, logprobs)`` (default `greedy`).
      key: the PRNG key split once per step for ``sample`` (default ``jax.random.key(0)``).

    Returns:
      A `DecodeOutput`: per row and step the tokens written and sampled, their
      log-probabilities, the steps each row ran and the final state.

    Raises:
      TypeError: an argument of the wrong kind (a list for an array, an int for ``num_pages``, a
        step or sample that is not callable, a key that is no PRNG key), named with the form to pass.
      ValueError: a value out of its range, a shape or dtype that does not fit the plan, or (when
        the step is traced) logits that are not ``(rows, vocab)`` or an ``eos_id`` past the
        vocabulary; all before the loop runs.
    """
    args = _checked(step, tokens, metadata, num_steps=num_steps, page_size=page_size, num_pages=num_pages,
                    limits=limits, eos_id=eos_id, sample=sample, key=key)
    rows, num_steps, eos = args.rows, args.num_steps, args.eos

    def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        j, state, meta, current, written, sampled, logprobs, live, count, key = carry
        logits, state = _logits_of(step(state, current, _only_live(meta, live)), rows, eos)
        key, sub = jax.random.split(key)
        nxt, logp = sample(logits[:rows], sub)
        written = written.at[:, j].set(current)
        sampled = sampled.at[:, j].set(nxt)
        logprobs = logprobs.at[:, j].set(logp.astype(jnp.float32))
        count = count + live
        stopped = count >= limits
        if eos is not None:
            stopped |= jnp.isin(nxt, jnp.asarray(eos, jnp.int32))
        meta = increment_groups(meta, page_size=args.page_size, num_pages=args.num_pages)
        return j + 1, state, meta, nxt, written, sampled, logprobs, live & ~stopped, count, key

    def cond(carry: tuple[Any, ...]) -> jax.Array:
        more: jax.Array = (carry[0] < num_steps) & carry[7].any()
        return more

    limits = jnp.minimum(args.limits, num_steps)
    empty = jnp.zeros((rows, num_steps), jnp.int32)
    carry = (jnp.int32(0), state, args.metadata, args.tokens, empty, empty,
             jnp.zeros((rows, num_steps), jnp.float32), limits > 0, jnp.zeros(rows, jnp.int32), args.key)
    j, state, _, _, written, sampled, logprobs, _, count, _ = jax.lax.while_loop(cond, body, carry)
    return DecodeOutput(written=written, sampled=sampled, logprobs=logprobs, num_written=count, steps=j, state=state)


# ---- argument checks: every one before the loop is built ------------------------------------------
class _Arguments(NamedTuple):
    metadata: tuple[RaggedFields, ...]
    rows: int
    num_steps: int
    page_size: int
    num_pages: tuple[int, ...]
    tokens: jax.Array  # (rows,) int32
    limits: jax.Array  # (rows,) int32
    eos: tuple[int, ...] | None
    key: jax.Array


def _checked(step: Any, tokens: Any, metadata: Any, *, num_steps: Any, page_size: Any, num_pages: Any, limits: Any,
             eos_id: Any, sample: Any, key: Any) -> _Arguments:
    """`decode_loop`'s arguments checked (TypeError or ValueError naming the first bad one and the
    fix), as the loop takes them. Static checks only on jax arrays (they may be traced); a numpy
    array's values are checked too."""
    for name, fn, form in (("step", step, "step(state, tokens, metadata) -> (logits, state)"),
                           ("sample", sample, "sample(logits, key) -> (tokens, logprobs), e.g. greedy")):
        if not callable(fn):
            raise TypeError(f"{name} must be a function {form}, got {show(fn)} of type {type(fn).__name__}")
    if not isinstance(num_pages, (tuple, list)):
        raise TypeError(f"num_pages must be a tuple of each layer group's pool size (the plan's plan.num_pages), got "
                        f"{show(num_pages)} of type {type(num_pages).__name__}; pass plan.num_pages"
                        f"{f' (one group: ({num_pages},))' if isinstance(num_pages, (int, np.integer)) else ''}")
    if not num_pages:
        raise ValueError("num_pages=() names no layer group; pass plan.num_pages, one pool size per group")
    pools = tuple(integer(f"num_pages[{g}]", n, lo=1, hint="the pages of a layer group's pool, plan.num_pages")
                  for g, n in enumerate(num_pages))
    page_size = integer("page_size", page_size, lo=1, hint="tokens per page, the plan's plan.page_size")
    metadata = per_group(metadata, len(pools))
    for g, m in enumerate(metadata):
        if np.ndim(m.page_table) != 2:
            raise ValueError(f"metadata[{g}] is not one decode step in the mixed form (page_table of shape "
                             f"{np.shape(m.page_table)}); pass the plan's first step, plan.metadata")
    rows = int(np.shape(metadata[0].page_table)[0])
    # A loop writes one position per step: more steps than the page table holds positions cannot run,
    # and the outputs, (rows, num_steps) each, are allocated before the loop starts.
    most = min(int(np.shape(m.page_table)[1]) for m in metadata) * page_size
    num_steps = integer("num_steps", num_steps, lo=1, hi=most,
                        hint=f"the plan's plan.num_steps, at most the {most} positions the page table holds per "
                             "sequence")
    return _Arguments(metadata=metadata, rows=rows, num_steps=num_steps, page_size=page_size, num_pages=pools,
                      tokens=_per_row("tokens", tokens, rows, "each row's next token to write"),
                      limits=_per_row("limits", limits, rows, "the most tokens each row may write, plan.limits"),
                      eos=_eos_ids(eos_id), key=_prng_key(key))


def _per_row(name: str, value: Any, rows: int, what: str) -> jax.Array:
    """``value`` as the ``(rows,)`` int32 array the loop carries (a numpy array's values checked)."""
    if not isinstance(value, (np.ndarray, jax.Array)):
        raise TypeError(f"{name} must be a ({rows},) int array, jax or numpy ({what}), got {show(value)} of type "
                        f"{type(value).__name__}; pass jnp.asarray({name}, jnp.int32)")
    if value.shape != (rows,):
        raise ValueError(f"{name} has shape {value.shape}; pass ({rows},): one per row of the plan ({what})")
    if isinstance(value, np.ndarray):  # known on the host: every value checked before it becomes int32
        return jnp.asarray(integer_array(name, value, lo=0, hi=INT32_MAX, hint=what))
    if not jnp.issubdtype(value.dtype, jnp.integer) or not jnp.can_cast(value.dtype, jnp.int32):
        raise ValueError(f"{name} has dtype {value.dtype}; pass ints that int32 holds exactly (int32, int16, int8, "
                         f"uint16, uint8): {what}")
    return value.astype(jnp.int32)


def _eos_ids(eos_id: Any) -> tuple[int, ...] | None:
    """``eos_id`` as a tuple of static token ids (None: none)."""
    if eos_id is None:
        return None
    hint = "a token id of the step's vocabulary, a static int"
    if is_scalar(eos_id):
        return (integer("eos_id", eos_id, lo=0, hint=hint),)
    if not isinstance(eos_id, (tuple, list)):
        raise TypeError(f"eos_id must be a token id or a tuple of them, got {show(eos_id)} of type "
                        f"{type(eos_id).__name__}; pass a tuple of ints")
    if not eos_id:
        raise ValueError("eos_id=() names no token; pass None to stop rows at their limits only")
    return tuple(integer(f"eos_id[{i}]", e, lo=0, hint=hint) for i, e in enumerate(eos_id))


def _prng_key(key: Any) -> jax.Array:
    """``key`` (None: ``jax.random.key(0)``), one PRNG key: a typed key or a raw uint32 one."""
    if key is None:
        return jax.random.key(0)
    if isinstance(key, jax.Array) and ((jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ())
                                       or (key.dtype == jnp.uint32 and key.ndim == 1)):
        return key
    raise TypeError(f"key must be one PRNG key, e.g. jax.random.key(seed), got {show(key)} of type "
                    f"{type(key).__name__}{f' and shape {key.shape}' if hasattr(key, 'shape') else ''}")


def _logits_of(out: Any, rows: int, eos: tuple[int, ...] | None) -> tuple[jax.Array, Any]:
    """The step's ``(logits, state)``, checked when the step is traced (before the loop runs)."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"step must return (logits, state), got {type(out).__name__}")
    logits, state = out
    shape = np.shape(logits)
    if len(shape) != 2 or shape[0] < rows:
        raise ValueError(f"step returned logits of shape {shape}; it must return ({rows} or more rows, vocab) logits, "
                         "one row per row of the plan")
    if eos is not None and max(eos) >= shape[1]:
        raise ValueError(f"eos_id {max(eos)} is not a token of the step's vocabulary of {shape[1]} (its logits have "
                         f"shape {shape}); pass an id below {shape[1]}, or None")
    return logits, state


__all__ = ["DecodeOutput", "SampleFn", "StepFn", "decode_loop", "greedy", "increment_groups", "log_prob", "per_group",
           "with_temperature"]
