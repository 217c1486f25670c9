"""Log-coded one-byte steps, the arithmetic ``int4-ch`` (a step per channel per page) and
``int4-ol`` (steps per token) share, and the packing of 4-bit codes every int4 format uses.

A scale code c in 1..255 stands for the step ``2 ** ((c - 128) / 4)`` (steps 2**-31.75 ..
2**31.75, 19% apart); c = 0 is step 0, so a zero-filled pool decodes to zeros. A 4-bit code u in
[-8, 7] stands for ``(u + 0.5) * step``: all 16 codes used, no zero, the largest ``7.5 * step``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


def steps(codes: jax.Array) -> jax.Array:
    """Scale codes (uint8) -> float32 steps; code 0 -> 0."""
    c = codes.astype(jnp.int32)
    return jnp.where(c == 0, 0.0, _scaled_pow2(_ROOTS, jnp.maximum(c, 1)))


def inverse_steps(codes: jax.Array) -> jax.Array:
    """``1 / step`` of scale codes, 0 for code 0 (so an empty scale encodes every value as 0)."""
    step = steps(codes)
    return jnp.where(step == 0, 0.0, 1.0 / jnp.where(step == 0, 1.0, step))


def needed_codes(x: jax.Array) -> jax.Array:
    """The smallest scale code whose step holds ``x`` (``|x| <= 7.5 * step``), elementwise,
    uint8; 0 for x = 0 (and float32 subnormals, which XLA flushes to zero), 255 (saturating)
    beyond the largest (7.5 * 2**31.75, 2.5e10). The log gives a guess within one code; exact
    comparisons settle it."""
    a = jnp.abs(x.astype(jnp.float32))
    guess = jnp.ceil(jnp.log2(jnp.maximum(a, np.float32(1e-38)) * np.float32(1.0 / 7.5)) * _PER_OCTAVE) + _BIAS
    code = jnp.clip(guess, 1, 255).astype(jnp.int32)
    code = jnp.where((_scaled_pow2(_HOLDS, code) < a) & (code < 255), code + 1, code)
    code = jnp.where((code > 1) & (_scaled_pow2(_HOLDS, jnp.maximum(code - 1, 1)) >= a), code - 1, code)
    return jnp.where(a > 0, code, 0).astype(jnp.uint8)


def pack(codes: jax.Array) -> jax.Array:
    """int codes in [-8, 7] ``(..., n)`` -> uint8 ``(..., n // 2)``, low nibble first (a code in
    [0, 15] packs as itself)."""
    nibbles = (codes.astype(jnp.int8) & 0xF).astype(jnp.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def nibbles(packed: jax.Array) -> jax.Array:
    """uint8 ``(..., n // 2)`` -> its nibbles ``(..., n)`` in [0, 15], low nibble first."""
    return jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def unpack(packed: jax.Array) -> jax.Array:
    """uint8 ``(..., head_dim // 2)`` -> float32 ``code + 0.5`` ``(..., head_dim)``: a two's-complement
    nibble n is the code (n ^ 8) - 8, exact in float32."""
    return (nibbles(packed) ^ 8).astype(jnp.float32) - 7.5
