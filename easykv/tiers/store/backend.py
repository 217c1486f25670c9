"""What the shared prefix store asks of a storage engine (`StoreBackend`): batched existence
queries and reads, one atomic put-if-absent per key, and an operator's view (`StoreStats`,
`GcResult`). Each backend is a real engine people already run: tensorstore's kvstore
(``file://``, ``memory://``, ``gs://``, ``s3://``; `easykv.tiers.store.tensorstore_kv`) and
Redis / Valkey (``redis://``; `easykv.tiers.store.redis_kv`). `open_backend` (``url``) picks one.

A backend moves opaque bytes under string keys; what a value means (its header and checksum) is
`easykv.tiers.store.codec`'s, which keys it owns is `easykv.tiers.store.namespace`'s. A backend
never unpickles and never interprets a value.

Failures: a backend that cannot reach its engine (server down, directory gone or read-only, disk
full, a call past its timeout) raises `easykv.errors.StoreUnavailableError`; a bad URL or
argument is a ValueError raised before anything is sent. Imports ``errors`` only.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class StoreStats:
    """What a store holds under a key prefix (``easykv store stats URL``).

    Attributes:
      entries: values stored.
      bytes: their total size in bytes (values only, not the engine's own overhead).
      oldest: the modification time of the oldest value, seconds since the epoch (None: empty, or
        the engine keeps no times).
      newest: likewise, the newest.
      foreign_entries: names under the prefix that are no easykv value (not a store key; a link, a FIFO, a
        directory where a value would be), left alone and never counted as values.
    """

    entries: int
    bytes: int
    oldest: float | None = None
    newest: float | None = None
    foreign_entries: int = 0


@dataclasses.dataclass(frozen=True)
class GcResult:
    """What `StoreBackend.gc` removed and left.

    Attributes:
      removed_entries: values deleted.
      removed_bytes: their size in bytes.
      kept_entries: values left.
      kept_bytes: their size in bytes (``<= max_bytes`` asked).
      foreign_entries: names under the prefix that are no easykv value, left alone (never deleted).
    """

    removed_entries: int
    removed_bytes: int
    kept_entries: int
    kept_bytes: int
    foreign_entries: int = 0


class StoreBackend(abc.ABC):
    """A storage engine under the shared prefix store: opaque values under string keys.

    Keys are ASCII strings of ``[A-Za-z0-9._/-]``, at most 512 characters, never starting with
    ``/`` nor holding ``..`` (a file store maps them to paths under its root). Every method
    taking several keys does one batched round trip (or a few, bounded: a pipeline, a batch
    read), never one per key. Methods may be called from several threads at once.

    Attributes:
      url: the URL the backend was opened with, as the user gave it (for messages and metrics).
    """

    url: str

    @abc.abstractmethod
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` hold a value, in one batched query.

        Args:
          keys: the keys asked, any number (0 included), in any order.

        Returns:
          one bool per key, in order.

        Raises:
          StoreUnavailableError: the engine did not answer.
        """

    @abc.abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys``, in one batched read.

        Args:
          keys: the keys read, any number, in any order.

        Returns:
          one value per key, in order: its bytes, or None where the key holds none (never written,
            or evicted by the engine).

        Raises:
          StoreUnavailableError: the engine did not answer.
        """

    @abc.abstractmethod
    def put_if_absent(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        """Write each value unless its key holds one already: one atomic write per key (a reader
        sees the whole value or none; of two writers of one key, one wins and the other's value
        is never visible), batched.

        Args:
          items: ``(key, value)`` pairs, keys distinct.

        Returns:
          per item, True when this call wrote it, False when the key held a value.

        Raises:
          StoreUnavailableError: the engine did not answer, or refused the write (read-only,
            full); items before the failure may have been written.
        """

    @abc.abstractmethod
    def delete_many(self, keys: Sequence[str]) -> int:
        """Delete these keys (missing ones are ignored).

        Args:
          keys: the keys deleted, any number.

        Returns:
          how many held a value.

        Raises:
          StoreUnavailableError: the engine did not answer.
        """

    @abc.abstractmethod
    def list_keys(self, prefix: str = "") -> list[str]:
        """Every key starting with ``prefix``, sorted.

        Args:
          prefix: the keys listed start with it ("": every key).

        Raises:
          StoreUnavailableError: the engine did not answer.
        """

    @abc.abstractmethod
    def stats(self, prefix: str = "") -> StoreStats:
        """Entries and bytes stored under ``prefix`` (``easykv store stats``).

        Args:
          prefix: the keys counted start with it ("": every key).

        Raises:
          StoreUnavailableError: the engine did not answer.
        """

    @abc.abstractmethod
    def gc(self, max_bytes: int, prefix: str = "") -> GcResult:
        """Delete the oldest values under ``prefix`` (by modification time) until at most
        ``max_bytes`` bytes are left (``easykv store gc``).

        Args:
          max_bytes: the bytes to keep, ``>= 0``.
          prefix: the keys considered.

        Raises:
          ValueError: the engine evicts by itself and keeps no times (Redis / Valkey: set
            ``maxmemory`` and ``maxmemory-policy allkeys-lru`` on the server instead); the message
            says so.
          StoreUnavailableError: the engine did not answer.
        """

    refused_paths: int = 0  # keys whose stored object was no value and was never read (a file store's FIFO, say)

    def close(self) -> None:  # noqa: B027 (a backend holding nothing to close)
        """Let go of connections and handles; the backend is not used afterwards."""


__all__ = ["GcResult", "StoreBackend", "StoreStats"]
