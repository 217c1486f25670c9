"""The cache description's fields against hostile values (tests/support/hostile.py says what
every call must do): garbage of every type and integers of any size."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given

from easykv import PagedAttentionCacheMetaData
from easykv.validation import INT32_MAX
from tests.support.hostile import GARBAGE, INTS, META, check_refused_or_in_range, exact

METADATA_CALLS: list[tuple[str, Callable[[Any], Any], tuple[int, int] | None]] = [
    *[(f"metadata.{field}", (lambda f: lambda x: META.replace(**{f: x}))(field), None)
      for field in ("batch_size", "num_hidden_layers", "num_pages_per_layer", "page_size", "num_kv_heads",
                    "kv_head_dim_size", "kv_head_shards", "page_shards", "memory_bytes_per_device", "hbm_utilization",
                    "dtype", "quantization", "kv_head_mesh_axes")],
    ("metadata.from_json", lambda x: PagedAttentionCacheMetaData.from_json(json.dumps(
        {**META.to_dict(), "batch_size": exact(x)}) if exact(x) is not None else x), (1, INT32_MAX)),
]


@pytest.mark.parametrize("name,call,bounds", METADATA_CALLS, ids=[c[0] for c in METADATA_CALLS])
def test_metadata_arguments_refuse_garbage(name, call, bounds):
    for x in GARBAGE:
        check_refused_or_in_range(call, x, bounds, name)


@pytest.mark.parametrize("name,call,bounds", [c for c in METADATA_CALLS if c[2]],
                         ids=[c[0] for c in METADATA_CALLS if c[2]])
@given(x=INTS)
def test_metadata_integers_of_any_size_are_bounded_before_use(name, call, bounds, x):
    check_refused_or_in_range(call, x, bounds, name)
