"""Tests of ``easykv demo``: the small model and engine loop, end to end."""
