"""Tunix's own model modules over easykv pages: the families served, what each module's attention
computes before the cache (its projections, norms, RoPE and query scaling, reused as they are),
and one forward of a paged copy of the model.

A paged copy is the caller's model merged anew (the same parameter arrays, new module objects)
whose attention and decoder-layer classes are same-named subclasses: when a layer's cache is a
`PagedLayer` the attention writes the layer's new K/V into its easykv pages and reads them with
easykv's paged attention (the layer's window from its layer group); given anything else (no
cache, as in Tunix's log-prob forward) the module runs Tunix's own code unchanged. A qwix LoRA or
weight-quantized model keeps qwix's wrapper class, so its adapters apply in the paged forward as in
Tunix's (``_tunix_qwix``). A paged
forward skips Tunix's remat wrappers: it computes no gradient, and the pages a layer writes must
reach the next layer's read, which a remat trace would keep to itself. Private to the Tunix
integration; imports tunix, flax and easykv's attention, storage and step.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from easykv.attention.api import view_attention
from easykv.integrations._tunix_qwix import qwix_base, qwix_refusal
from easykv.step.ragged import RaggedStep
from easykv.storage.cache import PagedAttentionCache
from easykv.storage.view import PagedAttentionCacheView


class PagedLayer(NamedTuple):
    """A layer's cache in a paged forward: its view of the pages and the step's metadata (one per
    layer group)."""

    view: PagedAttentionCacheView
    metadata: tuple[RaggedStep, ...]


class LayerCaches(Mapping[str, PagedLayer]):
    """What a paged forward hands the model as its ``cache``: ``cache["layer_i"]`` is layer ``i``'s
    view taken when the model asks for it, so it holds what the layers before it wrote."""

    def __init__(self, cache: PagedAttentionCache, metadata: tuple[RaggedStep, ...]) -> None:
        self.cache, self.metadata = cache, metadata

    def __getitem__(self, name: str) -> PagedLayer:
        return PagedLayer(self.cache[int(name.removeprefix("layer_"))], self.metadata)

    def __iter__(self) -> Iterator[str]:
        return (f"layer_{i}" for i in range(len(self)))

    def __len__(self) -> int:
        return int(self.cache.metadata.num_hidden_layers)


def attend(layer: PagedLayer, q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
           soft_cap: float | None) -> tuple[PagedLayer, jax.Array]:
    """Write ``k``, ``v`` ``(1, tokens, kv_heads, head_dim)`` at the step's slots and attend ``q``
    ``(1, tokens, q_heads, head_dim)`` over the layer's pages; returns the written layer and the
    output ``(1, tokens, q_heads, head_dim)``."""
    view = layer.view
    view = view.write_mixed_to_cache(k[0].astype(view.dtype), v[0].astype(view.dtype), layer.metadata)
    out = view_attention(q[0].astype(view.dtype), view, layer.metadata, scale=scale, logit_soft_cap=soft_cap)
    return PagedLayer(view, layer.metadata), out[None].astype(q.dtype)


# ---- the families ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Family:
    """A Tunix model family easykv serves: where its module lives, what its attention computes
    before the cache (``qkv``: the module's own projections, norms and RoPE; ``scale``: the
    softmax scale after any query scaling ``qkv`` applied), its output projection, each layer's
    window, and what it refuses."""

    name: str
    module: str
    model_class: str
    qkv: Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]
    scale: Callable[[Any], float]
    out: Callable[[Any, jax.Array], jax.Array]
    windows: Callable[[Any], list[int | None]]
    refuse: Callable[[Any], str | None]
    vocab_field: str
    runs_quantized: str | None = None  # None: Tunix's module runs qwix-quantized weights; else why it cannot

    def tunix(self) -> ModuleType:
        return importlib.import_module(self.module)

    def vocab(self, model: Any) -> int:
        return int(getattr(model.config, self.vocab_field))


def _qwen3_qkv(attn: Any, x: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    rope = importlib.import_module("tunix.models.qwen3.model").apply_rope
    q, k, v = attn.q_norm(attn.q_proj(x)), attn.k_norm(attn.k_proj(x)), attn.v_proj(x)
    return rope(q, pos, head_dim=attn.head_dim), rope(k, pos, head_dim=attn.head_dim), v


def _llama3_qkv(attn: Any, x: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    rope = importlib.import_module("tunix.models.llama3.model").apply_rope
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    return rope(q, pos, head_dim=attn.head_dim), rope(k, pos, head_dim=attn.head_dim), v


def _gemma3_qkv(attn: Any, x: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    rope = importlib.import_module("tunix.models.gemma3.model").apply_rope
    if attn.use_qkv_einsum:
        q, k, v = attn.qkv_einsum(x)
    else:
        q = attn.q_einsum(x)
        k, v = attn.kv_einsum(x)
    q, k = attn._query_norm(q), attn._key_norm(k)
    kw = dict(head_dim=attn.head_dim, base_frequency=attn.rope_base_frequency, scale_factor=attn.rope_scale_factor)
    return rope(q, pos, **kw) * attn.query_pre_attn_scalar, rope(k, pos, **kw), v  # Gemma scales the query first


def _gemma3_windows(model: Any) -> list[int | None]:
    local = importlib.import_module("tunix.models.gemma3.model").AttentionType.LOCAL_SLIDING
    return [int(layer.attn.sliding_window_size) if layer.attn.attn_type == local else None for layer in model.layers]


def _gemma3_refuse(model: Any) -> str | None:
    if getattr(model.config, "vision_config", None) is not None:
        return "a Gemma 3 model with a vision tower (vision_config): easykv serves its text layers only"
    return None


FAMILIES = (
    Family("qwen3", "tunix.models.qwen3.model", "Qwen3", _qwen3_qkv, lambda a: float(a.scale),
           lambda a, o: a.o_proj(o), lambda m: [None] * len(m.layers), lambda m: None, "vocab_size",
           runs_quantized="Tunix's Qwen3 Einsum casts its weight with jnp.astype, which refuses qwix's quantized "
                          "arrays (Tunix's own forward fails too); use a LoRA without weight_qtype"),
    Family("llama3", "tunix.models.llama3.model", "Llama3", _llama3_qkv, lambda a: float(a.scale),
           lambda a, o: a.o_proj(o), lambda m: [None] * len(m.layers), lambda m: None, "vocab_size"),
    Family("gemma3", "tunix.models.gemma3.model", "Gemma3", _gemma3_qkv, lambda a: 1.0,
           lambda a, o: a.attn_vec_einsum(o), _gemma3_windows, _gemma3_refuse, "num_embed"),
)


def family_of(model: object) -> Family:
    """The family of a Tunix model, checked whole: ValueError naming the class (or the option) easykv
    cannot serve, TypeError for what is not a Tunix model module."""
    if not isinstance(model, nnx.Module):
        raise TypeError(f"easykv.integrations.tunix takes a Tunix model (an nnx.Module such as Qwen3, Llama3 or "
                        f"Gemma3), got {type(model).__name__}")
    names = ", ".join(f.name for f in FAMILIES)
    for family in FAMILIES:
        tunix = family.tunix()
        served = getattr(tunix, family.model_class)
        if type(model) is served:
            break
        if qwix_base(type(model)) is served:  # a qwix LoRA or quantized model: Tunix's modules, intercepted
            reason = qwix_refusal(model, family.name, family.runs_quantized)
            if reason is not None:
                raise ValueError(f"easykv.integrations.tunix cannot serve {reason}")
            break
        if isinstance(model, served):
            raise ValueError(f"{type(model).__module__}.{type(model).__qualname__} is a changed Tunix "
                             f"{family.model_class} (a subclass other than qwix's LoRA and quantization wrappers): "
                             "easykv reuses Tunix's own modules and cannot vouch for a changed one")
    else:
        raise ValueError(f"{type(model).__module__}.{type(model).__qualname__} is not a Tunix model family easykv "
                         f"serves ({names}); its attention is not known to easykv, so it is refused rather than "
                         "run wrong")
    _check_layers(family, tunix, model)
    reason = family.refuse(model)
    if reason is not None:
        raise ValueError(f"easykv.integrations.tunix cannot serve {reason}")
    return family


def _check_layers(family: Family, tunix: ModuleType, model: Any) -> None:
    """Every layer of ``model`` (of ``family``, whose module is ``tunix``) is Tunix's own decoder
    layer and attention, or their paged subclasses."""
    for i, layer in enumerate(model.layers):
        for part, expected in ((layer, tunix.DecoderLayer), (layer.attn, tunix.Attention)):
            if type(part) is not expected and type(part) not in _PAGED.values():
                raise ValueError(f"layer {i} of the {family.name} model is a {type(part).__qualname__}, not Tunix's "
                                 f"{expected.__qualname__}: easykv reuses Tunix's own module and cannot vouch for a "
                                 "changed one")


# ---- the paged copy --------------------------------------------------------------------------------
_PAGED: dict[type, type] = {}  # Tunix class -> its paged subclass (one each, so jit sees one graphdef)


def _paged_class(base: type, family: Family | None) -> type:
    if base in _PAGED.values():
        return base
    if base not in _PAGED:
        body: dict[str, Any] = {"__call__": _bypass_remat, "__module__": __name__, "__qualname__": base.__qualname__}
        if family is not None:
            body["block"] = _paged_block(family)
        _PAGED[base] = type(base.__name__, (base,), body)
    return _PAGED[base]


def _bypass_remat(self: Any, x: jax.Array, segment_pos: jax.Array, cache: Any, *args: Any, **kwargs: Any) -> Any:
    if isinstance(cache, PagedLayer):
        return self.block(x, segment_pos, cache, *args, **kwargs)
    return super(type(self), self).__call__(x, segment_pos, cache, *args, **kwargs)


def _paged_block(family: Family) -> Callable[..., Any]:
    def block(self: Any, x: jax.Array, segment_pos: jax.Array, cache: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(cache, PagedLayer):
            return super(type(self), self).block(x, segment_pos, cache, *args, **kwargs)
        q, k, v = family.qkv(self, x, segment_pos)
        cache, out = attend(cache, q, k, v, scale=family.scale(self),
                            soft_cap=getattr(self, "attn_logits_soft_cap", None))
        return cache, family.out(self, out)

    return block


def paged_copy(model: Any) -> tuple[Family, Any]:
    """The model's family and its paged copy (module doc); the caller's model is not changed."""
    family = family_of(model)
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    for layer in copy.layers:
        layer.__class__ = _paged_class(type(layer), None)
        layer.attn.__class__ = _paged_class(type(layer.attn), family)
    return family, copy


def forward(model: Any, cache: PagedAttentionCache, tokens: jax.Array, metadata: tuple[RaggedStep, ...]
            ) -> tuple[jax.Array, PagedAttentionCache]:  # fmt: skip
    """Logits ``(tokens, vocab)`` of a paged copy for one step's ``tokens`` ``(padded_len,)`` (mixed
    metadata); their K/V written into ``cache``, which is returned."""
    positions = jnp.maximum(metadata[0].positions, 0)  # padding tokens: any position, nothing is kept
    logits, _ = model(tokens[None], positions[None], LayerCaches(cache, metadata), None)
    return logits[0], cache


__all__ = ["FAMILIES", "Family", "LayerCaches", "PagedLayer", "attend", "family_of", "forward", "paged_copy"]
