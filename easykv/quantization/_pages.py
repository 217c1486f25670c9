"""What the cache needs of a quantizer, and the stored form of quantized pages."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Generic, Protocol, TypeGuard, TypeVar, cast, runtime_checkable

import jax
import numpy as np
from jax.typing import DTypeLike

from easykv.quantization._rotation import Rotation

SCALE_DTYPE = np.dtype("float32")

#: What a `QuantizedPages` holds as values and scales: ``jax.Array`` for pages and new tokens,
#: ``jax.ShapeDtypeStruct`` in a page template, ``np.ndarray`` in a host copy.
Leaf = TypeVar("Leaf", bound="jax.Array | jax.ShapeDtypeStruct | np.ndarray")


@runtime_checkable
class Quantizer(Protocol):
    """What the cache needs of a quantizer."""

    @property
    def name(self) -> str:
        """The name the metadata records (read-only: a field, a property or a class constant)."""
        ...

    def bytes_per_token_head(self, head_dim: int, dtype: np.dtype) -> int:
        """Stored bytes of one token of one kv head, values and per-token scales together. A
        quantizer with scales per page also has ``bytes_per_page_head(page_size, head_dim,
        dtype)``, which sizing uses instead (``page_head_bytes``).

        Args:
          head_dim: values per token and head.
          dtype: the cache's logical dtype (a numpy dtype).
        """
        ...

    def validate(self, head_dim: int, dtype: np.dtype) -> None:
        """Raise ValueError if this quantizer cannot store ``head_dim`` values of ``dtype``.

        Args:
          head_dim: values per token and head.
          dtype: the cache's logical dtype (a numpy dtype).
        """
        ...


@runtime_checkable
class CompressingQuantizer(Quantizer, Protocol):
    """A quantizer whose pages are ``QuantizedPages``. One that rotates tokens before
    quantizing (see ``_rotation.py``) also has ``rotation(head_dim) -> Rotation | None`` and
    takes ``dequantize(q, dtype, rotated=True)`` (values left in the rotated basis)."""

    def value_shape(self, head_dim: int) -> tuple[tuple[int, ...], np.dtype]:
        """Trailing shape and dtype of stored values for one token-head."""
        ...

    def scale_shape(self, head_dim: int) -> tuple[int, ...]:
        """Trailing shape of the scales for one token-head (``()``: one scale)."""
        ...

    def quantize(self, x: jax.Array) -> QuantizedPages[jax.Array]:
        """(..., head_dim) -> values (..., packed) and scales (..., *scale_shape)."""
        ...

    def dequantize(self, q: QuantizedPages[jax.Array], dtype: DTypeLike) -> jax.Array:
        """The inverse of quantize, in ``dtype``."""
        ...


@runtime_checkable
class RotatingQuantizer(CompressingQuantizer, Protocol):
    """A compressing quantizer that rotates tokens before quantizing (``_rotation.py``): its
    dequantized values can stay in the rotated basis, where attention rotates the query instead."""

    def rotation(self, head_dim: int) -> Rotation | None:
        """The rotation applied to tokens of ``head_dim`` values (None: this one rotates none)."""
        ...

    def dequantize(self, q: QuantizedPages[jax.Array], dtype: DTypeLike, *, rotated: bool = False) -> jax.Array:
        """The inverse of quantize, in ``dtype``; ``rotated``: left in the rotated basis."""
        ...


@runtime_checkable
class PageScaledQuantizer(CompressingQuantizer, Protocol):
    """A compressing quantizer with its scales per page (``scales_per_page = True``, as
    ``int4-ch``): a write is a read-modify-write of the pages it lands in
    (``easykv.storage.writes``), through these three, and sizing counts bytes per page."""

    def needed_codes(self, x: jax.Array) -> jax.Array:
        """The smallest scale code that holds each of ``x``'s values."""
        ...

    def requantize(self, packed: jax.Array, old: jax.Array, new: jax.Array) -> jax.Array:
        """Codes under scale codes ``old`` -> the same values under the larger ``new``."""
        ...

    def encode(self, x: jax.Array, codes: jax.Array) -> jax.Array:
        """Tokens under scale codes broadcastable to them -> stored codes."""
        ...

    def bytes_per_page_head(self, page_size: int, head_dim: int, dtype: np.dtype) -> int:
        """Stored bytes of one page of one kv head, codes and scales."""
        ...


def scales_per_page(quantizer: Quantizer) -> TypeGuard[PageScaledQuantizer]:
    """Whether ``quantizer`` keeps its scales per page (``(..., num_pages, *scale_shape)``, e.g.
    ``int4-ch``: a `PageScaledQuantizer`) rather than per token (``(..., num_pages, page_size,
    *scale_shape)``)."""
    return bool(getattr(quantizer, "scales_per_page", False))


def scale_dtype(quantizer: Quantizer) -> np.dtype:
    """The dtype of ``quantizer``'s stored scales (float32 unless it says otherwise)."""
    return np.dtype(getattr(quantizer, "scale_dtype", SCALE_DTYPE))


def page_head_bytes(quantizer: Quantizer, page_size: int, head_dim: int, dtype: np.dtype) -> int:
    """Stored bytes of one page of one kv head: values and scales, per-page scales included."""
    per_page = getattr(quantizer, "bytes_per_page_head", None)
    if callable(per_page):
        return int(per_page(page_size, head_dim, dtype))
    return page_size * int(quantizer.bytes_per_token_head(head_dim, dtype))


def rotation_of(quantizer: Quantizer, head_dim: int) -> Rotation | None:
    """The rotation ``quantizer`` applies to tokens of ``head_dim`` values (None: none)."""
    rotation = getattr(quantizer, "rotation", None)
    return rotation(head_dim) if callable(rotation) else None


@partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"], meta_fields=["quantizer"])
@dataclasses.dataclass(frozen=True)
class QuantizedPages(Generic[Leaf]):
    """Stored values plus compact scales, for pages or for a batch of new tokens. A pytree: the
    arrays are its leaves, the quantizer static.

    Attributes:
      values: the codes, ``(*lead, packed)``: pages ``(num_kv_heads, num_pages, page_size, packed)``
        (a layer group's stack leads with ``layers``), new tokens ``(num_tokens, num_kv_heads,
        packed)``; shape and dtype of the quantizer's ``value_shape(head_dim)``.
      scales: ``(*lead, *scale_shape)``, one set per token in the quantizer's scale dtype (float32
        unless it says otherwise); a quantizer with scales per page (``int4-ch``) has no
        ``page_size`` axis: ``(..., num_pages, *scale_shape)``.
      quantizer: the compressing quantizer that made them (and dequantizes them).

    The type parameter is what values and scales are (`Leaf`): ``QuantizedPages[jax.Array]``
    for pages and tokens, ``QuantizedPages[jax.ShapeDtypeStruct]`` for a page template.
    """

    values: Leaf
    scales: Leaf
    quantizer: CompressingQuantizer

    def dequantize(self: QuantizedPages[jax.Array], dtype: DTypeLike, *, rotated: bool = False) -> jax.Array:
        """The values these codes stand for, ``(*lead, head_dim)`` in ``dtype``.

        Args:
          dtype: the dtype of the result (the cache's logical dtype).
          rotated: a rotating quantizer's values are left in its rotated basis (attention rotates
            the query instead); for any other quantizer it changes nothing. Default False.
        """
        if rotated and self.rotation is not None:
            # cast: `rotation_of` found the quantizer's ``rotation``, so it rotates and takes ``rotated``.
            return cast(RotatingQuantizer, self.quantizer).dequantize(self, dtype, rotated=True)
        return self.quantizer.dequantize(self, dtype)

    @property
    def rotation(self) -> Rotation | None:
        """The rotation the quantizer applied to these values (None: none)."""
        return rotation_of(self.quantizer, self.head_dim)

    @property
    def head_dim(self) -> int:
        """The logical head_dim the values encode, read from the stored shapes (values ``(...,
        packed)``, scales ``(..., *scale_shape)``): the smallest dim the quantizer lays out exactly
        so (a whole number, at most 8, of values per stored element). ValueError when none does."""
        vshape, sshape = np.shape(self.values), np.shape(self.scales)
        lead = len(vshape) - (2 if scales_per_page(self.quantizer) else 1)  # per page: no page_size axis
        packed, scale_tail = int(vshape[-1]), tuple(sshape[lead:])
        if len(vshape) < 2 or sshape[:lead] != vshape[:lead] or packed <= 0:
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


def is_compressing(quantizer: Quantizer) -> TypeGuard[CompressingQuantizer]:
    """Whether ``quantizer``'s pages are `QuantizedPages` (it has ``quantize`` and the shapes)."""
    return isinstance(quantizer, CompressingQuantizer)
