"""How a freshly claimed sequence starts: on the cached pages of its prompt's prefix
(`match_prefix`, on the device or brought back from the host tier), or in the middle of a
sequence whose earlier tokens this cache will never hold (`resume`).

Coordinator code over the parts it is handed (the sequence table, the group allocators, the version
log, the host-tier policy). Imports ``prefix_hash`` and ``validation``; never ``storage``,
``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from easykv.manager.prefix_hash import salt_digest
from easykv.step.metadata import PAD_PAGE
from easykv.validation import integer

if TYPE_CHECKING:
    from easykv.manager.coordinator import GroupCoordinator
    from easykv.manager.host_tier import HostTierPolicy
    from easykv.manager.sequences import SequenceTable
    from easykv.manager.versions import VersionLog


def match_prefix(seqs: SequenceTable, groups: GroupCoordinator, versions: VersionLog, host: HostTierPolicy,
                 row: int, tokens: np.ndarray, salt: Any, *, caching: bool) -> int:
    """`PageManager.match_prefix` of the claimed ``row``; returns the prompt tokens found cached."""
    host.refuse_swapped(row, "match_prefix")
    seqs.check_fresh(row, "call match_prefix right after claim, before reserving or committing tokens")
    seqs.check_extent(row, tokens.size, "the prompt")
    salt_d = salt_digest(salt)
    seqs.start(row, versions.current, versions.root())  # the version current now, whenever it was claimed
    seqs.hashes.salt[row] = salt_d
    if not caching:
        return 0
    bound = int(seqs.replica[row])
    replica, pages, chain = groups.lookup(tokens, salt_d, versions.root(), bound)
    if host.enabled and not host.hit_room(replica, pages, groups):  # no device room to bring them back
        replica, pages, chain = groups.lookup(tokens, salt_d, versions.root(), bound, host=False)
    ps, k = seqs.page_size, len(pages[0])
    versions.count_lookup(int(tokens.size), k * ps)
    if k:
        _attach(seqs, groups, host, row, replica, pages)
        seqs.hashes.chain[row] = chain
        seqs.hashes.record(row, tokens[: k * ps])  # the log holds every committed id
        groups.release_out_of_window(seqs, np.array([row]), versions.current)
    return k * ps


def _attach(seqs: SequenceTable, groups: GroupCoordinator, host: HostTierPolicy, row: int, replica: int,
            pages: list[list[int]]) -> None:
    """``row`` holds the ``k`` columns of a hit (``pages``: per group, as `GroupCoordinator.lookup`
    found them), bound to ``replica``; host pages of the hit get device pages and onloads."""
    k = len(pages[0])
    starts = [group_pages.count(PAD_PAGE) for group_pages in pages]  # a window needs only its pages
    for table, group_pages in zip(groups, pages):
        table.pool.share([p for p in group_pages if p >= 0])
    onloaded = host.attach_hits(replica, pages, groups) if host.enabled else 0
    for table, group_pages, start in zip(groups, pages, starts):
        table.table[row, :k] = group_pages
        table.start[row] = start
    seqs.npages[row] = k
    seqs.lens[row] = k * seqs.page_size
    seqs.replica[row] = replica
    host.count_hit(onloaded, seqs.page_size)


def cached_prefix_length(groups: GroupCoordinator, versions: VersionLog, tokens: np.ndarray, salt: Any) -> int:
    """`PageManager.cached_prefix_length` (prefix caching on)."""
    return len(groups.lookup(tokens, salt_digest(salt), versions.root(), -1)[1][0]) * groups[0].page_size


def resume(seqs: SequenceTable, groups: GroupCoordinator, host: HostTierPolicy, row: int, first_position: Any) -> None:
    """`PageManager.resume` of the claimed ``row``."""
    host.refuse_swapped(row, "resume")
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
    for table in groups:
        table.table[row, :col] = PAD_PAGE
        table.start[row] = col
    seqs.npages[row] = col
    seqs.lens[row] = col * seqs.page_size
    # A floor matters only while some window still reaches before it; a chunk that starts at the
    # resumed page is already past it (the state would then be refused: its window passed the floor).
    seqs.floor[row] = col * seqs.page_size if groups.fewest_released(seqs.lens[[row]])[0] < col else 0
    seqs.hashes.hashable[row] = False
    # A row with columns is bound; the emptiest slice.
    seqs.replica[row] = int(np.argmax(groups.available_per_replica()))


__all__ = ["cached_prefix_length", "match_prefix", "resume"]
