"""A sequence moved out of a cache of several layer groups: `GroupedSequenceExport`.

Each group of the source exports its own part (`ExportedGroup`) in its own geometry: K
``(layers_in_group, tokens, kv_heads, key_head_dim)`` and V with ``value_head_dim`` (none for a
latent group), dense in the cache's dtype or raw (quantized values plus compact scales), for the
positions the group still holds: ``first_position .. length - 1`` (a sliding or chunked group
keeps only its window). A group with its own format (`LayerGroup.dtype` / ``quantization``)
exports in it: its ``dtype`` / ``quantization`` (None: the export's); with ``raw`` a group whose
quantizer compresses keeps its codes and scales, any other group is dense. The file is the
``.npz`` of `ExportFile` in format version 3; `SequenceExport.load` reads either kind,
`GroupedSequenceExport.load` this one only. `easykv.checkpoint.transfer` makes and consumes
exports.

An export is input like any other: every field is checked when it is built (also from a file
that may have been crafted), naming the field in a ValueError.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import numpy as np

from easykv.checkpoint.export_file import (
    EXPORT_FORMAT,
    GROUPED_FORMAT,
    MOST_GROUPS,
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
from easykv.quantization import Quantizer, get_quantizer, is_compressing
from easykv.validation import boolean, integer, optional_int, positive_int, show

_HEADER_FIELDS = ("format", "length", "dtype", "quantization", "raw", "source_page_size", "groups", "dtypes")
_GROUP_FIELDS = ("layers", "num_kv_heads", "key_head_dim", "value_head_dim", "latent", "first_position")
# Written only for a group with a format of its own: an older reader refuses such a file (it
# would read the group's arrays in the export's format) instead of misreading it.
_GROUP_FORMAT_FIELDS = ("dtype", "quantization")


@dataclasses.dataclass(frozen=True, eq=False)
class ExportedGroup:
    """One layer group's part of a `GroupedSequenceExport` (see the module doc): the model
    layers it holds (in the group's order), its geometry, the first position it holds, its keys
    and values (values None for a latent group), and its own ``dtype`` / ``quantization`` (None:
    the export's). Checked by the export that holds it.

    Attributes:
      layers: the model layers the group holds, in the group's order.
      num_kv_heads: kv heads per layer.
      key_head_dim: head dim of the keys (of the latent, for a latent group).
      value_head_dim: head dim of the values; of a latent group, the leading dims of the latent
        read as the value.
      latent: whether the group stores one latent per token and head and no values (MLA).
      first_position: the first position the group holds (> 0: a sliding or chunked group
        exported from its window), below the export's ``length``.
      keys: dense ``(len(layers), length - first_position, num_kv_heads, key_head_dim)`` in the
        group's dtype, or, where `GroupedSequenceExport.group_raw`, a dict ``{"values": (len(layers),
        length - first_position, num_kv_heads, packed), "scales": (len(layers), length -
        first_position, num_kv_heads[, groups])}`` of the group's quantizer.
      values: as ``keys`` with ``value_head_dim``; None for a latent group.
      dtype: the group's own dtype (None: the export's).
      quantization: the group's own quantizer name (None: the export's).
    """

    layers: tuple[int, ...]
    num_kv_heads: int
    key_head_dim: int
    value_head_dim: int
    latent: bool
    first_position: int
    keys: ExportPart
    values: ExportPart | None
    dtype: np.dtype | None = None
    quantization: str | None = None

    def geometry(self) -> tuple[tuple[int, ...], int, int, int, bool]:
        """``(layers, num_kv_heads, key_head_dim, value_head_dim, latent)``: what the importing
        cache's group must equal."""
        return (self.layers, self.num_kv_heads, self.key_head_dim, self.value_head_dim, self.latent)


@dataclasses.dataclass(frozen=True, eq=False)
class GroupedSequenceExport(ExportFile["GroupedSequenceExport"]):
    """One sequence's tokens and K/V from a cache of several layer groups, on the host.

    ``groups``: one `ExportedGroup` per layer group, together every model layer once. Every
    field is checked when the export is built (ValueError naming the field); ints and names are
    normalized. Two exports are equal when every field is, arrays bit for bit.

    Attributes:
      length: the sequence's committed tokens.
      groups: one `ExportedGroup` per layer group of the source; together they hold every model
        layer once.
      dtype: the source cache's dtype, that of every group without its own.
      quantization: the source cache's quantizer name, that of every group without its own.
      raw: whether groups with a compressing quantizer hold codes and scales (`group_raw`);
        True needs at least one such group.
      token_ids: the sequence's token ids, ``(length,)`` int32, or None.
      source_page_size: page size of the source cache, in tokens (None: not recorded); the
        import does not read it.
    """

    length: int
    groups: tuple[ExportedGroup, ...]
    dtype: np.dtype
    quantization: str
    raw: bool
    token_ids: np.ndarray | None = None
    source_page_size: int | None = None

    def __post_init__(self) -> None:
        put = partial(object.__setattr__, self)
        length = positive_int("GroupedSequenceExport.length", self.length, hint="committed tokens of the sequence")
        dtype = cache_dtype("GroupedSequenceExport.dtype", self.dtype)
        if not isinstance(self.quantization, str):
            raise ValueError(f"GroupedSequenceExport.quantization must be a quantizer name, got "
                             f"{show(self.quantization)}")
        quantizer = get_quantizer(self.quantization)
        raw = boolean("GroupedSequenceExport.raw", self.raw)
        groups = self.groups
        if not isinstance(groups, (tuple, list)) or not groups or len(groups) > MOST_GROUPS:
            raise ValueError(f"GroupedSequenceExport.groups must be a tuple of 1..{MOST_GROUPS} ExportedGroup "
                             f"(what load reads back), got {show(groups)}")
        checked = tuple(_checked_group(g, i, length, dtype, quantizer, raw) for i, g in enumerate(groups))
        if raw and not any(is_compressing(_format(g, dtype, quantizer)[1]) for g in checked):
            raise ValueError(f"GroupedSequenceExport.raw=True needs a group with a compressing quantizer (int8, fp8, "
                             f"int4, ...), but every group's is {quantizer.name!r}")
        for g in checked if raw else ():
            check_raw_exportable(_format(g, dtype, quantizer)[1], "GroupedSequenceExport.raw=True")
        layers = sorted(i for g in checked for i in g.layers)
        if layers != list(range(len(layers))):
            raise ValueError(f"GroupedSequenceExport.groups hold the layers {show(layers)}; together they must hold "
                             f"every model layer 0..{len(layers) - 1} exactly once")
        token_ids = checked_token_ids("GroupedSequenceExport", self.token_ids, length)
        source_page_size = optional_int("GroupedSequenceExport.source_page_size", self.source_page_size, lo=1)
        for name, value in (("length", length), ("groups", checked), ("dtype", dtype),
                            ("quantization", quantizer.name), ("raw", raw), ("token_ids", token_ids),
                            ("source_page_size", source_page_size)):
            put(name, value)

    @property
    def num_hidden_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def group_format(self, i: int) -> tuple[np.dtype, Quantizer]:
        """(dtype, quantizer) of group ``i``'s tokens: its own, else the export's.

        Args:
          i: the group's index in ``groups``.
        """
        return _format(self.groups[i], self.dtype, get_quantizer(self.quantization))

    def group_raw(self, i: int) -> bool:
        """Whether group ``i`` holds raw codes and scales (else dense values in its dtype).

        Args:
          i: the group's index in ``groups``.
        """
        return self.raw and is_compressing(self.group_format(i)[1])

    @property
    def first_position(self) -> int:
        """The first position every group holds (0 when each holds the whole sequence)."""
        return max(g.first_position for g in self.groups)

    def dense(self) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Per group, (keys, values) dense in the group's dtype (values None for a latent group)."""
        out: list[tuple[np.ndarray, np.ndarray | None]] = []
        for i, g in enumerate(self.groups):
            dtype, q = self.group_format(i)
            out.append((dense_part(g.keys, q, dtype), None if g.values is None else dense_part(g.values, q, dtype)))
        return out

    # ---- what ExportFile asks of its classes ------------------------------------------------------
    def _scalars(self) -> tuple[Any, ...]:
        return (self.length, self.dtype, self.quantization, self.raw, self.source_page_size,
                tuple(g.geometry() + (g.first_position, g.dtype, g.quantization) for g in self.groups))

    def _arrays(self) -> Any:
        return [(g.keys, g.values) for g in self.groups]

    def _members(self) -> list[tuple[str, Any]]:
        out = []
        for i, g in enumerate(self.groups):
            for kind in ("keys", "values"):
                data = getattr(g, kind)
                if data is None:
                    continue
                for sub, arr in (data.items() if self.group_raw(i) else [("dense", data)]):
                    out.append((f"group_{i:03d}.{kind}.{sub}", arr))
        return out

    def _header(self, dtypes: dict[str, str]) -> dict[str, Any]:
        return {"format": GROUPED_FORMAT, "length": self.length, "dtype": self.dtype.name,
                "quantization": self.quantization, "raw": self.raw, "source_page_size": self.source_page_size,
                "groups": [{"layers": list(g.layers), "num_kv_heads": g.num_kv_heads,
                            "key_head_dim": g.key_head_dim, "value_head_dim": g.value_head_dim,
                            "latent": g.latent, "first_position": g.first_position,
                            **({} if g.dtype is None else {"dtype": g.dtype.name}),
                            **({} if g.quantization is None else {"quantization": g.quantization})}
                           for g in self.groups],
                "dtypes": dtypes}

    @classmethod
    def _from_header(cls, header: dict[str, Any], members: Any, read: MemberReader, source: str
                     ) -> GroupedSequenceExport:
        """The export a version-3 file holds."""
        fmt = header.get("format")
        if fmt in (EXPORT_FORMAT, WINDOW_FORMAT):
            raise ValueError("the file holds the export of a cache of one layer geometry (a SequenceExport), not a "
                             "grouped one; load it with SequenceExport.load")
        if fmt != GROUPED_FORMAT:
            raise unknown_format(fmt, source)
        check_header_keys(header, _HEADER_FIELDS, GROUPED_FORMAT, source)
        field = f"the header of {source}: field"
        length = positive_int(f"{field} 'length'", header["length"])
        dtype = header_dtype(header, field)
        raw = boolean(f"{field} 'raw'", header["raw"])
        source_page_size = optional_int(f"{field} 'source_page_size'", header["source_page_size"], lo=1)
        raw_groups = header["groups"]
        if not isinstance(raw_groups, list) or not raw_groups or len(raw_groups) > MOST_GROUPS:
            raise ValueError(f"{field} 'groups' must be a list of 1..{MOST_GROUPS} group descriptions, got "
                             f"{show(raw_groups)}")
        specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        fields = []
        for i, g in enumerate(raw_groups):
            group, group_specs = _group_from_header(i, g, header, field, source, length, dtype, raw)
            specs.update(group_specs)
            fields.append(group)
        arrays = read_arrays(header, members, read, specs, source, field, shown=300)

        def part(i: int, kind: str) -> Any:
            if f"group_{i:03d}.{kind}.values" in specs:
                got = {s: arrays.get(f"group_{i:03d}.{kind}.{s}") for s in ("values", "scales")}
                return None if got["values"] is None else got
            return arrays.get(f"group_{i:03d}.{kind}.dense")

        groups = tuple(ExportedGroup(**f, keys=part(i, "keys"), values=part(i, "values")) for i, f in enumerate(fields))
        return cls._from_file(source, length=length, groups=groups, dtype=dtype, quantization=header["quantization"],
                              raw=raw, token_ids=read_token_ids(read, members, length),
                              source_page_size=source_page_size)


def _group_from_header(i: int, g: Any, header: dict[str, Any], field: str, source: str, length: int,
                       dtype: np.dtype, raw: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Group ``i`` of a version-3 header, checked: its `ExportedGroup` fields but the arrays,
    and the (shape, dtype) of the arrays it implies."""
    where = f"{field} 'groups'[{i}]"
    if not isinstance(g, dict):
        raise ValueError(f"{where} must be an object, got {show(g)}")
    check_header_keys(g, _GROUP_FIELDS, "exported group", f"{source} ('groups'[{i}])", optional=_GROUP_FORMAT_FIELDS)
    if not isinstance(g["layers"], list) or not g["layers"] or len(g["layers"]) > 1 << 16:
        raise ValueError(f"{where}.layers must be a non-empty list of layer indices, got {show(g['layers'])}")
    layers = tuple(integer(f"{where}.layers", x, lo=0, hi=1 << 16) for x in g["layers"])
    heads = positive_int(f"{where}.num_kv_heads", g["num_kv_heads"], hi=1 << 16)
    dk = positive_int(f"{where}.key_head_dim", g["key_head_dim"], hi=1 << 16)
    dv = positive_int(f"{where}.value_head_dim", g["value_head_dim"], hi=1 << 16)
    latent = boolean(f"{where}.latent", g["latent"])
    first = integer(f"{where}.first_position", g["first_position"], lo=0, hi=length - 1)
    own_dtype = None if "dtype" not in g else cache_dtype(f"{where}.dtype", g["dtype"])
    group_dtype = dtype if own_dtype is None else own_dtype
    named = f"{where}.quantization" if "quantization" in g else f"{field} 'quantization'"
    quantizer = quantizer_for(named, g.get("quantization", header["quantization"]), dk, group_dtype)
    if not latent:
        quantizer_for(named, quantizer.name, dv, group_dtype)
    specs = _group_specs(i, length - first, len(layers), heads, dk, None if latent else dv, group_dtype, quantizer,
                         raw and is_compressing(quantizer))
    return dict(layers=layers, num_kv_heads=heads, key_head_dim=dk, value_head_dim=dv, latent=latent,
                first_position=first, dtype=own_dtype, quantization=g.get("quantization")), specs


def _group_specs(g: int, tokens: int, layers: int, heads: int, key_dim: int, value_dim: int | None, dtype: np.dtype,
                 quantizer: Any, raw: bool) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``"group_000.keys.dense"`` ... -> (shape, dtype) of group ``g``'s arrays (no values for a
    latent group, ``value_dim`` None)."""
    out = {}
    for kind, dim in (("keys", key_dim), ("values", value_dim)):
        if dim is None:
            continue
        for name, spec in member_specs(tokens, layers, heads, dim, dtype, quantizer, raw).items():
            part, sub = name.split(".")
            if part == kind:
                out[f"group_{g:03d}.{kind}.{sub}"] = spec
    return out


def _format(g: ExportedGroup, dtype: np.dtype, quantizer: Quantizer) -> tuple[np.dtype, Quantizer]:
    """(dtype, quantizer) of a checked group of an export of ``dtype`` and ``quantizer``."""
    return (dtype if g.dtype is None else g.dtype,
            quantizer if g.quantization is None else get_quantizer(g.quantization))


def _checked_group(g: Any, i: int, length: int, export_dtype: np.dtype, export_quantizer: Any,
                   export_raw: bool) -> ExportedGroup:
    """Group ``i``, checked, with its own format None where it is the export's."""
    where = f"GroupedSequenceExport.groups[{i}]"
    if not isinstance(g, ExportedGroup):
        raise ValueError(f"{where} must be an ExportedGroup, got {type(g).__name__}")
    dtype = export_dtype if g.dtype is None else cache_dtype(f"{where}.dtype", g.dtype)
    if g.quantization is not None and not isinstance(g.quantization, str):
        raise ValueError(f"{where}.quantization must be a quantizer name or None, got {show(g.quantization)}")
    try:
        quantizer = export_quantizer if g.quantization is None else get_quantizer(g.quantization)
    except ValueError as err:
        raise ValueError(f"{where}.quantization: {err}") from None
    raw = export_raw and is_compressing(quantizer)
    raw_layers = g.layers
    if isinstance(raw_layers, (str, bytes)) or not hasattr(raw_layers, "__iter__"):
        raise ValueError(f"{where}.layers must be a sequence of layer indices, got {show(raw_layers)}")
    layers = tuple(integer(f"{where}.layers", x, lo=0) for x in raw_layers)
    if not layers or len(set(layers)) != len(layers):
        raise ValueError(f"{where}.layers must name at least one layer, each once, got {show(raw_layers)}")
    heads = positive_int(f"{where}.num_kv_heads", g.num_kv_heads)
    dk = positive_int(f"{where}.key_head_dim", g.key_head_dim)
    dv = positive_int(f"{where}.value_head_dim", g.value_head_dim)
    latent = boolean(f"{where}.latent", g.latent)
    first = integer(f"{where}.first_position", g.first_position, lo=0, hi=length - 1,
                    hint="the first position whose K/V the group holds, below the length")
    for dim in (dk,) if latent else (dk, dv):
        try:
            quantizer.validate(dim, dtype)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    specs = _group_specs(i, length - first, len(layers), heads, dk, None if latent else dv, dtype, quantizer, raw)
    what = (f"{length - first} tokens x {len(layers)} layers x {heads} kv heads (K {dk}, "
            f"{'latent' if latent else f'V {dv}'}) "
            + (f"in the raw {quantizer.name} format" if raw else f"in {dtype.name}"))
    parts: dict[str, Any] = {}
    for kind in ("keys", "values"):
        data = getattr(g, kind)
        name = f"{where}.{kind}"
        if kind == "values" and latent:
            if data is not None:
                raise ValueError(f"{name} must be None: a latent group stores no values")
            parts[kind] = None
            continue
        parts[kind] = checked_part(name, data, specs, f"group_{i:03d}.{kind}", raw, what)
    return ExportedGroup(layers=layers, num_kv_heads=heads, key_head_dim=dk, value_head_dim=dv, latent=latent,
                         first_position=first, keys=parts["keys"], values=parts["values"],
                         dtype=None if dtype == export_dtype else dtype,
                         quantization=None if quantizer.name == export_quantizer.name else quantizer.name)


__all__ = ["ExportedGroup", "GroupedSequenceExport"]
