"""Quantizers: how new tokens become stored page values plus scales, and back.

A quantized layer stores, for K and for V separately, a ``QuantizedPages`` pytree:

  values: (num_kv_heads, num_pages, page_size, packed_head_dim)  int8 / float8 / packed int4
  scales: (num_kv_heads, num_pages, page_size[, groups])          float32

Scales are compact (one per token and head, or per group of head_dim for grouped int4); they
are never broadcast to head_dim in memory. Writes quantize only the new tokens; reads
dequantize only the pages they gather. A quantizer is chosen once per cache, by name or as an
object, and recorded in the metadata by name (``register_quantizer`` makes a custom one
nameable).

Built in (absmax scaling per token and head; in float32, with r = 1 / s, exactly as written,
so eager and jitted code, on any jax version, store the same codes):
  * ``int8``: round(x * r), s = absmax * (1 / 127);
  * ``fp8``:  float8_e4m3fn(x * r), s = absmax * (1 / 448);
  * ``int4``: 16 levels on a half-integer grid, x ~ (u + 0.5) s with u = floor(x * r) in
    [-8, 7] and s = absmax * (1 / 7.5) (all 16 codes used: 7% less error than 15 symmetric levels),
    two values per byte along head_dim (head_dim must be even); ``int4-g32`` etc. take one
    scale per group of 32 values.
"""

from __future__ import annotations

import dataclasses
import re
from functools import partial
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from easykv.validation import show

SCALE_DTYPE = np.dtype("float32")


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


@runtime_checkable
class CompressingQuantizer(Quantizer, Protocol):
    """A quantizer whose pages are ``QuantizedPages``."""

    def value_shape(self, head_dim: int) -> tuple[tuple[int, ...], np.dtype]:
        """Trailing shape and dtype of stored values for one token-head."""
        ...

    def scale_shape(self, head_dim: int) -> tuple[int, ...]:
        """Trailing shape of the scales for one token-head (``()``: one scale)."""
        ...

    def quantize(self, x: jax.Array) -> QuantizedPages:
        """(..., head_dim) -> values (..., packed) and scales (..., *scale_shape)."""
        ...

    def dequantize(self, q: QuantizedPages, dtype: Any) -> jax.Array:
        """The inverse of quantize, in ``dtype``."""
        ...


@partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"], meta_fields=["quantizer"])
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """Stored values plus compact scales, for pages or for a batch of new tokens."""

    values: Any
    scales: Any
    quantizer: Any

    def dequantize(self, dtype: Any) -> jax.Array:
        return self.quantizer.dequantize(self, dtype)

    @property
    def head_dim(self) -> int:
        """The logical head_dim the values encode, read from the stored shapes (values ``(...,
        packed)``, scales ``(..., *scale_shape)``): the smallest dim the quantizer lays out exactly
        so (a whole number, at most 8, of values per stored element). ValueError when none does."""
        vshape, sshape = np.shape(self.values), np.shape(self.scales)
        packed, scale_tail = vshape[-1], tuple(sshape[len(vshape) - 1:])
        if sshape[:len(vshape) - 1] != vshape[:-1] or packed <= 0:
            raise ValueError(f"{self.quantizer.name} values {vshape} and scales {sshape} do not pair up")
        for per_element in range(1, 9):  # values packed per stored element: 8 candidates, whatever the size
            dim = packed * per_element
            if tuple(self.quantizer.value_shape(dim)[0]) == (packed,) and \
                    tuple(self.quantizer.scale_shape(dim)) == scale_tail:
                return dim
        raise ValueError(f"no head_dim gives {self.quantizer.name} values {vshape} and scales {sshape}")


@dataclasses.dataclass(frozen=True)
class NoQuantizer:
    """Pages hold the cache dtype itself."""

    name: str = "none"

    def bytes_per_token_head(self, head_dim: int, dtype: np.dtype) -> int:
        return head_dim * np.dtype(dtype).itemsize

    def validate(self, head_dim: int, dtype: np.dtype) -> None:
        return None


def _absmax_scale(x: jax.Array, qmax: float, groups: int) -> tuple[jax.Array, jax.Array]:
    """Per-group absmax scales (..., groups) and x grouped as (..., groups, head_dim / groups).

    The one formula, in float32: ``s = absmax * (1 / qmax)``. Written as multiplications by
    reciprocals because XLA may turn ``a / b`` into ``a * (1 / b)`` inside a fused jit but not
    in an eager op: codes of values on a grid point then differed by one step between paths
    (and between jax versions)."""
    xg = x.astype(jnp.float32).reshape(x.shape[:-1] + (groups, x.shape[-1] // groups))
    scale = jnp.max(jnp.abs(xg), axis=-1) * np.float32(1.0 / qmax)
    return scale, xg


def _scaled(xg: jax.Array, scale: jax.Array) -> jax.Array:
    """``x * (1 / s)`` per group; an all-zero group (s = 0) uses 1 so it stores exact zeros."""
    return xg * (1.0 / jnp.where(scale == 0, 1.0, scale))[..., None]


@dataclasses.dataclass(frozen=True)
class _Grid:
    """A one-byte code: values in ``[-qmax, qmax]`` stored as ``dtype``; ``rounds``: an integer
    grid (float8 rounds in its own cast)."""

    qmax: float
    dtype: Any
    rounds: bool


class _BytePerValueQuantizer:
    """One byte per value with one absmax scale per token and head; subclasses set the grid."""

    name: str
    _grid: ClassVar[_Grid]

    def value_shape(self, head_dim: int) -> tuple[tuple[int, ...], np.dtype]:
        return (head_dim,), np.dtype(self._grid.dtype)

    def scale_shape(self, head_dim: int) -> tuple[int, ...]:
        return ()

    def bytes_per_token_head(self, head_dim: int, dtype: np.dtype) -> int:
        return head_dim + SCALE_DTYPE.itemsize

    def validate(self, head_dim: int, dtype: np.dtype) -> None:
        return None

    def _encode(self, scaled: jax.Array) -> jax.Array:
        grid = self._grid
        return jnp.clip(jnp.round(scaled) if grid.rounds else scaled, -grid.qmax, grid.qmax).astype(grid.dtype)

    def quantize(self, x: jax.Array) -> QuantizedPages:
        scale, xg = _absmax_scale(x, self._grid.qmax, 1)
        return QuantizedPages(self._encode(_scaled(xg, scale)).reshape(x.shape), scale[..., 0], self)

    def dequantize(self, q: QuantizedPages, dtype: Any) -> jax.Array:
        return (q.values.astype(jnp.float32) * q.scales[..., None]).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Int8Quantizer(_BytePerValueQuantizer):
    """Symmetric int8: round(x * (1 / s)) with s = absmax * (1 / 127), per token and head."""

    name: str = "int8"
    _grid: ClassVar[_Grid] = _Grid(127.0, np.int8, rounds=True)


@dataclasses.dataclass(frozen=True)
class Fp8Quantizer(_BytePerValueQuantizer):
    """float8_e4m3fn values, absmax per token and head mapped to 448 (the format's maximum)."""

    name: str = "fp8"
    _grid: ClassVar[_Grid] = _Grid(448.0, jnp.float8_e4m3fn, rounds=False)


@dataclasses.dataclass(frozen=True)
class Int4Quantizer:
    """int4 codes u in [-8, 7] standing for (u + 0.5) * scale, two per byte along head_dim; one
    absmax scale per token and head, or per ``group_size`` values of head_dim."""

    group_size: int | None = None

    @property
    def name(self) -> str:
        return "int4" if self.group_size is None else f"int4-g{self.group_size}"

    def _groups(self, head_dim: int) -> int:
        return 1 if self.group_size is None else head_dim // self.group_size

    def value_shape(self, head_dim: int) -> tuple[tuple[int, ...], np.dtype]:
        return (head_dim // 2,), np.dtype("uint8")

    def scale_shape(self, head_dim: int) -> tuple[int, ...]:
        return () if self.group_size is None else (self._groups(head_dim),)

    def bytes_per_token_head(self, head_dim: int, dtype: np.dtype) -> int:
        return head_dim // 2 + SCALE_DTYPE.itemsize * self._groups(head_dim)

    def validate(self, head_dim: int, dtype: np.dtype) -> None:
        if head_dim % 2:
            raise ValueError(
                f"int4 packs two values per byte along head_dim, so head_dim must be even; got {head_dim}"
            )
        if self.group_size is not None and (self.group_size <= 0 or head_dim % self.group_size or self.group_size % 2):
            raise ValueError(
                f"int4 group_size={self.group_size} must be a positive even divisor of head_dim={head_dim}"
            )

    def quantize(self, x: jax.Array) -> QuantizedPages:
        scale, xg = _absmax_scale(x, 7.5, self._groups(x.shape[-1]))
        q = jnp.clip(jnp.floor(_scaled(xg, scale)), -8, 7).astype(jnp.int8).reshape(x.shape)
        nibbles = (q & 0xF).astype(jnp.uint8)
        packed = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
        return QuantizedPages(packed, scale if self.group_size is not None else scale[..., 0], self)

    def dequantize(self, q: QuantizedPages, dtype: Any) -> jax.Array:
        packed = q.values
        # Sign-extend each nibble: shift it to the top of an int8, then arithmetic-shift back.
        low = (packed << 4).astype(jnp.int8) >> 4
        high = packed.astype(jnp.int8) >> 4
        vals = jnp.stack([low, high], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))
        groups = 1 if self.group_size is None else q.scales.shape[-1]
        scales = q.scales[..., None] if self.group_size is None else q.scales
        grouped = (vals.astype(jnp.float32) + 0.5).reshape(vals.shape[:-1] + (groups, vals.shape[-1] // groups))
        return (grouped * scales[..., None]).reshape(vals.shape).astype(dtype)


_REGISTRY: dict[str, Quantizer] = {
    q.name: q for q in (NoQuantizer(), Int8Quantizer(), Fp8Quantizer(), Int4Quantizer())
}
_INT4_GROUPED = re.compile(r"int4-g([0-9]+)")


def available_quantizers() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY)) + ("int4-g<N>",)


def register_quantizer(quantizer: Quantizer) -> None:
    """Make a custom quantizer nameable (metadata records quantizers by name)."""
    if not isinstance(quantizer, Quantizer):
        raise ValueError(f"{show(quantizer)} does not implement the Quantizer protocol (name, bytes_per_token_head, validate)")
    known = _REGISTRY.get(quantizer.name)
    if known is not None and known != quantizer:
        raise ValueError(f"a different quantizer is already registered as {show(quantizer.name)}: {show(known)}")
    _REGISTRY[quantizer.name] = quantizer


def get_quantizer(quantizer: str | Quantizer | None) -> Quantizer:
    """Resolve ``None``, a registered name, or a quantizer object to a quantizer object."""
    if quantizer is None:
        return _REGISTRY["none"]
    if isinstance(quantizer, str):
        key = quantizer.lower()
        if key in _REGISTRY:
            return _REGISTRY[key]
        grouped = _INT4_GROUPED.fullmatch(key)
        if grouped:
            return Int4Quantizer(group_size=int(grouped.group(1)))
        raise ValueError(f"unknown quantizer {show(quantizer)}; available: {', '.join(available_quantizers())}")
    if isinstance(quantizer, Quantizer):
        if get_quantizer_or_none(quantizer.name) != quantizer:
            raise ValueError(
                f"quantizer {show(quantizer)} is not registered under its name {show(quantizer.name)}; the "
                "metadata records quantizers by name, so call easykv.register_quantizer(q) first"
            )
        return quantizer
    raise ValueError(
        f"quantizer must be None, a name ({', '.join(available_quantizers())}) or a Quantizer "
        f"object, got {type(quantizer).__name__}: {show(quantizer)}"
    )


def get_quantizer_or_none(name: str) -> Quantizer | None:
    try:
        return get_quantizer(name)
    except ValueError:
        return None


def is_compressing(quantizer: Quantizer) -> bool:
    return isinstance(quantizer, CompressingQuantizer)
