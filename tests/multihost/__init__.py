"""Tests of multi-process runs and the local launcher (``easykv.multihost``)."""
