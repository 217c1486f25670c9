"""The step metadata's constructors against hostile values (tests/support/hostile.py says what
every call must do): garbage of every type and integers of any size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given

from easykv import PagedAttentionMetadata
from easykv.step.metadata import increment_cache_lengths
from easykv.validation import INT32_MAX, INT64_MAX
from tests.support.hostile import DECODE, GARBAGE, INTS, META, check_refused_or_in_range
from tests.support.pools import MAX_LEN, PAGES

RUNTIME_CALLS: list[tuple[str, Callable[[Any], Any], tuple[int, int] | None]] = [
    ("for_prefill(page)", lambda x: PagedAttentionMetadata.for_prefill([x], 1, cache_metadata=META), (0, PAGES - 1)),
    ("for_prefill(length)", lambda x: PagedAttentionMetadata.for_prefill([0, 1, 2, 3], x, cache_metadata=META),
     (0, MAX_LEN)),
    ("for_prefill(start)", lambda x: PagedAttentionMetadata.for_prefill([0, 1, 2, 3], 1, start=x, cache_metadata=META),
     (0, MAX_LEN - 1)),
    ("for_prefill(padded_length)",
     lambda x: PagedAttentionMetadata.for_prefill([0], 1, padded_length=x, cache_metadata=META), (1, MAX_LEN)),
    ("for_decode(page)", lambda x: PagedAttentionMetadata.for_decode([[x]], [0], cache_metadata=META), (0, PAGES - 1)),
    ("for_decode(position)",
     lambda x: PagedAttentionMetadata.for_decode([[0, 1, 2, 3]], [x], cache_metadata=META), (-1, MAX_LEN - 1)),
    ("for_mixed(page)", lambda x: PagedAttentionMetadata.for_mixed([[x]], [0], [1], cache_metadata=META),
     (0, PAGES - 1)),
    ("for_mixed(cached)", lambda x: PagedAttentionMetadata.for_mixed([[0, 1, 2, 3]], [x], [1], cache_metadata=META),
     (0, MAX_LEN - 1)),
    ("for_mixed(new)", lambda x: PagedAttentionMetadata.for_mixed([[0, 1, 2, 3]], [0], [x], cache_metadata=META),
     (0, MAX_LEN)),
    ("for_mixed(pad_tokens_to)",
     lambda x: PagedAttentionMetadata.for_mixed([[0]], [0], [1], pad_tokens_to=x, cache_metadata=META),
     (1, 4 * MAX_LEN)),
    ("for_mixed(pad_seqs_to)",
     lambda x: PagedAttentionMetadata.for_mixed([[0]], [0], [1], pad_seqs_to=x, cache_metadata=META), (1, 4)),
    ("increment_cache_lengths(page_size)", lambda x: increment_cache_lengths(DECODE, page_size=x), (1, INT32_MAX)),
    ("increment_cache_lengths(num_pages)",
     lambda x: increment_cache_lengths(DECODE, page_size=4, num_pages=x), (1, INT32_MAX)),
]


@pytest.mark.parametrize("name,call,bounds", RUNTIME_CALLS, ids=[c[0] for c in RUNTIME_CALLS])
def test_runtime_arguments_refuse_garbage(name, call, bounds):
    for x in GARBAGE:
        check_refused_or_in_range(call, x, bounds, name)


@pytest.mark.parametrize("name,call,bounds", [c for c in RUNTIME_CALLS if c[2]],
                         ids=[c[0] for c in RUNTIME_CALLS if c[2]])
@given(x=INTS)
def test_runtime_integers_of_any_size_are_bounded_before_use(name, call, bounds, x):
    check_refused_or_in_range(call, x, bounds, name)


def test_integer_arrays_with_uint64_entries_are_exact():
    with pytest.raises(ValueError, match=r"new_lens\[0\] = 18446744073709551611 is out of range"):
        PagedAttentionMetadata.for_mixed([[0]], [0], np.array([2**64 - 5], np.uint64), cache_metadata=META)
    with pytest.raises(ValueError, match=r"page_table\[0, 0\] = 9223372036854775808 is out of range"):
        PagedAttentionMetadata.for_decode(np.array([[2**63]], np.uint64), [0], cache_metadata=META)
    assert INT64_MAX == 2**63 - 1
