"""A plain numpy model of ``int4-ch`` pages (a scale per channel per page) and of their writes,
written from the format's definition (easykv/quantization/_channel.py) for the tests to compare
the cache against, code for code.

State: codes ``(layers, heads, pages, page_size, head_dim)`` int in [-8, 7] and scale codes
``(layers, heads, pages, head_dim)`` in 0..255; the value of a code u under scale code c is
``(u + 0.5) * 2 ** ((c - 128) / 4)`` (c = 0: 0).
"""

from __future__ import annotations

import numpy as np

STEPS = np.where(np.arange(256) == 0, 0.0, np.exp2((np.arange(256) - 128) / 4)).astype(np.float32)
LIMITS = (7.5 * STEPS.astype(np.float64)).astype(np.float32)


def needed(x: np.ndarray) -> np.ndarray:
    """Smallest code c >= 1 with |x| <= LIMITS[c] (255 beyond), 0 for x = 0, by brute force."""
    a = np.abs(np.asarray(x, np.float32))[..., None]
    code = np.argmax(LIMITS[None, 1:] >= a, axis=-1) + 1
    code = np.where((LIMITS[1:] >= a).any(axis=-1), code, 255)
    return np.where(a[..., 0] > 0, code, 0)


def encode(x: np.ndarray, codes: np.ndarray) -> np.ndarray:
    step = STEPS[codes]
    inverse = np.where(step == 0, np.float32(0), np.float32(1) / np.where(step == 0, np.float32(1), step))
    return np.clip(np.floor(np.asarray(x, np.float32) * inverse), -8, 7).astype(np.int64)


def values(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Codes ``(..., page_size, d)`` under scale codes ``(..., d)`` -> float32 values."""
    return ((codes.astype(np.float32) + np.float32(0.5)) * STEPS[scales][..., None, :]).astype(np.float32)


class ChannelPages:
    """The state of one stacked int4-ch page array and what a write does to it."""

    def __init__(self, layers: int, heads: int, pages: int, page_size: int, dim: int):
        self.codes = np.zeros((layers, heads, pages, page_size, dim), np.int64)  # a zero byte: code 0
        self.scales = np.zeros((layers, heads, pages, dim), np.int64)
        self.page_size = page_size

    def write(self, rows: np.ndarray, slots: np.ndarray, layers: list[int] | None = None) -> None:
        """Token rows ``(layers, tokens, heads, d)`` at ``slots`` (negative or beyond the pool:
        dropped): per page touched, the scale is the larger of the page's (0 when a token lands
        on the page's first slot) and the new tokens' needs; the page's other codes are moved
        to that scale, then the tokens are encoded under it."""
        layers = list(range(self.codes.shape[0])) if layers is None else layers
        ps, pool = self.page_size, self.codes.shape[2]
        slots = np.asarray(slots)
        live = [(t, int(s) // ps, int(s) % ps) for t, s in enumerate(slots) if 0 <= s < pool * ps]
        for page in sorted({p for _, p, _ in live}):
            mine = [(t, o) for t, p, o in live if p == page]
            for i, layer in enumerate(layers):
                old = np.zeros_like(self.scales[layer, :, page]) if any(o == 0 for _, o in mine) \
                    else self.scales[layer, :, page]
                need = np.max(np.stack([needed(rows[i, t]) for t, _ in mine]), axis=0)
                new = np.maximum(old, need)  # (heads, d)
                if not any(o == 0 for _, o in mine):
                    ratio = STEPS[old] * (np.float32(1) / np.where(new == 0, np.float32(1), STEPS[new]))
                    moved = (self.codes[layer, :, page].astype(np.float32) + np.float32(0.5)) * ratio[:, None, :]
                    self.codes[layer, :, page] = np.clip(np.floor(moved), -8, 7)
                self.scales[layer, :, page] = new
                for t, o in mine:
                    self.codes[layer, :, page, o] = encode(rows[i, t], new)

    def read(self, layer: int) -> np.ndarray:
        """Every page's values of ``layer`` ``(heads, pages, page_size, d)``."""
        return values(self.codes[layer], self.scales[layer])
