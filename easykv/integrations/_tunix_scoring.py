"""Scoring completions over pages (`TunixPagedEngine.score`): the per-token log-probabilities of given
completions under the engine's model, with the shape, masking and padding of Tunix's
``compute_per_token_logps``, where each distinct prompt is computed once.

How: the rows of one prompt form a group. Its leader sequence takes the prompt's cached prefix (device,
host tier, shared store) and prefills the prompt's whole pages before its last token; then each row
(one completion) feeds the rest of the prompt and the completion but its last token, in a fork of the
leader, the last row in the leader itself. The logits at the prompt's last token and at each fed
completion token give the log-probability of the next completion token. The leader stops at a page
boundary so its forks share whole pages only: no copy-on-write copy, and a row needs exactly the pages
of its own tokens. The loop (``_tunix_scorer``) packs ``score_tokens`` tokens a step and runs a batch
larger than the cache in waves.

Tunix's conventions: a token equal to ``pad_id`` is padding wherever it sits, in the prompt or the
completion: Tunix masks it from attention and positions, and so does easykv, which never feeds it.
Each other completion token gets its log-probability given the real tokens before it, and a padding
position gets 0 (Tunix's loss masks exactly those: ``completion != pad_id``). This is Tunix's value for
every token but one after a pad inside a completion (not the right padding rollouts add): Tunix reads
that token's logits off the pad's own query, a value of the padding, not of the model's distribution.
``temperature`` divides the logits as Tunix's does (0 and 1: not at all).

This module holds the request, checked whole before anything changes, and the jitted step. Private to the
Tunix integration; imports flax, jax and easykv's manager.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from easykv.errors import CacheFullError
from easykv.integrations._tunix_model import forward
from easykv.manager.manager import PageManager
from easykv.validation import integer, integer_array


@dataclasses.dataclass(eq=False)  # one object per sequence: compared by identity
class Feed:
    """A sequence the scorer feeds: ``tokens`` from ``fed`` on. The last ``targets.size`` tokens each predict a
    target, whose log-probability goes to column ``columns[i]`` of output row ``row``; a leader's prompt pages
    predict nothing (no targets, row -1) until it takes its group's last row (`take`)."""

    tokens: np.ndarray
    targets: np.ndarray
    columns: np.ndarray
    row: int = -1
    seq: int = -1
    fed: int = 0

    @property
    def left(self) -> int:
        return self.tokens.size - self.fed

    def take(self, row: Feed) -> None:
        """Feed ``row``'s tokens after its own (a leader taking its group's last row, at its page boundary)."""
        self.tokens = np.concatenate([self.tokens, row.tokens])
        self.targets, self.columns, self.row = row.targets, row.columns, row.row


@dataclasses.dataclass(eq=False)
class Group:
    """The rows of one distinct prompt: its leader (the prompt's whole pages before its last token) and the rows
    still to start, each the rest of the prompt and its completion but the last token."""

    prompt: np.ndarray
    leader: Feed
    rows: deque[Feed]
    running_rows: int = 0  # rows started and not finished


@dataclasses.dataclass(frozen=True)
class ScoreBatch:
    """A checked scoring request: the groups to run and the output's shape."""

    groups: list[Group]
    rows: int
    width: int
    temperature: float


def check_request(prompt_tokens: Any, completion_tokens: Any, *, pad_id: Any, eos_id: Any, temperature: Any,
                  vocab: int, manager: PageManager) -> ScoreBatch:  # fmt: skip
    """The request checked whole before anything changes (ValueError, or CacheFullError naming the pages for a
    row no sequence of the cache can hold), as a `ScoreBatch`."""
    pad = integer("pad_id", pad_id, lo=0, hi=vocab - 1, hint="a token id of the model's vocabulary")
    integer("eos_id", eos_id, lo=0, hi=vocab - 1, hint="a token id of the model's vocabulary")
    scale = _temperature(temperature)
    hint = f"token ids of the model's vocabulary of {vocab}"
    prompts = integer_array("prompt_tokens", _host(prompt_tokens), ndim=2, lo=0, hi=vocab - 1, hint=hint)
    completions = integer_array("completion_tokens", _host(completion_tokens), ndim=2, lo=0, hi=vocab - 1, hint=hint)
    if prompts.shape[0] != completions.shape[0] or prompts.shape[0] == 0:
        raise ValueError(f"prompt_tokens {prompts.shape} and completion_tokens {completions.shape} must have the same "
                         "number of rows, at least one: row i of each is one prompt and its completion")
    groups: dict[object, Group] = {}
    page = manager.page_size
    for i, (row, completion) in enumerate(zip(prompts, completions)):
        prompt = row[row != pad]
        if prompt.size == 0:
            raise ValueError(f"prompt_tokens[{i}] holds only the pad id {pad}; every completion needs a prompt")
        columns = np.flatnonzero(completion != pad)
        if not columns.size:
            continue  # nothing to score: the row stays 0
        _check_room(manager, i, prompt.size - 1 + columns.size)
        cut = (prompt.size - 1) // page * page  # the leader's whole pages
        real = completion[columns]
        feed = Feed(np.concatenate([prompt[cut:], real[:-1]]), real, columns, row=i)
        # one sequence slot leaves no room for a fork: each row is then its own group (the prefix cache still shares)
        key = prompt.tobytes() if manager.batch_size > 1 else i
        if key not in groups:
            groups[key] = Group(prompt, Feed(prompt[:cut], real[:0], columns[:0]), deque())
        groups[key].rows.append(feed)
    return ScoreBatch(list(groups.values()), prompts.shape[0], completions.shape[1], scale or 1.0)


def _temperature(value: Any) -> float:
    """``value`` as a finite float >= 0 (ints of any size, numpy scalars), else ValueError naming it."""
    number = None
    if not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, float, np.integer, np.floating)):
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float
            number = None
    if number is None or not (np.isfinite(number) and number >= 0):
        big = isinstance(value, int) and value.bit_length() >= 64
        shown = f"an int of {value.bit_length()} bits" if big else repr(value)
        raise ValueError(f"temperature={shown} must be a finite float >= 0 (0 and 1: the logits as they are)")
    return number


def _host(tokens: Any) -> Any:
    return jax.device_get(tokens) if isinstance(tokens, jax.Array) else tokens


def _check_room(manager: PageManager, row: int, tokens: int) -> None:
    meta = manager.metadata
    pages = -(-tokens // meta.page_size)
    per_sequence = -(-meta.max_sequences // meta.page_size)
    # a sliding group holds a window's pages, whatever the length: the full-attention groups bound a sequence
    full = [int(g.num_pages or 0) for g in meta.groups if g.window is None]  # sized groups: never None here
    pool = min(full) // meta.page_shards if full else pages
    if tokens > meta.max_sequences or pages > pool:
        limit, what = (per_sequence, f"a sequence holds at most max_length={meta.max_sequences} tokens") if (
            tokens > meta.max_sequences) else (pool, f"the pool holds {pool} pages")
        raise CacheFullError(f"row {row} needs {tokens} tokens in one sequence ({pages} pages of {meta.page_size}) to "
                             f"score its completion, but {what}; score shorter completions or create the engine "
                             "with a larger max_length / num_pages", resource="pages", needed=pages, available=limit)


# ---- the jitted step: the log-probability of each fed token's target ----------------------------------
def _score(graphdef: Any, state: Any, cache: Any, tokens: jax.Array, targets: jax.Array, metadata: Any,
           temperature: jax.Array) -> tuple[jax.Array, Any]:  # fmt: skip
    """``(log p(targets[t] | tokens up to t), cache)`` ``(padded_len,)`` float32, Tunix's arithmetic
    (``logits / temperature`` in the model's dtype, then a float32 log-softmax)."""
    logits, cache = forward(nnx.merge(graphdef, state), cache, tokens, metadata)
    logits = logits / temperature.astype(logits.dtype)
    picked = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0].astype(jnp.float32)
    return picked - jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1), cache


def padded_rows(n: int, batch_size: int) -> int:
    """A step's ``n`` sequence rows padded to a power of two (at least 4, at most ``batch_size``): few shapes, so
    few compilations (the engine's prefill and decode steps and the scorer's)."""
    return min(max(4, 1 << (n - 1).bit_length()), batch_size)


def compiled_score(graphdef: Any) -> Callable[..., tuple[jax.Array, Any]]:
    """The scoring step of one model structure, jitted (the cache donated)."""
    return jax.jit(partial(_score, graphdef), donate_argnums=1)


__all__ = ["Feed", "Group", "ScoreBatch", "check_request", "compiled_score", "padded_rows"]
