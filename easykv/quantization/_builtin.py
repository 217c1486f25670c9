"""The built-in quantizers: int8, fp8 and int4 (per group, asymmetric), each with or without
the rotation of ``_rotation.py``.

Every scale is computed in float32 with reciprocals written out (``x * (1 / s)``), so eager and
jitted code, on any jax version, store the same codes: XLA may turn ``a / b`` into ``a * (1 / b)``
inside a fused jit but not in an eager op, and codes of values on a grid point then differed by
one step between paths.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from easykv.quantization._logstep import nibbles as unpacked_nibbles
from easykv.quantization._logstep import pack
from easykv.quantization._pages import SCALE_DTYPE, QuantizedPages
from easykv.quantization._rotation import Rotation


def _grouped(x: jax.Array, groups: int) -> jax.Array:
    """x ``(..., head_dim)`` as float32 ``(..., groups, head_dim / groups)``."""
    return x.astype(jnp.float32).reshape(x.shape[:-1] + (groups, x.shape[-1] // groups))


def _absmax_scale(xg: jax.Array, qmax: float) -> jax.Array:
    """Per-group scales ``s = absmax * (1 / qmax)`` of grouped ``xg``."""
    return jnp.max(jnp.abs(xg), axis=-1) * np.float32(1.0 / qmax)


def _scaled(xg: jax.Array, scale: jax.Array) -> jax.Array:
    """``x * (1 / s)`` per group; a constant group (s = 0) uses 1 so it stores exact codes."""
    return xg * (1.0 / jnp.where(scale == 0, 1.0, scale))[..., None]


class _Rotating:
    """``rotate=True`` (a field of each quantizer, its last): tokens are rotated (``Rotation``)
    before they are quantized; dequantized values are rotated back unless ``rotated=True`` asks
    for them in the rotated basis."""

    rotate: bool

    def rotation(self, head_dim: int) -> Rotation | None:
        return Rotation(head_dim) if self.rotate else None

    def _suffix(self) -> str:
        return "-rot" if self.rotate else ""

    def _into_basis(self, x: jax.Array) -> jax.Array:
        return Rotation(x.shape[-1]).apply(x) if self.rotate else x

    def _out_of_basis(self, values: jax.Array, dtype: DTypeLike, rotated: bool) -> jax.Array:
        if self.rotate and not rotated:
            values = Rotation(values.shape[-1]).undo(values)
        return values.astype(dtype)


@dataclasses.dataclass(frozen=True)
class _Grid:
    """A one-byte code: values in ``[-qmax, qmax]`` stored as ``dtype``; ``rounds``: an integer
    grid (float8 rounds in its own cast)."""

    qmax: float
    dtype: Any
    rounds: bool


class _BytePerValueQuantizer(_Rotating):
    """One byte per value with one absmax scale per token and head; subclasses set the grid."""

    _base: ClassVar[str]
    _grid: ClassVar[_Grid]

    @property
    def name(self) -> str:
        return self._base + self._suffix()

    def value_shape(self, head_dim: int) -> tuple[tuple[int, ...], np.dtype]:
        return (head_dim,), np.dtype(self._grid.dtype)

    def scale_shape(self, head_dim: int) -> tuple[int, ...]:
        return ()

    def bytes_per_token_head(self, head_dim: int, dtype: np.dtype) -> int:
        return head_dim + SCALE_DTYPE.itemsize

    def validate(self, head_dim: int, dtype: np.dtype) -> None:
        return None

    def quantize(self, x: jax.Array) -> QuantizedPages[jax.Array]:
        grid = self._grid
        xg = _grouped(self._into_basis(x), 1)
        scale = _absmax_scale(xg, grid.qmax)
        scaled = _scaled(xg, scale)
        codes = jnp.clip(jnp.round(scaled) if grid.rounds else scaled, -grid.qmax, grid.qmax).astype(grid.dtype)
        return QuantizedPages(codes.reshape(x.shape), scale[..., 0], self)

    def dequantize(self, q: QuantizedPages[jax.Array], dtype: DTypeLike, *, rotated: bool = False) -> jax.Array:
        return self._out_of_basis(q.values.astype(jnp.float32) * q.scales[..., None], dtype, rotated)


@dataclasses.dataclass(frozen=True)
class Int8Quantizer(_BytePerValueQuantizer):
    """Symmetric int8: round(x * (1 / s)) with s = absmax * (1 / 127), per token and head."""

    rotate: bool = False
    _base: ClassVar[str] = "int8"
    _grid: ClassVar[_Grid] = _Grid(127.0, np.int8, rounds=True)


@dataclasses.dataclass(frozen=True)
class Fp8Quantizer(_BytePerValueQuantizer):
    """float8_e4m3fn values, absmax per token and head mapped to 448 (the format's maximum)."""

    rotate: bool = False
    _base: ClassVar[str] = "fp8"
    _grid: ClassVar[_Grid] = _Grid(448.0, jnp.float8_e4m3fn, rounds=False)


@dataclasses.dataclass(frozen=True)
class Int4Quantizer(_Rotating):
    """4-bit codes, two per byte along head_dim (low nibble first), with float32 scales per
    token and head, or per ``group_size`` values of head_dim.

    Symmetric (the default): codes u in [-8, 7] stand for (u + 0.5) * s with s = absmax * (1 /
    7.5), u = floor(x / s): all 16 codes used, 7% less error than 15 symmetric levels.
    ``asymmetric=True``: codes u in [0, 15] stand for lo + u * s with s = (hi - lo) * (1 / 15),
    u = round((x - lo) / s); the scales hold (s, lo) per group, one float more.
    """

    group_size: int | None = None
    asymmetric: bool = False
    rotate: bool = False

    @property
    def name(self) -> str:
        groups = "" if self.group_size is None else f"-g{self.group_size}"
        return f"int4{groups}{'-asym' if self.asymmetric else ''}{self._suffix()}"

    def _groups(self, head_dim: int) -> int:
        return 1 if self.group_size is None else head_dim // self.group_size

    def value_shape(self, head_dim: int) -> tuple[tuple[int, ...], np.dtype]:
        return (head_dim // 2,), np.dtype("uint8")

    def scale_shape(self, head_dim: int) -> tuple[int, ...]:
        per_group = (2,) if self.asymmetric else ()
        return per_group if self.group_size is None else (self._groups(head_dim), *per_group)

    def bytes_per_token_head(self, head_dim: int, dtype: np.dtype) -> int:
        return head_dim // 2 + SCALE_DTYPE.itemsize * self._groups(head_dim) * (2 if self.asymmetric else 1)

    def validate(self, head_dim: int, dtype: np.dtype) -> None:
        if head_dim % 2:
            raise ValueError(
                f"int4 packs two values per byte along head_dim, so head_dim must be even; got {head_dim}"
            )
        if self.group_size is not None and (self.group_size <= 0 or head_dim % self.group_size or self.group_size % 2):
            raise ValueError(
                f"int4 group_size={self.group_size} must be a positive even divisor of head_dim={head_dim}"
            )

    def quantize(self, x: jax.Array) -> QuantizedPages[jax.Array]:
        xg = _grouped(self._into_basis(x), self._groups(x.shape[-1]))
        if self.asymmetric:
            lo = jnp.min(xg, axis=-1)
            step = (jnp.max(xg, axis=-1) - lo) * np.float32(1.0 / 15.0)
            codes = jnp.clip(jnp.round(_scaled(xg - lo[..., None], step)), 0, 15).astype(jnp.int8)
            scales = jnp.stack([step, lo], axis=-1)
        else:
            scales = _absmax_scale(xg, 7.5)
            codes = jnp.clip(jnp.floor(_scaled(xg, scales)), -8, 7).astype(jnp.int8)
        packed = pack(codes.reshape(x.shape))
        if self.group_size is None:
            scales = scales[..., 0, :] if self.asymmetric else scales[..., 0]
        return QuantizedPages(packed, scales, self)

    def dequantize(self, q: QuantizedPages[jax.Array], dtype: DTypeLike, *, rotated: bool = False) -> jax.Array:
        packed = q.values
        nibbles = unpacked_nibbles(packed)
        scales = q.scales if self.group_size is not None else q.scales[..., None, :] if self.asymmetric \
            else q.scales[..., None]
        groups = scales.shape[-2] if self.asymmetric else scales.shape[-1]
        if self.asymmetric:
            values = _grouped(nibbles, groups) * scales[..., 0:1] + scales[..., 1:2]
        else:
            # A two's-complement nibble n is the code (n ^ 8) - 8, so both formats unpack alike;
            # code + 0.5 = (n ^ 8) - 7.5, exact in float32.
            values = (_grouped(nibbles ^ 8, groups) - 7.5) * scales[..., None]
        return self._out_of_basis(values.reshape(nibbles.shape), dtype, rotated)
