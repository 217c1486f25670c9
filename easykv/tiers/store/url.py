"""Store URLs: which engine a URL names (`parse_store_url`) and the backend it opens
(`open_backend`).

URLs (a bad one is a ValueError naming it and the spelling to use, raised before anything is
opened):

- ``file:///abs/dir``: tensorstore's ``file`` kvstore under an absolute directory (the embedded
  default; a shared file system such as NFS, Lustre or Filestore shares it across hosts).
- ``memory://name``: tensorstore's ``memory`` kvstore. Every open of the same name in one process
  shares the data (one tensorstore context for the process; tensorstore itself gives each
  context its own memory store); different names never do; nothing outlives the process.
- ``gs://bucket/path``, ``s3://bucket/path``: tensorstore's ``gcs`` and ``s3`` kvstores. Only the
  spec is built and tested here (no network in the tests); credentials and endpoints come from
  tensorstore's usual environment (``GOOGLE_APPLICATION_CREDENTIALS``, ``AWS_*``).
- ``<scheme>+ocdbt://...`` (``file+ocdbt:///dir``, ``memory+ocdbt://name``, ``gs+ocdbt://b/p``,
  ``s3+ocdbt://b/p``): the same base wrapped in an ``ocdbt`` kvstore (many small values packed
  into few files).
- ``redis://[:password@]host:port/db``, ``rediss://`` (TLS), ``valkey://`` and ``valkeys://`` (the
  same protocol), ``unix:///path/redis.sock?db=N``: Redis or Valkey through the ``redis`` client.

Key syntax is `easykv.tiers.store.key_syntax`'s (memory names and bucket paths follow it too).
Imports ``key_syntax`` and ``backend``, and the backends lazily (only the one a URL names).
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from typing import Any

from easykv.tiers.store.backend import StoreBackend
from easykv.tiers.store.key_syntax import key_problem

DEFAULT_TIMEOUT_S = 5.0
"""How long one backend call may wait on its engine before it raises StoreUnavailableError."""

_TENSORSTORE_SCHEMES = ("file", "memory", "gs", "s3")
_REDIS_SCHEMES = {"redis": "redis", "valkey": "redis", "rediss": "rediss", "valkeys": "rediss", "unix": "unix"}
_EXAMPLES = ("file:///abs/dir, memory://name, gs://bucket/path, s3://bucket/path (each optionally +ocdbt, "
             "e.g. file+ocdbt:///abs/dir), redis://host:6379/0, rediss://, valkey://, unix:///path.sock")


# ---- URLs ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StoreUrl:
    """A parsed store URL.

    Attributes:
      url: the URL as given, with any password replaced by ``***`` (for messages and logs).
      engine: ``"tensorstore"`` or ``"redis"``.
      kvstore_spec: tensorstore's kvstore JSON spec (tensorstore engine only; None for redis).
      root: the local directory of a ``file`` store (None otherwise): the backend checks it is
        still a directory before each call and reads file times under it.
      redis_url: the URL handed to the ``redis`` client, in its own scheme (redis engine only).
    """

    url: str
    engine: str
    kvstore_spec: dict[str, Any] | None = None
    root: str | None = None
    redis_url: str | None = None


def _bad(url: str, problem: str, fix: str) -> ValueError:
    return ValueError(f"store URL {redact(url)!r} {problem}; {fix}")


def redact(url: str) -> str:
    """``url`` with the password of its user-info part replaced by ``***``."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user, _, host = parts.netloc.rpartition("@")
    name = user.partition(":")[0]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{name}:***@{host}"))


def parse_store_url(url: str) -> StoreUrl:
    """Parse ``url`` into the engine and spec it names.

    Raises:
      ValueError: an unknown scheme, a relative or hosted ``file`` path, an empty memory name, a
        bad bucket, a bad Redis host, port or database; the message names the value and the fix.
    """
    if not isinstance(url, str):
        raise TypeError(f"a store URL is a str, got {type(url).__name__}; write e.g. file:///abs/dir")
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise _bad(url, "has no scheme", f"write one of {_EXAMPLES}")
    scheme = scheme.lower()
    base, plus, layer = scheme.partition("+")
    if plus and (layer != "ocdbt" or base not in _TENSORSTORE_SCHEMES):
        raise _bad(url, f"names {scheme!r}", "only '+ocdbt' may follow file, memory, gs or s3 (e.g. "
                                              "file+ocdbt:///abs/dir)")
    parts = urllib.parse.urlsplit(url)
    if base in _TENSORSTORE_SCHEMES:
        if parts.query or parts.fragment:
            raise _bad(url, "has a query or fragment", "a tensorstore store URL takes none; drop the '?...'")
        spec, root = _tensorstore_spec(url, base, parts)
        if plus:
            spec = {"driver": "ocdbt", "base": spec}
        _check_spec(url, spec)
        return StoreUrl(url=url, engine="tensorstore", kvstore_spec=spec, root=root)
    if scheme in _REDIS_SCHEMES:
        return StoreUrl(url=redact(url), engine="redis", redis_url=_redis_url(url, scheme, parts))
    raise _bad(url, f"has the unknown scheme {scheme!r}", f"write one of {_EXAMPLES}")


def _tensorstore_spec(url: str, base: str, parts: urllib.parse.SplitResult) -> tuple[dict[str, Any], str | None]:
    """The base kvstore spec of a tensorstore URL and its local root (file only)."""
    if base == "file":
        if parts.netloc not in ("", "localhost"):
            raise _bad(url, f"names the host or relative path start {parts.netloc!r}",
                       "the file store's directory must be an absolute path: write file:///abs/dir (three slashes)")
        path = urllib.parse.unquote(parts.path)
        if not path.startswith("/"):
            raise _bad(url, "has a relative path", "write file:///abs/dir (three slashes, an absolute path)")
        root = os.path.normpath(path)
        return {"driver": "file", "path": root.rstrip("/") + "/"}, root
    name = (parts.netloc + parts.path).strip("/") if base == "memory" else parts.netloc
    if not name or key_problem(name, prefix=False) is not None:
        what = "memory store name" if base == "memory" else "bucket"
        raise _bad(url, f"has the {what} {name!r}",
                   f"write {base}://NAME{'/path' * (base != 'memory')} with NAME of letters, digits and . _ -")
    if base == "memory":
        return {"driver": "memory", "path": name + "/"}, None
    path = parts.path.strip("/")
    if path and key_problem(path, prefix=False) is not None:
        raise _bad(url, f"has the path {path!r}", "use letters, digits and . _ / - without empty or '..' parts")
    return {"driver": "gcs" if base == "gs" else "s3", "bucket": name, "path": path + "/" if path else ""}, None


def _check_spec(url: str, spec: dict[str, Any]) -> None:
    """tensorstore's own spec rules (bucket names and the like), without opening anything."""
    import tensorstore as ts

    try:
        ts.KvStore.Spec(spec)
    except ValueError as err:
        raise _bad(url, f"gives a spec tensorstore refuses ({' '.join(str(err).split())})",
                   f"write one of {_EXAMPLES}") from None


def _redis_url(url: str, scheme: str, parts: urllib.parse.SplitResult) -> str:
    """``url`` in the ``redis`` client's scheme, its host, port and database checked."""
    client_scheme = _REDIS_SCHEMES[scheme]
    if parts.fragment:
        raise _bad(url, "has a fragment", "drop the '#...'")
    if client_scheme == "unix":
        if not parts.path.startswith("/") or parts.netloc not in ("", "localhost"):
            raise _bad(url, "has no absolute socket path", "write unix:///path/to/redis.sock?db=0")
        return "unix://" + url.partition("://")[2]
    try:
        port = parts.port
    except ValueError:
        raise _bad(url, "has a port that is not a number in 1..65535", "write e.g. redis://127.0.0.1:6379/0") from None
    if not parts.hostname or port == 0:
        raise _bad(url, "has no host or port 0", "write e.g. redis://127.0.0.1:6379/0")
    db = parts.path.strip("/")
    if db and not (db.isdigit() and db.isascii()):
        raise _bad(url, f"names the database {db!r}", "a Redis database is a number: write redis://host:port/0")
    return urllib.parse.urlunsplit(parts._replace(scheme=client_scheme))


def open_backend(url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, create: bool = True) -> StoreBackend:
    """Open the store ``url`` names (see the module docstring).

    Args:
      url: a store URL.
      timeout_s: how long one call may wait on the engine (Redis: its socket and connect
        timeouts; tensorstore: the wait on each batch), ``> 0``.
      create: create a ``file`` store's missing directory (a store a cache writes into); False
        for an operator's command, which must not create a mistyped path.

    Raises:
      ValueError: a bad URL or timeout (the message names it and the fix).
      ModuleNotFoundError: a Redis URL without the ``redis`` client installed (names the fix).
      StoreUnavailableError: the engine cannot be reached or its directory cannot be created
        (with ``create=False``: is not there).
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < 86400:
        raise ValueError(f"timeout_s={timeout_s!r} must be a number of seconds in (0, 86400); e.g. 5.0")
    parsed = parse_store_url(url)
    if parsed.engine == "redis":
        try:
            from easykv.tiers.store.redis_kv import RedisBackend
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError(f"store URL {parsed.url!r} needs the redis client ({err}); "
                                      "install it with: pip install 'redis>=5'") from err
        assert parsed.redis_url is not None  # parse_store_url sets it for every Redis URL
        return RedisBackend(parsed.url, parsed.redis_url, timeout_s=float(timeout_s))
    from easykv.tiers.store.tensorstore_kv import TensorstoreBackend

    assert parsed.kvstore_spec is not None  # and the spec for every tensorstore URL
    return TensorstoreBackend(parsed.url, parsed.kvstore_spec, root=parsed.root, timeout_s=float(timeout_s),
                             create=create)


__all__ = ["DEFAULT_TIMEOUT_S", "StoreUrl", "open_backend", "parse_store_url", "redact"]
