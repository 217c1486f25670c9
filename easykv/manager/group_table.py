"""One layer group's share of the page manager: its pool, its block table, its window.

Every layer group has its own pool of page ids (its pages have their own size), so the manager
keeps one `GroupTable` per group. What a sequence *is* (its length, the columns it has reserved,
its data-parallel replica, its token hashes) is one thing for all groups and stays in the
`PageManager`; what a sequence *holds* differs per group:

- ``table[row, col]``: the group's page at block-table column ``col`` (``PAD_PAGE`` where none);
  every group reserves the same columns, so a row holds pages in ``[start[row], npages[row])``.
- ``start[row]``: columns before it were released because they left the group's window (always
  0 in a full-attention group): a sliding group's memory follows its window, not the sequence.
- ``copies``: pending copy-on-write copies of this pool (dst page -> src page).
- ``shared_partial``: partly filled pages of this pool a fork left shared.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from easykv.manager.page_pool import PagePool
from easykv.runtime import PAD_PAGE


@dataclasses.dataclass(eq=False)
class GroupTable:
    """One layer group's pages of every sequence (see the module doc)."""

    group: Any  # LayerGroup (the spec is not imported at module level: the manager's import stays light)
    pool: PagePool
    table: np.ndarray  # (batch_size, pages_per_sequence) int32
    start: np.ndarray  # (batch_size,) int32
    copies: dict[int, int] = dataclasses.field(default_factory=dict)
    shared_partial: set[int] = dataclasses.field(default_factory=set)

    @classmethod
    def fresh(cls, group: Any, *, batch_size: int, pages_per_sequence: int, page_shards: int,
              scrub_released: bool) -> GroupTable:
        return cls(group=group, pool=PagePool(int(group.num_pages), int(page_shards), scrub_released=scrub_released),
                   table=np.full((batch_size, pages_per_sequence), PAD_PAGE, np.int32),
                   start=np.zeros(batch_size, np.int32))

    @property
    def windowed(self) -> bool:
        """Whether the group releases pages that left its window (sliding or chunked)."""
        return self.group.attention != "full"

    def released_columns(self, lens: Any, page_size: int) -> np.ndarray:
        """Per length, the block-table columns wholly before what the next query reads."""
        if not self.windowed:
            return np.zeros(np.shape(lens), np.int32)
        first = self.group.first_needed_position(np.asarray(lens, np.int64))
        return (first // page_size).astype(np.int32)

    def held(self, row: int, npages: int) -> list[int]:
        """The pages ``row`` holds in this group, in column order."""
        return self.table[row, self.start[row]:npages].tolist()

    def release_pages(self, pages: list[int], *, stale: bool = False) -> None:
        """Drop one reference from each page (``stale``: of an older weight version, see
        `PagePool.release`); a pending copy into a page that became free is dropped (nobody
        will read its destination)."""
        sources = set(self.copies.values()) if self.copies else ()
        for page in self.pool.release(pages, stale=stale, sources=sources):
            self.copies.pop(page, None)

    def reset_row(self, row: int) -> None:
        self.table[row] = PAD_PAGE
        self.start[row] = 0

    def fork_shared_pages(self, rows: np.ndarray, cols: np.ndarray) -> set[int]:
        """Of the pages at ``(rows, cols)`` (the unfinished pages of sequences), those this
        group holds with more than one owner (only a fork makes these)."""
        pages = self.table[rows, cols]
        pages = pages[pages != PAD_PAGE]
        return set(pages[self.pool.refcount[pages] > 1].tolist())


__all__ = ["GroupTable"]
