"""One internal step form, host values checked once.

* `as_mixed` turns EasyDeL's decode and prefill forms into the mixed form with exact fields on
  tiny cases, and the write and attention give the same results from either form;
* a validated constructor or the page manager marks what it proved: the write and attention do
  not run those value checks again (asserted by counting calls of the checks), the marked
  arrays are read-only, and anything that could make the mark stale (a replace, a JSON round
  trip, an array made writable again, another pool) brings the checks back;
* a table with a page released before the window (a windowed caller) is not marked as read-safe:
  attention with that window accepts it, attention without one refuses it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from easykv import PagedAttentionCacheMetaData, PagedAttentionMetadata, PageManager
from easykv.attention import checks as attention_checks
from easykv.attention.api import paged_attention, paged_attention_reference
from easykv.step import checks as runtime_checks
from easykv.step.checks import host_checked
from easykv.step.metadata import INVALID_SLOT, PAD_SLOT, as_mixed, step_form
from easykv.storage import writes
from easykv.storage.writes import token_slots

META = PagedAttentionCacheMetaData(
    batch_size=4, num_hidden_layers=1, num_pages_per_layer=12, num_pages_per_sequence=4,
    max_sequences=16, page_size=4, num_kv_heads=2, kv_head_dim_size=8, hbm_utilization=0.9,
)  # fmt: skip
OTHER_POOL = dataclasses.replace(META, num_pages_per_layer=16)


def fields(step_meta):
    return {f.name: np.asarray(getattr(step_meta, f.name)).tolist() for f in dataclasses.fields(step_meta)}


def test_decode_form_as_mixed_exact():
    md = PagedAttentionMetadata(decodes_position=np.array([5, -1, 0], np.int32),
                                decodes_page_table=np.array([[3, 7, -1], [-1, -1, -1], [11, -1, -1]], np.int32))
    step = as_mixed(md, page_size=4, num_pages=12)
    assert step.decode_only and step.names["page_table"] == "decodes_page_table"
    got = fields(step.step_meta)
    assert got["slot_mapping"] == [29, PAD_SLOT, 44]  # page 7 offset 1; padding; page 11 offset 0
    assert got["positions"] == [5, -1, 0]
    assert got["query_start_loc"] == [0, 1, 2, 3]
    assert got["page_table"] == [[3, 7, -1], [-1, -1, -1], [11, -1, -1]]
    assert got["context_lens"] == [6, 0, 1]
    assert got["num_seqs"] == 3
    assert step_form(step.step_meta) == "mixed"


def test_prefill_form_as_mixed_exact():
    md = PagedAttentionMetadata(prefill_length=np.asarray(5, np.int32),
                                prefill_position=np.array([2, 3, 4, 5, 6, 7, -1], np.int32),
                                prefill_page_table=np.array([9, 1], np.int32))
    step = as_mixed(md, page_size=4, num_pages=12)
    assert not step.decode_only and step.names["positions"] == "prefill_position"
    got = fields(step.step_meta)
    assert got["positions"] == [2, 3, 4, 5, 6, -1, -1]  # rows past prefill_length are padding
    assert got["slot_mapping"] == [38, 39, 4, 5, 6, PAD_SLOT, PAD_SLOT]
    assert got["query_start_loc"] == [0, 5] and got["page_table"] == [[9, 1]]
    assert got["context_lens"] == [7] and got["num_seqs"] == 1
    # inside jit, with a bad page: the slot is invalid, never another page
    traced = jax.jit(lambda m: as_mixed(m, page_size=4, num_pages=12).step_meta.slot_mapping)(
        md.replace(prefill_page_table=jnp.array([9, 12], jnp.int32)))
    assert np.asarray(traced).tolist() == [38, 39, INVALID_SLOT, INVALID_SLOT, INVALID_SLOT, PAD_SLOT, PAD_SLOT]


def test_bad_prefill_length_is_refused_by_the_write_and_attention_alike():
    md = PagedAttentionMetadata(prefill_length=np.asarray(4, np.int32),
                                prefill_position=np.arange(3, dtype=np.int32),
                                prefill_page_table=np.array([9], np.int32))
    with pytest.raises(ValueError, match=r"metadata.prefill_length=4 is outside 0..3 \(the padded chunk\)"):
        token_slots(md, META)
    q, k = np.zeros((3, 2, 8), np.float32), np.zeros((2, 12, 4, 8), np.float32)
    with pytest.raises(ValueError, match=r"metadata.prefill_length=4 is outside 0..3"):
        paged_attention(q, k, k, md)


def _random_pages(rng):
    return (rng.standard_normal((2, 12, 4, 8)).astype(np.float32) for _ in range(2))


@pytest.mark.parametrize("form", ["decode", "prefill"])
def test_easydel_forms_attend_and_write_like_their_mixed_form(form):
    rng = np.random.default_rng(5)
    k, v = _random_pages(rng)
    table = rng.permutation(12)[:8].reshape(2, 4).astype(np.int32)
    if form == "decode":
        md = PagedAttentionMetadata.for_decode(table, [13, 6], cache_metadata=META)
    else:
        md = PagedAttentionMetadata.for_prefill(table[0], 7, start=3, padded_length=9, cache_metadata=META)
    mixed = as_mixed(md, page_size=4, num_pages=12).step_meta
    q = rng.standard_normal((md.num_tokens, 4, 8)).astype(np.float32)
    got, via_mixed = paged_attention(q, k, v, md), paged_attention(q, k, v, mixed)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(via_mixed))
    np.testing.assert_allclose(np.asarray(got), np.asarray(paged_attention_reference(q, k, v, md)), atol=2e-6)
    np.testing.assert_array_equal(np.asarray(token_slots(md, META)), np.asarray(token_slots(mixed, META)))


def _counting(monkeypatch):
    """Count the value checks attention and the write run."""
    calls = {"attention": 0, "write": 0}
    real_read, real_slots = runtime_checks.bad_read, writes.check_slots

    def read(*args, **kwargs):
        calls["attention"] += 1
        return real_read(*args, **kwargs)

    def slots(*args, **kwargs):
        calls["write"] += 1
        return real_slots(*args, **kwargs)

    monkeypatch.setattr(runtime_checks, "bad_read", read)
    monkeypatch.setattr(writes, "check_slots", slots)
    return calls


def _checks_run(calls, step_meta, meta=META):
    q = np.zeros((step_meta.num_tokens, 4, 8), np.float32)
    k = np.zeros((2, meta.num_pages_per_layer, 4, 8), np.float32)
    before = dict(calls)
    attention_checks.prepare(q, k, k, step_meta, attention_checks.AttentionOptions())
    token_slots(step_meta, meta)
    return {name: calls[name] - before[name] for name in calls}


def test_validated_metadata_is_checked_once(monkeypatch):
    calls = _counting(monkeypatch)
    table = np.array([[3, 7, -1, -1], [0, 1, 2, -1]], np.int32)
    built = {
        "for_mixed": PagedAttentionMetadata.for_mixed(table, [5, 9], [1, 2], cache_metadata=META),
        "for_decode": PagedAttentionMetadata.for_decode(table, [5, 10], cache_metadata=META),
        "for_prefill": PagedAttentionMetadata.for_prefill(table[1], 3, start=8, cache_metadata=META),
    }
    for name, step_meta in built.items():
        assert host_checked(step_meta) is not None, name
        assert _checks_run(calls, step_meta) == {"attention": 0, "write": 0}, name
        # Equal arrays built by hand, a replace, a JSON round trip: checked again.
        for copy in (step_meta.replace(), type(step_meta).from_json(step_meta.to_json()),
                     dataclasses.replace(step_meta, **{f.name: np.array(getattr(step_meta, f.name))
                                                for f in dataclasses.fields(step_meta)})):
            assert host_checked(copy) is None
            assert _checks_run(calls, copy) == {"attention": 1, "write": 1}, name
        # Against another pool the mark proves nothing.
        assert _checks_run(calls, step_meta, OTHER_POOL) == {"attention": 1, "write": 1}, name


def test_marked_arrays_are_read_only_and_a_writable_one_drops_the_mark(monkeypatch):
    calls = _counting(monkeypatch)
    step_meta = PagedAttentionMetadata.for_mixed([[3, 7, -1, -1]], [5], [1], cache_metadata=META)
    with pytest.raises(ValueError, match="read-only"):
        step_meta.page_table[0, 1] = 11
    step_meta.page_table.flags.writeable = True  # deliberately: the mark no longer holds
    step_meta.page_table[0, 1] = 12
    assert host_checked(step_meta) is None
    with pytest.raises(ValueError, match=r"metadata.page_table\[0, 1\] = 12 is not a page of the pool \(0..11\)"):
        _checks_run(calls, step_meta)


def test_manager_metadata_is_marked(monkeypatch):
    calls = _counting(monkeypatch)
    pm = PageManager(META)
    a, b = pm.claim(2)
    plan = pm.schedule([a, b], [6, 3])
    (step_meta,) = plan.metadata
    assert _checks_run(calls, step_meta) == {"attention": 0, "write": 0}
    pm.commit(plan, [list(range(6)), list(range(3))])
    steps = []  # three decode steps, each scheduled by the manager (a loop's later steps are derived on the device)
    for token in range(3):
        plan = pm.schedule_decode([a, b], 1)
        steps.append(plan.metadata[0])
        pm.commit(plan, [[token], [token]])
    assert all(host_checked(s) is not None for s in steps)
    assert _checks_run(calls, steps[2]) == {"attention": 0, "write": 0}


def test_a_page_released_before_the_window_is_not_read_safe():
    # Sequence 0 has 9 tokens cached and appends one (position 9, page column 2); its first page
    # was released (a window of 4 no longer reads it).
    step_meta = PagedAttentionMetadata.for_mixed([[-1, 7, 2, -1]], [9], [1], cache_metadata=META)
    mark = host_checked(step_meta)
    assert mark is not None and not mark.reads
    rng = np.random.default_rng(0)
    k, v = _random_pages(rng)
    q = rng.standard_normal((1, 4, 8)).astype(np.float32)
    windowed = paged_attention(q, k, v, step_meta, sliding_window=4)
    np.testing.assert_allclose(np.asarray(windowed),
                               np.asarray(paged_attention_reference(q, k, v, step_meta, sliding_window=4)), atol=2e-6)
    with pytest.raises(ValueError, match=r"metadata.page_table\[0, 0\] = -1 is no page"):
        paged_attention(q, k, v, step_meta)
    # The new token's own page must still be assigned.
    with pytest.raises(ValueError, match=r"position 9 of row 0 falls on logical page 2, which is unassigned"):
        PagedAttentionMetadata.for_mixed([[-1, 7, -1, -1]], [9], [1], cache_metadata=META)


def test_check_values_is_the_opt_in_check_of_device_arrays():
    table = np.array([[3, 7, -1, -1], [0, 1, 2, -1]], np.int32)
    good = PagedAttentionMetadata.for_mixed(table, [5, 9], [1, 2], cache_metadata=META)
    on_device = jax.tree.map(jnp.asarray, good)  # as a jitted step receives it: values unknown to the host
    on_device.check_values(META)  # device arrays carry no mark: every value is checked, and all are valid
    bad = on_device.replace(page_table=on_device.page_table.at[1, 0].set(12))
    with pytest.raises(ValueError, match=r"metadata.page_table\[1, 0\] = 12 is not a page of the pool \(0..11\) "
                                         r"but row 1 reads it \(keys up to position 10\)"):
        bad.check_values(META)
    twice = on_device.replace(slot_mapping=on_device.slot_mapping.at[1].set(on_device.slot_mapping[0]))
    with pytest.raises(ValueError, match=r"two tokens of this write step write the same slot 29"):
        twice.check_values(META)
    decode = PagedAttentionMetadata(decodes_position=jnp.array([9], jnp.int32),
                                    decodes_page_table=jnp.array([[-1, 4, 5, -1]], jnp.int32))
    decode.check_values(META, sliding_window=4)  # the released first page is outside the window
    with pytest.raises(ValueError, match=r"metadata.decodes_page_table\[0, 0\] = -1 is no page"):
        decode.check_values(META)
    with pytest.raises(ValueError, match=r"token 0 would be written to slot -2, outside the pool's 48 slots"):
        PagedAttentionMetadata(slot_mapping=jnp.array([-2], jnp.int32)).check_values(META)


def test_check_values_refuses_traced_steps():
    step_meta = PagedAttentionMetadata.for_mixed([[3, 7, -1, -1]], [5], [1], cache_metadata=META)

    def traced(m):
        m.check_values(META)
        return m.slot_mapping

    with pytest.raises(ValueError, match=r"check_values reads the step's values: call it outside jit"):
        jax.jit(traced)(jax.tree.map(jnp.asarray, step_meta))


def test_a_row_across_data_parallel_slices_is_not_read_safe():
    """On a pool split over 2 replicas (pages 0..5 and 6..11), for_mixed proves the reads of a
    row inside one slice; a row reaching into both slices is not marked read-safe, and the
    checks of its reads (attention's, or check_values) refuse it."""
    split = dataclasses.replace(META, page_mesh_axes=("dp",), page_shards=2)
    inside = PagedAttentionMetadata.for_mixed([[1, 4, -1, -1], [7, 6, -1, -1]], [5, 5], [1, 1], cache_metadata=split)
    assert host_checked(inside).reads and host_checked(inside).page_shards == 2
    inside.check_values(split)
    across = PagedAttentionMetadata.for_mixed([[1, 8, -1, -1]], [5], [1], cache_metadata=split)
    assert not host_checked(across).reads  # the write may still use it: its slots were checked
    with pytest.raises(ValueError, match=r"row 0 of metadata.page_table uses pages of two data-parallel replicas "
                                         r"\(page 1 in slice 0, page 8 in slice 1; 6 pages per slice\)"):
        across.check_values(split)


def test_the_old_module_name_still_imports_with_a_deprecation_warning():
    """`easykv.runtime` (before 0.2) gives the moved objects and warns once with the new name."""
    from tests.support.deprecation import warnings_on_import

    seen = warnings_on_import("from easykv.runtime import PagedAttentionMetadata, as_mixed", """
import easykv.step.metadata as moved
assert PagedAttentionMetadata is moved.PagedAttentionMetadata and as_mixed is moved.as_mixed""")
    assert [message for category, message, _ in seen if category == "DeprecationWarning"] == [
        "easykv.runtime moved to easykv.step.metadata and will be removed in easykv 0.3; import from "
        "easykv.step.metadata instead"]
