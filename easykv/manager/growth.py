"""How the page manager's sequences get pages: room reserved ahead of writes (new pages at
page boundaries, bound to one data-parallel replica, all or nothing), a private copy of a shared,
partly filled page before it is written (copy-on-write), fork, and the step metadata built right
after reserving [MAX: fetch, increment_cache_lengths].

``_Growth`` is a mixin of `PageManager` (manager.py), never used alone: its methods read and
change the manager's block table, lengths, replicas and pool, and use its input checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from easykv.errors import CacheFullError
from easykv.manager.group_table import GroupTable
from easykv.step.metadata import PagedAttentionMetadata, build_mixed, increment_cache_lengths, stack_metadata
from easykv.step.checks import HostChecked, check_padding, mark_checked
from easykv.validation import positive_int


class _Growth:
    """`PageManager`'s reservation, copy-on-write, fork and step metadata (see the module doc)."""

    # ---- growth ------------------------------------------------------------------------------
    def reserve(self, seq_ids: int | Sequence[int], num_tokens: int | Sequence[int]) -> None:
        """Make room for ``num_tokens`` more tokens of each sequence: new pages at page
        boundaries, and a private copy of a shared, partly filled last page (copy-on-write; see
        `take_copies`). All or nothing: on CacheFullError no sequence got anything."""
        rows = self._rows([seq_ids] if isinstance(seq_ids, (int, np.integer)) else seq_ids)
        self._reserve(rows, self._counts(num_tokens, rows.size))

    def _reserve(self, rows: np.ndarray, new: np.ndarray) -> None:
        ps, groups = self.page_size, self._groups
        self._refuse_swapped(rows, "reserving pages for it")
        lens = self._lens[rows]
        ends = lens + new
        if ends.size and ends.max() > self.max_length:
            i = int(np.argmax(ends))
            self._check_extent(int(rows[i]), int(ends[i]), f"{int(lens[i])} cached + {int(new[i])} new tokens")
        held = self._npages[rows]
        need = (ends + (ps - 1)) // ps - held  # columns: the same in every group
        grow = np.flatnonzero(need > 0)
        cows = [self._copy_on_write_rows(gt, rows, lens, new) for gt in groups]
        if not grow.size and not any(cows):
            return
        counts = need[grow]
        rep = self._replica[rows]
        if self._num_replicas == 1:
            for gt, cow in zip(groups, cows):
                demand = int(counts.sum()) + len(cow)
                if demand > gt.pool.num_available(0):
                    self._raise_full(gt, 0, demand)
            self._replica[rows[grow]] = 0
        else:
            rep = self._bind_replicas(rows, grow, counts, cows)
        # Checks passed: nothing below can fail.
        total = int(counts.sum())
        for gt, cow in zip(groups, cows):
            pool = gt.pool
            for i in cow:
                row, col = int(rows[i]), int(lens[i]) // ps
                src = int(gt.table[row, col])
                dst = gt.allocate(int(self._replica[row]), 1, overwritten=True)[0]
                gt.table[row, col] = dst
                pool.release([src])
                self._counters["copies"] += gt.copy_into(dst, src)
            if not grow.size:
                continue
            g_rows = rows[grow]
            if self._num_replicas == 1:
                pages = gt.allocate(0, total)
            else:  # one allocation per replica, handed out in batch order
                pages = np.empty(total, np.int32)
                owner = np.repeat(rep[grow], counts)
                for r in np.unique(owner).tolist():
                    mask = owner == r
                    pages[mask] = gt.allocate(r, int(mask.sum()))
            if total == grow.size:  # one page each: the decode case
                gt.table[g_rows, held[grow]] = pages
            else:
                starts = np.cumsum(counts) - counts
                cols = np.arange(total) - np.repeat(starts - held[grow], counts)
                gt.table[np.repeat(g_rows, counts), cols] = pages
        if grow.size:
            self._npages[rows[grow]] += counts.astype(np.int32)

    def _bind_replicas(self, rows: np.ndarray, grow: np.ndarray, counts: np.ndarray, cows: list[list[int]]) -> np.ndarray:
        """Check per-replica capacity in every group, binding unbound sequences to the least
        loaded replica (most pages left in its tightest group, then the lowest index); returns
        the batch's replicas. Raises CacheFullError."""
        groups, n_rep = self._groups, self._num_replicas
        demand = np.zeros((len(groups), rows.size), np.int64)
        demand[:, grow] = counts
        for g, cow in enumerate(cows):
            demand[g, cow] += 1
        rep = self._replica[rows].copy()
        avail = np.stack([gt.pool.available_per_replica() for gt in groups])
        bound = rep >= 0
        left = avail - np.stack([np.bincount(rep[bound], weights=d[bound], minlength=n_rep) for d in demand]).astype(np.int64)
        wants = demand.sum(axis=0) > 0
        for i in np.flatnonzero(~bound & wants):
            r = int(np.argmax(left.min(axis=0)))
            rep[i] = r
            left[:, r] -= demand[:, i]
        if left.min() < 0:
            g, r = np.unravel_index(int(np.argmin(left)), left.shape)
            self._raise_full(groups[g], int(r), int(avail[g, r] - left[g, r]))
        self._replica[rows] = np.where(wants, rep, self._replica[rows])
        return rep

    def _raise_full(self, gt: GroupTable, replica: int, needed: int) -> None:
        pool = gt.pool
        split = pool.num_replicas > 1
        raise CacheFullError(
            f"the step needs {needed} page{'s' * (needed != 1)}{self._in_group(gt)}"
            f"{f' in data-parallel replica {replica}' if split else ''} but only "
            f"{pool.num_available(replica)} are free or evictable ({pool.num_used(replica)} in use by running "
            "sequences); release or preempt sequences, or give the cache more pages",
            resource="pages", needed=needed, available=pool.num_available(replica), replica=replica if split else None)

    def _copy_on_write_rows(self, gt: GroupTable, rows: np.ndarray, lens: np.ndarray, new: np.ndarray) -> list[int]:
        """Indices of ``rows`` that write into a partly filled page of ``gt``'s pool another
        sequence shares. Processed in batch order, the last writer of a page keeps the
        original. Only forks share partly filled pages, so without live forks this costs nothing."""
        live = gt.shared_partial
        if live:
            live.difference_update([p for p in live if gt.pool.refcount[p] <= 1])
        if not live:
            return []
        idx = np.flatnonzero((new > 0) & (lens % self.page_size != 0))
        pages = gt.table[rows[idx], lens[idx] // self.page_size]
        refs = gt.pool.refcount[pages]
        out, left = [], {}
        for j in np.flatnonzero(refs > 1):
            page = int(pages[j])
            count = left.get(page, int(refs[j]))
            if count > 1:
                out.append(int(idx[j]))
                left[page] = count - 1
        return out

    def fork(self, seq_id: int, n: int | None = None) -> int | list[int]:
        """A new sequence with the same history (parallel sampling, beam search); with ``n``,
        ``n`` of them in one call (GRPO-style samples of one prompt), returned as a list, all or
        none. Written pages are shared; whichever sequence next writes into a shared partly
        filled page gets a private copy. Pages reserved ahead but not written stay with
        ``seq_id``."""
        row = self._row(seq_id)
        self._refuse_swapped(row, "fork")
        count = 1 if n is None else positive_int("n", n, hi=self.batch_size,
                                                  hint=f"children of one sequence, at most batch_size={self.batch_size}")
        free = np.flatnonzero(~self._active)
        if free.size < count:
            raise CacheFullError(
                f"fork({row}{'' if n is None else f', n={count}'}) needs {count} free sequence slot"
                f"{'s' * (count > 1)} but {free.size} of batch_size={self.batch_size} are free; release sequences "
                "first", resource="sequence slots", needed=count, available=int(free.size))
        children = [self._fork_one(row, int(child)) for child in free[:count]]
        return children[0] if n is None else children

    def _fork_one(self, row: int, child: int) -> int:
        k = -(-int(self._lens[row]) // self.page_size)
        for gt in self._groups:
            start = min(int(gt.start[row]), k)  # pages before it left the window: holes in both rows
            if self._lens[row] % self.page_size and start < k:
                gt.shared_partial.add(int(gt.table[row, k - 1]))
            gt.pool.share(gt.table[row, start:k].tolist())
            gt.table[child, :k] = gt.table[row, :k]
            gt.start[child] = start
        self._npages[child], self._floor[child] = k, self._floor[row]
        self._active[child] = True
        # A parent that holds only pages reserved ahead shares none: the child is unbound.
        self._lens[child], self._replica[child] = self._lens[row], (self._replica[row] if k else -1)
        self._hashes.copy_row(row, child)
        self._row_version[child] = self._row_version[row]
        return child

    # ---- step metadata [MAX: fetch, increment_cache_lengths] --------------------------------------
    def build_step_metadata(self, seq_ids: Sequence[int], num_new_tokens: int | Sequence[int], *,
                            pad_tokens_to: int | None = None, pad_seqs_to: int | None = None) -> Any:
        """Reserve pages and build the mixed-form metadata of one step in which sequence
        ``seq_ids[b]`` appends ``num_new_tokens[b]`` tokens (a prefill chunk, a decode, or 0).
        Lengths advance only when the tokens are committed (`step`), after the device wrote them.
        ``pad_tokens_to`` / ``pad_seqs_to`` fix the shapes so jit sees few of them.

        With several layer groups, a tuple of one `PagedAttentionMetadata` per group (each its
        own page table and slots; the cache's writes and attention take the tuple)."""
        rows = self._rows(seq_ids)
        new = self._counts(num_new_tokens, rows.size)
        pad_tokens_to, pad_seqs_to = check_padding(self.metadata, int(new.sum()), rows.size, pad_tokens_to, pad_seqs_to)
        self._reserve(rows, new)
        return self._per_group([
            self._proved(gt, build_mixed(gt.table[rows], self._lens[rows], new.astype(np.int32), page_size=self.page_size,
                                         pad_tokens_to=pad_tokens_to, pad_seqs_to=pad_seqs_to), rows)
            for gt in self._groups])

    def build_decode_metadata(self, seq_ids: Sequence[int], num_steps: int = 1, *, pad_seqs_to: int | None = None,
                              stacked: bool = False) -> Any:
        """Metadata for ``num_steps`` decode steps ahead, with pages reserved for all of them,
        so a multi-step loop needs no host round trip. Step ``j`` writes position ``length + j``.
        Returns a list, or with ``stacked=True`` one metadata whose mixed fields carry a leading
        step axis (for `lax.scan`). On device, `increment_cache_lengths` derives step ``j + 1``
        from step ``j``. Commit the tokens afterwards with `step` (``(n, num_steps)`` ids).
        With several layer groups each step (or the stacked metadata) is a tuple of one per group."""
        rows = self._rows(seq_ids)
        k = positive_int("num_steps", num_steps)
        _, pad_seqs_to = check_padding(self.metadata, rows.size, rows.size, None, pad_seqs_to)
        self._reserve(rows, np.full(rows.size, k, np.int64))
        per_group = []
        for gt in self._groups:
            steps = [build_mixed(gt.table[rows], self._lens[rows], np.ones(rows.size, np.int32),
                                 page_size=self.page_size, pad_tokens_to=pad_seqs_to, pad_seqs_to=pad_seqs_to)]
            for _ in range(k - 1):
                steps.append(increment_cache_lengths(steps[-1], page_size=self.page_size, num_pages=gt.pool.num_pages))
            per_group.append(stack_metadata(steps) if stacked else [self._proved(gt, m, rows) for m in steps])
        if stacked:
            return self._per_group(per_group)
        return [self._per_group(step) for step in zip(*per_group)]

    def _proved(self, gt: GroupTable, rt: PagedAttentionMetadata, rows: np.ndarray) -> PagedAttentionMetadata:
        """``rt`` marked as checked: the manager's invariants prove what the constructors check
        (every page a row reads is its own, assigned and in its replica's slice; a page written
        this step belongs to one sequence), so the write and attention skip those checks; a sliding
        or chunked cache's mark holds only for reads within its window."""
        group = gt.group
        reads = not self._floor[rows].any()  # a resumed sequence's window may still reach before its floor
        return mark_checked(rt, HostChecked(num_pages=gt.pool.num_pages, page_size=self.page_size, reads=reads,
                                            page_shards=self._num_replicas, attention=group.attention,
                                            window=group.window))

    def increment_cache_lengths(self, metadata: Any) -> Any:
        """The next decode step's metadata from this one (numpy or jax arrays, jit-friendly;
        with several layer groups, a tuple of one per group); the manager's lengths do not
        change (see `build_decode_metadata`)."""
        n = len(self._groups)
        if n > 1 and (not isinstance(metadata, tuple) or len(metadata) != n):
            raise ValueError(f"this manager has {n} layer groups: pass a tuple of {n} step metadata, one per group "
                             f"(what build_decode_metadata returns), got {type(metadata).__name__}")
        steps = metadata if n > 1 else (metadata,)
        return self._per_group([increment_cache_lengths(m, page_size=self.page_size, num_pages=gt.pool.num_pages)
                                for gt, m in zip(self._groups, steps)])
