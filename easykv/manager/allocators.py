"""One allocator class per attention kind, chosen by `ALLOCATORS` from the group's `AttentionKind`:
what a layer group's sequences keep of their pages. Each holds its kind's rules through the
group's window rule (`easykv.spec.windows`, where the arithmetic is written once):

- `FullAttentionTable`: every query reads from position 0, so a sequence keeps every page and
  the table releases nothing; a prefix hit of k pages needs all k.
- `SlidingWindowTable` and `ChunkedTable`: after every commit (and prefix match) the full pages
  wholly before the first position the sequence's next query sees are released: they return to
  the group's pool, or stay findable in its prefix cache when hashed. Their block-table columns
  become holes (``PAD_PAGE``): a row is holes in ``[0, start)``, pages in ``[start, npages)``
  (`group_table`). So a sequence holds about its window's pages however long it grows; reading
  its table needs the window (`HostChecked.covers`). A prefix hit of k pages needs only the pages
  the window of a k-page sequence reads (the window lookup, `prefix_hits`).

A sequence can also start in the middle (`PageManager.resume`): one moved from another cache with
only its window's tokens. Its positions before its floor have no K/V; the table holds no page for
them, and until its window has moved past the floor the manager vouches for none of its reads.

Imports of the manager: the `GroupTable` base only; it never imports ``storage``, ``attention``,
``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from easykv.manager.group_table import GroupTable
from easykv.spec.groups import AttentionKind
from easykv.step.metadata import PAD_PAGE

if TYPE_CHECKING:
    from easykv.spec.groups import LayerGroup
    from easykv.spec.windows import ChunkedRule, SlidingWindowRule


class FullAttentionTable(GroupTable):
    """A full-attention group: nothing leaves a window, ``start`` stays 0, nothing is released
    (owns what `GroupTable` does)."""

    kind = AttentionKind.FULL
    windowed = False

    def release_out_of_window(self, rows: np.ndarray, lens: np.ndarray, version: list[bytes | None],
                              current: bytes | None) -> np.ndarray:
        return np.zeros(np.shape(lens), np.int32)  # every page is read again: none is released


class _WindowTable(GroupTable):
    """A group whose queries read a window of positions: the release, written once for the
    sliding and the chunked kind (owns what `GroupTable` does)."""

    windowed = True

    def release_out_of_window(self, rows: np.ndarray, lens: np.ndarray, version: list[bytes | None],
                              current: bytes | None) -> np.ndarray:
        """Release the pages of ``rows`` (of lengths ``lens``) wholly before what their next
        queries read, and leave holes in their columns; returns the columns released per row.
        Last column first, as `GroupCoordinator.release_row`: a prefix's head pages, which more
        prompts share, are evicted last. ``version``: each row's weight version (``current``: the
        current one; an older one's pages are evicted first)."""
        cols = self.released_columns(lens)
        starts = self.start
        for i in np.flatnonzero(cols > starts[rows]).tolist():
            row, stop = int(rows[i]), int(cols[i])
            start = int(starts[row])
            self.release_pages(self.table[row, start:stop][::-1].tolist(), stale=version[row] != current)
            self.table[row, start:stop] = PAD_PAGE
            starts[row] = stop
        return cols


class SlidingWindowTable(_WindowTable):
    """A sliding-window group (a query at p reads p - W + 1 .. p, `SlidingWindowRule`): a
    sequence keeps the ``ceil((W - 1) / page_size) + 1`` pages its window touches, one page
    leaving as one enters; a prefix hit needs only the pages of its last window."""

    kind = AttentionKind.SLIDING

    @functools.cached_property
    def rule(self) -> SlidingWindowRule:
        return cast("SlidingWindowRule", self.group.rule)  # `fresh` took a sliding group only


class ChunkedTable(_WindowTable):
    """A chunked group (a query reads its own page-aligned chunk of C tokens, `ChunkedRule`): a
    sequence keeps its current chunk's pages, all released at once when the next chunk starts; a
    prefix hit needs the pages of its last chunk, so one ending on a chunk boundary is none."""

    kind = AttentionKind.CHUNKED

    @functools.cached_property
    def rule(self) -> ChunkedRule:
        return cast("ChunkedRule", self.group.rule)  # `fresh` took a chunked group only


ALLOCATORS: Mapping[AttentionKind, type[GroupTable]] = {
    table.kind: table for table in (FullAttentionTable, SlidingWindowTable, ChunkedTable)}


def allocator_for(group: LayerGroup, **fields: Any) -> GroupTable:
    """A fresh allocator of the class `ALLOCATORS` names for ``group``'s attention kind
    (``fields``: `GroupTable.fresh`'s keywords)."""
    return ALLOCATORS[group.attention].fresh(group, **fields)


__all__ = ["ALLOCATORS", "ChunkedTable", "FullAttentionTable", "SlidingWindowTable", "allocator_for"]
