"""The one engine loop: apply a manager's plan to a cache, run the caller's jitted step, commit.

The manager decides (`PageManager.schedule` returns a frozen `StepPlan`: the step's metadata and
the device work it implies) and never sees a cache or a tier; the `Runner` holds the cache (and its
`HostTier`) and carries a plan out::

    runner = easykv.Runner(manager, cache, host=tier)        # host: only with a host-memory tier
    plan = manager.schedule(seq_ids, num_new_tokens, pad_tokens_to=256, pad_seqs_to=32)
    logits = runner.run(plan, model_step, token_ids=new_ids)  # work, step, commit (abort on failure)

`Runner.run` applies the plan's work (host-tier transfers, copy-on-write copies, scrubs: one program
whose page ids are padded to a power of two) unless `Runner.schedule` applied it already, calls
``step(cache, plan) -> (cache, out)`` (the engine's one jitted step for all layers: it writes by
``plan.metadata`` and attends), and commits what each sequence wrote. On any exception, the step's
or the commit's, the plan is aborted (its sequences stay as they were before it, usable and
releasable) and the exception goes on. The work a plan carries must reach the device before any
other step writes pages: run a plan right after it is made, or make it with `Runner.schedule`,
which applies the work at once. The demo engine, the Tunix rollout engine and sequence import all
run on it.

Before anything moves, the runner checks what it is given: the cache is a live cache of the
manager's pool (`check_cache_of`), the tier is that cache's and holds this manager's host pages
(`PageManager.attach_host_tier`), the plan is an open plan of this manager (`PageManager.commit`'s
own checks); a refusal names the difference and changes nothing.

Sits above ``manager``, ``storage`` and ``tiers``; imported by the engines (``demo``,
``integrations``) and ``checkpoint``'s sequence import. Never imports ``checkpoint``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from easykv.manager.device_work import DeviceWork
from easykv.manager.manager import PageManager
from easykv.manager.step_plan import StepPlan
from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.storage.cache import PagedAttentionCache
from easykv.storage.pool_match import check_cache_of
from easykv.tiers.host import HostTier
from easykv.tiers.store.prefix_store import PrefixStore

Out = TypeVar("Out")
# The engine's step: the cache (donate it) and the plan in; the new cache and anything of its own out.
Step = Callable[[PagedAttentionCache, StepPlan], tuple[PagedAttentionCache, Out]]


class Runner:
    """Applies ``manager``'s plans to ``cache`` (and its host tier): see the module doc.

    Args:
      manager: the `PageManager` whose plans this runner applies.
      cache: the live `PagedAttentionCache` of the manager's pool; the runner holds it from now on
        (`cache` gives the current one after each call; buffers are donated).
      host: the cache's `HostTier`, required when the manager has a host-memory tier and refused
        otherwise.
      store: a `PrefixStore` below the host tier (it needs ``host``), serving this runner's cache from now
        on; None: no shared store.
    """

    def __init__(self, manager: PageManager, cache: PagedAttentionCache, *, host: HostTier | None = None,
                 store: PrefixStore | None = None):
        if not isinstance(manager, PageManager):
            raise TypeError(f"manager must be a PageManager, got {type(manager).__name__}")
        if store is not None and not isinstance(store, PrefixStore):
            raise TypeError(f"store must be an easykv.tiers.store.PrefixStore, got {type(store).__name__}")
        self._manager = manager
        self._cache = cache
        self._host = host
        self._check(cache, host)
        if store is not None:
            store.attach(manager, host)
        self._store = store
        self._copies = 0  # device pages copied (copy-on-write) by this runner's work
        self._applied: weakref.WeakSet[StepPlan] = weakref.WeakSet()  # plans whose work this runner ran

    @property
    def manager(self) -> PageManager:
        """The `PageManager` whose plans this runner applies."""
        return self._manager

    @property
    def cache(self) -> PagedAttentionCache:
        """The cache as the last call left it (the one before it was donated)."""
        return self._cache

    @property
    def copies(self) -> int:
        """Device pages this runner's work copied (copy-on-write), since it was made."""
        return self._copies

    @property
    def store(self) -> PrefixStore | None:
        """The shared prefix store below the host tier (None without one)."""
        return self._store

    @property
    def host(self) -> HostTier | None:
        """The cache's `HostTier` (None without a host-memory tier)."""
        return self._host

    def replace_cache(self, cache: PagedAttentionCache, *, host: HostTier | None = None) -> None:
        """Hold ``cache`` (and its tier) from now on: the engine changed it outside the runner (a checkpoint
        restored, a sleeping cache woken, a sequence imported). Checked as the constructor checks; nothing changes
        on a refusal.

        Args:
          cache: a live cache of the manager's pool.
          host: its `HostTier`, as the constructor's."""
        self._check(cache, host)
        self._cache, self._host = cache, host

    def _check(self, cache: PagedAttentionCache, host: HostTier | None) -> PagedAttentionCacheMetaData:
        manager = self._manager
        unknown = [name for name in manager.tier_names if name != "host"]
        if unknown:  # their transfers would be handed over with the work and never land
            raise ValueError(f"the manager has the tiers {unknown} below its device pool, whose transfers this runner "
                             "cannot apply (it applies the device's work and the host tier's, through its HostTier)")
        meta = check_cache_of(cache, manager.metadata, "the runner's cache")
        if not manager.has_host_tier:
            if host is not None:
                raise ValueError("host= was given but the manager has no host-memory tier; leave it out, or create the "
                                 "metadata with one (PagedAttentionCacheMetaData.create(..., host_memory_bytes=N))")
            return meta
        if host is None:
            raise ValueError("the manager has a host-memory tier: pass the cache's tier, host=easykv.HostTier(cache) "
                             "(made once, for the cache's life)")
        if not isinstance(host, HostTier):
            raise ValueError(f"host= must be the easykv.HostTier of this cache (tier = easykv.HostTier(cache), made "
                             f"once, for the cache's life), got {type(host).__name__}")
        host.check(cache, manager.metadata)
        self._attach(host)
        return meta

    def _attach(self, host: HostTier | None) -> None:
        """``host`` holds the manager's host pages from now on (`PageManager.attach_host_tier`): checked before
        any work that touches it is handed over or run."""
        if host is not None:
            host.bind(self._manager.attach_host_tier(host.token, host.owner))

    # ---- admission: the prefix caches, the shared store's included -------------------------------
    def prefetch(self, token_ids: Sequence[int] | np.ndarray, *, salt: object = None) -> None:
        """Start reading the prompt's pages that only the shared store holds (in the background), so that
        `match_prefix` finds them arrived: call it when a request arrives. Without a store: nothing.

        Args:
          token_ids: the prompt, ``(prompt_len,)`` ints.
          salt: the prefix namespace, as `PageManager.match_prefix`'s."""
        if self._store is not None:
            self._store.prefetch(self._manager, token_ids, salt)

    def match_prefix(self, seq_id: int, token_ids: Sequence[int] | np.ndarray, *, salt: object = None) -> int:
        """`PageManager.match_prefix`, after the pages the shared store delivered (by its read policy) entered the
        host tier: the device, the host tier and the store, nearest first, the longest hit taken. Call it between
        steps (not between `PageManager.schedule` and `run` of that plan). Returns the prompt tokens found.

        Args:
          seq_id: a freshly claimed sequence id.
          token_ids: the prompt, ``(prompt_len,)`` ints.
          salt: the prefix namespace."""
        store = self._store
        if store is None:
            return self._manager.match_prefix(seq_id, token_ids, salt=salt)
        self._check(self._cache, self._host)
        self._manager.sequence(seq_id)  # a claimed id, before the store reads anything
        before = self._manager.cached_prefix_length(token_ids, salt=salt)
        if self._host is not None:
            store.bring_in(self._manager, self._host, self._cache, token_ids, salt)
        found = self._manager.match_prefix(seq_id, token_ids, salt=salt)
        store.count_served(0, max(found - before, 0))
        return found

    # ---- the loop --------------------------------------------------------------------------------
    def schedule(self, seq_ids: Sequence[int], num_new_tokens: int | Sequence[int], *,
                 pad_tokens_to: int | None = None, pad_seqs_to: int | None = None) -> StepPlan:
        """`PageManager.schedule`, with the plan's device work applied at once (`run` then runs only the step):
        for an engine that schedules ahead and runs other steps meanwhile, whose writes must find that work
        done (a scrub of a page the next admission takes lands before that admission writes it).

        Args:
          seq_ids: ``n`` claimed sequence ids, each once, none in an open plan.
          num_new_tokens: tokens each writes: one int for all, or ``n`` ints >= 0.
          pad_tokens_to: token rows of the metadata (None: exactly the step's new tokens).
          pad_seqs_to: sequence rows of the metadata (None: ``n``)."""
        self._check(self._cache, self._host)  # before the manager hands any work over
        plan = self._manager.schedule(seq_ids, num_new_tokens, pad_tokens_to=pad_tokens_to, pad_seqs_to=pad_seqs_to)
        self._apply_plan(plan)
        return plan

    def schedule_decode(self, seq_ids: Sequence[int], num_steps: int, *,
                        max_tokens: int | Sequence[int] | None = None, pad_seqs_to: int | None = None) -> StepPlan:
        """`PageManager.schedule_decode`, with the plan's device work applied at once (see `schedule`).

        Args:
          seq_ids: ``n`` claimed sequence ids, each once, none in an open plan.
          num_steps: decode steps of the loop, ``1 .. max_sequences``.
          max_tokens: ``0 .. num_steps`` tokens each may write: one int for all, or ``n`` ints; None: ``num_steps``.
          pad_seqs_to: sequence rows of the metadata (None: ``n``)."""
        self._check(self._cache, self._host)
        plan = self._manager.schedule_decode(seq_ids, num_steps, max_tokens=max_tokens, pad_seqs_to=pad_seqs_to)
        self._apply_plan(plan)
        return plan

    def _apply_plan(self, plan: StepPlan) -> None:
        """Run ``plan``'s work once (abort the plan when it fails: its sequences stay usable)."""
        if plan in self._applied:
            return
        try:
            self._apply(plan.work)
        except BaseException:
            self._manager.abort(plan)
            raise
        self._applied.add(plan)

    def run(self, plan: StepPlan, step: Step[Out], *, token_ids: object = None, num_tokens: object = None) -> Out:
        """Carry ``plan`` out: its device work, then ``step(cache, plan) -> (cache, out)``, then
        ``manager.commit(plan, token_ids, num_tokens)``; returns ``out``. On any exception (the work's, the step's
        or the commit's) the plan is aborted and the exception raised. A plan of another manager, or one that
        ended, is refused before anything runs.

        Args:
          plan: an open `StepPlan` of the runner's manager.
          step: the engine's step: takes the cache (donate it) and the plan, returns the new cache and anything.
          token_ids: what `PageManager.commit` takes, or a function of ``out`` giving it (a decode loop's
            sampled ids); None: a mixed step's planned tokens, ids unknown.
          num_tokens: likewise (a decode loop's counts), or None.
        """
        self._manager.check_plan(plan, "run")
        if self._store is not None and self._store.closed:  # before anything moves: its writes would fail after commit
            raise RuntimeError("the runner's PrefixStore was closed; make the runner with an open store (or none)")
        if plan not in self._applied:  # the cache alive and the tier still this manager's: else the plan stays open,
            self._check(self._cache, self._host)  # its work kept for a runner that can apply it
        try:
            if plan not in self._applied:  # `schedule` ran it already
                self._apply(plan.work)
            cache, out = step(self._cache, plan)
            if not isinstance(cache, PagedAttentionCache):  # else the next step would find no cache
                raise TypeError(f"the step must return (cache, out) with the new PagedAttentionCache first, got "
                                f"{type(cache).__name__}")
            self._cache = cache
            ids = token_ids(out) if callable(token_ids) else token_ids
            counts = num_tokens(out) if callable(num_tokens) else num_tokens
            self._manager.commit(plan, ids, counts)
        except BaseException:
            if plan.ended is None:  # a refused commit leaves it open: nothing it wrote counts
                self._manager.abort(plan)
            raise
        if self._store is not None:  # the pages this step filled, queued (write_through)
            self._store.sync(self._manager, self._cache, self._host)
        return out

    def apply_pending(self) -> int:
        """Apply the work no plan took (`PageManager.take_work`): a swap-out's offloads before its
        sequence is preempted, an import's copies. Returns the device pages copied."""
        self._check(self._cache, self._host)  # before the manager hands anything over
        work = self._manager.take_work()
        return self._apply(work)

    def forget_host_tier(self) -> int:
        """`PageManager.forget_host_tier`, and the host pages it leaves zeroed in this runner's tier (the manager
        scrubs released pages) before the tier is detached. Returns the cached pages forgotten."""
        self.apply_pending()  # device work first, through the tier it was recorded for
        forgotten = self._manager.forget_host_tier()
        host = self._host
        if host is not None:  # the pages it left: host scrubs only (no transfer was pending)
            host.scrub(tuple(transfer[4] for transfer in self._manager.take_work().transfers()))
        self._host = None
        return forgotten

    def _apply(self, work: DeviceWork) -> int:
        """Run ``work`` on the cache and the tier (transfers, copies, scrubs, in one program); returns the
        device pages copied."""
        if self._store is not None:  # the host pages evicted are read before this work overwrites them
            self._store.sync(self._manager, self._cache, self._host)
        if work.empty:
            return 0
        host = self._host
        if host is None and work.has_host_work:
            raise ValueError("the work holds host-tier transfers or scrubs but this runner has no HostTier; make the "
                             "runner with host=easykv.HostTier(cache)")
        if host is None:
            cache = self._cache
            if work.num_copies:
                cache = cache.copy_pages(*work.copies())
            if any(a.size for a in work.scrubs()):
                cache = cache.zero_pages(work.scrubs())
            self._cache = cache
        else:  # every piece in one program of the tier's (a bounded number of shapes: `easykv.storage.page_work`)
            self._cache = host.apply(self._cache, work.transfers(), copies=tuple(zip(*work.copies())),
                                     scrubs=work.scrubs(), manager_metadata=self._manager.metadata)
            # The host pages these transfers left unreferenced: the tier has read them (onload
            # sources) or drops their landing (offload destinations), so they are zeroed now.
            host.scrub(work.host_scrubs_after())
        self._copies += work.num_copies
        return work.num_copies


def apply_pending(manager: PageManager, cache: PagedAttentionCache, *,
                  host: HostTier | None = None) -> tuple[PagedAttentionCache, int]:
    """Apply ``manager``'s pending device work to ``cache`` (and its tier) once: ``Runner(manager, cache,
    host=host).apply_pending()``. Returns the new cache and the device pages copied.

    Args:
      manager: the `PageManager` whose work it is.
      cache: a live cache of its pool; donated.
      host: the cache's `HostTier`, with a host-memory tier; else None."""
    runner = Runner(manager, cache, host=host)
    copied = runner.apply_pending()
    return runner.cache, copied


__all__ = ["Runner", "apply_pending"]
