"""The logical dtypes a cache (or one of its layer groups) stores.

Compressed formats (int8, fp8, int4) are quantizers, not cache dtypes: a quantized group keeps
its logical dtype for what reads give back."""

from __future__ import annotations

import numpy as np
from numpy.typing import DTypeLike

from easykv.validation import as_dtype

SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def canonical_dtype(dtype: DTypeLike) -> np.dtype:
    """The numpy dtype for a user's dtype argument, or a ValueError naming the choices."""
    choices = f"{', '.join(SUPPORTED_DTYPES)} (int8/fp8/int4 storage is chosen with quantizer=...)"
    dt = as_dtype("dtype", dtype, choices=choices)
    if not dt.isnative:  # '>f4' names float32 in another byte order: bits would be misread
        raise ValueError(f"dtype {dt.str} is {dt.name} in a byte order other than this machine's; use {dt.name}")
    if dt.name not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dt.name} is not a cache dtype; use one of {choices}")
    return dt


__all__ = ["SUPPORTED_DTYPES", "canonical_dtype"]
