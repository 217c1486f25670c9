"""Tests of ``easykv.tiers.store``: the shared prefix store, its URLs and backends."""
