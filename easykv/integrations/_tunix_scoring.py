"""Scoring completions over pages (`TunixPagedEngine.score`): the per-token log-probabilities of given
completions under the engine's model, with the shape, masking and padding of Tunix's
``compute_per_token_logps``, where each distinct prompt is computed once.

How: the rows of one prompt form a group. Its leader sequence takes the prompt's cached prefix (device,
host tier, shared store) and prefills the rest of the prompt but its last token; then one fork per
completion feeds the prompt's last token and the completion but its last token, so the logits at each
fed token give the log-probability of the next completion token. Every step packs up to
``score_tokens`` tokens of running sequences (forks first, then leaders) and admits new forks and
groups while sequence slots and pages allow, so a batch larger than the cache is scored in waves; a
finished fork is released at once (its full pages stay findable as any prefix), a leader once its last
fork exists. One jitted program per step shape; the log-probabilities stay on the device until one
gather at the end, so no step waits on the host.

Tunix's conventions: a token equal to ``pad_id`` is padding wherever it sits, in the prompt or the
completion: Tunix masks it from attention and positions, and so does easykv, which never feeds it.
Each other completion token gets its log-probability given the real tokens before it, and a padding
position gets 0 (Tunix's loss masks exactly those: ``completion != pad_id``). This is Tunix's value for
every token but one after a pad inside a completion (not the right padding rollouts add): Tunix reads
that token's logits off the pad's own query, a value of the padding, not of the model's distribution.
``temperature`` divides the logits as Tunix's does (0 and 1: not at all).

Private to the Tunix integration; imports flax, jax and easykv's manager, runner and step.
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
from easykv.runner import Runner
from easykv.validation import integer, integer_array


@dataclasses.dataclass(eq=False)  # one object per sequence: compared by identity
class _Feed:
    """One sequence the scorer feeds: a group's leader (the prompt but its last token) or a completion's
    fork (the prompt's last token, then the completion but its last token)."""

    tokens: np.ndarray
    targets: np.ndarray | None = None  # a fork's completion: what each fed token predicts; None: a leader
    columns: np.ndarray | None = None  # a fork's output columns of its targets (its completion's non-pad ones)
    row: int = -1  # the output row of a fork; -1: a leader
    seq: int = -1
    fed: int = 0

    @property
    def left(self) -> int:
        return self.tokens.size - self.fed


@dataclasses.dataclass(eq=False)
class _Group:
    """The rows of one distinct prompt: its leader, and the forks still to make."""

    prompt: np.ndarray
    forks: deque[_Feed]
    leader: _Feed = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.leader = _Feed(self.prompt[:-1])


@dataclasses.dataclass(frozen=True)
class ScoreBatch:
    """A checked scoring request: the groups to run, the output shape and where each fork's log-probabilities go."""

    groups: list[_Group]
    rows: int
    width: int
    temperature: float


def check_request(prompt_tokens: Any, completion_tokens: Any, *, pad_id: Any, eos_id: Any, temperature: Any,
                  vocab: int, manager: PageManager) -> ScoreBatch:  # fmt: skip
    """The request checked whole before anything changes (ValueError, or CacheFullError naming the pages for a
    row no sequence of the cache can hold), as a `ScoreBatch`."""
    pad = integer("pad_id", pad_id, lo=0, hi=vocab - 1, hint="a token id of the model's vocabulary")
    integer("eos_id", eos_id, lo=0, hi=vocab - 1, hint="a token id of the model's vocabulary")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating)) or not (
            np.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature!r} must be a float >= 0 (0 and 1: the logits as they are)")
    hint = f"token ids of the model's vocabulary of {vocab}"
    prompts = integer_array("prompt_tokens", _host(prompt_tokens), ndim=2, lo=0, hi=vocab - 1, hint=hint)
    completions = integer_array("completion_tokens", _host(completion_tokens), ndim=2, lo=0, hi=vocab - 1, hint=hint)
    if prompts.shape[0] != completions.shape[0] or prompts.shape[0] == 0:
        raise ValueError(f"prompt_tokens {prompts.shape} and completion_tokens {completions.shape} must have the same "
                         "number of rows, at least one: row i of each is one prompt and its completion")
    groups: dict[bytes, _Group] = {}
    for i, (row, completion) in enumerate(zip(prompts, completions)):
        prompt = row[row != pad]
        if prompt.size == 0:
            raise ValueError(f"prompt_tokens[{i}] holds only the pad id {pad}; every completion needs a prompt")
        columns = np.flatnonzero(completion != pad)
        if columns.size:
            _check_room(manager, i, prompt.size - 1 + columns.size)
            real = completion[columns]
            fork = _Feed(np.concatenate([prompt[-1:], real[:-1]]), real, columns, row=i)
            groups.setdefault(prompt.tobytes(), _Group(prompt, deque())).forks.append(fork)
    return ScoreBatch(list(groups.values()), prompts.shape[0], completions.shape[1], float(temperature) or 1.0)


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


def compiled_score(graphdef: Any) -> Callable[..., tuple[jax.Array, Any]]:
    """The scoring step of one model structure, jitted (the cache donated)."""
    return jax.jit(partial(_score, graphdef), donate_argnums=1)


# ---- the loop ------------------------------------------------------------------------------------
class Scorer:
    """Runs one `ScoreBatch` (module doc) on an engine's manager and runner.

    Args:
      manager: the engine's manager.
      runner: its runner.
      step: ``step(tokens, targets, temperature, cache, plan) -> (cache, logp)``: the runner's step.
      budget: tokens per step."""

    def __init__(self, manager: PageManager, runner: Runner, step: Callable[..., tuple[Any, jax.Array]],
                 budget: int) -> None:  # fmt: skip
        self.manager, self.runner, self.step, self.budget = manager, runner, step, budget
        self.outputs: list[jax.Array] = []  # each step's (budget,) log-probabilities, on the device
        self.where: list[tuple[int, np.ndarray, int, int]] = []  # (row, columns, step, offset) of each fed run

    def run(self, batch: ScoreBatch) -> jax.Array:
        pending, ready = deque(batch.groups), deque[_Group]()
        prefilling: list[_Group] = []
        forks: list[_Feed] = []
        try:
            while pending or prefilling or ready or forks:
                feeds = self._continue(forks + [g.leader for g in prefilling])
                self._admit(feeds, pending, prefilling, ready, forks)
                if feeds:
                    self._run_step(feeds, batch.temperature)
                forks[:] = [f for f in forks if not self._finished(f)]
                for group in [g for g in prefilling if g.leader.left == 0]:
                    prefilling.remove(group)
                    ready.append(group)
        finally:
            for group in list(prefilling) + list(ready):
                self._release(group.leader)
            for feed in forks:
                self._release(feed)
        return self._gather(batch)

    def _continue(self, running: list[_Feed]) -> list[tuple[_Feed, int]]:
        feeds, budget = [], self.budget
        for feed in running:
            n = min(feed.left, budget)
            if n:
                feeds.append((feed, n))
                budget -= n
        return feeds

    def _admit(self, feeds: list[tuple[_Feed, int]], pending: deque[_Group], prefilling: list[_Group],
               ready: deque[_Group], forks: list[_Feed]) -> None:  # fmt: skip
        """New forks of prefilled prompts, then new prompts, while the step has tokens left, a sequence slot is
        free and the pages they will need are (a conservative count: nothing runs short mid-way)."""
        mgr = self.manager
        budget = self.budget - sum(n for _, n in feeds)
        held = sum(self._need(f.left) for f in forks) + sum(self._need(g.leader.left) for g in prefilling)
        room = min(g.free_pages + g.cached_pages for g in mgr.metrics.groups)  # what the running ones may take
        while budget > 0 and len(mgr.active_ids) < mgr.batch_size:
            if ready:
                group = ready[0]
                if held and held + self._need(group.forks[0].tokens.size) > room:
                    return
                feed = group.forks.popleft()
                feed.seq = self._fork(group.leader)
                forks.append(feed)
                if not group.forks:
                    ready.popleft()
                    self._release(group.leader)
            elif pending:
                group = pending[0]
                if held and held + self._need(group.prompt.size) > room:
                    return
                pending.popleft()
                leader = group.leader
                leader.seq = mgr.claim(1)[0]
                prefilling.append(group)  # from here on `run` releases it, whatever fails
                leader.fed = min(self.runner.match_prefix(leader.seq, group.prompt.tolist()), leader.tokens.size)
                if not leader.left:  # a one-token prompt, or all of it cached: its forks can start
                    prefilling.remove(group)
                    ready.append(group)
                feed = leader
            else:
                return
            n = min(feed.left, budget)
            if n:
                feeds.append((feed, n))
                budget -= n
            held += self._need(feed.left)

    def _fork(self, leader: _Feed) -> int:
        child = self.manager.fork(leader.seq)
        assert isinstance(child, int)  # fork(seq) returns one id
        return child

    def _need(self, tokens: int) -> int:
        return -(-tokens // self.manager.page_size) + 1  # + a copy-on-write copy of a shared partial page

    def _run_step(self, feeds: list[tuple[_Feed, int]], temperature: float) -> None:
        mgr, budget = self.manager, self.budget
        tokens, targets = np.zeros(budget, np.int32), np.zeros(budget, np.int32)
        chunks, offset = [], 0
        for feed, n in feeds:
            chunk = feed.tokens[feed.fed : feed.fed + n]
            tokens[offset : offset + n] = chunk
            if feed.targets is not None and feed.columns is not None:  # a fork: fed token t predicts target t
                targets[offset : offset + n] = feed.targets[feed.fed : feed.fed + n]
                self.where.append((feed.row, feed.columns[feed.fed : feed.fed + n], len(self.outputs), offset))
            chunks.append(chunk)
            offset += n
        pad_seqs = min(max(4, 1 << (len(feeds) - 1).bit_length()), mgr.batch_size)
        plan = mgr.schedule([f.seq for f, _ in feeds], [n for _, n in feeds], pad_tokens_to=budget,
                            pad_seqs_to=pad_seqs)
        step = partial(self.step, jnp.asarray(tokens), jnp.asarray(targets), jnp.float32(temperature))
        self.outputs.append(self.runner.run(plan, step, token_ids=chunks))
        for feed, n in feeds:
            feed.fed += n

    def _finished(self, feed: _Feed) -> bool:
        if feed.left:
            return False
        self._release(feed)
        return True

    def _release(self, feed: _Feed) -> None:
        if feed.seq >= 0 and self.manager.contains(feed.seq):
            self.manager.release(feed.seq)
        feed.seq = -1

    def _gather(self, batch: ScoreBatch) -> jax.Array:
        """The ``(rows, width)`` float32 output: one gather from every step's log-probabilities (0 at padding)."""
        index = np.full((batch.rows, batch.width), -1, np.int64)
        for row, columns, step, offset in self.where:
            index[row, columns] = step * self.budget + offset + np.arange(columns.size)
        if not self.outputs:
            return jnp.zeros((batch.rows, batch.width), jnp.float32)
        flat = jnp.concatenate(self.outputs)
        return jnp.where(jnp.asarray(index >= 0), flat[jnp.asarray(np.maximum(index, 0))], 0.0)


__all__ = ["ScoreBatch", "Scorer", "check_request", "compiled_score"]
