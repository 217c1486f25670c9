"""Lock-step checks: every process runs the same program, and the page manager runs on every host
and must make the same decisions everywhere (it is deterministic). ``assert_lockstep`` all-gathers
a fingerprint of its state and names the processes that diverged, so a divergence is caught at
the step it happens instead of surfacing later as silently mixed-up pages."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Protocol, TypeAlias, cast

import jax
import numpy as np

from easykv.errors import LockstepError


class _LockstepState(Protocol):
    """The `PageManager`: its state for lock-step checks, host tier included."""

    @property
    def has_host_tier(self) -> bool: ...
    def state_dict(self, *, host_tier: bool = False) -> Mapping[str, Any]: ...


class _StateDict(Protocol):
    """Anything else that gives its state as a JSON-safe mapping."""

    def state_dict(self) -> Mapping[str, Any]: ...


#: What `assert_lockstep` compares across processes: a holder of state, or the state itself.
LockstepSource: TypeAlias = _LockstepState | _StateDict | Mapping[str, Any]


def fingerprint(state: Mapping[str, Any]) -> bytes:
    """sha256 of a JSON-safe state in canonical form (sorted keys, no whitespace).

    Args:
      state: a mapping of str keys to JSON values (no NaN); ValueError otherwise.

    Returns:
      the 32-byte digest.
    """
    try:
        text = json.dumps(state, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as err:  # objects, mixed key types, NaN, cycles
        raise ValueError(f"the state to compare across processes is not plain JSON ({err}); pass a PageManager "
                         "or a mapping of str keys to JSON values") from None
    return hashlib.sha256(text.encode()).digest()


def assert_lockstep(manager: LockstepSource, *, what: str = "page manager") -> bytes:
    """Raise ``LockstepError`` unless every process holds the same state.

    Every process must call it at the same point.

    Args:
      manager: the `PageManager` (its ``state_dict(host_tier=True)``, host tier included), anything else
        with ``state_dict()``, or a JSON-safe mapping.
      what: how the error message names the state (default ``"page manager"``).

    Returns:
      this process's fingerprint (`fingerprint`).
    """
    if hasattr(manager, "has_host_tier"):  # the PageManager: its host tier's bookkeeping included
        state = cast(_LockstepState, manager).state_dict(host_tier=True)
    else:
        state = manager.state_dict() if hasattr(manager, "state_dict") else manager
    if not isinstance(state, Mapping):
        raise ValueError(f"assert_lockstep needs an object with state_dict() or a mapping, "
                         f"got {type(manager).__name__}")
    digest = fingerprint(state)
    if jax.process_count() == 1:
        return digest
    from jax.experimental import multihost_utils

    local = np.frombuffer(digest, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(local))  # (processes, 32)
    rows = [bytes(r) for r in gathered.reshape(jax.process_count(), -1)]
    if len(set(rows)) > 1:
        groups: dict[bytes, list[int]] = {}
        for pid, row in enumerate(rows):
            groups.setdefault(row, []).append(pid)
        majority = max(groups.values(), key=lambda g: (len(g), -g[0]))
        differ = sorted(p for p in range(len(rows)) if p not in majority)
        raise LockstepError(
            f"the {what} state differs between processes: processes {differ} disagree with "
            f"processes {majority} (fingerprints "
            + ", ".join(f"{pid}:{row.hex()[:12]}" for pid, row in enumerate(rows))
            + "); every host must make the same calls in the same order"
        )
    return digest
