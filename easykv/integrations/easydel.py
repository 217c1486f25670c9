"""EasyDeL 0.3 on easykv pages: one call, in EasyDeL's own forward and in its eSurge engine.

.. code-block:: python

    import easydel as ed
    from easykv.integrations.easydel import use_easykv

    model = ed.LlamaForCausalLM(config=config, rngs=...)        # attn_mechanism ragged v3 or v2
    model = use_easykv(model, num_pages_per_layer=4096)           # or memory_bytes_per_device=...
    engine = ed.eSurge(model=model, tokenizer=tok, page_size=16)  # eSurge now schedules easykv pages
    cache = model.init_operations_cache(batch_size=8, max_length=2048, page_size=16)  # EasyKVCache
    out = model(input_ids=ids, position_ids=pos, past_key_values=cache, cache_metadata=ragged_metadata)
    easykv.save_cache(path, out.past_key_values.to_easykv())      # the same arrays, easykv's API

``use_easykv(model, ...)`` returns the model with two changes, both through EasyDeL's extension
points (the model keeps its weights, config, name and everything else):

* every ``FlexibleAttentionModule`` runs ``EasyKVRaggedPageAttnV3`` / ``...V2`` in place of
  EasyDeL's ``RaggedPageAttnV3`` / ``V2``: subclasses with the same names and requirements that
  compute easykv's paged attention when the layer's cache view is an :class:`EasyKVCacheView`
  and EasyDeL's own kernel otherwise (so EasyDeL's own cache still works on the same model);
* the model's class becomes a same-named subclass whose ``create_ragged_page_cache_config``
  and ``init_operations_cache`` (the two hooks eSurge calls) size and allocate an easykv pool
  and return an :class:`EasyKVCache`. eSurge's scheduler then hands out easykv's pages.

A model whose config mixes ``"sliding_attention"`` and ``"full_attention"`` ``layer_types``
(gpt-oss, Gemma 2/3) gets a cache with those layer groups: the same geometry and the one pool for
every group (EasyDeL hands every layer one page table, so the pages a window left are not freed
here; easykv's own `PageManager` does that with a pool per group), each group declaring its
window, which checkpoints record and each layer's attention is checked against (a layer that
attends with another window than its group declares is an error). EasyDeL's sinks
(``softmax_aux``) are easykv's ``sinks``.

A model whose ``attn_mechanism`` is not ragged-page (e.g. ``"vanilla"``) is first rebuilt with
``"ragged_page_attention_v3"``, as eSurge itself does on CPU and TPU (use the returned model).
The pool is sized by easykv (``PagedAttentionCacheMetaData.create``: device memory times
eSurge's ``hbm_utilization``) unless ``num_pages_per_layer`` or ``memory_bytes_per_device`` is
given; ``attention_options`` tune easykv's attention (``query_block``: smaller compiles faster).

Pages stay in easykv's layout: per layer ``(num_kv_heads, num_pages, page_size, head_dim)`` for K
and for V, raw bits for bf16/f16 on CPU, ``QuantizedPages`` when quantized; ``cache.to_easykv()``
and ``EasyKVCache.from_easykv(cache)`` convert without copying. Each step, EasyDeL's
``RaggedPagesMetadata`` (v2 or v3) is converted on the device to easykv's ragged form
(:func:`runtime_from_easydel`, a ``RaggedStep``: a position and a slot per token, page table,
lengths): the new K/V are written through easykv's one write primitive in the view's
``concatenate_to_cache``, and the operation attends with ``easykv.paged_attention``.

Numerics: easykv attends in float32 (scores, softmax, weighted sum) and returns the query dtype,
as EasyDeL's v3 kernel does; the written K/V bits equal EasyDeL's own cache. EasyDeL's v2 kernel
computes attention in bfloat16 whatever the model dtype, so greedy tokens on EasyDeL's own v2
cache can drift from easykv's (and from its own v3) on near ties; in bfloat16 models a
different float32 summation order can, rarely, round an exact bfloat16 tie the other way.

:func:`attach_store` extends an eSurge engine's prefix cache to a shared prefix store (``store=`` a URL with
``model_id=``, or a ``PrefixStore``): prompt pages eSurge's cache misses are read from it, every full page eSurge
caches is written to it in the background (``easykv.integrations._easydel_store`` says how and what it wraps).

Conversions (pure functions; JSON works without EasyDeL installed):

* :func:`metadata_from_easydel_config` / :func:`easydel_config_json` /
  :func:`easydel_config_from_metadata`: ``RaggedPagesCacheConfig`` (object, dict or JSON; v2 and
  v3) <-> ``PagedAttentionCacheMetaData``. ``num_pages`` <-> ``num_pages_per_layer``,
  ``max_model_length`` <-> ``max_sequences``, ``max_num_pages_per_req`` <->
  ``num_pages_per_sequence``, ``kv_head_shards`` / ``data_parallel_size`` <-> the kv-head and page
  shard counts (mesh axis names from the partition manager, default ``tp`` / ``dp``),
  ``_kvdtype_str`` <-> ``dtype``, ``max_num_reqs`` <-> ``batch_size`` (-1 is EasyDeL's
  ``get_max_num_seqs`` default), ``num_slices_per_kv_cache_update_page`` is derived as EasyDeL
  derives it. Round trips are exact except easykv's ``memory_bytes_per_device`` (a record of the
  budget the pool was sized from; EasyDeL has no field for it).
* :func:`partition_manager_from_easydel`: an eformer/EasyDeL ``PartitionManager`` or
  ``PartitionAxis`` as easykv's (kv heads <- ``KV_HEAD``, pages <- EasyDeL's ``ATTN_DP``, batch,
  sequence, head, head_dim, hidden; resolved in prefill mode like EasyDeL's ragged cache; mesh
  axes of size 1 dropped). Every function here that takes a partition manager takes either.
* :func:`quantizer_from_easydel`: ``EasyQuantizer`` / ``QuantizationConfig`` /
  ``QuantizationType`` -> easykv's quantizer name: INT8 (and AFFINE bits=8) -> ``int8``; NVFP8,
  MXFP8 -> ``fp8``; AFFINE bits=4 (scale + bias per group) -> ``int4-g<group_size>-asym``
  (EasyDeL's default group 64; ``int4-asym`` when the group covers head_dim). easykv's
  ``int8`` / ``fp8`` keep one scale per token and kv head: an explicit smaller ``group_size``
  is refused.
* :func:`runtime_from_easydel` (traceable) and :func:`easydel_metadata_from_easykv` (host, to
  drive an EasyDeL model from easykv's ``PageManager``).

Refused, with an error naming the object and the supported alternative (nothing is converted or
dropped silently): cache versions other than v2/v3; MLA, TurboQuant and unified-attention cache
configs; ``k_headdim != v_headdim``; float8 / fp64 KV dtypes (use ``quantizer='fp8'`` / fp32);
configs never sized (``num_pages=-1``), with per-layer geometries, window-aware caps or a token
budget set; a ``kv_head_shards`` that does not divide the kv heads (EasyDeL v2 can split one
head's K and V), or shard counts the given mesh cannot produce; NF4, MXFP4, NVFP4, ternary,
binary, TurboQuant, simulated (QAT) quantization, ``runtime_dtype``, affine bit widths other than
4 and 8; at run time two-sided sliding windows; models with
non-attention (recurrent, hybrid), MLA or KV-shared layers, and attention operations other than
the ragged-page ones.

Without EasyDeL installed the JSON, partition and quantizer functions work; everything that needs
EasyDeL's classes raises ImportError naming ``pip install 'easykv[easydel]'``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from jax.sharding import Mesh

from easykv.integrations._easydel_config import (
    ConfigValue,
    config_dict_from_metadata,
    config_json_from_metadata,
    metadata_from_config,
    partition_manager_from_easydel,
    quantizer_from_easydel,
)
from easykv.integrations._easydel_runtime import runtime_from_easydel
from easykv.manager.coordinator import single_group
from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.step.metadata import StepInput

if TYPE_CHECKING:  # at run time loaded on first use (`__getattr__`): they need EasyDeL
    from easykv.integrations._easydel_model import (
        EasyKVCache,
        EasyKVCacheView,
        EasyKVRaggedPageAttnV2,
        EasyKVRaggedPageAttnV3,
    )

_INSTALL = "pip install 'easykv[easydel]'"
_MODEL_NAMES = ("EasyKVCache", "EasyKVCacheView", "EasyKVRaggedPageAttnV2", "EasyKVRaggedPageAttnV3")


def _model_module() -> ModuleType:
    try:
        from easykv.integrations import _easydel_model
    except ImportError as err:
        raise ImportError(f"this part of easykv.integrations.easydel needs EasyDeL 0.3 ({err}); install it with "
                          f"{_INSTALL}") from err
    return _easydel_model


def __getattr__(name: str) -> type:
    if name in _MODEL_NAMES:
        cls: type = getattr(_model_module(), name)
        return cls
    raise AttributeError(f"module 'easykv.integrations.easydel' has no attribute {name!r}")


def use_easykv(model: Any, *, num_pages_per_layer: int | None = None, memory_bytes_per_device: int | None = None,
               hbm_utilization: float | None = None, quantizer: object = None, partition_manager: object = None,
               attention_options: dict[str, int | str | None] | None = None) -> Any:
    """Make an EasyDeL 0.3 model (and eSurge engines built on it) run its paged attention on easykv.

    Args:
      model: an EasyDeL ``EasyDeLBaseModule`` whose layers are all standard attention.
      num_pages_per_layer: fix the pool size (default: easykv sizes it from device memory).
      memory_bytes_per_device: the per-device budget easykv sizes the pool from.
      hbm_utilization: overrides the fraction eSurge passes (its ``hbm_utilization``).
      quantizer: easykv quantizer name or object, or EasyDeL's quantizer objects (mapped); default:
        the model config's ``kv_cache_quantization_config``.
      partition_manager: easykv's or EasyDeL's; default: the model config's, mapped.
      attention_options: extra keywords of ``easykv.paged_attention``: ``query_block`` (query rows
        per block of a prefill chunk, default 32: smaller compiles faster, larger prefills
        faster), ``pages_per_block``, ``implementation``.

    Returns the model to use: the same object, changed in place, or (when its attention mechanism
    was not ragged-page) a rebuilt one sharing its weights.
    """
    m = _model_module()
    from easydel.caching import RaggedPagesCacheView
    from easydel.infra.base_module import EasyDeLBaseModule

    if not isinstance(model, EasyDeLBaseModule):
        raise ValueError(f"use_easykv takes an EasyDeL 0.3 model (EasyDeLBaseModule), got {type(model).__name__}")
    if num_pages_per_layer is not None and memory_bytes_per_device is not None:
        raise ValueError("give num_pages_per_layer (a fixed pool) or memory_bytes_per_device (a budget), not both")
    text = model.config.get_text_config()
    mech = str(getattr(text.attn_mechanism, "value", text.attn_mechanism))
    if "multi_latent" in mech:
        raise ValueError(f"attn_mechanism={mech!r}: multi-latent (MLA) caches hold one latent per token; easykv "
                         "stores K and V per kv head. Serve MLA models with EasyDeL's own MLARaggedPagesCache")
    if mech not in m.RAGGED_MECHANISMS:
        graphdef = model.new_graphdef(attn_mechanism="ragged_page_attention_v3", recursive_update=True)
        model = model.merge_module(graphdef, model.graphstate, model.graphother)
    if text.get_kv_shared_layer_mapping():
        raise ValueError("this model shares K/V between layers (num_kv_shared_layers); an easykv cache has one view "
                         "per layer. Serve it with EasyDeL's own cache")
    views = model.get_operations_cache_view()
    other = sorted({cls.__name__ for cls in views.values() if cls is not RaggedPagesCacheView})
    if other:
        raise ValueError(f"layers of this model need {other} caches; easykv replaces ragged-page attention caches only "
                         "(recurrent, hybrid and MLA layers: use EasyDeL's HybridCache)")
    _, heads, dim = m.model_geometry(model)
    for path, attn in _attention_modules(model):
        got = (int(getattr(attn, "num_key_value_heads", heads)), int(getattr(attn, "head_dim", dim)))
        if got != (heads, dim):
            raise ValueError(f"{path} has {got[0]} kv heads of {got[1]} dims, the config "
                             f"{heads} of {dim}: an easykv cache has one geometry for all layers")
    qname = None if quantizer is None else quantizer_from_easydel(quantizer, head_dim=dim)
    pm = None if partition_manager is None else partition_manager_from_easydel(partition_manager, mesh=model.mesh)
    settings = m.Settings(num_pages_per_layer=num_pages_per_layer, memory_bytes_per_device=memory_bytes_per_device,
                          hbm_utilization=hbm_utilization, quantizer=qname, partition_manager=pm,
                          attention=m.attention_options(attention_options))
    cls = m.model_class(type(model), settings)
    # The config's KV quantization must map: fail here (model unchanged), not in eSurge.
    m.resolve_quantizer(model, settings)
    m.install_attention(model, settings.attention)
    model.__class__ = cls
    return model


def attach_store(engine: Any, store: Any, *, model_id: str | None = None) -> Any:
    """Extend an eSurge engine's prefix cache to a shared prefix store: a prompt's full pages eSurge's own cache
    misses are read from the store into its pages, and every full page it caches is written there in the
    background (the step never waits). Engines of the same model id and cache format share the pages, in any
    process, across restarts; an ``easykv.Runner`` of the same metadata and model id shares them too.

    Called on the engine, not in `use_easykv`: the store serves an engine's scheduler and page pool (one model may
    back several engines, each with its own), eSurge gives the model no handle on them, and
    ``eSurge.update_model_weights`` builds a new scheduler for new weights, which must be attached anew under the
    new weights' model id (the old id's pages hold the old weights' K/V).

    Args:
      engine: an ``easydel.eSurge`` built on a `use_easykv` model, single process, data-parallel size 1, prefix
        caching on (its default).
      store: a store URL (``file:///dir``, ``memory://name``, ``gs://...``, ``redis://host:6379/0``; opened here and
        closed by ``detach()``) or an ``easykv.tiers.store.PrefixStore`` (its read policy and queue apply).
      model_id: with a URL, the name and revision of the weights (e.g. ``'meta-llama/Llama-3.2-1B@main'``), the same
        in every engine that may share pages; easykv never guesses it. Not with a `PrefixStore` (it carries one).

    Returns:
      the attached store: ``.store.metrics()`` (pages read, values written, refused, dropped), ``.pages_read``,
      ``.flush()``, ``.detach()``.

    Raises:
      TypeError: ``engine`` is no eSurge engine, or ``store`` no URL or `PrefixStore`.
      ValueError: a bad URL, a missing or superfluous ``model_id``, a `PrefixStore` serving another engine or
        runner, or an engine the store cannot serve (not on easykv pages, without prefix caching, data parallel,
        several kv-cache groups or processes); nothing is changed.
    """
    _model_module()
    from easykv.integrations import _easydel_store

    return _easydel_store.attach(engine, store, model_id)


def _attention_modules(model: Any) -> Iterator[tuple[str, Any]]:
    from easydel.layers.attention import AttentionModule
    from easydel.utils.traversals import iter_module_search

    for path, module in iter_module_search(model, AttentionModule):
        yield ".".join(map(str, path)), module


def metadata_from_easydel_config(config: object, *, mesh: Mesh | None = None, partition_manager: object = None,
                                 batch_size: int | None = None, quantizer: object = None,
                                 ) -> PagedAttentionCacheMetaData:
    """easykv metadata for an EasyDeL ``RaggedPagesCacheConfig`` (v2 or v3).

    EasyDeL's config keeps shard counts, not mesh axes: the axes come from ``partition_manager``.

    Args:
      config: the config: the object, a dict of its fields, or its ``to_json()``; a config never
        sized (``num_pages=-1``) or with fields easykv cannot keep is refused (module doc).
      mesh: the mesh the axes are checked against (each shard count must be the product of its
        axes' sizes); None (default): not checked.
      partition_manager: easykv's or EasyDeL's; None (default): ``tp`` for kv heads, ``dp`` for
        pages.
      batch_size: sequences of the cache, needed only when ``max_num_reqs`` is -1 (None: EasyDeL's
        own ``get_max_num_seqs`` figure); must equal ``max_num_reqs`` otherwise.
      quantizer: easykv's or EasyDeL's, sets ``quantization`` (EasyDeL keeps KV quantization
        outside the cache config); None (default): unquantized.

    Returns:
      the `PagedAttentionCacheMetaData`.
    """
    return metadata_from_config(config, mesh=mesh, partition_manager=partition_manager, batch_size=batch_size,
                                quantizer=quantizer)


def easydel_config_json(meta: PagedAttentionCacheMetaData, *, version: str = "v3") -> str:
    """The JSON of the EasyDeL 0.3 ``RaggedPagesCacheConfig`` describing the same pool, byte for
    byte what that config's ``to_json()`` writes. Refuses quantized metadata (convert
    ``dataclasses.replace(meta, quantization='none')`` and set the quantizer on the model) and,
    for v3, kv-head splits EasyDeL's packed layout cannot make.

    Args:
      meta: the `PagedAttentionCacheMetaData`, unquantized, with its dtype and kv-head layout set;
        layer groups only of the cache-wide geometry, format and pool.
      version: ``"v3"`` (default) or ``"v2"``, the config's cache version.
    """
    return config_json_from_metadata(meta, version=version)


def easydel_config_dict(meta: PagedAttentionCacheMetaData, *, version: str = "v3") -> dict[str, ConfigValue]:
    """:func:`easydel_config_json` as a dict.

    Args:
      meta: the `PagedAttentionCacheMetaData` (as `easydel_config_json`'s).
      version: ``"v3"`` (default) or ``"v2"``.
    """
    return config_dict_from_metadata(meta, version=version)


def easydel_config_from_metadata(meta: PagedAttentionCacheMetaData, *, version: str = "v3") -> Any:
    """:func:`easydel_config_json` as EasyDeL's ``RaggedPagesCacheConfig`` object (needs EasyDeL).

    Args:
      meta: the `PagedAttentionCacheMetaData` (as `easydel_config_json`'s).
      version: ``"v3"`` (default) or ``"v2"``.
    """
    return _model_module().easydel_config_from_metadata(meta, version=version)


def easydel_metadata_from_easykv(metadata: StepInput | tuple[StepInput, ...], *, page_size: int,
                                 version: str = "v3", padded_num_slices: int | None = None) -> Any:
    """EasyDeL's ``RaggedPagesMetadata`` for a host-side easykv step in the ragged form, to run an
    EasyDeL model forward on either cache (needs EasyDeL).

    Unassigned page-table entries (-1) and padding positions become 0, as EasyDeL's engine leaves
    them. v3 gets ``request_distribution`` (decodes, decodes + prefills, sequences); v2 gets
    ``slot_mapping`` as EasyDeL's page-contiguous slices and ``num_kv_update_slices``.

    Args:
      metadata: one step with numpy values, a `RaggedStep` or a mixed-form `PagedAttentionMetadata`
        (``PagedAttentionMetadata.for_mixed``), or a plan's ``plan.metadata``, the tuple of a cache of
        one layer group (EasyDeL hands every layer one page table; several are refused).
      page_size: tokens per page of the cache.
      version: ``"v3"`` (default) or ``"v2"``.
      padded_num_slices: v2 only: the slices ``slot_mapping`` is padded to, ``(3,
        padded_num_slices)``; None (default): one per token.
    """
    if isinstance(metadata, (tuple, list)):  # the manager's per-group answer: its one item, or a refusal
        metadata = single_group(tuple(metadata))
    return _model_module().easydel_metadata_from_easykv(metadata, page_size=page_size, version=version,
                                                        padded_num_slices=padded_num_slices)


def unquantized(meta: PagedAttentionCacheMetaData) -> PagedAttentionCacheMetaData:
    """``meta`` without its quantizer (what EasyDeL's cache config can describe).

    Args:
      meta: a `PagedAttentionCacheMetaData`; its ``quantization`` becomes ``"none"``.
    """
    return dataclasses.replace(meta, quantization="none")


__all__ = [
    "EasyKVCache",  # loaded on first use (__getattr__): needs EasyDeL
    "EasyKVCacheView",  # loaded on first use (__getattr__): needs EasyDeL
    "EasyKVRaggedPageAttnV2",  # loaded on first use (__getattr__): needs EasyDeL
    "EasyKVRaggedPageAttnV3",  # loaded on first use (__getattr__): needs EasyDeL
    "attach_store",
    "easydel_config_dict",
    "easydel_config_from_metadata",
    "easydel_config_json",
    "easydel_metadata_from_easykv",
    "metadata_from_easydel_config",
    "partition_manager_from_easydel",
    "quantizer_from_easydel",
    "runtime_from_easydel",
    "unquantized",
    "use_easykv",
]
