"""Tests that run every script of ``examples/``."""
