"""`RedisBackend`: the shared prefix store on Redis or Valkey through the ``redis`` client
(``redis://``, ``rediss://``, ``valkey://``, ``valkeys://``, ``unix://``; see
`easykv.tiers.store.url`).

How each call maps onto the server, one round trip each: ``exists_many`` a pipeline of
``EXISTS`` (one per key, so each answer is per key), ``get_many`` one ``MGET``,
``put_if_absent`` a pipeline of ``SET key value NX`` (the server runs each atomically: of two
writers of one key exactly one gets OK, and a reader sees a whole value or none),
``delete_many`` one ``DEL``. ``list_keys`` and ``stats`` walk the key space with ``SCAN MATCH
prefix*`` (plus one pipeline of ``STRLEN`` per batch of keys for ``stats``). The server keeps no
modification times (``stats`` gives None) and evicts by itself: ``gc`` refuses and names the
server settings (``maxmemory``, ``maxmemory-policy allkeys-lru``); an evicted key is a miss.

Faults: the socket and connect timeouts are ``timeout_s``, and the client retries nothing (its
default would retry three times with backoff, several times ``timeout_s``): a dead or hung server
is reported within about ``timeout_s``. Every client error (connection refused or reset, timeout,
``LOADING``, ``READONLY``, ``OOM command not allowed when used memory > 'maxmemory'``) raises
`StoreUnavailableError` naming the URL and the cause. The next call tries the server again: the
client's pool drops a connection the server closed (killed, restarted) before reusing it, so the
first call after a restart works.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from easykv.errors import StoreUnavailableError
from easykv.tiers.store.backend import GcResult, StoreBackend, StoreStats
from easykv.tiers.store.key_syntax import check_items, check_keys, check_prefix, is_store_key

_SCAN_COUNT = 1000  # keys the server looks at per SCAN step
_STRLEN_CHUNK = 1000  # STRLEN commands per pipeline in stats


class RedisBackend(StoreBackend):
    """A store on a Redis or Valkey server (see the module docstring).

    Args:
      url: the store's URL, password hidden, for messages (`easykv.tiers.store.url.open_backend`
        parses it).
      client_url: the URL in the client's own scheme (``redis``, ``rediss``, ``unix``).
      timeout_s: the client's socket and connect timeouts.

    Nothing is sent when the backend opens: the first call connects.
    """

    def __init__(self, url: str, client_url: str, *, timeout_s: float):
        self.url = url
        self._timeout_s = timeout_s
        self._client = redis.Redis.from_url(
            client_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0))

    def _unavailable(self, err: redis.RedisError) -> StoreUnavailableError:
        cause = " ".join(str(err).split()) or "no message"
        return StoreUnavailableError(f"store {self.url} did not answer: {type(err).__name__}: {cause}", url=self.url)

    def _pipeline(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """The replies of ``commands`` sent in one pipeline (no MULTI: each command is atomic on
        its own, and a transaction would hold the server for the whole batch)."""
        if not commands:
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return list(pipe.execute())
        except redis.RedisError as err:
            raise self._unavailable(err) from err

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        check_keys(keys)
        return [bool(n) for n in self._pipeline([("EXISTS", key) for key in keys])]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        check_keys(keys)
        if not keys:
            return []
        try:
            values = self._client.mget(keys)
        except redis.RedisError as err:
            raise self._unavailable(err) from err
        return cast("list[bytes | None]", values)  # bytes: the client does not decode (decode_responses=False)

    def put_if_absent(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        check_items(items)
        # SET NX replies OK when it wrote and None when the key held a value.
        return [reply is not None and reply is not False for reply in
                self._pipeline([("SET", key, value, "NX") for key, value in items])]

    def delete_many(self, keys: Sequence[str]) -> int:
        check_keys(keys)
        if not keys:
            return 0
        try:
            return int(self._client.delete(*keys))
        except redis.RedisError as err:
            raise self._unavailable(err) from err

    def _scan(self, prefix: str) -> Iterator[bytes]:
        # check_prefix admits no glob character (* ? [ ] \), so the prefix is its own pattern.
        try:
            yield from self._client.scan_iter(match=prefix + "*", count=_SCAN_COUNT)
        except redis.RedisError as err:
            raise self._unavailable(err) from err

    def list_keys(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        # SCAN may return a key twice (the table was resized mid-walk): a set, then sorted.
        return sorted({key.decode("ascii", "replace") for key in self._scan(prefix)})

    def stats(self, prefix: str = "") -> StoreStats:
        listed = self.list_keys(prefix)
        keys = [key.encode("ascii") for key in listed if is_store_key(key)]  # other keys: another user's, left alone
        entries = total = 0
        for start in range(0, len(keys), _STRLEN_CHUNK):
            lengths = self._pipeline([("STRLEN", key) for key in keys[start:start + _STRLEN_CHUNK]])
            entries += sum(1 for n in lengths if n)  # 0: deleted or evicted since the SCAN
            total += sum(int(n) for n in lengths)
        return StoreStats(entries=entries, bytes=total, foreign_entries=len(listed) - len(keys))

    def gc(self, max_bytes: int, prefix: str = "") -> GcResult:
        raise ValueError(f"store {self.url}: Redis / Valkey keep no modification times to collect by and evict by "
                         "themselves: set `maxmemory <bytes>` and `maxmemory-policy allkeys-lru` on the server "
                         "(redis.conf or CONFIG SET); an evicted entry is a miss")

    def close(self) -> None:
        self._client.close()


__all__ = ["RedisBackend"]
