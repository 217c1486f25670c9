"""Restoring a checkpoint step (`restore_cache`): onto another mesh, partition rule, storage
platform, and (with ``convert=True``) dtype or quantizer; the saving side is
`easykv.checkpoint.checkpointer`, which re-exports everything here.

Every persisted byte the restore uses is verified before it becomes a cache (see the
checkpointer's module doc); errors are `CheckpointError`s and nothing is restored (and no
live cache is touched) when one is raised.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.typing import DTypeLike

from easykv.checkpoint.format import (
    STORAGE_PLATFORMS,
    check_fingerprints,
    checkpoint_path,
    expected_leaves,
    read_manager_state,
    read_record,
    resolve_step,
    saved_metadata,
)
from easykv.checkpoint.orbax_types import CheckpointDir, EPath
from easykv.checkpoint.reader import read_arrays
from easykv.checkpoint.record import expected_templates, group_index, is_legacy, is_stacked, legacy_note, page_pairs
from easykv.checkpoint.reshard import check_format, check_same_cache
from easykv.errors import CheckpointIntegrityError, CheckpointMismatchError
from easykv.manager.manager import PageManager
from easykv.quantization import Quantizer
from easykv.sharding import PartitionManager
from easykv.spec.metadata import PagedAttentionCacheMetaData, known_dtype
from easykv.spec.relayout import target_metadata
from easykv.storage.cache import PagedAttentionCache
from easykv.storage.convert import convert_pages, to_storage_dtypes
from easykv.storage.pages import PageLayout, group_templates
from easykv.storage.placement import cache_layout, group_layouts
from easykv.validation import boolean, show


# ---- restoring -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RestoredCache:
    """What `restore_cache` returns; unpacks as ``cache, manager = restored``.

    Attributes:
      cache: the restored `PagedAttentionCache`, on the target mesh.
      manager: the restored `PageManager`; None when none was saved or ``restore_manager=False``.
      metadata: the restored cache's metadata, laid out for the target mesh.
      step: the step restored.
      saved_metadata: the metadata the step was saved with.
      saved_mesh: the saving cache's devices as recorded: ``platform``, ``device_kind``,
        ``num_devices``, ``process_count``, and with a layout ``axis_names``, ``shape``,
        ``kv_head_mesh_axes`` and ``page_mesh_axes``.
      extra_metadata: the JSON-safe dict passed to the save (``{}`` when none was).
    """

    cache: PagedAttentionCache
    manager: PageManager | None  # None when none was saved (or restore_manager=False)
    metadata: PagedAttentionCacheMetaData  # the restored cache's (laid out for the target mesh)
    step: int
    saved_metadata: PagedAttentionCacheMetaData
    saved_mesh: dict[str, Any]
    extra_metadata: dict[str, Any]

    def __iter__(self) -> Iterator[Any]:
        yield self.cache
        yield self.manager


def restore_cache(
    directory: CheckpointDir,
    *,
    mesh: Mesh,
    partition_manager: PartitionManager | None = None,
    step: int | None = None,
    metadata: PagedAttentionCacheMetaData | None = None,
    dtype: DTypeLike | None = None,
    quantizer: str | Quantizer | None = None,
    convert: bool = False,
    verify: bool = True,
    restore_manager: bool = True,
    storage_platform: str | None = None,
) -> RestoredCache:
    """Restore ``step`` (default: the latest complete one) of ``directory`` onto ``mesh``.

    The metadata's layout fields are rebuilt for the target mesh and partition rule and the pool
    keeps its size.

    Args:
      directory: the checkpoint directory (a str, an ``os.PathLike`` or an epath).
      mesh: the `jax.sharding.Mesh` to restore onto (e.g. `easykv.sharding.create_mesh`).
      partition_manager: the target's sharding rule (kv heads over ``tp``, pages optionally over
        ``dp``); None (default): the default rules (kv heads over ``tp``, pages unsplit).
      step: the step to restore; None (default): the latest complete one.
      metadata: the target's metadata, checked against the saved model and pool shape (layers,
        kv heads, head_dim, page_size, pages, ...); None (default): the saved one.
      dtype: the target dtype of every layer group (None: each group's in ``metadata``, else as
        saved); a change needs ``convert=True``.
      quantizer: the target quantizer of every layer group, a name or object (None: as for
        ``dtype``; ``"none"`` asks for unquantized pages); a change needs ``convert=True``.
      convert: dequantize and re-encode every page into the target format (lossy when the target
        is coarser); default False: another format is refused (`CheckpointMismatchError`).
      verify: check every array's fingerprint (default True).
      restore_manager: rebuild the PageManager when one was saved (default True), re-split for
        another number of data-parallel page slices (a sequence whose pages would straddle two
        slices is refused); False: ``manager`` is None.
      storage_platform: whose storage dtypes the pages use, one of ``"cpu"``, ``"gpu"``,
        ``"cuda"``, ``"rocm"``, ``"tpu"`` (default: the mesh's; e.g. ``"gpu"`` to hold bf16
        natively).

    Returns:
      a `RestoredCache`: ``cache, manager = restored``, also its ``metadata``, ``step``,
      ``saved_metadata``, ``saved_mesh`` and ``extra_metadata``.
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh (e.g. easykv.sharding.create_mesh), "
                         f"got {type(mesh).__name__}")
    convert, verify = boolean("convert", convert), boolean("verify", verify)
    restore_manager = boolean("restore_manager", restore_manager)
    if storage_platform is not None and storage_platform not in STORAGE_PLATFORMS:
        raise ValueError(f"storage_platform must be None or one of {STORAGE_PLATFORMS}, got {show(storage_platform)}")
    directory = checkpoint_path(directory)
    step, _ = resolve_step(directory, step)
    record = read_record(directory, step)  # sealed, schema-checked
    if is_legacy(record):
        warnings.warn(legacy_note(step, directory), UserWarning, stacklevel=2)
    saved = saved_metadata(record, step, directory)
    if metadata is not None:
        if not isinstance(metadata, PagedAttentionCacheMetaData):
            raise ValueError(f"metadata must be a PagedAttentionCacheMetaData, got {type(metadata).__name__}")
        check_same_cache(saved, metadata)
    target = target_metadata(check_format(saved, dtype, quantizer, convert, like=metadata), mesh, partition_manager)
    platform = storage_platform or mesh.devices.flat[0].platform
    manager = _restore_manager(directory, step, saved, target) if restore_manager else None
    if manager is None and saved.page_shards != target.page_shards and target.page_shards > 1:
        warnings.warn(
            f"restoring onto {target.page_shards} data-parallel page slices (saved with {saved.page_shards}) without a "
            "PageManager: whoever schedules this cache must keep each sequence's pages inside one slice of "
            f"{target.pages_per_shard} pages", stacklevel=2)

    # Read the saved arrays as stored, each shard straight onto its target device, checked as read.
    layout = cache_layout(mesh, target)
    version = record["format_version"]
    abstract = _saved_arrays(record, group_layouts(target, layout), layout, is_stacked(version))
    algorithm = record["fingerprint_algorithm"] if verify else None
    arrays, digests = read_arrays(directory, step, record, abstract, algorithm=algorithm)
    if digests is not None:
        check_fingerprints(record, digests, step, directory)
    cache = _build_cache(arrays, saved, target, layout, platform, version)
    return RestoredCache(cache=cache, manager=manager, metadata=target, step=step, saved_metadata=saved,
                         saved_mesh=dict(record["mesh"]), extra_metadata=dict(record["extra_metadata"]))


def _restore_manager(directory: EPath, step: int, saved: PagedAttentionCacheMetaData,
                     target: PagedAttentionCacheMetaData) -> Any:
    """The saved PageManager, validated against the pool it was saved with, then re-split for
    the target's page slices; None when none was saved."""
    state = read_manager_state(directory, step)
    if state is None:
        return None
    try:
        manager = PageManager.from_state_dict(saved, state)
    except ValueError as err:
        raise CheckpointIntegrityError(f"the page-manager state of step {step} in {directory} cannot be rebuilt: "
                                       f"{err}", step=step, directory=str(directory)) from err
    try:
        return manager.clone(target)
    except ValueError as err:
        raise CheckpointMismatchError(f"the page manager of step {step} in {directory} cannot follow the pages "
                                      f"onto the target mesh: {err}") from err


def _saved_arrays(record: Mapping[str, Any], layouts: tuple[PageLayout, ...], layout: PageLayout,
                  stacked: bool) -> list[tuple[dict[str, Any], jax.ShapeDtypeStruct]]:
    """(record entry, ShapeDtypeStruct as stored, with the target sharding) of every array
    (`check_record` has matched each entry against the saved metadata): stacked group arrays,
    placed as their group's layout places them, or one layer's arrays (formats 1-2)."""
    def sharding(entry: Mapping[str, Any]) -> Any:
        ndim = len(entry["shape"])
        if not stacked:
            return layout.layer_sharding_for(ndim)
        return layouts[group_index(entry["path"][0])].sharding_for(ndim)

    return [(entry, jax.ShapeDtypeStruct(tuple(entry["shape"]), np.dtype(entry["stored_dtype"]),
                                         sharding=sharding(entry)))
            for entry in record["arrays"]]


def _build_cache(arrays: list[jax.Array], saved: PagedAttentionCacheMetaData, target: PagedAttentionCacheMetaData,
                 layout: PageLayout, platform: str, version: int) -> PagedAttentionCache:
    """The restored arrays bitcast to ``platform``'s storage, stacked per layer group when the
    step holds one array per layer (formats 1-2: the migration), and, when ``target`` asks for
    another dtype or quantizer, re-encoded; then the cache."""
    same_format = target.with_formats(saved.group_formats, dtype=saved.dtype, quantization=saved.quantization)
    arrays = to_storage_dtypes(arrays, [np.dtype(s.dtype) for _, _, s in
                                        expected_leaves(same_format, platform, version)])
    pairs = page_pairs(expected_templates(same_format, platform, version), arrays)
    del arrays
    if not is_stacked(version):
        pairs = _stack_layers(pairs, same_format, layout)
    dst_templates = group_templates(target, platform) if target != same_format else None
    keys, values = [], []
    for g, ((k, v), group_layout) in enumerate(zip(pairs, group_layouts(target, layout))):
        if dst_templates is not None and same_format.group_formats[g] != target.group_formats[g]:
            k_tmpl, v_tmpl = dst_templates[g]
            src, dst = known_dtype(same_format.group_formats[g][0]), known_dtype(target.group_formats[g][0])
            k = convert_pages(k, src, dst, k_tmpl, group_layout)
            # A latent group has neither saved values nor a value template (the same groups, other formats).
            v = None if v is None or v_tmpl is None else convert_pages(v, src, dst, v_tmpl, group_layout)
        keys.append(k)
        values.append(v)
    return PagedAttentionCache(target, tuple(keys), tuple(values), layout)


def _stack_layers(pairs: list[tuple[Any, Any]], meta: PagedAttentionCacheMetaData,
                  layout: PageLayout) -> list[tuple[Any, Any]]:
    """Per-layer (K, V) page arrays -> one stacked (K, V) per layer group, placed as the cache
    places them. The per-layer arrays and the stacks exist together for the moment of the copy:
    a step of format 1-2 needs twice its pages' memory to restore."""
    def stack(*xs: Any) -> Any:
        return jax.tree.map(lambda *leaves: jnp.stack(leaves), *xs)

    out = []
    for group in meta.groups:
        k0 = pairs[group.layers[0]][0]
        shardings = jax.tree.map(lambda a: layout.sharding_for(a.ndim + 1), k0)
        run = jax.jit(stack, out_shardings=shardings)
        out.append((run(*(pairs[i][0] for i in group.layers)), run(*(pairs[i][1] for i in group.layers))))
    return out


__all__ = ["RestoredCache", "restore_cache"]
