"""Tests of ``easykv.attention``: paged attention against the numpy reference."""
