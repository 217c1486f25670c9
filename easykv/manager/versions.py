"""Weight versions: a prefix cache that never serves K/V computed by other weights.

An RL loop generates rollouts, updates the weights, and generates again; K/V cached under the
old weights would be silently wrong for the new ones (a stale prefix hit corrupts logprobs).
`set_weight_version(v)` roots every new sequence's page digests in ``v``
(`prefix_hash.version_root`), so a lookup under one version never finds a page another version
wrote. Sequences already running keep their version and their pages and finish; their pages, and
every cached page of another version, are evicted before the current version's. A sequence takes
the version current when it starts: when it is claimed, or when a version is set before it
holds anything. Setting an earlier version again makes its still-cached pages findable again
(the caller says the weights are those again).

`reset_prefix_cache()` empties the prefix cache at any time, also with sequences running: their
pages stay theirs, only the lookup forgets them.

This module holds the `VersionLog` (the versions and the prefix lookups counted under each) and its
metrics; it imports ``prefix_hash`` only of the manager (each row's version is the sequence table's,
each page's the pool's), and never ``storage``, ``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from easykv.manager.prefix_hash import version_digest, version_root

if TYPE_CHECKING:
    from easykv.manager.group_table import GroupTable
    from easykv.manager.sequences import SequenceTable
    from easykv.manager.tier_set import LowerTiers

WeightVersion: TypeAlias = int | str | bytes | None  # as the caller set it
VERSION_COUNTERS = ("prefix_queries", "prefix_hits", "prefix_hit_tokens")
LOOKUP_COUNTERS = ("prefix_queries", "prefix_hits", "prefix_query_tokens", "prefix_hit_tokens")


@dataclasses.dataclass(frozen=True)
class VersionMetrics:
    """One weight version's share of the manager: ``version`` as it was set (None: before any
    was set), whether it is the current one, the pages its running sequences hold and the
    cached pages it wrote (over every layer group's pool; ``host_cached_pages``: those in the
    tiers below the device, the host-memory tier's), and its prefix lookups.

    Attributes:
      version: the version as it was set (None: before any was set).
      current: whether it is the current version.
      live_pages: distinct pages held by its running sequences, summed over the groups.
      cached_pages: unreferenced pages of the prefix cache it wrote.
      prefix_queries: prefix lookups run under it.
      prefix_hits: those that found at least one cached page.
      prefix_hit_tokens: prompt tokens they found cached.
      host_cached_pages: its pages in the prefix caches of the tiers below the device (the host
        tier's, and any other tier's `LowerTier.cached_tags`; 0 without one).
    """

    version: Any
    current: bool
    live_pages: int
    cached_pages: int
    prefix_queries: int
    prefix_hits: int
    prefix_hit_tokens: int
    host_cached_pages: int = 0


class VersionLog:
    """The weight versions of one manager and the prefix lookups run under them.

    Owns ``current`` (the current version's digest; None: never set), ``labels`` (digest -> the
    version as it was set, in order of first use), ``counters`` (digest -> its lookups,
    `VERSION_COUNTERS`) and ``lookups`` (every lookup's totals, `LOOKUP_COUNTERS`).
    """

    def __init__(self) -> None:
        self.current: bytes | None = None
        self.labels: dict[bytes | None, WeightVersion] = {None: None}
        self.counters: dict[bytes | None, dict[str, int]] = {None: dict.fromkeys(VERSION_COUNTERS, 0)}
        self.lookups: dict[str, int] = dict.fromkeys(LOOKUP_COUNTERS, 0)

    @property
    def weight_version(self) -> WeightVersion:
        return self.labels[self.current]

    @property
    def versioned(self) -> bool:
        """Whether a version was ever set (only then do states and metrics carry versions)."""
        return len(self.labels) > 1

    def set(self, version: WeightVersion) -> bool:
        """Make ``version`` current; False when it already is (ValueError before anything changes
        for a version that cannot be hashed alike on every host)."""
        digest = version_digest(version)
        if digest == self.current:
            return False
        if digest not in self.labels:
            self.labels[digest] = version
            self.counters[digest] = dict.fromkeys(VERSION_COUNTERS, 0)
        self.current = digest
        return True

    def root(self) -> bytes:
        """The parent digest of a new sequence's first page under the current version."""
        return version_root(self.current)

    def count_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """A prefix lookup of ``query_tokens`` that found ``hit_tokens`` cached."""
        totals, mine = self.lookups, self.counters[self.current]
        for c in (totals, mine):
            c["prefix_queries"] += 1
            c["prefix_hits"] += bool(hit_tokens)
            c["prefix_hit_tokens"] += hit_tokens
        totals["prefix_query_tokens"] += query_tokens

    def known(self) -> Iterator[tuple[bytes | None, WeightVersion, dict[str, int]]]:
        """(digest, version as set, lookups) of every known version, in order of first use."""
        for digest, label in self.labels.items():
            yield digest, label, self.counters[digest]

    def load(self, current: bytes | None, known: dict[bytes | None, tuple[WeightVersion, dict[str, int]]],
             lookups: dict[str, int]) -> None:
        """The versions of a loaded state (checked: every version hashes to its digest)."""
        self.current = current
        self.labels = {d: label for d, (label, _) in known.items()}
        self.counters = {d: c for d, (_, c) in known.items()}
        self.lookups = {k: lookups[k] for k in LOOKUP_COUNTERS}

    def metrics(self, seqs: SequenceTable, groups: Sequence[GroupTable],
                tiers: LowerTiers) -> tuple[VersionMetrics, ...]:
        """Per known version (in order of first use; the unversioned one only while it holds or
        counts anything or is current); empty while no version was ever set (the counts walk
        every page, so a manager without versions does not pay for them in `metrics`)."""
        if not self.versioned:
            return ()
        versions = list(self.labels)
        index = {v: i for i, v in enumerate(versions)}
        live = np.zeros(len(versions), np.int64)
        cached = np.zeros(len(versions), np.int64)
        host = np.zeros(len(versions), np.int64)
        rows = np.flatnonzero(seqs.active)
        of_row = np.array([index[seqs.version[r]] for r in rows.tolist()], np.int64)
        for table in groups:
            for i in np.unique(of_row).tolist():
                pages = table.table[rows[of_row == i]]
                live[i] += np.unique(pages[pages >= 0]).size
            for tag in table.pool.cached_tags():
                cached[index[tag]] += 1
        for tag in tiers.cached_tags():
            host[index[tag]] += 1
        out = []
        for i, v in enumerate(versions):
            counters = self.counters[v]
            if v is None and v != self.current and not (live[i] or cached[i] or host[i] or any(counters.values())):
                continue
            out.append(VersionMetrics(version=self.labels[v], current=v == self.current, live_pages=int(live[i]),
                                      cached_pages=int(cached[i]), host_cached_pages=int(host[i]), **counters))
        return tuple(out)


__all__ = ["LOOKUP_COUNTERS", "VERSION_COUNTERS", "VersionLog", "VersionMetrics", "WeightVersion"]
