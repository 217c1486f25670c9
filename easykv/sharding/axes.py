"""Logical axis names and the rule that maps each one onto mesh axes.

Arrays in easykv are described with *logical* axis names ("kv_head", "page", ...) rather than
mesh axis names, so the same code runs on a 1-device CPU, a tp=8 GPU box or a dp x tp TPU slice:
only the `PartitionAxis` changes. The defaults follow EasyDeL's `PartitionAxis`, so users moving
from EasyDeL keep their mental model.
"""

from __future__ import annotations

import dataclasses

# Logical axis names. Use these constants rather than string literals so a typo is a NameError,
# not a silently replicated dimension.
BATCH = "batch"
SEQUENCE = "sequence"
HEAD = "head"
KV_HEAD = "kv_head"
HEAD_DIM = "head_dim"
PAGE = "page"
PAGE_SIZE = "page_size"
HIDDEN = "hidden"

#: A mesh-axis rule: one mesh axis, several (sharded over their product, major first), or None.
MeshAxes = str | tuple[str, ...] | None

# logical name -> PartitionAxis field holding its rule.
_FIELD_OF: dict[str, str] = {
    BATCH: "batch_axis",
    SEQUENCE: "sequence_axis",
    HEAD: "head_axis",
    KV_HEAD: "kv_head_axis",
    HEAD_DIM: "head_dim_axis",
    PAGE: "page_axis",
    PAGE_SIZE: "page_size_axis",
    HIDDEN: "hidden_axis",
}

LOGICAL_AXES: tuple[str, ...] = tuple(_FIELD_OF)


def _normalize(field_name: str, value: object) -> MeshAxes:
    """Return `value` as None, a str or a tuple of str; raise ValueError naming the field if not.

    Lists are accepted (they come naturally from JSON/YAML configs) but stored as tuples so the
    dataclass stays hashable and usable as a jit static argument.
    """
    if value is None:
        return None
    if isinstance(value, str):
        if not value:
            raise ValueError(
                f"PartitionAxis.{field_name}={value!r}: a mesh axis name must be a non-empty "
                "string; use None for a dimension that is never sharded."
            )
        return value
    if isinstance(value, (list, tuple)):
        items = tuple(value)
        if not items:
            raise ValueError(
                f"PartitionAxis.{field_name}={value!r}: an empty sequence of mesh axes is "
                "ambiguous; use None for a dimension that is never sharded."
            )
        for item in items:
            if not isinstance(item, str) or not item:
                raise ValueError(
                    f"PartitionAxis.{field_name}={value!r}: every entry must be a non-empty mesh "
                    f"axis name (str), got {item!r}."
                )
        if len(set(items)) != len(items):
            raise ValueError(
                f"PartitionAxis.{field_name}={value!r}: a mesh axis may appear only once; "
                "remove the duplicate."
            )
        return items
    raise ValueError(
        f"PartitionAxis.{field_name}={value!r} (type {type(value).__name__}): expected None, a "
        "mesh axis name (str) or a tuple of mesh axis names."
    )


@dataclasses.dataclass(frozen=True)
class PartitionAxis:
    """Which mesh axes each logical axis is sharded over.

    Each field is a mesh axis name, a tuple of names (the dimension is split over their product),
    or None (never sharded). Whether a rule can actually be applied to a given array depends on
    the mesh and the array's shape; `PartitionManager.resolve` decides that and reports any
    adjustment. Lists are accepted and stored as tuples (the rules stay hashable); an empty name,
    an empty sequence or a repeated axis is a ValueError.

    Attributes:
      batch_axis: the batch axis (default ``("fsdp", "dp")``).
      sequence_axis: the sequence axis (default None).
      head_axis: the query heads (default ``"tp"``).
      kv_head_axis: the kv heads, of the pages too (default ``"tp"``).
      head_dim_axis: the head dim (default None).
      page_axis: the page pool (default None); set e.g. ``"dp"`` to give each data-parallel
        replica its own slice of the pool.
      page_size_axis: the tokens of a page (default None).
      hidden_axis: the model's hidden dim (default None).
    """

    batch_axis: MeshAxes = ("fsdp", "dp")
    sequence_axis: MeshAxes = None
    head_axis: MeshAxes = "tp"
    kv_head_axis: MeshAxes = "tp"
    head_dim_axis: MeshAxes = None
    #: Set e.g. "dp" to give each data-parallel replica its own slice of the page pool.
    page_axis: MeshAxes = None
    page_size_axis: MeshAxes = None
    hidden_axis: MeshAxes = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _normalize(f.name, getattr(self, f.name)))

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """Mesh axes for a logical axis name, as a tuple (empty for None or unsharded axes).

        Args:
          logical: a logical axis name (``"batch"``, ``"sequence"``, ``"head"``, ``"kv_head"``,
            ``"head_dim"``, ``"page"``, ``"page_size"``, ``"hidden"``) or None; any other is a
            ValueError.
        """
        if logical is None:
            return ()
        field_name = _FIELD_OF.get(logical) if isinstance(logical, str) else None
        if field_name is None:
            raise ValueError(
                f"unknown logical axis {logical!r}; known logical axes are "
                f"{', '.join(repr(n) for n in LOGICAL_AXES)} (or None for an unsharded dim)."
            )
        rule: MeshAxes = getattr(self, field_name)
        if rule is None:
            return ()
        if isinstance(rule, str):
            return (rule,)
        return rule
