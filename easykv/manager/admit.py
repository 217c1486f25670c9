"""How a freshly claimed sequence starts: on the cached pages of its prompt's prefix
(`match_prefix`, on the device or brought back from a tier below it), or in the middle of a
sequence whose earlier tokens this cache will never hold (`resume`).

Coordinator code over the parts it is handed (the sequence table, the group allocators, the version
log, the lower tiers, asked through their interface). Imports ``prefix_hash`` and ``validation``;
never ``storage``, ``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from easykv.manager.prefix_hash import salt_digest
from easykv.step.metadata import PAD_PAGE
from easykv.validation import integer

if TYPE_CHECKING:
    from easykv.manager.coordinator import GroupCoordinator
    from easykv.manager.sequences import SequenceTable
    from easykv.manager.tier_set import LowerTiers
    from easykv.manager.versions import VersionLog


def match_prefix(seqs: SequenceTable, groups: GroupCoordinator, versions: VersionLog, tiers: LowerTiers,
                 row: int, tokens: np.ndarray, salt: Any, *, caching: bool) -> int:
    """`PageManager.match_prefix` of the claimed ``row``; returns the prompt tokens found cached."""
    tiers.refuse_held(row, "match_prefix")
    seqs.check_fresh(row, "call match_prefix right after claim, before reserving or committing tokens")
    seqs.check_extent(row, tokens.size, "the prompt")
    salt_d = salt_digest(salt)
    seqs.start(row, versions.current, versions.root(), salt_d)  # the version current now, whenever it was claimed
    if not caching:
        return 0
    bound = int(seqs.replica[row])
    replica, pages, chain = groups.lookup(tokens, salt_d, versions.root(), bound)
    if tiers and not _room_for_tier_hits(groups, replica, pages):  # no device room to bring them back
        replica, pages, chain = groups.lookup(tokens, salt_d, versions.root(), bound, tiers=False)
    ps, k = seqs.page_size, len(pages[0])
    versions.count_lookup(int(tokens.size), k * ps)
    if k:
        _attach(groups, tiers, row, replica, pages)
        seqs.start_on_prefix(row, k, replica, chain, tokens)  # the log holds every committed id
        groups.release_out_of_window(seqs, np.array([row]), versions.current)
    return k * ps


def _room_for_tier_hits(groups: GroupCoordinator, replica: int, pages: list[list[int]]) -> bool:
    """Whether every group has device pages for the lower tiers' part of a hit (``pages``: per
    group, as `GroupCoordinator.lookup` found them), once its device part (cached pages among them)
    is shared."""
    for table, group_pages in zip(groups, pages):
        below = sum(p < PAD_PAGE for p in group_pages)
        cached = sum(1 for p in group_pages if p >= 0 and table.pool.refcount[p] == 0)
        if below and below > table.pool.num_available(replica) - cached:
            return False
    return True


def _attach(groups: GroupCoordinator, tiers: LowerTiers, row: int, replica: int, pages: list[list[int]]) -> None:
    """In every group, ``row`` holds the pages of a hit (``pages``: per group, as
    `GroupCoordinator.lookup` found them) of ``replica``; the lower tiers' pages of the hit get
    device pages and onloads (`LowerTiers.attach_hit`)."""
    starts = [group_pages.count(PAD_PAGE) for group_pages in pages]  # a window needs only its pages
    for table, group_pages in zip(groups, pages):
        table.pool.share([p for p in group_pages if p >= 0])
    if tiers:
        tiers.attach_hit(replica, pages, groups)
    for table, group_pages, start in zip(groups, pages, starts):
        table.hold(row, start, group_pages[start:])


def cached_prefix_length(groups: GroupCoordinator, versions: VersionLog, tokens: np.ndarray, salt: Any) -> int:
    """`PageManager.cached_prefix_length` (prefix caching on)."""
    return len(groups.lookup(tokens, salt_digest(salt), versions.root(), -1)[1][0]) * groups[0].page_size


def resume(seqs: SequenceTable, groups: GroupCoordinator, tiers: LowerTiers, row: int, first_position: Any) -> None:
    """`PageManager.resume` of the claimed ``row``."""
    tiers.refuse_held(row, "resume")
    pos = integer("first_position", first_position, lo=0, hi=seqs.max_length - 1,
                  hint=f"a position of a sequence of at most max_sequences={seqs.max_length} tokens")
    seqs.check_fresh(row, "resume right after claim")
    full = [g for g, table in enumerate(groups) if not table.windowed]
    if pos and full:
        single = len(groups) == 1
        where = "this full-attention cache" if single else f"layer group {full[0]} (full attention)"
        raise ValueError(f"resume(first_position={pos}) needs a sliding or chunked cache"
                         f"{'' if single else ' in every layer group'}: in {where} every query reads from "
                         "position 0, so a sequence must hold all its tokens")
    col = pos // seqs.page_size
    if not col:
        return
    start = col * seqs.page_size
    # A floor matters only while some window still reaches before it; a chunk that starts at the
    # resumed page is already past it (the state would then be refused: its window passed the floor).
    floor = start if groups.fewest_released(np.array([start]))[0] < col else 0
    # A row with columns is bound; the emptiest slice.
    replica = int(np.argmax(groups.available_per_replica()))
    for table in groups:
        table.hold(row, col, [])
    seqs.resume_at(row, col, floor, replica)


__all__ = ["cached_prefix_length", "match_prefix", "resume"]
