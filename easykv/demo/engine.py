"""The engine loop behind `easykv demo`: continuous batching over the paged cache.

Each step the scheduler takes the running decodes (one token each) and fills the rest of a
fixed token budget with prefill chunks of waiting prompts; the page manager reserves pages and
builds the step's mixed metadata; pending copy-on-write copies are applied; one jitted call
writes and attends for all layers; the sampled tokens are committed to the manager (which enters
full pages into the prefix cache). Requests arrive over time, finish, and free their pages.

Sampling is greedy, except that a forked request (parallel sampling) takes the second most
likely token at its first step and then follows greedily, so the fork diverges from its parent
through a copy-on-write of their shared last page.

With ``decode_steps=k > 1``, a step that schedules only decodes runs up to ``k`` of them in one
device loop (the manager plans them at once, sampling happens on the device) and returns to the
host once; a request stops inside the loop at its ``max_new_tokens``.

With a host-memory tier (``host=``, an `easykv.HostTier`), a step whose pages do not fit
preempts: the running request that arrived last is swapped out to host memory and swapped back
in, ahead of new requests, once its pages fit again; it continues where it stopped (no prefill
is repeated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from easykv.demo.model import CompiledModel
from easykv.errors import CacheFullError, InvariantError
from easykv.manager.manager import PageManager
from easykv.step.metadata import PAD_POSITION
from easykv.storage.cache import PagedAttentionCache


@dataclasses.dataclass
class Request:
    """A generation request: ``prompt`` token ids, ``max_new_tokens`` to generate, the step it
    arrives at, and optionally ``fork_of`` (a request id whose prompt it shares and whose
    sequence it forks right after the parent's prefill)."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0
    fork_of: int | None = None
    # filled in by the engine
    seq: int | None = None
    cached: int = 0  # prompt tokens found in the prefix cache (no prefill)
    fed: int = 0  # prompt tokens written so far (cached ones included)
    output: list[int] = dataclasses.field(default_factory=list)
    done: bool = False
    swapped: bool = False  # preempted to the host tier
    prompt_logits: np.ndarray | None = None  # logits after the last prompt token (for forks)


@dataclasses.dataclass
class StepRecord:
    step: int
    tokens: int
    running: int
    used_pages: int
    cached_pages: int
    group_pages: tuple[int, ...] = ()  # pages in use per layer group


class Engine:
    """Runs requests to completion through one model, one paged cache and one page manager."""

    def __init__(self, model: CompiledModel, cache: PagedAttentionCache, manager: PageManager, *,
                 token_budget: int, max_seqs: int, prefill_chunk: int, host: Any = None,
                 decode_steps: int = 1) -> None:  # fmt: skip
        if prefill_chunk > token_budget:
            raise ValueError(f"prefill_chunk={prefill_chunk} exceeds token_budget={token_budget}")
        if max_seqs > token_budget:
            raise ValueError(f"max_seqs={max_seqs} exceeds token_budget={token_budget}: one decode token each must fit")
        if not isinstance(decode_steps, int) or isinstance(decode_steps, bool) or decode_steps < 1:
            raise ValueError(f"decode_steps={decode_steps!r} must be an int >= 1 (decode steps per device loop)")
        self.model, self.cache, self.manager = model, cache, manager
        self.decode_steps = decode_steps
        self.token_budget, self.max_seqs, self.prefill_chunk = token_budget, max_seqs, prefill_chunk
        self.step_index = 0
        self.history: list[StepRecord] = []
        self.copies = 0
        self.host = host
        self.preemptions = 0

    def run(self, requests: list[Request], *, until_step: int | None = None,
            on_step: Callable[[Engine, list[Request]], None] | None = None) -> None:  # fmt: skip
        """Advance until every request is done (or ``until_step`` is reached)."""
        while not all(r.done for r in requests):
            if until_step is not None and self.step_index >= until_step:
                return
            self._admit(requests)
            batch = self._schedule(requests)
            if not batch and not any(r.arrival > self.step_index for r in requests if not r.done):
                # Nothing ran and nothing is still to arrive: the next step would be this one again.
                raise self._stalled(requests)
            ran = self._decode_steps(batch, self._horizon(requests, until_step)) if batch else None
            if batch and ran is None:
                self._step(batch, requests)
            self.step_index += ran or 1
            if on_step is not None:
                on_step(self, requests)

    def _stalled(self, requests: list[Request]) -> CacheFullError:
        """Every request has arrived, none is running and none can be admitted: nothing will change."""
        waiting = [r.rid for r in requests if not r.done]
        forks = sum(1 for r in requests if r.fork_of is not None and r.seq is None and not r.done)
        swapped = [r.rid for r in requests if r.swapped]
        free = len(self.manager.slots_remaining)
        return CacheFullError(
            f"requests {waiting} can never run: step {self.step_index} scheduled nothing and no request is still to "
            f"arrive ({free} of max_seqs={self.max_seqs} sequence slots free, {forks} kept for forks still to come"
            + (f", requests {swapped} swapped out waiting for pages" if swapped else "")
            + "); give the engine more sequence slots (max_seqs) or pages",
            resource="sequence slots", needed=forks + 1, available=free)

    # ---- scheduling -------------------------------------------------------------------------
    def _admit(self, requests: list[Request]) -> None:
        """Forks first (each at its parent's fork point), then new requests while sequence
        slots remain, keeping one slot free for every fork still to come so that no fork can
        miss its point."""
        by_id = {r.rid: r for r in requests}
        for r in (r for r in requests if r.swapped):  # preempted ones first, in arrival order
            try:
                self.manager.swap_in(r.seq)
            except CacheFullError:
                break
            r.swapped = False
        waiting = [r for r in requests if r.seq is None and not r.done and r.arrival <= self.step_index]
        for r in (r for r in waiting if r.fork_of is not None):
            parent = by_id[r.fork_of]
            if parent.swapped:
                continue  # forks once its parent is back
            # Fork right after the parent's prompt is written (its first sampled token is not
            # written yet): both share the prompt's pages, the child starts from the parent's
            # prompt logits with the second most likely token.
            if parent.prompt_logits is None:
                continue
            if len(parent.output) != 1 or parent.done:
                raise InvariantError(f"request {r.rid} missed its fork point (parent {parent.rid})",
                                     where="demo engine")
            r.seq = self.manager.fork(parent.seq)
            r.fed, r.cached = len(r.prompt), parent.cached
            r.output.append(_sample(parent.prompt_logits, second=True))
        pending_forks = sum(1 for r in requests if r.fork_of is not None and r.seq is None and not r.done)
        for r in (r for r in waiting if r.fork_of is None):
            if len(self.manager.slots_remaining) <= pending_forks:
                return
            r.seq = self.manager.claim(1)[0]
            r.cached = r.fed = self.manager.match_prefix(r.seq, r.prompt)

    def _schedule(self, requests: list[Request]) -> list[tuple[Request, list[int]]]:
        """(request, token ids to write this step): decodes first, then prefill chunks."""
        batch: list[tuple[Request, list[int]]] = []
        budget = self.token_budget
        for r in requests:
            if r.seq is not None and not r.done and not r.swapped and r.fed >= len(r.prompt) and r.output:
                batch.append((r, [r.output[-1]]))
                budget -= 1
        for r in requests:
            if len(batch) >= self.max_seqs or budget <= 0:
                break
            if r.seq is not None and not r.done and not r.swapped and r.fed < len(r.prompt):
                n = min(self.prefill_chunk, budget, len(r.prompt) - r.fed)
                batch.append((r, r.prompt[r.fed : r.fed + n]))
                budget -= n
        return batch[: self.max_seqs]

    # ---- one device step --------------------------------------------------------------------
    def _step(self, batch: list[tuple[Request, list[int]]], requests: list[Request]) -> None:
        mgr = self.manager
        while True:
            seqs = [r.seq for r, _ in batch]
            counts = [len(t) for _, t in batch]
            try:
                meta = mgr.build_step_metadata(seqs, counts, pad_tokens_to=self.token_budget, pad_seqs_to=self.max_seqs)
                break
            except CacheFullError:
                if self.host is None or len(batch) == 1:
                    raise
                victim = max(batch, key=lambda item: (item[0].arrival, item[0].rid))[0]
                self.cache, copied = mgr.apply_pending(self.cache, host=self.host)  # its pages complete first
                self.copies += copied
                mgr.swap_out(victim.seq)
                victim.swapped = True
                self.preemptions += 1
                batch = [item for item in batch if item[0] is not victim]
        step_meta = meta[0]  # one per layer group: the same positions
        tokens = np.zeros(self.token_budget, np.int32)
        flat = [t for _, ids in batch for t in ids]
        tokens[: len(flat)] = flat
        if not np.all((step_meta.positions != PAD_POSITION)[: len(flat)]):
            raise InvariantError("a scheduled token got a padding position", where="demo engine")
        logits = self._device_step(tokens, meta, np.repeat(seqs, counts))
        ends = np.asarray(step_meta.query_start_loc[1 : len(batch) + 1]) - 1
        last = np.asarray(jax.device_get(_rows(logits, jnp.asarray(ends))))
        mgr.step(seqs, [ids for _, ids in batch])
        for (r, ids), row in zip(batch, last):
            if r.fed < len(r.prompt):
                r.fed += len(ids)
                if r.fed < len(r.prompt):
                    continue  # mid-prompt chunk: no token sampled yet
            if not r.output:
                r.prompt_logits = row
            r.output.append(_sample(row, second=False))
            if len(r.output) >= r.max_new_tokens:
                r.done = True
                mgr.release(r.seq)
        m = mgr.metrics
        self.history.append(StepRecord(self.step_index, len(flat), len(batch), m.used_pages, m.cached_pages,
                                       tuple(g.used_pages for g in m.groups)))


    def _horizon(self, requests: list[Request], until_step: int | None) -> int:
        """Steps a device loop may run before the host is needed: the next arrival of a request
        still to come, or ``until_step``."""
        ends = [r.arrival for r in requests if r.seq is None and not r.done and r.arrival > self.step_index]
        if until_step is not None:
            ends.append(until_step)
        return max(1, min(ends, default=self.step_index + self.decode_steps) - self.step_index)

    def _decode_steps(self, batch: list[tuple[Request, list[int]]], horizon: int) -> int | None:
        """With ``decode_steps > 1`` and only decodes scheduled: up to ``decode_steps`` steps of
        them in one device loop (`PageManager.plan_decode`, `CompiledModel.paged_decode`), each
        request stopping at its ``max_new_tokens``. Returns the steps run; None when this step
        is not all decodes or the plan does not fit (the one-step path runs it, preempting).
        ``horizon``: no request samples more tokens than this (an arrival is due then)."""
        if self.decode_steps == 1 or any(r.fed < len(r.prompt) for r, _ in batch):
            return None
        mgr, k = self.manager, self.decode_steps
        seqs = [r.seq for r, _ in batch]
        most = [min(k, horizon, r.max_new_tokens - len(r.output)) for r, _ in batch]
        try:
            plan = mgr.plan_decode(seqs, k, max_tokens=most, pad_seqs_to=self.max_seqs)
        except CacheFullError:
            return None
        try:
            self.cache, copied = mgr.apply_pending(self.cache, host=self.host)
            self.copies += copied
            tokens = np.zeros(self.max_seqs, np.int32)
            tokens[: len(batch)] = [ids[0] for _, ids in batch]
            out = self.model.paged_decode(self.cache, jnp.asarray(tokens), plan, jnp.asarray(plan.limits))
            self.cache = out.state
            written, sampled, counts = jax.device_get((out.written, out.sampled, out.num_written))
        except BaseException:  # the plan closes with nothing written: its sequences stay usable
            mgr.commit_decode(plan, np.zeros((plan.padded_rows, k), np.int64), np.zeros(plan.padded_rows, np.int64))
            raise
        mgr.commit_decode(plan, written, counts)
        for i, (r, _) in enumerate(batch):
            r.output.extend(sampled[i, : counts[i]].tolist())
            if len(r.output) >= r.max_new_tokens:
                r.done = True
                mgr.release(r.seq)
        m = mgr.metrics
        self.history.append(StepRecord(self.step_index, int(counts.sum()), len(batch), m.used_pages, m.cached_pages,
                                       tuple(g.used_pages for g in m.groups)))
        return int(out.steps)

    def _device_step(self, tokens: np.ndarray, meta: Any, rows: np.ndarray) -> jax.Array:
        """Apply pending copy-on-write copies, then write and attend for all layers in one jit."""
        self.cache, copied = self.manager.apply_pending(self.cache, host=self.host)
        self.copies += copied
        logits, self.cache = self.model.paged_step(self.cache, jnp.asarray(tokens), meta)
        return logits


class DenseEngine(Engine):
    """The baseline: the same scheduler, but every request owns a dense cache row preallocated
    at ``max_len`` tokens and attends over all of it. ``cache`` is (keys, values), each
    (layers, batch_size, max_len, kv_heads, head_dim). No forks (a fork would copy a whole row)."""

    def _device_step(self, tokens: np.ndarray, meta: Any, rows: np.ndarray) -> jax.Array:
        padded = np.zeros(self.token_budget, np.int32)
        padded[: rows.size] = rows
        keys, values = self.cache
        step_meta = meta[0]
        logits, keys, values = self.model.dense_batch_step(
            keys, values, jnp.asarray(tokens), jnp.asarray(padded), jnp.asarray(step_meta.positions)
        )
        self.cache = (keys, values)
        return logits


@jax.jit
def _rows(logits: jax.Array, ends: jax.Array) -> jax.Array:
    return jnp.take(logits, ends, axis=0)


def _sample(row: np.ndarray, *, second: bool) -> int:
    if second:
        return int(np.argsort(row, kind="stable")[-2])
    return int(np.argmax(row))


# How far below the reference's choice (in its own logits) the engine's token may be and still
# count as agreeing: the engine and the dense reference compute the same function in different
# float32 summation orders, and a quantized cache can turn a last-bit difference into a code
# step; a tie closer than this is a coin toss, while a wrong page read moves logits by O(0.1-1).
NEAR_TIE = 1e-3


def reference_generate(model: CompiledModel, request: Request, *, max_len: int, dtype: Any,
                       quantizer: Any = None) -> list[int]:  # fmt: skip
    """The same request generated with a plain dense per-request cache, one token per call."""
    return [choice for choice, _ in _reference_steps(model, request, max_len=max_len, dtype=dtype,
                                                     quantizer=quantizer)]


def reference_disagreements(model: CompiledModel, request: Request, *, max_len: int, dtype: Any,
                            quantizer: Any = None, near_tie: float = NEAR_TIE) -> list[int]:  # fmt: skip
    """The steps at which the engine's token (``request.output``) is not the dense reference's
    choice given the same history (the reference is fed the engine's tokens) and trails it in
    the reference's logits by more than ``near_tie``; a missing or extra token counts as one."""
    out = list(request.output)
    steps = _reference_steps(model, request, max_len=max_len, dtype=dtype, quantizer=quantizer, forced=out)
    wrong = [i for i, ((choice, row), token) in enumerate(zip(steps, out))
             if token != choice and not row[choice] - row[token] <= near_tie]
    return wrong + ([min(len(out), len(steps))] if len(out) != len(steps) else [])


def _reference_steps(model: CompiledModel, request: Request, *, max_len: int, dtype: Any, quantizer: Any,
                     forced: list[int] | None = None) -> list[tuple[int, np.ndarray]]:  # fmt: skip
    """The dense reference's (choice, logits row) before each generated token; the token fed
    back is its own choice, or ``forced[i]`` (teacher forcing) while there is one."""
    cfg = model.cfg
    keys = jnp.zeros((cfg.layers, max_len, cfg.kv_heads, cfg.head_dim), dtype)
    values = jnp.zeros_like(keys)
    row = None
    for pos, tok in enumerate(request.prompt):
        logits, keys, values = model.dense_step(keys, values, jnp.asarray([tok], jnp.int32), jnp.int32(pos), quantizer)
        row = np.asarray(logits[0])
    steps: list[tuple[int, np.ndarray]] = []
    for i in range(request.max_new_tokens):
        choice = _sample(row, second=(request.fork_of is not None and i == 0))
        steps.append((choice, row))
        if i + 1 == request.max_new_tokens or (forced is not None and i >= len(forced)):
            break
        fed = choice if forced is None else forced[i]
        pos = len(request.prompt) + i
        logits, keys, values = model.dense_step(keys, values, jnp.asarray([fed], jnp.int32), jnp.int32(pos), quantizer)
        row = np.asarray(logits[0])
    return steps
