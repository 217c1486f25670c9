"""Sleep and wake: the cache's device memory handed to someone else (an RL trainer sharing the
accelerators) and taken back.

- ``sleep(cache, manager, level=1)`` moves every page array to host memory (JAX's
  ``pinned_host`` memory kind, with the same sharding: each host keeps its own shards) and frees
  the device buffers; the manager keeps its state. ``wake`` puts the pages back, bit for bit, on
  the same mesh or on another one (the pool re-split over its data-parallel slices, each group's
  kv heads over the new mesh, as a checkpoint restore does).
- ``level=2`` frees the device buffers and keeps nothing of the pages: the prefix cache is
  emptied, so no sequence may be running; ``wake`` allocates fresh pages. What is kept is what
  starting again needs: the metadata, and the manager with its weight versions and counters.

A `SleepingCache` is woken once; its host copies are freed then.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
from jax.sharding import Mesh

from easykv.manager.manager import PageManager
from easykv.sharding import PartitionManager
from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.spec.relayout import target_metadata
from easykv.storage.cache import PagedAttentionCache
from easykv.storage.pages import PageLayout, StoredPages, allocate_pages, group_page_templates
from easykv.storage.placement import cache_layout, check_fits, group_layouts
from easykv.storage.pool_match import check_cache_of
from easykv.validation import integer

HOST_KIND = "pinned_host"


@dataclasses.dataclass(eq=False)
class SleepingCache:
    """A cache put to sleep (see the module doc); `wake` takes it, once.

    Attributes:
      level: 1 (pages kept in host memory) or 2 (pages discarded).
      metadata: the `PagedAttentionCacheMetaData` the cache had.
      layout: the `PageLayout` it had (None: one device).
      manager: its `PageManager`, state kept.
      key_pages: level 1: the key pages in host memory (``pinned_host``), one entry per layer
        group as the cache held them, ``(layers_in_group, num_kv_heads, num_pages, page_size, head_dim)``
        stacks (or `QuantizedPages`); None at level 2 and once woken.
      value_pages: the value pages, likewise (an entry is None for a latent group).
      woken: whether `wake` has taken it (default False).
    """

    level: int
    metadata: PagedAttentionCacheMetaData
    layout: PageLayout | None
    manager: PageManager
    key_pages: tuple[StoredPages, ...] | None
    value_pages: tuple[StoredPages | None, ...] | None
    woken: bool = False

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the pages hold here (every addressable shard; 0 at level 2)."""
        return _held_bytes(jax.tree.leaves((self.key_pages, self.value_pages)), HOST_KIND)


def device_bytes(tree: object = None) -> int:
    """Bytes of device memory held by the arrays of ``tree`` (default: every live array of this
    process), counted from the arrays themselves: their addressable shards in the ``device``
    memory kind (a replicated shard counts once per device holding it).

    Args:
      tree: a pytree of `jax.Array` leaves; deleted arrays count nothing (None: every live array).
    """
    return _held_bytes(jax.live_arrays() if tree is None else jax.tree.leaves(tree), "device")


def _to_kind(a: jax.Array, kind: str) -> jax.Array:
    """``a`` with the same sharding in memory kind ``kind``: one transfer when this process holds
    every shard; else shard by shard, each on its own device (a program over a multi-process mesh
    that moves memory kinds is refused by some jaxlib versions)."""
    sharding = a.sharding.with_memory_kind(kind)
    if a.is_fully_addressable:
        moved: jax.Array = jax.device_put(a, sharding)  # device_put of an array returns an array
        return moved
    shards = [jax.device_put(s.data, s.data.sharding.with_memory_kind(kind)) for s in a.addressable_shards]
    return jax.make_array_from_single_device_arrays(a.shape, sharding, shards)


def _held_bytes(arrays: Any, kind: str) -> int:
    """Bytes of the distinct buffers behind the arrays' shards in memory kind ``kind`` (two
    Array objects over one buffer, as a donation can leave them, count once)."""
    seen: dict[tuple[Any, int], int] = {}
    for a in arrays:
        if a.is_deleted() or (a.sharding.memory_kind or "device") != kind:
            continue
        for shard in a.addressable_shards:
            seen[(shard.device, shard.data.unsafe_buffer_pointer())] = int(shard.data.nbytes)
    return sum(seen.values())


def _spans(arrays: Any) -> list[tuple[Any, int, int]]:
    """(device, first byte, end) of the buffer behind each addressable shard of the arrays."""
    out = []
    for a in arrays:
        if not a.is_deleted():
            for shard in a.addressable_shards:
                start = shard.data.unsafe_buffer_pointer()
                out.append((shard.device, start, start + max(int(shard.data.nbytes), 1)))
    return out


def _free_unshared(arrays: Any, kept: Any) -> None:
    """Delete each of ``arrays`` that shares no buffer with the arrays of ``kept``; drop the rest.

    A transfer may hand back the buffers it was given rather than copies: a ``device_put`` onto
    the sharding an array already has returns that array, and one onto another layout reuses
    every shard already on its device (a replicated group's shards all are, so replicated kv heads
    or a latent group keep some or all of the staged buffers). ``delete`` frees a buffer under
    every array that holds it, so an array sharing one is left to be freed when the last array
    over its buffers goes. Ranges, not just start addresses, are compared: a shard could be a
    view into another's buffer."""
    held = _spans(jax.tree.leaves(kept))
    for a in jax.tree.leaves(arrays):
        if not any(d == kd and lo < khi and klo < hi for d, lo, hi in _spans([a]) for kd, klo, khi in held):
            a.delete()  # a deleted array has no spans: deleting it again is a no-op


def sleep(cache: PagedAttentionCache, manager: PageManager, *, level: int = 1) -> SleepingCache:
    """Free ``cache``'s device memory (see the module doc); ``cache`` is consumed. Level 2 needs
    every sequence released first (ValueError naming them, nothing changed).

    Args:
      cache: the `PagedAttentionCache` to put to sleep, with no host-tier transfers pending.
      manager: the cache's `PageManager`; kept in the `SleepingCache` (at level 2 its prefix
        cache is emptied).
      level: 1 (default) keeps the pages in host memory; 2 discards them (a cache laid out on a
        mesh only).

    Returns:
      the `SleepingCache` to `wake`.
    """
    if not isinstance(cache, PagedAttentionCache):
        raise ValueError(f"sleep takes a PagedAttentionCache, got {type(cache).__name__}")
    if not isinstance(manager, PageManager):
        raise ValueError(f"manager must be the easykv.PageManager of the cache's pool, got {type(manager).__name__}")
    meta = check_cache_of(cache, manager.metadata)
    level = integer("level", level, lo=1, hi=2, hint="1 keeps the pages in host memory, 2 discards them")
    if manager.has_host_tier and manager.has_pending_work:
        raise ValueError("device work is pending, with a host tier (host-tier transfers read and write the pages "
                         "being put to sleep); apply it first: runner.apply_pending(), or "
                         "easykv.apply_pending(manager, cache, host=tier)")
    if level == 2 and cache.layout is None:
        raise ValueError("sleep(level=2) needs a cache laid out on a mesh (init_cache) to allocate again on wake; "
                         "sleep this one at level 1")
    if level == 2 and manager.active_ids:
        ids = manager.active_ids
        raise ValueError(f"sleep(level=2) discards every page, but sequences {ids[:8]}{'...' * (len(ids) > 8)} are "
                         "still running; release them first, or sleep at level 1 (pages kept in host memory)")
    leaves = jax.tree.leaves((cache.key_pages, cache.value_pages))
    if level == 1:
        host = jax.tree.map(lambda a: _to_kind(a, HOST_KIND), (cache.key_pages, cache.value_pages))
        jax.block_until_ready(host)
        keys, values = host
    else:
        keys = values = None
        manager.reset_prefix_cache()  # its scrubs stay pending: zeroing the fresh pages again is harmless
    _free_unshared(leaves, (keys, values))
    return SleepingCache(level=level, metadata=meta, layout=cache.layout, manager=manager, key_pages=keys,
                         value_pages=values)


def wake(sleeping: SleepingCache, *, mesh: Mesh | None = None,
         partition_manager: PartitionManager | None = None) -> tuple[PagedAttentionCache, PageManager]:
    """The cache (and its manager) back in device memory: on the mesh it slept on, or on
    ``mesh`` laid out by ``partition_manager`` (kv heads re-split, the pool re-sliced over the
    target's data-parallel replicas with the manager following). Level 1 restores every page
    bit for bit; level 2 allocates zeroed pages. ValueError, with the sleeping cache unchanged,
    when ``mesh`` cannot hold the pages or a sequence's pages would straddle two slices.

    Args:
      sleeping: the `SleepingCache` `sleep` returned, not woken yet.
      mesh: a `jax.sharding.Mesh` of the platform it slept on; None (default): the mesh it
        slept on. Given one, the manager forgets its host tier's cached prefixes (swapped-out
        sequences are refused).
      partition_manager: the rules that lay the pages out on ``mesh`` (None: the default rules,
        kv heads over ``tp``); only with ``mesh``.

    Returns:
      ``(cache, manager)``: the cache in device memory and its manager (resharded when the pool
      is re-sliced).
    """
    if not isinstance(sleeping, SleepingCache):
        raise ValueError(f"wake takes the SleepingCache sleep returned, got {type(sleeping).__name__}")
    if sleeping.woken:
        raise ValueError("this SleepingCache was woken already; its pages live in the cache wake returned")
    meta, layout = sleeping.metadata, sleeping.layout
    if mesh is None:
        if partition_manager is not None:
            raise ValueError("partition_manager lays the pages out on a new mesh; pass mesh= with it")
        target, manager, moved = meta, sleeping.manager, False
        layouts = group_layouts(meta, layout)
        if layout is not None:
            mesh = layout.mesh
    else:
        if not isinstance(mesh, Mesh):
            raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        old = None if layout is None else layout.mesh.devices.flat[0].platform
        if old is not None and mesh.devices.flat[0].platform != old:
            raise ValueError(f"the pages slept on {old} and keep its storage dtypes; wake them on a {old} mesh (move "
                             "them across platforms with save_cache / restore_cache)")
        target = target_metadata(meta, mesh, partition_manager)
        manager = sleeping.manager
        if manager.has_host_tier and manager.swapped_ids:
            raise ValueError(f"sequences {manager.swapped_ids} are swapped out to the host tier, whose pages stay with "
                             "the old placement; swap them in before sleeping, or wake on the mesh it slept on")
        manager = manager.clone(target) if target.page_shards != meta.page_shards else manager
        new = cache_layout(mesh, target)
        layouts, layout, moved = group_layouts(target, new), new, True
        if manager.has_host_tier:  # a HostTier holds pages of one placement: the new cache needs a new one
            manager.forget_host_tier()
    if mesh is not None:
        check_fits(mesh, target, target.bytes_per_device, "the woken pages")
    if sleeping.level == 2:  # fresh zeroed pages, each device making its own shards
        # cast: sleep(level=2) refuses a cache without a layout; wake keeps it or lays it out anew.
        placed = cast(PageLayout, layout)
        platform = placed.mesh.devices.flat[0].platform
        pages = [allocate_pages(group_page_templates(target, g, platform), gl)
                 for g, gl in zip(target.groups, group_layouts(target, placed))]
        cache = PagedAttentionCache(target, tuple(k for k, _ in pages), tuple(v for _, v in pages), layout)
    else:
        cache = PagedAttentionCache(target, *_placed_pages(sleeping, layouts, moved), layout)
        # the host copies are read: free them, unless a transfer handed their buffers to the cache
        _free_unshared((sleeping.key_pages, sleeping.value_pages), cache)
        sleeping.key_pages = sleeping.value_pages = None
    sleeping.woken = True
    return cache, manager


def _placed_pages(sleeping: SleepingCache, layouts: tuple[PageLayout | None, ...],
                  moved: bool) -> tuple[tuple[StoredPages, ...], tuple[StoredPages | None, ...]]:
    """The sleeping pages back in device memory: with the shardings they had, or (``moved``)
    staged there as they were and laid out per ``layouts`` (one group at a time, so the extra
    device memory is one group's). Returns (key pages, value pages), one entry per group, ready."""
    # cast: a level-1 cache not yet woken holds its host pages (level 2 and `woken` never get here).
    key_pages, value_pages = cast("tuple[tuple[StoredPages, ...], tuple[StoredPages | None, ...]]",
                                  (sleeping.key_pages, sleeping.value_pages))
    keys: list[StoredPages] = []
    values: list[StoredPages | None] = []
    for g, group_layout in enumerate(layouts):
        staged: list[jax.Array] = []

        def place(a: Any, gl: PageLayout | None = group_layout, staged: list[jax.Array] = staged) -> Any:
            if not moved:  # where it slept: the very shardings it had
                return _to_kind(a, "device")
            staged.append(_to_kind(a, "device"))
            # cast: moved pages take the layouts `wake` made for the new mesh, each a PageLayout.
            return jax.device_put(staged[-1], cast(PageLayout, gl).sharding_for(a.ndim))

        keys.append(jax.tree.map(place, key_pages[g]))
        values.append(None if value_pages[g] is None else jax.tree.map(place, value_pages[g]))
        if staged:  # ready before a staged buffer goes: a transfer may still be reading it
            jax.block_until_ready((keys[-1], values[-1]))
            _free_unshared(staged, (keys[-1], values[-1]))
            staged.clear()
    jax.block_until_ready((keys, values))
    return tuple(keys), tuple(values)


__all__ = ["SleepingCache", "device_bytes", "sleep", "wake"]
