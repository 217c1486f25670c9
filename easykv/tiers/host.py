"""The host-memory tier's pages: where evicted prefix pages and swapped-out sequences live, and
the transfers between them and the cache's device pages.

The `PageManager` decides which pages move (`easykv.manager.host_tier`); a `HostTier` holds
them and moves them when a runner applies a plan's work::

    tier = easykv.HostTier(cache)              # host pages of every layer group, per shard
    runner = easykv.Runner(manager, cache, host=tier)    # applies each plan's transfers before its writes

The host pages of each layer group are kept per addressable shard of the cache's page arrays
(each process holds the shards of its own devices; a shard replicated on several devices is
kept once), as page-major numpy arrays of the storage dtype (a host page is one contiguous
block): bit for bit what the device held, scales of quantized pages included. JAX's
``pinned_host`` memory kind would keep them in a jax array instead, but updating such an array in
place needs host-side scatters that jaxlib 0.9 cannot compile over a sharded mesh, and easykv
supports jaxlib 0.9.

One `apply` runs every group's pending device work in one program, usually in one call: it
gathers the pages to offload, makes the copy-on-write copies, scatters the onloaded pages and
zeroes the scrubbed ones, in that order (see `HostTier.apply`). The program's page ids are
padded to one bucket per call (`easykv.storage.page_work`: a power of two, at most the pool), so
a server compiles a number of shapes logarithmic in its pool; work of very different sizes (a
few onloads beside many scrubs) is split into calls of its own bucket rather than padding the
transfers to the largest, and transfers go at most `TRANSFER_CHUNK` pages per replica a call.
Each kind of work a call does not have is skipped on the device (``lax.cond``), so a call costs
the work it has, not its padding. A call's transfers go through one staging array per group, the
program's input (pages to onload) and output (pages offloaded), donated: a call offloads or
onloads, never both (offloads then onloads of one `apply` are two calls), so the array never
holds both directions at once, and a call without an onload passes it through untouched. Each
group keeps one such array per width a call used (`_GroupStore.staging`: at most
``2 * TRANSFER_CHUNK - 1`` pages per replica), reused once its offload has landed, so a call
that stages nothing allocates nothing and no staging array is made by a program of its own.
Offloaded pages are copied to the host asynchronously (``copy_to_host_async``) and land in the
host arrays at the start of the next `apply` (or `flush`), so the step never waits for them; host
pages are read for onloads only after every earlier offload has landed. On CPU devices, whose
buffers are host memory, an offload of several chunks lands each chunk when the next one needs
its staging width (`HostTier._land_done`): one staging array goes round instead of zeros put on
the devices per chunk. Landing writes the staged pages straight into the host pages (one pass
over their bytes). A call with only host pages to zero runs no device program and returns the
cache it was given.

Released host pages are zeroed when the manager scrubs released pages (``scrub_released``):
those released since the last call at its start (after earlier offloads landed), those its own
transfers leave unreferenced right after it (`scrub`: their reads are done, and an offload still
in flight into one is dropped). A tier serves one manager for its life (`bind`): the manager
refuses a tier bound to another, so one cache's offload cannot overwrite another's host pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from numpy.typing import ArrayLike

from easykv.spec.groups import known_size
from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.storage.cache import PagedAttentionCache
from easykv.storage.page_work import TRANSFER_CHUNK, padded_ids, page_work_local, work_bucket
from easykv.storage.pages import PageLayout


class HostTier:
    """The host pages of ``cache``'s host-memory tier (see the module doc). Made for one
    cache's metadata and placement: the cache `apply` takes must have both (a cache returned
    by a write or an earlier `apply` of it does). It serves one `PageManager` for its life:
    the first that attaches it (a runner does, `bind`); another manager's is refused.

    Args:
      cache: the `PagedAttentionCache` whose tier this is; its metadata must have a host-memory
        tier (``host_memory_bytes=`` at creation), else ValueError. Zeroed host pages are
        allocated for every layer group, per addressable shard.
    """

    def __init__(self, cache: PagedAttentionCache):
        if not isinstance(cache, PagedAttentionCache):
            raise ValueError(f"HostTier takes the PagedAttentionCache whose tier it holds, got {type(cache).__name__}")
        meta = cache.metadata
        if not meta.has_host_tier:
            raise ValueError("this cache's metadata has no host-memory tier (host_pages_per_layer is None); create it "
                             "with PagedAttentionCacheMetaData.create(..., host_memory_bytes=N)")
        self.metadata = meta
        self._layouts = tuple(cache.layout_of(g) for g in range(len(meta.groups)))
        self._groups: list[_GroupStore] = []
        for g, group in enumerate(meta.groups):
            leaves, treedef = jax.tree.flatten((cache.key_pages[g], cache.value_pages[g]))
            self._groups.append(_GroupStore(leaves, treedef, meta.group_host_pages(group), meta.page_shards))
        self._inflight: list[tuple[int, list[jax.Array], np.ndarray, np.ndarray]] = []
        self._owner: object | None = None  # the key of the manager whose host pages these are (bind)
        self._token = _TierToken()  # what a manager knows this tier by (it never holds the tier)
        # Bytes of the pages moved (every layer, K, V and scales, each kv head once).
        self.bytes_offloaded = 0  # device -> host
        self.bytes_onloaded = 0  # host -> device

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory this process holds for the tier's pages."""
        return sum(a.nbytes for store in self._groups for shards in store.shards for a in shards.values())

    @property
    def token(self) -> object:
        """This tier's identity for a `PageManager` (`PageManager.attach_host_tier`): the manager keeps
        the token of the tier holding its host pages, never the tier."""
        return self._token

    @property
    def owner(self) -> object | None:
        """The token of the `PageManager` this tier serves (None until one binds it)."""
        return self._owner

    def bind(self, owner: object) -> None:
        """Serve the manager holding the token ``owner`` from now on (`easykv.Runner` calls it);
        binding again with the same token is a no-op. ValueError when the tier serves
        another manager: its pages hold that manager's sequences.

        Args:
          owner: the manager's token, any object but None, compared by identity.
        """
        if owner is None:
            raise ValueError("bind takes the token of the PageManager this tier serves, got None")
        if self._owner is not None and self._owner is not owner:
            raise ValueError("this HostTier serves another PageManager already: its host pages hold that manager's "
                             "sequences; make one for this cache with easykv.HostTier(cache)")
        self._owner = owner

    def scrub(self, pages: Sequence[ArrayLike]) -> None:
        """Zero host pages now, per layer group, and drop any offload still in flight into them:
        the pages hold nothing anyone reads again (released after `apply` read them, or
        forgotten), so no later landing may refill them.

        Args:
          pages: per layer group, a ``(host_scrubs,)`` int array of global host page ids in
            ``0 .. group host pages - 1``.
        """
        if len(pages) != len(self._groups):
            raise ValueError(f"scrub takes one array of host pages per layer group ({len(self._groups)}), got "
                             f"{len(pages)}")
        host_ids = [np.asarray(ids, np.int64).reshape(-1) for ids in pages]
        for store, ids in zip(self._groups, host_ids):
            n = store.host_local * store.replicas
            if ids.size and (ids.min() < 0 or ids.max() >= n):
                raise ValueError(f"a host page id is outside 0..{n - 1}: {ids.tolist()}")
        for g, (store, ids) in enumerate(zip(self._groups, host_ids)):
            if ids.size:
                for group, _, dst, _ in self._inflight:
                    if group == g:
                        store.cancel(dst, ids)
                store.zero(ids)

    def flush(self) -> None:
        """Wait for every offload in flight and write it into the host pages (its staging
        arrays are then free for the next call of their width)."""
        for g, staged, dst, counts in self._inflight:
            self._groups[g].land(staged, dst, counts)
            self._groups[g].keep_staging(staged)
        self._inflight.clear()

    def _land_done(self, group: int, width: int) -> None:
        """On CPU, land the oldest offload in flight from ``group``'s staging arrays of ``width``
        pages per replica when no free one is left, so the next call of that width reuses them
        instead of putting zeros on the devices (an offload of many chunks would stage a fresh
        array per chunk). There the device buffers are host memory, so landing copies in host
        memory and waits at most for that call's program, which runs before the next call's
        anyway; elsewhere the copy to the host may still be on its way, and it lands at `flush`."""
        store = self._groups[group]
        if not store.host_resident or store.spares.get(width):
            return
        for i, (g, staged, dst, counts) in enumerate(self._inflight):
            if g == group and staged[0].shape[0] == width * store.replicas:
                store.land(staged, dst, counts)
                store.keep_staging(staged)
                del self._inflight[i]
                return

    def check(self, cache: PagedAttentionCache, manager_metadata: PagedAttentionCacheMetaData | None = None) -> None:
        """ValueError unless ``cache`` is this tier's cache (its metadata and placement) and
        ``manager_metadata`` (if given) has its pools.

        Args:
          cache: the cache to check.
          manager_metadata: a manager's `PagedAttentionCacheMetaData`, whose device and host
            pages per group must be the tier's; None (default): not checked.
        """
        meta = self.metadata
        if not isinstance(cache, PagedAttentionCache) or cache.metadata != meta or tuple(
                cache.layout_of(g) for g in range(len(meta.groups))) != self._layouts:
            raise ValueError("host= is the HostTier of another cache (other metadata or placement); make one for this "
                             "cache with easykv.HostTier(cache)")
        if manager_metadata is not None:
            mine = [(g.num_pages, meta.group_host_pages(g)) for g in meta.groups]
            theirs = [(g.num_pages, manager_metadata.group_host_pages(g)) for g in manager_metadata.groups]
            if mine != theirs:
                raise ValueError(f"the manager's pools (device, host pages per group: {theirs}) are not this "
                                 f"HostTier's ({mine})")

    def apply(self, cache: PagedAttentionCache, transfers: Sequence[Sequence[ArrayLike]], *,
              copies: Sequence[tuple[ArrayLike, ArrayLike]] | None = None, scrubs: Sequence[ArrayLike] | None = None,
              manager_metadata: PagedAttentionCacheMetaData | None = None) -> PagedAttentionCache:
        """Run a manager's pending work on ``cache`` and these host pages, in one program (one
        call of it, or a few: see the module doc). Called by `easykv.Runner` (which
        checks the tier is the manager's: `bind`); everything here is checked before anything
        moves.

        The order is what the manager's bookkeeping relies on: offloads read the device pages
        first (an evicted page may be any later step's destination), then copies (a copy's
        source may be freed and filled by an onload of the same call), then onloads, then scrubs
        (pages released since).

        Args:
          cache: this tier's `PagedAttentionCache` (`check`); donated.
          transfers: per layer group ``(offload_src, offload_dst, onload_src, onload_dst,
            host_scrubs)`` int page ids, shaped ``(offloads,)``, ``(offloads,)``, ``(onloads,)``,
            ``(onloads,)``, ``(host_scrubs,)`` (`PageManager.pending_transfers`).
          copies: per layer group a ``(src, dst)`` pair of ``(copies,)`` int32 device page ids
            (copy-on-write; -1: padding); None (default): none.
          scrubs: per layer group ``(scrubs,)`` int32 device pages to zero (-1: padding); None
            (default): none.
          manager_metadata: the manager's metadata, checked against the tier's pools (`check`);
            None (default): not checked.

        Returns:
          the new cache (the one given when only host pages are zeroed).
        """
        self.check(cache, manager_metadata)
        meta = self.metadata
        n = len(meta.groups)
        empty = np.zeros(0, np.int32)
        copies = ((empty, empty),) * n if copies is None else copies
        scrubs = (empty,) * n if scrubs is None else scrubs
        if len(transfers) != n or len(copies) != n or len(scrubs) != n:
            raise ValueError(f"transfers, copies and scrubs need one entry per layer group ({n}), got "
                             f"{len(transfers)}, {len(copies)}, {len(scrubs)}")
        plans = [store.plan(t, known_size(group.num_pages))
                 for store, t, group in zip(self._groups, transfers, meta.groups)]
        device_ids = []
        for (src, dst), z, group in zip(copies, scrubs, meta.groups):
            src, dst, z = (np.asarray(a, np.int32).reshape(-1) for a in (src, dst, z))
            pool = known_size(group.num_pages)
            if src.shape != dst.shape or any(a.size and (a.min() < -1 or a.max() >= pool)
                                             for a in (src, dst, z)):
                raise ValueError(f"copies and scrubs are page ids of 0..{pool - 1} (-1: padding), "
                                 f"src and dst paired; got src {src.tolist()}, dst {dst.tolist()}, scrubs {z.tolist()}")
            real = (src >= 0) & (dst >= 0)  # a caller's padding goes: each call pads to its own bucket
            device_ids.append((src[real], dst[real], z[z >= 0]))
        self.flush()  # every earlier offload lands before a host page is read or zeroed
        for store, t in zip(self._groups, transfers):
            store.zero(np.asarray(t[4], np.int64))
        calls = _calls(plans, device_ids, max(known_size(g.num_pages) for g in meta.groups))
        for call in calls:  # none when only host pages were zeroed: no device program (nor its compile)
            cache = self._run(cache, call, plans, device_ids)
        return cache

    def _run(self, cache: PagedAttentionCache, call: _Call, plans: list[_Plan],
             device_ids: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> PagedAttentionCache:
        """One call of the program: ``call``'s share of every group's work, each array padded to
        its bucket (transfers to ``call.width`` pages per replica)."""
        meta, k, w = self.metadata, call.size, call.width
        none = np.full(k, -1, np.int32)
        staging, off_ids, on_ids, ids = [], [], [], []
        for g, (store, plan, (src, dst, z)) in enumerate(zip(self._groups, plans, device_ids)):
            off, on = call.columns("off", plan.off_src.shape[1]), call.columns("on", plan.on_src.shape[1])
            real = np.arange(w)[None, :] < _counts(plan.off_counts, off)[:, None]
            # numpy (jnp.asarray would compile a program per shape); padding one past the slice: no offload
            off_ids.append(np.where(real, _window(plan.off_src, off, w, 0), store.device_local).astype(np.int32))
            on_ids.append(_window(plan.on_dst, on, w, store.device_local))
            onloads = _counts(plan.on_counts, on).any()  # else nothing crosses the host link for this group
            if not onloads:
                self._land_done(g, w)
            staging.append(store.gather(_window(plan.on_src, on, w, 0)) if onloads else store.staging(w))
            ids.append((padded_ids(src, k) if "copies" in call.parts else none,
                        padded_ids(dst, k) if "copies" in call.parts else none,
                        padded_ids(z, k) if "scrubs" in call.parts else none))
        pools = tuple(jax.tree.leaves((cache.key_pages[g], cache.value_pages[g])) for g in range(len(meta.groups)))
        new_pools, staged_off = _move(pools, tuple(off_ids), tuple(staging), tuple(on_ids), tuple(ids),
                                      layouts=self._layouts)
        for g, (store, plan, staged) in enumerate(zip(self._groups, plans, staged_off)):
            off, on = call.columns("off", plan.off_src.shape[1]), call.columns("on", plan.on_src.shape[1])
            off_counts, on_counts = _counts(plan.off_counts, off), _counts(plan.on_counts, on)
            if off_counts.any():
                for a in staged:
                    a.copy_to_host_async()
                self._inflight.append((g, staged, _window(plan.off_dst, off, w, store.host_local), off_counts))
                self.bytes_offloaded += store.page_bytes * int(off_counts.sum())
            else:  # passed through untouched: free for the next call of its width
                store.keep_staging(staged)
            self.bytes_onloaded += store.page_bytes * int(on_counts.sum())
        keys, values = [], []
        for store, leaves in zip(self._groups, new_pools):
            k_pages, v_pages = jax.tree.unflatten(store.treedef, leaves)
            keys.append(k_pages)
            values.append(v_pages)
        return PagedAttentionCache(meta, tuple(keys), tuple(values), cache.layout)

    def page_blocks(self, group: int) -> list[tuple[int, int, int, list[np.ndarray]]]:
        """The host pages of layer group ``group`` this process holds, as blocks of kv heads: per distinct
        shard, ``(replica, first head, end head, arrays)``, the arrays one per page-array leaf (the group's key
        and value pages, then their scales, in pytree order), each page-major
        ``(host pages of the replica, layers, heads end - first, ...)`` of the storage dtype. Views, not copies:
        a shared prefix store reads and writes pages through them (`easykv.tiers.store`). Replicated heads
        appear in several blocks; each holds its own copy.

        Args:
          group: the layer group, ``0 <= group < len(metadata.groups)``.
        """
        store = self._groups[group]
        blocks: dict[tuple[int, int, int], list[np.ndarray]] = {}
        for stores, shape in zip(store.shards, store.shapes):
            for key, array in stores.items():
                heads, pages = key[1], key[2]
                start = heads[0]
                stop = shape[1] if heads[1] is None else heads[1]
                replica = pages[0] // store.device_local if store.replicas > 1 else 0
                blocks.setdefault((replica, start, stop), []).append(array)
        return [(replica, start, stop, arrays) for (replica, start, stop), arrays in blocks.items()]

    @property
    def host_pages_per_replica(self) -> tuple[int, ...]:
        """Per layer group, the host pages of one data-parallel replica (global host page ``h`` is page
        ``h % n`` of replica ``h // n``)."""
        return tuple(store.host_local for store in self._groups)


class _Call:
    """One call of the program: its bucket ``size`` (the length of its copy and scrub ids),
    ``width`` (its transfers' pages per replica: ``min(size, TRANSFER_CHUNK)``) and ``parts``:
    kind ("off", "copies", "on", "scrubs") -> (chunk index, the part's own bucket)."""

    def __init__(self, kind: str, index: int, size: int):
        self.size = size
        self.parts = {kind: (index, size)}

    @property
    def width(self) -> int:
        return min(self.size, TRANSFER_CHUNK)

    def take(self, kind: str, index: int, size: int) -> bool:
        """Add the part if its kind is new here, it is not a transfer beside one of the other
        direction (both share the call's staging arrays) and no transfer of the call would pad
        past its own bucket (transfers move real bytes over the host link; padding copies and
        scrubs only costs device work). Returns whether it was added."""
        grown = max(self.size, size)
        transfers = [s for kd, (_, s) in self.parts.items() if kd in ("off", "on")]
        transfers += [size] if kind in ("off", "on") else []
        both = {"off", "on"} <= {kind, *self.parts}
        if kind in self.parts or both or any(s != min(grown, TRANSFER_CHUNK) for s in transfers):
            return False
        self.size = grown
        self.parts[kind] = (index, size)
        return True

    def columns(self, kind: str, total: int) -> slice:
        """The columns of a transfer kind's per-replica ids this call moves (empty when none)."""
        if kind not in self.parts:
            return slice(0, 0)
        start = self.parts[kind][0] * TRANSFER_CHUNK
        return slice(start, min(start + self.width, total))


def _calls(plans: list[_Plan], device_ids: list[tuple[np.ndarray, np.ndarray, np.ndarray]], most: int
           ) -> list[_Call]:
    """Every group's work as calls of one program, in the order it must run: offloads, copies,
    onloads, scrubs (transfers in chunks of `TRANSFER_CHUNK` pages per replica), each call as
    many consecutive parts as share a bucket (`_Call.take`)."""
    parts: list[tuple[str, int, int]] = []
    for kind, total in (("off", max(p.off_src.shape[1] for p in plans)),
                        ("copies", max(src.size for src, _, _ in device_ids)),
                        ("on", max(p.on_src.shape[1] for p in plans)),
                        ("scrubs", max(z.size for _, _, z in device_ids))):
        chunk = TRANSFER_CHUNK if kind in ("off", "on") else max(total, 1)
        parts += [(kind, i, work_bucket(min(chunk, total - i * chunk), most)) for i in range(-(-total // chunk))]
    calls: list[_Call] = []
    for kind, index, size in parts:
        if not calls or not calls[-1].take(kind, index, size):
            calls.append(_Call(kind, index, size))
    return calls


def _window(ids: np.ndarray, columns: slice, width: int, fill: int) -> np.ndarray:
    """``ids[:, columns]`` (per replica) padded with ``fill`` to ``width`` columns."""
    out = np.full((ids.shape[0], width), fill, np.int32)
    part = ids[:, columns]
    out[:, : part.shape[1]] = part
    return out


def _counts(counts: np.ndarray, columns: slice) -> np.ndarray:
    """Per replica, how many of its real pairs fall in ``columns``."""
    inside: np.ndarray = np.clip(counts - columns.start, 0, columns.stop - columns.start)
    return inside


class _Plan:
    """One group's transfers as per-replica local page ids ``(replicas, most pairs of one
    replica)``, rows padded as `_GroupStore._split` says; `HostTier._run` cuts and pads the
    columns of each call."""

    def __init__(self, off_src: np.ndarray, off_dst: np.ndarray, off_counts: np.ndarray, on_src: np.ndarray,
                 on_dst: np.ndarray, on_counts: np.ndarray):
        self.off_src, self.off_dst, self.off_counts = off_src, off_dst, off_counts
        self.on_src, self.on_dst, self.on_counts = on_src, on_dst, on_counts


class _GroupStore:
    """One layer group's host pages: per page-array leaf, one numpy array per distinct shard
    this process holds, ``(layers, heads of the shard, host pages of its replica, ...)``."""

    def __init__(self, leaves: list[jax.Array], treedef: Any, host_pages: int, page_shards: int):
        self.treedef = treedef
        self.replicas = page_shards
        self.device_local = leaves[0].shape[2] // page_shards
        self.host_local = host_pages // page_shards
        self.shards: list[dict[tuple[Any, ...], np.ndarray]] = []
        self.devices: list[list[tuple[Any, tuple[Any, ...], int]]] = []  # per leaf: (device, shard key, replica)
        self.distinct: list[list[tuple[Any, tuple[Any, ...], int]]] = []  # per leaf: `devices`, one per shard key
        self.shapes = [a.shape for a in leaves]
        self.spares: dict[int, list[list[jax.Array]]] = {}  # free staging arrays (`staging`), by width
        self.shardings = [_page_major(a.sharding) for a in leaves]
        # CPU devices: a device buffer is host memory (`HostTier._land_done`)
        self.host_resident = all(device.platform == "cpu" for a in leaves  # type: ignore[attr-defined]
                                 for device in a.sharding.device_set)
        page_bytes = 0
        for a in leaves:
            stores, devices = {}, []
            for shard in a.addressable_shards:
                key = _key(shard.index, a.ndim)
                pages = shard.index[2]
                replica = (pages.start or 0) // self.device_local if self.replicas > 1 else 0
                if key not in stores:  # page-major: a host page is one contiguous block
                    shape = shard.data.shape
                    stores[key] = np.zeros((self.host_local, *shape[:2], *shape[3:]), shard.data.dtype)
                devices.append((shard.device, key, replica))
            self.shards.append(stores)
            self.devices.append(devices)
            firsts = {key: (device, key, r) for device, key, r in reversed(devices)}  # the first device of each
            self.distinct.append(list(firsts.values()))
            page_bytes += a.nbytes // a.shape[2]
        self.page_bytes = page_bytes  # one page of every layer, every leaf, all heads

    def plan(self, transfers: Sequence[ArrayLike], num_pages: int) -> _Plan:
        off_src, off_dst, on_src, on_dst = (np.asarray(t, np.int64) for t in transfers[:4])
        hosts = self.host_local * self.replicas
        for name, ids, n in (("offload source", off_src, num_pages), ("offload destination", off_dst, hosts),
                             ("onload source", on_src, hosts), ("onload destination", on_dst, num_pages)):
            if ids.size and (ids.min() < 0 or ids.max() >= n):
                raise ValueError(f"an {name} page id is outside 0..{n - 1}: {ids.tolist()}")
        a, b, c = self._split(off_src, self.device_local, off_dst, self.host_local)
        d, e, f = self._split(on_src, self.host_local, on_dst, self.device_local)
        return _Plan(a, b, c, d, e, f)

    def _split(self, src: np.ndarray, src_local: int, dst: np.ndarray, dst_local: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per replica, the pairs' local ids ``(replicas, k)`` (``k``: the most pairs of one
        replica); padding: page 0 as a source (read and thrown away), one past the slice as a
        destination (dropped). A pair crossing replicas is refused."""
        rep = src // src_local
        if np.any(rep != dst // dst_local):
            raise ValueError("a host-tier transfer crosses data-parallel replicas; each replica's pages stay in its "
                             "own slice")
        counts = np.bincount(rep, minlength=self.replicas) if src.size else np.zeros(self.replicas, np.int64)
        k = int(counts.max())
        out_src = np.zeros((self.replicas, k), np.int32)
        out_dst = np.full((self.replicas, k), dst_local, np.int32)
        for r in range(self.replicas):
            mask = rep == r
            out_src[r, : counts[r]] = src[mask] - r * src_local
            out_dst[r, : counts[r]] = dst[mask] - r * dst_local
        return out_src, out_dst, counts

    def gather(self, on_src: np.ndarray) -> list[jax.Array]:
        """The host pages ``on_src`` (``(replicas, k)`` local ids) as device arrays, page-major
        ``(replicas * k, layers, heads, ...)`` and sharded like the pool; padding pages go nowhere."""
        # padding reads page 0: its destination drops it
        return self._put(on_src.shape[1], lambda stores, key, r: stores[key][on_src[r]])

    def staging(self, k: int) -> list[jax.Array]:
        """Staging arrays of ``k`` pages per replica (laid out as `gather`'s) for a call that
        onloads nothing into this group: a free one of that width (`keep_staging`), else zeros
        put on the devices (a copy, no program; once per width, or per offload of a width still
        in flight)."""
        free = self.spares.get(k)
        if free:
            return free.pop()
        return self._put(k, lambda stores, key, r: np.zeros((k, *stores[key].shape[1:]), stores[key].dtype))

    def keep_staging(self, staged: list[jax.Array]) -> None:
        """Keep ``staged`` (a call's staging arrays, no longer read) for the next call of its
        width: one per width, so at most ``2 * TRANSFER_CHUNK - 1`` pages per replica are kept."""
        kept = self.spares.setdefault(staged[0].shape[0] // self.replicas, [])
        if not kept:
            kept.append(staged)

    def _put(self, k: int, pages_of: Any) -> list[jax.Array]:
        """Arrays of ``k`` pages per replica laid out as `gather`'s, each device's part
        ``pages_of(stores, key, replica)`` (a shard replicated on several devices read once)."""
        out: list[jax.Array] = []
        for stores, devices, shape, sharding in zip(self.shards, self.devices, self.shapes, self.shardings):
            parts: dict[tuple[Any, int], np.ndarray] = {}
            for _, key, r in devices:
                if (key, r) not in parts:
                    parts[key, r] = pages_of(stores, key, r)
            # One batched transfer for every device (several single ones cost more than the floor's one).
            arrays = jax.device_put([parts[key, r] for _, key, r in devices], [device for device, _, _ in devices])
            global_shape = (k * self.replicas, *shape[:2], *shape[3:])
            out.append(jax.make_array_from_single_device_arrays(global_shape, sharding, arrays))
        return out

    def land(self, staged: list[jax.Array], dst: np.ndarray, counts: np.ndarray) -> None:
        """Write offloaded pages (``staged``, laid out as `gather`'s) into the host pages ``dst``;
        a destination one past the slice (padding, or one `cancel` dropped) gets nothing."""
        for stores, distinct, a in zip(self.shards, self.distinct, staged):
            by_device = {shard.device: shard for shard in a.addressable_shards}
            for device, key, r in distinct:
                n = int(counts[r])
                rows = dst[r, :n]
                # a host view of the device buffer where the platform has one (CPU): the landing is the one copy
                data = np.asarray(by_device[device].data)
                keep = rows < self.host_local
                if keep.all():  # a slice of the staged pages, no temporary: one pass over the bytes
                    stores[key][rows] = data[:n]
                elif keep.any():
                    kept = np.flatnonzero(keep)
                    stores[key][rows[kept]] = data[kept]

    def cancel(self, dst: np.ndarray, pages: np.ndarray) -> None:
        """Drop the landings into the global host ``pages`` from an in-flight ``dst`` (`_split`'s
        per-replica local ids), in place."""
        for r in range(self.replicas):
            mine = pages[pages // self.host_local == r] - r * self.host_local
            dst[r][np.isin(dst[r], mine)] = self.host_local

    def zero(self, pages: np.ndarray) -> None:
        if not pages.size:
            return
        for stores, devices in zip(self.shards, self.devices):
            for _, key, r in devices:
                mine = pages[pages // self.host_local == r] - r * self.host_local
                stores[key][mine] = 0


def page_major_spec(spec: PartitionSpec) -> PartitionSpec:
    """The spec of a pool array's pages moved to the front: ``(pages, layers, heads, ...)``."""
    entries = tuple(spec) + (None,) * max(0, 3 - len(spec))
    return PartitionSpec(entries[2], *entries[:2], *entries[3:])


def _page_major(sharding: Any) -> Any:
    """``sharding`` of a pool array for its page-major transfer arrays (one that splits nothing,
    or a single device's, serves as it is)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, page_major_spec(sharding.spec), memory_kind=sharding.memory_kind)
    return sharding


def _key(index: tuple[Any, ...], ndim: int) -> tuple[Any, ...]:
    return tuple((s.start or 0, s.stop) if isinstance(s, slice) else s for s in index[:ndim])


@partial(jax.jit, static_argnames=("layouts",), donate_argnums=(0, 2))
def _move(pools: tuple[list[jax.Array], ...], off_ids: tuple[jax.Array, ...], staging: tuple[list[jax.Array], ...],
          on_ids: tuple[jax.Array, ...], device_ids: tuple[tuple[jax.Array, jax.Array, jax.Array], ...], *,
          layouts: tuple[PageLayout | None, ...]) -> tuple[tuple[list[jax.Array], ...], tuple[list[jax.Array], ...]]:
    """Every group's pending device work in one program (see `HostTier.apply` for the order).
    ``staging`` (donated): per group the pages to onload; returned holding the pages offloaded
    (untouched when none were)."""
    new_pools, staged_off = [], []
    for leaves, off, stage, on, ids, layout in zip(pools, off_ids, staging, on_ids, device_ids, layouts):
        p, s = _local_move(layout, leaves, off, stage, on, ids)
        new_pools.append(p)
        staged_off.append(s)
    return tuple(new_pools), tuple(staged_off)


def _local_move(layout: PageLayout | None, leaves: list[jax.Array], off: jax.Array, stage: list[jax.Array],
                on: jax.Array, ids: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[list[jax.Array], list[jax.Array]]:
    def local(leaves: list[jax.Array], stage: list[jax.Array], off: jax.Array, on: jax.Array,
              copy_src: jax.Array, copy_dst: jax.Array, scrubs: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
        r: int | jax.Array = 0
        if layout is not None and layout.page_shards > 1:
            r = jax.lax.axis_index(layout.page_axes)
        n = leaves[0].shape[2]

        def offload(operands: tuple[list[jax.Array], list[jax.Array]]) -> tuple[list[jax.Array], list[jax.Array]]:
            pages, _ = operands  # the stage holds no onload: a call moves pages one way only (`_Call.take`)
            gathered = [jnp.take(a, off[r], axis=2, mode="clip") for a in pages]  # padding reads the last page
            # The first page written back onto itself (no change; padding, one past the slice, is dropped):
            # every later write then follows the gather, so XLA updates the pool in place (a gathered
            # output beside in-place writes made it copy the whole pool on every call).
            pages = [a.at[:, :, off[r][:1]].set(g[:, :, :1], mode="drop") for a, g in zip(pages, gathered)]
            return pages, [jnp.moveaxis(g, 2, 0) for g in gathered]  # page-major

        # Each kind of work runs only when the call has some of it (padding costs no device work).
        leaves, staged = jax.lax.cond(jnp.any(off[r] < n), offload, _unchanged, (leaves, stage))

        def onload(pages: list[jax.Array]) -> list[jax.Array]:  # padding: one past the slice, dropped
            # `staged`, not `stage`: the same array when nothing was offloaded, and reading what the offload
            # branch returns leaves XLA one buffer for both (reading `stage` would make it copy the stage)
            return [a.at[:, :, on[r]].set(jnp.moveaxis(u, 0, 2), mode="drop") for a, u in zip(pages, staged)]

        def onloads(pages: list[jax.Array]) -> list[jax.Array]:
            result: list[jax.Array] = jax.lax.cond(jnp.any(on[r] < n), onload, _unchanged, pages)
            return result

        return page_work_local(leaves, None, copy_src, copy_dst, scrubs, layout=layout, between=onloads), staged

    if layout is None or layout.mesh.size == 1:
        return local(leaves, stage, off, on, *ids)
    specs = [layout.spec_for(a.ndim) for a in leaves]
    moved = [page_major_spec(s) for s in specs]
    replicated = (PartitionSpec(),) * 5
    mapped = jax.shard_map(local, mesh=layout.mesh, in_specs=(specs, moved, *replicated), out_specs=(specs, moved))
    result: tuple[list[jax.Array], list[jax.Array]] = mapped(leaves, stage, off, on, *ids)  # shard_map: typed here
    return result


def _unchanged(operands: Any) -> Any:
    return operands


class _TierToken:
    """A `HostTier`'s identity, compared by ``is``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<HostTier token {id(self):#x}>"


__all__ = ["HostTier", "page_major_spec"]
