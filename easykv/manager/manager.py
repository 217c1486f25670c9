"""PageManager: the host-side brain of the paged cache (which pages each sequence owns).

Continuous batching over a paged pool needs one authority that admits sequences, hands out
pages at page boundaries, shares pages between sequences with a common prefix (prefix caching)
or a common history (fork, copy-on-write), and emits each step's `PagedAttentionMetadata`.

Pure numpy/Python and deterministic: the same calls give the same page ids on every host
(lowest free page first, LRU in release order, no dict-iteration or hash-randomization
dependence), which multi-host lock-step relies on. The block table is one preallocated int32
array, so a step's metadata is built by slicing it, not by looping over pages. Reserving pages,
copy-on-write, fork and the step metadata are in growth.py, a mixin of `PageManager`.

Life of a sequence (Modular MAX names in brackets)::

    [seq] = manager.claim(1)                              # [claim]
    done = manager.match_prefix(seq, prompt, salt=user)   # prompt[:done] is already cached
    meta = manager.build_step_metadata([seq], [len(prompt) - done])   # [fetch]
    cache = cache.copy_pages(*manager.take_copies())      # before the step's writes
    ... jitted step writes K/V by meta.slot_mapping and attends ...
    manager.step([seq], [prompt[done:]])                  # [step]: commit tokens, fill prefix cache
    ... decode: build_decode_metadata(ids, num_steps=k)   # [increment_cache_lengths]
    manager.release(seq)                                  # [release]

Three tiers of error: `CacheFullError` when the pool or the batch is full (expected; nothing
changed), `ValueError`/`UnknownSequenceError` for bad input (nothing changed), `InvariantError`
when the manager's own bookkeeping is broken (a bug).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from easykv.manager import state as manager_state
from easykv.errors import CacheFullError, InvariantError, ManagerStateError, UnknownSequenceError
from easykv.manager.device_work import _DeviceWork
from easykv.manager.group_table import GroupTable
from easykv.manager.growth import _Growth
from easykv.manager.host_tier import HostTierMetrics, _HostTier
from easykv.manager.rollback import _Rollback
from easykv.manager.versions import VersionMetrics, _Versions
from easykv.manager.windows import _Windows
from easykv.manager.reshard import reshard_state
from easykv.manager.prefix_hash import SequenceHashes, as_token_ids, iter_page_digests, salt_digest
from easykv.spec import sizing
from easykv.step.metadata import PAD_PAGE, increment_cache_lengths, stack_metadata  # the last two: re-exported
from easykv.validation import INT32_MAX, boolean, integer, integer_array, non_negative_int, show


@dataclasses.dataclass(frozen=True)
class GroupPoolMetrics:
    """A snapshot of one layer group's pool (its own page ids)."""

    total_pages: int
    free_pages: int
    cached_pages: int
    used_pages: int
    evictions: int


@dataclasses.dataclass(frozen=True)
class PageManagerMetrics:
    """A snapshot of the pools and the prefix cache (counters are totals since creation).
    Page counts add up every layer group's pool; ``groups`` has each pool on its own."""

    total_pages: int
    free_pages: int
    cached_pages: int  # unreferenced, kept for prefix reuse, evicted when memory is needed
    used_pages: int
    active_sequences: int
    prefix_queries: int
    prefix_hits: int  # queries that reused at least one page
    prefix_query_tokens: int
    prefix_hit_tokens: int  # prompt tokens that needed no prefill
    evictions: int
    copies: int  # copy-on-write page copies reported
    scrubs: int  # released pages reported for zeroing
    groups: tuple[GroupPoolMetrics, ...] = ()
    versions: tuple[VersionMetrics, ...] = ()  # per weight version (`set_weight_version`)
    host: HostTierMetrics | None = None  # the host-memory tier (None without one)

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by running sequences (cached pages count as free)."""
        return self.used_pages / self.total_pages

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


_MAX_TABLE_ENTRIES = 1 << 28  # a 1 GiB int32 block table: beyond any real batch x length


class PageManager(_Growth, _Windows, _Versions, _Rollback, _HostTier, _DeviceWork):
    """Sequences, their pages and the prefix cache of one paged pool (see the module doc).

    Sequence ids are the rows of the block table, ``0 .. metadata.batch_size - 1``.
    ``enable_prefix_caching``: keep full pages findable by content (chained sha256 with salt).
    ``scrub_released``: report pages that leave every owner for zeroing (`take_scrubs`), so no
    tenant's K/V outlives its sequence in device memory (cached pages are scrubbed when evicted;
    host-tier pages likewise in host memory).
    ``host_tier``: keep evicted prefix pages and swapped-out sequences in the metadata's
    host-memory tier (`host_tier.py`); None (the default) uses it when the metadata has one.
    """

    def __init__(self, metadata: Any, *, enable_prefix_caching: bool = True, scrub_released: bool = False,
                 host_tier: bool | None = None):
        from easykv.spec.metadata import PagedAttentionCacheMetaData

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
                f"batch_size={metadata.batch_size} sequences x num_pages_per_sequence={metadata.num_pages_per_sequence} "
                f"x {len(groups)} layer group(s) is a block table of {entries} entries, more than the "
                f"{_MAX_TABLE_ENTRIES} one host manages; lower batch_size or max_sequences")
        self.metadata = metadata
        self.page_size = ps = int(metadata.page_size)
        self.batch_size = b = int(metadata.batch_size)
        self.max_length = int(metadata.max_sequences)
        self.pages_per_sequence = p = int(metadata.num_pages_per_sequence)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.scrub_released = bool(scrub_released)
        # One pool and block table per layer group (groups have their own page ids); what a
        # sequence is (length, columns reserved, replica, hashes) is shared by all groups.
        self._groups = tuple(GroupTable.fresh(g, batch_size=b, pages_per_sequence=p,
                                              page_shards=int(metadata.page_shards), scrub_released=scrub_released,
                                              host_pages=metadata.group_host_pages(g) if host_tier else 0)
                             for g in groups)
        self._num_replicas = int(metadata.page_shards)
        self._lens = np.zeros(b, np.int32)  # tokens written (K/V valid) per sequence
        self._npages = np.zeros(b, np.int32)  # block-table columns held, including pages reserved ahead
        self._floor = np.zeros(b, np.int32)  # a resumed sequence's first position with K/V, until its windows pass it
        self._replica = np.full(b, -1, np.int32)  # -1 until the sequence's first page
        self._active = np.zeros(b, bool)
        self._hashes = SequenceHashes(b, ps)
        self._init_versions()
        self._init_host_tier()
        self._counters = dict.fromkeys(("prefix_queries", "prefix_hits", "prefix_query_tokens", "prefix_hit_tokens", "copies"), 0)

    @property
    def num_groups(self) -> int:
        """Layer groups of the metadata: one pool, one block table and one step metadata each."""
        return len(self._groups)

    def _per_group(self, items: Sequence[Any]) -> Any:
        """The one item of a one-group manager, else a tuple of one per group (the form the
        storage takes: `PagedAttentionCache.write`, `copy_pages`, `zero_pages`)."""
        return items[0] if len(items) == 1 else tuple(items)

    def _group_index(self, group: Any) -> int:
        n = len(self._groups)
        if group is None:
            if n > 1:
                raise ValueError(f"this manager has {n} layer groups, each with its own pages; pass group=0..{n - 1}")
            return 0
        return integer("group", group, lo=0, hi=n - 1, hint=f"a layer group of the {n} in the metadata")

    # ---- sequence slots [MAX: claim, external_claim, contains, release, slots_remaining] -------
    def claim(self, n: int = 1) -> list[int]:
        """Claim ``n`` free sequence ids (lowest first) for new requests."""
        n = non_negative_int("n", n)
        free = np.flatnonzero(~self._active)
        if n > free.size:
            raise CacheFullError(
                f"claim({n}) needs {n} sequence slots but only {free.size} of batch_size={self.batch_size} "
                "are free; release finished sequences first or create the metadata with a larger batch_size",
                resource="sequence slots", needed=n, available=int(free.size))
        ids = free[:n]
        self._active[ids] = True
        for row in ids.tolist():
            self._start_row(row)
        return ids.tolist()

    def external_claim(self, seq_ids: Sequence[int]) -> None:
        """Claim ids chosen by the caller (e.g. a scheduler that owns the numbering)."""
        if isinstance(seq_ids, (int, np.integer)):
            raise ValueError(f"external_claim takes a list of ids, got the int {seq_ids}; pass [{seq_ids}]")
        ids = integer_array("seq_ids", seq_ids, ndim=1, lo=0, hi=self.batch_size - 1,
                            hint=f"sequence ids of batch_size={self.batch_size}").tolist()
        for s in ids:
            if self._active[s]:
                raise ValueError(f"sequence id {s} is already claimed; release it first or claim another id")
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids {ids} repeat an id; claim each id once")
        self._active[ids] = True
        for row in ids:
            self._start_row(row)

    def contains(self, seq_id: int) -> bool:
        sid = self._check_id(seq_id, strict=False)  # the checked value, never the object again
        return sid >= 0 and bool(self._active[sid])

    __contains__ = contains

    @property
    def slots_remaining(self) -> set[int]:
        return set(np.flatnonzero(~self._active).tolist())

    @property
    def active_ids(self) -> list[int]:
        return np.flatnonzero(self._active).tolist()

    def release(self, seq_id: int) -> None:
        """End a sequence: its id becomes free, its pages lose a reference. Full pages stay in
        the prefix cache (tail pages are evicted before head pages); others are freed."""
        row = self._row(seq_id)
        if row in self._swapped:
            self._release_swapped(row)
        n, stale = int(self._npages[row]), self._is_stale(row)
        for gt in self._groups:
            gt.release_pages(gt.held(row, n)[::-1], stale=stale)
        self._reset_row(row)

    def _reset_row(self, row: int) -> None:
        for gt in self._groups:
            gt.reset_row(row)
        self._lens[row] = self._npages[row] = self._floor[row] = 0
        self._replica[row] = -1
        self._active[row] = False
        self._hashes.reset(row)
        self._row_version[row] = None

    # ---- prefix caching ------------------------------------------------------------------------
    def match_prefix(self, seq_id: int, token_ids: Sequence[int] | np.ndarray, *, salt: Any = None) -> int:
        """Attach the longest run of cached full pages that starts ``token_ids`` (with the same
        ``salt``) to a freshly claimed sequence. Returns how many prompt tokens need no prefill
        (a multiple of page_size, at most ``len(token_ids) - 1``: the last prompt token is always
        computed so the model has logits to sample from). The sequence then continues from there:
        commit ``token_ids[returned:]`` after writing them."""
        row = self._row(seq_id)
        tokens = as_token_ids(token_ids)
        self._refuse_swapped(row, "match_prefix")
        if self._lens[row] or self._npages[row]:
            raise ValueError(
                f"sequence {row} already holds {int(self._lens[row])} tokens in {int(self._npages[row])} "
                "pages; call match_prefix right after claim, before reserving or committing tokens")
        self._check_extent(row, tokens.size, "the prompt")
        salt_d = salt_digest(salt)
        self._start_row(row)  # the version current now, whenever it was claimed
        self._hashes.salt[row] = salt_d
        if not self.enable_prefix_caching:
            return 0
        replica, pages, chain = self._lookup(tokens, salt_d, int(self._replica[row]))
        if self.has_host_tier and not self._host_hit_room(replica, pages):  # no device room to bring them back
            replica, pages, chain = self._lookup(tokens, salt_d, int(self._replica[row]), host=False)
        c = self._counters
        c["prefix_queries"] += 1
        c["prefix_query_tokens"] += int(tokens.size)
        k = len(pages[0])
        self._count_lookup(int(tokens.size), k * self.page_size)
        if k:
            starts = [group_pages.count(PAD_PAGE) for group_pages in pages]  # a window needs only its pages
            for gt, group_pages in zip(self._groups, pages):
                gt.pool.share([p for p in group_pages if p >= 0])
            onloaded = self._attach_host_hits(row, replica, pages) if self.has_host_tier else 0
            for gt, group_pages, start in zip(self._groups, pages, starts):
                gt.table[row, :k] = group_pages
                gt.start[row] = start
            self._npages[row] = k
            self._lens[row] = k * self.page_size
            self._replica[row] = replica
            self._hashes.chain[row] = chain
            self._hashes.record(row, tokens[: k * self.page_size])  # the log holds every committed id
            c["prefix_hits"] += 1
            c["prefix_hit_tokens"] += k * self.page_size
            if onloaded:
                self._host_counters["host_hits"] += 1
                self._host_counters["host_hit_tokens"] += onloaded * self.page_size
            self._release_out_of_window(np.array([row]))
        return k * self.page_size

    def cached_prefix_length(self, token_ids: Sequence[int] | np.ndarray, *, salt: Any = None) -> int:
        """How many tokens of ``token_ids`` `match_prefix` would find cached now (no state change),
        on the device or in the host tier (`match_prefix` takes fewer when the device has no room
        to bring the host part back)."""
        tokens = as_token_ids(token_ids)
        if not self.enable_prefix_caching:
            return 0
        return len(self._lookup(tokens, salt_digest(salt), -1)[1][0]) * self.page_size

    def _lookup(self, tokens: np.ndarray, salt: bytes, bound: int, *,
                host: bool = True) -> tuple[int, list[list[int]], bytes]:
        """The best replica, its cached pages for the prompt in every group (``PAD_PAGE``
        where a window does not need one; ``-2 - h`` for page ``h`` of the host tier, unless
        ``host`` is False), and the digest of the last one. A hit of ``k`` pages needs every
        group's pages for it. Best: most pages, then most available pages (in the tightest
        group), then lowest index."""
        replicas = [bound] if bound >= 0 else list(range(self._num_replicas))
        host = host and self.has_host_tier
        if any(gt.windowed for gt in self._groups):
            return self._lookup_window(tokens, salt, replicas, host=host)
        found: dict[int, list[Any]] = {r: [] for r in replicas}  # per replica, per page: its page in each group
        # (hits, the replica's prefix map in each group) per replica, bound once: this loop is the lookup's cost
        searches = [(found[r], [gt.tier_map(r) if host else gt.pool.digest_map(r) for gt in self._groups])
                    for r in replicas]
        chain = root = self._root()
        for k, digest in enumerate(iter_page_digests(tokens, self.page_size, (tokens.size - 1) // self.page_size, salt,
                                                     root)):
            alive = False
            for hits, maps in searches:
                if len(hits) == k:  # one group (the common case) without a comprehension per page
                    pages = (maps[0].get(digest, -1),) if len(maps) == 1 else [m.get(digest, -1) for m in maps]
                    if -1 not in pages:
                        hits.append(pages)
                        alive = True
            if not alive:
                break
            chain = digest
        avail = self._available_per_replica()
        best = max(replicas, key=lambda r: (len(found[r]), avail[r], -r))
        return best, [list(column) for column in zip(*found[best])] or [[] for _ in self._groups], chain

    def _available_per_replica(self) -> np.ndarray:
        """Per replica, the pages an allocation can take in its tightest group."""
        return np.min([gt.pool.available_per_replica() for gt in self._groups], axis=0)

    # ---- committing written tokens [MAX: step] -----------------------------------------------------
    def step(self, seq_ids: Sequence[int], token_ids: Any) -> None:
        """Commit tokens the device has written: lengths advance and pages that became full
        enter the prefix cache. ``token_ids``: one id per sequence (decode), an ``(n, k)``
        array (``k`` each, multi-step decode), or one sequence of ids per sequence (prefill)."""
        rows = self._rows(seq_ids)
        if isinstance(token_ids, jax.Array):
            token_ids = np.asarray(token_ids)
        if not isinstance(token_ids, (list, tuple, np.ndarray)):
            raise ValueError(f"token_ids={show(token_ids)} is not a list or array; pass one id per sequence or one "
                             "list per sequence")
        if isinstance(token_ids, np.ndarray) or all(isinstance(t, (int, np.integer)) for t in token_ids):
            arr = integer_array("token_ids", token_ids, lo=0, hi=INT32_MAX, hint="token ids")
            if arr.ndim not in (1, 2) or arr.shape[0] != rows.size:
                raise ValueError(f"token_ids has shape {arr.shape}; pass ({rows.size},) or ({rows.size}, k) ids for {rows.size} sequences")
            self._commit(rows, np.full(rows.size, 1 if arr.ndim == 1 else arr.shape[1], np.int64), arr)
        else:
            if len(token_ids) != rows.size:
                raise ValueError(f"token_ids holds {len(token_ids)} entries for {rows.size} sequences; pass one per sequence")
            lists = [as_token_ids(t, f"token_ids[{i}]") for i, t in enumerate(token_ids)]
            self._commit(rows, np.array([t.size for t in lists], np.int64), lists)

    def append_tokens(self, seq_id: int, token_ids: Sequence[int] | np.ndarray) -> None:
        """`step` for one sequence: commit ``token_ids`` written at its next positions."""
        self.step([seq_id], [token_ids])

    def advance(self, seq_ids: int | Sequence[int], num_tokens: int | Sequence[int]) -> None:
        """Commit written tokens without their ids. Pages filled from here on are not entered
        in the prefix cache (their content is unknown); use `step` to keep caching them."""
        rows = self._rows([seq_ids] if isinstance(seq_ids, (int, np.integer)) else seq_ids)
        self._commit(rows, self._counts(num_tokens, rows.size), None)

    def _commit(self, rows: np.ndarray, counts: np.ndarray, tokens: Any) -> None:
        ps = self.page_size
        self._refuse_swapped(rows, "committing its tokens")
        lens = self._lens[rows]
        over = lens + counts > self._npages[rows] * ps
        if over.any():
            i = int(np.argmax(over))
            raise ValueError(
                f"sequence {int(rows[i])} has room for {int(self._npages[rows[i]]) * ps - int(lens[i])} more tokens "
                f"but {int(counts[i])} were committed; reserve them first (build_step_metadata / reserve)")
        for gt in self._groups:
            if gt.shared_partial:
                writing = np.flatnonzero(counts > 0)
                first = gt.table[rows[writing], lens[writing] // ps]
                shared = (first != PAD_PAGE) & (gt.pool.refcount[first] > 1)
                if shared.any():
                    j = int(np.argmax(shared))
                    raise ValueError(
                        f"sequence {int(rows[writing[j]])} commits tokens into page {int(first[j])}"
                        f"{self._in_group(gt)}, which it shares since a fork; reserve (build_step_metadata) after "
                        "forking so it gets a private copy, then write")
            if gt.copies or gt.pool.has_pending_scrubs() or gt.offloads or gt.onloads:
                self._check_no_pending_work(gt, rows, lens, counts)
        # Validated: commit.
        hashes = self._hashes
        if tokens is None:
            hashes.hashable[rows[counts > 0]] = False
        elif self.enable_prefix_caching and isinstance(tokens, np.ndarray) and tokens.ndim == 1:
            f_rows, cols, digests = hashes.extend_one(rows, lens, tokens)
            tags = [self._row_version[r] for r in f_rows.tolist()]
            for gt in self._groups:
                for page, digest, tag in zip(gt.table[f_rows, cols].tolist(), digests, tags):
                    gt.pool.commit(page, digest, tag)
        elif self.enable_prefix_caching:
            for i in np.flatnonzero(hashes.hashable[rows] & (counts > 0)).tolist():
                row = int(rows[i])
                for col, digest in hashes.extend(row, int(lens[i]), tokens[i]):
                    for gt in self._groups:
                        gt.pool.commit(int(gt.table[row, col]), digest, self._row_version[row])
        self._lens[rows] = lens + counts
        self._release_out_of_window(rows)

    def _check_no_pending_work(self, gt: GroupTable, rows: np.ndarray, lens: np.ndarray, counts: np.ndarray) -> None:
        """Tokens committed into a page a pending copy or scrub touches were written before that
        device work: it would overwrite them, or carry them into another sequence's page."""
        ps = self.page_size
        copied = set(gt.copies) | set(gt.copies.values())
        moved = set(gt.onloads) | {src for src, _, _ in gt.offloads.values()}
        pending = copied | moved | set(gt.pool.pending_scrubs().tolist())
        for i in np.flatnonzero(counts > 0).tolist():
            row, first, last = int(rows[i]), int(lens[i]) // ps, (int(lens[i]) + int(counts[i]) - 1) // ps
            for page in gt.table[row, first : last + 1].tolist():
                if page in pending:
                    work = "copy-on-write copy" if page in copied else "host-tier transfer" if page in moved else "scrub"
                    raise ValueError(
                        f"sequence {row} commits tokens in page {page}{self._in_group(gt)}, whose {work} is still "
                        "pending: the device would overwrite them. Call apply_pending(cache, host=...) after "
                        "build_step_metadata and before the step's writes")

    def _in_group(self, gt: GroupTable) -> str:
        """`` of layer group g`` in messages of a manager of several groups."""
        return f" of layer group {self._groups.index(gt)}" if len(self._groups) > 1 else ""

    # ---- inspection -------------------------------------------------------------------------------
    def length(self, seq_id: int) -> int:
        """Committed tokens of a sequence [MAX: cache_length]."""
        return int(self._lens[self._row(seq_id)])

    cache_length = length

    def capacity(self, seq_id: int) -> int:
        """Tokens the sequence's pages can hold (committed plus reserved ahead)."""
        return int(self._npages[self._row(seq_id)]) * self.page_size

    def pages(self, seq_id: int, *, group: int | None = None) -> list[int]:
        """The block-table row up to the last page held; in a sliding or chunked group the
        pages released from the window are ``PAD_PAGE`` (-1). ``group``: which layer group's
        pages (needed when there are several)."""
        g = self._group_index(group)
        row = self._row(seq_id)
        return self._groups[g].table[row, : self._npages[row]].tolist()

    def replica(self, seq_id: int) -> int | None:
        """The data-parallel replica whose slice of the pool holds the sequence (None: unbound)."""
        r = int(self._replica[self._row(seq_id)])
        return r if r >= 0 else None

    def page_table(self, seq_ids: Sequence[int], *, group: int | None = None) -> np.ndarray:
        """Rows of layer group ``group``'s block table (``PAD_PAGE`` past each sequence's
        pages), a copy."""
        g = self._group_index(group)
        return self._groups[g].table[self._rows(seq_ids)]

    @property
    def metrics(self) -> PageManagerMetrics:
        pools = [gt.pool for gt in self._groups]
        groups = tuple(GroupPoolMetrics(total_pages=p.num_pages, free_pages=p.num_free(), cached_pages=p.num_cached(),
                                        used_pages=p.num_used(), evictions=p.evictions) for p in pools)
        total = {f: sum(getattr(m, f) for m in groups) for f in ("total_pages", "free_pages", "cached_pages",
                                                                  "used_pages", "evictions")}
        return PageManagerMetrics(**total, active_sequences=int(self._active.sum()),
                                  scrubs=sum(p.scrubs for p in pools), groups=groups,
                                  versions=self._version_metrics(), host=self._host_metrics(), **self._counters)

    @property
    def usage(self) -> float:
        """Fraction of the pages (of every group) referenced by running sequences."""
        return sum(gt.pool.num_used() for gt in self._groups) / sum(gt.pool.num_pages for gt in self._groups)

    def __repr__(self) -> str:
        m = self.metrics
        return (f"PageManager({m.active_sequences}/{self.batch_size} sequences, pages used={m.used_pages} "
                f"cached={m.cached_pages} free={m.free_pages}, prefix caching "
                f"{'on' if self.enable_prefix_caching else 'off'})")

    # ---- sizing [MAX: estimated_memory_size, infer_optimal_batch_size] ----------------------------------
    estimated_memory_size = staticmethod(sizing.estimated_memory_size)
    infer_optimal_batch_size = staticmethod(sizing.infer_optimal_batch_size)

    # ---- invariants and persistence --------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise InvariantError (a bug in easykv) unless the bookkeeping is consistent: free +
        cached + used = total, ref counts = owners, no page owned twice except by sharing, the
        prefix map matches the pages and the sequences' chain digests, every sequence's row
        matches its lengths, and pending copies and scrubs touch only pages nobody else reads.
        A loaded state is held to the same rules (`from_state_dict`)."""
        try:
            manager_state.check_consistency(self)
        except manager_state.Broken as err:
            raise InvariantError(f"{err.message} (state field {err.field})") from None
        except InvariantError as err:  # the pool's own check
            raise InvariantError(f"{err.detail} (state field pool)") from None

    def _fork_shared_pages(self, gt: GroupTable) -> set[int]:
        """Partly filled pages of ``gt``'s pool with more than one owner (only a fork makes these)."""
        rows = np.flatnonzero(self._active & (self._lens % self.page_size != 0))
        return gt.fork_shared_pages(rows, self._lens[rows] // self.page_size)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild this manager exactly, as JSON-safe lists and numbers.
        Canonical: the same calls give the same state, restored on the way or not."""
        return manager_state.write_state(self)

    def clone(self) -> PageManager:
        """An independent copy of this manager (to try calls on without changing it); the
        `HostTier` it last applied work through is shared, not copied, and stays bound to this
        manager: the clone cannot apply work through it (`check_host`)."""
        import copy

        return copy.deepcopy(self, {id(self._tier): self._tier} if self._tier is not None else {})

    def lockstep_state(self) -> dict[str, Any]:
        """`state_dict` with the host tier's bookkeeping (swapped-out sequences, pending transfers,
        the host pools): what `easykv.distributed.assert_lockstep` compares between processes."""
        return manager_state.write_state(self, host=True)

    @classmethod
    def from_state_dict(cls, metadata: Any, state: dict[str, Any]) -> PageManager:
        """A manager equal to the one that wrote ``state``, checked against ``metadata``.

        The state is input: every field's type and range, and every cross-reference (pages
        owned, reference counts, the prefix map, pending copies and scrubs) is checked before
        the manager is returned; `ManagerStateError` (a ValueError) names the field."""
        m = cls(metadata)
        manager_state.read_state(m, state)
        try:
            manager_state.check_consistency(m)
        except manager_state.Broken as err:
            raise ManagerStateError(err.message, field=err.field) from None
        except InvariantError as err:  # the pool's own check
            raise ManagerStateError(err.detail, field="pool") from None
        return m

    def reshard(self, metadata: Any) -> PageManager:
        """A copy of this manager for ``metadata``: the same pool split into
        ``metadata.page_shards`` data-parallel slices (restoring a checkpoint onto another
        mesh). ValueError when a sequence's pages would straddle two slices (or lie in different
        slices in two layer groups)."""
        from easykv.spec.metadata import PagedAttentionCacheMetaData

        if not isinstance(metadata, PagedAttentionCacheMetaData):
            raise ValueError(f"metadata must be a PagedAttentionCacheMetaData, got {type(metadata).__name__}")
        state = reshard_state(self.state_dict(), int(metadata.page_shards))
        return PageManager.from_state_dict(metadata, state)

    # ---- input checks ---------------------------------------------------------------------------
    def _check_id(self, seq_id: Any, strict: bool = True) -> int:
        """The id as an int; outside ``0..batch_size - 1``: ValueError, or -1 when not ``strict``."""
        sid = integer("sequence id", seq_id, lo=None, hi=None)
        if not 0 <= sid < self.batch_size:
            if not strict:
                return -1
            raise ValueError(f"sequence id {sid} is outside 0..{self.batch_size - 1} (batch_size={self.batch_size})")
        return sid

    def _row(self, seq_id: Any) -> int:
        sid = self._check_id(seq_id, strict=False)
        if sid < 0 or not self._active[sid]:
            raise UnknownSequenceError(
                f"sequence id {show(seq_id)} is not claimed (never claimed, or already released); "
                f"claimed ids: {self.active_ids[:16]}{'...' if self._active.sum() > 16 else ''}")
        return sid

    def _rows(self, seq_ids: Any) -> np.ndarray:
        rows = integer_array("seq_ids", seq_ids, ndim=1, lo=None, hi=None, dtype=np.int64)
        if not rows.size:
            return rows
        if rows.min() < 0 or rows.max() >= self.batch_size or not self._active[rows].all():
            for s in rows.tolist():
                self._row(s)
        if rows.size > 1:
            seen = np.bincount(rows)
            if seen.max() > 1:
                raise ValueError(f"seq_ids repeats id {int(np.argmax(seen))}; list each sequence once per step")
        return rows

    def _counts(self, num_tokens: Any, n: int) -> np.ndarray:
        """Token counts, one per sequence, each bounded by max_sequences before any arithmetic."""
        hint = f"a sequence holds at most max_sequences={self.max_length} tokens"
        try:
            scalar = np.ndim(num_tokens) == 0
        except (ValueError, TypeError):  # ragged: integer_array names the problem
            scalar = False
        if scalar:
            return np.full(n, integer("num_tokens", num_tokens, lo=0, hi=self.max_length, hint=hint), np.int64)
        counts = integer_array("num_tokens", num_tokens, ndim=1, lo=0, hi=self.max_length, dtype=np.int64, hint=hint)
        if counts.shape != (n,):
            raise ValueError(f"num_tokens must be an int or {n} ints (one per sequence), got {counts.size}")
        return counts

    def _check_extent(self, row: int, end: int, what: str) -> None:
        if end > self.max_length:
            raise ValueError(
                f"sequence {row} would hold {end} tokens ({what}), past max_sequences={self.max_length}; "
                "finish or truncate it, or create the metadata with a larger max_sequences")


__all__ = [
    "CacheFullError", "GroupPoolMetrics", "InvariantError", "PageManager", "PageManagerMetrics", "UnknownSequenceError",
    "VersionMetrics",
    "increment_cache_lengths", "stack_metadata",
]
