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

``_Versions`` is a mixin of `PageManager` (manager.py): its methods read and change the
manager's rows, pools and counters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from easykv.manager.prefix_hash import version_digest, version_root

VERSION_COUNTERS = ("prefix_queries", "prefix_hits", "prefix_hit_tokens")


@dataclasses.dataclass(frozen=True)
class VersionMetrics:
    """One weight version's share of the manager: ``version`` as it was set (None: before any
    was set), whether it is the current one, the pages its running sequences hold and the
    cached pages it wrote (over every layer group's pool; ``host_cached_pages``: those in the
    host-memory tier), and its prefix lookups."""

    version: Any
    current: bool
    live_pages: int
    cached_pages: int
    prefix_queries: int
    prefix_hits: int
    prefix_hit_tokens: int
    host_cached_pages: int = 0


class _Versions:
    """`PageManager`'s weight versions and prefix-cache reset (see the module doc)."""

    def _init_versions(self) -> None:
        self._version: bytes | None = None  # the current version's digest
        self._versions: dict[bytes | None, Any] = {None: None}  # digest -> the version as set, in order of first use
        self._version_counters: dict[bytes | None, dict[str, int]] = {None: dict.fromkeys(VERSION_COUNTERS, 0)}
        self._row_version: list[bytes | None] = [None] * self.batch_size

    @property
    def weight_version(self) -> Any:
        """The current weight version as it was set (None: never set)."""
        return self._versions[self._version]

    def set_weight_version(self, version: Any) -> None:
        """Make ``version`` (an int of up to 64 bits, a str or bytes: hashed alike on every
        host) the weights new sequences run with. From now on prefix lookups find only pages
        written under ``version``; running sequences finish under theirs, and cached pages of
        other versions are evicted first. Sequences claimed but not yet started take
        ``version``. Setting the current version again changes nothing."""
        digest = version_digest(version)  # ValueError before anything changes
        if digest == self._version:
            return
        if digest not in self._versions:
            self._versions[digest] = version
            self._version_counters[digest] = dict.fromkeys(VERSION_COUNTERS, 0)
        self._version = digest
        root = version_root(digest)
        for row in np.flatnonzero(self._active & (self._lens == 0) & (self._npages == 0)).tolist():
            self._row_version[row] = digest
            self._hashes.chain[row] = root
        for gt in self._groups:
            gt.pool.demote(digest)
            if gt.host is not None:
                gt.host.demote(digest)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix now, also with sequences running (they keep their pages;
        pages they fill from now on are cached again as usual). Cached pages become free
        (scrubbed first when the manager scrubs). Returns how many pages the prefix cache
        held, over every layer group (the host tier's included)."""
        held = 0
        for gt in self._groups:
            held += gt.pool.forget_prefixes()
            if gt.host is not None:
                gt.drop_freed_onloads()
                held += gt.host.forget_prefixes()
                # Offloads still pending land as plain pages: their digests are forgotten too.
                gt.offloads = {h: (page, None, None) for h, (page, _, _) in gt.offloads.items()}
        return held

    # ---- helpers for the manager -----------------------------------------------------------------
    def _root(self) -> bytes:
        """The parent digest of a new sequence's first page under the current version."""
        return version_root(self._version)

    def _start_row(self, row: int) -> None:
        """A freshly claimed row runs under the current version."""
        self._row_version[row] = self._version
        self._hashes.reset(row, self._root())

    def _is_stale(self, row: int) -> bool:
        return self._row_version[row] != self._version

    def _count_lookup(self, tokens: int, hit_tokens: int) -> None:
        c = self._version_counters[self._version]
        c["prefix_queries"] += 1
        c["prefix_hits"] += bool(hit_tokens)
        c["prefix_hit_tokens"] += hit_tokens

    def _version_metrics(self) -> tuple[VersionMetrics, ...]:
        """Per known version (in order of first use; the unversioned one only while it holds or
        counts anything or is current); empty while no version was ever set (the counts walk
        every page, so a manager without versions does not pay for them in `metrics`)."""
        if len(self._versions) == 1:
            return ()
        versions = list(self._versions)
        index = {v: i for i, v in enumerate(versions)}
        live = np.zeros(len(versions), np.int64)
        cached = np.zeros(len(versions), np.int64)
        host = np.zeros(len(versions), np.int64)
        rows = np.flatnonzero(self._active)
        of_row = np.array([index[self._row_version[r]] for r in rows.tolist()], np.int64)
        for gt in self._groups:
            for i in np.unique(of_row).tolist():
                pages = gt.table[rows[of_row == i]]
                live[i] += np.unique(pages[pages >= 0]).size
            for tag in gt.pool.cached_tags():
                cached[index[tag]] += 1
            for tag in gt.host.cached_tags() if gt.host is not None else ():
                host[index[tag]] += 1
        out = []
        for i, v in enumerate(versions):
            counters = self._version_counters[v]
            if v is None and v != self._version and not (live[i] or cached[i] or host[i] or any(counters.values())):
                continue
            out.append(VersionMetrics(version=self._versions[v], current=v == self._version, live_pages=int(live[i]),
                                      cached_pages=int(cached[i]), host_cached_pages=int(host[i]), **counters))
        return tuple(out)


__all__ = ["VERSION_COUNTERS", "VersionMetrics"]
