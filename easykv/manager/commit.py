"""Committing tokens the device has written [MAX: step]: lengths advance, pages that became full
enter the prefix cache under their chained digest, and what left a window is released.

Coordinator code over the parts it is handed (the sequence table, the group allocators, the
lower tiers). Imports ``prefix_hash`` and ``validation``; never ``storage``, ``attention``,
``checkpoint`` or ``tiers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

import jax
import numpy as np

from easykv.manager.prefix_hash import as_token_ids
from easykv.validation import INT32_MAX, integer_array, is_scalar, show

if TYPE_CHECKING:
    from easykv.manager.coordinator import GroupCoordinator
    from easykv.manager.sequences import SequenceTable
    from easykv.manager.tier_set import LowerTiers

Tokens: TypeAlias = np.ndarray | list[np.ndarray] | None  # (n,) or (n, k) ids, one array per sequence, or unknown


def parse_tokens(token_ids: Any, n: int) -> tuple[np.ndarray, Tokens]:
    """`PageManager.step`'s ``token_ids`` for ``n`` sequences as (count per sequence, ids)."""
    if isinstance(token_ids, jax.Array):
        token_ids = np.asarray(token_ids)
    if not isinstance(token_ids, (list, tuple, np.ndarray)):
        raise ValueError(f"token_ids={show(token_ids)} is not a list or array; pass one id per sequence or one "
                         "list per sequence")
    if isinstance(token_ids, np.ndarray) or all(is_scalar(t) for t in token_ids):
        arr = integer_array("token_ids", token_ids, lo=0, hi=INT32_MAX, hint="token ids")
        if arr.ndim not in (1, 2) or arr.shape[0] != n:
            raise ValueError(f"token_ids has shape {arr.shape}; pass ({n},) or ({n}, k) ids for {n} sequences")
        return np.full(n, 1 if arr.ndim == 1 else arr.shape[1], np.int64), arr
    if len(token_ids) != n:
        raise ValueError(f"token_ids holds {len(token_ids)} entries for {n} sequences; pass one per sequence")
    lists = [as_token_ids(t, f"token_ids[{i}]") for i, t in enumerate(token_ids)]
    return np.array([t.size for t in lists], np.int64), lists


def commit_tokens(seqs: SequenceTable, groups: GroupCoordinator, tiers: LowerTiers, rows: np.ndarray,
           counts: np.ndarray, tokens: Tokens, *, caching: bool, current: bytes | None) -> None:
    """``counts[i]`` written tokens of ``rows[i]`` (their ids ``tokens``; None: unknown, which
    ends the rows' prefix caching) become committed. ValueError, with nothing changed, for tokens
    past the room reserved, into a page shared since a fork, or into a page with pending work.
    ``current``: the current weight version (pages of other versions are evicted first)."""
    ps = seqs.page_size
    tiers.refuse_held(rows, "committing its tokens")
    lens = seqs.lens[rows]
    over = lens + counts > seqs.npages[rows] * ps
    if over.any():
        i = int(np.argmax(over))
        raise ValueError(
            f"sequence {int(rows[i])} has room for {int(seqs.npages[rows[i]]) * ps - int(lens[i])} more tokens "
            f"but {int(counts[i])} were committed; schedule them first (the plan reserves their room)")
    for table in groups:
        table.check_commit(rows, lens, counts)
    # Validated: commit.
    hashes, version = seqs.hashes, seqs.version
    if tokens is None:
        hashes.stop_hashing(rows[counts > 0])
    elif caching and isinstance(tokens, np.ndarray) and tokens.ndim == 1:
        f_rows, cols, digests = hashes.record_decode_tokens(rows, lens, tokens)
        if digests:
            tags = [version[r] for r in f_rows.tolist()]
            for table in groups:
                commit_page = table.pool.commit
                for page, digest, tag in zip(table.table[f_rows, cols].tolist(), digests, tags):
                    commit_page(page, digest, tag, written=True)
    elif caching:
        for i in np.flatnonzero(hashes.hashable[rows] & (counts > 0)).tolist():
            row = int(rows[i])
            for col, digest in hashes.record_tokens(row, int(lens[i]), tokens[i]):
                for table in groups:
                    table.pool.commit(int(table.table[row, col]), digest, version[row], written=True)
    seqs.advance(rows, counts)
    groups.release_out_of_window(seqs, rows, current)


__all__ = ["commit_tokens", "parse_tokens"]
