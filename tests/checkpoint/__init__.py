"""Tests of ``easykv.checkpoint``: saves, restores, integrity and sequence transfer."""
