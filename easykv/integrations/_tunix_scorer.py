"""The scoring loop (`Scorer`): runs a checked `ScoreBatch` (``_tunix_scoring``) on an engine's manager and
runner, step by step, in waves when the batch is larger than the cache.

Each step packs up to ``budget`` tokens: first the sequences already running (rows, then leaders prefilling
their prompt), then new ones while the step has tokens, sequence slots and pages left. A group whose leader
has prefilled starts its rows: a fork per row, the last row in the leader itself (so a group needs a second
slot only for its other rows); a new group is opened only while a slot is left for those forks. Pages are
counted before anything starts: what the running sequences may still take, plus, for every open group with
no row running, its largest waiting row, must fit in the free and cached pages, so every open group can
always run a row once the running ones finish (their full pages stay cached, findable as any prefix). A
finished row's sequence is released at once.

One jitted program per step shape (``budget`` tokens, sequence rows in powers of two); each step's
log-probabilities stay on the device, gathered once into the output at the end, so no step waits on the host.
Private to the Tunix integration; imports jax and easykv's manager and runner.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from easykv.integrations._tunix_scoring import Feed, Group, ScoreBatch, padded_rows
from easykv.manager.manager import PageManager
from easykv.runner import Runner


class Scorer:
    """Runs one `ScoreBatch` (module doc).

    Args:
      manager: the engine's manager.
      runner: its runner.
      step: ``step(tokens, targets, temperature, cache, plan) -> (cache, logp)``: the runner's step.
      budget: tokens per step (at most what one step of the cache holds)."""

    def __init__(self, manager: PageManager, runner: Runner, step: Callable[..., tuple[Any, jax.Array]],
                 budget: int) -> None:  # fmt: skip
        self.manager, self.runner, self.step, self.budget = manager, runner, step, budget
        self.outputs: list[jax.Array] = []  # each step's (budget,) log-probabilities, on the device
        self.where: list[tuple[int, np.ndarray, int, int]] = []  # (row, columns, step, offset) of each fed run
        self.pending: deque[Group] = deque()  # groups not opened yet
        self.open: list[Group] = []  # groups whose leader holds a sequence and rows are still to start
        self.running: list[tuple[Feed, Group]] = []  # sequences being fed: leaders prefilling, rows

    def run(self, batch: ScoreBatch) -> jax.Array:
        """Score ``batch``: its ``(rows, width)`` float32 log-probabilities (0 at padding). Every sequence it
        claimed is released, also when a step fails."""
        self.pending = deque(batch.groups)
        try:
            while self.pending or self.open or self.running:
                feeds = self._continue()
                started = self._start(feeds)
                if not feeds:
                    raise RuntimeError(f"the scorer could start nothing ({started} new sequences, {len(self.open)} "
                                       f"open groups, {len(self.pending)} waiting): a bug in easykv's scoring loop")
                self._run_step(feeds, batch.temperature)
                self._finish()
        finally:
            for feed, _ in self.running:
                self._release(feed)
            for group in self.open:
                self._release(group.leader)
        return self._gather(batch)

    # ---- what a step feeds ------------------------------------------------------------------------
    def _continue(self) -> list[tuple[Feed, int]]:
        feeds, budget = [], self.budget
        for feed, _ in sorted(self.running, key=lambda fg: fg[0].row < 0):  # rows first: they free pages
            n = min(feed.left, budget)
            if n:
                feeds.append((feed, n))
                budget -= n
        return feeds

    def _start(self, feeds: list[tuple[Feed, int]]) -> int:
        """Start rows of open groups, then open new groups, while the step has tokens and the cache has slots
        and pages (module doc); returns how many sequences started."""
        mgr, page = self.manager, self.manager.page_size
        budget = self.budget - sum(n for _, n in feeds)
        held = sum(_pages(feed.left, page) for feed, _ in self.running)
        room = min(g.free_pages + g.cached_pages for g in mgr.metrics.groups)
        started = 0
        while budget > 0:
            slots = mgr.batch_size - len(mgr.active_ids)
            group = next((g for g in self.open if self._ready(g) and (slots or len(g.rows) == 1)), None)
            if group is not None:
                need = _pages(group.rows[0].left, page)
                if held and held + need + self._reserve(exclude=group) > room:
                    break
                feed = self._start_row(group)
            elif self.pending and slots >= (2 if len(self.pending[0].rows) > 1 else 1):
                group = self.pending[0]
                need = _pages(group.leader.left, page) + _reserve(group, page)
                if (held or self.open) and held + need + self._reserve() > room:
                    break
                feed = self._open(self.pending.popleft())
                # the prompt's cached pages it took (and host pages brought back) are no longer free or cached
                room = min(g.free_pages + g.cached_pages for g in mgr.metrics.groups)
            else:
                break
            started += 1
            held += _pages(feed.left, page)
            n = min(feed.left, budget)
            if n:
                feeds.append((feed, n))
                budget -= n
        return started

    def _ready(self, group: Group) -> bool:
        """Whether ``group``'s leader has prefilled its pages and a row is waiting."""
        return bool(group.rows) and group.leader.left == 0

    def _reserve(self, exclude: Group | None = None) -> int:
        """Pages kept for the open groups with no row running (their largest waiting row each)."""
        page = self.manager.page_size
        return sum(_reserve(g, page) for g in self.open if g is not exclude and not g.running_rows)

    def _start_row(self, group: Group) -> Feed:
        """The group's next row: in a fork of the leader, or the last one in the leader itself."""
        row = group.rows.popleft()
        if group.rows:
            child = self.manager.fork(group.leader.seq)
            assert isinstance(child, int)  # fork(seq) returns one id
            row.seq = child
        else:
            self.open.remove(group)
            group.leader.take(row)
            row = group.leader
        group.running_rows += 1
        self.running.append((row, group))
        return row

    def _open(self, group: Group) -> Feed:
        """Claim the group's leader and attach the prompt's cached pages (device, host tier, store)."""
        leader = group.leader
        leader.seq = self.manager.claim(1)[0]
        self.open.append(group)  # from here on `run` releases it, whatever fails
        found = self.runner.match_prefix(leader.seq, group.prompt.tolist())
        leader.fed = min(found, leader.tokens.size)  # whole pages, at most the prompt before its last token
        if leader.left:
            self.running.append((leader, group))
        return leader

    # ---- a step ---------------------------------------------------------------------------------
    def _run_step(self, feeds: list[tuple[Feed, int]], temperature: float) -> None:
        mgr, budget = self.manager, self.budget
        tokens, targets = np.zeros(budget, np.int32), np.zeros(budget, np.int32)
        chunks, offset = [], 0
        for feed, n in feeds:
            chunk = feed.tokens[feed.fed : feed.fed + n]
            tokens[offset : offset + n] = chunk
            skip = feed.tokens.size - feed.targets.size  # tokens before the first that predicts a target
            first, last = max(feed.fed, skip), feed.fed + n
            if first < last:
                at = offset + first - feed.fed
                targets[at : at + last - first] = feed.targets[first - skip : last - skip]
                self.where.append((feed.row, feed.columns[first - skip : last - skip], len(self.outputs), at))
            chunks.append(chunk)
            offset += n
        plan = mgr.schedule([f.seq for f, _ in feeds], [n for _, n in feeds], pad_tokens_to=budget,
                            pad_seqs_to=padded_rows(len(feeds), mgr.batch_size))
        step = partial(self.step, jnp.asarray(tokens), jnp.asarray(targets), jnp.float32(temperature))
        self.outputs.append(self.runner.run(plan, step, token_ids=chunks))
        for feed, n in feeds:
            feed.fed += n

    def _finish(self) -> None:
        """Release the rows fed whole; a leader that prefilled its pages leaves the running ones (its group's
        rows start from it)."""
        still = []
        for feed, group in self.running:
            if feed.left:
                still.append((feed, group))
            elif feed.row >= 0:
                group.running_rows -= 1
                self._release(feed)
        self.running = still

    def _release(self, feed: Feed) -> None:
        if feed.seq >= 0 and self.manager.contains(feed.seq):
            self.manager.release(feed.seq)
        feed.seq = -1

    def _gather(self, batch: ScoreBatch) -> jax.Array:
        """The ``(rows, width)`` float32 output: one gather from every step's log-probabilities (0 at padding)."""
        index = np.full((batch.rows, batch.width), -1, np.int64)
        for row, columns, step, offset in self.where:
            index[row, columns] = step * self.budget + offset + np.arange(columns.size)
        if not self.outputs:
            return jnp.zeros((batch.rows, batch.width), jnp.float32)
        flat = jnp.concatenate(self.outputs)
        return jnp.where(jnp.asarray(index >= 0), flat[jnp.asarray(np.maximum(index, 0))], 0.0)


def _pages(tokens: int, page_size: int) -> int:
    """Pages a sequence may still take for ``tokens`` more tokens (its writes start on a fresh page at worst)."""
    return -(-tokens // page_size)


def _reserve(group: Group, page_size: int) -> int:
    """Pages one row of ``group`` needs (its largest waiting one), so the group can always run a row."""
    return max((_pages(row.left, page_size) for row in group.rows), default=0)


__all__ = ["Scorer"]
