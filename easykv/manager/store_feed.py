"""What a shared prefix store above the manager (`easykv.tiers.store`) reads of it and gives it: the
digests a prompt's lookup tries (`prompt_digests`), the prefix pages sequences filled and the host pages
the host tier evicted since it last asked (`take_events`, a `PrefixEvents`). The store holds no manager
state: it keys its values by these digests and hands pages it fetched to the host tier
(`HostTierLayer.adopt`), where the manager's own lookups find them.

Coordinator code over the parts it is handed. Imports the manager's ``prefix_hash``; never ``storage``,
``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from easykv.manager.page_pool import JOURNAL_LIMIT  # noqa: F401 (named in the docs)
from easykv.manager.prefix_hash import iter_page_digests, salt_digest

if TYPE_CHECKING:
    from easykv.manager.coordinator import GroupCoordinator
    from easykv.manager.host_tier import HostTierLayer
    from easykv.manager.versions import VersionLog


@dataclasses.dataclass(frozen=True)
class PrefixEvents:
    """Prefix pages that changed place since the store last asked (`PageManager.take_prefix_events`).

    Attributes:
      written: per layer group, ``(device page, digest)`` of each page a sequence filled and entered in the
        device's prefix map, in commit order (while watched with ``written=True``). Its data are on the
        device from the step that wrote it on.
      host_evicted: per layer group, ``(host page, digest)`` of each host page the host tier evicted (while
        watched with ``host_evicted=True``): its data stay in the `HostTier` until the next work lands there.
      dropped: entries dropped so far, in all (a journal nobody drains keeps its newest `JOURNAL_LIMIT`).
    """

    written: tuple[tuple[tuple[int, bytes], ...], ...]
    host_evicted: tuple[tuple[tuple[int, bytes], ...], ...]
    dropped: int = 0

    @property
    def empty(self) -> bool:
        """No page in any group."""
        return not (any(self.written) or any(self.host_evicted))


def prompt_digests(groups: GroupCoordinator, versions: VersionLog, tokens: np.ndarray, salt: Any) -> tuple[bytes, ...]:
    """The digests of the full pages of ``tokens`` a lookup tries, under the current weight version: every full
    page but one holding the last token (`PageManager.match_prefix` always computes that one)."""
    ps = groups[0].page_size
    return tuple(iter_page_digests(tokens, ps, max(tokens.size - 1, 0) // ps, salt_digest(salt), versions.root()))


def watch(groups: GroupCoordinator, host: HostTierLayer | None, *, written: bool, host_evicted: bool) -> None:
    """Keep (or stop keeping) the journals `take_events` drains."""
    for table in groups:
        table.pool.set_journal(written)
    if host is not None:
        host.watch_evictions(host_evicted)


def take_events(groups: GroupCoordinator, host: HostTierLayer | None) -> PrefixEvents:
    """Drain the journals (`PrefixEvents`)."""
    written = tuple(tuple(table.pool.take_written()) for table in groups)
    evicted: tuple[tuple[tuple[int, bytes], ...], ...] = tuple(() for _ in groups)
    dropped = sum(table.pool.journal_dropped for table in groups)
    if host is not None:
        evicted = tuple(tuple((page, digest) for page, digest, _ in part) for part in host.take_evicted())
        dropped += sum(part.pool.journal_dropped for part in host.parts)
    return PrefixEvents(written=written, host_evicted=evicted, dropped=dropped)


__all__ = ["PrefixEvents", "prompt_digests", "take_events", "watch"]
