"""The snapshots `PageManager.metrics` returns: one per layer group's pool, and the whole manager's
(pools, prefix cache, weight versions, the tiers below the device), taken by `snapshot`, which asks
every part for what it counts. Plain frozen dataclasses; the per-version and host-tier ones live
with their parts (`versions`, `host_tier`), the only modules of the manager this one imports at run
time; each lower tier gives its own (`LowerTier.metrics`). It never imports ``storage``,
``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from easykv.manager.host_tier import HostTierMetrics
from easykv.manager.versions import VersionMetrics

if TYPE_CHECKING:
    from easykv.manager.parts import ManagerParts


@dataclasses.dataclass(frozen=True)
class SequenceInfo:
    """A snapshot of one claimed sequence (`PageManager.sequence`).

    Attributes:
      seq_id: its id.
      length: committed tokens [MAX: cache_length].
      capacity: tokens its pages can hold (committed plus reserved ahead).
      replica: the data-parallel replica whose slice of the pool holds its pages (None: unbound).
      swapped: whether it is swapped out to the host tier.
      planned: whether an open plan holds it (it changes only through that plan's commit or abort).
      first_kept: per layer group, the first position whose K/V it holds and its next query may read
        (0 in a full-attention group; where its window starts in a sliding or chunked one, or a
        resumed sequence's first position while a window still reaches before it).
    """

    seq_id: int
    length: int
    capacity: int
    replica: int | None
    swapped: bool
    planned: bool
    first_kept: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class GroupPoolMetrics:
    """A snapshot of one layer group's pool (its own page ids).

    Attributes:
      total_pages: pages of the pool.
      free_pages: pages unreferenced and holding no cached prefix.
      cached_pages: unreferenced pages kept for prefix reuse.
      used_pages: pages referenced by at least one sequence.
      evictions: cached pages evicted from the prefix cache to be allocated, since creation.
    """

    total_pages: int
    free_pages: int
    cached_pages: int
    used_pages: int
    evictions: int


@dataclasses.dataclass(frozen=True)
class PageManagerMetrics:
    """A snapshot of the pools and the prefix cache (counters are totals since creation).
    Page counts add up every layer group's pool; ``groups`` has each pool on its own.

    Attributes:
      total_pages: pages of the pools.
      free_pages: pages unreferenced and holding no cached prefix.
      cached_pages: unreferenced pages kept for prefix reuse.
      used_pages: pages referenced by at least one sequence.
      active_sequences: claimed sequence ids (swapped-out ones included).
      prefix_queries: `match_prefix` lookups (with ``enable_prefix_caching``).
      prefix_hits: lookups that found at least one cached page.
      prefix_query_tokens: prompt tokens looked up.
      prefix_hit_tokens: prompt tokens found cached (whole pages), which need no prefill.
      evictions: cached pages evicted from the prefix cache to be allocated.
      copies: copy-on-write page copies recorded.
      scrubs: released pages marked for zeroing (``scrub_released`` only).
      groups: one `GroupPoolMetrics` per layer group.
      versions: one `VersionMetrics` per weight version (`set_weight_version`); empty while
        none was ever set.
      host: the host-memory tier's `HostTierMetrics` (None without one).
      open_plans: step plans scheduled and not ended yet (`PageManager.commit` / `abort` end one).
      tiers: each tier below the device pool's own snapshot (`LowerTier.metrics`), nearest first:
        the host tier's (also ``host``), then those of ``PageManager(tiers=...)``.
    """

    total_pages: int
    free_pages: int
    cached_pages: int  # unreferenced, kept for prefix reuse, evicted when memory is needed
    used_pages: int
    active_sequences: int
    prefix_queries: int
    prefix_hits: int  # queries that reused at least one page
    prefix_query_tokens: int
    prefix_hit_tokens: int  # prompt tokens that needed no prefill
    evictions: int
    copies: int  # copy-on-write page copies reported
    scrubs: int  # released pages reported for zeroing
    groups: tuple[GroupPoolMetrics, ...] = ()
    versions: tuple[VersionMetrics, ...] = ()  # per weight version (`set_weight_version`)
    host: HostTierMetrics | None = None  # the host-memory tier (None without one)
    open_plans: int = 0  # step plans not committed or aborted yet
    tiers: tuple[object, ...] = ()  # each lower tier's snapshot, nearest the device first

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by running sequences (cached pages count as free)."""
        return self.used_pages / self.total_pages

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def snapshot(parts: ManagerParts) -> PageManagerMetrics:
    """The metrics of a manager's ``parts`` now: each part counts what it owns."""
    pools = [table.pool for table in parts.groups]
    tiers = parts.tiers.metrics()
    groups = tuple(GroupPoolMetrics(total_pages=p.num_pages, free_pages=p.num_free(), cached_pages=p.num_cached(),
                                    used_pages=p.num_used(), evictions=p.evictions) for p in pools)
    total = {f: sum(getattr(m, f) for m in groups) for f in ("total_pages", "free_pages", "cached_pages",
                                                              "used_pages", "evictions")}
    return PageManagerMetrics(**total, active_sequences=int(parts.seqs.active.sum()),
                              scrubs=sum(p.scrubs for p in pools), groups=groups,
                              versions=parts.versions.metrics(parts.seqs, parts.groups, parts.tiers),
                              host=next((m for m in tiers if isinstance(m, HostTierMetrics)), None),
                              **parts.versions.lookups, copies=parts.copies.copies,
                              open_plans=len(parts.seqs.open_plans), tiers=tiers)


__all__ = ["GroupPoolMetrics", "PageManagerMetrics", "SequenceInfo", "snapshot"]
