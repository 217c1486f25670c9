"""Tests of ``easykv.integrations`` that need no EasyDeL install (the rest: tests_easydel)."""
