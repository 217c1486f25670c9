"""One sequence of a cache of one layer geometry, on the host: `SequenceExport`, its checks and
its ``.npz`` file (formats 1 and 2; `ExportFile` in ``export_file`` holds what both export
classes share, the loader included).

The export holds the sequence's K/V token-major, ``(layers, tokens, kv_heads, head_dim)``, either
dense in the source's logical dtype or raw (quantized values in their value dtype plus compact
scales, per token and head: independent of the page layout), for positions ``first_position ..
length - 1``: all of them, or (from a sliding or chunked cache) those its window still reads.
`easykv.checkpoint.transfer` makes and consumes exports (`export_sequence`, `import_sequence`).
A cache of several layer groups exports a `GroupedSequenceExport` (``grouped_export``, file
format version 3); `SequenceExport.load` reads files of every version, so this module imports
that one (never the other way round).

An export is input like any other: a `SequenceExport` checks every field when it is built
(also by `load`, from a file that may have been crafted), naming the field in a ValueError.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import numpy as np

from easykv.checkpoint.export_file import (
    EXPORT_FORMAT,
    GROUPED_FORMAT,
    WINDOW_FORMAT,
    ExportFile,
    ExportPart,
    MemberReader,
    cache_dtype,
    check_header_keys,
    check_raw_exportable,
    checked_part,
    checked_token_ids,
    dense_part,
    header_dtype,
    member_specs,
    quantizer_for,
    read_arrays,
    read_token_ids,
    unknown_format,
)
from easykv.checkpoint.grouped_export import GroupedSequenceExport
from easykv.quantization import get_quantizer, is_compressing
from easykv.validation import boolean, integer, optional_int, positive_int

_HEADER_FIELDS = ("format", "length", "num_hidden_layers", "num_kv_heads", "kv_head_dim_size", "dtype",
                  "quantization", "raw", "source_page_size", "dtypes")
_WINDOW_FIELDS = _HEADER_FIELDS + ("first_position",)
_SCALARS = ("length", "num_hidden_layers", "num_kv_heads", "kv_head_dim_size", "dtype", "quantization", "raw",
            "source_page_size", "first_position")


@dataclasses.dataclass(frozen=True, eq=False)
class SequenceExport(ExportFile["SequenceExport | GroupedSequenceExport"]):
    """One sequence's tokens and K/V, on the host.

    keys / values: dense ``(layers, tokens, kv_heads, head_dim)`` arrays in ``dtype``, or, when
    ``raw``, dicts ``{"values": (layers, tokens, kv_heads, packed), "scales": (layers, tokens,
    kv_heads[, groups])}`` of the ``quantization`` format, where ``tokens = length -
    first_position``: the K/V of positions ``first_position .. length - 1`` (``first_position``
    > 0: a sliding or chunked cache's sequence, exported with the tokens its window still
    reads; ``token_ids`` then still names every token from the first). Every field is checked when the
    export is built (ValueError naming the field); ints and names are normalized (``dtype`` a
    numpy dtype, ``quantization`` the quantizer's name, ``token_ids`` int32). Two exports are
    equal when every field is, arrays bit for bit.

    Attributes:
      length: the sequence's committed tokens.
      num_hidden_layers: the model's layers.
      num_kv_heads: kv heads per layer.
      kv_head_dim_size: head dim of the keys and the values.
      dtype: the source cache's logical dtype (that of dense ``keys`` / ``values``).
      quantization: the source cache's quantizer name.
      raw: whether ``keys`` / ``values`` are codes and scales (needs a compressing quantizer).
      keys: ``(num_hidden_layers, length - first_position, num_kv_heads, kv_head_dim_size)``, or
        the dict of a raw export (above).
      values: as ``keys``.
      token_ids: the sequence's token ids, ``(length,)`` int32, or None.
      source_page_size: page size of the source cache, in tokens (None: not recorded); the
        import does not read it.
      first_position: the first position whose K/V the export holds (default 0).
    """

    length: int
    num_hidden_layers: int
    num_kv_heads: int
    kv_head_dim_size: int
    dtype: np.dtype
    quantization: str
    raw: bool
    keys: ExportPart
    values: ExportPart
    token_ids: np.ndarray | None = None
    source_page_size: int | None = None
    first_position: int = 0

    def __post_init__(self) -> None:
        put = partial(object.__setattr__, self)
        length = positive_int("SequenceExport.length", self.length, hint="committed tokens of the sequence")
        layers = positive_int("SequenceExport.num_hidden_layers", self.num_hidden_layers)
        heads = positive_int("SequenceExport.num_kv_heads", self.num_kv_heads)
        head_dim = positive_int("SequenceExport.kv_head_dim_size", self.kv_head_dim_size)
        first = integer("SequenceExport.first_position", self.first_position, lo=0, hi=length - 1,
                        hint="the first position whose K/V the export holds, below its length")
        dtype = cache_dtype("SequenceExport.dtype", self.dtype)
        quantizer = quantizer_for("SequenceExport.quantization", self.quantization, head_dim, dtype)
        raw = boolean("SequenceExport.raw", self.raw)
        if raw and not is_compressing(quantizer):
            raise ValueError(f"SequenceExport.raw=True needs a compressing quantizer (int8, fp8, int4, ...), but "
                             f"quantization is {quantizer.name!r}; an export of an unquantized cache has raw=False")
        if raw:
            check_raw_exportable(quantizer, "SequenceExport.raw=True")
        specs = member_specs(length - first, layers, heads, head_dim, dtype, quantizer, raw)
        span = f" (positions {first}..{length - 1})" if first else ""
        what = (f"{length - first} tokens{span} x {layers} layers x {heads} kv heads of head_dim {head_dim} "
                + (f"in the raw {quantizer.name} format" if raw else f"in {dtype.name}"))
        for part in ("keys", "values"):
            put(part, checked_part(f"SequenceExport.{part}", getattr(self, part), specs, part, raw, what))
        token_ids = checked_token_ids("SequenceExport", self.token_ids, length)
        source_page_size = optional_int("SequenceExport.source_page_size", self.source_page_size, lo=1)
        for name, value in (("length", length), ("num_hidden_layers", layers), ("num_kv_heads", heads),
                            ("kv_head_dim_size", head_dim), ("dtype", dtype), ("quantization", quantizer.name),
                            ("raw", raw), ("token_ids", token_ids), ("source_page_size", source_page_size),
                            ("first_position", first)):
            put(name, value)

    def dense(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) as dense ``(layers, length - first_position, kv_heads, head_dim)`` in ``dtype``."""
        q = get_quantizer(self.quantization)
        return dense_part(self.keys, q, self.dtype), dense_part(self.values, q, self.dtype)

    # ---- what ExportFile asks of its classes ------------------------------------------------------
    def _scalars(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f) for f in _SCALARS)

    def _arrays(self) -> Any:
        return (self.keys, self.values)

    def _members(self) -> list[tuple[str, Any]]:
        return [(f"{part}.{sub}", arr) for part in ("keys", "values")
                for sub, arr in (getattr(self, part).items() if self.raw else [("dense", getattr(self, part))])]

    def _header(self, dtypes: dict[str, str]) -> dict[str, Any]:
        header = {"format": EXPORT_FORMAT, "length": self.length, "num_hidden_layers": self.num_hidden_layers,
                  "num_kv_heads": self.num_kv_heads, "kv_head_dim_size": self.kv_head_dim_size,
                  "dtype": self.dtype.name, "quantization": self.quantization, "raw": self.raw,
                  "source_page_size": self.source_page_size, "dtypes": dtypes}
        if self.first_position:
            header.update(format=WINDOW_FORMAT, first_position=self.first_position)
        return header

    @classmethod
    def _from_header(cls, header: dict[str, Any], members: Any, read: MemberReader, source: str
                     ) -> SequenceExport | GroupedSequenceExport:
        """The export a file of any version holds (a grouped one from a version-3 file)."""
        fmt = header.get("format")
        if fmt == GROUPED_FORMAT:  # a cache of several layer groups
            return GroupedSequenceExport._from_header(header, members, read, source)
        if fmt not in (EXPORT_FORMAT, WINDOW_FORMAT):
            raise unknown_format(fmt, source)
        check_header_keys(header, _HEADER_FIELDS if fmt == EXPORT_FORMAT else _WINDOW_FIELDS, fmt, source)
        field = f"the header of {source}: field"
        length = positive_int(f"{field} 'length'", header["length"])
        layers = positive_int(f"{field} 'num_hidden_layers'", header["num_hidden_layers"])
        heads = positive_int(f"{field} 'num_kv_heads'", header["num_kv_heads"])
        head_dim = positive_int(f"{field} 'kv_head_dim_size'", header["kv_head_dim_size"])
        dtype = header_dtype(header, field)
        quantizer = quantizer_for(f"{field} 'quantization'", header["quantization"], head_dim, dtype)
        raw = boolean(f"{field} 'raw'", header["raw"])
        if raw and not is_compressing(quantizer):
            raise ValueError(f"{field} 'raw' is true but quantization {quantizer.name!r} stores no raw format")
        if raw:
            check_raw_exportable(quantizer, f"{field} 'raw'")
        source_page_size = optional_int(f"{field} 'source_page_size'", header["source_page_size"], lo=1)
        first = 0
        if fmt == WINDOW_FORMAT:  # version 2 exists for a window: first_position 0 is written as version 1
            first = integer(f"{field} 'first_position'", header["first_position"], lo=1, hi=length - 1,
                            hint="the first position the export holds, in 1..length - 1 in a version-2 header")
        specs = member_specs(length - first, layers, heads, head_dim, dtype, quantizer, raw)
        arrays = read_arrays(header, members, read, specs, source, field, shown=200)
        token_ids = read_token_ids(read, members, length)
        parts = {p: ({s: arrays[f"{p}.{s}"] for s in ("values", "scales")} if raw else arrays[f"{p}.dense"])
                 for p in ("keys", "values")}
        return cls._from_file(source, length=length, num_hidden_layers=layers, num_kv_heads=heads,
                              kv_head_dim_size=head_dim, dtype=dtype, quantization=quantizer.name, raw=raw,
                              keys=parts["keys"], values=parts["values"], token_ids=token_ids,
                              source_page_size=source_page_size, first_position=first)


__all__ = ["SequenceExport"]
