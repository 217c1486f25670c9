"""Tests of the per-step metadata (``easykv.runtime``, ``easykv.runtime_checks``)."""
