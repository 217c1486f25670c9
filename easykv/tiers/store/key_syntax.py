"""The syntax of store keys, checked in one place by every backend before anything is sent
(`check_keys`, `check_prefix`, `check_distinct`) and by `easykv.tiers.store.url` for memory
names and bucket paths (`key_problem`), and the shape of the keys easykv writes (`is_store_key`),
by which a backend's ``stats`` and ``gc`` tell easykv's values from anything else under its root.

A key is ASCII ``[A-Za-z0-9._/-]``, 1 to 512 characters, of ``/``-separated components none of
which is empty, ``.`` or holds ``..``: a file store maps a key to a path under its root, so no key
may leave the root or name a directory; a Redis ``SCAN MATCH`` pattern built from a prefix holds
no glob character. Imports only the key scheme and the digest width of the keys
`easykv.tiers.store.namespace` builds.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from easykv.manager.prefix_hash import DIGEST_BYTES
from easykv.tiers.store.namespace import GROUP_HEX, KEY_SCHEME

MAX_KEY_LENGTH = 512
_KEY_CHARS = re.compile(r"[A-Za-z0-9._/-]*")
# ``<scheme>/<model slug>/<group namespace hex>/<page digest hex>/<kv head>``, as
# StoreNamespace.key builds it (tests/tiers/store/test_backends.py checks the two agree).
_STORE_KEY = re.compile(rf"{re.escape(KEY_SCHEME)}/[A-Za-z0-9_.-]+/[0-9a-f]{{{GROUP_HEX}}}/"
                        rf"[0-9a-f]{{{2 * DIGEST_BYTES}}}/(0|[1-9][0-9]*)")


def key_problem(text: object, *, prefix: bool) -> str | None:
    """What is wrong with ``text`` as a key (or a key prefix), None when it is fine."""
    if not isinstance(text, str):
        return f"is a {type(text).__name__}, not a str"
    if not prefix and not text:
        return "is empty"
    if len(text) > MAX_KEY_LENGTH:
        return f"has {len(text)} characters, more than {MAX_KEY_LENGTH}"
    if not _KEY_CHARS.fullmatch(text):
        bad = sorted({c for c in text if not _KEY_CHARS.fullmatch(c)})
        return f"holds {''.join(bad)!r}; use only ASCII letters, digits and . _ / -"
    parts = text.split("/")
    if prefix:  # a prefix may end inside a component or right after a '/'
        parts = parts[:-1] + ([parts[-1]] if parts[-1] else [])
    if "" in parts:
        return "has an empty component (a leading, trailing or doubled '/')"
    if any(p == "." or ".." in p for p in parts):
        return "has a '.' component or holds '..' (keys map to paths under a file store's root)"
    return None


def is_store_key(key: str) -> bool:
    """Whether ``key`` has the shape of a key easykv writes (a value of some cache's page): what
    ``stats`` and ``gc`` count and delete; anything else under a store's root is left alone."""
    return len(key) <= MAX_KEY_LENGTH and _STORE_KEY.fullmatch(key) is not None


def check_keys(keys: Sequence[str]) -> None:
    """Raise ValueError naming the first key of ``keys`` a backend must refuse (see the module
    docstring for the syntax), before anything is sent."""
    if isinstance(keys, str | bytes):
        raise TypeError(f"keys must be a sequence of str, got the single {type(keys).__name__} {keys[:80]!r}; "
                        "wrap one key in a list")
    for i, key in enumerate(keys):
        problem = key_problem(key, prefix=False)
        if problem is not None:
            raise ValueError(f"store key {i} {str(key)[:80]!r} {problem}")


def check_prefix(prefix: str) -> None:
    """Raise ValueError when ``prefix`` cannot start any valid key ("" is every key)."""
    problem = key_problem(prefix, prefix=True)
    if problem is not None:
        raise ValueError(f"store key prefix {str(prefix)[:80]!r} {problem}")


def check_distinct(keys: Sequence[str]) -> None:
    """Raise ValueError naming a key given twice (one write per key per call)."""
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise ValueError(f"store key {key[:80]!r} is given twice in one put_if_absent; give each key once")
        seen.add(key)


def check_items(items: Sequence[tuple[str, bytes]]) -> list[str]:
    """The keys of ``put_if_absent``'s ``items``, each checked (`check_keys`, `check_distinct`) and each value bytes.

    Raises:
      ValueError: a bad or repeated key.
      TypeError: a value that is not bytes."""
    keys = [key for key, _ in items]
    check_keys(keys)
    check_distinct(keys)
    for key, value in items:
        if not isinstance(value, bytes):
            raise TypeError(f"the value of store key {key!r} is a {type(value).__name__}; give bytes")
    return keys


__all__ = ["MAX_KEY_LENGTH", "check_distinct", "check_items", "check_keys", "check_prefix", "is_store_key",
           "key_problem"]
