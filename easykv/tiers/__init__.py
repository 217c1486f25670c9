"""Memory tiers of a cache: its pages handed to host memory and back (`sleep` / `wake`), and the
host-memory tier behind the device pool (`HostTier`)."""

from easykv.tiers.host import HostTier
from easykv.tiers.sleep import SleepingCache, device_bytes, sleep, wake

__all__ = ["HostTier", "SleepingCache", "device_bytes", "sleep", "wake"]
