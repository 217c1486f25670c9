"""Re-splitting a manager state over another number of data-parallel replicas (restoring a
checkpoint onto another mesh): the same pages, other slices.

Each replica owns the slice ``[r * n, (r + 1) * n)`` of every layer group's page ids (``n`` the
group's pool over the replicas). A sequence's pages, in every group, and a pending copy-on-write
pair must lie in one slice of the target, else ValueError. Free and cached pages move to the
slice that now holds them; where two old slices cached the same prefix, the new slice keeps one
page per digest (the lowest used page, else the least recently released cached one) and the
others lose their digest (scrubbed before reuse when the manager scrubs).

It works on the JSON state alone: it imports no other module of the manager, and never ``storage``,
``attention``, ``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np

from easykv.step.metadata import PAD_PAGE


def reshard_state(saved: Mapping[str, Any], new_shards: int) -> dict[str, Any]:
    """A (validated, canonical) state for ``new_shards`` page slices instead of its own (see the
    module doc). Format 1 (one group) and format 2 (several) alike."""
    state = copy.deepcopy(dict(saved))
    cfg = state["config"]
    old_shards = cfg["page_shards"]
    if old_shards == new_shards:
        return state
    grouped = "groups" in cfg
    sizes = [g["num_pages"] for g in cfg["groups"]] if grouped else [cfg["num_pages_per_layer"]]

    def rows(seq: dict[str, Any]) -> list[list[int]]:
        return seq["pages"] if grouped else [seq["pages"]]

    def what(g: int) -> str:
        of = f" of layer group {g}" if grouped else ""
        return (f"the target splits the pool{of} of {sizes[g]} pages into {new_shards} data-parallel slices of "
                f"{sizes[g] // new_shards} pages (saved with {old_shards})")

    for seq in state["sequences"]:
        reps: dict[int, int] = {}  # replica -> the first group holding a page there
        for g, row in enumerate(rows(seq)):
            for page in row:
                if page != PAD_PAGE:  # holes: released from a window
                    reps.setdefault(page // (sizes[g] // new_shards), g)
        if len(reps) > 1:
            g = max(reps.values())
            raise ValueError(
                f"{what(g)}, which would put sequence {seq['id']}'s pages {seq['pages']} in replicas {sorted(reps)}; a "
                f"sequence's pages must stay in one replica's slice. Use page_shards={old_shards} (or a divisor of "
                "it), or release/export that sequence first")
        if reps:
            seq["replica"] = next(iter(reps))
        elif seq["replica"] >= 0:  # every page it held left the window: it stays where its slice now lies
            seq["replica"] = seq["replica"] * new_shards // old_shards
    pools = state["pool"] if grouped else [state["pool"]]
    copies = state["copies"] if grouped else [state["copies"]]
    for g, (pool, pending) in enumerate(zip(pools, copies)):
        per = sizes[g] // new_shards
        for src, dst in pending:
            if src // per != dst // per:
                raise ValueError(f"{what(g)}, which would split the pending copy-on-write of page {src} -> {dst} "
                                 f"across replicas; apply the manager's pending copies (apply_pending) first, or keep "
                                 f"page_shards={old_shards}")
        refcount = np.zeros(sizes[g], np.int64)
        for seq in state["sequences"]:
            pages = np.asarray(rows(seq)[g], np.int64)
            np.add.at(refcount, pages[pages != PAD_PAGE], 1)
        _reshard_pool(pool, refcount, per, new_shards, cfg["scrub_released"], state.get("versions", {}).get("current"))
    cfg["page_shards"] = new_shards
    return state


def _reshard_pool(pool: dict[str, Any], refcount: np.ndarray, per: int, new_shards: int, scrub_released: bool,
                  current: str | None) -> None:
    """One group's pool state (in place) for slices of ``per`` pages; cached pages of weight
    versions other than ``current`` (a digest's hex) stay ahead in each LRU."""
    digest_of = {int(p): d for p, d in pool["digests"]}
    lru_all = [int(p) for q in pool["lru"] for p in q]  # slice order, then each slice's LRU order
    lru_rank = {p: i for i, p in enumerate(lru_all)}
    keep: dict[tuple[int, str], int] = {}
    for page in sorted(digest_of, key=lambda p: (refcount[p] == 0, lru_rank.get(p, -1), p)):
        keep.setdefault((page // per, digest_of[page]), page)
    kept = set(keep.values())
    lru = [p for p in lru_all if p in kept]
    freed = [p for p in lru_all if p not in kept]
    free = sorted([int(p) for h in pool["free"] for p in h] + freed)
    scrub = list(pool["scrub"])
    if scrub_released:  # like an eviction: zero before reuse
        known = set(scrub)
        scrub += [p for p in freed if p not in known]
    tags = {int(p): t for p, t in pool.get("versions", [])}
    lru = sorted(lru, key=lambda p: tags.get(p) == current)  # stable: stale pages first, each kind in order
    pool["free"] = [[p for p in free if p // per == r] for r in range(new_shards)]
    pool["lru"] = [[p for p in lru if p // per == r] for r in range(new_shards)]
    pool["digests"] = [[p, d] for p, d in sorted(digest_of.items()) if p in kept]
    pool["scrub"] = scrub
    pool.pop("versions", None)
    if any(p in kept for p in tags):
        pool["versions"] = [[p, t] for p, t in sorted(tags.items()) if p in kept]


__all__ = ["reshard_state"]
