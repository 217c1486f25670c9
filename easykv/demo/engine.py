"""The engine loop behind `easykv demo`: continuous batching over the paged cache.

Each step the scheduler takes the running decodes (one token each) and fills the rest of a
fixed token budget with prefill chunks of waiting prompts; the page manager schedules the step
(`PageManager.schedule`: pages reserved, a frozen plan of the step's metadata and device work);
the engine's `easykv.Runner` carries the plan out: pending copy-on-write copies, then one jitted
call that writes and attends for all layers, then the commit of the written tokens (which enters
full pages into the prefix cache), or the abort of the plan when anything failed, so every
sequence stays usable. Requests arrive over time, finish, and free their pages.

Sampling is greedy, except that a forked request (parallel sampling) takes the second most
likely token at its first step and then follows greedily, so the fork diverges from its parent
through a copy-on-write of their shared last page.

With ``decode_steps=k > 1``, a step that schedules only decodes runs up to ``k`` of them in one
device loop (`PageManager.schedule_decode` plans them at once, sampling happens on the device)
and returns to the host once; a request stops inside the loop at its ``max_new_tokens``.

With a shared prefix store (``store=``, an `easykv.tiers.store.PrefixStore`, over the host tier), a request's
prompt pages are read from the store when it arrives and the pages each step fills are written to it.

With a host-memory tier (``host=``, an `easykv.HostTier`), a step whose pages do not fit
preempts: the running request that arrived last is swapped out to host memory and swapped back
in, ahead of new requests, once its pages fit again; it continues where it stopped (no prefill
is repeated).

`DenseEngine`, the baseline the benchmark compares with, shares the scheduler (`BatchingEngine`)
but runs each step over dense per-request rows, without pages, plans or a runner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Self

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from easykv.demo.model import CompiledModel
from easykv.errors import CacheFullError, InvariantError
from easykv.manager.manager import PageManager
from easykv.manager.step_plan import StepPlan
from easykv.quantization import CompressingQuantizer
from easykv.runner import Runner
from easykv.step.loop import DecodeOutput
from easykv.step.metadata import PAD_POSITION
from easykv.storage.cache import PagedAttentionCache
from easykv.tiers.host import HostTier
from easykv.tiers.store.prefix_store import PrefixStore


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

    @property
    def seq_id(self) -> int:
        """``seq``, once the engine admitted the request (InvariantError before: an engine bug)."""
        if self.seq is None:
            raise InvariantError(f"request {self.rid} has no sequence yet", where="demo engine")
        return self.seq


@dataclasses.dataclass
class StepRecord:
    step: int
    tokens: int
    running: int
    used_pages: int
    cached_pages: int
    group_pages: tuple[int, ...] = ()  # pages in use per layer group


# One step's work: each scheduled request with the token ids it writes this step.
Batch = list[tuple[Request, list[int]]]


class BatchingEngine:
    """The continuous-batching scheduler both engines share: admission (forks at their fork
    points, swapped-out requests first), the step's batch (decodes, then prefill chunks within the
    token budget), sampling and the requests' bookkeeping. How a step runs is the subclass's
    (`_forward`; `_decode_loop` for several decode steps at once).

    Args:
      model: the compiled demo model.
      manager: the `PageManager` whose sequence slots the requests take.
      token_budget: tokens per step (decodes and prefill chunks together).
      max_seqs: sequences per step, at most ``token_budget``.
      prefill_chunk: the most prompt tokens of one request per step, at most ``token_budget``.
      decode_steps: decode steps per device loop (1: back to the host after every token).
    """

    def __init__(self, model: CompiledModel, manager: PageManager, *, token_budget: int, max_seqs: int,
                 prefill_chunk: int, decode_steps: int = 1) -> None:  # fmt: skip
        if prefill_chunk > token_budget:
            raise ValueError(f"prefill_chunk={prefill_chunk} exceeds token_budget={token_budget}")
        if max_seqs > token_budget:
            raise ValueError(f"max_seqs={max_seqs} exceeds token_budget={token_budget}: one decode token each must fit")
        if not isinstance(decode_steps, int) or isinstance(decode_steps, bool) or decode_steps < 1:
            raise ValueError(f"decode_steps={decode_steps!r} must be an int >= 1 (decode steps per device loop)")
        self.model = model
        self._manager = manager
        self.decode_steps = decode_steps
        self.token_budget, self.max_seqs, self.prefill_chunk = token_budget, max_seqs, prefill_chunk
        self.step_index = 0
        self.history: list[StepRecord] = []

    @property
    def manager(self) -> PageManager:
        """The `PageManager` the requests' sequences live in."""
        return self._manager

    def run(self, requests: list[Request], *, until_step: int | None = None,
            on_step: Callable[[Self, list[Request]], None] | None = None) -> None:  # fmt: skip
        """Advance until every request is done (or ``until_step`` is reached)."""
        while not all(r.done for r in requests):
            if until_step is not None and self.step_index >= until_step:
                return
            self._admit(requests)
            batch = self._schedule(requests)
            if not batch and not any(r.arrival > self.step_index for r in requests if not r.done):
                # Nothing ran and nothing is still to arrive: the next step would be this one again.
                raise self._stalled(requests)
            ran = self._decode_loop(batch, self._horizon(requests, until_step)) if batch else None
            if batch and ran is None:
                self._step(batch)
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
                self.manager.swap_in(r.seq_id)
            except CacheFullError:
                break
            r.swapped = False
        waiting = [r for r in requests if r.seq is None and not r.done and r.arrival <= self.step_index]
        for r in waiting:
            if r.fork_of is None:
                continue
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
            child = self.manager.fork(parent.seq_id)
            assert isinstance(child, int)  # one child (n=None) comes as an int
            r.seq = child
            r.fed, r.cached = len(r.prompt), parent.cached
            r.output.append(_sample(parent.prompt_logits, second=True))
        pending_forks = sum(1 for r in requests if r.fork_of is not None and r.seq is None and not r.done)
        for r in (r for r in waiting if r.fork_of is None):
            if len(self.manager.slots_remaining) <= pending_forks:
                return
            r.seq = self.manager.claim(1)[0]
            r.cached = r.fed = self._match_prefix(r.seq, r.prompt)

    def _match_prefix(self, seq: int, prompt: list[int]) -> int:
        """The prompt tokens of the freshly claimed ``seq`` found cached (`PageManager.match_prefix`)."""
        return self.manager.match_prefix(seq, prompt)

    def _schedule(self, requests: list[Request]) -> Batch:
        """(request, token ids to write this step): decodes first, then prefill chunks."""
        batch: Batch = []
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

    def _horizon(self, requests: list[Request], until_step: int | None) -> int:
        """Steps a device loop may run before the host is needed: the next arrival of a request
        still to come, or ``until_step``."""
        ends = [r.arrival for r in requests if r.seq is None and not r.done and r.arrival > self.step_index]
        if until_step is not None:
            ends.append(until_step)
        return max(1, min(ends, default=self.step_index + self.decode_steps) - self.step_index)

    # ---- one step ---------------------------------------------------------------------------
    def _step(self, batch: Batch) -> None:
        """Run ``batch`` (`_forward`), then sample each request whose prompt is written."""
        batch, last = self._forward(batch)
        for (r, ids), row in zip(batch, last):
            if r.fed < len(r.prompt):
                r.fed += len(ids)
                if r.fed < len(r.prompt):
                    continue  # mid-prompt chunk: no token sampled yet
            if not r.output:
                r.prompt_logits = row
            r.output.append(_sample(row, second=False))
            self._finish_if_done(r)
        self._record(sum(len(ids) for _, ids in batch), len(batch))

    def _forward(self, batch: Batch) -> tuple[Batch, np.ndarray]:
        """Write ``batch``'s tokens and attend, all layers. Returns the batch that ran (a subclass
        may leave requests out: preempted) and each one's logits after its last token, ``(len, vocab)``."""
        raise NotImplementedError(f"{type(self).__name__} does not say how a step runs: define _forward")

    def _decode_loop(self, batch: Batch, horizon: int) -> int | None:
        """Several decode steps of ``batch`` at once: the steps run, or None (one step runs). The
        scheduler's own: always one step."""
        return None

    def _finish_if_done(self, r: Request) -> None:
        if len(r.output) >= r.max_new_tokens:
            r.done = True
            self.manager.release(r.seq_id)

    def _record(self, tokens: int, running: int) -> None:
        m = self.manager.metrics
        self.history.append(StepRecord(self.step_index, tokens, running, m.used_pages, m.cached_pages,
                                       tuple(g.used_pages for g in m.groups)))


class Engine(BatchingEngine):
    """Runs requests to completion through one model, one paged cache and one page manager: each
    step is a plan of the manager (`PageManager.schedule` / `schedule_decode`) that the engine's
    `easykv.Runner` carries out (device work, the jitted step, commit; abort on failure).

    Args:
      model, manager, token_budget, max_seqs, prefill_chunk, decode_steps: as `BatchingEngine`'s.
      cache: the live `PagedAttentionCache` of ``manager``'s pool; the engine's runner holds it
        (``engine.cache`` gives the current one).
      host: the cache's `HostTier` when the manager has a host-memory tier (the engine preempts to
        it), else None.
      store: a shared `PrefixStore` below the host tier (needs ``host``): a request's prompt pages are
        read from it when the request arrives, and the pages its steps fill are written to it.
    """

    def __init__(self, model: CompiledModel, cache: PagedAttentionCache, manager: PageManager, *,
                 token_budget: int, max_seqs: int, prefill_chunk: int, host: HostTier | None = None,
                 decode_steps: int = 1, store: PrefixStore | None = None) -> None:  # fmt: skip
        super().__init__(model, manager, token_budget=token_budget, max_seqs=max_seqs, prefill_chunk=prefill_chunk,
                         decode_steps=decode_steps)
        self.runner = Runner(manager, cache, host=host, store=store)
        self._prefetched: set[int] = set()  # requests whose prompt pages the store began reading
        self.preemptions = 0
        self._earlier_copies = 0  # pages copied by the runners `restore` replaced

    @property
    def cache(self) -> PagedAttentionCache:
        """The live cache, as the last step left it."""
        return self.runner.cache

    @property
    def host(self) -> HostTier | None:
        """The cache's `HostTier`, or None without a host-memory tier."""
        return self.runner.host

    @property
    def copies(self) -> int:
        """Device pages copied (copy-on-write) so far."""
        return self._earlier_copies + self.runner.copies

    def restore(self, cache: PagedAttentionCache, manager: PageManager, *, host: HostTier | None = None) -> None:
        """Go on with ``cache`` and ``manager`` (a restored checkpoint: the requests' sequences are
        in it). Checked as the constructor checks (`easykv.Runner`); nothing changes on a refusal.

        Args:
          cache: a live cache of ``manager``'s pool.
          manager: the restored `PageManager`.
          host: the cache's `HostTier` when ``manager`` has a host-memory tier, else None."""
        store = self.runner.store
        if store is not None:  # it serves the restored manager from now on
            store.detach()
        try:
            runner = Runner(manager, cache, host=host, store=store)
        except BaseException:
            if store is not None:
                store.attach(self.runner.manager, self.runner.host)
            raise
        self._earlier_copies += self.runner.copies
        self.runner, self._manager = runner, manager

    # ---- admission --------------------------------------------------------------------------
    def _admit(self, requests: list[Request]) -> None:
        """`BatchingEngine._admit`, each arrived request's prompt pages first asked of the shared store (read in
        the background while the steps before its admission run)."""
        if self.runner.store is not None:
            for r in requests:
                if r.arrival <= self.step_index and r.rid not in self._prefetched and r.fork_of is None:
                    self._prefetched.add(r.rid)
                    self.runner.prefetch(r.prompt)
        super()._admit(requests)

    def _match_prefix(self, seq: int, prompt: list[int]) -> int:
        """The prompt tokens found cached on the device, in the host tier or in the shared store."""
        return self.runner.match_prefix(seq, prompt)

    # ---- one step ---------------------------------------------------------------------------
    def _forward(self, batch: Batch) -> tuple[Batch, np.ndarray]:
        """The batch's plan (preempting while it does not fit), carried out by the runner."""
        plan, batch = self._plan(batch)
        flat = [t for _, ids in batch for t in ids]
        tokens = np.zeros(self.token_budget, np.int32)
        tokens[: len(flat)] = flat

        def step(cache: PagedAttentionCache, plan: StepPlan) -> tuple[PagedAttentionCache, np.ndarray]:
            if not np.all((plan.metadata[0].positions != PAD_POSITION)[: len(flat)]):  # one per group: same positions
                raise InvariantError("a scheduled token got a padding position", where="demo engine")
            logits, cache = self.model.paged_step(cache, jnp.asarray(tokens), plan.metadata)
            return cache, _last_rows(logits, batch)

        return batch, self.runner.run(plan, step, token_ids=[ids for _, ids in batch])

    def _plan(self, batch: Batch) -> tuple[StepPlan, Batch]:
        """The step's plan; while its pages do not fit and a host tier can take a request, the
        running request that arrived last is swapped out (preempted) and left out of the step."""
        while True:
            try:
                plan = self.manager.schedule([r.seq_id for r, _ in batch], [len(ids) for _, ids in batch],
                                             pad_tokens_to=self.token_budget, pad_seqs_to=self.max_seqs)
                return plan, batch
            except CacheFullError:
                if self.host is None or len(batch) == 1:
                    raise
            victim = max(batch, key=lambda item: (item[0].arrival, item[0].rid))[0]
            self.runner.apply_pending()  # its pages complete first
            self.manager.swap_out(victim.seq_id)
            victim.swapped = True
            self.preemptions += 1
            batch = [item for item in batch if item[0] is not victim]

    def _decode_loop(self, batch: Batch, horizon: int) -> int | None:
        """With ``decode_steps > 1`` and only decodes scheduled: up to ``decode_steps`` steps of
        them in one device loop (`PageManager.schedule_decode`, `CompiledModel.paged_decode`),
        each request stopping at its ``max_new_tokens``. Returns the steps run; None when this step
        is not all decodes or the plan does not fit (the one-step path runs it, preempting).
        ``horizon``: no request samples more tokens than this (an arrival is due then)."""
        if self.decode_steps == 1 or any(r.fed < len(r.prompt) for r, _ in batch):
            return None
        k = self.decode_steps
        most = [min(k, horizon, r.max_new_tokens - len(r.output)) for r, _ in batch]
        try:
            plan = self.manager.schedule_decode([r.seq_id for r, _ in batch], k, max_tokens=most,
                                                pad_seqs_to=self.max_seqs)
        except CacheFullError:
            return None
        tokens = np.zeros(self.max_seqs, np.int32)
        tokens[: len(batch)] = [ids[0] for _, ids in batch]

        def loop(cache: PagedAttentionCache, plan: StepPlan) -> tuple[PagedAttentionCache, DecodeOutput]:
            out = self.model.paged_decode(cache, jnp.asarray(tokens), plan, jnp.asarray(plan.limits))
            return out.state, jax.device_get(out._replace(state=None))  # on the host, the cache left out

        out = self.runner.run(plan, loop, token_ids=lambda out: out.written, num_tokens=lambda out: out.num_written)
        for i, (r, _) in enumerate(batch):
            r.output.extend(out.sampled[i, : out.num_written[i]].tolist())
            self._finish_if_done(r)
        self._record(int(out.num_written.sum()), len(batch))
        return int(out.steps)


class DenseEngine(BatchingEngine):
    """The baseline: the same scheduler, but every request owns a dense cache row preallocated
    at ``max_len`` tokens and attends over all of it. ``cache`` is (keys, values), each
    (layers, rows, max_len, kv_heads, head_dim), a row per sequence slot of ``manager`` (which
    only hands out the slots: no pages are reserved, no plan is made). No forks (a fork would copy
    a whole row), one step per device call.

    Args:
      model, manager, token_budget, max_seqs, prefill_chunk: as `BatchingEngine`'s.
      cache: the dense (keys, values); donated at each step (``engine.cache`` is the current one).
    """

    def __init__(self, model: CompiledModel, cache: tuple[jax.Array, jax.Array], manager: PageManager, *,
                 token_budget: int, max_seqs: int, prefill_chunk: int) -> None:  # fmt: skip
        keys, values = cache
        if keys.shape != values.shape or keys.ndim != 5 or keys.shape[1] < manager.batch_size:
            raise ValueError(f"the dense cache holds keys {keys.shape} and values {values.shape}; both must be "
                             f"(layers, rows, max_len, kv_heads, head_dim) with rows >= the manager's "
                             f"batch_size={manager.batch_size} (one row per sequence slot)")
        super().__init__(model, manager, token_budget=token_budget, max_seqs=max_seqs, prefill_chunk=prefill_chunk)
        self.cache = (keys, values)

    def run(self, requests: list[Request], *, until_step: int | None = None,
            on_step: Callable[[Self, list[Request]], None] | None = None) -> None:  # fmt: skip
        """`BatchingEngine.run`; a fork is refused before anything runs."""
        forks = [r.rid for r in requests if r.fork_of is not None]
        if forks:
            raise ValueError(f"requests {forks} are forks, which the dense baseline does not run (a fork would copy a "
                             "whole dense row); make the requests with fork=False, or run them on Engine")
        super().run(requests, until_step=until_step, on_step=on_step)

    def _forward(self, batch: Batch) -> tuple[Batch, np.ndarray]:
        """One dense step: each token written into its sequence's row at its position (the tokens
        the request wrote before it: its prompt chunks, then its prompt and outputs but the last)."""
        max_len = self.cache[0].shape[2]
        rows = np.zeros(self.token_budget, np.int32)
        positions = np.full(self.token_budget, PAD_POSITION, np.int32)
        tokens = np.zeros(self.token_budget, np.int32)
        at = 0
        for r, ids in batch:
            start = r.fed if r.fed < len(r.prompt) else len(r.prompt) + len(r.output) - 1
            if start + len(ids) > max_len:
                raise ValueError(f"request {r.rid} reaches position {start + len(ids) - 1} but the dense cache holds "
                                 f"max_len={max_len} tokens per row; make the cache rows longer")
            rows[at : at + len(ids)] = r.seq_id
            positions[at : at + len(ids)] = np.arange(start, start + len(ids))
            tokens[at : at + len(ids)] = ids
            at += len(ids)
        keys, values = self.cache
        logits, keys, values = self.model.dense_batch_step(keys, values, jnp.asarray(tokens), jnp.asarray(rows),
                                                           jnp.asarray(positions))
        self.cache = (keys, values)
        return batch, _last_rows(logits, batch)


def _last_rows(logits: jax.Array, batch: Batch) -> np.ndarray:
    """Each request's logits after its last token this step, on the host: ``(len(batch), vocab)``."""
    ends = np.cumsum([len(ids) for _, ids in batch]) - 1
    return np.asarray(jax.device_get(_rows(logits, jnp.asarray(ends))))


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


def reference_generate(model: CompiledModel, request: Request, *, max_len: int, dtype: DTypeLike,
                       quantizer: CompressingQuantizer | None = None) -> list[int]:  # fmt: skip
    """The same request generated with a plain dense per-request cache, one token per call."""
    return [choice for choice, _ in _reference_steps(model, request, max_len=max_len, dtype=dtype,
                                                     quantizer=quantizer)]


def reference_disagreements(model: CompiledModel, request: Request, *, max_len: int, dtype: DTypeLike,
                            quantizer: CompressingQuantizer | None = None,
                            near_tie: float = NEAR_TIE) -> list[int]:  # fmt: skip
    """The steps at which the engine's token (``request.output``) is not the dense reference's
    choice given the same history (the reference is fed the engine's tokens) and trails it in
    the reference's logits by more than ``near_tie``; a missing or extra token counts as one."""
    out = list(request.output)
    steps = _reference_steps(model, request, max_len=max_len, dtype=dtype, quantizer=quantizer, forced=out)
    wrong = [i for i, ((choice, row), token) in enumerate(zip(steps, out))
             if token != choice and not row[choice] - row[token] <= near_tie]
    return wrong + ([min(len(out), len(steps))] if len(out) != len(steps) else [])


def _reference_steps(model: CompiledModel, request: Request, *, max_len: int, dtype: DTypeLike,
                     quantizer: CompressingQuantizer | None,
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
    if row is None:
        raise ValueError(f"request {request.rid} has an empty prompt; the reference starts from one token at least")
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
