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
This module imports jax and ``step.metadata`` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from easykv.step.metadata import PAD_SLOT, PagedAttentionMetadata, increment_cache_lengths

# step(state, tokens: (rows,) int32, metadata: tuple of one per layer group) -> (logits: (rows, vocab), state)
StepFn = Callable[[Any, jax.Array, tuple[PagedAttentionMetadata, ...]], tuple[jax.Array, Any]]
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


def per_group(metadata: Any, num_groups: int) -> tuple[PagedAttentionMetadata, ...]:
    """``metadata`` as a tuple of one `PagedAttentionMetadata` per layer group: the tuple itself, or,
    for a cache of one group, its one metadata given bare (wrapped here, once, for every use after).

    Args:
      metadata: a tuple of one `PagedAttentionMetadata` per layer group, or one bare for one group.
      num_groups: the cache's layer groups.

    Raises:
      ValueError: anything else, named, with the form to pass.
    """
    if num_groups == 1 and isinstance(metadata, PagedAttentionMetadata):
        return (metadata,)
    if not isinstance(metadata, tuple) or len(metadata) != num_groups \
            or not all(isinstance(m, PagedAttentionMetadata) for m in metadata):
        got = type(metadata).__name__
        if isinstance(metadata, tuple):
            got = f"a tuple of {len(metadata)}: {', '.join(type(m).__name__ for m in metadata[:4])}"
        raise ValueError(f"this manager has {num_groups} layer group(s): pass a tuple of {num_groups} step metadata, "
                         "one PagedAttentionMetadata per group (what build_decode_metadata and plan_decode give"
                         f"{'; or the one metadata bare' if num_groups == 1 else ''}), got {got}")
    return metadata


def increment_groups(metadata: Any, *, page_size: int,
                     num_pages: tuple[int, ...]) -> tuple[PagedAttentionMetadata, ...]:
    """`increment_cache_lengths` of each layer group's decode metadata (``num_pages``: each group's
    pool; numpy or jax, inside jit too); a cache of one group also takes its one metadata bare
    (`per_group`)."""
    metadata = per_group(metadata, len(num_pages))
    return tuple(increment_cache_lengths(m, page_size=page_size, num_pages=p) for m, p in zip(metadata, num_pages))


def _only_live(metadata: tuple[PagedAttentionMetadata, ...], live: jax.Array) -> tuple[PagedAttentionMetadata, ...]:
    """The step's metadata with the stopped rows' writes dropped (token ``i`` is row ``i``): a
    row that stopped writes nothing more, not even into its own pages."""
    def keep(m: PagedAttentionMetadata) -> PagedAttentionMetadata:
        slots = jnp.asarray(m.slot_mapping)  # a traced array inside the loop
        rows = live.shape[0]
        return m.replace(slot_mapping=slots.at[:rows].set(jnp.where(live, slots[:rows], PAD_SLOT)))

    return tuple(keep(m) for m in metadata)


def decode_loop(step: StepFn, state: Any, tokens: jax.Array,
                metadata: tuple[PagedAttentionMetadata, ...] | PagedAttentionMetadata, *,
                num_steps: int, page_size: int, num_pages: tuple[int, ...], limits: jax.Array,
                eos_id: int | tuple[int, ...] | None = None, sample: SampleFn = greedy,
                key: jax.Array | None = None) -> DecodeOutput:
    """Run up to ``num_steps`` decode steps of a plan in one device loop.

    Args:
      step: the model step, ``step(state, tokens, metadata) -> (logits, state)``: writes
        ``tokens`` ``(rows,)`` int32 with ``metadata`` (one per layer group) and returns
        ``(rows, vocab)`` logits (any rows beyond ``rows`` are ignored) and the new state.
      state: the step function's state (the cache), carried through the loop.
      tokens: ``(rows,)`` int each row's next token to write (the last one it sampled).
      metadata: the plan's first step, a tuple of one `PagedAttentionMetadata` per layer group
        (``plan.metadata``), in the mixed decode form; a cache of one group also takes its one
        metadata bare (``step`` gets the one-tuple either way).
      num_steps: the plan's ``plan.num_steps``, a static int ``>= 1``.
      page_size: the plan's ``plan.page_size``, static.
      num_pages: the plan's ``plan.num_pages``, each group's pool, static.
      limits: ``(rows,)`` int the most tokens each row may still sample (0 for padding rows and
        rows that must not run), at most ``num_steps`` each (more is cut to it).
      eos_id: an end-of-sequence id (or a tuple of them): a row stops after sampling one (it is
        kept in ``sampled``, never written). None (default): rows stop at their limits only.
      sample: the `SampleFn`, ``sample(logits, key) -> (tokens, logprobs)`` (default `greedy`).
      key: the PRNG key split once per step for ``sample`` (default ``jax.random.key(0)``).

    Returns:
      A `DecodeOutput`: per row and step the tokens written and sampled, their
      log-probabilities, the steps each row ran and the final state.
    """
    if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
        raise ValueError(f"num_steps={num_steps!r} must be an int >= 1 (the plan's num_steps)")
    metadata = per_group(metadata, len(num_pages))  # the checked tuple, what every step below takes
    rows = metadata[0].page_table.shape[0]
    if tokens.shape != (rows,) or limits.shape != (rows,):
        raise ValueError(f"tokens {tokens.shape} and limits {limits.shape} must be ({rows},): one per row of the plan")
    key = jax.random.key(0) if key is None else key

    def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        j, state, meta, current, written, sampled, logprobs, live, count, key = carry
        logits, state = step(state, current, _only_live(meta, live))
        key, sub = jax.random.split(key)
        nxt, logp = sample(logits[:rows], sub)
        written = written.at[:, j].set(current)
        sampled = sampled.at[:, j].set(nxt)
        logprobs = logprobs.at[:, j].set(logp.astype(jnp.float32))
        count = count + live
        stopped = count >= limits
        if eos_id is not None:
            stopped |= jnp.isin(nxt, jnp.asarray(eos_id, jnp.int32))
        meta = increment_groups(meta, page_size=page_size, num_pages=num_pages)
        return j + 1, state, meta, nxt, written, sampled, logprobs, live & ~stopped, count, key

    def cond(carry: tuple[Any, ...]) -> jax.Array:
        more: jax.Array = (carry[0] < num_steps) & carry[7].any()
        return more

    limits = jnp.minimum(limits.astype(jnp.int32), num_steps)
    empty = jnp.zeros((rows, num_steps), jnp.int32)
    carry = (jnp.int32(0), state, metadata, tokens.astype(jnp.int32), empty, empty,
             jnp.zeros((rows, num_steps), jnp.float32), limits > 0, jnp.zeros(rows, jnp.int32), key)
    j, state, _, _, written, sampled, logprobs, _, count, _ = jax.lax.while_loop(cond, body, carry)
    return DecodeOutput(written=written, sampled=sampled, logprobs=logprobs, num_written=count, steps=j, state=state)


__all__ = ["DecodeOutput", "SampleFn", "StepFn", "decode_loop", "greedy", "increment_groups", "log_prob", "per_group",
           "with_temperature"]
