"""Tunix (``google-tunix`` 0.1.7, extra ``easykv[tunix]``) on easykv pages: its own models generate
over a paged cache, and RL rollouts run through Tunix's own RL cluster on them.

.. code-block:: python

    import functools
    from tunix.rl import rl_cluster as rl
    from easykv.integrations.tunix import EasyKVRollout

    config = rl.ClusterConfig(..., rollout_engine=functools.partial(EasyKVRollout, num_pages=4096))
    # or, without Tunix's cluster: engine = TunixPagedEngine(model); tokens, logp = engine.generate(ids, 64)

What it serves: Tunix's Qwen3, Llama3 and Gemma3 modules, each layer computing what Tunix's own
attention computes before the cache (its projections, q/k norms, RoPE and Gemma's query scaling,
reused, not rewritten) and reading its keys and values from easykv pages (Gemma 3's local layers
as a sliding layer group, whose pages leave as the window moves). qwix LoRA models
(``qwix.apply_lora_to_model`` with a ``LoraProvider``, as Tunix's GRPO recipes make the policy) and
qwix weight-quantized ones (QLoRA, ``PtqProvider``) run too: their adapters apply on exactly the
projections they wrap, through qwix's own interception of Tunix's modules. Any other model class, a
changed attention module, a Gemma 3 with a vision tower, and each qwix option easykv cannot run
right (activation quantization, LoRA dropout, other providers, quantized weights in Tunix's Qwen3)
are refused by name (ValueError), never run wrong. The rollout (`EasyKVRollout`, a Tunix
``BaseRollout``):

- prefills each distinct prompt once, in chunks, after looking its prefix up in the cache's prefix
  cache; GRPO's ``num_generations`` samples of a prompt are forks of it (copy-on-write pages);
- decodes ``decode_steps`` tokens per device loop, sampling on the device as Tunix's ``Sampler``
  does (greedy while ``top_p`` is None; else temperature, ``top_k`` and ``top_p``);
- on new weights (``update_params``, or the trainer's update of the parameters the rollout shares
  with the actor; with LoRA, Tunix pushes the adapters each step) starts a new weight version of the
  cache, so no prefix computed with the old weights or adapters is ever found again; parameters set
  to the arrays they already hold (the frozen base) start none;
- scores completions (``get_per_token_logps``, Tunix's old-policy log-probabilities) over its pages:
  each distinct prompt computed once (often found in the cache its generation just filled) and
  forked per completion (`TunixPagedEngine.score`); `use_easykv_scoring` does the same for the
  reference model in Tunix's RL cluster;
- with ``sleep_level`` (1 or 2) frees the cache's device memory between calls (the trainer's phase)
  and wakes it at the next ``generate``;
- with ``store=`` (a store URL and ``model_id=``, or an `easykv.tiers.store.PrefixStore`) shares
  prompt pages with every other engine of the model through a shared prefix store: each call's
  prompts are read from it, the pages it fills written to it; its keys carry a fingerprint of the
  weights, so engines share pages exactly while their weights agree (`TunixPagedEngine`).

A sample ends at a generated pad id, as at an end token (not returned): Tunix masks a pad id wherever
it sits, in its ``Sampler`` (which carries on without attending to it) and in its scoring and losses,
so a sample that carried on after attending to it would be scored on a context it was not drawn from.
Both give the same tokens unless a sample generates the pad id. `TunixPagedEngine.generate` itself
stops only at its ``eos_ids`` and attends to every generated token, as the model without a cache does.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tunix.generate.tokenizer_adapter import TokenizerAdapter
from tunix.rl import reshard, rl_cluster
from tunix.rl.inference import inference_worker
from tunix.rl.rollout import base_rollout

from easykv.integrations._tunix_engine import Sampling, TunixPagedEngine
from easykv.integrations._tunix_model import FAMILIES, family_of


class EasyKVRollout(base_rollout.BaseRollout):
    """A Tunix rollout engine over easykv pages (module doc). Tunix's RL cluster builds it as
    ``EasyKVRollout(rollout_actor=model, tokenizer=..., mesh=..., rollout_config=...)``: pass it
    as ``ClusterConfig.rollout_engine``, with engine options bound by ``functools.partial``.

    Args:
      rollout_actor: the Tunix model (Qwen3, Llama3 or Gemma3) to generate with; required.
      tokenizer: its tokenizer, or Tunix's ``TokenizerAdapter`` of it; required.
      mesh: the mesh of the engine's cache (None: one device).
      rollout_config: Tunix's ``RolloutConfig``; its ``kv_cache_size`` is the default
        ``max_length`` (1024 without one).
      sleep_level: free the cache's device memory after each `generate` (`TunixPagedEngine.sleep`):
        1 keeps the pages in host memory, 2 discards them; None (default): stay awake.
      **engine_options: `TunixPagedEngine`'s keywords (``num_pages``, ``page_size``,
        ``batch_size``, ``decode_steps``, ``dtype``, ``quantizer``, ``max_length``, ``store``,
        ``model_id``, ``host_memory_bytes``, ...).
    """

    def __init__(self, rollout_actor: Any = None, tokenizer: Any = None, mesh: Mesh | None = None,
                 rollout_config: base_rollout.RolloutConfig | None = None, *, sleep_level: int | None = None,
                 **engine_options: Any) -> None:  # fmt: skip
        if rollout_actor is None or tokenizer is None:
            raise ValueError("EasyKVRollout needs rollout_actor (a Tunix model) and tokenizer, as Tunix's RL cluster "
                             "passes them")
        _check_sleep_level(sleep_level)
        self._tokenizer = tokenizer if isinstance(tokenizer, TokenizerAdapter) else TokenizerAdapter(tokenizer)
        engine_options.setdefault("max_length", getattr(rollout_config, "kv_cache_size", 1024))
        self._engine = TunixPagedEngine(rollout_actor, mesh=mesh, **engine_options)
        self._mesh, self._sleep_level, self._calls = mesh, sleep_level, 0

    @property
    def engine(self) -> TunixPagedEngine:
        """The `TunixPagedEngine` that generates."""
        return self._engine

    @property
    def mesh(self) -> Mesh | None:
        """The mesh it was built with (None: one device)."""
        return self._mesh

    def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
                 **kwargs: object) -> base_rollout.RolloutOutput:  # fmt: skip
        """Tunix's ``generate``: ``prompts`` as strings (tokenized as Tunix's ``Sampler`` does),
        up to ``max_tokens_to_generate`` tokens each, a sample ending at an end token or a generated
        pad id (module doc); the output as ``VanillaRollout`` gives it (completion tokens without the
        end token, prompts left-padded to ``max_prompt_length`` or the next power of two of the
        longest).

        Args:
          prompts: the prompts, ``batch`` strings (at most the engine's ``batch_size``).
          rollout_config: Tunix's ``RolloutConfig``: ``max_tokens_to_generate``, ``eos_tokens``
            (default: the tokenizer's eos), ``temperature``, ``top_p``, ``top_k``, ``seed``
            (None: the call's number), ``max_prompt_length``, ``return_logprobs``.
          **kwargs: accepted for Tunix's interface; unused.

        Returns:
          Tunix's ``RolloutOutput``: ``tokens`` (one int32 array per prompt), ``text``,
          ``left_padded_prompt_tokens`` ``(batch, padded_prompt_len)``, and ``logprobs`` when asked.
        """
        tok = self._tokenizer
        ids = [self._tokenize(p) for p in prompts]
        eos = tuple(dict.fromkeys([*(rollout_config.eos_tokens or [tok.eos_id()]), tok.pad_id()]))  # module doc
        sampling = Sampling(temperature=rollout_config.temperature, top_p=rollout_config.top_p,
                            top_k=rollout_config.top_k)
        self._calls += 1
        seed = rollout_config.seed if rollout_config.seed is not None else self._calls
        tokens, logp = self._engine.generate(ids, rollout_config.max_tokens_to_generate, eos_ids=eos,
                                             sampling=sampling, seed=seed)
        if self._sleep_level is not None:
            self._engine.sleep(self._sleep_level)
        return base_rollout.RolloutOutput(
            text=[tok.decode(t.tolist()) for t in tokens], logits=[], tokens=tokens,
            left_padded_prompt_tokens=_left_padded(ids, rollout_config.max_prompt_length, tok.pad_id()),
            logprobs=[lp.tolist() for lp in logp] if rollout_config.return_logprobs else None)

    def _tokenize(self, text: str) -> np.ndarray:
        tok = self._tokenizer
        bos = [tok.bos_id()] if tok.bos_id() else []
        return np.asarray(tok.dedup_bos_ids(bos + list(tok.encode(text))), np.int32)

    def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array,
                            **kwargs: object) -> jax.Array:  # fmt: skip
        """Tunix's log-probabilities of the completion tokens under the current weights, scored over
        the engine's pages (`TunixPagedEngine.score`: each distinct prompt computed once, or found in
        the cache the rollout just filled), in place of Tunix's dense ``compute_per_token_logps``.

        Args:
          prompt_tokens: ``(batch, prompt_len)`` int token ids, left-padded with the pad id.
          completion_tokens: ``(batch, completion_len)`` int token ids, right-padded with the pad id.
          **kwargs: ``temperature`` (default 1.0, as Tunix's rollouts score); others accepted for
            Tunix's interface and unused.

        Returns:
          ``(batch, completion_len)`` float32 log-probabilities, 0 at padding.
        """
        temperature = kwargs.get("temperature", 1.0)
        logps = self._engine.score(prompt_tokens, completion_tokens, pad_id=self.pad_id(), eos_id=self.eos_id(),
                                   temperature=temperature)  # type: ignore[arg-type]  # checked by score
        if self._sleep_level is not None:
            self._engine.sleep(self._sleep_level)
        return logps

    def update_params(self, params: nnx.State[Any, Any], filter_types: tuple[type, ...] | None = None) -> None:
        """New weights from the trainer; the cache starts a new weight version.

        Args:
          params: an ``nnx.State`` of the model's parameters, whole or in part.
          filter_types: nnx variable types: when given, ``params`` are first laid out as the
            rollout model's state of those types (as Tunix's own rollout does); None (default):
            used as they are.
        """
        if filter_types is not None:
            params = reshard.reshard_pytree(params, nnx.state(self._engine.model, filter_types))
        self._engine.update_params(params)

    def pad_id(self) -> int:
        """The tokenizer's pad id."""
        return int(self._tokenizer.pad_id())

    def eos_id(self) -> int:
        """The tokenizer's end-of-sequence id."""
        return int(self._tokenizer.eos_id())

    def model(self) -> Any:
        """The engine's paged copy of the model. It shares the actor's parameters, so Tunix sees
        shared weights and skips the sync; the engine notices new parameter arrays at the next
        ``generate`` and moves the cache to a new weight version then."""
        return self._engine.model


class EasyKVInferenceWorker(inference_worker.InferenceWorker):
    """Tunix's ``InferenceWorker`` whose reference-model scoring (``get_ref_per_token_logps``, which
    Tunix's GRPO and PPO learners call through ``RLCluster.get_ref_per_token_logps``) runs over easykv
    pages (`TunixPagedEngine.score`) instead of Tunix's dense ``compute_per_token_logps``; critic and
    reward models are served as Tunix serves them. Install it in a cluster with `use_easykv_scoring`.

    Args:
      models: Tunix's role -> model map (``"reference"`` required; ``"critic"``, ``"reward"``).
      mesh: the reference cache's mesh (None: one device).
      sleep_level: free the reference cache's device memory after each scoring call (the trainer's
        phase; `TunixPagedEngine.sleep`): 1 keeps its pages in host memory, so later steps still find
        the prompts, 2 discards them; None (default): stay awake.
      **engine_options: `TunixPagedEngine`'s keywords (``num_pages``, ``max_length``, ``batch_size``,
        ``score_tokens``, ...).
    """

    def __init__(self, models: dict[str, nnx.Module], *, mesh: Mesh | None = None, sleep_level: int | None = None,
                 **engine_options: Any) -> None:  # fmt: skip
        if models.get("reference") is None:
            raise ValueError("EasyKVInferenceWorker scores with the reference model, and models has none; give the "
                             "RLCluster a reference model (GRPO with beta != 0 needs one)")
        _check_sleep_level(sleep_level)
        super().__init__(models)
        self._engine = TunixPagedEngine(models["reference"], mesh=mesh, **engine_options)
        self._sleep_level = sleep_level

    @property
    def engine(self) -> TunixPagedEngine:
        """The `TunixPagedEngine` over the reference model that scores."""
        return self._engine

    def get_ref_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array, pad_id: int,
                                eos_id: int, temperature: float = 1.0) -> jax.Array:  # fmt: skip
        """Tunix's reference log-probabilities, scored over pages (`TunixPagedEngine.score`).

        Args:
          prompt_tokens: ``(batch, prompt_len)`` token ids, left-padded with ``pad_id``.
          completion_tokens: ``(batch, completion_len)`` token ids, right-padded with ``pad_id``.
          pad_id: the padding id.
          eos_id: the end id.
          temperature: divides the logits (0 and 1: not at all), as Tunix's does.

        Returns:
          ``(batch, completion_len)`` float32 log-probabilities, 0 at padding.
        """
        logps = self._engine.score(prompt_tokens, completion_tokens, pad_id=pad_id, eos_id=eos_id,
                                   temperature=temperature)
        if self._sleep_level is not None:
            self._engine.sleep(self._sleep_level)
        return logps


def use_easykv_scoring(cluster: rl_cluster.RLCluster, **engine_options: Any) -> EasyKVInferenceWorker:
    """Make ``cluster`` (Tunix's ``RLCluster``) score its reference model over easykv pages: its
    inference worker becomes an `EasyKVInferenceWorker` over the same models, its cache on the
    cluster's reference mesh. Tunix 0.1.7 builds the worker inside ``RLCluster`` with no option to pass
    one, so this replaces it after the cluster is made (before the learner's first step). The policy's
    own log-probabilities (``get_old_per_token_logps``) already run over pages when the rollout engine
    is `EasyKVRollout`.

    Args:
      cluster: the RL cluster, with a reference model.
      **engine_options: `TunixPagedEngine`'s keywords for the reference engine.

    Returns:
      The installed worker.
    """
    worker = cluster.inference_worker
    models = {}
    for role in ("critic", "reference", "reward"):
        try:
            models[role] = worker.get_model(role)
        except ValueError:  # Tunix's answer for a role the cluster has no model for
            continue
    # a cluster without a reference (GRPO with beta = 0) may have no reference mesh: the worker names what is missing
    scorer = EasyKVInferenceWorker(models, mesh=cluster.r2m.get(rl_cluster.Role.REFERENCE), **engine_options)
    cluster._inference_worker = scorer  # noqa: SLF001  the one place Tunix 0.1.7 keeps it (see the doc)
    return scorer


def _check_sleep_level(sleep_level: object) -> None:
    if isinstance(sleep_level, bool) or sleep_level not in (None, 1, 2):
        raise ValueError(f"sleep_level={sleep_level!r} must be None (stay awake), 1 (pages kept in host memory "
                         "between calls) or 2 (pages discarded between calls)")


def _left_padded(ids: list[np.ndarray], length: int | None, pad: int) -> np.ndarray:
    longest = max(p.size for p in ids)
    if length is None or length < longest:
        length = 1 << (longest - 1).bit_length()
    out = np.full((len(ids), length), pad, np.int32)
    for i, p in enumerate(ids):
        out[i, length - p.size :] = p
    return out


__all__ = ["FAMILIES", "EasyKVInferenceWorker", "EasyKVRollout", "Sampling", "TunixPagedEngine", "family_of",
           "use_easykv_scoring"]
