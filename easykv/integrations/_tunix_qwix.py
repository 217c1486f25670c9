"""qwix models in the Tunix integration: which LoRA and weight-quantized Tunix models easykv serves, and why
it refuses the others.

How qwix changes a Tunix model: ``qwix.apply_lora_to_model`` (a ``LoraProvider``) or
``qwix.quantize_model`` (a ``PtqProvider``) gives the model a same-named subclass whose ``__call__``
intercepts ``jnp.einsum`` / ``lax.dot_general`` while it runs, and adds the adapters (``*_lora_a`` /
``*_lora_b``, ``nnx.LoRAParam``) or quantized weights to the projection modules its rules match. Every
layer's projections run through Tunix's own modules in easykv's paged forward too (only the attention
core between them reads easykv's pages), so the interception applies the adapters to exactly the
projections they wrap, as in Tunix's own forward. What that mechanism cannot make right is refused by
name: activation quantization (its scales are computed over a whole step's input, so a token's keys
and values would depend on the tokens that share its step, and a cached page would not be what a
recomputation gives), LoRA dropout (random at every forward), ``disable_jit`` (easykv's steps are
jitted), a provider easykv has not checked, adapters not created yet (a model made with
``skip_nnx_init``: qwix would create them inside easykv's jitted step), qwix parameters on an attention
module itself (whose core easykv replaces), and quantized weights in a family whose Tunix module cannot
run them (Tunix 0.1.7's Qwen3 casts each weight with ``jnp.astype``, which refuses qwix's quantized
arrays, so Tunix's own forward fails as well).

Private to the Tunix integration; imports qwix only when a model is a qwix model (qwix comes with Tunix).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx


def qwix_base(cls: type) -> type | None:
    """The Tunix class a qwix-wrapped model class wraps (qwix records it as ``_unquantized_type``); None for
    any other class."""
    base = cls.__dict__.get("_unquantized_type")
    return base if isinstance(base, type) and cls.__bases__ == (base,) else None


def _provider(cls: type) -> Any:
    """The qwix provider bound into the wrapped ``__call__`` (its input transform is ``partial(fn, provider)``);
    None when none is found."""
    qconfig = importlib.import_module("qwix._src.qconfig")
    for cell in getattr(cls.__dict__.get("__call__"), "__closure__", None) or ():
        value = cell.cell_contents
        if isinstance(value, functools.partial) and value.args and isinstance(value.args[0],
                                                                               qconfig.QuantizationProvider):
            return value.args[0]
    return None


def qwix_refusal(model: Any, family_name: str, runs_quantized: str | None) -> str | None:
    """Why easykv cannot serve the qwix model ``model`` of family ``family_name`` (module doc), or None.

    Args:
      model: a model whose class `qwix_base` recognised.
      family_name: its family's name, for the messages.
      runs_quantized: None when the family's Tunix module runs qwix-quantized weights, else why it cannot."""
    qwix = importlib.import_module("qwix")
    provider = _provider(type(model))
    if provider is None:
        return "a qwix model whose provider easykv cannot find in its wrapped __call__"
    if type(provider) not in (qwix.LoraProvider, qwix.PtqProvider):
        return (f"a qwix {type(provider).__name__} model: easykv serves qwix.LoraProvider (LoRA, QLoRA) and "
                "qwix.PtqProvider (weight quantization) models, whose forward it has checked against Tunix's")
    if getattr(provider, "disable_jit", False):
        return "a qwix provider with disable_jit=True: easykv's steps run jitted; make it with disable_jit=False"
    quantized = False
    for rule in getattr(provider, "_rules", ()):
        if getattr(rule, "act_qtype", None) is not None:
            return (f"the qwix rule for {rule.module_path!r} quantizes activations (act_qtype={rule.act_qtype}): its "
                    "scales span a whole step's input, so cached keys and values would depend on which tokens "
                    "shared their step; quantize weights only (weight_qtype)")
        if getattr(rule, "dropout", 0.0):
            return (f"the qwix LoRA rule for {rule.module_path!r} has dropout={rule.dropout}: dropout is random at "
                    "every forward, so no cached key or value could be reused; use dropout=0 for rollouts")
        quantized = quantized or getattr(rule, "weight_qtype", None) is not None
    if quantized and runs_quantized is not None:
        return f"qwix-quantized weights in a {family_name} model: {runs_quantized}"
    if isinstance(provider, qwix.LoraProvider) and not jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
        paths = [getattr(rule, "module_path", None) for rule in getattr(provider, "_rules", ())]
        return (f"a qwix LoRA model without adapters: none of its rules (module paths {paths}) matched a "
                "projection, or it was made with skip_nnx_init=True (qwix creates adapters at the model's first "
                "call); call qwix.apply_lora_to_model with the model's inputs (model.get_model_input())")
    return _attention_parameters(model)


def qwix_signature(model: Any) -> str:
    """What a qwix model's forward depends on besides its parameter arrays: the provider's class and each
    rule's options (``alpha``, ``rank``, module paths, quantized types, ...), as text equal in every process
    ("" for a model qwix did not wrap). Two LoRA models with equal arrays and another ``alpha`` compute other
    keys and values, so a shared store's weight version must tell them apart. Initializers are left out: they
    shape only the first arrays, which the version holds anyway, and their text names memory addresses."""
    if qwix_base(type(model)) is None:
        return ""
    provider = _provider(type(model))
    rules = [",".join(f"{f.name}={_plain(getattr(rule, f.name))}" for f in dataclasses.fields(rule)
                      if not callable(getattr(rule, f.name)))
             for rule in getattr(provider, "_rules", ())]
    return f"qwix:{type(provider).__qualname__}[{';'.join(rules)}]"


def _plain(value: Any) -> str:
    """A rule option as process-independent text (dtypes by name, collections element by element)."""
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(map(_plain, value)) if isinstance(value, (set, frozenset)) else map(_plain, value)
        return "(" + ",".join(items) + ")"
    if value is None or isinstance(value, (str, int, float, bool)):
        return repr(value)
    try:
        return str(jax.numpy.dtype(value).name)
    except TypeError:
        return f"{type(value).__qualname__}:{value}"


def _attention_parameters(model: Any) -> str | None:
    """Why qwix parameters sit on a module whose code easykv does not run, or None: easykv runs every module
    of the model through Tunix's own code but for each attention module's own core."""
    for i, layer in enumerate(model.layers):
        for name in _qwix_attributes(layer.attn):
            return (f"layer {i}'s attention module itself carries qwix's {name!r}: easykv runs Tunix's projections "
                    "but replaces the attention core between them, so an adapter or quantized weight there would "
                    "not run; target the projection modules (e.g. '.*q_proj|.*k_proj|.*v_proj|.*o_proj')")
    return None


def _qwix_attributes(module: nnx.Module) -> Iterator[str]:
    """Names of ``module``'s own attributes (not its submodules') that qwix added: adapters and quantized
    weights."""
    for name, value in vars(module).items():
        if isinstance(value, nnx.LoRAParam) or type(value).__module__.startswith("qwix."):
            yield name


__all__ = ["qwix_base", "qwix_refusal", "qwix_signature"]
