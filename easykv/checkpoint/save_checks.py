"""What a save checks before it writes anything: a save never writes what a restore refuses.

A restore reads a step's record with `easykv.checkpoint.record.check_record` and places each
array as the saved metadata lays it out. A save therefore checks, before the directory, the
marker or orbax sees anything (so a refused save leaves nothing behind):

* `check_placement`: every page array (and scale array of quantized pages) is a live
  `jax.Array` on the placement the cache's layout gives it: the layout's mesh, devices and
  partition spec (compared with ``Sharding.is_equivalent_to``), in device memory; a cache
  without a layout holds every array on one device. An array off its layout is what
  ``jax.tree.map`` outside jit (arrays made from shapes alone land on the default device) or a
  ``jax.device_put`` onto other devices leaves; its record would name the layout's mesh beside
  the devices the arrays sit on, which every restore refuses as damage.
* `check_record_to_write`: the record as a restore will read it (through JSON, with the
  fingerprints and seals the writer adds later stood in by values of their form) passes
  `check_record`.

Both read only metadata and shardings, never array data: microseconds per array.
A failure is the caller's bad input: ``ValueError`` naming the array (or record field), where it
sits, where it must sit, and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding, Sharding, SingleDeviceSharding

from easykv.checkpoint.orbax_types import EPath
from easykv.checkpoint.record import MANAGER_SEAL, RECORD_SEAL, check_record, group_index, page_leaves
from easykv.errors import CheckpointError
from easykv.storage.cache import PagedAttentionCache
from easykv.storage.placement import group_layouts

# Stand-ins of the values the writer adds once the data are written (the schema checks their form only).
_FINGERPRINT_STAND_IN = "0" * 32
_SHA256_STAND_IN = "0" * 64


def layout_shardings(cache: PagedAttentionCache) -> PagedAttentionCache:
    """Where each of ``cache``'s arrays must sit: a pytree of ``cache``'s structure whose leaves
    are shardings, so that ``jax.device_put(cache, layout_shardings(cache))`` puts every array
    back on the layout.

    Args:
      cache: a `PagedAttentionCache`.

    Returns:
      ``cache`` with each array replaced by its sharding: ``cache.layout_of(g).sharding_for(ndim)``
      for layer group ``g``'s arrays; for a cache without a layout, one device for all (the
      device of its first array that sits on one device, else ``jax.devices()[0]``).
    """
    pairs = list(zip(cache.key_pages, cache.value_pages))
    placed = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(pairs),
                                          [want for _, _, _, want in _placements(cache)])
    return PagedAttentionCache(cache.metadata, tuple(k for k, _ in placed), tuple(v for _, v in placed), cache.layout)


def _placements(cache: PagedAttentionCache) -> list[tuple[str, tuple[str, ...], Any, Sharding]]:
    """(name, path, array, the sharding it must have) of every array of ``cache``, in the
    record's order (`page_leaves`)."""
    leaves = page_leaves(list(zip(cache.key_pages, cache.value_pages)))
    if cache.layout is None:
        one = SingleDeviceSharding(_anchor_device(cache))
        return [(name, path, leaf, one) for name, path, leaf in leaves]
    layouts = group_layouts(cache.metadata, cache.layout)
    return [(name, path, leaf, layouts[group_index(path[0])].sharding_for(len(leaf.shape)))
            for name, path, leaf in leaves]


def _anchor_device(cache: PagedAttentionCache) -> Any:
    """The one device a cache without a layout lives on."""
    for leaf in jax.tree.leaves((cache.key_pages, cache.value_pages)):
        devices = getattr(getattr(leaf, "sharding", None), "device_set", ())
        if len(devices) == 1:
            return next(iter(devices))
    return jax.devices()[0]


def check_placement(cache: PagedAttentionCache) -> None:
    """Refuse a cache any of whose arrays is not a live `jax.Array` on the placement its layout
    gives it (see the module doc). Reads shardings only.

    Args:
      cache: the `PagedAttentionCache` to be saved.

    Raises:
      ValueError: an array was donated, is not a concrete `jax.Array` (a numpy array, or traced
        inside a transformation), or sits off the cache's layout; the message names it, where it
        sits, where it must sit and how to put it there.
    """
    placements = _placements(cache)
    for name, _, arr, _ in placements:
        if isinstance(arr, jax.core.Tracer):
            raise ValueError(f"{name} is traced (the save was called inside jax.jit or another transformation); "
                             "save, outside it, the cache the transformed function returns")
        if not isinstance(arr, jax.Array):
            raise ValueError(f"{name} is a {type(arr).__name__}, not a jax.Array on the cache's layout; put it "
                             "there with jax.device_put(cache, easykv.checkpoint.save_checks.layout_shardings(cache))")
        if arr.is_deleted():
            raise ValueError(f"{name} was donated (deleted); save the cache returned by the last write")
    off = [(name, path, arr, want) for name, path, arr, want in placements
           if not arr.sharding.is_equivalent_to(want, arr.ndim)]
    if not off:
        return
    name, path, arr, want = off[0]
    more = f" (and {len(off) - 1} more array(s) off it: {[n for n, *_ in off[1:4]]})" if len(off) > 1 else ""
    place = (f"jax.device_put(array, cache.layout_of({group_index(path[0])}).sharding_for({arr.ndim}))"
             if cache.layout is not None else f"jax.device_put(array, {_anchor_device(cache)})")
    raise ValueError(
        f"{name} sits {_where(arr.sharding)}, but the cache's layout puts it {_where(want)}{more}. A checkpoint of "
        "it would record the layout's mesh beside devices its arrays do not match, and every restore would refuse "
        "that step, so nothing was saved. Put the arrays back on the layout before saving: cache = jax.device_put("
        f"cache, easykv.checkpoint.save_checks.layout_shardings(cache)) (this array alone: {place}). jax.tree.map "
        "outside jax.jit (arrays made from shapes alone land on the default device) and jax.device_put onto other "
        "devices move arrays off the layout")


def _where(sharding: Sharding) -> str:
    """Where a sharding puts an array, in words: its devices, its mesh and spec."""
    held: Any = sharding.device_set  # jaxlib's Device stub lacks its ``id``
    ids = sorted(int(d.id) for d in held)
    devices = f"device {ids[0]}" if len(ids) == 1 else f"{len(ids)} devices {ids}" if len(ids) <= 16 else \
        f"{len(ids)} devices"
    memory = "" if sharding.memory_kind in (None, "device") else f" in {sharding.memory_kind} memory"
    if isinstance(sharding, NamedSharding):
        return f"on {devices} as {sharding.spec} over mesh {dict(sharding.mesh.shape)}{memory}"
    return f"on {devices} ({type(sharding).__name__}){memory}"


def check_record_to_write(record: Mapping[str, Any], *, manager_saved: bool, directory: EPath) -> None:
    """Refuse a record (as `CacheCheckpointer.save` builds it, before the writer adds the
    fingerprints and seals) that a restore would refuse: it is read back through JSON, the
    values the writer adds later are stood in by values of their form, and `check_record` --
    the check every restore runs -- is run on it.

    Args:
      record: the record to be written (``step`` set; ``fingerprint`` of every array None).
      manager_saved: whether a page-manager state is saved beside it.
      directory: the checkpoint directory (for the message).

    Raises:
      ValueError: the record fails `check_record` (the cache disagrees with its own metadata,
        e.g. arrays of another dtype or shape) or is not JSON-safe; the message names the field.
    """
    algorithm = record["fingerprint_algorithm"]
    probe = {**record, MANAGER_SEAL: _SHA256_STAND_IN if manager_saved else None, RECORD_SEAL: _SHA256_STAND_IN,
             "arrays": [{**entry, "fingerprint": None if algorithm is None else _FINGERPRINT_STAND_IN}
                        for entry in record["arrays"]]}
    step = record["step"]
    try:
        # Read back as the writer writes it (`record.seal`: keys in their order; canonical() sorts them,
        # which would reorder mesh.shape against mesh.axis_names).
        as_read = json.loads(json.dumps(probe, allow_nan=False))
        check_record(as_read, step, directory)
    except (CheckpointError, TypeError, ValueError) as err:
        # check_record speaks to a reader ("step N of DIR is damaged — restore another step"): keep the problem only.
        problem = str(err).removesuffix(f"; step {step} of {directory} is damaged — restore another step")
        raise ValueError(
            f"the record of step {step} of {directory} would fail the check every restore runs ({problem}), so "
            "nothing was saved. Either the cache disagrees with its own metadata (a jax.tree.map that changes its "
            "arrays' dtypes or shapes makes one that no restore can rebuild: save a cache as init_cache, "
            "restore_cache, wake or a write returned it), or, for such a cache, this is a bug in easykv") from err


__all__ = ["check_placement", "check_record_to_write", "layout_shardings"]
