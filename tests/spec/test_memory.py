"""device_memory_budget: memory_stats rules, the cgroup-aware host rule, and the override."""

from __future__ import annotations

import os

import jax
import pytest

from easykv.errors import MemoryUnavailableError
from easykv.spec.memory import HostMemory, MemoryBudget, device_memory_budget, read_host_memory

GIB = 2**30


class FakeDevice:
    def __init__(self, stats, name="tpu:0", process_index=0):
        self._stats, self._name, self.process_index = stats, name, process_index

    def memory_stats(self):
        return self._stats

    def __str__(self):
        return self._name


def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def meminfo(kb):
    return f"MemTotal:       99999999 kB\nMemFree:  1 kB\nMemAvailable:   {kb} kB\n"


# ---- memory_stats ---------------------------------------------------------------------------

def test_bytes_limit_with_in_use():
    d = FakeDevice({"bytes_limit": 16 * GIB, "bytes_in_use": GIB})
    b = device_memory_budget([d], 0.9)
    assert b == MemoryBudget(int(16 * GIB * 0.9) - GIB, "memory_stats", b.detail)
    assert "bytes_limit" in b.detail and "0.90" in b.detail and "tpu:0" in b.detail


def test_reservable_limit_used_when_bytes_limit_missing_or_nonpositive():
    for stats in ({"bytes_reservable_limit": 8 * GIB, "bytes_in_use": 0},
                  {"bytes_limit": -1, "bytes_reservable_limit": 8 * GIB, "bytes_in_use": 0}):
        b = device_memory_budget([FakeDevice(stats)], 0.5)
        assert b.per_device_bytes == 4 * GIB
        assert "bytes_reservable_limit" in b.detail


def test_no_limit_keys_raises_naming_keys():
    d = FakeDevice({"bytes_limit": -1, "bytes_in_use": 5, "peak_bytes_in_use": 7})
    with pytest.raises(MemoryUnavailableError) as e:
        device_memory_budget([d], 0.9)
    msg = str(e.value)
    assert "tpu:0" in msg and "peak_bytes_in_use" in msg and "memory_bytes_per_device" in msg
    with pytest.raises(MemoryUnavailableError):
        device_memory_budget([FakeDevice({})], 0.9)


@pytest.mark.parametrize("in_use", [None, -1])
def test_in_use_missing_taken_as_zero(in_use):
    stats = {"bytes_limit": 10 * GIB}
    if in_use is not None:
        stats["bytes_in_use"] = in_use
    b = device_memory_budget([FakeDevice(stats)], 1.0)
    assert b.per_device_bytes == 10 * GIB
    assert "bytes_in_use not reported, taken as 0" in b.detail


def test_min_over_devices():
    devs = [FakeDevice({"bytes_limit": 16 * GIB, "bytes_in_use": i * GIB}, f"tpu:{i}")
            for i in range(4)]
    b = device_memory_budget(devs, 1.0)
    assert b.per_device_bytes == 13 * GIB
    assert "tpu:3" in b.detail and "4 devices" in b.detail


def test_other_process_devices_are_not_queried():
    class Remote(FakeDevice):
        def memory_stats(self):
            raise AssertionError("remote device queried")
    devs = [FakeDevice({"bytes_limit": 4 * GIB}), Remote(None, "tpu:9", process_index=1)]
    assert device_memory_budget(devs, 1.0).per_device_bytes == 4 * GIB


def test_budget_nonpositive_raises_with_figures_and_fix():
    d = FakeDevice({"bytes_limit": 10 * GIB, "bytes_in_use": 9 * GIB})
    with pytest.raises(ValueError) as e:
        device_memory_budget([d], 0.9)
    msg = str(e.value)
    assert "in use 9.00 GiB" in msg and "hbm_utilization" in msg
    assert "memory_bytes_per_device" in msg


def test_mixed_device_kinds_raise():
    devs = [FakeDevice({"bytes_limit": GIB}), FakeDevice(None, "cpu:0")]
    with pytest.raises(ValueError, match="mix"):
        device_memory_budget(devs, 0.9)


def test_empty_devices_raise():
    with pytest.raises(ValueError, match="empty"):
        device_memory_budget([], 0.9)


# ---- override and utilization ---------------------------------------------------------------

def test_override_is_the_budget_without_utilization():
    d = FakeDevice({"bytes_limit": 1})  # never consulted
    b = device_memory_budget([d], 0.5, memory_bytes_per_device=3 * GIB)
    assert (b.per_device_bytes, b.source) == (3 * GIB, "override")
    assert "not applied" in b.detail


@pytest.mark.parametrize("bad", [0, -5, 1.5, "1", True, 2.0**30])
def test_override_must_be_positive_int(bad):
    with pytest.raises(ValueError, match="memory_bytes_per_device") as e:
        device_memory_budget([], 0.9, memory_bytes_per_device=bad)
    assert repr(bad) in str(e.value)


@pytest.mark.parametrize("bad", [0, -0.1, 1.01, float("nan"), "0.9", True])
def test_utilization_validated_even_with_override(bad):
    with pytest.raises(ValueError, match="hbm_utilization") as e:
        device_memory_budget([], bad, memory_bytes_per_device=GIB)
    assert repr(bad) in str(e.value)


# ---- host rule ------------------------------------------------------------------------------

def test_host_rule_with_injected_reader():
    devs = [FakeDevice(None, f"cpu:{i}") for i in range(8)]
    b = device_memory_budget(devs, 0.5, host_memory_reader=lambda: HostMemory(16 * GIB))
    assert (b.per_device_bytes, b.source) == (GIB, "host")
    assert "shared by 8 local devices" in b.detail
    b = device_memory_budget(devs, 1.0,
                             host_memory_reader=lambda: HostMemory(16 * GIB, 10 * GIB, 2 * GIB))
    assert b.per_device_bytes == GIB and "cgroup limit 10.00 GiB" in b.detail


def test_host_rule_nonpositive_raises():
    devs = [FakeDevice(None, "cpu:0")]
    with pytest.raises(ValueError, match="no memory left"):
        device_memory_budget(devs, 0.9, host_memory_reader=lambda: HostMemory(GIB, GIB, 2 * GIB))


def test_read_host_meminfo_only(tmp_path):
    write(tmp_path, "proc/meminfo", meminfo(1024))
    assert read_host_memory(str(tmp_path)) == HostMemory(1024 * 1024, None, None)


def test_read_host_cgroup_v2(tmp_path):
    write(tmp_path, "proc/meminfo", meminfo(8 * 1024 * 1024))  # 8 GiB
    write(tmp_path, "sys/fs/cgroup/memory.max", f"{4 * GIB}\n")
    write(tmp_path, "sys/fs/cgroup/memory.current", f"{GIB}\n")
    host = read_host_memory(str(tmp_path))
    assert host == HostMemory(8 * GIB, 4 * GIB, GIB)
    devs = [FakeDevice(None, f"cpu:{i}") for i in range(3)]
    b = device_memory_budget(devs, 1.0, host_memory_reader=lambda: host)
    assert b.per_device_bytes == GIB  # min(8, 4 - 1) GiB over 3 devices


def test_read_host_cgroup_v2_nested_takes_tightest(tmp_path):
    write(tmp_path, "proc/meminfo", meminfo(8 * 1024 * 1024))
    write(tmp_path, "proc/self/cgroup", "0::/pod/ctr\n")
    write(tmp_path, "sys/fs/cgroup/pod/memory.max", f"{4 * GIB}")
    write(tmp_path, "sys/fs/cgroup/pod/memory.current", f"{3 * GIB}")
    write(tmp_path, "sys/fs/cgroup/pod/ctr/memory.max", "max")
    assert read_host_memory(str(tmp_path)) == HostMemory(8 * GIB, 4 * GIB, 3 * GIB)


def test_read_host_cgroup_v2_unlimited(tmp_path):
    write(tmp_path, "proc/meminfo", meminfo(1024))
    write(tmp_path, "sys/fs/cgroup/memory.max", "max\n")
    write(tmp_path, "sys/fs/cgroup/memory.current", "123\n")
    assert read_host_memory(str(tmp_path)).cgroup_limit is None


def test_read_host_cgroup_v1(tmp_path):
    write(tmp_path, "proc/meminfo", meminfo(8 * 1024 * 1024))
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", f"{2 * GIB}\n")
    write(tmp_path, "sys/fs/cgroup/memory/memory.usage_in_bytes", f"{GIB // 2}\n")
    assert read_host_memory(str(tmp_path)) == HostMemory(8 * GIB, 2 * GIB, GIB // 2)


def test_read_host_cgroup_v1_unlimited(tmp_path):
    write(tmp_path, "proc/meminfo", meminfo(1024))
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    assert read_host_memory(str(tmp_path)).cgroup_limit is None


def test_missing_meminfo_raises(tmp_path):
    with pytest.raises(MemoryUnavailableError, match="memory_bytes_per_device"):
        read_host_memory(str(tmp_path))
    devs = [FakeDevice(None, "cpu:0")]
    with pytest.raises(MemoryUnavailableError):
        device_memory_budget(devs, 0.9, host_memory_reader=lambda: read_host_memory(str(tmp_path)))


@pytest.mark.parametrize("text", ["MemTotal: 5 kB\n", "MemAvailable: lots kB\n",
                                  "MemAvailable: 12 MB\n"])
def test_corrupt_meminfo_names_path(tmp_path, text):
    write(tmp_path, "proc/meminfo", text)
    with pytest.raises(MemoryUnavailableError) as e:
        read_host_memory(str(tmp_path))
    assert os.path.join(str(tmp_path), "proc/meminfo") in str(e.value)


def test_corrupt_cgroup_file_names_path(tmp_path):
    write(tmp_path, "proc/meminfo", meminfo(1024))
    write(tmp_path, "sys/fs/cgroup/memory.max", "lots\n")
    with pytest.raises(MemoryUnavailableError, match="memory.max"):
        read_host_memory(str(tmp_path))


def test_cgroup_limit_without_usage_raises(tmp_path):
    write(tmp_path, "proc/meminfo", meminfo(1024))
    write(tmp_path, "sys/fs/cgroup/memory.max", "4096\n")
    with pytest.raises(MemoryUnavailableError, match="memory.current"):
        read_host_memory(str(tmp_path))


def test_real_cpu_devices_host_rule():
    devices = jax.devices()
    assert len(devices) == 8 and all(d.memory_stats() is None for d in devices)
    b = device_memory_budget(devices, 0.9)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert b.source == "host"
    assert 0 < b.per_device_bytes < total / 8
