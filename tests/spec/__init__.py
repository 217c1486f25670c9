"""Tests of ``easykv.spec``: the cache description, its sizing, JSON and layer groups."""
