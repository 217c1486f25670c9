"""Making a cache's metadata: `PagedAttentionCacheMetaData.create` sizes the pool from device
memory, for a uniform cache or for layer groups, and adds a host-memory tier when asked.

The metadata class calls in here with itself (``cls``), so this module never imports it: what a
sizing needs of a metadata (its bytes per page, per sequence) it asks of a probe it builds.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeVar

from easykv.quantization import get_quantizer
from easykv.sharding import ShardingAdjustedWarning
from easykv.spec.groups import LayerGroup, check_groups
from easykv.spec.layout import LayoutPlan, plan_layout
from easykv.spec.memory import MemoryBudget, device_memory_budget, devices_per_host
from easykv.validation import INT32_MAX, positive_int, show

if TYPE_CHECKING:
    from jax.sharding import AbstractMesh, Mesh


class _Metadata(Protocol):
    """What `create_metadata` needs of the metadata class it builds (`PagedAttentionCacheMetaData`)."""

    def with_host_memory(self, host_memory_bytes: int, devices_per_host: int) -> Self: ...


_M = TypeVar("_M", bound=_Metadata)


def create_metadata(cls: Callable[..., _M], mesh: Mesh | AbstractMesh, *, host_memory_bytes: int | None,
                    layer_groups: Sequence[LayerGroup] | None, stacklevel: int, **args: Any) -> _M:
    """`PagedAttentionCacheMetaData.create` (see its doc) for class ``cls``; ``args`` are its
    other arguments, by name. ``stacklevel``: the code that asked for the metadata, as
    `warnings.warn` counts frames from here; the mesh plan's adjustments are warned there, and
    each call below passes it on one frame deeper."""
    if host_memory_bytes is not None:
        meta = create_metadata(cls, mesh, host_memory_bytes=None, layer_groups=layer_groups,
                               stacklevel=stacklevel + 1, **args)
        return meta.with_host_memory(host_memory_bytes, devices_per_host(mesh))
    created: _M
    if layer_groups is not None:
        created = _create_grouped(cls, mesh, layer_groups, args, stacklevel + 1)
    else:
        created = _create_uniform(cls, mesh, stacklevel=stacklevel + 1, **args)
    return created


def _plan(mesh: Any, num_kv_heads: int, partition_manager: Any, stacklevel: int) -> LayoutPlan:
    """`plan_layout` for ``num_kv_heads``, its adjustments warned at ``stacklevel`` (see
    `create_metadata`): at the user's call of `create`, however deep in here the plan is made."""
    plan = plan_layout(mesh, num_kv_heads=num_kv_heads, partition_manager=partition_manager, emit_warnings=False)
    for message in plan.adjustments:
        warnings.warn(message, ShardingAdjustedWarning, stacklevel=stacklevel)
    return plan


def _create_uniform(cls: Callable[..., Any], mesh: Any, *, batch_size: int, num_hidden_layers: int, max_sequences: int,
                    page_size: int, num_kv_heads: int, kv_head_dim_size: int, hbm_utilization: float, dtype: Any,
                    partition_manager: Any, quantizer: Any, memory_bytes_per_device: int | None,
                    num_pages_per_layer: int | None, stacklevel: int) -> Any:
    """`create` of one full-attention group of every layer: EasyDeL's fields say it all."""
    plan = _plan(mesh, num_kv_heads, partition_manager, stacklevel + 1)
    model = (batch_size, num_hidden_layers, max_sequences, page_size, num_kv_heads, kv_head_dim_size)
    base: dict[str, Any] = dict(zip(("batch_size", "num_hidden_layers", "max_sequences", "page_size",
                                     "num_kv_heads", "kv_head_dim_size"), model))
    base.update(hbm_utilization=hbm_utilization, dtype=dtype, quantization=get_quantizer(quantizer).name,
                **{f: getattr(plan, f) for f in ("kv_head_mesh_axes", "kv_head_shards", "page_mesh_axes",
                                                  "page_shards")})
    for name in ("max_sequences", "page_size"):
        positive_int(name, base[name])
    pages_per_sequence = math.ceil(max_sequences / page_size)
    if num_pages_per_layer is not None:
        return cls(**base, num_pages_per_sequence=pages_per_sequence,
                   num_pages_per_layer=positive_int("num_pages_per_layer", num_pages_per_layer))
    # Validate every field with a one-page pool before asking the devices for memory.
    probe = cls(**base, num_pages_per_sequence=pages_per_sequence,
                num_pages_per_layer=plan.page_shards * pages_per_sequence)
    budget = _budget(mesh, probe, memory_bytes_per_device)
    per_page_all_layers = probe.page_bytes_per_device * probe.num_hidden_layers
    pages_per_shard = budget.per_device_bytes // per_page_all_layers
    # Slot ids are int32: a budget larger than that can address is capped, not an error.
    pages_per_shard = min(pages_per_shard, INT32_MAX // page_size // plan.page_shards)
    if pages_per_shard < pages_per_sequence:
        raise ValueError(
            f"the memory budget holds {pages_per_shard} pages per device but one sequence of "
            f"max_sequences={max_sequences} tokens needs {pages_per_sequence} "
            f"({per_page_all_layers} bytes per page across {num_hidden_layers} layers; budget "
            f"{budget.detail}); raise hbm_utilization or memory_bytes_per_device, or lower max_sequences"
        )
    return cls(**base, num_pages_per_sequence=pages_per_sequence,
               num_pages_per_layer=pages_per_shard * plan.page_shards,
               memory_bytes_per_device=budget.per_device_bytes)


def _budget(mesh: Any, probe: Any, memory_bytes_per_device: int | None) -> MemoryBudget:
    """The per-device budget of the devices of ``mesh`` at ``probe``'s utilization."""
    # An explicit budget needs no devices, so an AbstractMesh can plan a pod from a laptop.
    devices = () if memory_bytes_per_device is not None else tuple(mesh.devices.flat)
    return device_memory_budget(devices, probe.hbm_utilization, memory_bytes_per_device=memory_bytes_per_device)


def _create_grouped(cls: Callable[..., Any], mesh: Any, layer_groups: Any, args: dict[str, Any],
                    stacklevel: int) -> Any:
    """`create` with layer groups: each group's head split on ``mesh``, then its pool sized."""
    if isinstance(layer_groups, LayerGroup) or not isinstance(layer_groups, (tuple, list)) or not layer_groups:
        raise ValueError(f"layer_groups must be a non-empty sequence of LayerGroup, got {show(layer_groups)}")
    for i, g in enumerate(layer_groups):
        if not isinstance(g, LayerGroup):
            raise ValueError(f"layer_groups[{i}] must be a LayerGroup, got {type(g).__name__}")
    heads, dim = positive_int("num_kv_heads", args["num_kv_heads"]), positive_int("kv_head_dim_size",
                                                                                   args["kv_head_dim_size"])
    groups = [g.filled(num_kv_heads=heads, head_dim=dim) for g in layer_groups]
    uniform = (len(groups) == 1 and not groups[0].windowed and not groups[0].latent
               and (groups[0].num_kv_heads, groups[0].key_head_dim, groups[0].value_head_dim) == (heads, dim, dim))
    if uniform:  # today's cache: EasyDeL's fields say it all (its own format is the cache's)
        if groups[0].dtype is not None:
            args["dtype"] = groups[0].dtype
        if groups[0].quantization is not None:
            args["quantizer"] = groups[0].quantization
        check_groups(tuple(groups), num_layers=positive_int("num_hidden_layers", args["num_hidden_layers"]),
                     page_size=positive_int("page_size", args["page_size"]))
        if args["num_pages_per_layer"] is None and groups[0].num_pages is not None:
            args["num_pages_per_layer"] = groups[0].num_pages
        return _create_uniform(cls, mesh, stacklevel=stacklevel + 1, **args)
    pm, explicit = args["partition_manager"], [g.num_pages is not None for g in groups]
    if args["num_pages_per_layer"] is not None:
        raise ValueError("with layer_groups give each LayerGroup its num_pages (or none, to size them from "
                         f"memory), not num_pages_per_layer={show(args['num_pages_per_layer'])}")
    if any(explicit) and not all(explicit):
        raise ValueError(f"layer_groups {[i for i, e in enumerate(explicit) if not e]} have no num_pages but the "
                         "others do; give every group num_pages or none (then memory sizes them)")
    plans = []
    for g in groups:  # a loop, not a comprehension: the warnings' stack depth must not depend on it
        plans.append(_plan(mesh, g.num_kv_heads, pm, stacklevel + 1))
    top = plan_layout(mesh, num_kv_heads=max(g.num_kv_heads for g in groups), partition_manager=pm,
                      emit_warnings=False)
    groups = [dataclasses.replace(g, kv_head_mesh_axes=p.kv_head_mesh_axes, kv_head_shards=p.kv_head_shards)
              for g, p in zip(groups, plans)]
    page_size, length = positive_int("page_size", args["page_size"]), positive_int("max_sequences",
                                                                                    args["max_sequences"])
    shards = top.page_shards
    need = [g.pages_per_sequence(length, page_size) for g in groups]
    base = dict(batch_size=args["batch_size"], num_hidden_layers=args["num_hidden_layers"], max_sequences=length,
                page_size=page_size, num_kv_heads=max(g.num_kv_heads for g in groups),
                kv_head_dim_size=max(g.key_head_dim for g in groups), hbm_utilization=args["hbm_utilization"],
                dtype=args["dtype"], quantization=get_quantizer(args["quantizer"]).name,
                kv_head_mesh_axes=top.kv_head_mesh_axes, kv_head_shards=top.kv_head_shards,
                page_mesh_axes=top.page_mesh_axes, page_shards=shards,
                num_pages_per_sequence=math.ceil(length / page_size))

    def build(pages: list[int], **extra: Any) -> Any:
        sized = tuple(dataclasses.replace(g, num_pages=p) for g, p in zip(groups, pages))
        return cls(**base, num_pages_per_layer=max(pages), layer_groups=sized, **extra)

    if all(explicit):
        return build([g.num_pages for g in groups])
    probe = build([shards * n for n in need])  # every field checked before memory is asked
    budget = _budget(mesh, probe, args["memory_bytes_per_device"])
    # One "unit" is what one max-length sequence costs a device in every group: each group gets
    # pages for the same number of units, so no group runs out before the others.
    unit = probe.bytes_per_sequence(length)
    cap = INT32_MAX // page_size // shards
    per_shard = [min(budget.per_device_bytes * n // unit, cap) for n in need]
    short = [i for i, (p, n) in enumerate(zip(per_shard, need)) if p < n]
    if short:
        raise ValueError(
            f"the memory budget ({budget.detail}) holds less than one sequence of max_sequences={length} tokens: "
            f"one needs {unit} bytes per device ({probe._cost_detail()} per sequence); raise hbm_utilization or "
            "memory_bytes_per_device, or lower max_sequences")
    return build([p * shards for p in per_shard], memory_bytes_per_device=budget.per_device_bytes)


__all__ = ["create_metadata"]
