"""Memory tiers of a cache: its pages handed to host memory and back (``sleep``: `sleep` /
`wake`), and the host-memory tier behind the device pool (``host``: `HostTier`).

They sit on top of the pages and the page manager, beside checkpoints. This package never
imports ``checkpoint``, which brings orbax and files. A wake on another mesh lays the metadata
out as a restore does, with the one rule both share (``easykv.spec.relayout``)."""

from easykv.tiers.host import HostTier
from easykv.tiers.sleep import SleepingCache, device_bytes, sleep, wake

__all__ = ["HostTier", "SleepingCache", "device_bytes", "sleep", "wake"]
