"""Step metadata that would make two tokens (or two logical pages) share one physical place is
refused on the host, and a cache description cannot claim more memory than its budget.

* a page-table row naming one physical page twice: a sequence would read its own page twice
  and write one logical page over another;
* two real tokens of one step with the same slot: the scatter keeps one of them, silently;
* paddings that are not ints, or larger than one step of the cache can hold;
* metadata whose pool does not fit the ``memory_bytes_per_device`` it claims to be sized for.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from easykv import PagedAttentionCacheMetaData, PagedAttentionMetadata
from tests.support.pools import PAGE_SIZE, assert_unchanged, new_cache, setup, snapshot

META = setup("heads")[2]


@pytest.mark.parametrize("make", [
    lambda: PagedAttentionMetadata.for_prefill([3, 3], 8, cache_metadata=META),
    lambda: PagedAttentionMetadata.for_prefill([3, 5, 3], 1, cache_metadata=META),  # even past the length
    lambda: PagedAttentionMetadata.for_decode([[1, 2], [4, 4]], [0, 5], cache_metadata=META),
    lambda: PagedAttentionMetadata.for_mixed([[7, 8, 7, -1]], [0], [9], cache_metadata=META),
], ids=["prefill", "prefill-unused-column", "decode", "mixed"])
def test_a_row_naming_one_page_twice_is_refused(make):
    with pytest.raises(ValueError, match=r"names page \d+ twice"):
        make()


def test_rows_may_share_pages_they_only_read():
    """Prefix sharing: two sequences read the same pages and write to their own."""
    md = PagedAttentionMetadata.for_mixed([[0, 1, -1, -1], [0, 2, -1, -1]], [4, 4], [1, 1], cache_metadata=META)
    assert md.slot_mapping.tolist() == [1 * PAGE_SIZE, 2 * PAGE_SIZE]


@pytest.mark.parametrize("make", [
    lambda: PagedAttentionMetadata.for_decode([[1, -1, -1, -1], [1, -1, -1, -1]], [2, 2], cache_metadata=META),
    lambda: PagedAttentionMetadata.for_mixed([[0, 1, -1, -1], [0, 1, -1, -1]], [4, 4], [1, 1], cache_metadata=META),
    lambda: PagedAttentionMetadata.for_mixed([[5, -1, -1, -1], [5, -1, -1, -1]], [0, 2], [3, 1], cache_metadata=META),
], ids=["decode", "mixed-decodes", "mixed-prefill-and-decode"])
def test_two_tokens_writing_one_slot_are_refused(make):
    with pytest.raises(ValueError, match=r"two tokens of this \w+ step write the same slot"):
        make()


def test_a_write_with_one_slot_twice_changes_nothing():
    cache = new_cache("heads")
    before = snapshot(cache)
    k = np.zeros((2, 8, 8), np.float32).astype(META.dtype)
    with pytest.raises(ValueError, match=r"two tokens of this write step write the same slot 9"):
        cache[0].write_tokens(k, k, [9, 9])
    keys = np.zeros((2, 2, 8, 8), META.dtype)
    with pytest.raises(ValueError, match=r"same slot 9"):
        cache.write(keys, keys, PagedAttentionMetadata(slot_mapping=np.array([9, 9], np.int32)))
    assert_unchanged(cache, before)


@given(rows=st.lists(st.lists(st.integers(-1, 23), min_size=4, max_size=4), min_size=1, max_size=4),
       data=st.data())
def test_for_mixed_accepts_exactly_the_steps_without_shared_pages_or_slots(rows, data):
    """Against a plain reference: a step is accepted iff its pages are assigned, no row repeats a
    page and no two real tokens share a slot; every accepted slot is the reference slot."""
    n = len(rows)
    cached = data.draw(st.lists(st.integers(0, 15), min_size=n, max_size=n))
    new = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    slots, ok = [], True
    for row, c, k in zip(rows, cached, new):
        real = [p for p in row if p >= 0]
        ok &= len(real) == len(set(real)) and c + k <= 16
        for pos in range(c, c + k):
            page = row[pos // PAGE_SIZE] if pos // PAGE_SIZE < 4 else -1
            ok &= page >= 0
            slots.append(page * PAGE_SIZE + pos % PAGE_SIZE)
    ok &= len(slots) == len(set(slots))
    try:
        md = PagedAttentionMetadata.for_mixed(rows, cached, new, cache_metadata=META)
    except ValueError:
        assert not ok
        return
    assert ok and md.slot_mapping.tolist() == slots


@pytest.mark.parametrize("pad", [2.7, True, "3", 2**40, -1, np.float32(3), [4]])
def test_paddings_must_be_ints_a_step_can_hold(pad):
    with pytest.raises(ValueError, match=r"pad_tokens_to"):
        PagedAttentionMetadata.for_mixed([[0, -1, -1, -1]], [0], [1], cache_metadata=META, pad_tokens_to=pad)
    with pytest.raises(ValueError, match=r"pad_seqs_to"):
        PagedAttentionMetadata.for_mixed([[0, -1, -1, -1]], [0], [1], cache_metadata=META, pad_seqs_to=pad)


def test_metadata_cannot_claim_a_pool_beyond_its_budget():
    sized = META.replace(memory_bytes_per_device=META.bytes_per_device)  # exactly fits
    text = json.loads(sized.to_json())
    text["num_pages_per_layer"] = 10**6
    with pytest.raises(ValueError, match=r"memory_bytes_per_device"):
        PagedAttentionCacheMetaData.from_json(json.dumps(text))
    text = json.loads(sized.to_json())
    text["memory_bytes_per_device"] = 1000
    with pytest.raises(ValueError, match=r"the pool needs \d+ bytes per device .* but memory_bytes_per_device=1000"):
        PagedAttentionCacheMetaData.from_json(json.dumps(text))
    with pytest.raises(ValueError, match=r"__version__"):
        PagedAttentionCacheMetaData.from_json(json.dumps({**json.loads(sized.to_json()), "__version__": True}))
