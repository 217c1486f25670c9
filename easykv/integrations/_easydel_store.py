"""eSurge's prefix cache extended to a shared prefix store (`attach_store`): what eSurge's own cache misses of a
prompt's full pages is read from the store into fresh eSurge pages, and every full page eSurge caches is written to
the store in the background.

eSurge 0.3 keeps its own scheduler and page bookkeeping over easykv's page arrays (``use_easykv`` swaps only the
cache and the attention), and offers no hook for an external prefix tier. Three methods of objects of one engine
are wrapped (instance attributes, restored by `ESurgeStore.detach`; EasyDeL's files and classes are untouched):

- ``scheduler.kv_cache_manager.get_computed_pages`` (eSurge's prefix lookup): after eSurge's own hit, the rest of
  the prompt's full pages (all but one holding the last token, as eSurge's own lookup) are read from the store
  (the store's read policy: ``wait``, ``timeout`` or ``best_effort``), written into fresh eSurge pages (one jitted
  scatter per layer group of the stored bits), registered under eSurge's own page hashes in its page pool, and
  returned as computed prefix pages; eSurge touches them as any cache hit.
- ``page_pool.cache_full_pages`` (where eSurge names a page full, at scheduling time, before the step computes it):
  the page and its easykv digest are noted for the step being scheduled.
- ``scheduler.schedule`` / ``scheduler.update_from_output``: the pages a schedule noted are gathered from the cache
  once that step ran (`easykv.tiers.store.device_pages.gather_pages`, the copy to host started) and queued on the
  store's writer (a full queue drops them, counted): the step never waits.

Keys: the store's namespace of the `EasyKVCache`'s metadata and the page digest of easykv's `prefix_hash` (a
chained sha256 of the tokens, no salt, no weight version): the same keys an ``easykv.Runner`` of the same metadata
and model id uses. eSurge's own page hashes cannot be keys: Python's ``hash()`` of a chain whose root is 32 bytes
of ``os.urandom`` unless ``PYTHONHASHSEED`` is set (so no two processes agree), and 64 bits wide.

Limits (each refused at `attach`, nothing silently skipped): one process (a store value is read and written for
every kv head, which one process holds only alone), data-parallel size 1, one eSurge kv-cache group, prefix caching
on. ``eSurge.update_model_weights`` builds a new scheduler without these hooks: the weights changed, so attach again
with the new weights' model id.

Private to the EasyDeL integration (``easykv.integrations.easydel.attach_store``).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from easykv.integrations._easydel_model import EasyKVCache
from easykv.manager.prefix_hash import NO_SALT, ROOT_DIGEST, iter_page_digests
from easykv.storage.page_work import work_bucket
from easykv.tiers.store import codec
from easykv.tiers.store.arguments import check_store_arg, open_store
from easykv.tiers.store.namespace import StoreNamespace
from easykv.tiers.store.prefix_store import PrefixStore
from easykv.tiers.store.store_io import Fetch

log = logging.getLogger("easykv.store")

DIGEST_CACHE_REQUESTS = 1024  # requests whose page digests are remembered (a decode extends them page by page)
PENDING_SCHEDULES = 64  # schedules whose pages wait for their step; more means update_from_output is never called

_ATTACHED: weakref.WeakKeyDictionary[PrefixStore, ESurgeStore] = weakref.WeakKeyDictionary()


def attach(engine: Any, store: str | PrefixStore, model_id: str | None) -> ESurgeStore:
    """`ESurgeStore` of ``engine`` on ``store`` (see `easykv.integrations.easydel.attach_store`)."""
    check_store_arg(store, model_id)
    _check_engine(engine)
    if isinstance(store, PrefixStore) and (store in _ATTACHED or store.serving):
        raise ValueError("this PrefixStore serves another engine or runner already; open one PrefixStore per engine "
                         "(they share the store's values through its URL)")
    opened, owns = open_store(store, model_id)
    attached = ESurgeStore(engine, opened, owns)
    _ATTACHED[opened] = attached
    return attached


def _check_engine(engine: Any) -> None:
    """ValueError / TypeError naming what ``engine`` lacks, before anything is wrapped."""
    scheduler = getattr(engine, "scheduler", None)
    runner = getattr(engine, "runner", None)
    if scheduler is None or runner is None:
        raise TypeError(f"attach_store takes an eSurge engine (easydel.eSurge), got {type(engine).__name__}")
    cache = runner.executor_manager.kv_pages
    if not isinstance(cache, EasyKVCache):
        raise ValueError(f"this engine's cache is {type(cache).__name__}, not an EasyKVCache; build the engine on "
                         "use_easykv(model, ...) so that its pages are easykv's")
    manager = scheduler.kv_cache_manager
    if not manager.enable_caching:
        raise ValueError("this engine runs without prefix caching; the store extends eSurge's prefix cache: build it "
                         "with eSurge(..., enable_prefix_caching=True)")
    if manager.num_kv_cache_groups != 1:
        raise ValueError(f"this engine has {manager.num_kv_cache_groups} kv-cache groups; the store serves eSurge "
                         "engines of one (one page table for every layer)")
    if int(getattr(scheduler, "data_parallel_size", 1) or 1) != 1 or cache.easykv_metadata.page_shards != 1:
        raise ValueError("this engine is data parallel; the store serves eSurge engines of data-parallel size 1")
    if jax.process_count() != 1:
        raise ValueError(f"this engine runs on {jax.process_count()} processes; the store serves single-process "
                         "eSurge engines (every kv head of a page is read and written here)")


class ESurgeStore:
    """A shared prefix store serving one eSurge engine (see the module doc); made by `attach_store`.

    Attributes:
      store: the `PrefixStore` (its ``metrics()`` counts pages read, values written, refused, dropped).
      pages_read: prompt pages this engine took from the store.
    """

    def __init__(self, engine: Any, store: PrefixStore, owns: bool):
        self.store = store
        self.pages_read = 0
        self._owns = owns
        self._engine = engine
        self._scheduler = engine.scheduler
        self._manager = self._scheduler.kv_cache_manager
        self._pool = self._manager.page_pool
        meta = self._cache().easykv_metadata
        self.page_size = int(meta.page_size)
        self.namespace = StoreNamespace.of(meta, store.model_id)
        self._layouts = [codec.ValueLayout([((a.shape[0], *a.shape[3:]), codec.raw_dtype(a.dtype))
                                            for a in _group_leaves(self._cache(), g)])
                         for g in range(len(meta.groups))]
        self._slots = [(g, h) for g in range(len(meta.groups)) for h in range(self.namespace.group_heads[g])]
        self._digests_of: OrderedDict[str, list[bytes]] = OrderedDict()
        self._noting: list[tuple[int, bytes]] | None = None  # pages named full by the schedule running now
        self._waiting: dict[int, tuple[Any, list[tuple[int, bytes]]]] = {}  # per schedule output: its full pages
        store.hold(self, self.namespace)  # last before the wrapping: no runner attaches it while this engine holds it
        self._originals = {"lookup": self._manager.get_computed_pages, "cache": self._pool.cache_full_pages,
                           "schedule": self._scheduler.schedule, "update": self._scheduler.update_from_output}
        self._manager.get_computed_pages = self._lookup
        self._pool.cache_full_pages = self._cache_full_pages
        self._scheduler.schedule = self._schedule
        self._scheduler.update_from_output = self._update_from_output

    def _cache(self) -> EasyKVCache:
        cache: EasyKVCache = self._engine.runner.executor_manager.kv_pages
        return cache

    # ---- reads --------------------------------------------------------------------------------------
    def _lookup(self, request: Any, **kwargs: Any) -> Any:
        """eSurge's lookup, then the rest of the prompt's full pages from the store."""
        found, hit = self._originals["lookup"](request, **kwargs)
        params = request.sampling_params
        if params is not None and params.prompt_logprobs is not None:  # eSurge computes every token then
            return found, hit
        limit = (request.num_tokens - 1) // self.page_size
        start = hit // self.page_size
        if hit % self.page_size or start >= limit or not self.store.health.usable():
            return found, hit
        digests = self._digests(request, limit)
        values = self._read(digests, start)
        if not values:
            return found, hit
        pages = self._adopt(found.pages[0], values, request, start)
        self.pages_read += len(pages)
        self.store.count_served(len(pages), len(pages) * self.page_size)
        return type(found)((found.pages[0] + pages,)), hit + len(pages) * self.page_size

    def _read(self, digests: tuple[bytes, ...], start: int) -> list[list[list[np.ndarray]]]:
        """The values of ``digests[start:]`` that arrived by the store's read policy (a refused value ends them)."""
        ns = self.namespace
        heads = [[h for gg, h in self._slots if gg == g] for g in range(len(self._layouts))]

        def keys(digest: bytes) -> list[str]:
            return [key for g, group_heads in enumerate(heads) for key in ns.keys(g, digest, group_heads)]

        fetcher = self.store.fetcher
        fetch = fetcher.start(Fetch(digests, start, 0, self._slots, keys, [self._layouts[g] for g, _ in self._slots]))
        if fetch.start > start:  # begun when eSurge held fewer pages: read again from here
            fetcher.pop(digests)
            fetch = fetcher.start(Fetch(digests, start, 0, self._slots, keys,
                                        [self._layouts[g] for g, _ in self._slots]))
        if self.store.read == "wait":
            fetch.done.wait()
        elif self.store.read == "timeout":
            fetch.done.wait(self.store.timeout_s)
        skip = start - fetch.start
        arrived = fetch.arrived - skip
        if fetch.done.is_set() or arrived > 0:  # used or finished: a later lookup reads afresh
            fetcher.pop(digests)
        return fetch.take(skip + arrived)[skip:] if arrived > 0 else []

    def _adopt(self, hit_pages: list[Any], values: list[list[list[np.ndarray]]], request: Any,
               start: int) -> list[Any]:
        """Fresh eSurge pages holding ``values`` (pages ``start..`` of ``request``), registered in eSurge's prefix
        cache and left free (reference count 0) for eSurge to touch as any hit."""
        from easydel.inference.esurge.core.utils import PageHashWithGroupId

        pool = self._pool
        pool.touch((hit_pages,))  # eSurge's own hits may sit free: allocating must not evict them
        try:
            n = min(len(values), pool.get_num_free_pages())
            pages = pool.get_new_pages(n) if n > 0 else []
        finally:
            pool.free_pages(reversed(hit_pages))
        if not pages:
            return []
        self._write_device([p.page_id for p in pages], values[:n])
        hashes = self._manager.req_to_page_hashes[request.request_id]
        for i, page in enumerate(pages):
            key = PageHashWithGroupId(hashes[start + i], 0)
            page.page_hash = key
            pool.cached_page_hash_to_page[key][page.page_id] = page
        pool.free_pages(reversed(pages))  # the chain's tail is evicted first, as eSurge frees a request's pages
        return pages

    def _write_device(self, page_ids: list[int], values: list[list[list[np.ndarray]]]) -> None:
        """Write the stored bits of ``values`` (per page, per slot, per leaf) into device pages ``page_ids``."""
        cache = self._cache()
        meta = cache.easykv_metadata
        k = work_bucket(len(page_ids), int(meta.num_pages_per_layer))
        ids = np.full((k,), int(meta.num_pages_per_layer), np.int32)  # padding: out of range, dropped
        ids[: len(page_ids)] = page_ids
        slot_of = {slot: i for i, slot in enumerate(self._slots)}
        for g in range(len(meta.groups)):
            leaves = _group_leaves(cache, g)
            host = []
            for li, a in enumerate(leaves):
                rows = np.zeros((k, a.shape[0], a.shape[1], *a.shape[3:]), a.dtype)
                for i, page in enumerate(values):
                    for h in range(a.shape[1]):
                        rows[i, :, h] = page[slot_of[g, h]][li].view(a.dtype)
                host.append(rows)
            new = _scatter(tuple(a.sharding for a in leaves))(leaves, ids, host)
            treedef = jax.tree.structure((cache.key_stacks[g], cache.value_stacks[g]))
            keys, vals = jax.tree.unflatten(treedef, new)
            cache._put(g, keys, vals)

    # ---- writes -------------------------------------------------------------------------------------
    def _cache_full_pages(self, request: Any, pages: list[Any], page_hashes: list[Any], num_cached_pages: int,
                          num_full_pages: int, page_size: int, kv_cache_group_id: int) -> None:
        """eSurge's own, then note the pages it named full for the step being scheduled."""
        self._originals["cache"](request, pages, page_hashes, num_cached_pages, num_full_pages, page_size,
                                 kv_cache_group_id)
        if self._noting is None or num_full_pages <= num_cached_pages:
            return
        digests = self._digests(request, num_full_pages)
        self._noting.extend((pages[i].page_id, digests[i]) for i in range(num_cached_pages, num_full_pages)
                            if not pages[i].is_null)

    def _schedule(self) -> Any:
        self._noting = []
        try:
            out = self._originals["schedule"]()
            noted = self._noting
        finally:
            self._noting = None
        if noted:
            if len(self._waiting) >= PENDING_SCHEDULES:
                raise RuntimeError(f"{len(self._waiting)} eSurge schedules' pages wait for update_from_output, which "
                                   "never came; the store's hooks need eSurge's schedule -> execute -> "
                                   "update_from_output loop")
            self._waiting[id(out)] = (out, noted)
        return out

    def _update_from_output(self, scheduler_output: Any, model_output: Any) -> Any:
        """Queue the pages the step just run filled, then eSurge's own (which may free them)."""
        entry = self._waiting.pop(id(scheduler_output), None)
        if entry is not None:
            self._queue_writes(entry[1])
        return self._originals["update"](scheduler_output, model_output)

    def _queue_writes(self, pages: list[tuple[int, bytes]]) -> None:
        """Queue ``pages`` (eSurge page, digest) on the store's writer (gathered from the cache; the step never
        waits)."""
        cache = self._cache().to_easykv()
        for g in range(len(self._layouts)):
            self.store.queue_device_pages(cache, g, pages)

    # ---- both ---------------------------------------------------------------------------------------
    def _digests(self, request: Any, n: int) -> tuple[bytes, ...]:
        """easykv's digests of the first ``n`` full pages of ``request``'s tokens (extended as it decodes)."""
        known = self._digests_of.pop(request.request_id, [])
        if len(known) < n:
            ps = self.page_size
            tokens = np.asarray(list(request.all_token_ids[len(known) * ps: n * ps]), np.int64)
            known.extend(iter_page_digests(tokens, ps, n - len(known), NO_SALT, known[-1] if known else ROOT_DIGEST))
        self._digests_of[request.request_id] = known
        if len(self._digests_of) > DIGEST_CACHE_REQUESTS:
            self._digests_of.popitem(last=False)
        return tuple(known[:n])

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued page is written (`PrefixStore.flush`).

        Args:
          timeout_s: seconds to wait at most; None: until the queue is empty."""
        return self.store.flush(timeout_s)

    def detach(self) -> None:
        """Unwrap the engine's methods (what is queued still lands); closes the store when `attach_store` opened
        it from a URL."""
        for obj, name in ((self._manager, "get_computed_pages"), (self._pool, "cache_full_pages"),
                          (self._scheduler, "schedule"), (self._scheduler, "update_from_output")):
            obj.__dict__.pop(name, None)
        _ATTACHED.pop(self.store, None)
        self.store.release(self)
        if self._owns:
            self.store.close()


def _group_leaves(cache: EasyKVCache, group: int) -> list[jax.Array]:
    """Layer group ``group``'s page arrays, ``(layers, kv heads, pages, page_size, ...)`` each."""
    return jax.tree.leaves((cache.key_stacks[group], cache.value_stacks[group]))


@functools.lru_cache(maxsize=64)
def _scatter(shardings: tuple[Any, ...]) -> Any:
    """A program writing page-major rows ``(k, layers, heads, page_size, ...)`` into pages ``ids`` of each leaf (ids
    out of range: dropped), the leaves donated and laid out as they were."""

    def scatter(leaves: list[jax.Array], ids: jax.Array, rows: list[jax.Array]) -> list[jax.Array]:
        return [a.at[:, :, ids].set(jnp.moveaxis(r, 0, 2), mode="drop") for a, r in zip(leaves, rows)]

    return jax.jit(scatter, donate_argnums=(0,), out_shardings=list(shardings))


__all__ = ["ESurgeStore", "attach"]
