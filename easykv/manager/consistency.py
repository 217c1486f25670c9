"""The one checker of a page manager's consistency, for a live manager
(`PageManager.check_invariants`: a broken rule is an easykv bug) and for one built from a saved
state (`PageManager.from_state_dict`: a broken rule is bad input). `Broken` names the state field
a rule concerns.

Each part's rules are checked on their own (`SequenceTable.check`, `group_checks.check_group`,
each lower tier's `LowerTier.check`); this module runs them in order and holds the rule that spans the
sequence table and every group's prefix cache (chain digests). It imports neither the manager
(manager.py) nor ``state`` (the manager imports it), and never ``storage``, ``attention``,
``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from easykv.manager.broken import Broken
from easykv.manager.group_checks import check_group
from easykv.manager.prefix_hash import iter_page_digests, version_root
from easykv.step.metadata import PAD_PAGE

if TYPE_CHECKING:
    from easykv.manager.coordinator import GroupCoordinator
    from easykv.manager.parts import ManagerParts
    from easykv.manager.sequences import SequenceTable


def check_consistency(parts: ManagerParts) -> None:
    """Raise `Broken` unless the parts' bookkeeping is consistent (see `PageManager.check_invariants`)."""
    seqs, groups, tiers = parts.seqs, parts.groups, parts.tiers
    swapped = tiers.held_mask(seqs.batch_size)  # rows a tier holds (swapped out): nothing on the device
    seqs.check(swapped, all_windowed=groups.all_windowed, released=groups.fewest_released(seqs.lens))
    for table in groups:
        check_group(table, seqs, swapped, caching=parts.caching, scrub=parts.scrub)
        tiers.check(table.index, table, seqs)
    _check_chains(seqs, groups, caching=parts.caching)


def _check_chains(seqs: SequenceTable, groups: GroupCoordinator, *, caching: bool) -> None:
    """A hashing sequence's chain digest is its last full page's digest (in every group whose
    prefix cache holds that page), or the root of its weight version before its first full page.
    Where it knows its ids from position 0, they give its chain and name every full page it holds
    in the prefix cache."""
    ps, hashes = seqs.page_size, seqs.hashes
    for row in np.flatnonzero(seqs.active & hashes.hashable).tolist():
        full = int(seqs.lens[row]) // ps
        chain, root = hashes.chain[row], version_root(seqs.version[row])
        if full == 0 and chain != root:
            raise Broken(f"sequences[id={row}].chain", f"sequence {row} has no full page but a chain digest "
                                                      "other than the root of its weight version")
        digests: list[bytes | None] = [None] * full
        if full:
            digests[-1] = chain
        if caching and hashes.known[row] == 0:
            digests = list(iter_page_digests(hashes.log[row, : full * ps], ps, full, hashes.salt[row], root))
        for table in groups:
            for col, want in enumerate(digests):
                page = int(table.table[row, col])
                digest = table.pool.digest_of(page) if want is not None and page != PAD_PAGE else None
                if digest is not None and digest != want:  # released from the window, or not cached: not checkable
                    raise Broken(f"sequences[id={row}].chain", f"sequence {row}'s chain digest differs from the digest "
                                                              f"of its full page {page} (column {col})")
        if full and digests[-1] != chain:
            raise Broken(f"sequences[id={row}].chain", f"sequence {row}'s chain digest is not the one its token ids "
                                                      "give")


__all__ = ["Broken", "check_consistency"]
