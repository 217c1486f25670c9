"""Device pages on their way to the shared store (``write_through``): one program gathers a layer
group's pages per data-parallel replica into page-major arrays sharded like the pool (each device
gathers only the pages of its own slice and heads), and starts their copy to host memory; the
store's writer thread reads them there (`gathered_blocks`), so the step never waits.

The program's page count is padded to a power of two (`easykv.storage.page_work.work_bucket`), so a
server compiles a number of shapes logarithmic in its pool.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from easykv.storage.cache import PagedAttentionCache
from easykv.storage.page_work import work_bucket
from easykv.storage.pages import PageLayout
from easykv.tiers.host import page_major_spec


@dataclasses.dataclass(frozen=True)
class GatheredPages:
    """Device pages of one layer group gathered for the store, their copy to host started.

    Attributes:
      group: the layer group.
      pages: ``(replicas, k)`` local page ids per replica (padding: page 0, left out by ``counts``).
      counts: ``(replicas,)`` how many of each row are real.
      arrays: per page-array leaf, ``(replicas * k, layers, heads, ...)`` sharded like the pool's pages.
    """

    group: int
    pages: np.ndarray
    counts: np.ndarray
    arrays: tuple[jax.Array, ...]


def gather_pages(cache: PagedAttentionCache, group: int, pages: np.ndarray) -> GatheredPages:
    """Gather device ``pages`` (global ids) of layer group ``group`` and start their copy to host memory.

    Args:
      cache: a live cache.
      group: the layer group.
      pages: ``(n,)`` global device page ids of the group's pool, ``n >= 1``.
    """
    meta = cache.metadata
    num_pages = int(meta.groups[group].num_pages or meta.num_pages_per_layer)
    replicas = int(meta.page_shards)
    per_replica = num_pages // replicas
    ids = np.asarray(pages, np.int64).reshape(-1)
    replica = ids // per_replica
    counts = np.bincount(replica, minlength=replicas)
    k = work_bucket(int(counts.max()), per_replica)
    local = np.zeros((replicas, k), np.int32)
    for r in range(replicas):
        mine = ids[replica == r] - r * per_replica
        local[r, : mine.size] = mine
    leaves = jax.tree.leaves((cache.key_pages[group], cache.value_pages[group]))
    # numpy ids straight into the program (jnp.asarray would dispatch a program of its own: ~2 ms a call)
    arrays = _gather(leaves, local, layout=cache.layout_of(group))
    for a in arrays:
        a.copy_to_host_async()
    return GatheredPages(group=group, pages=local, counts=counts, arrays=tuple(arrays))


def gathered_blocks(gathered: GatheredPages) -> list[tuple[int, int, int, list[np.ndarray]]]:
    """The gathered pages in host memory as blocks of kv heads, laid out as `HostTier.page_blocks`' (the
    first axis: the ``k`` gathered pages of the replica). Waits for the copy: called by the writer thread.

    Returns:
      per distinct shard, ``(replica, first head, end head, arrays)``.
    """
    k = gathered.pages.shape[1]
    blocks: dict[tuple[int, int, int], list[np.ndarray]] = {}
    for a in gathered.arrays:
        seen = set()
        for shard in a.addressable_shards:
            rows, _, heads = shard.index[0], shard.index[1], shard.index[2]
            first_row = rows.start or 0
            start = heads.start or 0
            stop = a.shape[2] if heads.stop is None else heads.stop
            key = (first_row, start, stop)
            if key in seen:  # a shard replicated on several devices is read once
                continue
            seen.add(key)
            data = np.asarray(shard.data)
            for offset in range(0, data.shape[0], k):  # a shard may hold several replicas' rows
                replica = (first_row + offset) // k
                blocks.setdefault((replica, start, stop), []).append(data[offset: offset + k])
    return [(replica, start, stop, arrays) for (replica, start, stop), arrays in blocks.items()]


@partial(jax.jit, static_argnames=("layout",))
def _gather(leaves: list[jax.Array], ids: jax.Array, *, layout: PageLayout | None) -> list[jax.Array]:
    """Per leaf, ``ids[r]`` (local ids) of each replica ``r``'s slice, page-major."""

    def local(leaves: list[jax.Array], ids: jax.Array) -> list[jax.Array]:
        r: int | jax.Array = 0
        if layout is not None and layout.page_shards > 1:
            r = jax.lax.axis_index(layout.page_axes)
        return [jnp.moveaxis(jnp.take(a, ids[r], axis=2, mode="clip"), 2, 0) for a in leaves]

    if layout is None or layout.mesh.size == 1:
        return local(leaves, ids)
    specs = [layout.spec_for(a.ndim) for a in leaves]
    moved = [page_major_spec(s) for s in specs]
    mapped: Any = jax.shard_map(local, mesh=layout.mesh, in_specs=(specs, PartitionSpec()), out_specs=moved)
    result: list[jax.Array] = mapped(leaves, ids)
    return result


__all__ = ["GatheredPages", "gather_pages", "gathered_blocks"]
