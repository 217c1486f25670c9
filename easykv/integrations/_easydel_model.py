"""EasyDeL 0.3 objects backed by easykv pages: the view, the cache, the attention operations and
the model hook (imported only when EasyDeL is installed; see ``easykv.integrations.easydel``)."""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
from easydel.caching import RaggedPagesCache, RaggedPagesCacheConfig, RaggedPagesCacheView, RaggedPagesMetadata
from easydel.layers.attention import FlexibleAttentionModule
from easydel.operations import AttentionOutput, RaggedPageAttnV2, RaggedPageAttnV3
from easydel.utils.traversals import iter_module_search
from eformer.pytree import auto_pytree, field
from jax.sharding import Mesh
from jax.typing import DTypeLike

import easykv
from easykv.integrations._easydel_config import (
    config_dict_from_metadata,
    layer_groups_from_model,
    metadata_from_config,
    partition_manager_from_easydel,
    quantizer_from_easydel,
    shares_one_table,
    with_model_groups,
)
from easykv.integrations._easydel_runtime import easydel_fields_from_easykv, ragged_fields, runtime_from_easydel
from easykv.sharding import PartitionManager
from easykv.spec.groups import AttentionKind
from easykv.spec.metadata import PagedAttentionCacheMetaData, known_dtype
from easykv.step.metadata import StepInput
from easykv.step.ragged import RaggedStep
from easykv.storage.cache import PagedAttentionCache
from easykv.storage.pages import PageLayout, StoredPages
from easykv.storage.view import PagedAttentionCacheView
from easykv.storage.writes import scatter_kv

RAGGED_MECHANISMS = ("ragged_page_attention_v3", "ragged_page_attention_v2")


def easydel_config_from_metadata(meta: PagedAttentionCacheMetaData, *, version: str = "v3") -> RaggedPagesCacheConfig:
    return RaggedPagesCacheConfig(**config_dict_from_metadata(meta, version=version))


def easydel_metadata_from_easykv(step_meta: StepInput, *, page_size: int, version: str = "v3",
                                 padded_num_slices: int | None = None) -> RaggedPagesMetadata:
    fields = easydel_fields_from_easykv(step_meta, page_size=page_size, version=version,
                                        padded_num_slices=padded_num_slices)
    arrays = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in fields.items()}
    return RaggedPagesMetadata(**arrays)


# ---- the view and the cache ---------------------------------------------------------------------
@auto_pytree
class EasyKVCacheView(RaggedPagesCacheView):
    """One layer of an easykv cache, as a view EasyDeL's attention accepts.

    ``metadata`` is the RaggedPagesCacheConfig describing this pool in EasyDeL's terms (what
    eSurge's scheduler sees); ``easykv_metadata`` and ``layout`` are easykv's. The pages are not
    held here but by the :class:`EasyKVCache` the view belongs to: its layer group's stacks
    ``(layers_in_group, num_kv_heads, num_pages, page_size, head_dim)`` in the storage dtype
    (raw bits for bf16/f16 on CPU; ``QuantizedPages`` when quantized), this layer being
    ``[layer]`` of group ``group``. A write goes into the cache's stack at that layer (in place,
    never a copy of the pool) and every view of the cache sees it: no view can hold stale pages.
    ``kv_pages`` stays None.
    """

    easykv_metadata: PagedAttentionCacheMetaData | None = field(pytree_node=False, default=None)
    layout: PageLayout | None = field(pytree_node=False, default=None)
    group: int = field(pytree_node=False, default=0)
    layer: int = field(pytree_node=False, default=0)

    @classmethod
    def init(cls, *args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError("an easykv view is made with its cache: EasyKVCache.init_cache(...), "
                                  "EasyKVCache.from_easykv(cache) or model.init_operations_cache(...) after use_easykv")

    def _owner(self) -> EasyKVCache:
        cache: EasyKVCache | None = getattr(self, "_cache", None)  # set by the cache (EasyKVCache.__post_init__)
        if cache is None:
            raise ValueError(f"this EasyKVCacheView (layer {self.layer_index}) belongs to no EasyKVCache; take views "
                             "from the cache (cache.views[i]), which holds the pages")
        return cache

    def _metadata(self) -> PagedAttentionCacheMetaData:
        """``easykv_metadata``, which every view a cache makes has (the field defaults to None only
        because EasyDeL's view fields come first)."""
        meta = self.easykv_metadata
        if meta is None:
            raise ValueError(f"this EasyKVCacheView (layer {self.layer_index}) has no easykv_metadata; take views "
                             "from the cache (cache.views[i]), which makes them with it")
        return meta

    def to_easykv(self) -> PagedAttentionCacheView:
        """This layer as easykv's PagedAttentionCacheView (the same arrays)."""
        return self._owner().to_easykv()[self.layer_index]

    @property
    def dtype(self) -> np.dtype:
        return known_dtype(self._metadata().dtype)

    @property
    def group_key_pages(self) -> StoredPages:
        """The layer group's stacked key pages, held by the cache."""
        return self._owner().key_stacks[self.group]

    @property
    def group_value_pages(self) -> StoredPages | None:
        return self._owner().value_stacks[self.group]

    @property
    def key_pages(self) -> StoredPages:
        """easykv's key pages of this layer ``(num_kv_heads, num_pages, page_size, head_dim)``
        (storage dtype): a slice of the group's stack (a copy outside jit; attention and writes
        index the stack itself)."""
        pages: StoredPages = jax.tree.map(lambda a: a[self.layer], self.group_key_pages)
        return pages

    @property
    def value_pages(self) -> StoredPages | None:
        pages: StoredPages | None = jax.tree.map(lambda a: a[self.layer], self.group_value_pages)
        return pages

    k_pages = key_pages
    v_pages = value_pages

    def flattened_kv_pages(self) -> NoReturn:
        raise NotImplementedError("easykv keeps K and V in separate (num_kv_heads, num_pages, page_size, head_dim) "
                                  "arrays, not EasyDeL's interleaved kv_pages; use key_pages / value_pages")

    def _runtime(self, cache_metadata: object, num_tokens: int) -> RaggedStep:
        meta = self._metadata()
        return runtime_from_easydel(cache_metadata, num_tokens=num_tokens, page_size=meta.page_size,
                                    num_pages=meta.num_pages_per_layer, pages_per_sequence=meta.num_pages_per_sequence)

    def concatenate_to_cache(self, key: jax.Array, value: jax.Array, cache_metadata: object) -> EasyKVCacheView:
        """Write the step's new K/V (``[batch, tokens, kv_heads, head_dim]``, flattened to the
        ragged token axis) through easykv's one write primitive into this layer of the cache's
        stacks; returns this view. K/V are cast to the cache dtype, as EasyDeL's own ragged
        cache does."""
        md = ragged_fields(cache_metadata)
        heads, dim = key.shape[-2:]
        k = jnp.reshape(key, (-1, heads, dim)).astype(self.dtype)
        v = jnp.reshape(value, (-1, heads, dim)).astype(self.dtype)
        step_meta = self._runtime(md, k.shape[0])
        cache = self._owner()
        kp, vp = scatter_kv(self.group_key_pages, self.group_value_pages, k, v, step_meta.slot_mapping, self.layer,
                            layout=self.layout)
        cache._put(self.group, kp, vp)
        return self

    def __repr__(self) -> str:
        m = self.easykv_metadata
        if m is None:
            return f"EasyKVCacheView(layer_index={self.layer_index}, no easykv_metadata)"
        return (f"EasyKVCacheView(layer_index={self.layer_index}, pages=({m.num_kv_heads}, {m.num_pages_per_layer}, "
                f"{m.page_size}, {m.kv_head_dim_size}), dtype={known_dtype(m.dtype).name}, "
                f"quantization={m.quantization})")

    __str__ = __repr__


@auto_pytree
class EasyKVCache(RaggedPagesCache):
    """All layers of an easykv cache as EasyDeL's RaggedPagesCache: ``views`` is a list, as
    EasyDeL's models read ``cache.views[i]`` and assign ``cache[i] = view``; the pages are the
    cache's, one stack per layer group (``key_stacks`` / ``value_stacks``, the arrays of
    easykv's PagedAttentionCache), shared by the views."""

    views: list[EasyKVCacheView | None]
    key_stacks: tuple[StoredPages, ...] = field(pytree_node=True, default=())
    value_stacks: tuple[StoredPages | None, ...] = field(pytree_node=True, default=())

    def __post_init__(self) -> None:
        # jax rebuilds the cache (and its views) at every transformation: the views follow it.
        for view in self.views:
            if isinstance(view, EasyKVCacheView):
                object.__setattr__(view, "_cache", self)

    def _put(self, group: int, keys: StoredPages, values: StoredPages | None) -> None:
        replace = lambda stacks, new: stacks[:group] + (new,) + stacks[group + 1:]  # noqa: E731
        object.__setattr__(self, "key_stacks", replace(tuple(self.key_stacks), keys))
        object.__setattr__(self, "value_stacks", replace(tuple(self.value_stacks), values))

    @classmethod
    def init_cache(cls, mesh: Mesh, config: object, partition_manager: object = None, quantizer: object = None, *,
                   batch_size: int | None = None) -> EasyKVCache:
        """An easykv pool sized and laid out as the EasyDeL ``config`` describes (RaggedPagesCache's
        signature; the partition manager and quantizer may be EasyDeL's or easykv's)."""
        pm = partition_manager_from_easydel(partition_manager, mesh=mesh) if partition_manager is not None else None
        meta = metadata_from_config(config, mesh=mesh, partition_manager=pm, batch_size=batch_size, quantizer=quantizer)
        return cls.from_easykv(_allocate(mesh, meta, pm), easydel_config=config)

    @classmethod
    def from_easykv(cls, cache: PagedAttentionCache, *, version: str = "v3", easydel_config: object = None,
                    ) -> EasyKVCache:
        """Wrap an easykv PagedAttentionCache (same arrays). ``easydel_config`` defaults to the
        RaggedPagesCacheConfig of its metadata in ``version``."""
        meta = cache.metadata
        if not meta.is_uniform and not shares_one_table(meta):
            raise ValueError("EasyDeL hands every layer one page table: an EasyKVCache holds layer groups of one "
                             "geometry, one format and one pool only (as use_easykv builds them), not "
                             f"{[(g.span, g.attention, g.num_pages, g.format_note) for g in meta.groups]}")
        if easydel_config is None:  # EasyDeL's config keeps no quantizer: the views' easykv metadata does
            easydel_config = easydel_config_from_metadata(dataclasses.replace(meta, quantization="none"),
                                                          version=version)
        config = easydel_config
        if not isinstance(config, RaggedPagesCacheConfig):
            config = RaggedPagesCacheConfig(**_as_config_dict(config))
        where = {i: (g, j) for g, group in enumerate(meta.groups) for j, i in enumerate(group.layers)}
        views = [EasyKVCacheView(metadata=config, layer_index=i, kv_pages=None, easykv_metadata=meta,
                                 layout=cache.layout, group=where[i][0], layer=where[i][1])
                 for i in range(meta.num_hidden_layers)]
        return cls(views=views, key_stacks=tuple(cache.key_pages), value_stacks=tuple(cache.value_pages))

    def _last_view(self) -> EasyKVCacheView:
        view = self.views[-1]
        if view is None:
            raise ValueError(f"the last of this EasyKVCache's {len(self.views)} views was set to None; put the view "
                             "back (cache.views[i] = view): the cache's metadata and layout are read from it")
        return view

    @property
    def easykv_metadata(self) -> PagedAttentionCacheMetaData:
        return self._last_view()._metadata()

    def to_easykv(self) -> PagedAttentionCache:
        """The easykv PagedAttentionCache of these pages (no copy): checkpoint it with
        ``easykv.save_cache``, hand sequences over with ``export_sequence``, ..."""
        return PagedAttentionCache(self.easykv_metadata, self.key_stacks, self.value_stacks, self._last_view().layout)

    def __repr__(self) -> str:
        return f"EasyKVCache({len(self.views)} layers, {self.views[-1]!r})"

    __str__ = __repr__


def _as_config_dict(config: object) -> dict[str, Any]:
    from easykv.integrations._easydel_config import _check_fields, config_dict

    return _check_fields(config_dict(config))


def _allocate(mesh: Mesh, meta: PagedAttentionCacheMetaData, pm: PartitionManager | None) -> PagedAttentionCache:
    if pm is None:  # the layout recorded in the metadata, as rules
        from easykv.sharding import PartitionAxis

        pm = PartitionManager(PartitionAxis(kv_head_axis=meta.kv_head_mesh_axes or None,
                                            page_axis=meta.page_mesh_axes or None))
    cache = PagedAttentionCache.init_cache(mesh, known_dtype(meta.dtype), meta, pm, meta.quantization)
    got = cache.metadata
    if (got.kv_head_shards, got.page_shards, got.num_pages_per_layer) != (
            meta.kv_head_shards, meta.page_shards, meta.num_pages_per_layer):
        raise ValueError(f"the mesh and partition rules lay the pages out as {got.kv_head_shards} kv-head x "
                         f"{got.page_shards} page shards, but the EasyDeL config says {meta.kv_head_shards} x "
                         f"{meta.page_shards}; use the mesh and partition manager the config was made for")
    return cache


# ---- attention ------------------------------------------------------------------------------------
if TYPE_CHECKING:  # what the mixin extends (its forward_native falls through to the operation's own)
    from easydel.operations import RaggedPageAttnV3 as _RaggedPageOperation
else:
    _RaggedPageOperation = object


class _EasyKVAttention(_RaggedPageOperation):
    """EasyDeL's ragged-page attention, computed by easykv when the view is an easykv view.

    Mixed into EasyDeL's two ragged-page operations, so it keeps their names (EasyDeL's own
    checks accept only ragged-page operations for ragged views), requirements and dispatch; any
    other view falls through to EasyDeL's kernel unchanged. ``easykv_options`` are extra
    keywords of ``easykv.paged_attention`` (``query_block``, ``pages_per_block``,
    ``implementation``), set by use_easykv."""

    # Set on each operation by install_attention; values of several types (the keywords').
    easykv_options: Mapping[str, Any] = types.MappingProxyType({})

    def forward_native(self, query: jax.Array, key: jax.Array | None = None, value: jax.Array | None = None,
                       cache_view: object = None, cache_metadata: object = None, softmax_scale: float | None = None,
                       logits_soft_cap: float | None = None,
                       sliding_window: int | tuple[int, int] | list[int] | None = None,
                       softmax_aux: jax.Array | None = None, **rest: object) -> AttentionOutput:
        if not isinstance(cache_view, EasyKVCacheView):
            return super().forward_native(query=query, key=key, value=value, cache_view=cache_view,
                                          cache_metadata=cache_metadata, softmax_scale=softmax_scale,
                                          logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
                                          softmax_aux=softmax_aux, **rest)
        if isinstance(sliding_window, (tuple, list)):
            raise NotImplementedError(f"sliding_window={sliding_window!r}: easykv takes one causal window size (a "
                                      "query at p sees keys in (p - window, p]); two-sided windows are not supported")
        _check_window(cache_view, sliding_window)
        step_meta = cache_view._runtime(cache_metadata, query.shape[0])
        # softmax_aux: EasyDeL's attention sinks, one logit per q head (gpt-oss), as easykv's sinks.
        out = easykv.paged_attention(query, cache_view.group_key_pages, cache_view.group_value_pages, step_meta,
                                     softmax_aux, cache_view.layer, layout=cache_view.layout,
                                     dtype=cache_view.dtype, scale=softmax_scale, sliding_window=sliding_window,
                                     logit_soft_cap=logits_soft_cap, **self.easykv_options)
        return AttentionOutput(attention_weights=None, attention_outputs=out, cache_view=cache_view)


def _check_window(view: EasyKVCacheView, sliding_window: int | None) -> None:
    """A cache with layer groups declares each layer's window: the window the model attends with
    must be the one its group declares (a grouped checkpoint or export records it)."""
    meta = view._metadata()
    if meta.is_uniform:
        return  # one full-attention group: the model's run-time window is the only one
    group = meta.groups[view.group]
    declared = group.window if group.windowed else None
    given = None if sliding_window is None else int(sliding_window)
    if group.attention is AttentionKind.CHUNKED or given != declared:
        raise ValueError(f"layer {view.layer_index} attends with sliding_window={given}, but its cache group (layers "
                         f"{group.span}) is {group.attention}{'' if declared is None else f' {declared}'}; build the "
                         "cache for this model (model.init_operations_cache after use_easykv)")


class EasyKVRaggedPageAttnV3(_EasyKVAttention, RaggedPageAttnV3):
    """``ragged_page_attention_v3`` that runs easykv's paged attention on easykv views."""


class EasyKVRaggedPageAttnV2(_EasyKVAttention, RaggedPageAttnV2):
    """``ragged_page_attention_v2`` that runs easykv's paged attention on easykv views."""


ATTENTION_OPTIONS = ("query_block", "pages_per_block", "implementation")


def attention_options(options: object) -> tuple[tuple[str, int | str | None], ...]:
    """use_easykv's ``attention_options``, checked now (not at trace time inside eSurge) by the
    rules ``easykv.paged_attention`` applies."""
    from easykv.attention.options import AttentionOptions
    from easykv.validation import show

    if options is None:
        return ()
    if not isinstance(options, dict) or set(options) - set(ATTENTION_OPTIONS):
        raise ValueError(f"attention_options={show(options)}: a dict of {ATTENTION_OPTIONS} (keywords of "
                         "easykv.paged_attention)")
    checked = AttentionOptions(**options)
    return tuple((key, getattr(checked, key)) for key in sorted(options))


def install_attention(model: Any, options: tuple[tuple[str, int | str | None], ...] = ()) -> int:
    """Swap every FlexibleAttentionModule's ragged-page operation for its easykv-aware twin (all
    checked first: a refusal changes nothing)."""
    swaps = []
    for path, flex in iter_module_search(model, FlexibleAttentionModule):
        for attr in ("impl", "impl_decode"):
            op = getattr(flex, attr, None)
            if op is None:
                continue
            if isinstance(op, _EasyKVAttention):  # use_easykv again: new options, same operation
                swaps.append((flex, attr, op))
                continue
            twin = (EasyKVRaggedPageAttnV3 if isinstance(op, RaggedPageAttnV3)
                    else EasyKVRaggedPageAttnV2 if isinstance(op, RaggedPageAttnV2) else None)
            if twin is None:
                name = op.get_impl_name() if hasattr(op, "get_impl_name") else type(op).__name__
                raise ValueError(f"{'.'.join(map(str, path))}.{attr} runs {name!r}; easykv pages are read by "
                                 f"the ragged-page operations only: set attn_mechanism (and decode_attn_mechanism) "
                                 f"to one of "
                                 f"{RAGGED_MECHANISMS}")
            swaps.append((flex, attr, twin(op.metadata)))
    for flex, attr, op in swaps:
        op.easykv_options = dict(options)
        setattr(flex, attr, op)
    return len(swaps)


# ---- the model hook -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Settings:
    """What use_easykv was given (hashable: it is part of the model class)."""

    num_pages_per_layer: int | None = None
    memory_bytes_per_device: int | None = None
    hbm_utilization: float | None = None
    quantizer: str | None = None  # None: the model config's kv_cache_quantization_config
    partition_manager: PartitionManager | None = None  # None: the model's, mapped
    attention: tuple[tuple[str, int | str | None], ...] = ()  # extra keywords of easykv.paged_attention


class EasyKVModelMixin:
    """What use_easykv adds to an EasyDeL model's class (in a same-named subclass, see
    ``model_class``): EasyDeL's (and eSurge's) cache hooks, ``create_ragged_page_cache_config``
    and ``init_operations_cache``, build easykv pools."""

    __slots__ = ()  # the model object keeps its layout (its __class__ is reassigned)
    _easykv_settings: ClassVar[Settings]
    _easykv_base: ClassVar[type]
    # The EasyDeL model's own (EasyDeLBaseModule's): its config, untyped as EasyDeL ships no types, and mesh.
    config: Any
    mesh: Mesh

    def easykv_partition_manager(self) -> PartitionManager:
        pm = self._easykv_settings.partition_manager
        return pm if pm is not None else partition_manager_from_easydel(
            self.config.get_text_config().partition_manager, mesh=self.mesh)

    def easykv_quantizer(self, quantizer: object = None) -> str:
        """The easykv quantizer for the cache: use_easykv's, else the model config's (or the
        EasyQuantizer eSurge passes); both given and different is an error."""
        return resolve_quantizer(self, self._easykv_settings, quantizer)

    def easykv_cache_metadata(self, max_length: int, *, page_size: int = 128, hbm_utilization: float = 0.9,
                              dtype: DTypeLike | None = None, batch_size: int | None = None,
                              quantizer: object = None) -> PagedAttentionCacheMetaData:
        """The easykv metadata of this model's cache (sized by easykv from device memory unless
        use_easykv fixed the pool)."""
        from easykv.integrations._easydel_config import default_batch_size

        s = self._easykv_settings
        layers, heads, dim = model_geometry(self)
        per_seq = math.ceil(max_length / page_size)
        meta = PagedAttentionCacheMetaData.create(
            self.mesh, batch_size if batch_size is not None else default_batch_size(per_seq), layers, max_length,
            page_size, heads, dim, s.hbm_utilization if s.hbm_utilization is not None else hbm_utilization,
            cache_dtype(self, dtype), partition_manager=self.easykv_partition_manager(),
            quantizer=self.easykv_quantizer(quantizer), memory_bytes_per_device=s.memory_bytes_per_device,
            num_pages_per_layer=s.num_pages_per_layer,
        )  # fmt: skip
        return with_model_groups(meta, layer_groups_from_model(self.config.get_text_config()))

    def create_ragged_page_cache_config(self, max_length: int, *, page_size: int = 128,
                                        hbm_utilization: float = 0.9, dtype: DTypeLike | None = None,
                                        ) -> RaggedPagesCacheConfig:
        meta = self.easykv_cache_metadata(max_length, page_size=page_size, hbm_utilization=hbm_utilization,
                                          dtype=dtype)
        return easydel_config_from_metadata(dataclasses.replace(meta, quantization="none"), version=cache_version(self))

    def init_operations_cache(self, batch_size: int, max_length: int, *, page_size: int = 128,
                              hbm_utilization: float = 0.9, dtype: DTypeLike | None = None, quantizer: object = None,
                              masking_details: object = None, starts: object = None, ragged_config: object = None,
                              unified_config: object = None) -> EasyKVCache:
        """An EasyKVCache for this model (eSurge calls this with the config it got from
        ``create_ragged_page_cache_config``). ``masking_details`` and ``starts`` concern
        EasyDeL's dense TransformerCache only; its ragged caches ignore them too."""
        if unified_config is not None:
            raise ValueError("unified_config: an easykv cache replaces EasyDeL's ragged-page cache, not its "
                             "UnifiedAttentionCache; run the model with a ragged-page attn_mechanism")
        del masking_details, starts
        pm = self.easykv_partition_manager()
        q = self.easykv_quantizer(quantizer)
        if ragged_config is None:
            meta = self.easykv_cache_metadata(max_length, page_size=page_size, hbm_utilization=hbm_utilization,
                                              dtype=dtype, batch_size=batch_size, quantizer=q)
            ragged_config = easydel_config_from_metadata(dataclasses.replace(meta, quantization="none"),
                                                         version=cache_version(self))
        else:
            meta = metadata_from_config(ragged_config, mesh=self.mesh, partition_manager=pm,
                                        batch_size=batch_size, quantizer=q)
            meta = with_model_groups(meta, layer_groups_from_model(self.config.get_text_config()))
            layers, heads, dim = model_geometry(self)
            if (meta.num_hidden_layers, meta.num_kv_heads, meta.kv_head_dim_size) != (layers, heads, dim):
                raise ValueError(f"ragged_config describes {meta.num_hidden_layers} layers x {meta.num_kv_heads} kv "
                                 f"heads x {meta.kv_head_dim_size} dims, the model {layers} x {heads} x {dim}")
        return EasyKVCache.from_easykv(_allocate(self.mesh, meta, pm), easydel_config=ragged_config)


def resolve_quantizer(model: Any, settings: Settings, quantizer: object = None) -> str:
    text = model.config.get_text_config()
    chosen = settings.quantizer
    given = quantizer_from_easydel(quantizer if quantizer is not None else text.kv_cache_quantization_config,
                                   head_dim=model_geometry(model)[2])
    if chosen is not None and given != "none" and given != chosen:
        raise ValueError(f"use_easykv(quantizer={chosen!r}) contradicts the model's KV quantization ({given!r}); "
                         "give one of them")
    return chosen if chosen is not None else given


_CLASSES: dict[tuple[type, Settings], type] = {}


def model_class(base: type, settings: Settings) -> type:
    """The easykv-backed subclass of an EasyDeL model class (same name; cached per settings)."""
    base = getattr(base, "_easykv_base", base)
    key = (base, settings)
    if key not in _CLASSES:
        def body(ns: dict[str, Any]) -> None:
            # The mixin goes after the base (a base in front would change the object layout and
            # forbid the __class__ swap), so its methods are copied in to take precedence.
            ns.update({k: v for k, v in vars(EasyKVModelMixin).items() if not k.startswith("__")})
            ns.update(_easykv_settings=settings, _easykv_base=base, __module__=base.__module__,
                      __qualname__=base.__qualname__, __doc__=base.__doc__)

        _CLASSES[key] = types.new_class(base.__name__, (base, EasyKVModelMixin), exec_body=body)
    return _CLASSES[key]


def model_geometry(model: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head_dim) of the model's text config."""
    text = model.config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return int(text.num_hidden_layers), int(heads), int(dim)


def cache_version(model: Any) -> str:
    mech = getattr(model.config.get_text_config(), "attn_mechanism", None)
    return "v2" if str(getattr(mech, "value", mech)) == "ragged_page_attention_v2" else "v3"


def cache_dtype(model: Any, dtype: DTypeLike | None) -> np.dtype:
    if dtype is None:
        dtype = getattr(model.config.get_text_config(), "kvdtype", None) or jnp.bfloat16
    if isinstance(dtype, str):
        from easykv.integrations._easydel_config import _dtype_from_easydel

        return _dtype_from_easydel(dtype)
    dt = np.dtype(dtype)
    if dt.itemsize == 1:  # float8 (easykv's own dtype check names the other unsupported ones)
        raise ValueError(f"kvdtype {dt.name}: easykv stores float8 K/V as quantized pages; use kvdtype=bfloat16 with "
                         "use_easykv(model, quantizer='fp8')")
    return dt
