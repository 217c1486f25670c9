"""Content identity of full pages for prefix caching: a chained sha256.

A page's digest covers its parent's digest, an extra key (tenant salt, adapter id, ...) and the
page's token ids, so equal digests mean the whole prefix up to and including that page is equal
(up to sha256 collisions): a page can be shared only with sequences that have the same history
and the same extra key. Everything is hashed as fixed-width little-endian bytes, never with
Python's ``hash()``, so every host and every process computes the same digests (multi-host
lock-step and restoring a saved manager both rely on that).

This module also holds `SequenceHashes` (what each sequence knows of its own content). A leaf of the
manager: it imports ``validation`` only, so never ``storage``, ``attention``, ``checkpoint`` or
``tiers``.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from easykv.validation import INT32_MAX, integer_array, show

DIGEST_BYTES = 32
# The parent of a sequence's first page. Versioned so that a change of scheme never matches old digests.
ROOT_DIGEST: bytes = hashlib.sha256(b"easykv.prefix_hash.v1").digest()
NO_SALT: bytes = hashlib.sha256(b"easykv.prefix_hash.v1.no-salt").digest()



def _tagged(value: Any, name: str, what: str) -> bytes:
    """``value`` (a str, bytes or int of 64 bits) as bytes tagged by its type, so ``"1"``,
    ``b"1"`` and ``1`` differ; the same on every host (never Python's ``hash()``)."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}={show(value)} is a bool; use a str, bytes or int {what}")
    if isinstance(value, str):
        return b"s:" + value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return b"b:" + bytes(value)
    if isinstance(value, (int, np.integer)):
        if not -(2**63) <= int(value) < 2**64:
            raise ValueError(f"an int {name} must lie in -2**63 .. 2**64 - 1 (64 bits, signed or unsigned), got "
                             f"{show(int(value))}; use a str or bytes {what} for other values")
        return b"i:" + str(int(value)).encode("ascii")
    raise ValueError(f"{name}={show(value)} of type {type(value).__name__} is not supported; use a str, bytes or int "
                     f"{what} (one every host hashes alike)")


def salt_digest(salt: Any) -> bytes:
    """The 32-byte extra key of a sequence; None is the default namespace.

    str, bytes and int salts are tagged by type before hashing, so ``"1"``, ``b"1"`` and ``1``
    are three different namespaces.
    """
    if salt is None:
        return NO_SALT
    return hashlib.sha256(b"easykv.prefix_hash.v1.salt|" + _tagged(salt, "salt", "tenant/adapter key")).digest()


def version_digest(version: Any) -> bytes | None:
    """The 32-byte digest of a weight version (a str, bytes or int); None for None, the
    version of a manager that never set one (its page digests are those of easykv before
    weight versions)."""
    if version is None:
        return None
    return hashlib.sha256(b"easykv.prefix_hash.v1.version|" + _tagged(version, "version", "weight version")).digest()


@functools.lru_cache(maxsize=256)
def version_root(version: bytes | None) -> bytes:
    """The parent digest of the first page of a sequence of weight version ``version`` (a
    `version_digest`): pages of different versions never share a digest, so a prefix lookup
    under one version never finds K/V another version's weights computed."""
    if version is None:
        return ROOT_DIGEST
    return hashlib.sha256(b"easykv.prefix_hash.v1.root|" + version).digest()


def as_token_ids(token_ids: Any, name: str = "token_ids") -> np.ndarray:
    """A 1-D int32 copy of ``token_ids`` (ids in 0..2**31 - 1), or a ValueError that names the problem."""
    return integer_array(name, token_ids, ndim=1, lo=0, hi=INT32_MAX, hint="token ids")


def page_digest(parent: bytes, salt: bytes, page_tokens: np.ndarray) -> bytes:
    """The digest of one full page given its parent's digest and the sequence's salt digest."""
    return hashlib.sha256(parent + salt + np.asarray(page_tokens, "<i4").tobytes()).digest()


def iter_page_digests(tokens: np.ndarray, page_size: int, num_pages: int, salt: bytes,
                      parent: bytes = ROOT_DIGEST) -> Iterator[bytes]:
    """Digests of the first ``num_pages`` full pages of ``tokens``, lazily (lookups stop early).

    The token bytes are converted once; each page then costs one sha256 over 64 + 4*page_size bytes.
    """
    step = 4 * page_size
    data = np.ascontiguousarray(tokens[: num_pages * page_size], "<i4").tobytes()
    sha = hashlib.sha256
    for k in range(num_pages):
        parent = sha(parent + salt + data[k * step : (k + 1) * step]).digest()
        yield parent


class SequenceHashes:
    """What each sequence (a block-table row) knows of its own content, to name the pages it fills.

    Per row: the salt digest, the digest of its last full page (the parent of the next one),
    the token ids of its unfinished page, and whether its ids are known at all (tokens committed
    without ids end its prefix caching). Pages are named as they fill, so a page is findable
    from the step that completes it.

    ``log[row, :n]``: the ids of every token the row committed, from position ``known[row]``
    on (0; or the unfinished page's first position, in a row loaded from a state of an easykv that
    did not keep the ids), so a truncated row can name its pages again. Grown by doubling, never past the longest row.
    Every change to them is one of its methods; the sequence table and the checks read them.
    """

    def __init__(self, batch_size: int, page_size: int):
        self.page_size = page_size
        self.partial = np.zeros((batch_size, page_size), np.int32)
        self.chain: list[bytes] = [ROOT_DIGEST] * batch_size
        self.salt: list[bytes] = [NO_SALT] * batch_size
        self.hashable = np.ones(batch_size, bool)
        self.log = np.zeros((batch_size, 4 * page_size), np.int32)
        self.known = np.zeros(batch_size, np.int64)

    def _room(self, end: int) -> None:
        if end > self.log.shape[1]:
            grown = np.zeros((self.log.shape[0], max(end, 2 * self.log.shape[1])), np.int32)
            grown[:, : self.log.shape[1]] = self.log
            self.log = grown

    def reset(self, row: int, root: bytes = ROOT_DIGEST, salt: bytes = NO_SALT) -> None:
        """``row`` knows nothing yet: its chain starts at ``root``, in the namespace ``salt``."""
        self.partial[row] = 0
        self.chain[row], self.salt[row], self.hashable[row] = root, salt, True
        self.known[row] = 0

    def reroot(self, row: int, root: bytes) -> None:
        """``row``, which holds no token yet, starts its chain at ``root`` (a weight version set
        before it started); its salt stays."""
        self.chain[row] = root

    def stop_hashing(self, rows: np.ndarray | list[int]) -> None:
        """``rows`` no longer name their pages (ids committed unknown, or a resumed row): they
        enter nothing in the prefix cache from now on."""
        self.hashable[rows] = False

    def copy_row(self, src: int, dst: int) -> None:
        self.partial[dst], self.hashable[dst] = self.partial[src], self.hashable[src]
        self.chain[dst], self.salt[dst] = self.chain[src], self.salt[src]
        self.log[dst], self.known[dst] = self.log[src], self.known[src]

    def start_on_prefix(self, row: int, chain: bytes, tokens: np.ndarray) -> None:
        """``row`` starts on a cached prefix of ``tokens`` (whole pages) whose last page's digest
        is ``chain``: the log holds them as its first ids."""
        self.chain[row] = chain
        self._room(tokens.size)
        self.log[row, : tokens.size] = tokens

    def ids(self, row: int, start: int, stop: int) -> np.ndarray | None:
        """The row's token ids at positions ``start .. stop - 1``, or None where not known."""
        if not self.hashable[row] or start < self.known[row]:
            return None
        return self.log[row, start:stop].copy()

    def rewind(self, row: int, length: int, chain: bytes | None) -> None:
        """The row truncated to ``length`` tokens whose last full page has digest ``chain``
        (the root before the first; None: unknown): its unfinished page's ids come from the
        log; a row whose digest or ids are not known stops hashing."""
        ps = self.page_size
        start = length - length % ps
        tokens = self.ids(row, start, length)
        if chain is None or tokens is None:
            self.hashable[row] = False
            return
        self.chain[row] = chain
        self.partial[row] = 0
        self.partial[row, : tokens.size] = tokens

    def record_tokens(self, row: int, start: int, tokens: np.ndarray) -> list[tuple[int, bytes]]:
        """Record ``tokens`` written from position ``start``; returns (page index, digest) of
        each page they complete."""
        ps, pos, i, sealed = self.page_size, start, 0, []
        self._room(start + tokens.size)
        self.log[row, start : start + tokens.size] = tokens
        off = pos % ps
        if off:
            i = min(ps - off, tokens.size)
            self.partial[row, off : off + i] = tokens[:i]
            pos += i
            if pos % ps == 0:
                self.chain[row] = page_digest(self.chain[row], self.salt[row], self.partial[row])
                sealed.append((pos // ps - 1, self.chain[row]))
        full = (tokens.size - i) // ps
        digests = iter_page_digests(tokens[i:], ps, full, self.salt[row], self.chain[row])
        for col, digest in enumerate(digests, pos // ps):
            sealed.append((col, digest))
            self.chain[row] = digest
        i += full * ps
        self.partial[row, : tokens.size - i] = tokens[i:]
        return sealed

    def record_decode_tokens(self, rows: np.ndarray, lens: np.ndarray,
                   tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
        """One token per row at position ``lens`` (the decode fast path, vectorized); returns
        the rows, page indices and digests of the pages completed."""
        ps = self.page_size
        keep = self.hashable[rows]
        if not keep.all():
            rows, lens, tokens = rows[keep], lens[keep], tokens[keep]
        offs = lens % ps
        self.partial[rows, offs] = tokens
        if rows.size:
            self._room(int(lens.max()) + 1)
            self.log[rows, lens] = tokens
        full = np.flatnonzero(offs == ps - 1)
        rows, width = rows[full], 4 * ps
        blob = self.partial[rows].astype("<i4").tobytes()
        chain, salt, sha, digests = self.chain, self.salt, hashlib.sha256, []
        for k, row in enumerate(rows.tolist()):
            chain[row] = digest = sha(chain[row] + salt[row] + blob[k * width : (k + 1) * width]).digest()
            digests.append(digest)
        return rows, lens[full] // ps, digests

    def load_row(self, row: int, *, hashable: bool, chain: bytes, salt: bytes, length: int, partial: np.ndarray,
                 tokens: np.ndarray | None) -> None:
        """A row of a loaded state: its ids from position 0 (``tokens``), or, from a state that
        did not keep them, those of its unfinished page only (``partial``)."""
        self.hashable[row], self.salt[row] = hashable, salt
        self.chain[row] = chain if hashable else ROOT_DIGEST  # never read again: canonical, as a state writes it
        self.partial[row] = 0
        if hashable:
            self.partial[row, : partial.size] = partial
        start = 0 if tokens is not None else length - partial.size
        self.known[row] = start
        self._room(length)
        self.log[row, start:length] = tokens if tokens is not None else partial

__all__ = [
    "DIGEST_BYTES", "NO_SALT", "ROOT_DIGEST", "SequenceHashes", "as_token_ids", "iter_page_digests",
    "page_digest", "salt_digest", "version_digest", "version_root",
]
