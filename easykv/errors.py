"""The typed errors of the page manager, one per tier of trouble.

A caller must be able to tell three things apart without parsing messages:

* the cache is full (expected under load; the scheduler preempts or waits): `CacheFullError`;
* the caller passed a bad value (a bug in the caller; nothing changed): `ValueError`, or
  `UnknownSequenceError` for sequence ids that are not (or no longer) claimed;
* the manager broke its own bookkeeping (a bug in easykv): `InvariantError`.
"""

from __future__ import annotations


class CacheFullError(RuntimeError):
    """The pool (or the batch's sequence slots) cannot hold what was asked; nothing changed.

    ``resource`` is ``"pages"`` or ``"sequence slots"``; ``needed`` and ``available`` count it;
    ``replica`` is the data-parallel replica that ran out (None when the pool is not split).
    """

    def __init__(self, message: str, *, resource: str, needed: int, available: int, replica: int | None = None):
        super().__init__(message)
        self.resource = resource
        self.needed = needed
        self.available = available
        self.replica = replica


class UnknownSequenceError(KeyError, ValueError):
    """A sequence id that is not claimed (never claimed, or already released).

    A KeyError (the id is a key the manager does not hold) and a ValueError (it is bad input),
    so callers may catch either.
    """

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class InvariantError(AssertionError):
    """The page manager's bookkeeping is inconsistent. This is a bug in easykv, never bad input."""

    def __init__(self, message: str):
        super().__init__(f"easykv bug: page manager invariant broken: {message}. Please report it with the calls that led here.")


__all__ = ["CacheFullError", "InvariantError", "UnknownSequenceError"]
