"""Quantizers: how new tokens become stored page values, and what one stored token-head costs.

A quantizer is chosen once per cache (by name or as an object) and recorded in the metadata by
name. Sizing asks it for the bytes of one stored token-head so that a compressed cache really
holds more pages in the same memory.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Quantizer(Protocol):
    """What the cache needs of a quantizer."""

    name: str

    def bytes_per_token_head(self, head_dim: int, dtype: np.dtype) -> int:
        """Stored bytes of one token of one kv head, values and scales together."""
        ...

    def validate(self, head_dim: int, dtype: np.dtype) -> None:
        """Raise ValueError if this quantizer cannot store ``head_dim`` values of ``dtype``."""
        ...


@dataclasses.dataclass(frozen=True)
class NoQuantizer:
    """Pages hold the cache dtype itself."""

    name: str = "none"

    def bytes_per_token_head(self, head_dim: int, dtype: np.dtype) -> int:
        return head_dim * np.dtype(dtype).itemsize

    def validate(self, head_dim: int, dtype: np.dtype) -> None:
        return None


_REGISTRY: dict[str, Quantizer] = {"none": NoQuantizer()}


def available_quantizers() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def get_quantizer(quantizer: str | Quantizer | None) -> Quantizer:
    """Resolve ``None``, a registered name, or a quantizer object to a quantizer object."""
    if quantizer is None:
        return _REGISTRY["none"]
    if isinstance(quantizer, str):
        key = quantizer.lower()
        if key not in _REGISTRY:
            raise ValueError(
                f"unknown quantizer {quantizer!r}; available: {', '.join(available_quantizers())}"
            )
        return _REGISTRY[key]
    if isinstance(quantizer, Quantizer):
        return quantizer
    raise ValueError(
        f"quantizer must be None, a name ({', '.join(available_quantizers())}) or a Quantizer "
        f"object, got {type(quantizer).__name__}: {quantizer!r}"
    )
