"""`ManagerParts`: the parts of one page manager, handed together to the code that reads or checks
all of them (`state`, `consistency`), so neither needs the `PageManager` itself.

Imports the parts' modules only (for their types); the manager (manager.py) builds the bundle,
nothing here imports it. It never imports ``storage``, ``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from easykv.manager.coordinator import GroupCoordinator
    from easykv.manager.device_work import CopyCounter
    from easykv.manager.sequences import SequenceTable
    from easykv.manager.tier_set import LowerTiers
    from easykv.manager.versions import VersionLog
    from easykv.spec.metadata import PagedAttentionCacheMetaData


@dataclasses.dataclass(frozen=True)
class ManagerParts:
    """One manager's parts (each owns its own fields: see its class; ``tiers``: the tiers below the
    device, asked through their interface) and its two flags:
    ``caching`` (prefix caching on) and ``scrub`` (released pages are zeroed)."""

    metadata: PagedAttentionCacheMetaData
    seqs: SequenceTable
    groups: GroupCoordinator
    versions: VersionLog
    tiers: LowerTiers
    copies: CopyCounter
    caching: bool
    scrub: bool


__all__ = ["ManagerParts"]
