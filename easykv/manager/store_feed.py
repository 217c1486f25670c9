"""What a shared prefix store above the manager (`easykv.tiers.store`) reads of it and gives it: the
digests a prompt's lookup tries (`prompt_digests`), the prefix pages sequences filled and the host pages
the host tier evicted since it last asked (`take_events`, a `PrefixEvents`). The store holds no manager
state: it keys its values by these digests and hands pages it fetched to the host tier
(`HostTierLayer.adopt`), where the manager's own lookups find them.

Coordinator code over the parts it is handed, and the `PageManager` members that use it (`SharedStoreMethods`).
Imports the manager's ``prefix_hash``, ``page_pool`` and ``host_tier``; never ``storage``, ``attention``,
``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from easykv.manager.host_tier import require_host
from easykv.manager.page_pool import JOURNAL_LIMIT  # noqa: F401 (named in the docs)
from easykv.manager.prefix_hash import as_token_ids, iter_page_digests, salt_digest
from easykv.validation import boolean, non_negative_int

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


def chain_digests(groups: GroupCoordinator, versions: VersionLog, tokens: np.ndarray, salt: Any) -> tuple[bytes, ...]:
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


class SharedStoreMethods:
    """`PageManager`'s members for a shared prefix store above it (`easykv.tiers.store`); ``_groups``, ``_host``,
    ``_versions`` are the manager's parts."""

    _groups: GroupCoordinator
    _host: HostTierLayer | None
    _versions: VersionLog

    def prompt_digests(self, token_ids: Sequence[int] | np.ndarray, *, salt: Any = None) -> tuple[bytes, ...]:
        """The 32-byte digests of the full pages of ``token_ids`` that `match_prefix` looks up (all but a page
        holding the last token), under the current weight version: the keys a shared prefix store uses.

        Args:
          token_ids: the prompt, ``(prompt_len,)`` ints in ``0 .. 2**31 - 1``.
          salt: the prefix namespace, as `match_prefix`'s."""
        return chain_digests(self._groups, self._versions, as_token_ids(token_ids), salt)

    def adopt_host_prefixes(self, digests: Sequence[bytes], *, replica: int | None = None) -> tuple[list[int], ...]:
        """Host pages for the pages of a prefix chain a shared store holds, entered in the host tier's prefix map
        (so `match_prefix` finds them there and onloads them): per layer group, for the longest run
        ``digests[:k]`` that fits in every group, a host page, or -1 where ``replica``'s device or host pool holds
        that digest already. The caller writes each page's data into the `HostTier` before any work reads it (the
        runner's store does). ValueError without a host tier or for a digest that is not 32 bytes.

        Args:
          digests: consecutive page digests of one chain (`prompt_digests`), in order.
          replica: the data-parallel replica whose host pool takes them (None: the one with the most available
            device pages, where a new sequence goes)."""
        host = require_host(self._host, "adopt_host_prefixes")
        chain = [bytes(d) if isinstance(d, (bytes, bytearray)) else d for d in digests]
        for i, d in enumerate(chain):
            if not isinstance(d, bytes) or len(d) != 32:
                raise ValueError(f"digests[{i}]={d!r} is not a 32-byte page digest; pass what prompt_digests returns")
        n = self._groups.num_replicas
        if replica is None:
            replica = self.admission_replica
        replica = non_negative_int("replica", replica)
        if replica >= n:
            raise ValueError(f"replica={replica} is not a data-parallel replica of this pool (0 .. {n - 1})")
        return host.adopt(self._groups, replica, chain, self._versions.current)

    @property
    def admission_replica(self) -> int:
        """The data-parallel replica whose slice a prefix hit of a new sequence lands in when no replica holds more of
        it: the one with the most available device pages (its tightest group's; the lowest index on a tie), where
        `adopt_host_prefixes` places a chain by default. The same on every host."""
        return int(np.argmax(self._groups.available_per_replica()))

    def watch_prefixes(self, *, written: bool, host_evicted: bool) -> None:
        """Keep, for `take_prefix_events`, the prefix pages sequences fill (``written``) and the host pages the host
        tier evicts (``host_evicted``), from now on; False stops keeping them (and drops what was kept).

        Args:
          written: keep the filled pages (a store's ``write_through``).
          host_evicted: keep the host tier's evictions (a store's ``write_back``; needs a host tier)."""
        written, host_evicted = boolean("written", written), boolean("host_evicted", host_evicted)
        if host_evicted:
            require_host(self._host, "watch_prefixes(host_evicted=True)")
        watch(self._groups, self._host, written=written, host_evicted=host_evicted)

    def take_prefix_events(self) -> PrefixEvents:
        """The prefix pages filled and the host pages evicted since the last call (`PrefixEvents`), as
        `watch_prefixes` asked."""
        return take_events(self._groups, self._host)


__all__ = ["PrefixEvents", "SharedStoreMethods", "chain_digests", "take_events", "watch"]
