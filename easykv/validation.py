"""Argument checks shared by the public entry points: one wording for one mistake."""

from __future__ import annotations

from typing import Any

import numpy as np


def non_negative_int(name: str, value: Any) -> int:
    """``value`` as an int, or a ValueError naming ``name`` and the value (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)
