"""PageManager: the host-side brain of the paged cache (which pages each sequence owns).

Continuous batching over a paged pool needs one authority that admits sequences, hands out
pages at page boundaries, shares pages between sequences with a common prefix (prefix caching)
or a common history (fork, copy-on-write), and plans each step (`StepPlan`: its `RaggedStep` metadata
and device work).

Pure numpy/Python and deterministic: the same calls give the same page ids on every host
(lowest free page first, LRU in release order, no dict-iteration or hash-randomization
dependence), which multi-host lock-step relies on. The block table is one preallocated int32
array, so a step's metadata is built by slicing it, not by looping over pages.

`PageManager` is a facade, the way vLLM's kv-cache manager sits on a coordinator over one manager
per attention kind: it checks the caller's input and hands each call to the parts that own the state
(``_seqs``: `SequenceTable`; ``_groups``: `GroupCoordinator` over one allocator per layer group, its
class chosen by the group's attention kind; ``_versions``: `VersionLog`; ``_tiers``: `LowerTiers`,
the tiers below the device pool, the host tier's `HostTierLayer` (``_host``) first; ``_copies``:
`CopyCounter`; the package doc lists what each owns), or to coordinator code handed the parts it
changes, which it changes through their methods only (growth, commit, rollback, admit, step_plan).
state.py and consistency.py read and check the parts (`ManagerParts`). None of them imports this
module; it never imports ``storage``, ``attention``, ``checkpoint`` or ``tiers``.

Life of a sequence (Modular MAX names in brackets)::

    [seq] = manager.claim(1)                              # [claim]
    done = manager.match_prefix(seq, prompt, salt=user)   # prompt[:done] is already cached
    plan = manager.schedule([seq], [len(prompt) - done])  # [fetch]: a frozen plan (metadata, device work)
    out = runner.run(plan, jitted_step, token_ids=[prompt[done:]])   # work, step, commit (abort on failure)
    plan = manager.schedule_decode(ids, num_steps=k)      # k decode steps in one device loop
    out = runner.run(plan, jitted_loop, token_ids=lambda o: o.written, num_tokens=lambda o: o.num_written)
    manager.release(seq)                                  # [release]

The manager decides and never sees a cache or a tier: `easykv.Runner` carries a plan out. Without
a runner: apply ``plan.work`` to the cache, run the step, then ``manager.commit(plan, token_ids)``
(or ``manager.abort(plan)``).

Three tiers of error: `CacheFullError` when the pool or the batch is full (expected; nothing
changed), `ValueError`/`UnknownSequenceError` for bad input (nothing changed), `InvariantError`
when the manager's own bookkeeping is broken (a bug).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np

from easykv.errors import CacheFullError, InvariantError, ManagerStateError, UnknownSequenceError
from easykv.manager import admit, growth, rollback, step_plan
from easykv.manager.allocators import allocator_for
from easykv.manager.broken import Broken
from easykv.manager.commit import commit_tokens, parse_tokens
from easykv.manager.consistency import check_consistency
from easykv.manager.coordinator import GroupCoordinator, PerGroup, single_group  # the last: re-exported
from easykv.manager.deprecated import DeprecatedMethods
from easykv.manager.device_work import HOST_TIER, CopyCounter, DeviceWork, has_pending, take_work
from easykv.manager.host_tier import HostTierLayer, require_host
from easykv.manager.lower_tier import TierFactory
from easykv.manager.metrics import GroupPoolMetrics, PageManagerMetrics, SequenceInfo, snapshot
from easykv.manager.open_plans import freeze_planned
from easykv.manager.parts import ManagerParts
from easykv.manager.prefix_hash import as_token_ids
from easykv.manager.reshard import reshard_state
from easykv.manager.sequences import SequenceTable
from easykv.manager.state import STATE_KEYS, read_state, write_state
from easykv.manager.step_plan import StepPlan
from easykv.manager.store_feed import SharedStoreMethods  # the first: re-exported
from easykv.manager.tier_set import LowerTiers, build_tiers
from easykv.manager.versions import VersionLog, VersionMetrics, WeightVersion
from easykv.spec import sizing
from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.step.loop import increment_groups
from easykv.step.ragged import (  # the last two: re-exported
    RaggedStep,
    increment_cache_lengths,
    stack_metadata,
)
from easykv.validation import boolean, non_negative_int, positive_int

_MAX_TABLE_ENTRIES = 1 << 28  # a 1 GiB int32 block table: beyond any real batch x length
StepMetadata: TypeAlias = PerGroup[RaggedStep]


@freeze_planned  # an open plan's sequences change only through its commit or abort (`open_plans` declares each member)
class PageManager(SharedStoreMethods, DeprecatedMethods):
    """Sequences, their pages and the prefix cache of one paged pool (see the module doc).

    Sequence ids are the rows of the block table, ``0 .. metadata.batch_size - 1``. While a plan is open
    (`schedule` or `schedule_decode` until its `commit` or `abort`), every call that would change one of its
    sequences is refused with nothing changed; what each public member changes is declared once, in `open_plans`.

    Args:
      metadata: the pool's `PagedAttentionCacheMetaData` (sequences, pages, layer groups).
      enable_prefix_caching: keep full pages findable by content (chained sha256 with salt).
      scrub_released: report pages that leave every owner for zeroing (a plan's ``work.scrubs()``), so no
        tenant's K/V outlives its sequence (evicted cached pages and host pages likewise).
      host_tier: keep evicted prefix pages and swapped-out sequences in the metadata's host-memory
        tier (`host_tier.py`); None (the default) uses it when the metadata has one.
      tiers: more tiers below the device pool (and the host tier), nearest first: each a factory
        called with the manager's `GroupCoordinator`, returning a `lower_tier.LowerTier` of its own
        ``name`` (a shared prefix store, say). None of them is part of a state; `clone` copies them.
    """

    def __init__(self, metadata: PagedAttentionCacheMetaData, *, enable_prefix_caching: bool = True,
                 scrub_released: bool = False, host_tier: bool | None = None, tiers: Sequence[TierFactory] = ()):
        if not isinstance(metadata, PagedAttentionCacheMetaData):
            raise ValueError(f"metadata must be a PagedAttentionCacheMetaData, got {type(metadata).__name__}")
        enable_prefix_caching = boolean("enable_prefix_caching", enable_prefix_caching)
        scrub_released = boolean("scrub_released", scrub_released)
        host_tier = metadata.has_host_tier if host_tier is None else boolean("host_tier", host_tier)
        if host_tier and not metadata.has_host_tier:
            raise ValueError("host_tier=True but the metadata has no host-memory tier (host_pages_per_layer is None); "
                             "create it with PagedAttentionCacheMetaData.create(..., host_memory_bytes=N)")
        groups = metadata.groups
        entries = metadata.batch_size * metadata.num_pages_per_sequence * len(groups)
        if entries > _MAX_TABLE_ENTRIES:
            raise ValueError(
                f"batch_size={metadata.batch_size} sequences x "
                f"num_pages_per_sequence={metadata.num_pages_per_sequence} "
                f"x {len(groups)} layer group(s) is a block table of {entries} entries, more than the "
                f"{_MAX_TABLE_ENTRIES} one host manages; lower batch_size or max_sequences")
        self.metadata = metadata
        self.page_size = ps = int(metadata.page_size)
        self.batch_size = b = int(metadata.batch_size)
        self.max_length = int(metadata.max_sequences)
        self.pages_per_sequence = int(metadata.num_pages_per_sequence)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.scrub_released = bool(scrub_released)
        self._seqs = SequenceTable(b, ps, self.max_length)
        self._groups = GroupCoordinator(
            allocator_for(g, index=i, grouped=len(groups) > 1, page_size=ps, batch_size=b,
                          pages_per_sequence=self.pages_per_sequence, page_shards=int(metadata.page_shards),
                          scrub_released=scrub_released) for i, g in enumerate(groups))
        self._host = HostTierLayer(self._groups, [metadata.group_host_pages(g) for g in groups]) if host_tier else None
        self._tiers: LowerTiers = build_tiers(self._groups, self._host, tiers, (*STATE_KEYS, HOST_TIER))
        self._tier_factories = tuple(tiers)  # checked: a clone laid out anew makes its own tiers with them
        self._tiers.set_scrub_released(scrub_released)
        self._groups.set_tiers(self._tiers)
        self._versions = VersionLog()
        self._copies = CopyCounter()

    def _parts(self) -> ManagerParts:
        return ManagerParts(metadata=self.metadata, seqs=self._seqs, groups=self._groups, versions=self._versions,
                            tiers=self._tiers, copies=self._copies, caching=self.enable_prefix_caching,
                            scrub=self.scrub_released)

    def _is_stale(self, row: int) -> bool:
        return self._seqs.version[row] != self._versions.current

    @property
    def num_groups(self) -> int:
        """Layer groups of the metadata: one pool, one block table and one step metadata each."""
        return len(self._groups)

    # ---- sequence slots [MAX: claim, external_claim, contains, release, slots_remaining] -------
    def claim(self, n: int = 1) -> list[int]:
        """Claim ``n`` free sequence ids (lowest first) for new requests; CacheFullError when fewer are free.

        Args:
          n: how many ids, >= 0 (default 1)."""
        n = non_negative_int("n", n)
        free = self._seqs.free_rows()
        if n > free.size:
            raise CacheFullError(
                f"claim({n}) needs {n} sequence slots but only {free.size} of batch_size={self.batch_size} "
                "are free; release finished sequences first or create the metadata with a larger batch_size",
                resource="sequence slots", needed=n, available=int(free.size))
        ids: list[int] = free[:n].tolist()  # numpy types tolist() as Any
        self._seqs.claim(ids, self._versions.current, self._versions.root())
        return ids

    def external_claim(self, seq_ids: Sequence[int]) -> None:
        """Claim ids chosen by the caller (e.g. a scheduler that owns the numbering).

        Args:
          seq_ids: free ids in ``0 .. batch_size - 1``, each once (a list, not an int)."""
        self._seqs.claim(self._seqs.free_ids(seq_ids), self._versions.current, self._versions.root())

    def contains(self, seq_id: int) -> bool:
        """Whether ``seq_id`` is claimed.

        Args:
          seq_id: an int (ValueError for a non-int); False for any but a claimed id, out of range included."""
        sid = self._seqs.check_id(seq_id, strict=False)  # the checked value, never the object again
        return sid >= 0 and bool(self._seqs.active[sid])

    __contains__ = contains

    @property
    def slots_remaining(self) -> set[int]:
        """The free sequence ids."""
        return set(self._seqs.free_rows().tolist())

    @property
    def active_ids(self) -> list[int]:
        """The claimed sequence ids, ascending."""
        return self._seqs.active_ids

    def release(self, seq_id: int) -> None:
        """End a sequence: its id becomes free, its pages lose a reference. Full pages stay in the prefix cache
        (tail pages are evicted before head pages); others are freed.

        Args:
          seq_id: a claimed sequence id, with no open plan."""
        row = self._seqs.row(seq_id)
        self._tiers.release_held(row)
        self._groups.release_row(row, int(self._seqs.npages[row]), stale=self._is_stale(row))
        self._seqs.reset(row)

    # ---- prefix caching ------------------------------------------------------------------------
    def match_prefix(self, seq_id: int, token_ids: Sequence[int] | np.ndarray, *, salt: Any = None) -> int:
        """Attach the longest run of cached full pages that starts ``token_ids`` (with the same ``salt``) to a
        freshly claimed sequence. Returns how many prompt tokens need no prefill (a multiple of page_size, at most
        ``len(token_ids) - 1``: the last prompt token is always computed so the model has logits to sample from).
        The sequence then continues from there: commit ``token_ids[returned:]`` after writing them.

        Args:
          seq_id: a freshly claimed sequence id (no tokens, no pages yet).
          token_ids: the prompt, ``(prompt_len,)`` ints in ``0 .. 2**31 - 1``.
          salt: the prefix namespace (a tenant or adapter): a str, bytes or 64-bit int; None: the default."""
        row = self._seqs.row(seq_id)
        return admit.match_prefix(self._seqs, self._groups, self._versions, self._tiers, row, as_token_ids(token_ids),
                                  salt, caching=self.enable_prefix_caching)

    def cached_prefix_length(self, token_ids: Sequence[int] | np.ndarray, *, salt: Any = None) -> int:
        """How many tokens of ``token_ids`` `match_prefix` would find cached now (no state change), on the device
        or in the host tier (`match_prefix` takes fewer when the device has no room to bring the host part back).

        Args:
          token_ids: the prompt, ``(prompt_len,)`` ints in ``0 .. 2**31 - 1``.
          salt: the prefix namespace, as `match_prefix`'s."""
        tokens = as_token_ids(token_ids)
        if not self.enable_prefix_caching:
            return 0
        return admit.cached_prefix_length(self._groups, self._versions, tokens, salt)

    def resume(self, seq_id: int, first_position: int) -> None:
        """Start the freshly claimed ``seq_id`` at ``first_position``: a sequence whose earlier tokens this cache
        will never hold (one moved here with only its window's tokens, see `import_sequence`). It holds no pages for
        them: its length becomes ``first_position`` rounded down to a page, and the tokens from there on are
        reserved, written and committed as usual (`schedule`, then `commit` without ids; they are not entered in the
        prefix cache, whose keys need every token from the first). Write up to a length whose window starts at or
        after ``first_position`` before attention reads the sequence. ValueError when a layer group attends fully
        (its queries read every position), or for a sequence that already holds tokens or pages.

        Args:
          seq_id: a freshly claimed sequence id.
          first_position: its first position this cache will hold, ``0 .. max_sequences - 1``."""
        admit.resume(self._seqs, self._groups, self._tiers, self._seqs.row(seq_id), first_position)

    # ---- growth [MAX: fetch, increment_cache_lengths] ------------------------------------------------
    def fork(self, seq_id: int, n: int | None = None) -> int | list[int]:
        """A new sequence with the same history (parallel sampling, beam search), or ``n`` of them, all or none
        (GRPO-style samples of one prompt). Written pages are shared; whichever sequence next writes into a shared
        partly filled page gets a private copy. Pages reserved ahead but not written stay with ``seq_id``.

        Args:
          seq_id: the claimed sequence to copy, not swapped out.
          n: ``1 .. batch_size`` children, returned as a list; None (default): one, returned as an int."""
        row = self._seqs.row(seq_id)
        self._tiers.refuse_held(row, "fork")
        hint = f"children of one sequence, at most batch_size={self.batch_size}"
        count = 1 if n is None else positive_int("n", n, hi=self.batch_size, hint=hint)
        children = growth.fork(self._seqs, self._groups, row, count,
                               what=f"fork({row}{'' if n is None else f', n={count}'})")
        return children[0] if n is None else children

    def schedule(self, seq_ids: Sequence[int], num_new_tokens: int | Sequence[int], *,
                 pad_tokens_to: int | None = None, pad_seqs_to: int | None = None) -> StepPlan:
        """One engine step in which sequence ``seq_ids[b]`` writes ``num_new_tokens[b]`` tokens (a prefill chunk, a
        decode, or 0), as a frozen `StepPlan`: room reserved (all or nothing: CacheFullError, nothing changed), the
        mixed-form metadata of every layer group, and every piece of device work pending (`StepPlan.work`: the
        step's copy-on-write copies, scrubs, host-tier transfers), which the runner applies before the step's
        writes. End it once: `commit` what each sequence wrote, or `abort`. Until then every call that would
        change one of its sequences is refused (ValueError, nothing changed); other sequences carry on.

        Args:
          seq_ids: ``n`` claimed sequence ids, each once, none in an open plan (row ``b`` of the metadata).
          num_new_tokens: tokens each writes: one int for all, or ``n`` ints >= 0.
          pad_tokens_to: token rows of the metadata, >= the step's new tokens (None: exactly those).
          pad_seqs_to: sequence rows of the metadata, >= ``n`` (None: ``n``); fixed shapes, few jit traces."""
        return step_plan.schedule(self._seqs, self._groups, self._tiers, self._copies, seq_ids, num_new_tokens,
                                  pad_tokens_to=pad_tokens_to, pad_seqs_to=pad_seqs_to, metadata=self.metadata)

    def schedule_decode(self, seq_ids: Sequence[int], num_steps: int, *,
                        max_tokens: int | Sequence[int] | None = None, pad_seqs_to: int | None = None) -> StepPlan:
        """``num_steps`` decode steps of ``seq_ids`` for one device loop, as a frozen `StepPlan` (see `schedule`):
        room for ``max_tokens[i]`` more tokens each reserved, all or nothing; the plan carries the first step's
        metadata (`StepPlan.next_metadata` derives the next ones on the device) and the pending device work.

        Args:
          seq_ids: ``n`` claimed sequence ids, each once, none in an open plan.
          num_steps: decode steps of the loop, ``1 .. max_sequences``.
          max_tokens: ``0 .. num_steps`` tokens each may write: one int for all, or ``n`` ints; None: ``num_steps``.
          pad_seqs_to: sequence rows of the metadata, >= ``n`` (None: ``n``)."""
        return step_plan.schedule_decode(self._seqs, self._groups, self._tiers, self._copies, seq_ids, num_steps,
                                         max_tokens, pad_seqs_to=pad_seqs_to, metadata=self.metadata)

    def commit(self, plan: StepPlan, token_ids: Any = None, num_tokens: Any = None) -> None:
        """End ``plan`` with what its step wrote: lengths advance, pages that became full enter the prefix cache,
        pages the plan reserved and nobody wrote go back, pages that left a window are released. Refused, nothing
        changed (the plan stays open): another manager's plan, one that ended already, more tokens than planned,
        tokens into a page whose copy is still pending.

        Args:
          plan: an open `StepPlan` of this manager.
          token_ids: a mixed step's: ``n`` lists of ids (each at most what was planned for it), ``(n,)`` ids (one
            each) or ``(n, k)``; None: every planned token, ids unknown (their pages are not prefix-cached). A
            decode plan's: ``(n, num_steps)`` or ``(padded_rows, num_steps)`` ints, numpy or jax.
          num_tokens: a decode plan's count of tokens each sequence wrote: one int for all, or ``n`` or
            ``padded_rows`` ints, each at most ``plan.limits``; None: every planned token."""
        step_plan.commit(self._seqs, self._groups, self._tiers, plan, token_ids, num_tokens,
                         caching=self.enable_prefix_caching, current=self._versions.current)

    def abort(self, plan: StepPlan) -> None:
        """End ``plan`` with nothing committed: its sequences are as they were before it, the pages it reserved go
        back (a private copy made for a first write stays). The plan's device work is taken as applied (the runner
        applies it first). Refused, nothing changed, for another manager's plan or one that ended already.

        Args:
          plan: an open `StepPlan` of this manager."""
        step_plan.abort(self._seqs, self._groups, plan, current=self._versions.current)

    def check_plan(self, plan: StepPlan, what: str = "commit") -> None:
        """Raise what `commit` would for ``plan`` before anything: TypeError for another object, ValueError for
        another manager's plan or one that ended, InvariantError when a planned sequence changed (a bug); nothing
        changes. The runner checks a plan with it before running the plan's work.

        Args:
          plan: the plan to check.
          what: the call the messages name."""
        step_plan.check_open(self._seqs, self._groups, plan, what)

    @property
    def has_pending_work(self) -> bool:
        """Whether `take_work` would hand anything over now: copy-on-write copies, scrubs of released pages
        (device and host) or host-tier transfers that no plan took yet."""
        return has_pending(self._groups, self._tiers)

    def take_work(self) -> DeviceWork:
        """Every piece of device work pending now (copies, scrubs, host-tier transfers) as one `DeviceWork`, handed
        over and forgotten: for work no plan took (a swap-out to apply before a preemption, an import), applied by
        `easykv.Runner.apply_pending`. A plan takes the work pending when it is made (`StepPlan.work`)."""
        return take_work(self._groups, self._tiers)

    def increment_cache_lengths(self, metadata: StepMetadata) -> StepMetadata:
        """The next decode step's metadata from this one (numpy or jax, jit-friendly), a per-group tuple; the
        manager's lengths do not change.

        Args:
          metadata: a decode step's per-group tuple (a decode plan's ``metadata``), or one bare metadata for one
            group."""
        return increment_groups(metadata, page_size=self.page_size,
                                num_pages=tuple(table.pool.num_pages for table in self._groups))

    # ---- committing written tokens [MAX: step] -----------------------------------------------------
    def step(self, seq_ids: Sequence[int], token_ids: Any) -> None:
        """Commit tokens the device has written: lengths advance and pages that became full enter the prefix cache.

        Args:
          seq_ids: ``n`` claimed sequence ids, each once.
          token_ids: ``(n,)`` ids (decode), ``(n, k)`` ids (``k`` each), or ``n`` lists of ids (prefill)."""
        rows = self._seqs.rows(seq_ids)
        counts, tokens = parse_tokens(token_ids, rows.size)
        commit_tokens(self._seqs, self._groups, self._tiers, rows, counts, tokens, caching=self.enable_prefix_caching,
                      current=self._versions.current)

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` committed tokens of ``seq_id`` and drop the rest, with the pages reserved ahead
        (see `rollback`). ValueError, with nothing changed, for a length past the committed one, or one whose tokens
        the sequence no longer holds (before its sliding or chunked window's first kept page, or before a resumed
        sequence's first).

        Args:
          seq_id: a claimed sequence id, not swapped out.
          length: committed tokens to keep, ``0 .. length(seq_id)``."""
        row = self._seqs.row(seq_id)
        self._tiers.refuse_held(row, "truncate")
        rollback.truncate(self._seqs, self._groups, self._copies, row, length, caching=self.enable_prefix_caching,
                          current=self._versions.current)

    # ---- weight versions (see `versions`) ------------------------------------------------------------
    @property
    def weight_version(self) -> WeightVersion:
        """The current weight version as it was set (None: never set)."""
        return self._versions.weight_version

    def set_weight_version(self, version: WeightVersion) -> None:
        """Make ``version`` (hashed alike on every host) the weights new sequences run with. From now on prefix
        lookups find only pages written under ``version``; running sequences finish under theirs, and cached pages
        of other versions are evicted first. Sequences claimed but not yet started take ``version``. Setting the
        current version again changes nothing. Open plans over running sequences do not block it (those
        finish under their version); ValueError, nothing changed, while one holds a sequence not started yet
        (commit or abort that plan first).

        Args:
          version: the weights' version: an int of up to 64 bits, a str or bytes."""
        versions = self._versions
        if versions.set(version):
            self._seqs.restart_unstarted(versions.current, versions.root())
            self._groups.demote(versions.current)
            self._tiers.demote(versions.current)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix now, also with sequences running (they keep their pages; pages they fill from
        now on are cached again as usual). Cached pages become free (scrubbed first when the manager scrubs).
        Returns how many pages the prefix cache held, over every layer group (the host tier's included)."""
        held = self._groups.forget_prefixes()  # the device's first: a tier drops its transfers into pages freed
        return held + self._tiers.forget_prefixes()

    # ---- inspection -------------------------------------------------------------------------------
    def length(self, seq_id: int) -> int:
        """Committed tokens of a sequence [MAX: cache_length].

        Args:
          seq_id: a claimed sequence id."""
        return int(self._seqs.lens[self._seqs.row(seq_id)])

    cache_length = length

    def pages(self, seq_id: int, *, group: int | None = None) -> list[int]:
        """The block-table row up to the last page held; in a sliding or chunked group the pages released from the
        window are ``PAD_PAGE`` (-1).

        Args:
          seq_id: a claimed sequence id.
          group: the layer group (None: the only one; needed when there are several)."""
        g = self._groups.group_index(group)
        row = self._seqs.row(seq_id)
        return self._groups[g].row_pages(row, int(self._seqs.npages[row]))

    def sequence(self, seq_id: int) -> SequenceInfo:
        """A snapshot of ``seq_id``: its length, capacity, replica, whether it is swapped out or planned, and
        where its kept positions start in each layer group (`SequenceInfo`).

        Args:
          seq_id: a claimed sequence id."""
        seqs = self._seqs
        row = seqs.row(seq_id)
        length, floor, replica = int(seqs.lens[row]), int(seqs.floor[row]), int(seqs.replica[row])
        return SequenceInfo(seq_id=row, length=length, capacity=int(seqs.npages[row]) * self.page_size,
                            replica=replica if replica >= 0 else None, swapped=self._tiers.holds(row),
                            planned=bool(seqs.plan_of[row]),
                            first_kept=tuple(table.first_kept_position(length, floor) for table in self._groups))

    def page_table(self, seq_ids: Sequence[int], *, group: int | None = None) -> np.ndarray:
        """Rows of layer group ``group``'s block table, a ``(n, pages_per_sequence)`` int32 copy (``PAD_PAGE`` past
        each sequence's pages).

        Args:
          seq_ids: ``n`` claimed sequence ids, each once.
          group: the layer group (None: the only one; needed when there are several)."""
        g = self._groups.group_index(group)
        return self._groups[g].table[self._seqs.rows(seq_ids)]

    @property
    def metrics(self) -> PageManagerMetrics:
        """A snapshot of the pools, sequences, prefix cache and counters (`PageManagerMetrics`)."""
        return snapshot(self._parts())

    @property
    def usage(self) -> float:
        """Fraction of the pages (of every group) referenced by running sequences."""
        pools = [table.pool for table in self._groups]
        return sum(pool.num_used() for pool in pools) / sum(pool.num_pages for pool in pools)

    def __repr__(self) -> str:
        m = self.metrics
        return (f"PageManager({m.active_sequences}/{self.batch_size} sequences, pages used={m.used_pages} "
                f"cached={m.cached_pages} free={m.free_pages}, prefix caching "
                f"{'on' if self.enable_prefix_caching else 'off'})")

    # ---- sizing [MAX: estimated_memory_size, infer_optimal_batch_size] ----------------------------------
    estimated_memory_size = staticmethod(sizing.estimated_memory_size)
    infer_optimal_batch_size = staticmethod(sizing.infer_optimal_batch_size)

    # ---- the host-memory tier (see `host_tier`) -------------------------------------------------------
    @property
    def has_host_tier(self) -> bool:
        """Whether this manager keeps evicted prefixes and swapped sequences in host memory."""
        return self._host is not None

    @property
    def tier_names(self) -> tuple[str, ...]:
        """The tiers below the device pool, nearest first, by name (``"host"``: the host-memory tier): each hands
        over its transfers with the device work, which the runner must know how to apply."""
        return tuple(tier.name for tier in self._tiers)

    def forget_host_tier(self) -> int:
        """Empty the host tier's prefix cache and detach its `HostTier` (the cache moved to another placement, whose
        new tier holds nothing yet); returns the cached pages forgotten. With ``scrub_released`` the host pages it
        leaves become pending host scrubs, for the detached tier (`easykv.Runner.forget_host_tier` zeroes them
        there); that tier stays bound to this manager (no other manager takes it). ValueError while sequences are
        swapped out or transfers are pending."""
        return require_host(self._host, "forget_host_tier").forget()

    def attach_host_tier(self, token: object, owner: object | None) -> object:
        """Let the `HostTier` whose token is ``token`` (bound to ``owner``) hold this manager's host pages from now
        on; returns the key to bind it to (`HostTier.bind`). The runner calls it with the tier's ``token`` and
        ``owner``: the manager never sees the tier. ValueError, nothing changed: no host tier here, a tier bound to
        another manager (a `clone`'s original included), or another tier than the one holding this manager's host
        pages (`forget_host_tier` first).

        Args:
          token: the tier's identity, ``HostTier.token``.
          owner: the key the tier is bound to, ``HostTier.owner`` (None: unbound)."""
        return require_host(self._host, "attach_host_tier").attach(token, owner)

    @property
    def swapped_ids(self) -> list[int]:
        """The swapped-out sequence ids, ascending."""
        return sorted(self._host.swapped) if self._host is not None else []

    def swap_out(self, seq_id: int) -> None:
        """Preempt ``seq_id``: its written pages go to host pages it owns there (pending offloads, applied by
        the runner before the device pages are written again), its device pages and pages reserved ahead are
        released, its id stays claimed. Until `swap_in`, nothing may reserve, write, fork or
        truncate it. CacheFullError when the host tier lacks pages for it; ValueError when device work into its
        pages is still pending; nothing changes then.

        Args:
          seq_id: a claimed sequence id, not swapped out, with no open plan."""
        host = require_host(self._host, "swap_out")
        row = self._seqs.row(seq_id)
        host.refuse_held(row, "swap_out")
        host.swap_out(row, self._seqs, self._groups, stale=self._is_stale(row))

    def swap_in(self, seq_id: int) -> None:
        """Give the swapped-out ``seq_id`` device pages again in its replica: a page whose digest the device's
        prefix cache holds is shared, every other one gets a fresh page and a pending onload
        (the next plan's work, or `easykv.Runner.apply_pending`). CacheFullError when the device pool lacks
        pages (nothing changes; it stays swapped out); ValueError when it is not swapped out or its swap-out was not
        applied yet.

        Args:
          seq_id: a swapped-out sequence id."""
        row = self._seqs.row(seq_id)
        require_host(self._host, "swap_in").swap_in(row, self._seqs, self._groups)

    # ---- invariants and persistence --------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise InvariantError (a bug in easykv) unless the bookkeeping is consistent: free + cached + used =
        total, ref counts = owners, no page owned twice except by sharing, the prefix map matches the pages and the
        sequences' chain digests, every sequence's row matches its lengths, no page a sequence's next query reads
        was released, and pending copies and scrubs touch only pages nobody else reads. A loaded state is held to
        the same rules (`from_state_dict`)."""
        try:
            check_consistency(self._parts())
        except Broken as err:
            raise InvariantError(f"{err.message} (state field {err.field})") from None
        except InvariantError as err:  # the pool's own check
            raise InvariantError(f"{err.detail} (state field pool)") from None

    def state_dict(self, *, host_tier: bool = False) -> dict[str, Any]:
        """Everything needed to rebuild this manager exactly, as JSON-safe lists and numbers.
        Canonical: the same calls give the same state, restored on the way or not.

        Args:
          host_tier: add the host tier's bookkeeping (swapped-out sequences, pending transfers, the host pools):
            what `easykv.multihost.assert_lockstep` compares between processes (`from_state_dict` reads neither)."""
        return write_state(self._parts(), tiers=boolean("host_tier", host_tier))

    def clone(self, metadata: PagedAttentionCacheMetaData | None = None) -> PageManager:
        """An independent copy of this manager (to try calls on without changing it), its tiers below the device
        copied too. The `HostTier` the original attached stays bound to the original: the clone cannot attach it
        (`attach_host_tier`). The original's open plans stay the original's: the clone holds their pages as reserved
        room.

        Args:
          metadata: None (default): the same layout. Else the target `PagedAttentionCacheMetaData` of the same pool
            laid out anew: the pool split into ``metadata.page_shards`` data-parallel slices (restoring a checkpoint
            onto another mesh); ValueError when a sequence's pages would straddle two slices (or lie in different
            slices in two layer groups)."""
        if metadata is not None:
            if not isinstance(metadata, PagedAttentionCacheMetaData):
                raise ValueError(f"metadata must be a PagedAttentionCacheMetaData, got {type(metadata).__name__}")
            state = reshard_state(self.state_dict(), int(metadata.page_shards))
            return PageManager._restored(metadata, state, self._tier_factories)  # its tiers made anew, empty
        twin: PageManager = copy.deepcopy(self)
        twin._seqs.close_all_plans()
        return twin

    @classmethod
    def from_state_dict(cls, metadata: PagedAttentionCacheMetaData, state: dict[str, Any]) -> PageManager:
        """A manager equal to the one that wrote ``state``, checked against ``metadata``.

        The state is input: every field's type and range, and every cross-reference (pages owned, reference
        counts, the prefix map, pending copies and scrubs) is checked before the manager is returned;
        `ManagerStateError` (a ValueError) names the field.


        Args:
          metadata: the pool's `PagedAttentionCacheMetaData`.
          state: a `state_dict` (as written, or read back from JSON)."""
        return cls._restored(metadata, state, ())

    @classmethod
    def _restored(cls, metadata: PagedAttentionCacheMetaData, state: dict[str, Any],
                  tiers: Sequence[TierFactory]) -> PageManager:
        """`from_state_dict` with ``tiers`` (`PageManager`'s argument) below the device, empty: a state has none."""
        m = cls(metadata, tiers=tiers)
        m._load_state(state)
        try:
            check_consistency(m._parts())
        except Broken as err:
            raise ManagerStateError(err.message, field=err.field) from None
        except InvariantError as err:  # the pool's own check
            raise ManagerStateError(err.detail, field="pool") from None
        return m

    def _load_state(self, state: dict[str, Any]) -> None:
        """Fill this fresh manager's parts and flags from ``state`` (`read_state`: each field's type and range)."""
        self.enable_prefix_caching, self.scrub_released = read_state(self._parts(), state)
        self._tiers.set_scrub_released(self.scrub_released)


__all__ = [
    "CacheFullError", "GroupPoolMetrics", "InvariantError", "PageManager", "PageManagerMetrics", "UnknownSequenceError",
    "VersionMetrics",
    "increment_cache_lengths", "single_group", "stack_metadata",
]
