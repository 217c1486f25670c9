"""`Broken`: the one exception a page-manager consistency rule raises when it does not hold.

Every part of the manager (the sequence table, each group's allocator, each lower tier)
raises it from its own ``check`` pieces, and `consistency.check_consistency` runs them; the
manager turns it into `InvariantError` (a live manager: a bug) or `ManagerStateError` (a loaded
state: bad input). A leaf: it imports nothing, so every part can raise it without an import circle
(and it never imports ``storage``, ``attention``, ``checkpoint`` or ``tiers``).
"""

from __future__ import annotations


class Broken(Exception):
    """A consistency rule does not hold; ``field`` names the part of the state it concerns."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


__all__ = ["Broken"]
