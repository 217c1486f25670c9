"""Quantizers: how new tokens become stored page values plus scales, and back.

A quantized layer stores, for K and for V separately, a ``QuantizedPages`` pytree:

  values: (num_kv_heads, num_pages, page_size, packed_head_dim)  int8 / float8 / packed int4
  scales: (num_kv_heads, num_pages, page_size[, groups][, 2])     float32
          (num_kv_heads, num_pages, head_dim)                     uint8, ``int4-ch``: per page
          (num_kv_heads, num_pages, page_size, 2 + 3 k / 2)       uint8, ``int4-ol``: side bytes

Scales are compact (one per token and head, or per group of head_dim; asymmetric int4 adds a
zero point; ``int4-ch`` one log-coded byte per channel per page, ``_channel.py``; ``int4-ol`` two
log-coded steps, the outliers' channels and their low nibbles per token, ``_outlier.py``); they
are never broadcast in memory. Writes quantize only the new tokens; reads dequantize only the
pages they gather. A quantizer is chosen once per cache, by name or as an object, and recorded in
the metadata by name (``register_quantizer`` makes a custom one nameable; ``available_quantizers``
lists the names).

Built in (``_builtin.py``): ``int8``, ``fp8``, ``int4``, ``int4-g<N>``, ``int4[-g<N>]-asym``;
``int4-ch`` (``_channel.py``) scales each channel per page instead; ``int4-ol`` (``_outlier.py``)
keeps each token's largest values at 8 bits; ``-rot`` after any of the
others rotates every token by a fixed orthogonal matrix first
(``_rotation.py``), which spreads outlier channels over all channels; attention rotates the
query and the output instead of the pages.
"""

from easykv.quantization._builtin import Fp8Quantizer, Int4Quantizer, Int8Quantizer
from easykv.quantization._channel import Int4ChannelQuantizer
from easykv.quantization._outlier import Int4OutlierQuantizer
from easykv.quantization._pages import (
    SCALE_DTYPE,
    CompressingQuantizer,
    NoQuantizer,
    PageScaledQuantizer,
    QuantizedPages,
    Quantizer,
    RotatingQuantizer,
    is_compressing,
    page_head_bytes,
    rotation_of,
    scale_dtype,
    scales_per_page,
)
from easykv.quantization._registry import (
    available_quantizers,
    get_quantizer,
    get_quantizer_or_none,
    register_quantizer,
)
from easykv.quantization._rotation import Rotation, rotation_matrix

__all__ = [
    "SCALE_DTYPE",
    "CompressingQuantizer",
    "Fp8Quantizer",
    "Int4ChannelQuantizer",
    "Int4OutlierQuantizer",
    "Int4Quantizer",
    "Int8Quantizer",
    "NoQuantizer",
    "PageScaledQuantizer",
    "QuantizedPages",
    "Quantizer",
    "Rotation",
    "RotatingQuantizer",
    "available_quantizers",
    "get_quantizer",
    "get_quantizer_or_none",
    "is_compressing",
    "register_quantizer",
    "rotation_matrix",
    "page_head_bytes",
    "rotation_of",
    "scale_dtype",
    "scales_per_page",
]
