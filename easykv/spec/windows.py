"""The window rule, written once: which keys a query of each attention kind reads, and so which
pages a sequence of that kind may release.

A query at position ``p`` reads the keys ``first_seen(p) .. p``:

- full attention: from 0;
- a sliding window of W tokens: from ``p - W + 1`` (never before 0);
- chunks of C tokens: from ``p - p % C``, the start of its own chunk.

One small frozen class per kind (`FullAttentionRule`, `SlidingWindowRule`, `ChunkedRule`); a
layer group's is `AttentionKind.rule` (``LayerGroup.rule``). Everything that depends on a window
asks it: the sizing (`AttentionRule.pages_kept`), the manager's per-kind tables (the block-table
columns a sequence of a given length releases, where its kept positions start, what a prefix hit
needs), the step checks (the pages a step reads; whether a table kept for one kind serves a read
with another window: `AttentionRule.covers`) and attention on the device.

`AttentionRule.window_start` is written with arithmetic operators only, so one expression serves
Python ints, numpy arrays and jax arrays (traced too); `first_seen` joins the rules of one read
with the array module it is given (``numpy`` here, ``jax.numpy`` inside jit), so this module
imports no array code beyond numpy. Imports: numpy and ``validation`` only.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
from collections.abc import Sequence
from types import ModuleType
from typing import Protocol, Self, TypeVar, overload

import numpy as np

from easykv.validation import positive_int


class Positions(Protocol):
    """Token positions the rule's arithmetic reads: a Python int, a numpy or a jax array."""

    def __add__(self, other: int, /) -> Self: ...
    def __sub__(self, other: Self | int, /) -> Self: ...
    def __mul__(self, other: int, /) -> Self: ...
    def __mod__(self, other: int, /) -> Self: ...


P = TypeVar("P", bound=Positions)


class AttentionRule(abc.ABC):
    """What a query of one attention kind reads (see the module doc)."""

    @abc.abstractmethod
    def window_start(self, positions: P) -> P:
        """The first key a query at ``positions`` reads, before the clamp at position 0 (so
        negative near the start): arithmetic operators only, for ints and numpy or jax arrays
        alike. Callers clamp through `first_seen` or `first_needed_position`."""

    @abc.abstractmethod
    def pages_kept(self, full_pages: int, page_size: int) -> int:
        """Pages a sequence of ``full_pages`` pages keeps at once (the most it holds under this
        rule, its sizing unit).

        Args:
          full_pages: the pages the sequence holds under full attention (the most it keeps).
          page_size: tokens per page.
        """

    @abc.abstractmethod
    def covers(self, window: int | None, chunk: int | None) -> bool:
        """Whether a read with a sliding ``window`` and in ``chunk``-sized chunks (None: not
        bounded that way) starts, for every query position, no earlier than a table kept under
        this rule still holds pages.

        Args:
          window: the read's sliding window, in tokens (attention's ``sliding_window``).
          chunk: the read's chunk size, in tokens (attention's ``chunk_size``).
        """

    @overload
    def first_needed_position(self, positions: int) -> int: ...
    @overload
    def first_needed_position(self, positions: np.ndarray) -> np.ndarray: ...

    def first_needed_position(self, positions: int | np.ndarray) -> int | np.ndarray:
        """The first position a query at ``positions`` or later reads (an int, or elementwise
        for a numpy array of positions, of its dtype).

        Args:
          positions: the position of a sequence's next query (its length), an int or a numpy array.
        """
        if isinstance(positions, int):
            return max(self.window_start(positions), 0)
        # `first_seen(positions, (self,), np)` without its array of zeros: this runs on every commit.
        first: np.ndarray = np.maximum(self.window_start(positions), 0)
        return first

    def released_columns(self, lens: np.ndarray, page_size: int) -> np.ndarray:
        """Per length, the block-table columns (int32) wholly before what the sequence's next
        query reads: the pages a sequence of that length may release.

        Args:
          lens: sequence lengths (the positions of their next queries), a numpy array.
          page_size: tokens per page.
        """
        first = self.first_needed_position(np.asarray(lens, np.int64))
        return (first // page_size).astype(np.int32)

    def first_kept_position(self, length: int, floor: int) -> int:
        """The first position of a sequence of ``length`` tokens whose K/V a table kept under
        this rule holds and its next query may read: where its window starts, or its ``floor``
        (a resumed sequence's first position with K/V) while the window still reaches before it.

        Args:
          length: the sequence's tokens written.
          floor: its first position with K/V (0 unless it was resumed in the middle).
        """
        return max(self.first_needed_position(int(length)), int(floor))


@dataclasses.dataclass(frozen=True)
class FullAttentionRule(AttentionRule):
    """Full attention: every query reads from position 0, so a sequence keeps every page."""

    def window_start(self, positions: P) -> P:
        return positions * 0  # position 0, in the positions' own type and shape

    @overload
    def first_needed_position(self, positions: int) -> int: ...
    @overload
    def first_needed_position(self, positions: np.ndarray) -> np.ndarray: ...

    def first_needed_position(self, positions: int | np.ndarray) -> int | np.ndarray:
        return 0 if isinstance(positions, int) else np.zeros_like(positions)  # always 0: no arithmetic

    def released_columns(self, lens: np.ndarray, page_size: int) -> np.ndarray:
        return np.zeros(np.shape(lens), np.int32)

    def pages_kept(self, full_pages: int, page_size: int) -> int:
        return full_pages

    def covers(self, window: int | None, chunk: int | None) -> bool:
        return True  # every page is kept: any read is served

    def first_kept_position(self, length: int, floor: int) -> int:
        return 0  # a resumed sequence (a floor) never lives in a cache with a full-attention group


@dataclasses.dataclass(frozen=True)
class SlidingWindowRule(AttentionRule):
    """A sliding window of ``size`` tokens: a query at p reads p - size + 1 .. p, so a sequence
    keeps the ``ceil((size - 1) / page_size) + 1`` pages its window touches, one page leaving as
    one enters."""

    size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", positive_int("window", self.size, hint="a sliding window in tokens"))

    def window_start(self, positions: P) -> P:
        return positions - self.size + 1

    def pages_kept(self, full_pages: int, page_size: int) -> int:
        return min(full_pages, math.ceil((self.size - 1) / page_size) + 1)

    def covers(self, window: int | None, chunk: int | None) -> bool:
        return window is not None and window <= self.size


@dataclasses.dataclass(frozen=True)
class ChunkedRule(AttentionRule):
    """Chunks of ``size`` tokens (Llama 4's local layers): a query reads only its own chunk
    ``[k * size, (k + 1) * size)``. With ``size`` a multiple of the page size (`check_groups`),
    a sequence keeps exactly its current chunk's ``size / page_size`` pages, all released at
    once when the next chunk starts."""

    size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", positive_int("window (the chunk size)", self.size,
                                                      hint="a chunk size in tokens"))

    def window_start(self, positions: P) -> P:
        return positions - positions % self.size

    def pages_kept(self, full_pages: int, page_size: int) -> int:
        return min(full_pages, self.size // page_size)

    def covers(self, window: int | None, chunk: int | None) -> bool:
        return chunk is not None and self.size % chunk == 0  # every read chunk lies inside a kept one


@functools.lru_cache(maxsize=256, typed=True)  # typed: True is no window of 1 (positive_int refuses it)
def read_rules(window: int | None, chunk: int | None) -> tuple[AttentionRule, ...]:
    """The rules of one read (attention's ``sliding_window=`` and ``chunk_size=``; None: not
    bounded that way): a query reads the keys every one of them allows, from 0 with none.
    Cached: the step checks ask on every call.

    Args:
      window: the read's sliding window, in tokens, or None.
      chunk: the read's chunk size, in tokens, or None.

    Raises:
      ValueError: ``window`` or ``chunk`` is not a positive int (nor None).
    """
    return ((() if window is None else (SlidingWindowRule(window),))
            + (() if chunk is None else (ChunkedRule(chunk),)))


def first_seen(positions: P, rules: Sequence[AttentionRule], xp: ModuleType) -> P:
    """The first key a query at ``positions`` reads under every rule of ``rules`` at once (each
    rule's window start, never before position 0), elementwise.

    Args:
      positions: the queries' positions, an array of ``xp``.
      rules: the rules of the read (`read_rules`; one layer group's: ``(group.rule,)``).
      xp: the array module of ``positions``: ``numpy``, or ``jax.numpy`` inside jit.
    """
    first: P = xp.zeros_like(positions)
    for rule in rules:
        first = xp.maximum(first, rule.window_start(positions))
    return first


__all__ = ["AttentionRule", "ChunkedRule", "FullAttentionRule", "Positions", "SlidingWindowRule", "first_seen",
           "read_rules"]
