"""Tests of ``easykv.tiers``: the host-memory tier, sleep and wake."""
