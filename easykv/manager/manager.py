"""PageManager: the host-side brain of the paged cache (which pages each sequence owns).

Continuous batching over a paged pool needs one authority that admits sequences, hands out
pages at page boundaries, shares pages between sequences with a common prefix (prefix caching)
or a common history (fork, copy-on-write), and emits each step's `PagedAttentionMetadata`.

Pure numpy/Python and deterministic: the same calls give the same page ids on every host
(lowest free page first, LRU in release order, no dict-iteration or hash-randomization
dependence), which multi-host lock-step relies on. The block table is one preallocated int32
array, so a step's metadata is built by slicing it, not by looping over pages.

`PageManager` is a facade, the way vLLM's kv-cache manager sits on a coordinator over one manager
per attention kind: it checks the caller's input and hands each call to the parts that own the state
(``_seqs``: `SequenceTable`; ``_groups``: `GroupCoordinator` over one allocator per layer group, its
class chosen by the group's attention kind; ``_versions``: `VersionLog`; ``_host``:
`HostTierPolicy`; ``_work``: `PendingWork`; the package doc lists what each owns), or to coordinator
code handed the parts it changes (growth, commit, rollback, admit, decode_plan). state.py and
consistency.py read and check the parts (`ManagerParts`). None of them imports this module; it
never imports ``storage``, ``attention``, ``checkpoint`` or ``tiers``.

Life of a sequence (Modular MAX names in brackets)::

    [seq] = manager.claim(1)                              # [claim]
    done = manager.match_prefix(seq, prompt, salt=user)   # prompt[:done] is already cached
    meta = manager.build_step_metadata([seq], [len(prompt) - done])   # [fetch]
    cache = cache.copy_pages(*manager.take_copies())      # before the step's writes
    ... jitted step writes K/V by meta.slot_mapping and attends ...
    manager.step([seq], [prompt[done:]])                  # [step]: commit tokens, fill prefix cache
    plan = manager.plan_decode(ids, num_steps=k)          # k decode steps in one device loop
    manager.commit_decode(plan, written, num_tokens)      # early stops give back their pages
    manager.release(seq)                                  # [release]

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
from easykv.manager import admit, decode_plan, growth, rollback
from easykv.manager.allocators import allocator_for
from easykv.manager.broken import Broken
from easykv.manager.commit import commit_tokens, parse_tokens
from easykv.manager.consistency import check_consistency
from easykv.manager.coordinator import GroupCoordinator, PerGroup, single_group  # the last: re-exported
from easykv.manager.decode_plan import DecodePlan
from easykv.manager.device_work import PendingWork
from easykv.manager.host_tier import HostTierPolicy, Transfers
from easykv.manager.metrics import GroupPoolMetrics, PageManagerMetrics, snapshot
from easykv.manager.open_plans import freeze_planned
from easykv.manager.parts import ManagerParts
from easykv.manager.prefix_hash import as_token_ids
from easykv.manager.reshard import reshard_state
from easykv.manager.sequences import SequenceTable
from easykv.manager.state import read_state, write_state
from easykv.manager.versions import VersionLog, VersionMetrics, WeightVersion
from easykv.spec import sizing
from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.step.checks import check_padding
from easykv.step.loop import increment_groups
from easykv.step.metadata import (  # the last two: re-exported
    PagedAttentionMetadata,
    increment_cache_lengths,
    stack_metadata,
)
from easykv.validation import boolean, non_negative_int, positive_int

_MAX_TABLE_ENTRIES = 1 << 28  # a 1 GiB int32 block table: beyond any real batch x length
StepMetadata: TypeAlias = PerGroup[PagedAttentionMetadata]


@freeze_planned  # an open decode plan's sequences change only through its commit (`open_plans` declares each member)
class PageManager:
    """Sequences, their pages and the prefix cache of one paged pool (see the module doc).

    Sequence ids are the rows of the block table, ``0 .. metadata.batch_size - 1``. While a decode plan is open
    (`plan_decode` until its `commit_decode`), every call that would change one of its sequences is refused with
    nothing changed; what each public member changes is declared once, in `open_plans`.

    Args:
      metadata: the pool's `PagedAttentionCacheMetaData` (sequences, pages, layer groups).
      enable_prefix_caching: keep full pages findable by content (chained sha256 with salt).
      scrub_released: report pages that leave every owner for zeroing (`take_scrubs`), so no
        tenant's K/V outlives its sequence (evicted cached pages and host pages likewise).
      host_tier: keep evicted prefix pages and swapped-out sequences in the metadata's host-memory
        tier (`host_tier.py`); None (the default) uses it when the metadata has one.
    """

    def __init__(self, metadata: PagedAttentionCacheMetaData, *, enable_prefix_caching: bool = True,
                 scrub_released: bool = False, host_tier: bool | None = None):
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
                          scrub_released=scrub_released, host_pages=metadata.group_host_pages(g) if host_tier else 0)
            for i, g in enumerate(groups))
        self._versions = VersionLog()
        self._host = HostTierPolicy(enabled=self._groups.has_host)
        self._work = PendingWork()

    def _parts(self) -> ManagerParts:
        return ManagerParts(metadata=self.metadata, seqs=self._seqs, groups=self._groups, versions=self._versions,
                            host=self._host, work=self._work, caching=self.enable_prefix_caching,
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
          seq_id: a claimed sequence id, with no open decode plan."""
        row = self._seqs.row(seq_id)
        if row in self._host.swapped:
            self._host.release_swapped(row, self._groups)
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
        return admit.match_prefix(self._seqs, self._groups, self._versions, self._host, row, as_token_ids(token_ids),
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
        reserved, written and committed as usual (`build_step_metadata`, then `advance`; they are not entered in the
        prefix cache, whose keys need every token from the first). Write up to a length whose window starts at or
        after ``first_position`` before attention reads the sequence. ValueError when a layer group attends fully
        (its queries read every position), or for a sequence that already holds tokens or pages.

        Args:
          seq_id: a freshly claimed sequence id.
          first_position: its first position this cache will hold, ``0 .. max_sequences - 1``."""
        admit.resume(self._seqs, self._groups, self._host, self._seqs.row(seq_id), first_position)

    # ---- growth [MAX: fetch, increment_cache_lengths] ------------------------------------------------
    def reserve(self, seq_ids: int | Sequence[int], num_tokens: int | Sequence[int]) -> None:
        """Make room for ``num_tokens`` more tokens of each sequence: new pages at page boundaries, and a private
        copy of a shared, partly filled last page (copy-on-write; see `take_copies`). All or nothing: on
        CacheFullError no sequence got anything.

        Args:
          seq_ids: one claimed sequence id, or ``n`` of them, each once.
          num_tokens: tokens to make room for: one int for all, or ``n`` ints >= 0."""
        seqs = self._seqs
        rows = seqs.one_or_more_rows(seq_ids)
        growth.reserve(seqs, self._groups, self._host, self._work, rows, seqs.counts(num_tokens, rows.size))

    def fork(self, seq_id: int, n: int | None = None) -> int | list[int]:
        """A new sequence with the same history (parallel sampling, beam search), or ``n`` of them, all or none
        (GRPO-style samples of one prompt). Written pages are shared; whichever sequence next writes into a shared
        partly filled page gets a private copy. Pages reserved ahead but not written stay with ``seq_id``.

        Args:
          seq_id: the claimed sequence to copy, not swapped out.
          n: ``1 .. batch_size`` children, returned as a list; None (default): one, returned as an int."""
        row = self._seqs.row(seq_id)
        self._host.refuse_swapped(row, "fork")
        hint = f"children of one sequence, at most batch_size={self.batch_size}"
        count = 1 if n is None else positive_int("n", n, hi=self.batch_size, hint=hint)
        children = growth.fork(self._seqs, self._groups, row, count,
                               what=f"fork({row}{'' if n is None else f', n={count}'})")
        return children[0] if n is None else children

    def build_step_metadata(self, seq_ids: Sequence[int], num_new_tokens: int | Sequence[int], *,
                            pad_tokens_to: int | None = None, pad_seqs_to: int | None = None) -> StepMetadata:
        """Reserve pages and build the mixed-form metadata of one step in which sequence ``seq_ids[b]`` appends
        ``num_new_tokens[b]`` tokens (a prefill chunk, a decode, or 0). Lengths advance only when the tokens are
        committed (`step`), after the device wrote them.

        A tuple of one `PagedAttentionMetadata` per layer group, one for a cache of one group (each its own page
        table and slots; the cache's ``write`` takes the tuple, a layer's attention its group's item;
        `single_group` unpacks the one item of a one-group cache).

        Args:
          seq_ids: ``n`` claimed sequence ids, each once (row ``b`` of the metadata).
          num_new_tokens: tokens each appends: one int for all, or ``n`` ints >= 0.
          pad_tokens_to: token rows of the metadata, >= the step's new tokens (None: exactly those).
          pad_seqs_to: sequence rows of the metadata, >= ``n`` (None: ``n``); fixed shapes, few jit traces."""
        seqs, groups = self._seqs, self._groups
        rows = seqs.rows(seq_ids)
        new = seqs.counts(num_new_tokens, rows.size)
        pad_tokens_to, pad_seqs_to = check_padding(self.metadata, int(new.sum()), rows.size, pad_tokens_to, pad_seqs_to)
        growth.reserve(seqs, groups, self._host, self._work, rows, new)
        return growth.step_metadata(seqs, groups, rows, new, pad_tokens_to=pad_tokens_to, pad_seqs_to=pad_seqs_to)

    def build_decode_metadata(self, seq_ids: Sequence[int], num_steps: int = 1, *, pad_seqs_to: int | None = None,
                              stacked: bool = False) -> StepMetadata | list[StepMetadata]:
        """Metadata of ``num_steps`` decode steps ahead (pages reserved for all; step ``j`` writes position
        ``length + j``): a list of per-group tuples, or with ``stacked=True`` one tuple whose fields carry a leading
        step axis (for `lax.scan`). Commit with `step` (``(n, num_steps)`` ids). `plan_decode` is the form with
        early stops and a guarded commit.

        Args:
          seq_ids: ``n`` claimed sequence ids, each once.
          num_steps: decode steps to reserve and describe, >= 1 (default 1).
          pad_seqs_to: sequence rows of each metadata, >= ``n`` (None: ``n``).
          stacked: one tuple with a leading ``num_steps`` axis instead of a list of tuples."""
        seqs, groups = self._seqs, self._groups
        rows = seqs.rows(seq_ids)
        k = positive_int("num_steps", num_steps)
        _, pad_seqs_to = check_padding(self.metadata, rows.size, rows.size, None, pad_seqs_to)
        growth.reserve(seqs, groups, self._host, self._work, rows, np.full(rows.size, k, np.int64))
        return growth.decode_metadata(seqs, groups, rows, k, pad_seqs_to=pad_seqs_to, stacked=stacked)

    def plan_decode(self, seq_ids: Sequence[int], num_steps: int, *, max_tokens: int | Sequence[int] | None = None,
                    pad_seqs_to: int | None = None) -> DecodePlan:
        """``num_steps`` decode steps of ``seq_ids`` for one device loop: room for ``max_tokens[i]`` more tokens
        each reserved, all or nothing (CacheFullError, nothing changed); the `DecodePlan` carries the first step's
        metadata. Commit it once with `commit_decode`; until then every call that would change one of its sequences
        (release, match_prefix, resume, set_weight_version over one not started yet, ...) is refused, ValueError
        with nothing changed; other sequences carry on.

        Args:
          seq_ids: ``n`` claimed sequence ids, each once, none in an open plan.
          num_steps: decode steps of the loop, ``1 .. max_sequences``.
          max_tokens: ``0 .. num_steps`` tokens each may write: one int for all, or ``n`` ints; None: ``num_steps``.
          pad_seqs_to: sequence rows of the metadata, >= ``n`` (None: ``n``)."""
        return decode_plan.plan(self._seqs, self._groups, self._host, self._work, seq_ids, num_steps, max_tokens,
                                pad_seqs_to=pad_seqs_to, metadata=self.metadata)

    def commit_decode(self, plan: DecodePlan, token_ids: Any, num_tokens: Any = None) -> None:
        """Commit what ``plan``'s loop wrote: of ``token_ids[i]`` the first ``num_tokens[i]`` count. Pages the plan
        reserved and nobody wrote go back; pages that left a window are released; the plan ends. Refused, nothing
        changed: another manager's plan, one committed already, too many tokens, tokens into a page whose copy is
        still pending. Committing no tokens (``num_tokens=0``) aborts an open plan and always succeeds.

        Args:
          plan: the open `DecodePlan` this manager's `plan_decode` returned.
          token_ids: ``(n, num_steps)`` or ``(padded_rows, num_steps)`` ints, numpy or jax.
          num_tokens: one int for all, or ``n`` or ``padded_rows`` ints, each at most ``plan.limits``; None: every
            planned token."""
        decode_plan.commit(self._seqs, self._groups, self._host, self._work, plan, token_ids, num_tokens,
                           caching=self.enable_prefix_caching, current=self._versions.current)

    def increment_cache_lengths(self, metadata: StepMetadata) -> StepMetadata:
        """The next decode step's metadata from this one (numpy or jax, jit-friendly), a per-group tuple; the
        manager's lengths do not change.

        Args:
          metadata: a decode step's per-group tuple (`build_decode_metadata`'s), or one bare metadata for one group."""
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
        commit_tokens(self._seqs, self._groups, self._host, rows, counts, tokens, caching=self.enable_prefix_caching,
                      current=self._versions.current)

    def append_tokens(self, seq_id: int, token_ids: Sequence[int] | np.ndarray) -> None:
        """`step` for one sequence: commit ``token_ids`` written at its next positions.

        Args:
          seq_id: a claimed sequence id.
          token_ids: the written ids, ``(k,)`` ints."""
        self.step([self._seqs.row(seq_id)], [token_ids])  # the id read as the open-plan guard reads it

    def advance(self, seq_ids: int | Sequence[int], num_tokens: int | Sequence[int]) -> None:
        """Commit written tokens without their ids. Pages filled from here on are not entered in the prefix cache
        (their content is unknown); use `step` to keep caching them.

        Args:
          seq_ids: one claimed sequence id, or ``n`` of them, each once.
          num_tokens: tokens written: one int for all, or ``n`` ints >= 0."""
        seqs = self._seqs
        rows = seqs.one_or_more_rows(seq_ids)
        commit_tokens(seqs, self._groups, self._host, rows, seqs.counts(num_tokens, rows.size), None,
                      caching=self.enable_prefix_caching, current=self._versions.current)

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` committed tokens of ``seq_id`` and drop the rest, with the pages reserved ahead
        (see `rollback`). ValueError, with nothing changed, for a length past the committed one, or one whose tokens
        the sequence no longer holds (before its sliding or chunked window's first kept page, or before a resumed
        sequence's first).

        Args:
          seq_id: a claimed sequence id, not swapped out.
          length: committed tokens to keep, ``0 .. length(seq_id)``."""
        row = self._seqs.row(seq_id)
        self._host.refuse_swapped(row, "truncate")
        rollback.truncate(self._seqs, self._groups, self._work, row, length, caching=self.enable_prefix_caching,
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
        current version again changes nothing. Open decode plans over running sequences do not block it (those
        finish under their version); ValueError, nothing changed, while one holds a sequence not started yet
        (commit or abort that plan first).

        Args:
          version: the weights' version: an int of up to 64 bits, a str or bytes."""
        versions = self._versions
        if versions.set(version):
            self._seqs.restart_unstarted(versions.current, versions.root())
            self._groups.demote(versions.current)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix now, also with sequences running (they keep their pages; pages they fill from
        now on are cached again as usual). Cached pages become free (scrubbed first when the manager scrubs).
        Returns how many pages the prefix cache held, over every layer group (the host tier's included)."""
        return self._groups.forget_prefixes()

    # ---- inspection -------------------------------------------------------------------------------
    def length(self, seq_id: int) -> int:
        """Committed tokens of a sequence [MAX: cache_length].

        Args:
          seq_id: a claimed sequence id."""
        return int(self._seqs.lens[self._seqs.row(seq_id)])

    cache_length = length

    def capacity(self, seq_id: int) -> int:
        """Tokens the sequence's pages can hold (committed plus reserved ahead).

        Args:
          seq_id: a claimed sequence id."""
        return int(self._seqs.npages[self._seqs.row(seq_id)]) * self.page_size

    def pages(self, seq_id: int, *, group: int | None = None) -> list[int]:
        """The block-table row up to the last page held; in a sliding or chunked group the pages released from the
        window are ``PAD_PAGE`` (-1).

        Args:
          seq_id: a claimed sequence id.
          group: the layer group (None: the only one; needed when there are several)."""
        g = self._groups.group_index(group)
        row = self._seqs.row(seq_id)
        return self._groups[g].row_pages(row, int(self._seqs.npages[row]))

    def first_kept_position(self, seq_id: int, *, group: int | None = None) -> int:
        """The first position whose K/V the sequence holds in layer group ``group`` and its next query may read: 0
        in a full-attention group; in a sliding or chunked one, where its window starts (or a resumed sequence's
        first position, while a window still reaches before it).

        Args:
          seq_id: a claimed sequence id.
          group: the layer group (None: the only one; needed when there are several)."""
        table = self._groups[self._groups.group_index(group)]
        row = self._seqs.row(seq_id)
        return table.first_kept_position(int(self._seqs.lens[row]), int(self._seqs.floor[row]))

    def replica(self, seq_id: int) -> int | None:
        """The data-parallel replica whose slice of the pool holds the sequence (None: unbound).

        Args:
          seq_id: a claimed sequence id."""
        r = int(self._seqs.replica[self._seqs.row(seq_id)])
        return r if r >= 0 else None

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
        return self._host.enabled

    def forget_host_tier(self) -> int:
        """Empty the host tier's prefix cache and detach its `HostTier` (the cache moved to another placement, whose
        new tier holds nothing yet); returns the cached pages forgotten. With ``scrub_released`` the pages it leaves
        (forgotten ones, released ones not zeroed yet) are zeroed in the detached tier now; that tier stays bound to
        this manager (no other manager takes it). ValueError while sequences are swapped out or transfers are
        pending."""
        return self._host.forget(self._groups)

    def check_host(self, cache: Any, host: Any) -> None:
        """ValueError unless ``host`` may carry this manager's host-tier work on ``cache``: None while none is
        pending, else the `easykv.HostTier` of ``cache`` that holds this manager's host pages. A tier is bound to
        the first manager whose `apply_pending` takes it, for life: a tier bound to another manager (the original of
        a `clone` included) is refused, and a tier other than the current one is taken only while no host page holds
        data elsewhere (`forget_host_tier` detaches the current one). `apply_pending` and `import_sequence` check
        this before anything changes.

        Args:
          cache: the `PagedAttentionCache` the work is for.
          host: its `HostTier`, or None."""
        self._host.check_host(cache, host, self.metadata, self._groups)

    def is_swapped(self, seq_id: int) -> bool:
        """Whether ``seq_id`` is swapped out (`swap_out`).

        Args:
          seq_id: a claimed sequence id."""
        return self._seqs.row(seq_id) in self._host.swapped

    @property
    def swapped_ids(self) -> list[int]:
        """The swapped-out sequence ids, ascending."""
        return sorted(self._host.swapped)

    def swap_out(self, seq_id: int) -> None:
        """Preempt ``seq_id``: its written pages go to host pages it owns there (pending offloads;
        `apply_pending(cache, host=...)` before the device pages are written again), its device pages and pages
        reserved ahead are released, its id stays claimed. Until `swap_in`, nothing may reserve, write, fork or
        truncate it. CacheFullError when the host tier lacks pages for it; ValueError when device work into its
        pages is still pending; nothing changes then.

        Args:
          seq_id: a claimed sequence id, not swapped out, with no open decode plan."""
        self._host.require("swap_out")
        row = self._seqs.row(seq_id)
        self._host.refuse_swapped(row, "swap_out")
        self._host.swap_out(row, self._seqs, self._groups, stale=self._is_stale(row))

    def swap_in(self, seq_id: int) -> None:
        """Give the swapped-out ``seq_id`` device pages again in its replica: a page whose digest the device's
        prefix cache holds is shared, every other one gets a fresh page and a pending onload
        (`apply_pending(cache, host=...)` before the next step's writes). CacheFullError when the device pool lacks
        pages (nothing changes; it stays swapped out); ValueError when it is not swapped out or its swap-out was not
        applied yet.

        Args:
          seq_id: a swapped-out sequence id."""
        self._host.swap_in(self._seqs.row(seq_id), self._seqs, self._groups)

    def has_pending_transfers(self) -> bool:
        """Whether offloads or onloads wait for `apply_pending(cache, host=...)` (or `take_transfers`): the
        host-tier work that reads or writes device pages, and holds pages a manager state cannot (scrubs of
        released host pages touch neither: see `has_pending_work`)."""
        return self._host.has_pending_transfers(self._groups)

    def pending_transfers(self) -> Transfers:
        """Per layer group, ``(offload_src, offload_dst, onload_src, onload_dst, host_scrubs)``
        int32 page ids: device pages to copy to host pages, host pages to copy to device pages,
        and released host pages to zero (``scrub_released``)."""
        return self._host.pending_transfers(self._groups)

    def take_transfers(self) -> Transfers:
        """`pending_transfers`, then count them as done (offloaded prefix pages enter the host prefix map): for an
        engine that moves the pages itself, first thing before the copies and scrubs (`apply_pending` does all of it
        with a `HostTier`). All reads before any write: offload sources and onload sources are read before any
        destination is written, and host scrubs land before the offloads. Host pages these transfers leave
        unreferenced are the next call's host scrubs (`has_pending_work` says so meanwhile)."""
        self._host.require("take_transfers")
        out = self._host.pending_transfers(self._groups)
        self._host.transfers_done(self._groups)
        return out

    # ---- pending device work (see `device_work`) ---------------------------------------------------
    def pending_copies(self, pad_to: int | None = None) -> tuple[PerGroup[np.ndarray], PerGroup[np.ndarray]]:
        """(src, dst) int32 page ids the cache must copy, in every layer, before the next write (each a tuple of one
        ``(copies,)`` array per layer group). ``cache.copy_pages`` and `apply_pending` pad them to a power of two
        themselves (a few compiled shapes, not one per count); ``pad_to`` is for an engine's own jitted copy.

        Args:
          pad_to: pad each array with -1 to this length, >= its entries (fixed shapes for jit); None: unpadded."""
        return self._work.pending_copies(self._groups, pad_to)

    def has_pending_work(self) -> bool:
        """Whether `apply_pending` has anything to run: copy-on-write copies, scrubs of released
        device pages, or host-tier work (transfers, scrubs of released host pages)."""
        return self._work.has_pending(self._groups, self._host)

    def take_copies(self, pad_to: int | None = None) -> tuple[PerGroup[np.ndarray], PerGroup[np.ndarray]]:
        """`pending_copies`, then forget them: apply with ``cache.copy_pages(src, dst)`` before the step's writes
        (sources are read before destinations are written).

        Args:
          pad_to: as `pending_copies`'s."""
        self._work.refuse_transfers("take_copies", self._groups, self._host)
        out = self._work.pending_copies(self._groups, pad_to)
        self._work.forget_copies(self._groups)
        return out

    def pending_scrubs(self, pad_to: int | None = None) -> PerGroup[np.ndarray]:
        """Released pages to zero (``scrub_released=True``): a tuple of one ``(scrubs,)`` int32 array per group,
        padded by ``cache.zero_pages`` as `pending_copies` says.

        Args:
          pad_to: pad each array with -1 to this length, >= its entries; None: unpadded."""
        return self._work.pending_scrubs(self._groups, pad_to)

    def take_scrubs(self, pad_to: int | None = None) -> PerGroup[np.ndarray]:
        """`pending_scrubs`, then forget them: apply with ``cache.zero_pages(pages)`` after the copies and before
        the step's writes.

        Args:
          pad_to: as `pending_scrubs`'s."""
        self._work.refuse_transfers("take_scrubs", self._groups, self._host)
        out = self._work.pending_scrubs(self._groups, pad_to)
        self._work.forget_scrubs(self._groups)
        return out

    def apply_pending(self, cache: Any, *, host: Any = None) -> tuple[Any, int]:
        """Apply the pending device work to ``cache`` in the required order: host-tier transfers (through ``host``),
        copy-on-write copies, then scrubs of released pages, device and host. Call after building a step's
        metadata, before its writes. Returns the updated cache and the number of pages copied on the device.

        The work runs in one program whose page ids are padded to a power of two (at most the pool's pages), so a
        long-running server compiles at most ``2 + log2(pages)`` shapes of it, whatever counts of pages it copies,
        scrubs or moves (`easykv.storage.page_work`).

        The work is forgotten only once the device has taken it: when ``cache`` is not a live cache of this pool
        (deleted by an earlier donation, another pool), or ``host`` is missing, of another cache or bound to another
        manager (`check_host`), nothing is applied and everything stays pending, so a retry with the right arguments
        still copies and scrubs (a lost copy would leave a fork reading whatever its page held before).

        Args:
          cache: the live `PagedAttentionCache` of this pool; donated.
          host: the cache's `easykv.tiers.HostTier`, needed while host-tier work is pending; else None."""
        self.check_cache(cache, what="apply_pending's cache")  # else nothing is applied: the work stays pending
        self.check_host(cache, host)
        if host is not None:
            return self._work.apply_through(cache, host, self._groups, self._host, self.metadata)
        return self._work.apply(cache, self._groups)

    def check_cache(self, cache: Any, *, what: str = "the cache") -> PagedAttentionCacheMetaData:
        """The metadata of ``cache``, once it is a live cache of this manager's pool (the same pages, page split,
        sequences and layer groups, every buffer alive); ValueError naming the difference otherwise. (Duck-typed:
        the manager does not import the storage layer.)

        Args:
          cache: the cache to check.
          what: how the error message names it (default ``"the cache"``)."""
        return PendingWork.check_cache(cache, self.metadata, what)

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

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild this manager exactly, as JSON-safe lists and numbers.
        Canonical: the same calls give the same state, restored on the way or not."""
        return write_state(self._parts())

    def clone(self) -> PageManager:
        """An independent copy of this manager (to try calls on without changing it); the `HostTier` it last applied
        work through is shared, not copied, and stays bound to this manager: the clone cannot apply work through it
        (`check_host`). The original's open decode plans stay the original's: the clone holds their pages as
        reserved room."""
        tier = self._host.tier
        twin: PageManager = copy.deepcopy(self, {id(tier): tier} if tier is not None else {})
        twin._seqs.close_all_plans()
        return twin

    def lockstep_state(self) -> dict[str, Any]:
        """`state_dict` with the host tier's bookkeeping (swapped-out sequences, pending transfers,
        the host pools): what `easykv.multihost.assert_lockstep` compares between processes."""
        return write_state(self._parts(), host=True)

    @classmethod
    def from_state_dict(cls, metadata: PagedAttentionCacheMetaData, state: dict[str, Any]) -> PageManager:
        """A manager equal to the one that wrote ``state``, checked against ``metadata``.

        The state is input: every field's type and range, and every cross-reference (pages owned, reference
        counts, the prefix map, pending copies and scrubs) is checked before the manager is returned;
        `ManagerStateError` (a ValueError) names the field.


        Args:
          metadata: the pool's `PagedAttentionCacheMetaData`.
          state: a `state_dict` (as written, or read back from JSON)."""
        m = cls(metadata)
        m.enable_prefix_caching, m.scrub_released = read_state(m._parts(), state)
        try:
            check_consistency(m._parts())
        except Broken as err:
            raise ManagerStateError(err.message, field=err.field) from None
        except InvariantError as err:  # the pool's own check
            raise ManagerStateError(err.detail, field="pool") from None
        return m

    def reshard(self, metadata: PagedAttentionCacheMetaData) -> PageManager:
        """A copy of this manager for ``metadata``: the same pool split into ``metadata.page_shards`` data-parallel
        slices (restoring a checkpoint onto another mesh). ValueError when a sequence's pages would straddle two
        slices (or lie in different slices in two layer groups).

        Args:
          metadata: the target `PagedAttentionCacheMetaData`: the same pool, laid out anew."""
        if not isinstance(metadata, PagedAttentionCacheMetaData):
            raise ValueError(f"metadata must be a PagedAttentionCacheMetaData, got {type(metadata).__name__}")
        state = reshard_state(self.state_dict(), int(metadata.page_shards))
        return PageManager.from_state_dict(metadata, state)


__all__ = [
    "CacheFullError", "GroupPoolMetrics", "InvariantError", "PageManager", "PageManagerMetrics", "UnknownSequenceError",
    "VersionMetrics",
    "increment_cache_lengths", "single_group", "stack_metadata",
]
