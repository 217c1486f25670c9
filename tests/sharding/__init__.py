"""Tests of the ``sharding`` package: meshes and logical-axis rules."""
