"""EasyDeL 0.3 cache configs, partition rules and quantizers, as easykv's (no EasyDeL import).

Everything here reads EasyDeL's objects by their fields (``RaggedPagesCacheConfig``'s JSON, an
eformer ``PartitionAxis``'s rules, a ``QuantizationConfig``'s dtype/bits/group_size), so JSON
can be converted on a machine without EasyDeL. Objects easykv cannot honour raise an error
that names them and the supported alternative; nothing is dropped or converted silently.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, TypeAlias

import numpy as np
from jax.sharding import Mesh
from jax.typing import DTypeLike

from easykv.quantization import Quantizer, get_quantizer
from easykv.sharding import KV_HEAD, PAGE, PartitionAxis, PartitionManager
from easykv.spec.groups import LayerGroup, group_pattern
from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.validation import parse_json, positive_int, show

VERSIONS = ("v2", "v3")

# RaggedPagesCacheConfig's fields in EasyDeL 0.3's order (its to_json writes them so), with the
# defaults its dataclass declares for the optional ones.
_REQUIRED = ("num_hidden_layers", "max_model_length", "num_kv_heads", "k_headdim", "v_headdim")
_DEFAULTS: dict[str, Any] = {
    "hbm_utilization": 0.9, "data_parallel_size": 1, "kv_head_shards": 1, "page_size": 128, "num_pages": -1,
    "max_num_pages_per_req": -1, "num_slices_per_kv_cache_update_page": -1, "max_num_tokens": -1,
    "max_num_reqs": -1, "window_aware_max_num_seqs": -1, "window_aware_pages_per_request": -1,
    "window_aware_max_num_batched_tokens": -1, "version": "v3", "_kvdtype_str": "bf16", "_mixed_layer_configs": None,
}  # fmt: skip
FIELDS = _REQUIRED + tuple(_DEFAULTS)
# A value of a RaggedPagesCacheConfig's JSON as easykv writes it (`config_dict_from_metadata`).
ConfigValue: TypeAlias = int | float | str | None

# EasyDeL's dtype strings (eformer's map) for the cache dtypes easykv stores.
_DTYPE_IN = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
             "fp32": "float32", "float32": "float32"}
_DTYPE_OUT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

_NOT_RAGGED = {
    "MLARaggedPagesCacheConfig": "a multi-latent (MLA) cache stores one latent vector per token, easykv stores "
                                 "K and V per kv head; serve MLA models with EasyDeL's own MLARaggedPagesCache",
    "TurboQuantRaggedPagesCacheConfig": "TurboQuant pages (codebooks + QJL signs) have no easykv counterpart; use "
                                        "a RaggedPagesCacheConfig with quantizer='int4-rot' (4 bits after "
                                        "a fixed rotation, as TurboQuant) or 'int8-rot'",
    "UnifiedAttentionCacheConfig": "a unified-attention cache (K and V in separate [pages, page_size, heads, dim] "
                                   "arrays for GPU kernels) is not a RaggedPagesCacheConfig; use the model with "
                                   "attn_mechanism='ragged_page_attention_v3' (or 'v2')",
}  # fmt: skip


# ---- RaggedPagesCacheConfig <-> PagedAttentionCacheMetaData -------------------------------------
def config_dict(config: object) -> dict[str, Any]:
    """A RaggedPagesCacheConfig (object, dict or its JSON) as a plain dict of its fields."""
    name = type(config).__name__
    if name in _NOT_RAGGED:
        raise ValueError(f"{name} cannot be mapped to easykv: {_NOT_RAGGED[name]}")
    if isinstance(config, (str, bytes)):
        data = parse_json(config, what="RaggedPagesCacheConfig JSON")
    elif isinstance(config, dict):
        data = dict(config)
    elif dataclasses.is_dataclass(config) and not isinstance(config, type) and hasattr(config, "k_headdim"):
        data = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    else:
        raise ValueError(f"expected an EasyDeL RaggedPagesCacheConfig, a dict of its fields or its JSON, got "
                        f"{name}: {show(config)}")
    if not isinstance(data, dict):
        raise ValueError(f"RaggedPagesCacheConfig JSON must be an object, got {show(data)}")
    return data


def _check_fields(data: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(data) - set(FIELDS))
    if "head_dim" in unknown and "k_headdim" not in data:
        raise ValueError(f"this JSON is an EasyDeL UnifiedAttentionCacheConfig (it has 'head_dim', not 'k_headdim'): "
                         f"{_NOT_RAGGED['UnifiedAttentionCacheConfig']}")
    if "turboquant_config" in unknown:
        raise ValueError(f"this JSON is an EasyDeL TurboQuantRaggedPagesCacheConfig: "
                         f"{_NOT_RAGGED['TurboQuantRaggedPagesCacheConfig']}")
    if unknown:
        raise ValueError(f"RaggedPagesCacheConfig has no fields {unknown}; EasyDeL 0.3 writes {list(FIELDS)} (a "
                         "config from another EasyDeL version is not read, rather than guessed)")
    missing = [f for f in _REQUIRED if f not in data]
    if missing:
        raise ValueError(f"RaggedPagesCacheConfig is missing the required fields {missing}")
    return {**_DEFAULTS, **data}


def _int(data: dict[str, Any], name: str, *, lo: int = 1) -> int:
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"RaggedPagesCacheConfig.{name} must be an int, got {show(value)}")
    if value < lo:
        raise ValueError(f"RaggedPagesCacheConfig.{name}={value} must be >= {lo}")
    return int(value)


def _unset(data: dict[str, Any], name: str, why: str) -> None:
    if data[name] not in (-1, None):
        raise ValueError(f"RaggedPagesCacheConfig.{name}={show(data[name])} cannot be kept: {why}; leave it at -1")


def default_batch_size(pages_per_sequence: int) -> int:
    """EasyDeL's request cap when ``max_num_reqs`` is -1 (its ``get_max_num_seqs`` heuristic)."""
    return max(1, 1024 * 1024 // 2 // pages_per_sequence // 4)


def update_slices(page_size: int, num_kv_heads: int, head_dim: int, dtype: DTypeLike) -> int:
    """The v2 write kernel's slices per 16 MiB processing page, as EasyDeL derives it from one
    page's bytes (K and V heads padded to 32-bit packing, head_dim padded to 128), at most 64."""
    bits = np.dtype(dtype).itemsize * 8
    packing = 32 // bits
    heads = -(-2 * num_kv_heads // packing) * packing
    page_bytes = page_size * heads * (-(-head_dim // 128) * 128) * bits // 8
    slices = (16 * 1024 * 1024) // page_bytes
    if slices <= 0:
        raise ValueError(f"one page of {page_bytes} bytes exceeds EasyDeL's 16 MiB update page; "
                         "use a smaller page_size")
    return min(1 << (slices.bit_length() - 1), 64)


def v3_storage_groups(num_kv_heads: int, head_dim: int, dtype: DTypeLike) -> int:
    """How many packed K/V head groups EasyDeL's v3 layout shards over the kv-head axis."""
    packing = 32 // (np.dtype(dtype).itemsize * 8)
    combined = num_kv_heads if head_dim == 64 else 2 * num_kv_heads
    return -(-combined // packing)


def metadata_from_config(config: object, *, mesh: Mesh | None = None, partition_manager: object = None,
                         batch_size: int | None = None, quantizer: object = None) -> PagedAttentionCacheMetaData:
    """See ``easykv.integrations.easydel.metadata_from_easydel_config``."""
    data = _check_fields(config_dict(config))
    version = data["version"]
    if version not in VERSIONS:
        raise ValueError(f"RaggedPagesCacheConfig version {show(version)} is not supported: easykv maps EasyDeL 0.3's "
                         f"'v2' and 'v3' ragged-page caches; recreate the config with version='v3'")
    layers, length, heads = (_int(data, n) for n in ("num_hidden_layers", "max_model_length", "num_kv_heads"))
    k_dim, v_dim, page_size = (_int(data, n) for n in ("k_headdim", "v_headdim", "page_size"))
    if k_dim != v_dim:
        raise ValueError(f"k_headdim={k_dim} differs from v_headdim={v_dim} (an MLA latent layout?): easykv pages hold "
                         "K and V with one head_dim; only configs with k_headdim == v_headdim map")
    dtype = _dtype_from_easydel(data["_kvdtype_str"])
    if data["num_pages"] in (-1, None) or _int(data, "num_pages", lo=-1) <= 0:
        raise ValueError(f"RaggedPagesCacheConfig.num_pages={show(data['num_pages'])}: the config was never sized; "
                         "build it with RaggedPagesCacheConfig.create(...) or give num_pages")
    num_pages = _int(data, "num_pages")
    per_seq = math.ceil(length / page_size)
    if data["max_num_pages_per_req"] not in (-1, per_seq):
        raise ValueError(f"max_num_pages_per_req={show(data['max_num_pages_per_req'])} differs from "
                         f"ceil(max_model_length / page_size) = {per_seq}; easykv derives it, fix the config")
    slices = update_slices(page_size, heads, k_dim, dtype)
    if data["num_slices_per_kv_cache_update_page"] not in (-1, slices):
        raise ValueError(f"num_slices_per_kv_cache_update_page={show(data['num_slices_per_kv_cache_update_page'])} "
                         f"differs from the {slices} EasyDeL derives for this page; it tunes EasyDeL's TPU v2 write "
                         "kernel, easykv's write has no such knob and would write back the derived value: set it to "
                         f"-1 or {slices}")
    _unset(data, "max_num_tokens", "a per-step token budget is an engine setting in easykv (pad_tokens_to of "
                                   "PageManager.build_step_metadata), not cache metadata")
    for name in ("window_aware_max_num_seqs", "window_aware_pages_per_request", "window_aware_max_num_batched_tokens"):
        _unset(data, name, "eSurge's window-aware runtime caps have no easykv counterpart (easykv sizes every "
                           "sequence for max_model_length; run eSurge with enable_window_aware_runtime_cap=False)")
    if data["_mixed_layer_configs"] is not None:
        raise ValueError("_mixed_layer_configs is set: this model has per-layer kv-head counts or head sizes; "
                         "an easykv cache has one geometry for all layers (one cache per geometry is not supported "
                         "here)")
    max_reqs = _int(data, "max_num_reqs", lo=-1)
    if max_reqs > 0 and batch_size is not None and int(batch_size) != max_reqs:
        raise ValueError(f"batch_size={show(batch_size)} contradicts the config's max_num_reqs={max_reqs}")
    if max_reqs > 0:
        batch_size = max_reqs
    elif batch_size is None:
        batch_size = default_batch_size(per_seq)
    head_shards, page_shards = _int(data, "kv_head_shards"), _int(data, "data_parallel_size")
    if heads % head_shards:
        raise ValueError(f"kv_head_shards={head_shards} does not divide num_kv_heads={heads} (EasyDeL's v2 layout may "
                         "split one head's K and V over two devices): easykv shards whole kv heads; use a kv-head "
                         f"mesh axis whose size divides {heads}, or replicate the heads (kv_head_shards=1)")
    pm = partition_manager_from_easydel(partition_manager, mesh=mesh) if partition_manager is not None else None
    head_axes = _axes_for(head_shards, pm.rules.mesh_axes(KV_HEAD) if pm else ("tp",), mesh, "kv_head_shards")
    page_axes = _axes_for(page_shards, pm.rules.mesh_axes(PAGE) if pm else ("dp",), mesh, "data_parallel_size")
    return PagedAttentionCacheMetaData(
        batch_size=positive_int("batch_size", batch_size), num_hidden_layers=layers, num_pages_per_layer=num_pages,
        num_pages_per_sequence=per_seq, max_sequences=length, page_size=page_size, num_kv_heads=heads,
        kv_head_dim_size=k_dim, hbm_utilization=data["hbm_utilization"], dtype=dtype,
        quantization=quantizer_from_easydel(quantizer, head_dim=k_dim), kv_head_mesh_axes=head_axes,
        kv_head_shards=head_shards, page_mesh_axes=page_axes, page_shards=page_shards,
    )  # fmt: skip


def _axes_for(shards: int, axes: tuple[str, ...], mesh: Mesh | None, what: str) -> tuple[str, ...]:
    """The mesh axes that split a dimension into ``shards`` (EasyDeL's config keeps only counts)."""
    if shards == 1:
        return ()
    if not axes:
        raise ValueError(f"{what}={shards} but the partition rules shard that dimension over no mesh axis; pass the "
                         "partition manager the cache was made with")
    if mesh is not None:
        missing = [a for a in axes if a not in mesh.shape]
        size = math.prod(mesh.shape[a] for a in axes if a in mesh.shape)
        if missing or size != shards:
            raise ValueError(f"{what}={shards} cannot be laid out on this mesh: the partition rules name mesh axes "
                             f"{axes} ({'missing ' + str(missing) if missing else 'of size ' + str(size)}); use the "
                             "mesh and partition manager the config was created with")
    return tuple(axes)


def _dtype_from_easydel(name: object) -> np.dtype:
    if not isinstance(name, str):
        raise ValueError(f"_kvdtype_str must be a dtype string such as 'bf16', got {show(name)}")
    if name in _DTYPE_IN:
        return np.dtype(_DTYPE_IN[name])
    if "8" in name and ("fp" in name or "float" in name):
        raise ValueError(f"KV dtype {name!r}: easykv stores float8 K/V as quantized pages; use dtype='bf16' with "
                         "quantizer='fp8' (float8_e4m3fn codes with a scale per token and kv head)")
    raise ValueError(f"KV dtype {name!r} is not an easykv cache dtype; use one of {sorted(_DTYPE_OUT.values())} "
                     "(fp64 pages: use 'fp32')")


def layer_groups_from_model(text_config: object) -> tuple[LayerGroup, ...] | None:
    """The layer groups of an EasyDeL (HF-style) text config whose ``layer_types`` mix
    ``"sliding_attention"`` (window ``sliding_window``) and ``"full_attention"`` layers (gpt-oss,
    Gemma 2/3), as EasyDeL's attention modules read them; None for any other model (its windows,
    if any, reach the attention at run time only)."""
    types_ = getattr(text_config, "layer_types", None)
    window = getattr(text_config, "sliding_window", None)
    if not isinstance(types_, (list, tuple)) or "sliding_attention" not in types_:
        return None
    if set(types_) - {"sliding_attention", "full_attention"} or not isinstance(window, int) or window <= 0:
        return None
    pattern = "".join("S" if t == "sliding_attention" else "F" for t in types_)
    return group_pattern(len(types_), pattern, S=dict(attention="sliding", window=window), F=dict(attention="full"))


def with_model_groups(meta: PagedAttentionCacheMetaData, groups: tuple[LayerGroup, ...] | None,
                      ) -> PagedAttentionCacheMetaData:
    """``meta`` (a uniform cache) with ``groups``, each in the cache-wide geometry and the one
    pool: EasyDeL hands every layer the same page table, so the groups share page ids and
    differ only in the window attention applies."""
    if groups is None:
        return meta
    if len(groups) == 1 and not groups[0].windowed:
        return meta
    return meta.replace(layer_groups=tuple(
        dataclasses.replace(g, num_kv_heads=meta.num_kv_heads, key_head_dim=meta.kv_head_dim_size,
                            value_head_dim=meta.kv_head_dim_size, num_pages=meta.num_pages_per_layer,
                            kv_head_mesh_axes=meta.kv_head_mesh_axes, kv_head_shards=meta.kv_head_shards)
        for g in groups))


def shares_one_table(meta: PagedAttentionCacheMetaData) -> bool:
    """Whether every layer group has the cache-wide geometry, format and pool (one page table
    and one EasyDeL config fit all)."""
    return meta.has_one_format and all(not g.latent and g.num_pages == meta.num_pages_per_layer
               and (g.num_kv_heads, g.key_head_dim, g.value_head_dim) ==
               (meta.num_kv_heads, meta.kv_head_dim_size, meta.kv_head_dim_size) for g in meta.groups)


def config_dict_from_metadata(meta: PagedAttentionCacheMetaData, *, version: str = "v3",
                              ) -> dict[str, ConfigValue]:
    """See ``easykv.integrations.easydel.easydel_config_json``."""
    if not isinstance(meta, PagedAttentionCacheMetaData):
        raise ValueError(f"expected an easykv PagedAttentionCacheMetaData, got {type(meta).__name__}")
    if version not in VERSIONS:
        raise ValueError(f"version {show(version)}: EasyDeL 0.3 ragged-page caches are 'v2' or 'v3'")
    if meta.quantization != "none":
        raise ValueError(f"the metadata has quantization={meta.quantization!r}: EasyDeL keeps KV quantization in the "
                         "model config (kv_cache_quantization_config), not in RaggedPagesCacheConfig; convert "
                         "dataclasses.replace(meta, quantization='none') and set the quantizer on the model")
    if meta.dtype is None or meta.kv_head_shards is None:
        raise ValueError("the metadata leaves dtype or the kv-head layout open; complete it first "
                         "(PagedAttentionCacheMetaData.create, or the views of an initialised cache)")
    if not meta.is_uniform and not shares_one_table(meta):
        kinds = "; ".join(f"layers {g.span}: {g.attention}, {g.num_kv_heads} kv heads x K {g.key_head_dim} / V "
                          f"{g.value_head_dim}{' latent' if g.latent else ''}, {g.num_pages} pages{g.format_note}"
                          for g in meta.groups)
        raise ValueError(f"EasyDeL's ragged-page cache addresses every layer with one page table and one geometry, "
                         f"but this metadata's layer groups differ ({kinds}); only groups of the cache-wide geometry "
                         "and format with the same pool (as use_easykv builds for sliding + full models) map to "
                         "EasyDeL")
    heads, dim, shards = meta.num_kv_heads, meta.kv_head_dim_size, meta.kv_head_shards
    if version == "v3" and shards > 1 and v3_storage_groups(heads, dim, meta.dtype) % shards:
        raise ValueError(f"EasyDeL's v3 layout packs {heads} kv heads of {meta.dtype.name} into "
                         f"{v3_storage_groups(heads, dim, meta.dtype)} groups, which kv_head_shards={shards} does not "
                         "divide; use version='v2' or a kv-head mesh axis that divides the groups")
    per_seq = meta.num_pages_per_sequence
    return {
        "num_hidden_layers": meta.num_hidden_layers, "max_model_length": meta.max_sequences, "num_kv_heads": heads,
        "k_headdim": dim, "v_headdim": dim, "hbm_utilization": meta.hbm_utilization,
        "data_parallel_size": meta.page_shards, "kv_head_shards": shards, "page_size": meta.page_size,
        "num_pages": meta.num_pages_per_layer, "max_num_pages_per_req": per_seq,
        "num_slices_per_kv_cache_update_page": update_slices(meta.page_size, heads, dim, meta.dtype),
        "max_num_tokens": -1,
        "max_num_reqs": -1 if meta.batch_size == default_batch_size(per_seq) else meta.batch_size,
        "window_aware_max_num_seqs": -1, "window_aware_pages_per_request": -1,
        "window_aware_max_num_batched_tokens": -1, "version": version, "_kvdtype_str": _DTYPE_OUT[meta.dtype.name],
        "_mixed_layer_configs": None,
    }  # fmt: skip


def config_json_from_metadata(meta: PagedAttentionCacheMetaData, *, version: str = "v3") -> str:
    return json.dumps(config_dict_from_metadata(meta, version=version))  # as EasyDeL's to_json writes it


# ---- partition rules ------------------------------------------------------------------------------
# easykv PartitionAxis field <- eformer semantic axis (resolved in prefill mode, as EasyDeL's ragged
# cache resolves its page layout; its decode_* rules do not apply to pages).
_AXIS_MAP = {"batch_axis": "__BATCH__", "sequence_axis": "__LENGTH__", "head_axis": "__HEAD__",
             "kv_head_axis": "__KV_HEAD__", "head_dim_axis": "__HEAD_DIM__", "hidden_axis": "__EMBED__"}
_ATTN_DP = "__ATTN_DP__"  # easydel.axis.ATTN_DP: the KV-page data-parallel axis


def partition_manager_from_easydel(value: object, *, mesh: Mesh | None = None) -> PartitionManager:
    """An eformer/EasyDeL ``PartitionManager`` or ``PartitionAxis`` as easykv's `PartitionManager`.

    Each rule is resolved in prefill mode, as EasyDeL's ragged cache resolves its page layout:
    kv heads from ``KV_HEAD``, pages from EasyDeL's ``ATTN_DP`` (its ``data_parallel_axis`` when
    unregistered), and batch, sequence, head, head_dim and hidden likewise. easykv's own are
    taken as they are. Works without EasyDeL installed.

    Args:
      value: an easykv `PartitionManager` (returned as it is) or `PartitionAxis` (wrapped), or an
        eformer/EasyDeL ``PartitionManager`` or ``PartitionAxis``; ValueError for anything else.
      mesh: mesh axes of size 1 on it are dropped from every rule (they split nothing); None
        (default): every axis kept.
    """
    if isinstance(value, PartitionManager):
        return value
    if isinstance(value, PartitionAxis):
        return PartitionManager(value)
    paxis: Any = getattr(value, "paxis", value)  # eformer's PartitionAxis (eformer ships no types)
    resolve = getattr(paxis, "resolve_axis", None)
    if resolve is None or not type(paxis).__module__.startswith("eformer"):
        raise ValueError(f"expected an easykv or eformer/EasyDeL PartitionManager or PartitionAxis, got "
                        f"{type(value).__name__}: {show(value)}")
    try:
        import easydel.axis  # noqa: F401  (registers ATTN_DP, the KV-page data-parallel axis)
    except ImportError:
        pass
    rules = {}
    for field, semantic in (*_AXIS_MAP.items(), ("page_axis", _ATTN_DP)):
        try:
            rule = resolve([semantic], mode="__prefill__")[0]  # eformer's MODE_PREFILL
        except ValueError as err:  # an unregistered or cyclic semantic rule
            if field != "page_axis":
                raise ValueError(f"the eformer PartitionAxis cannot resolve {semantic}: {err}") from None
            rule = paxis.data_parallel_axis  # EasyDeL's default for ATTN_DP
        rules[field] = _mesh_rule(rule, field, mesh)
    return PartitionManager(PartitionAxis(**rules))


def _mesh_rule(rule: object, field: str, mesh: Mesh | None) -> str | tuple[str, ...] | None:
    """An eformer rule (None, '_', a mesh axis name or a sequence of them) as easykv's; axes of
    size 1 on ``mesh`` are dropped (they split nothing, as EasyDeL's sizing treats them)."""
    items = list(rule) if isinstance(rule, (list, tuple)) else [rule]
    axes = []
    for item in items:
        if item is None or item == "_":
            continue
        if not isinstance(item, str) or not item:
            raise ValueError(f"the eformer rule for {field} is {show(rule)}: easykv maps mesh axis names (or None); "
                             "a rule of another kind cannot be mapped")
        if mesh is not None and mesh.shape.get(item, 1) == 1:
            continue
        axes.append(item)
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


# ---- quantizers -------------------------------------------------------------------------------------
def quantizer_from_easydel(value: Any, *, head_dim: int | None = None) -> str:
    """easykv's quantizer name for an EasyDeL quantizer: INT8 (and AFFINE bits=8) -> ``int8``;
    NVFP8, MXFP8 -> ``fp8``; AFFINE bits=4 (scale + bias per group) -> ``int4-g<group_size>-asym``
    (EasyDeL's default group 64; ``int4-asym`` when the group covers head_dim). easykv's ``int8``
    / ``fp8`` keep one scale per token and kv head: an explicit smaller ``group_size`` is refused,
    as are the kinds easykv has no counterpart for (module doc of ``easykv.integrations.easydel``).

    Args:
      value: EasyDeL's ``EasyQuantizer``, ``QuantizationConfig`` or ``QuantizationType``; an
        easykv quantizer (a name or a `Quantizer`, returned by name); None: ``"none"``.
      head_dim: the cache's head dim, needed for 4-bit affine (its group must fit) and to accept
        an int8/fp8 ``group_size`` equal to it; None (default): unknown.

    Returns:
      the quantizer's name, e.g. ``"int8"``.
    """
    name = type(value).__name__
    if value is None:
        return "none"
    if name == "EasyQuantizer":
        return quantizer_from_easydel(value.config, head_dim=head_dim)
    if name == "TurboQuantConfig":
        raise ValueError(f"TurboQuantConfig(bits={getattr(value, 'bits', '?')}) has no easykv counterpart (codebooks "
                         "and QJL signs); use quantizer='int4-rot' (a fixed rotation, then 4-bit codes with a scale "
                         "per token and kv head) or 'int8-rot'")
    if name == "QuantizationType":
        return _map_quantization(str(value), None, None, head_dim)
    if name == "QuantizationConfig":
        if getattr(value, "simulate", False):
            raise ValueError("QuantizationConfig(simulate=True) keeps full-precision values (quantization-aware "
                             "training); cached K/V are stored as real codes: use quantizer=None for full precision, "
                             "or 'int8' / 'fp8' / 'int4'")
        if getattr(value, "runtime_dtype", None) is not None:
            raise ValueError(f"QuantizationConfig(runtime_dtype={value.runtime_dtype}) has no meaning for easykv pages "
                             "(they are dequantized to the cache dtype when read); leave runtime_dtype=None")
        return _map_quantization(str(value.dtype), value.bits, value.group_size, head_dim)
    if isinstance(value, (str, Quantizer)):
        return get_quantizer(value).name  # already easykv's
    raise ValueError(f"quantizer must be None, an easykv quantizer (name or object), or EasyDeL's EasyQuantizer / "
                    f"QuantizationConfig / QuantizationType; got {name}: {show(value)}")


_REFUSED = {
    "nf4": "NF4 uses a non-uniform 16-level codebook; easykv's 4-bit format is uniform: use 'int4-g64' (or 'int4')",
    "mxfp4": "MXFP4 (E2M1 codes, E8M0 block scales) has no easykv counterpart: use 'int4-g32' (or 'int4')",
    "nvfp4": "NVFP4 (E2M1 codes, FP8 block scales) has no easykv counterpart: use 'int4-g16' (or 'int4')",
    "ternary": "ternary codes have no easykv counterpart; the smallest easykv pages are 'int4'",
    "binary": "binary codes have no easykv counterpart; the smallest easykv pages are 'int4'",
    "turboquant": "TurboQuant has no easykv counterpart (codebooks and QJL signs); its rotation is easykv's "
                  "'-rot': use 'int4-rot' or 'int8-rot'",
}


def _map_quantization(kind: str, bits: int | None, group: int | None, head_dim: int | None) -> str:
    kind = kind.lower()
    if kind in _REFUSED:
        raise ValueError(f"EasyDeL quantization {kind!r}: {_REFUSED[kind]}")
    if kind == "int8" or (kind == "affine" and bits == 8):
        if bits not in (None, 8):
            raise ValueError(f"EasyDeL int8 with bits={bits}: easykv has 8-bit ('int8') and 4-bit ('int4') pages")
        target = "int8"
    elif kind == "affine":
        if bits not in (None, 4):
            raise ValueError(f"EasyDeL affine quantization with bits={bits}: easykv has 'int8' and 'int4' pages only")
        target = "int4"
    elif kind in ("nvfp8", "mxfp8"):
        target = "fp8"
    else:
        raise ValueError(f"EasyDeL quantization {kind!r} is unknown to easykv; use one of 'int8', 'fp8', 'int4'")
    if target in ("int8", "fp8"):  # one scale per token and kv head
        if group is not None and (head_dim is None or group != head_dim):
            raise ValueError(f"EasyDeL {kind} with group_size={group}: easykv's {target!r} keeps one scale per token "
                             f"and kv head (group_size = head_dim{'' if head_dim is None else ' = ' + str(head_dim)}); "
                             f"use group_size=None, or 'int4-g{group}' for grouped scales")
        return target
    # Affine is scale + bias per group: easykv's asymmetric int4 (a zero point per group).
    group = 64 if group is None else int(group)  # EasyDeL's affine default
    if head_dim is None:
        raise ValueError("mapping EasyDeL 4-bit affine quantization needs head_dim (its group size must fit it)")
    if group >= head_dim or head_dim % group:
        if group == head_dim or group > head_dim:
            return "int4-asym"
        raise ValueError(f"EasyDeL affine group_size={group} does not divide head_dim={head_dim}; use 'int4-asym' or "
                         f"an 'int4-g<N>-asym' whose N divides {head_dim}")
    return f"int4-g{group}-asym"
