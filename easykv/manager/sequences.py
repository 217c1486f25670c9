"""The sequence table: what each sequence slot (a row of every group's block table) *is*, the same
in every layer group, and the checks of the ids and counts callers pass.

What a sequence *holds* (its pages) differs per layer group and lives in each group's allocator
(`group_table`); this module knows no pages, and imports nothing of the manager but
``prefix_hash`` and ``broken`` (never ``storage``, ``attention``, ``checkpoint`` or ``tiers``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from easykv.errors import UnknownSequenceError
from easykv.manager.broken import Broken
from easykv.manager.prefix_hash import NO_SALT, ROOT_DIGEST, SequenceHashes
from easykv.validation import integer, integer_array, is_scalar, show


class SequenceTable:
    """Every sequence slot of a manager (rows ``0 .. batch_size - 1``).

    Owns, per row:

    - ``lens``: tokens written (their K/V is valid);
    - ``npages``: block-table columns held in every group, pages reserved ahead included;
    - ``floor``: a resumed sequence's first position with K/V, until every window passed it;
    - ``replica``: the data-parallel slice its pages lie in (-1 while it holds none);
    - ``active``: whether the id is claimed;
    - ``hashes``: its salt, chain digest, unfinished page and token log (`SequenceHashes`);
    - ``version``: the digest of the weight version it runs under (None: unversioned);
    - ``edits``: how often its row changed (every method here that changes a row counts one): a
      plan's stamp, these counts, tells the sequences it planned from one that changed in any way
      meanwhile (released and claimed again, restarted under another version, written and rewound
      to the same length, given columns);
    - ``plan_of``: the open plan that holds it (0: none; see `open_plans`), whose device
      loop may be writing its pages: until that plan is committed nothing else may change it.
      ``open_plans`` maps each open plan's number to its rows. Neither ``edits`` nor the plans
      are saved: a loaded manager (or a clone) is another manager, whose plans are its own.

    Every change to them is one of its methods (the hashes' are `SequenceHashes`'); others read them.
    """

    def __init__(self, batch_size: int, page_size: int, max_length: int):
        self.batch_size, self.page_size, self.max_length = batch_size, page_size, max_length
        b = batch_size
        self.lens = np.zeros(b, np.int32)
        self.npages = np.zeros(b, np.int32)
        self.floor = np.zeros(b, np.int32)
        self.replica = np.full(b, -1, np.int32)
        self.active = np.zeros(b, bool)
        self.hashes = SequenceHashes(b, page_size)
        self.version: list[bytes | None] = [None] * b
        self.edits = np.zeros(b, np.int64)
        self.plan_of = np.zeros(b, np.int64)
        self.open_plans: dict[int, np.ndarray] = {}  # plan number -> its rows, a read-only array
        self._plans_made = 0

    # ---- input checks ---------------------------------------------------------------------------
    def check_id(self, seq_id: Any, strict: bool = True) -> int:
        """The id as an int; outside ``0..batch_size - 1``: ValueError, or -1 when not ``strict``."""
        sid = integer("sequence id", seq_id, lo=None, hi=None)
        if not 0 <= sid < self.batch_size:
            if not strict:
                return -1
            raise ValueError(f"sequence id {sid} is outside 0..{self.batch_size - 1} (batch_size={self.batch_size})")
        return sid

    def row(self, seq_id: Any) -> int:
        """The row of a claimed sequence; UnknownSequenceError otherwise."""
        sid = self.check_id(seq_id, strict=False)
        if sid < 0 or not self.active[sid]:
            raise UnknownSequenceError(
                f"sequence id {show(seq_id)} is not claimed (never claimed, or already released); "
                f"claimed ids: {self.active_ids[:16]}{'...' if self.active.sum() > 16 else ''}")
        return sid

    def rows(self, seq_ids: Any) -> npt.NDArray[np.int64]:
        """The rows of claimed sequences, each listed once."""
        rows = integer_array("seq_ids", seq_ids, ndim=1, lo=None, hi=None, dtype=np.int64)
        if not rows.size:
            return rows
        if rows.min() < 0 or rows.max() >= self.batch_size or not self.active[rows].all():
            for s in rows.tolist():
                self.row(s)
        if rows.size > 1:
            seen = np.bincount(rows)
            if seen.max() > 1:
                raise ValueError(f"seq_ids repeats id {int(np.argmax(seen))}; list each sequence once per step")
        return rows

    def one_or_more_rows(self, seq_ids: Any) -> npt.NDArray[np.int64]:
        """The rows of one claimed sequence id (read as `row` reads it: a numpy or jax scalar too) or
        of a list of them (as `rows`), for the calls that take either (the deprecated ``reserve`` and ``advance``)."""
        if is_scalar(seq_ids):
            return np.array([self.row(seq_ids)], np.int64)
        return self.rows(seq_ids)

    def counts(self, num_tokens: Any, n: int) -> np.ndarray:
        """Token counts, one per sequence, each bounded by max_sequences before any arithmetic."""
        hint = f"a sequence holds at most max_sequences={self.max_length} tokens"
        if is_scalar(num_tokens):
            return np.full(n, integer("num_tokens", num_tokens, lo=0, hi=self.max_length, hint=hint), np.int64)
        counts = integer_array("num_tokens", num_tokens, ndim=1, lo=0, hi=self.max_length, dtype=np.int64, hint=hint)
        if counts.shape != (n,):
            raise ValueError(f"num_tokens must be an int or {n} ints (one per sequence), got {counts.size}")
        return counts

    # ---- open plans (the rule is `open_plans`') ------------------------------------------------
    def open_plan(self, rows: np.ndarray) -> int:
        """``rows`` (none in an open plan; a read-only array the plan keeps) are held by a new open
        plan; returns its number."""
        self._plans_made += 1
        self.plan_of[rows] = self._plans_made
        self.open_plans[self._plans_made] = rows
        return self._plans_made

    def close_plan(self, number: int, rows: np.ndarray) -> None:
        """Plan ``number`` (over ``rows``) ended: its rows may change again."""
        del self.open_plans[number]
        self.plan_of[rows] = 0

    def close_all_plans(self) -> None:
        """No plan is open (a clone: the original's plans stay the original's)."""
        self.plan_of[:] = 0
        self.open_plans.clear()

    def refuse_planned(self, rows: Any, call: str, why: str = "") -> None:
        """ValueError naming the first of ``rows`` an open plan holds, that plan's rows and the
        fix (``call``: the refused call; ``why``: how it would change the row, when not plain)."""
        rows = np.atleast_1d(np.asarray(rows, np.int64))
        held = self.plan_of[rows]
        if not held.any():
            return
        i = int(np.argmax(held > 0))
        row, number = int(rows[i]), int(held[i])
        raise ValueError(
            f"{call} would change sequence {row}{why}, which open plan #{number} holds (sequences "
            f"{self.open_plans[number].tolist()}: its step may be writing their pages); end that plan first with "
            "commit(plan, token_ids, ...) or abort(plan) (nothing committed, its reserved pages given back)")

    def check_extent(self, row: int, end: int, what: str) -> None:
        if end > self.max_length:
            raise ValueError(
                f"sequence {row} would hold {end} tokens ({what}), past max_sequences={self.max_length}; "
                "finish or truncate it, or create the metadata with a larger max_sequences")

    def check_fresh(self, row: int, what: str) -> None:
        """ValueError unless ``row`` holds no tokens and no pages yet (``what``: the fix)."""
        if self.lens[row] or self.npages[row]:
            raise ValueError(f"sequence {row} already holds {int(self.lens[row])} tokens in {int(self.npages[row])} "
                             f"pages; {what}")

    # ---- claiming, starting, forking, releasing --------------------------------------------------
    @property
    def active_ids(self) -> list[int]:
        return np.flatnonzero(self.active).tolist()

    def free_rows(self) -> np.ndarray:
        return np.flatnonzero(~self.active)

    def unstarted_rows(self) -> np.ndarray:
        """Claimed rows that hold no tokens and no pages yet (a new weight version reaches them)."""
        return np.flatnonzero(self.active & (self.lens == 0) & (self.npages == 0))

    def free_ids(self, seq_ids: Any) -> list[int]:
        """Ids a caller chose to claim (`PageManager.external_claim`), each free and listed once."""
        if is_scalar(seq_ids) and hasattr(seq_ids, "__index__") and not isinstance(seq_ids, (bool, np.bool_)):
            one = integer("seq_ids", seq_ids, lo=None, hi=None)  # a numpy or jax scalar too
            raise ValueError(f"external_claim takes a list of ids, got the one id {one}; pass [{one}]")
        ids: list[int] = integer_array("seq_ids", seq_ids, ndim=1, lo=0, hi=self.batch_size - 1,
                                       hint=f"sequence ids of batch_size={self.batch_size}").tolist()
        for s in ids:
            if self.active[s]:
                raise ValueError(f"sequence id {s} is already claimed; release it first or claim another id")
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids {ids} repeat an id; claim each id once")
        return ids

    def claim(self, rows: Sequence[int], version: bytes | None, root: bytes) -> None:
        """Claim ``rows`` (checked free), each starting under ``version`` (whose root is ``root``)."""
        self.active[rows] = True
        self.edits[rows] += 1
        for row in rows:
            self.start(row, version, root)

    def start(self, row: int, version: bytes | None, root: bytes, salt: bytes = NO_SALT) -> None:
        """``row`` runs under ``version`` from its first page (its chain starts at ``root``, in the
        prefix namespace ``salt``)."""
        self.version[row] = version
        self.edits[row] += 1  # a new version or namespace: what a plan over the row was made for changed
        self.hashes.reset(row, root, salt)

    def restart_unstarted(self, version: bytes | None, root: bytes) -> None:
        """Every claimed row that holds nothing yet takes ``version`` (a version set before it started)."""
        for row in self.unstarted_rows().tolist():
            self.version[row] = version
            self.edits[row] += 1
            self.hashes.reroot(row, root)

    def start_on_prefix(self, row: int, columns: int, replica: int, chain: bytes, tokens: np.ndarray) -> None:
        """The fresh ``row`` holds a cached prefix of ``columns`` full pages in ``replica``: its
        ``tokens`` (their ids, at least the prefix's) are written and committed, ``chain`` is the
        digest of its last page."""
        length = columns * self.page_size
        self.npages[row], self.lens[row], self.replica[row] = columns, length, replica
        self.edits[row] += 1
        self.hashes.start_on_prefix(row, chain, tokens[:length])

    def resume_at(self, row: int, columns: int, floor: int, replica: int) -> None:
        """The fresh ``row`` starts after ``columns`` pages it will never hold (`PageManager.resume`),
        bound to ``replica``; ``floor``: its first position with K/V while a window reaches before
        it (0: none does). Its ids are not known from the first: it does not hash."""
        self.npages[row], self.lens[row] = columns, columns * self.page_size
        self.floor[row], self.replica[row] = floor, replica
        self.edits[row] += 1
        self.hashes.stop_hashing([row])

    def forget_floors(self, rows: np.ndarray) -> None:
        """Every window of ``rows`` has passed their floor: it is forgotten."""
        self.floor[rows] = 0
        self.edits[rows] += 1

    def fork_row(self, src: int, dst: int, columns: int) -> None:
        """``dst`` continues ``src``'s history, holding its first ``columns`` columns."""
        self.npages[dst], self.floor[dst] = columns, self.floor[src]
        self.active[dst] = True
        self.edits[[src, dst]] += 1
        # A parent that holds only pages reserved ahead shares none: the child is unbound.
        self.lens[dst], self.replica[dst] = self.lens[src], (self.replica[src] if columns else -1)
        self.hashes.copy_row(src, dst)
        self.version[dst] = self.version[src]

    # ---- columns and lengths ------------------------------------------------------------------------
    def bind(self, rows: np.ndarray, replicas: np.ndarray | int) -> None:
        """``rows`` lie in data-parallel replica ``replicas`` (one each, or one for all) from now on."""
        self.replica[rows] = replicas
        self.edits[rows] += 1

    def grow(self, rows: np.ndarray, columns: np.ndarray) -> None:
        """``rows`` hold ``columns`` more block-table columns each (reserved in every group)."""
        self.npages[rows] += columns.astype(np.int32)
        self.edits[rows] += 1

    def hold_columns(self, row: int, columns: int, replica: int) -> None:
        """``row`` holds ``columns`` columns in ``replica`` (a swapped-out row back on the device);
        a row with none is unbound."""
        self.npages[row] = columns
        self.replica[row] = replica if columns else -1
        self.edits[row] += 1

    def keep_columns(self, row: int, columns: int) -> None:
        """``row`` keeps its first ``columns`` columns (the rest went back to the pools); a row with
        none is unbound."""
        self.npages[row] = columns
        self.edits[row] += 1
        if not columns:  # a sequence is bound to a replica while it holds pages
            self.replica[row] = -1

    def advance(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """``rows`` committed ``counts`` more tokens each; those that wrote any are edited (a plan
        made before knows)."""
        self.lens[rows] += counts.astype(np.int32)
        self.edits[rows[counts > 0]] += 1

    def rewind(self, row: int, length: int, columns: int) -> None:
        """``row`` is truncated to ``length`` tokens in its first ``columns`` columns (its hashes
        follow through `SequenceHashes.rewind`)."""
        self.lens[row] = length
        self.keep_columns(row, columns)  # counts the edit

    def reset(self, row: int) -> None:
        """``row`` is free again and holds nothing."""
        self.lens[row] = self.npages[row] = self.floor[row] = 0
        self.replica[row] = -1
        self.active[row] = False
        self.edits[row] += 1
        self.hashes.reset(row)
        self.version[row] = None

    def written_columns(self, row: int) -> int:
        """Columns holding written tokens (a partly filled last page included)."""
        return -(-int(self.lens[row]) // self.page_size)

    # ---- state -----------------------------------------------------------------------------------
    def row_state(self, row: int, pages: Any, *, caching: bool) -> dict[str, Any]:
        """``row`` as a state's sequence entry, ``pages`` (its block-table rows) included. A row that
        stopped hashing keeps stale chain and partial ids in memory; they are never read again,
        so the entry gives neutral ones and stays canonical."""
        length, hashes = int(self.lens[row]), self.hashes
        hashable, tail = bool(hashes.hashable[row]), length % self.page_size
        chain = hashes.chain[row] if hashable else ROOT_DIGEST
        partial = hashes.partial[row, :tail].tolist() if hashable else [0] * tail
        out = {"id": row, "length": length, "pages": pages, "replica": int(self.replica[row]), "hashable": hashable,
               "chain": chain.hex(), "salt": hashes.salt[row].hex(), "partial": partial}
        if self.floor[row]:  # a resumed sequence (only then: other states keep their form)
            out["floor"] = int(self.floor[row])
        if (version := self.version[row]) is not None:
            out["version"] = version.hex()
        if hashable and caching and hashes.known[row] == 0:  # a truncation names pages again by them
            out["tokens"] = hashes.log[row, :length].tolist()
        return out

    def load_row(self, row: int, *, length: int, npages: int, replica: int, floor: int, version: bytes | None,
                 hashable: bool, chain: bytes, salt: bytes, partial: np.ndarray, tokens: np.ndarray | None) -> None:
        """A claimed row of a loaded state (values checked for type and range; whether they agree
        with the rest is for `check`)."""
        self.active[row] = True
        self.npages[row], self.lens[row], self.replica[row], self.floor[row] = npages, length, replica, floor
        self.hashes.load_row(row, hashable=hashable, chain=chain, salt=salt, length=length, partial=partial,
                             tokens=tokens)
        self.version[row] = version

    # ---- invariants --------------------------------------------------------------------------------
    def check(self, swapped: np.ndarray, *, all_windowed: bool, released: np.ndarray) -> None:
        """Raise `Broken` unless every row's own fields agree: claimed rows only hold anything, a
        swapped-out row (``swapped``) holds no device columns, lengths fit their columns, rows
        are bound to a replica exactly while they hold columns, and floors are valid
        (``released``: per row, the fewest columns any group's window releases at its length)."""
        n = self.npages
        if np.any(swapped & ((n > 0) | ~self.active)):
            raise Broken("sequences", "a swapped-out sequence holds device pages, or is not claimed")
        if np.any((n > 0) & ~self.active) or np.any(self.lens[~self.active]):
            raise Broken("sequences", "a released sequence id still holds pages or tokens")
        planned = np.flatnonzero(self.plan_of)
        listed = {row: number for number, rows in self.open_plans.items() for row in rows.tolist()}
        if np.any(swapped[planned] | ~self.active[planned]) or \
                listed != dict(zip(planned.tolist(), self.plan_of[planned].tolist())):
            raise Broken("sequences", "an open plan holds a released or swapped-out sequence, or the plans "
                                      "disagree with the rows they hold")
        self._check_floors(all_windowed, released)
        if np.any((self.lens > n * self.page_size) & ~swapped) or np.any(self.lens > self.max_length):
            raise Broken("sequences", "a sequence holds more tokens than its pages or max_sequences allow")
        bound = self.replica >= 0
        if np.any(bound != (n > 0)):
            row = int(np.argmax(bound != (n > 0)))
            raise Broken(f"sequences[id={row}].replica", f"sequence {row} holds {int(n[row])} pages but replica "
                                                         f"{int(self.replica[row])}; a sequence is bound to a replica "
                                                         "exactly when it holds pages")

    def _check_floors(self, all_windowed: bool, released: np.ndarray) -> None:
        """A floor is a page boundary at most its length, in a cache whose groups are all sliding
        or chunked, of a sequence that does not hash, and only while a window still reaches
        before it (then it is forgotten)."""
        ps = self.page_size
        for row in np.flatnonzero(self.floor).tolist():
            floor, length = int(self.floor[row]), int(self.lens[row])
            where = f"sequences[id={row}].floor"
            if not all_windowed:
                raise Broken(where, f"sequence {row} has floor {floor}, but a full-attention layer group reads every "
                                    "position")
            if floor % ps or floor > length or self.hashes.hashable[row]:
                raise Broken(where, f"floor {floor} of sequence {row} (length {length}) must be a multiple of "
                                    f"page_size={ps}, at most its length, on a sequence that does not hash")
            if floor // ps <= released[row]:
                raise Broken(where, f"sequence {row}'s window (length {length}) has moved past its floor {floor}; the "
                                    "floor is forgotten then")

    def check_joined(self, members: list[tuple[int, int]], checked: dict[tuple[int, int], int], field: str | None,
                     what: str, *, caching: bool) -> None:
        """Sequences joined at one page (``members``: (row, column) of each) continue one history,
        the one rule for sharing and copying alike, which a live manager and a loaded state both
        meet: the page at one column, one salt and one weight version, and the same token ids
        wherever two of them know them (a fork shares its parent's pages; a prefix hit or a swap-in
        shares a page by a digest that names its whole history). Their earlier pages may differ: a
        page filled while another already held its digest stays private, a later hit shares that
        one. ``checked``: (row, row) -> ids compared so far (a shared prefix compares once).
        ``field``: the state field to blame (None: the sequence's own field that differs)."""
        ps, hashes = self.page_size, self.hashes
        (first, col), *_ = members
        for row, c in members:
            differ = ("columns" if c != col else "salts" if hashes.salt[row] != hashes.salt[first]
                      else "weight versions" if self.version[row] != self.version[first] else None)
            if differ:
                own = {"columns": "pages", "salts": "salt", "weight versions": "version"}[differ]
                raise Broken(field or f"sequences[id={row}].{own}",
                             f"{what}: sequences {first} and {row} hold it with different {differ} "
                             f"(columns {col} and {c})")
        if not caching:  # no row keeps its ids then
            return
        ends = {row: min(int(self.lens[row]), (col + 1) * ps) for row, _ in members}
        known = [row for row, _ in members if hashes.hashable[row] and int(hashes.known[row]) < ends[row]]
        if len(known) < 2:
            return
        ref = min(known, key=lambda r: (int(hashes.known[r]), -ends[r]))  # knows the most: spans every other's
        for row in known:
            lo, hi = max(int(hashes.known[row]), int(hashes.known[ref])), min(ends[row], ends[ref])
            if row == ref or hi <= lo or checked.get((ref, row), 0) >= hi:
                continue
            a, b = hashes.log[ref, lo:hi], hashes.log[row, lo:hi]
            if not np.array_equal(a, b):
                at = lo + int(np.argmax(a != b))
                own = "tokens" if hashes.known[row] == 0 else "partial"
                raise Broken(field or f"sequences[id={row}].{own}",
                             f"{what}: they hold different tokens (sequence {row} token {int(b[at - lo])} at position "
                             f"{at}, sequence {ref} token {int(a[at - lo])})")
            checked[ref, row] = hi


__all__ = ["SequenceTable"]
