"""The keyword options of paged attention as one frozen value, checked when it is built.

:class:`AttentionOptions` is the one definition of the options the entry points in ``api.py``
take (``paged_attention``'s keyword-only parameters are its fields, in order, with the same
defaults; a test holds them together). Each entry point turns its keywords into one
``AttentionOptions`` and hands that down, so the options are checked in one place, before
anything else about the call. What an option means against the pages (the default scale from
``head_dim``, the default block from ``page_size``, whether ``dtype`` fits the stored pages, the
layout read off the pages' sharding) is resolved in ``checks.prepare``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypedDict

import numpy as np
from numpy.typing import DTypeLike

from easykv.storage.pages import PageLayout
from easykv.validation import as_dtype, optional_int, real, show

IMPLEMENTATIONS = ("auto", "xla", "pallas_tpu", "pallas_gpu", "pallas_gpu_interpret")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def _positive_float_or_none(name: str, value: Any) -> float | None:
    return None if value is None else real(name, value, lo=0, hi=math.inf, lo_open=True, hi_open=True)


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """The keyword options of :func:`~easykv.attention.api.paged_attention`, checked and
    normalized (ints as ``int``, numbers as ``float``, ``dtype`` as ``np.dtype``), so that equal
    options compare and hash equal. ``None`` means "the default" (see ``paged_attention``).

    Raises ValueError naming the option and the value for anything out of range.
    """

    scale: float | None = None
    sliding_window: int | None = None
    chunk_size: int | None = None
    value_head_dim: int | None = None
    logit_soft_cap: float | None = None
    layout: PageLayout | None = None
    dtype: np.dtype | None = None
    implementation: str = "auto"
    pages_per_block: int | None = None
    query_block: int | None = None

    def __post_init__(self) -> None:
        checked = {
            "scale": _positive_float_or_none("scale", self.scale),
            "sliding_window": optional_int("sliding_window", self.sliding_window, lo=1),
            "chunk_size": optional_int("chunk_size", self.chunk_size, lo=1),
            "value_head_dim": optional_int("value_head_dim", self.value_head_dim, lo=1),
            "logit_soft_cap": _positive_float_or_none("logit_soft_cap", self.logit_soft_cap),
            "pages_per_block": optional_int("pages_per_block", self.pages_per_block, lo=1),
            "query_block": optional_int("query_block", self.query_block, lo=1),
            "dtype": None if self.dtype is None else _page_dtype(self.dtype),
        }
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation={show(self.implementation)}; use one of {', '.join(map(repr, IMPLEMENTATIONS))}"
            )
        if self.layout is not None and not isinstance(self.layout, PageLayout):
            raise ValueError(f"layout must be a PageLayout or None, got {type(self.layout).__name__}")
        for name, value in checked.items():  # frozen: the normalized values go in past __setattr__
            object.__setattr__(self, name, value)

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any], **fixed: Any) -> AttentionOptions:
        """The options among an entry point's arguments (its ``locals()``, taken first thing),
        plus ``fixed`` ones: the entry points name their keywords once, in their signatures,
        and this turns them into options without spelling the list out again."""
        given = {f.name: arguments[f.name] for f in dataclasses.fields(cls) if f.name in arguments}
        return cls(**given, **fixed)


class _Shared(TypedDict, total=False):
    scale: float | None
    sliding_window: int | None
    chunk_size: int | None
    value_head_dim: int | None
    logit_soft_cap: float | None


class ReferenceKeywords(_Shared, total=False):
    """The options the dense reference takes (``paged_attention_reference``'s ``**options``)."""

    dtype: DTypeLike | None


class ViewKeywords(_Shared, total=False):
    """The options ``view_attention`` passes on: all but ``layout`` and ``dtype``, the view's."""

    implementation: str
    pages_per_block: int | None
    query_block: int | None


class AttentionKeywords(ViewKeywords, total=False):
    """The options as keywords, typed for a checker (the ``**options`` the entry points pass on);
    each is checked, as above, when the options are built. Its keys are the fields of
    `AttentionOptions` (a test holds them together)."""

    layout: PageLayout | None
    dtype: DTypeLike | None


def _page_dtype(dtype: DTypeLike) -> np.dtype:
    dt = as_dtype("dtype", dtype, choices=", ".join(FLOAT_DTYPES))
    if dt.name not in FLOAT_DTYPES:
        raise ValueError(f"dtype={dt.name} is not a page dtype; use one of {', '.join(FLOAT_DTYPES)}")
    return dt


__all__ = ["FLOAT_DTYPES", "IMPLEMENTATIONS", "AttentionKeywords", "AttentionOptions", "ReferenceKeywords",
           "ViewKeywords"]
