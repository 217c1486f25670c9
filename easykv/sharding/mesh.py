"""Building device meshes with checked axis sizes.

`create_mesh` exists so a wrong mesh fails at construction with a message that says what to
change, rather than later as an opaque reshape error, and so every easykv mesh uses `Auto` axis
types: easykv places arrays with explicit `NamedSharding`s and sharding constraints, and JAX's
newer default (`Explicit` axes) would change the typing rules of every jitted op underneath.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AxisDims = Mapping[str, int] | Sequence[tuple[str, int]]


def _parse_axis_dims(axis_dims: AxisDims) -> list[tuple[str, int]]:
    """Turn a mapping or a sequence of (name, size) pairs into a validated list of pairs."""
    if isinstance(axis_dims, Mapping):
        pairs = list(axis_dims.items())
    elif isinstance(axis_dims, Sequence) and not isinstance(axis_dims, (str, bytes)):
        pairs = []
        for entry in axis_dims:
            if not isinstance(entry, Sequence) or isinstance(entry, (str, bytes)) or len(entry) != 2:
                raise ValueError(
                    f"create_mesh: axis entry {entry!r} is not a (name, size) pair; pass e.g. "
                    "{'dp': 1, 'tp': 8} or [('dp', 1), ('tp', 8)]."
                )
            pairs.append((entry[0], entry[1]))
    else:
        raise ValueError(
            f"create_mesh: axis_dims={axis_dims!r} must be a mapping name -> size or a sequence of "
            "(name, size) pairs, e.g. {'dp': 1, 'tp': 8}."
        )
    if not pairs:
        raise ValueError("create_mesh: axis_dims is empty; pass at least one axis, e.g. {'tp': -1}.")

    seen: set[str] = set()
    out: list[tuple[str, int]] = []
    for name, size in pairs:
        if not isinstance(name, str) or not name:
            raise ValueError(f"create_mesh: axis name {name!r} must be a non-empty string.")
        if name in seen:
            raise ValueError(f"create_mesh: axis name {name!r} appears twice; axis names must be unique.")
        seen.add(name)
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise ValueError(
                f"create_mesh: axis {name!r} has size {size!r}; sizes must be positive integers "
                "(or -1 for 'all remaining devices')."
            )
        size = int(size)
        if size != -1 and size < 1:
            raise ValueError(
                f"create_mesh: axis {name!r} has size {size}; sizes must be positive integers "
                "(or -1 for 'all remaining devices')."
            )
        out.append((name, size))
    wildcards = [name for name, size in out if size == -1]
    if len(wildcards) > 1:
        raise ValueError(
            f"create_mesh: axes {wildcards} all have size -1; at most one axis may take the "
            "remaining devices."
        )
    return out


# ``devices``: jax.Device objects; Any because jaxlib, which defines the class, gives mypy no types for it.
def create_mesh(axis_dims: AxisDims, *, devices: Sequence[Any] | None = None) -> Mesh:
    """Build a `Mesh` with `Auto` axis types over all devices (or the ones given).

    Args:
      axis_dims: the axes in order (major axis first), a mapping name -> size or a sequence of
        ``(name, size)`` pairs, e.g. ``{"dp": 1, "tp": 8}``; one size may be -1 for "all
        remaining devices". The sizes must multiply to the number of devices.
      devices: the devices to use, each once (None: all of ``jax.devices()``). Without them,
        `jax.make_mesh` chooses a device order that keeps fast-interconnect neighbours on minor
        axes and spans every process in multi-host runs; given, they are laid out in the order
        given, row-major, which is what callers who pass an explicit order expect.

    Raises:
      ValueError: a malformed ``axis_dims``, sizes that do not fit the devices, or a device
        listed twice.
    """
    pairs = _parse_axis_dims(axis_dims)
    if devices is not None:
        devices = list(devices)
        if len(set(id(d) for d in devices)) != len(devices):
            raise ValueError("create_mesh: `devices` lists a device more than once; pass each once.")
    n_devices = len(devices) if devices is not None else jax.device_count()
    source = "len(devices)" if devices is not None else "jax.device_count()"

    known = math.prod(size for _, size in pairs if size != -1)
    if any(size == -1 for _, size in pairs):
        if n_devices % known:
            raise ValueError(
                f"create_mesh: the fixed axes {dict(pairs)} multiply to {known}, which does not "
                f"divide the {n_devices} devices ({source}); choose sizes whose product divides "
                f"{n_devices}."
            )
        pairs = [(name, n_devices // known if size == -1 else size) for name, size in pairs]

    names = tuple(name for name, _ in pairs)
    shape = tuple(size for _, size in pairs)
    product = math.prod(shape)
    if product != n_devices:
        raise ValueError(
            f"create_mesh: axis sizes {dict(pairs)} multiply to {product}, but there are "
            f"{n_devices} devices ({source}); make the product equal {n_devices}, e.g. set one "
            "axis to -1 to take the remaining devices."
        )

    axis_types = (AxisType.Auto,) * len(names)
    if devices is None:
        return jax.make_mesh(shape, names, axis_types=axis_types)
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return Mesh(grid.reshape(shape), names, axis_types=axis_types)


def mesh_axis_size(mesh: Mesh, names: str | Sequence[str]) -> int:
    """Product of the sizes of the named mesh axes (1 for none): how many shards they make."""
    if isinstance(names, str):
        names = (names,)
    size = 1
    for name in names:
        if name not in mesh.shape:
            raise ValueError(
                f"mesh has no axis {name!r}; its axes are {tuple(mesh.axis_names)}."
            )
        size *= mesh.shape[name]
    return size
