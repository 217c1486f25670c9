"""Tests of the per-step metadata (``easykv.step.metadata``, ``easykv.step.checks``)."""
