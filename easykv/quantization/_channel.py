"""Per-channel scales per page (``int4-ch``): KIVI's remedy for outlier channels.

Real keys carry a few channels tens of times larger than the rest. A scale per token is set by
those channels and leaves the ordinary ones a handful of levels; a scale per channel gives every
channel its own grid. A channel's scale must cover the tokens that share it, so it is kept per
page: the page's tokens of one channel share one scale.

Stored form of one layer:

  values: (num_kv_heads, num_pages, page_size, head_dim // 2)  uint8, two 4-bit codes per byte
  scales: (num_kv_heads, num_pages, head_dim)                  uint8, a log-coded step per channel

Codes and steps are those of ``_logstep.py`` (a 4-bit code u stands for (u + 0.5) * step, a scale
byte c for step 2 ** ((c - 128) / 4), 19% apart); c = 0 is an empty channel (step 0, values 0),
which is what a zero-filled pool holds. One byte per channel per page keeps 3.56x the bf16 tokens
at page_size 16 (head_dim // 2 + head_dim / page_size bytes per token-head). Values beyond
7.5 * 2**31.75 (2.5e10) saturate at the largest code.

Tokens arrive one at a time in decode, so a page's scales grow as it fills: a write takes the
larger of the page's scale code and the new tokens' needs, and the page's earlier codes are
requantized to the grown step (``requantize``). Each growth rounds the earlier tokens once more
(about 10% more error in a decoded page than in one written whole). The write path lives in
``easykv.storage.writes``; this module holds the arithmetic.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from easykv.quantization._logstep import inverse_steps, needed_codes, pack, steps, unpack
from easykv.quantization._pages import QuantizedPages


@dataclasses.dataclass(frozen=True)
class Int4ChannelQuantizer:
    """4-bit codes with one log-coded scale per channel per page (see the module docstring).

    ``quantize`` takes whole pages ``(..., page_size, head_dim)``; writes of single tokens go
    through ``needed_codes`` / ``requantize`` / ``encode`` (the write path's read-modify-write)."""

    name: ClassVar[str] = "int4-ch"
    scales_per_page: ClassVar[bool] = True
    scale_dtype: ClassVar[np.dtype] = np.dtype("uint8")

    def value_shape(self, head_dim: int) -> tuple[tuple[int, ...], np.dtype]:
        return (head_dim // 2,), np.dtype("uint8")

    def scale_shape(self, head_dim: int) -> tuple[int, ...]:
        """Trailing shape of the scales of one page of one head (not of one token)."""
        return (head_dim,)

    def bytes_per_token_head(self, head_dim: int, dtype: np.dtype) -> int:
        """The codes of one token-head; the scales are per page (``bytes_per_page_head``)."""
        return head_dim // 2

    def bytes_per_page_head(self, page_size: int, head_dim: int, dtype: np.dtype) -> int:
        return page_size * (head_dim // 2) + head_dim

    def validate(self, head_dim: int, dtype: np.dtype) -> None:
        if head_dim % 2:
            raise ValueError(f"int4-ch packs two values per byte along head_dim, so head_dim must be even; got "
                             f"{head_dim}")

    # ---- the arithmetic ------------------------------------------------------------------------
    steps = staticmethod(steps)
    needed_codes = staticmethod(needed_codes)

    @classmethod
    def encode(cls, x: jax.Array, codes: jax.Array) -> jax.Array:
        """Tokens ``(..., head_dim)`` under scale codes broadcastable to them -> packed uint8 codes."""
        return pack(jnp.clip(jnp.floor(x.astype(jnp.float32) * inverse_steps(codes)), -8, 7))

    @classmethod
    def requantize(cls, packed: jax.Array, old: jax.Array, new: jax.Array) -> jax.Array:
        """Packed codes ``(..., head_dim // 2)`` under scale codes ``old`` -> the same values under
        the larger ``new`` (both broadcastable to ``(..., head_dim)``); unchanged where old == new."""
        ratio = cls.steps(old) * (1.0 / jnp.where(new == 0, 1.0, cls.steps(new)))
        return pack(jnp.clip(jnp.floor(unpack(packed) * ratio), -8, 7))

    # ---- whole pages -----------------------------------------------------------------------------
    def quantize(self, x: jax.Array) -> QuantizedPages[jax.Array]:
        """Whole pages ``(..., page_size, head_dim)`` -> values ``(..., page_size, head_dim // 2)`` and
        scale codes ``(..., head_dim)`` (the max over each page's tokens)."""
        codes = jnp.max(self.needed_codes(x), axis=-2)
        return QuantizedPages(self.encode(x, codes[..., None, :]), codes, self)

    def dequantize(self, q: QuantizedPages[jax.Array], dtype: DTypeLike, *, rotated: bool = False) -> jax.Array:
        """Pages ``(..., page_size, head_dim // 2)`` with scales ``(..., head_dim)`` -> ``(...,
        page_size, head_dim)`` in ``dtype``."""
        return (unpack(q.values) * self.steps(q.scales)[..., None, :]).astype(dtype)
