"""One allocator class per attention kind, chosen by `ALLOCATORS` from the group's `AttentionKind`:
what a layer group's sequences keep of their pages.

- `FullAttentionTable`: every query reads from position 0, so a sequence keeps every page.
- `SlidingWindowTable` and `ChunkedTable`: after every commit (and prefix match) the full pages
  wholly before the first position the sequence's next query sees are released: they return to
  the group's pool, or stay findable in its prefix cache when hashed. Their block-table columns
  become holes (``PAD_PAGE``): a row is holes in ``[0, start)``, pages in ``[start, npages)``
  (`group_table`). So a sequence holds about its window's pages however long it grows; reading
  its table needs the window (`HostChecked.covers`).

A sequence can also start in the middle (`PageManager.resume`): one moved from another cache with
only its window's tokens. Its positions before its floor have no K/V; the table holds no page for
them, and until its window has moved past the floor the manager vouches for none of its reads.

Imports of the manager: the `GroupTable` base only; it never imports ``storage``, ``attention``,
``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from easykv.manager.group_table import GroupTable
from easykv.spec.groups import AttentionKind
from easykv.step.metadata import PAD_PAGE

if TYPE_CHECKING:
    from easykv.spec.groups import LayerGroup


class FullAttentionTable(GroupTable):
    """A full-attention group: nothing leaves a window, ``start`` stays 0 (owns what `GroupTable` does)."""

    windowed = False

    def first_needed(self, lens: np.ndarray) -> np.ndarray:
        return np.zeros(np.shape(lens), np.int64)

    def released_columns(self, lens: np.ndarray) -> np.ndarray:
        return np.zeros(np.shape(lens), np.int32)

    def release_out_of_window(self, rows: np.ndarray, lens: np.ndarray, version: list[bytes | None],
                              current: bytes | None) -> np.ndarray:
        return self.released_columns(lens)

    def first_kept_position(self, length: int, floor: int) -> int:
        return 0


class _WindowTable(GroupTable):
    """A group whose queries read a window of positions (owns what `GroupTable` does)."""

    windowed = True

    def first_needed(self, lens: np.ndarray) -> np.ndarray:
        return self.group.first_needed_position(lens)

    def release_out_of_window(self, rows: np.ndarray, lens: np.ndarray, version: list[bytes | None],
                              current: bytes | None) -> np.ndarray:
        cols = self.released_columns(lens)
        starts = self.start
        for i in np.flatnonzero(cols > starts[rows]).tolist():
            row, stop = int(rows[i]), int(cols[i])
            start = int(starts[row])
            self.release_pages(self.table[row, start:stop][::-1].tolist(), stale=version[row] != current)
            self.table[row, start:stop] = PAD_PAGE
            starts[row] = stop
        return cols

    def first_kept_position(self, length: int, floor: int) -> int:
        return max(int(self.group.first_needed_position(length)), floor)


class SlidingWindowTable(_WindowTable):
    """A sliding-window group (a query at p reads p - W + 1 .. p): a sequence keeps the
    ``ceil((W - 1) / page_size) + 1`` pages its window touches, one page leaving as one enters."""


class ChunkedTable(_WindowTable):
    """A chunked group (a query reads its own page-aligned chunk of C tokens): a sequence keeps
    its current chunk's pages, all released at once when the next chunk starts."""


ALLOCATORS: Mapping[AttentionKind, type[GroupTable]] = {
    AttentionKind.FULL: FullAttentionTable,
    AttentionKind.SLIDING: SlidingWindowTable,
    AttentionKind.CHUNKED: ChunkedTable,
}


def allocator_for(group: LayerGroup, **fields: Any) -> GroupTable:
    """A fresh allocator of the class `ALLOCATORS` names for ``group``'s attention kind
    (``fields``: `GroupTable.fresh`'s keywords)."""
    return ALLOCATORS[group.attention].fresh(group, **fields)


__all__ = ["ALLOCATORS", "ChunkedTable", "FullAttentionTable", "SlidingWindowTable", "allocator_for"]
