"""How many bytes each device can give the KV cache.

The cache is sized from this number, so it must be honest: accelerators report their allocator
limit through ``Device.memory_stats()``; CPU devices report nothing, so we read the host's
``MemAvailable`` and any cgroup (container) limit, and split it among the devices that share the
host. Anything we cannot read is an error that tells the user to pass
``memory_bytes_per_device=`` -- never a guessed number.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import TYPE_CHECKING, Any

import jax

from easykv.errors import MemoryUnavailableError
from easykv.validation import INT64_MAX, positive_int, real

if TYPE_CHECKING:
    from jax.sharding import AbstractMesh, Mesh

_GIB = 2**30
_CGROUP_V1_UNLIMITED = 2**60  # v1 reports "no limit" as a huge page-rounded number


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes per device the cache may use (utilization applied, bytes in use subtracted).

    Attributes:
      per_device_bytes: bytes each device can give the cache, positive.
      source: ``"memory_stats"`` (the devices' allocator limits), ``"host"`` (host memory, for
        devices without stats) or ``"override"`` (``memory_bytes_per_device`` given).
      detail: one line with the figures, for `easykv plan` and error messages.
    """

    per_device_bytes: int
    source: str  # "memory_stats", "host" or "override"
    detail: str  # one line with the figures, for `easykv plan` and error messages


@dataclass(frozen=True)
class HostMemory:
    """What the host (and its cgroup, if any) has free; cgroup fields are None without a limit."""

    mem_available: int
    cgroup_limit: int | None = None
    cgroup_usage: int | None = None


def _gib(n: int | float) -> str:
    return f"{n / _GIB:.2f} GiB"


def _read_int(path: str) -> int | None:
    """The integer in ``path``; None if the file is absent; MemoryUnavailableError if garbled."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    return _parse_int(path, text)


def _parse_int(path: str, text: str) -> int:
    """The integer ``text`` read from ``path``; MemoryUnavailableError if garbled."""
    try:
        return int(text)
    except ValueError:
        raise MemoryUnavailableError(
            f"cannot parse {path}: expected an integer, got {text[:60]!r}; "
            "pass memory_bytes_per_device= to size the cache explicitly") from None


def _read_meminfo(path: str) -> int:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise MemoryUnavailableError(
            f"cannot determine host memory: {path} does not exist; "
            "pass memory_bytes_per_device= to size the cache explicitly") from None
    for line in lines:
        if line.startswith("MemAvailable:"):
            parts = line.split()
            if len(parts) == 3 and parts[1].isdigit() and parts[2] == "kB":
                return int(parts[1]) * 1024
            raise MemoryUnavailableError(
                f"cannot parse {path}: malformed line {line!r} (expected 'MemAvailable: N kB'); "
                "pass memory_bytes_per_device= to size the cache explicitly")
    raise MemoryUnavailableError(
        f"cannot parse {path}: no MemAvailable line; "
        "pass memory_bytes_per_device= to size the cache explicitly")


def _cgroup_v2_dirs(root: str) -> list[str]:
    """This process's cgroup v2 directory and its ancestors: every one of their limits applies."""
    base = os.path.join(root, "sys/fs/cgroup")
    rel = ""
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            for line in f:
                if line.startswith("0::"):
                    rel = line[3:].strip().strip("/")
    except FileNotFoundError:
        pass
    dirs = [base]
    parts = [p for p in rel.split("/") if p]
    for i in range(len(parts)):
        dirs.append(os.path.join(base, *parts[: i + 1]))
    return dirs


def read_host_memory(root: str = "/") -> HostMemory:
    """Read ``MemAvailable`` and the tightest cgroup memory limit under filesystem ``root``.

    ``root`` exists so tests can point this at a directory of fake ``/proc`` and ``/sys`` files.
    cgroup v2: ``memory.max`` (unless ``"max"``) with ``memory.current``, in this process's
    cgroup and its ancestors; cgroup v1 (only if no v2 limit): ``memory/memory.limit_in_bytes``
    below 2**60 with ``memory/memory.usage_in_bytes`` at the mount root.
    """
    available = _read_meminfo(os.path.join(root, "proc/meminfo"))
    best: tuple[int, int] | None = None  # (limit, usage) with the least headroom
    for d in _cgroup_v2_dirs(root):
        max_path = os.path.join(d, "memory.max")
        try:
            with open(max_path) as f:
                text = f.read().strip()
        except FileNotFoundError:
            continue
        if text == "max":
            continue
        limit = _parse_int(max_path, text)
        usage = _read_int(os.path.join(d, "memory.current"))
        if usage is None:
            raise MemoryUnavailableError(
                f"{max_path} sets a limit but {os.path.join(d, 'memory.current')} is missing; "
                "pass memory_bytes_per_device= to size the cache explicitly")
        if best is None or limit - usage < best[0] - best[1]:
            best = (limit, usage)
    if best is None:
        v1 = os.path.join(root, "sys/fs/cgroup/memory")
        v1_limit = _read_int(os.path.join(v1, "memory.limit_in_bytes"))
        if v1_limit is not None and v1_limit < _CGROUP_V1_UNLIMITED:
            usage = _read_int(os.path.join(v1, "memory.usage_in_bytes"))
            if usage is None:
                raise MemoryUnavailableError(
                    f"{v1}/memory.limit_in_bytes sets a limit but memory.usage_in_bytes is "
                    "missing; pass memory_bytes_per_device= to size the cache explicitly")
            best = (v1_limit, usage)
    if best is None:
        return HostMemory(available)
    return HostMemory(available, best[0], best[1])


def _check_utilization(hbm_utilization: Any) -> float:
    return real("hbm_utilization", hbm_utilization, lo=0, hi=1, lo_open=True,
                hint="e.g. 0.9 lets the cache take 90% of each device's memory limit")


def _local(devices: Sequence[Any]) -> list[Any]:
    """The devices of this process: memory of other hosts' devices cannot be queried here."""
    me = jax.process_index()
    return [d for d in devices if getattr(d, "process_index", me) == me]


def _from_stats(name: str, stats: dict[str, Any], util: float) -> tuple[int, str]:
    limit_key = next((k for k in ("bytes_limit", "bytes_reservable_limit")
                      if isinstance(stats.get(k), Integral) and stats[k] > 0), None)
    if limit_key is None:
        raise MemoryUnavailableError(
            f"device {name} reports no positive bytes_limit or bytes_reservable_limit in "
            f"memory_stats() (keys: {sorted(stats)}); "
            "pass memory_bytes_per_device= to size the cache explicitly")
    limit = int(stats[limit_key])
    in_use = stats.get("bytes_in_use")
    if isinstance(in_use, Integral) and int(in_use) >= 0:
        used, note = int(in_use), f"in use {_gib(int(in_use))}"
    else:
        used, note = 0, "bytes_in_use not reported, taken as 0"
    budget = int(limit * util) - used
    return budget, f"{name} {limit_key} {_gib(limit)} x {util:.2f} - {note}"


def device_memory_budget(
    devices: Sequence[Any],  # jax.Device: Any, jaxlib gives mypy no types for the class
    hbm_utilization: float,
    *,
    memory_bytes_per_device: int | None = None,
    host_memory_reader: Callable[[], HostMemory] | None = None,
) -> MemoryBudget:
    """The bytes each device can give the cache.

    - ``memory_bytes_per_device`` given: it IS the per-device cache budget; ``hbm_utilization``
      is not applied to it (it is still validated, so a bad value fails on every machine alike).
    - Devices with ``memory_stats()``: ``int(limit * hbm_utilization) - bytes_in_use``, where
      limit is ``bytes_limit`` or else ``bytes_reservable_limit``; the minimum over the devices
      of this process (other hosts' devices cannot be queried; hosts are assumed alike).
    - Devices without stats (CPU): the host's available memory (cgroup-aware, see
      ``read_host_memory``) times ``hbm_utilization``, split evenly among those devices.

    Raises ValueError for bad arguments, a non-positive budget or mixed device kinds, and
    MemoryUnavailableError when the memory cannot be read.

    Args:
      devices: the cache's devices (e.g. ``mesh.devices.flat``); only this process's are read.
      hbm_utilization: the share of each device's memory limit (or of the host's available
        memory) the cache may take, in ``(0, 1]``.
      memory_bytes_per_device: the budget itself, in bytes per device (None: read it).
      host_memory_reader: called for the host's `HostMemory` when the devices have no stats
        (None: `read_host_memory`).
    """
    util = _check_utilization(hbm_utilization)
    if memory_bytes_per_device is not None:
        n = positive_int("memory_bytes_per_device", memory_bytes_per_device, hi=INT64_MAX,
                         hint="bytes, e.g. 8 * 2**30 for 8 GiB per device")
        return MemoryBudget(n, "override",
                            f"memory_bytes_per_device={n} ({_gib(n)}), utilization not applied")
    devices = list(devices)
    if not devices:
        raise ValueError("devices is empty; pass the mesh's devices (e.g. mesh.devices.flat)")
    local = _local(devices)
    if not local:
        raise ValueError(
            f"none of the {len(devices)} devices belongs to this process "
            f"(process_index {jax.process_index()}); pass memory_bytes_per_device=")
    stats = [(d, d.memory_stats()) for d in local]
    with_stats = [str(d) for d, s in stats if s is not None]
    without = [str(d) for d, s in stats if s is None]
    if with_stats and without:
        raise ValueError(
            f"devices mix kinds: {with_stats} report memory_stats() but {without} do not; "
            "build the cache on one kind of device, or pass memory_bytes_per_device=")
    if with_stats:
        for d, s in stats:
            if not isinstance(s, dict):
                raise MemoryUnavailableError(
                    f"device {d} memory_stats() returned {type(s).__name__}, not a dict; "
                    "pass memory_bytes_per_device=")
        budget, detail = min((_from_stats(str(d), s, util) for d, s in stats),
                             key=lambda t: t[0])
        detail = f"min over {len(local)} devices: {detail}"
        source = "memory_stats"
        fix_hint = "lower memory in use, raise hbm_utilization"
    else:
        host = (host_memory_reader or read_host_memory)()
        available = host.mem_available
        detail = f"host MemAvailable {_gib(available)}"
        if host.cgroup_limit is not None:
            usage = host.cgroup_usage or 0
            available = min(available, host.cgroup_limit - usage)
            detail += f" (cgroup limit {_gib(host.cgroup_limit)}, usage {_gib(usage)})"
        budget = int(available * util) // len(local)
        detail += f" x {util:.2f} shared by {len(local)} local devices"
        source = "host"
        fix_hint = "free host memory, raise hbm_utilization"
    if budget <= 0:
        raise ValueError(
            f"no memory left for the cache: {detail} gives {budget} bytes per device "
            f"(memory in use exceeds the utilization share); {fix_hint}, "
            "or pass memory_bytes_per_device=")
    return MemoryBudget(budget, source, f"{detail} = {_gib(budget)} per device")


def devices_per_host(mesh: Mesh | AbstractMesh) -> int:
    """Devices of ``mesh`` on this process, which share its host memory (an abstract mesh, planned
    from one machine: all of them)."""
    from jax.sharding import Mesh

    if not isinstance(mesh, Mesh):  # an AbstractMesh has no devices
        return int(mesh.size)
    mine = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    return mine or int(mesh.size)
