"""Per-channel scales per page (``int4-ch``): KIVI's remedy for outlier channels.

Real keys carry a few channels tens of times larger than the rest. A scale per token is set by
those channels and leaves the ordinary ones a handful of levels; a scale per channel gives every
channel its own grid. A channel's scale must cover the tokens that share it, so it is kept per
page: the page's tokens of one channel share one scale.

Stored form of one layer:

  values: (num_kv_heads, num_pages, page_size, head_dim // 2)  uint8, two 4-bit codes per byte
  scales: (num_kv_heads, num_pages, head_dim)                  uint8, a log-coded step per channel

A code u in [-8, 7] stands for (u + 0.5) * step, step = 2 ** ((c - 128) / 4) for scale code c in
1..255 (steps 2**-31.75 .. 2**31.75, 19% apart); c = 0 is an empty channel (step 0, values 0),
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
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from easykv.quantization._pages import QuantizedPages

_BIAS, _PER_OCTAVE = 128, 4
# step(c) = 2 ** ((c - 128) / 4) = _ROOTS[r] * 2 ** e with c - 128 = 4 e + r, and the largest value
# it holds, 7.5 * step, = _HOLDS[r] * 2 ** e: both exact in float32 (a power of two only moves the
# exponent), so they are computed, not looked up (a table gather under a sharded index trips
# sharding propagation), and every backend gets the same bits as float64 rounded once.
_ROOTS = np.exp2(np.arange(_PER_OCTAVE) / _PER_OCTAVE).astype(np.float32)
_HOLDS = (7.5 * np.exp2(np.arange(_PER_OCTAVE) / _PER_OCTAVE)).astype(np.float32)


def _scaled_pow2(table: np.ndarray, codes: jax.Array) -> jax.Array:
    """``table[r] * 2 ** e`` for int32 ``codes`` - 128 = 4 e + r (codes 1..255), float32."""
    k = codes - _BIAS
    e, r = k >> 2, k & 3
    base = jnp.where(r == 0, table[0], jnp.where(r == 1, table[1], jnp.where(r == 2, table[2], table[3])))
    return base * jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)

def _pack(codes: jax.Array) -> jax.Array:
    """int codes in [-8, 7] ``(..., head_dim)`` -> uint8 ``(..., head_dim // 2)``, low nibble first."""
    nibbles = (codes.astype(jnp.int8) & 0xF).astype(jnp.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def _unpack(packed: jax.Array) -> jax.Array:
    """uint8 ``(..., head_dim // 2)`` -> float32 ``code + 0.5`` ``(..., head_dim)``: a two's-complement
    nibble n is the code (n ^ 8) - 8, exact in float32."""
    nibbles = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))
    return (nibbles ^ 8).astype(jnp.float32) - 7.5


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
    @staticmethod
    def steps(codes: jax.Array) -> jax.Array:
        """Scale codes (uint8) -> float32 steps; code 0 -> 0."""
        c = codes.astype(jnp.int32)
        return jnp.where(c == 0, 0.0, _scaled_pow2(_ROOTS, jnp.maximum(c, 1)))

    @staticmethod
    def needed_codes(x: jax.Array) -> jax.Array:
        """The smallest scale code whose step holds ``x`` (``|x| <= 7.5 * step``), elementwise,
        uint8; 0 for x = 0 (and float32 subnormals, which XLA flushes to zero), 255 (saturating)
        beyond the largest. The log gives a guess within one code; exact comparisons settle it."""
        a = jnp.abs(x.astype(jnp.float32))
        guess = jnp.ceil(jnp.log2(jnp.maximum(a, np.float32(1e-38)) * np.float32(1.0 / 7.5)) * _PER_OCTAVE) + _BIAS
        code = jnp.clip(guess, 1, 255).astype(jnp.int32)
        code = jnp.where((_scaled_pow2(_HOLDS, code) < a) & (code < 255), code + 1, code)
        code = jnp.where((code > 1) & (_scaled_pow2(_HOLDS, jnp.maximum(code - 1, 1)) >= a), code - 1, code)
        return jnp.where(a > 0, code, 0).astype(jnp.uint8)

    @classmethod
    def encode(cls, x: jax.Array, codes: jax.Array) -> jax.Array:
        """Tokens ``(..., head_dim)`` under scale codes broadcastable to them -> packed uint8 codes."""
        step = cls.steps(codes)
        inverse = jnp.where(step == 0, 0.0, 1.0 / jnp.where(step == 0, 1.0, step))
        return _pack(jnp.clip(jnp.floor(x.astype(jnp.float32) * inverse), -8, 7))

    @classmethod
    def requantize(cls, packed: jax.Array, old: jax.Array, new: jax.Array) -> jax.Array:
        """Packed codes ``(..., head_dim // 2)`` under scale codes ``old`` -> the same values under
        the larger ``new`` (both broadcastable to ``(..., head_dim)``); unchanged where old == new."""
        ratio = cls.steps(old) * (1.0 / jnp.where(new == 0, 1.0, cls.steps(new)))
        return _pack(jnp.clip(jnp.floor(_unpack(packed) * ratio), -8, 7))

    # ---- whole pages -----------------------------------------------------------------------------
    def quantize(self, x: jax.Array) -> QuantizedPages:
        """Whole pages ``(..., page_size, head_dim)`` -> values ``(..., page_size, head_dim // 2)`` and
        scale codes ``(..., head_dim)`` (the max over each page's tokens)."""
        codes = jnp.max(self.needed_codes(x), axis=-2)
        return QuantizedPages(self.encode(x, codes[..., None, :]), codes, self)

    def dequantize(self, q: QuantizedPages, dtype: Any, *, rotated: bool = False) -> jax.Array:
        """Pages ``(..., page_size, head_dim // 2)`` with scales ``(..., head_dim)`` -> ``(...,
        page_size, head_dim)`` in ``dtype``."""
        return (_unpack(q.values) * self.steps(q.scales)[..., None, :]).astype(dtype)
