"""Memory tiers of a cache: its pages handed to host memory and back (`sleep` / `wake`)."""

from easykv.tiers.sleep import SleepingCache, device_bytes, sleep, wake

__all__ = ["SleepingCache", "device_bytes", "sleep", "wake"]
