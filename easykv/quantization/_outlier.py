"""4-bit codes with each token's largest values kept at 8 bits (``int4-ol``): dense and sparse.

On keys with outlier channels the attention logits are carried by those few channels, so 4 bits
there cost attention accuracy however the scales are laid out (``int4-ch`` keeps every channel
at about 9% error, ``-rot`` spreads the noise over all of them). Here each token keeps its
``outliers`` values of largest magnitude (4 by default) at 8 bits under their own step, and the
rest at 4 bits under a step set by the largest of the rest: the ordinary values are no longer
scaled by the outliers, and the outliers lose 16x less. The choice is per token, so it needs no
calibration and no read-modify-write, follows outliers that move between tokens (heavy tails)
and pages written in any order hold the same bytes.

Stored form of one layer, k = ``outliers``:

  values: (num_kv_heads, num_pages, page_size, head_dim // 2)  uint8, two 4-bit codes per byte
  scales: (num_kv_heads, num_pages, page_size, 2 + k + k // 2) uint8, per token and head:
          [0] the ordinary step's code, [1] the outliers' step code (their step is 1/16 of it),
          [2 : 2 + k] the outliers' channels, [2 + k :] the low nibbles of their 8-bit codes

Steps are log-coded bytes (``_logstep.py``). An ordinary channel holds a 4-bit code u, the value
(u + 0.5) * step. An outlier channel holds the high nibble h of an 8-bit code 16 h + l (l in the
side bytes), the value (16 h + l + 0.5) * step / 16, where 16 h + l + 0.5 = 16 (h + 0.5) + (l - 7.5):
the 4-bit code scaled plus a correction, so decoding is elementwise (no gather). With k = 4 a
token-head takes head_dim / 2 + 8 bytes: 3.56x the bf16 tokens at head_dim 128. Channels are stored in one
byte each, so head_dim is at most 256.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from easykv.quantization._logstep import inverse_steps, needed_codes, nibbles, pack, steps, unpack
from easykv.quantization._pages import QuantizedPages

MAX_HEAD_DIM = 256  # a channel index is one byte


@dataclasses.dataclass(frozen=True)
class Int4OutlierQuantizer:
    """4-bit codes plus each token's ``outliers`` largest values at 8 bits (module docstring)."""

    outliers: int = 4
    scale_dtype: ClassVar[np.dtype] = np.dtype("uint8")

    def __post_init__(self) -> None:
        k = self.outliers
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 2 or k % 2:
            raise ValueError(f"int4-ol outliers must be an even int >= 2 (two low nibbles per byte), got {k!r:.40}; "
                             "name an even count, e.g. 'int4-ol' (4) or 'int4-ol8'")

    @property
    def name(self) -> str:
        return "int4-ol" if self.outliers == 4 else f"int4-ol{self.outliers}"

    def value_shape(self, head_dim: int) -> tuple[tuple[int, ...], np.dtype]:
        return (head_dim // 2,), np.dtype("uint8")

    def scale_shape(self, head_dim: int) -> tuple[int, ...]:
        """Trailing shape of one token-head's side bytes (steps, channels, low nibbles)."""
        return (2 + self.outliers + self.outliers // 2,)

    def bytes_per_token_head(self, head_dim: int, dtype: np.dtype) -> int:
        return head_dim // 2 + self.scale_shape(head_dim)[0]

    def validate(self, head_dim: int, dtype: np.dtype) -> None:
        if head_dim % 2:
            raise ValueError(f"{self.name} packs two values per byte along head_dim, so head_dim must be even; got "
                             f"{head_dim}")
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"{self.name} stores a channel index in one byte, so head_dim must be at most "
                             f"{MAX_HEAD_DIM}; got {head_dim} (int4-ch or int8 hold any head_dim)")
        if 2 * self.outliers > head_dim:
            raise ValueError(f"{self.name} keeps {self.outliers} outliers per token, more than half of head_dim "
                             f"{head_dim}; take fewer (int4-ol<K>, K even) or int8")

    def quantize(self, x: jax.Array) -> QuantizedPages[jax.Array]:
        """Tokens ``(..., head_dim)`` -> values ``(..., head_dim // 2)`` and side bytes ``(...,
        2 + k + k // 2)``. Ties in magnitude go to the lower channel. The shape is checked as
        `validate` checks a cache's (a static check: a direct call with head_dim 512 would store
        channel indices that wrap around a byte)."""
        self.validate(x.shape[-1], np.dtype(np.float32))
        k = self.outliers
        x = x.astype(jnp.float32)
        magnitude = jnp.abs(x)
        # The k largest one argmax at a time (the first of equals), not lax.top_k: its sharding
        # rule gathers head-sharded tokens onto every device, and on XLA:CPU a top_k whose values
        # are used runs as a full sort.
        lanes = jnp.arange(x.shape[-1])
        remaining, found, hits = magnitude, [], []
        for _ in range(k):
            found.append(jnp.argmax(remaining, axis=-1))
            hits.append(lanes == found[-1][..., None])
            remaining = jnp.where(hits[-1], -1.0, remaining)
        channels = jnp.stack(found, axis=-1)
        is_outlier = jnp.stack(hits, axis=-2)  # (..., k, head_dim)
        outlier = jnp.any(is_outlier, axis=-2)
        outlier_code = needed_codes(jnp.max(magnitude, axis=-1))
        ordinary_code = needed_codes(jnp.max(remaining, axis=-1))  # the largest of the rest
        # One term per sum: an elementwise pick (a gather along head_dim shards no better than top_k).
        picked = jnp.sum(jnp.where(is_outlier, x[..., None, :], 0.0), axis=-1)
        fine = jnp.clip(jnp.floor(picked * (inverse_steps(outlier_code) * 16.0)[..., None]), -128, 127)
        fine = fine.astype(jnp.int32)
        high, low = fine >> 4, fine & 0xF
        codes = jnp.clip(jnp.floor(x * inverse_steps(ordinary_code)[..., None]), -8, 7).astype(jnp.int32)
        codes = jnp.where(outlier, jnp.sum(jnp.where(is_outlier, high[..., None], 0), axis=-2), codes)
        side = jnp.concatenate([ordinary_code[..., None], outlier_code[..., None], channels.astype(jnp.uint8),
                                pack(low)], axis=-1)
        return QuantizedPages(pack(codes), side, self)

    def dequantize(self, q: QuantizedPages[jax.Array], dtype: DTypeLike, *, rotated: bool = False) -> jax.Array:
        """Values ``(..., head_dim // 2)`` with side bytes -> ``(..., head_dim)`` in ``dtype``."""
        k = self.outliers
        side = q.scales
        half = unpack(q.values)  # code + 0.5, (..., head_dim)
        ordinary_step, outlier_step = steps(side[..., 0]), steps(side[..., 1])
        low = nibbles(side[..., 2 + k:]).astype(jnp.float32) - 7.5
        is_outlier = _one_hot(side[..., 2:2 + k].astype(jnp.int32), half.shape[-1])
        outlier = jnp.any(is_outlier, axis=-2)
        # An outlier's code + 0.5 = 16 (h + 0.5) + (l - 7.5): small half-integers, exact in float32,
        # so each value is one rounded product, the same bits eager or fused (no multiply-add).
        # The channels are distinct: at most one term of the sum is nonzero per channel.
        code = jnp.where(outlier, half * 16.0 + jnp.sum(jnp.where(is_outlier, low[..., None], 0.0), axis=-2), half)
        step = jnp.where(outlier, (outlier_step * np.float32(1 / 16))[..., None], ordinary_step[..., None])
        return (code * step).astype(dtype)


def _one_hot(channels: jax.Array, dim: int) -> jax.Array:
    """``(..., k)`` channel indices -> ``(..., k, dim)`` booleans."""
    return channels[..., None] == jnp.arange(dim, dtype=channels.dtype)
