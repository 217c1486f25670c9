"""Turning logical axis names into PartitionSpecs that are valid for a given mesh and shape.

A rule such as kv_head -> "tp" cannot always be applied: 4 kv heads do not split over tp=8, and a
mesh built without an "fsdp" axis cannot shard over it. Rather than fail, or silently replicate
(which changes memory use by up to the axis size), the manager drops the offending mesh axis and
*says so*: `resolve` warns with `ShardingAdjustedWarning`, and `resolve_with_report` returns the
same messages so a planner can print them next to its memory estimate.
"""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from collections.abc import Sequence
from typing import cast

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from easykv.sharding.axes import PartitionAxis
from easykv.sharding.mesh import mesh_axis_size


class ShardingAdjustedWarning(UserWarning):
    """A logical->mesh axis rule could not be applied as written and was weakened."""


def shard_count(spec_entry: str | tuple[str, ...] | None, mesh: Mesh) -> int:
    """How many shards one PartitionSpec entry splits its dimension into (None -> 1)."""
    if spec_entry is None:
        return 1
    if not isinstance(spec_entry, (str, tuple)):
        raise ValueError(
            f"shard_count: spec entry {spec_entry!r} must be None, a mesh axis name or a tuple "
            "of mesh axis names."
        )
    return mesh_axis_size(mesh, spec_entry)


def _check_inputs(axes: Sequence[str | None], shape: Sequence[int]) -> tuple[tuple[str | None, ...], tuple[int, ...]]:
    """Validate `axes` and `shape` and return them as tuples."""
    if isinstance(axes, str) or not isinstance(axes, Sequence):
        raise ValueError(
            f"axes={axes!r} must be a sequence with one logical axis name (or None) per "
            f"dimension, e.g. ('kv_head', 'page', None, None)."
        )
    if isinstance(shape, str) or not isinstance(shape, Sequence):
        raise ValueError(f"shape={shape!r} must be a sequence of non-negative ints.")
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 0:
            raise ValueError(f"shape={tuple(shape)!r}: dimension {dim!r} is not a non-negative int.")
    if len(axes) != len(shape):
        raise ValueError(
            f"axes={tuple(axes)!r} has {len(axes)} entries but shape={tuple(shape)!r} has "
            f"{len(shape)} dimensions; give one logical axis name (or None) per dimension."
        )
    return tuple(axes), tuple(int(d) for d in shape)


@dataclasses.dataclass(frozen=True)
class PartitionManager:
    """Resolves logical axes to mesh shardings under a `PartitionAxis` rule set.

    Frozen and hashable so it can be stored in other frozen dataclasses and passed to jit as a
    static argument.

    Attributes:
      paxis: the `PartitionAxis` rules; None (the default) is replaced by ``PartitionAxis()`` at
        construction; anything else is a ValueError.
    """

    paxis: PartitionAxis | None = None

    def __post_init__(self) -> None:
        if self.paxis is None:
            object.__setattr__(self, "paxis", PartitionAxis())
        elif not isinstance(self.paxis, PartitionAxis):
            raise ValueError(
                f"PartitionManager(paxis={self.paxis!r}): expected a sharding.PartitionAxis "
                "(or None for the defaults)."
            )

    shard_count = staticmethod(shard_count)

    @property
    def rules(self) -> PartitionAxis:
        """``paxis`` as built: never None (``__post_init__`` puts the defaults in its place)."""
        # cast: the field's type keeps None because the constructor takes it; no built manager has it.
        return cast(PartitionAxis, self.paxis)

    def resolve_with_report(
        self, axes: Sequence[str | None], shape: Sequence[int], *, mesh: Mesh | AbstractMesh
    ) -> tuple[PartitionSpec, tuple[str, ...]]:
        """The PartitionSpec for `shape` on `mesh`, plus one message per adjustment made.

        This is the single implementation; `resolve` only adds warnings on top, so a planner
        that prints the report sees exactly what `resolve` would have warned about.

        Args:
          axes: one logical axis name (or None: never sharded) per dimension, e.g.
            ``("kv_head", "page", None, None)``.
          shape: the array's shape, as many non-negative ints as ``axes``.
          mesh: the `Mesh` (or `AbstractMesh`: only axis names and sizes are read) to shard over.

        Returns:
          The ``PartitionSpec`` and a tuple of messages, one per mesh axis dropped.

        Raises:
          ValueError: malformed ``axes`` or ``shape``, or one mesh axis requested by two dims.
        """
        axes, shape = _check_inputs(axes, shape)
        mesh_sizes = dict(mesh.shape)
        owner: dict[str, tuple[int, str | None]] = {}  # mesh axis -> (dim, logical) that requested it
        entries: list[str | tuple[str, ...] | None] = []
        report: list[str] = []
        for dim_index, (logical, dim) in enumerate(zip(axes, shape)):
            kept: list[str] = []
            product = 1
            where = f"logical axis {logical!r} (dim {dim_index}, size {dim})"
            for axis in self.rules.mesh_axes(logical):
                if axis not in mesh_sizes:
                    report.append(
                        f"{where}: the mesh has no axis {axis!r} (mesh axes: "
                        f"{tuple(mesh.axis_names)}); not sharded along {axis!r}."
                    )
                    continue
                if axis in owner:
                    other_dim, other_logical = owner[axis]
                    raise ValueError(
                        f"mesh axis {axis!r} is requested by dim {other_dim} ({other_logical!r}) "
                        f"and dim {dim_index} ({logical!r}) of axes={axes!r}; a mesh axis can "
                        "shard only one dimension. Map one of these logical axes to another "
                        "mesh axis (or None) in the PartitionAxis."
                    )
                owner[axis] = (dim_index, logical)
                size = mesh_sizes[axis]
                if dim % (product * size):
                    combined = (
                        f" (combined with {tuple(kept)}: {product * size})" if kept else ""
                    )
                    report.append(
                        f"{where}: mesh axis {axis!r} (size {size}){combined} does not divide "
                        f"{dim}; replicated along {axis!r}."
                    )
                    continue
                kept.append(axis)
                product *= size
            entries.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
        return PartitionSpec(*entries), tuple(report)

    def _resolve(
        self, axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, stacklevel: int
    ) -> PartitionSpec:
        """resolve_with_report + one warning per message; `stacklevel` counts from the public
        method that calls this (2 = that method's caller), so warnings point at user code."""
        spec, report = self.resolve_with_report(axes, shape, mesh=mesh)
        for message in report:
            warnings.warn(message, ShardingAdjustedWarning, stacklevel=stacklevel + 1)
        return spec

    def resolve(self, axes: Sequence[str | None], shape: Sequence[int], *, mesh: Mesh) -> PartitionSpec:
        """The PartitionSpec for `shape` on `mesh`; warns once per adjustment made.

        A mesh axis is dropped from a dimension when the mesh lacks it or when it (times the axes
        kept before it on that dimension) does not divide the dimension; the dimension is then
        replicated along that axis, and a `ShardingAdjustedWarning` says so.

        Args:
          axes: one logical axis name (or None: never sharded) per dimension, e.g.
            ``("kv_head", "page", None, None)``.
          shape: the array's shape, as many non-negative ints as ``axes``.
          mesh: the `Mesh` to shard over.
        """
        return self._resolve(axes, shape, mesh, stacklevel=2)

    def named_sharding(
        self, axes: Sequence[str | None], shape: Sequence[int], *, mesh: Mesh
    ) -> NamedSharding:
        """A NamedSharding for `shape` on `mesh`, resolved (and reported) like `resolve`.

        Args:
          axes: one logical axis name (or None: never sharded) per dimension, e.g.
            ``("kv_head", "page", None, None)``.
          shape: the array's shape, as many non-negative ints as ``axes``.
          mesh: the `Mesh` to shard over.
        """
        return NamedSharding(mesh, self._resolve(axes, shape, mesh, stacklevel=2))

    def constrain(self, x: jax.Array, axes: Sequence[str | None], *, mesh: Mesh) -> jax.Array:
        """`jax.lax.with_sharding_constraint` with the resolved spec; usable inside jit.

        Args:
          x: the array to constrain; its shape is resolved as in `resolve`.
          axes: one logical axis name (or None: never sharded) per dimension of ``x``.
          mesh: the `Mesh` to shard over.
        """
        sharding = NamedSharding(mesh, self._resolve(axes, x.shape, mesh, stacklevel=2))
        constrained: jax.Array = jax.lax.with_sharding_constraint(x, sharding)  # typed Any by jax
        return constrained
