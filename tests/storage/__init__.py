"""Tests of ``easykv.storage``: pages on devices, writes, copies, the cache and its views."""
