"""Generation with a Tunix model over easykv pages (`TunixPagedEngine`): the prompts' prefixes looked
up in the prefix cache, the rest prefilled in chunks, the samples of one prompt forked from it after
its one prefill (GRPO's groups), then decode ``decode_steps`` tokens at a time in one device loop
(`PageManager.schedule_decode`, `easykv.step.loop.decode_loop`), sampling on the device. Every step
is a plan the manager schedules and the engine's `easykv.Runner` carries out (its device work, the
jitted step, the commit; the abort when anything fails). With a shared prefix store (``store=``) the
prompts' pages are read from the store (all of a call's prompts asked for at its start, taken at
admission) and the pages its steps fill are written there (``_tunix_store``). Private to the Tunix
integration; imports tunix (through ``_tunix_model``), flax and easykv's public parts.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.typing import DTypeLike

from easykv.errors import CacheFullError
from easykv.integrations._tunix_model import Family, forward, paged_copy
from easykv.integrations._tunix_scorer import Scorer
from easykv.integrations._tunix_scoring import check_request, compiled_score, padded_rows
from easykv.integrations._tunix_store import WeightsFingerprint, with_store_host_tier
from easykv.manager.manager import PageManager
from easykv.manager.step_plan import StepPlan
from easykv.quantization import Quantizer
from easykv.runner import Runner
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh
from easykv.spec.groups import AttentionKind, LayerGroup
from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.step.loop import DecodeOutput, decode_loop, greedy, log_prob
from easykv.storage.cache import PagedAttentionCache
from easykv.tiers.host import HostTier
from easykv.tiers.sleep import SleepingCache, sleep, wake
from easykv.tiers.store.arguments import check_store_arg, open_store
from easykv.tiers.store.prefix_store import PrefixStore, StoreMetrics
from easykv.validation import integer, integer_array, is_scalar, positive_int


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a token is drawn, as Tunix's ``Sampler`` draws it: greedy while ``top_p`` is None, else
    from ``softmax(logits / temperature)`` cut to the ``top_k`` most likely and to the smallest set
    whose probability reaches ``top_p``. Hashable: the device loop's static.

    Attributes:
      temperature: divides the logits when sampling, > 0 (default 1.0).
      top_p: the probability mass kept, in ``(0, 1]``; None (default): greedy.
      top_k: keep the ``top_k`` most likely tokens, an int >= 0; None (default) or 0: all.
    """

    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None

    def __post_init__(self) -> None:
        if self.top_p is None:
            return
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1], or None for greedy decoding")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"temperature={self.temperature!r} must be > 0 when sampling (top_p={self.top_p}); "
                             "set top_p=None for greedy decoding")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 0 (0 or None: no top-k cut)")

    def __call__(self, logits: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        if self.top_p is None:
            return greedy(logits, key)
        scaled = logits.astype(jnp.float32) / self.temperature
        k = scaled.shape[-1] if not self.top_k else min(self.top_k, scaled.shape[-1])
        best, index = jax.lax.top_k(scaled, k)
        probs = jax.nn.softmax(best, axis=-1)
        best = jnp.where(jnp.cumsum(probs, axis=-1) - probs > self.top_p, -jnp.inf, best)
        pick = jax.random.categorical(key, best, axis=-1)
        tokens = jnp.take_along_axis(index, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
        return tokens, log_prob(scaled, tokens)


# ---- the jitted device work: pure functions of (graphdef, state); the graphdef is closed over (Tunix's
# configs are not hashable), the state passed, so new weights reuse the compiled code -----------------
def _prefill(graphdef: Any, state: Any, cache: Any, tokens: jax.Array, metadata: Any) -> tuple[jax.Array, Any]:
    """Write one prefill step; the logits after each row's last token of the step, ``(rows, vocab)``."""
    logits, cache = forward(nnx.merge(graphdef, state), cache, tokens, metadata)
    ends = jnp.maximum(metadata[0].query_start_loc[1:] - 1, 0)
    return logits[ends], cache


@partial(jax.jit, static_argnames=("sample",))
def _sample(logits: jax.Array, key: jax.Array, *, sample: Sampling) -> tuple[jax.Array, jax.Array]:
    return sample(logits, key)


def _decode(graphdef: Any, state: Any, cache: Any, tokens: jax.Array, metadata: Any, limits: jax.Array,
            key: jax.Array, round_: jax.Array, *, num_steps: int, page_size: int, num_pages: tuple[int, ...],
            eos_id: tuple[int, ...], sample: Sampling) -> DecodeOutput:  # fmt: skip
    """The device loop of one decode round; its key is ``key`` folded with the round's number here, not on the
    host (a fold outside jit is a dispatch of its own each round)."""
    # The model is merged inside the loop's body from fresh leaves: Tunix's remat (an nnx transform)
    # refuses Variables made at an outer trace level.
    def step(c: Any, t: jax.Array, m: Any) -> tuple[jax.Array, Any]:
        return forward(nnx.merge(graphdef, jax.tree.map(lambda a: a, state)), c, t, m)

    return decode_loop(step, cache, tokens, metadata,
                       num_steps=num_steps,
                       page_size=page_size, num_pages=num_pages, limits=limits, eos_id=eos_id or None,
                       sample=sample, key=jax.random.fold_in(key, round_))


def _compiled(graphdef: Any) -> tuple[Any, Any]:
    """The prefill and decode steps of one model structure, jitted (the cache donated)."""
    prefill = jax.jit(partial(_prefill, graphdef), donate_argnums=1)
    decode = jax.jit(partial(_decode, graphdef), donate_argnums=1,
                     static_argnames=("num_steps", "page_size", "num_pages", "eos_id", "sample"))
    return prefill, decode


@dataclasses.dataclass
class _Row:
    """One prompt's sample: its sequence, the prompt tokens fed so far, what it produced."""

    prompt: np.ndarray
    limit: int  # tokens it may produce
    seq: int = -1
    fed: int = 0
    out: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    done: bool = False
    ended_by_eos: bool = False

    def take(self, tokens: list[int], logp: list[float], eos: tuple[int, ...]) -> None:
        self.out += tokens
        self.logp += logp
        if tokens and tokens[-1] in eos:
            self.done = self.ended_by_eos = True
        elif len(self.out) >= self.limit:
            self.done = True


class TunixPagedEngine:
    """A Tunix model generating over an easykv cache it owns (see the module doc).

    Args:
      model: a Tunix Qwen3, Llama3 or Gemma3, or a qwix LoRA or weight-quantized one (its classes are
        not changed: the engine runs a paged copy, `model`, sharing its parameter variables, so a
        trainer's update of the caller's model reaches the engine and `update_params` sets the caller's
        parameters too; new parameters start a new weight version of the cache).
      mesh: the cache's mesh, kv heads over its ``tp`` axis when it has one; None (default): one
        device.
      max_length: tokens a sequence may hold, prompt included (default 1024).
      batch_size: sequences the cache holds at once (default 64); prompts per `generate` at most.
      page_size: tokens per page (default 16).
      num_pages: pages per layer (per layer group); None (default): sized from
        ``hbm_utilization`` of device memory.
      hbm_utilization: the fraction of device memory the pool is sized from when ``num_pages`` is
        None (default 0.5).
      dtype: the cache's dtype; None (default): the model parameters'.
      quantizer: an easykv quantizer (name or object) for the pages; None (default): unquantized.
      decode_steps: decode steps per device loop, ``1 .. max_length`` (default 16).
      prefill_tokens: tokens per prefill step, ``1 .. 2**20`` (default 256); at most what one step of the
        cache holds (``batch_size`` sequences of ``max_length`` tokens, in whole pages).
      score_tokens: tokens per `score` step, ``1 .. 2**20`` (default 1024; a step holds this many rows of
        logits, ``score_tokens x vocab`` floats), bounded as ``prefill_tokens`` is.
      store: a shared prefix store below the cache: a URL (``file:///dir``, ``redis://host:6379/0``,
        ``gs://bucket/dir``, ...; the engine opens it and `close` closes it) with ``model_id``, or an
        `easykv.tiers.store.PrefixStore` (its policies chosen by the caller, who closes it); None
        (default): no store. Keys carry the weights' content (`weight_version`), so engines share pages
        exactly while their weights agree.
      model_id: with a store URL, the model's name and revision (e.g. ``"Qwen/Qwen3-0.6B@main"``): its
        architecture and tokenizer, the same in every engine that may share pages; required there,
        refused otherwise.
      host_memory_bytes: bytes of host memory per host for a host-memory tier (evicted prefix pages;
        the store's pages land there); None (default): none without a store, and with one a tier of
        ``batch_size * max_length`` tokens' pages (at most the device pool's).

    Raises:
      TypeError, ValueError: a bad argument (a bad store URL, a missing ``model_id``, ...), before
        anything is made or opened.
    """

    def __init__(self, model: Any, *, mesh: Mesh | None = None, max_length: int = 1024, batch_size: int = 64,
                 page_size: int = 16, num_pages: int | None = None, hbm_utilization: float = 0.5,
                 dtype: DTypeLike | None = None, quantizer: str | Quantizer | None = None, decode_steps: int = 16,
                 prefill_tokens: int = 256, score_tokens: int = 1024, store: str | PrefixStore | None = None,
                 model_id: str | None = None, host_memory_bytes: int | None = None) -> None:  # fmt: skip
        check_store_arg(store, model_id)
        self.family: Family
        self.family, self.model = paged_copy(model)
        self.decode_steps = positive_int("decode_steps", decode_steps, hi=integer("max_length", max_length, lo=1),
                                         hint="decode steps per device loop, at most max_length")
        self.prefill_tokens = positive_int("prefill_tokens", prefill_tokens, hi=1 << 20)
        self.score_tokens = positive_int("score_tokens", score_tokens, hi=1 << 20)
        if mesh is None:
            mesh = create_mesh({"tp": 1}, devices=jax.devices()[:1])
        if dtype is None:  # the parameters' float dtype (a quantized weight's values are integers)
            dtype = next(a.dtype for a in jax.tree.leaves(nnx.state(self.model, nnx.Param))
                         if jnp.issubdtype(a.dtype, jnp.floating))
        pm = PartitionManager(PartitionAxis(kv_head_axis="tp" if "tp" in mesh.axis_names else None))
        meta = self._metadata(mesh, pm, max_length=max_length, batch_size=batch_size, page_size=page_size,
                              num_pages=num_pages, hbm_utilization=hbm_utilization, dtype=dtype, quantizer=quantizer,
                              host_memory_bytes=host_memory_bytes)
        if store is not None:
            meta = with_store_host_tier(meta)
        self.manager = PageManager(meta)
        # a step's token rows: at most what one step of the cache holds (batch_size full sequences)
        step_most = meta.batch_size * meta.num_pages_per_sequence * meta.page_size
        self.prefill_tokens, self.score_tokens = min(self.prefill_tokens, step_most), min(self.score_tokens, step_most)
        cache = PagedAttentionCache.init_cache(mesh, dtype, meta, pm, quantizer=quantizer)
        self._host = HostTier(cache) if meta.has_host_tier else None  # the cache's for its life, across sleeps
        self.version = 0
        self._fingerprint = WeightsFingerprint()  # a frozen base is fingerprinted once, adapters at each change
        self._store: PrefixStore | None = None
        self._owns_store = False
        self._weight_version: int | str = self._fingerprint(self.model) if store is not None else 0
        self._fingerprint_due = self._manager_behind = False
        self.manager.set_weight_version(self._weight_version)
        if store is not None:
            self._store, self._owns_store = open_store(store, model_id)
        try:
            # Holds the live cache; None while asleep, so no reference keeps the slept pages' buffers alive.
            self._runner: Runner | None = Runner(self.manager, cache, host=self._host, store=self._store)
        except BaseException:
            self.close()
            raise
        graphdef, self._state = nnx.split(self.model)
        self._prefill_step, self._decode_loop = _compiled(graphdef)
        self._score_step = compiled_score(graphdef)
        self._seen = self._param_refs()
        self._sleeping: SleepingCache | None = None
        self.peak_pages = 0  # the most pages (every group) the last generate held at once

    def _metadata(self, mesh: Mesh, pm: PartitionManager, *, max_length: int, batch_size: int, page_size: int,
                  num_pages: int | None, hbm_utilization: float, dtype: DTypeLike, quantizer: str | Quantizer | None,
                  host_memory_bytes: int | None) -> PagedAttentionCacheMetaData:  # fmt: skip
        """The cache's metadata: one layer group per distinct window (Gemma 3's local layers slide)."""
        attn = self.model.layers[0].attn
        windows = self.family.windows(self.model)
        groups = None
        if any(w is not None for w in windows):
            groups = tuple(LayerGroup(tuple(i for i, x in enumerate(windows) if x == w), AttentionKind.FULL if w is None
                                      else AttentionKind.SLIDING, w, num_pages=num_pages)
                           for w in dict.fromkeys(windows))  # fmt: skip
        return PagedAttentionCacheMetaData.create(
            mesh, batch_size, len(windows), max_length, page_size, int(attn.num_kv_heads), int(attn.head_dim),
            hbm_utilization, dtype, partition_manager=pm, quantizer=quantizer, layer_groups=groups,
            num_pages_per_layer=num_pages if groups is None else None, host_memory_bytes=host_memory_bytes)

    # ---- weights and memory ------------------------------------------------------------------------
    def update_params(self, params: nnx.State[Any, Any]) -> None:
        """New weights: when any parameter array changed (a LoRA run's adapters each step), the cache's next
        weight version, so no prefix cached under the old weights is found again (in the cache or in the
        store); parameters set to the arrays they already hold (a frozen base pushed again) change nothing.

        Args:
          params: an ``nnx.State`` of the model's parameters, whole or in part, as Tunix's trainer
            hands them.
        """
        nnx.update(self.model, params)
        self._check_weights()

    def _param_refs(self) -> list[weakref.ref[Any]]:
        """Weak references to the parameter arrays now, and the parameter variables kept to read them: the paged
        copy shares the caller's variables, and a trainer's update (``nnx.update``) sets their values in place,
        so reading the values of these variables finds every change without walking the model's graph."""
        self._variables = jax.tree.leaves(nnx.state(self.model, nnx.Param),
                                          is_leaf=lambda x: isinstance(x, nnx.Variable))
        return [weakref.ref(a) for a in self._param_arrays()]

    def _param_arrays(self) -> list[Any]:
        return [a for v in self._variables for a in jax.tree.leaves(v.get_value())]

    @property
    def weight_version(self) -> int | str:
        """The cache's weight version: the count of weight changes (`version`), or with a store a fingerprint of
        the weights (`_tunix_store`: the same in every engine and after a restart), computed when first asked
        after a change (`update_params` may run where no device transfer is allowed, as in Tunix's sync)."""
        if self._fingerprint_due:
            self._weight_version = self.version if self._store is None else self._fingerprint(self.model)
            self._fingerprint_due = False
        return self._weight_version

    def _new_version(self) -> None:
        self._state, self._seen = nnx.state(self.model), self._param_refs()
        self.version += 1
        self._fingerprint_due = self._manager_behind = True  # the manager learns it at the next call or wake

    def _sync_version(self) -> None:
        """Tell the (awake) manager the weight version, once per change, before a call looks up any prefix."""
        if self._manager_behind:
            self.manager.set_weight_version(self.weight_version)
            self._manager_behind = False

    def _check_weights(self) -> None:
        """The paged copy shares the caller's parameters (no second copy of the weights), so a
        trainer that updates them in place changes it too: a parameter array that is not the one
        last seen starts a new weight version."""
        now = self._param_arrays()
        if len(now) != len(self._seen) or any(ref() is not a for ref, a in zip(self._seen, now)):
            self._new_version()

    def sleep(self, level: int = 1) -> None:
        """Free the cache's device memory (`easykv.sleep`); the next `generate` wakes it. Nothing
        runs meanwhile; a call while asleep does nothing.

        Args:
          level: 1 (default) keeps its pages in host memory, 2 discards them.
        """
        if self._sleeping is None:
            runner = self._awake()
            if self._host is not None:  # the host tier's transfers and scrubs land before the pages leave
                runner.apply_pending()
            self._sleeping = sleep(runner.cache, self.manager, level=level)
            self._runner = None
            if self._store is not None:  # the woken manager's runner attaches it again
                self._store.detach()

    def wake(self) -> None:
        """Put the cache back in device memory (`easykv.wake`); a no-op while awake. The host tier (kept
        in host memory meanwhile) and the store serve the woken cache."""
        if self._sleeping is not None:
            cache, self.manager = wake(self._sleeping)
            # the woken cache (and manager) from now on
            self._runner = Runner(self.manager, cache, host=self._host, store=self._store)
            self._sleeping = None
            self.manager.set_weight_version(self.weight_version)
            self._manager_behind = False

    @property
    def store(self) -> PrefixStore | None:
        """The shared prefix store (None without one)."""
        return self._store

    def store_metrics(self) -> StoreMetrics | None:
        """What the store did so far (`easykv.tiers.store.StoreMetrics`: pages read, prompt tokens served,
        values written, refused, dropped); None without a store."""
        return None if self._store is None else self._store.metrics()

    def close(self) -> None:
        """Write what is queued for a store the engine opened from a URL and close it (a `PrefixStore`
        passed in stays open: its owner closes it). Without one: nothing."""
        if self._store is not None and self._owns_store:
            self._owns_store = False
            self._store.close()

    @property
    def cache(self) -> PagedAttentionCache | None:
        """The live cache (None while asleep)."""
        return None if self._runner is None else self._runner.cache

    def _awake(self) -> Runner:
        if self._runner is None:
            raise RuntimeError("the engine's cache is asleep; wake() it first")
        return self._runner

    @property
    def asleep(self) -> bool:
        """Whether the cache is asleep (`sleep`)."""
        return self._sleeping is not None

    # ---- generation --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int] | np.ndarray], max_new_tokens: int | Sequence[int], *,
                 eos_ids: Sequence[int] = (), sampling: Sampling = Sampling(), seed: int | jax.Array = 0
                 ) -> tuple[list[np.ndarray], list[np.ndarray]]:  # fmt: skip
        """Continue each prompt by up to ``max_new_tokens`` tokens, stopping at any of ``eos_ids``
        (not returned, as Tunix's ``Sampler`` does). Identical prompts are prefilled once and
        forked. Every sequence is released at the end (its full pages stay findable by later
        prompts until the weights change).

        Args:
          prompts: ``batch`` prompts (at most ``batch_size``), each a non-empty list of token ids
            in the model's vocabulary.
          max_new_tokens: new tokens per prompt, one int for all or ``batch`` ints, each >= 1 and
            at most ``max_length`` with its prompt.
          eos_ids: token ids that end a sequence (default none).
          sampling: how tokens are drawn (default `Sampling()`: greedy).
          seed: an int >= 0 or a ``jax.random`` key (default 0).

        Returns:
          ``(tokens, logprobs)``: per prompt, its new tokens ``(generated,)`` int32 and their
          log-probabilities under ``sampling`` ``(generated,)`` float32.
        """
        rows = self._rows(prompts, max_new_tokens)
        eos = tuple(integer("eos id", e, lo=0) for e in eos_ids)
        key = seed if isinstance(seed, jax.Array) else jax.random.key(integer("seed", seed, lo=0, hi=2**63 - 1))
        self.wake()
        self._check_weights()
        self._sync_version()
        self.peak_pages = 0
        runner = self._awake()
        for prompt in {row.prompt.tobytes(): row.prompt for row in rows}.values():  # read in the background
            runner.prefetch(prompt.tolist())
        try:
            leaders = self._admit(rows)
            last = self._prefill(rows, leaders)
            self._fork(rows, leaders)
            self._first_tokens(rows, leaders, last, jax.random.fold_in(key, 0), sampling, eos)
            round_ = 0
            while live := self._release_done(rows):
                round_ += 1
                self._decode_round(live, key, round_, sampling, eos)
        finally:
            for row in rows:
                if row.seq >= 0 and self.manager.contains(row.seq):
                    self.manager.release(row.seq)
        tokens = [np.asarray(r.out[: len(r.out) - r.ended_by_eos], np.int32) for r in rows]
        return tokens, [np.asarray(r.logp[: len(t)], np.float32) for r, t in zip(rows, tokens)]

    # ---- scoring -----------------------------------------------------------------------------------
    def score(self, prompt_tokens: Any, completion_tokens: Any, *, pad_id: int, eos_id: int,
              temperature: float = 1.0) -> jax.Array:  # fmt: skip
        """The log-probability of each completion token under the model, as Tunix's ``compute_per_token_logps``
        gives it (its shape, masking and padding; ``_tunix_scoring``), with each distinct prompt computed once
        (or found in the prefix cache, the host tier or the store) and its completions run as forks of it, in
        chunks of ``score_tokens``. Every sequence is released at the end; their full pages stay findable.

        Args:
          prompt_tokens: ``(batch, prompt_len)`` token ids, left-padded with ``pad_id``.
          completion_tokens: ``(batch, completion_len)`` token ids, right-padded with ``pad_id`` (a pad id is
            padding wherever it sits, as in Tunix; the token after a pad inside a completion is scored given
            the real tokens before it, where Tunix reads the pad's own query).
          pad_id: the padding id, in the vocabulary.
          eos_id: the end id, in the vocabulary (checked; Tunix's scoring takes it too and does not use it).
          temperature: divides the logits, >= 0 (default 1.0; 0 and 1: not at all), as Tunix's does.

        Returns:
          ``(batch, completion_len)`` float32 log-probabilities, 0 at padding.

        Raises:
          ValueError: a bad argument; CacheFullError: a row whose prompt and completion no sequence of the cache
            can hold (its pages named); both before anything changes.
        """
        batch = check_request(prompt_tokens, completion_tokens, pad_id=pad_id, eos_id=eos_id,
                              temperature=temperature, vocab=self.family.vocab(self.model), manager=self.manager)
        self.wake()
        self._check_weights()
        self._sync_version()
        runner = self._awake()
        for group in batch.groups:  # read in the background
            runner.prefetch(group.prompt.tolist())
        return Scorer(self.manager, runner, self._score_plan, self.score_tokens).run(batch)

    def _score_plan(self, tokens: jax.Array, targets: jax.Array, temperature: jax.Array, cache: PagedAttentionCache,
                    plan: StepPlan) -> tuple[PagedAttentionCache, jax.Array]:  # fmt: skip
        """The runner's step of a scoring plan: each fed token's target log-probability, ``(score_tokens,)``."""
        logp, cache = self._score_step(self._state, cache, tokens, targets, plan.metadata, temperature)
        return cache, logp

    def _rows(self, prompts: Sequence[Sequence[int] | np.ndarray], max_new_tokens: int | Sequence[int]) -> list[_Row]:
        meta = self.manager.metadata
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError(f"prompts must be a non-empty list of token-id lists, got {type(prompts).__name__}")
        if len(prompts) > meta.batch_size:
            raise ValueError(f"{len(prompts)} prompts but the cache holds batch_size={meta.batch_size} sequences; "
                             "generate fewer at once or create the engine with a larger batch_size")
        hint = f"new tokens per prompt, 1 .. max_length={meta.max_sequences}"
        if is_scalar(max_new_tokens):
            limits = [integer("max_new_tokens", max_new_tokens, lo=1, hi=meta.max_sequences, hint=hint)] * len(prompts)
        else:
            limits = integer_array("max_new_tokens", max_new_tokens, ndim=1, lo=1, hi=meta.max_sequences,
                                   hint=hint).tolist()
            if len(limits) != len(prompts):
                raise ValueError(f"max_new_tokens has {len(limits)} entries for {len(prompts)} prompts; pass one int "
                                 "or one per prompt")
        rows, vocab = [], self.family.vocab(self.model)
        for i, (p, n) in enumerate(zip(prompts, limits)):
            ids = np.asarray(p)
            if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0:
                raise ValueError(f"prompts[{i}] must be a non-empty list of token ids >= 0")
            if ids.max() >= vocab:
                raise ValueError(f"prompts[{i}] holds token id {int(ids.max())}, outside the model's vocabulary of "
                                 f"{vocab}")
            if n < 1 or ids.size + n > meta.max_sequences:
                raise ValueError(f"prompts[{i}] has {ids.size} tokens and asks for {n} new ones: each needs 1 or more "
                                 f"and at most max_length={meta.max_sequences} in all")
            rows.append(_Row(ids.astype(np.int32), n))
        return rows

    def _admit(self, rows: list[_Row]) -> dict[int, list[int]]:
        """One sequence per distinct prompt (its first row leads), its cached prefix attached;
        returns leader row -> every row of that prompt."""
        groups: dict[bytes, list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(row.prompt.tobytes(), []).append(i)
        leaders = {members[0]: members for members in groups.values()}
        runner = self._awake()
        for i in leaders:
            row = rows[i]
            row.seq = self.manager.claim(1)[0]
            row.fed = runner.match_prefix(row.seq, row.prompt.tolist())  # the device, the host tier, then the store
        return leaders

    def _prefill(self, rows: list[_Row], leaders: dict[int, list[int]]) -> dict[int, jax.Array]:
        """Each leader's uncached prompt tokens, ``prefill_tokens`` a step; its last logits."""
        mgr, runner, budget_each = self.manager, self._awake(), self.prefill_tokens
        todo, last = list(leaders), {}
        while todo:
            batch, budget = [], budget_each
            for i in todo:
                n = min(budget, rows[i].prompt.size - rows[i].fed)
                if n <= 0:
                    break
                batch.append((i, rows[i].prompt[rows[i].fed : rows[i].fed + n]))
                budget -= n
            chunks = [c for _, c in batch]
            tokens = np.zeros(budget_each, np.int32)
            flat = np.concatenate(chunks)
            tokens[: flat.size] = flat
            plan = mgr.schedule([rows[i].seq for i, _ in batch], [c.size for c in chunks], pad_tokens_to=budget_each,
                                pad_seqs_to=padded_rows(len(batch), mgr.batch_size))
            logits = runner.run(plan, partial(self._prefill_plan, jnp.asarray(tokens)), token_ids=chunks)
            self._note_pages()
            for j, (i, chunk) in enumerate(batch):
                rows[i].fed += chunk.size
                if rows[i].fed == rows[i].prompt.size:
                    last[i] = logits[j]
            todo = [i for i in todo if rows[i].fed < rows[i].prompt.size]
        return last

    def _prefill_plan(self, tokens: jax.Array, cache: PagedAttentionCache,
                      plan: StepPlan) -> tuple[PagedAttentionCache, jax.Array]:  # fmt: skip
        """The runner's step of a prefill plan: ``tokens`` written, the logits after each row's last token."""
        logits, cache = self._prefill_step(self._state, cache, tokens, plan.metadata)
        return cache, logits

    def _fork(self, rows: list[_Row], leaders: dict[int, list[int]]) -> None:
        for i, members in leaders.items():
            if len(members) > 1:
                children = self.manager.fork(rows[i].seq, len(members) - 1)
                assert isinstance(children, list)  # fork(seq, n) returns n ids
                for j, child in zip(members[1:], children, strict=True):
                    rows[j].seq = child

    def _first_tokens(self, rows: list[_Row], leaders: dict[int, list[int]], last: dict[int, jax.Array],
                      key: jax.Array, sampling: Sampling, eos: tuple[int, ...]) -> None:  # fmt: skip
        leader_of = {j: i for i, members in leaders.items() for j in members}
        logits = jnp.stack([last[leader_of[j]] for j in range(len(rows))])
        tokens, logp = jax.device_get(_sample(logits, key, sample=sampling))
        for row, t, lp in zip(rows, tokens.tolist(), logp.tolist()):
            row.take([t], [lp], eos)

    def _decode_round(self, live: list[_Row], key: jax.Array, round_: int, sampling: Sampling,
                      eos: tuple[int, ...]) -> None:  # fmt: skip
        mgr, runner, k = self.manager, self._awake(), self.decode_steps
        seqs, pad = [r.seq for r in live], padded_rows(len(live), mgr.batch_size)
        try:
            plan = mgr.schedule_decode(seqs, k, max_tokens=[min(k, r.limit - len(r.out)) for r in live],
                                       pad_seqs_to=pad)
        except CacheFullError:  # room for one more token each may still be there (same loop, one step)
            plan = mgr.schedule_decode(seqs, k, max_tokens=1, pad_seqs_to=pad)
        loop = partial(self._decode_plan, [r.out[-1] for r in live], key, round_, eos=eos, sampling=sampling)
        written, sampled, logp, counts = runner.run(plan, loop, token_ids=lambda out: out[0],
                                                    num_tokens=lambda out: out[3])
        for i, row in enumerate(live):
            row.take(sampled[i, : counts[i]].tolist(), logp[i, : counts[i]].tolist(), eos)

    def _decode_plan(self, last: list[int], key: jax.Array, round_: int, cache: PagedAttentionCache,
                     plan: StepPlan, *, eos: tuple[int, ...], sampling: Sampling
                     ) -> tuple[PagedAttentionCache, tuple[np.ndarray, ...]]:  # fmt: skip
        """The runner's step of a decode plan: its device loop from ``last`` (each sequence's last token); on
        the host, ``(written, sampled, logprobs, num_written)``, one row per padded row."""
        self._note_pages()  # the loop's pages are reserved now: the most this round holds
        tokens = np.zeros(plan.padded_rows, np.int32)
        tokens[: len(last)] = last
        out = self._decode_loop(self._state, cache, jnp.asarray(tokens), plan.metadata, jnp.asarray(plan.limits), key,
                                np.int32(round_), num_steps=plan.num_steps, page_size=plan.page_size,
                                num_pages=plan.num_pages, eos_id=eos, sample=sampling)
        return out.state, tuple(jax.device_get((out.written, out.sampled, out.logprobs, out.num_written)))

    def _release_done(self, rows: list[_Row]) -> list[_Row]:
        """Release the rows that are done (their full pages stay findable; a fork's shared pages
        stay with the others) so the running ones have their room; returns the running ones."""
        for row in rows:
            if row.done and row.seq >= 0:
                self.manager.release(row.seq)
                row.seq = -1
        return [row for row in rows if not row.done]

    def _note_pages(self) -> None:
        self.peak_pages = max(self.peak_pages, self.manager.metrics.used_pages)


__all__ = ["Sampling", "TunixPagedEngine"]
