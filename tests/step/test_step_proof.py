"""The proof that a step was checked is a declared part of its metadata, and what it says of the
pages a step reads is checked anyway.

* ``PagedAttentionMetadata(..., proof=...)`` declares the proof, ``checked`` reads it back; it is no
  dataclass field and no pytree leaf, so a ``replace``, a JSON round trip, ``jax.tree.map`` or a
  trip through jit gives a metadata without it;
* the caller's arrays are never frozen or changed: the metadata holds read-only arrays of its own;
* a proof whose table has a hole inside a window (its issuer released a page one step early) makes
  attention raise, naming the sequence and the column, instead of attending over the hole;
* a marked step entering attention is checked in one pass: each rule once per call, the pages it
  reads once per step (not once more per layer);
* the fast scan of the pages read agrees with the precise rule (`bad_read`) on random tables.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from easykv import LayerGroup, PagedAttentionCacheMetaData, PagedAttentionMetadata, PageManager
from easykv.attention.api import paged_attention, paged_attention_reference
from easykv.spec.groups import AttentionKind
from easykv.step import checks as runtime_checks
from easykv.step import metadata as runtime_metadata
from easykv.step.checks import HostChecked, host_checked, mark_checked
from easykv.step.metadata import increment_cache_lengths, stack_metadata

META = PagedAttentionCacheMetaData(
    batch_size=4, num_hidden_layers=1, num_pages_per_layer=12, num_pages_per_sequence=4,
    max_sequences=16, page_size=4, num_kv_heads=2, kv_head_dim_size=8, hbm_utilization=0.9,
)  # fmt: skip
FIELDS = ["prefill_length", "prefill_position", "prefill_page_table", "decodes_position", "decodes_page_table",
          "slot_mapping", "positions", "query_start_loc", "page_table", "context_lens", "num_seqs"]


def _arrays(step_meta):
    return [getattr(step_meta, name) for name in FIELDS]


def _pages(num_pages, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, num_pages, 4, 8)).astype(np.float32) for _ in range(2))


def test_a_constructor_leaves_the_callers_arrays_as_they_were():
    table = np.array([[3, 7, -1, -1], [0, 1, 2, -1]], np.int32)
    cached, new, positions = np.array([5, 9], np.int32), np.array([1, 2], np.int32), np.array([5, 10], np.int32)
    given_arrays = (table, cached, new, positions)
    before = [a.copy() for a in given_arrays]
    built = [PagedAttentionMetadata.for_mixed(table, cached, new, cache_metadata=META),
             PagedAttentionMetadata.for_decode(table, positions, cache_metadata=META),
             PagedAttentionMetadata.for_prefill(table[1], 3, start=8, cache_metadata=META)]
    for step_meta in built:
        assert host_checked(step_meta) is step_meta.checked is not None
        for array in _arrays(step_meta):  # the step's own arrays, read-only, sharing no memory with the caller's
            assert not array.flags.writeable
            assert not any(np.shares_memory(array, mine) for mine in given_arrays)
    for mine, was in zip(given_arrays, before):
        assert mine.flags.writeable
        np.testing.assert_array_equal(mine, was)
    table[0, 0] = 11  # still the caller's to change, and the steps do not see it
    assert built[0].page_table[0, 0] == built[1].decodes_page_table[0, 0] == 3


def test_marking_copies_a_writable_array_and_never_freezes_it():
    mine = np.array([5, -1], np.int32)
    step = PagedAttentionMetadata(slot_mapping=mine)
    mark = HostChecked(num_pages=12, page_size=4, reads=False, page_shards=1)
    marked = mark_checked(step, mark)
    assert step.checked is None and host_checked(step) is None  # the step passed in is as it was
    assert mine.flags.writeable and step.slot_mapping is mine
    assert host_checked(marked) is marked.checked == mark
    assert not marked.slot_mapping.flags.writeable and not np.shares_memory(marked.slot_mapping, mine)
    frozen = marked.slot_mapping
    assert mark_checked(marked, mark).slot_mapping is frozen  # already the step's own: no copy
    fields = {f.name: getattr(marked, f.name) for f in dataclasses.fields(marked)}
    carried = PagedAttentionMetadata(**fields, proof=marked.checked)  # the very same arrays: it carries
    assert carried.checked is marked.checked and carried.slot_mapping is frozen
    refused = r"proof= carries the proof of another step's arrays \(or of none\): a proof is issued by"
    with pytest.raises(ValueError, match=refused):  # written by hand: issued for no arrays
        PagedAttentionMetadata(slot_mapping=mine, proof=mark)
    with pytest.raises(ValueError, match=refused):  # equal values, but other arrays
        PagedAttentionMetadata(**{**fields, "slot_mapping": frozen.copy()}, proof=marked.checked)
    with pytest.raises(ValueError, match=r"proof must be a HostChecked \(what a validated constructor proved\), got "
                                         r"str"):
        PagedAttentionMetadata(slot_mapping=mine, proof="checked")


def test_the_proof_is_no_field_and_no_leaf_so_every_rebuild_drops_it():
    step_meta = PagedAttentionMetadata.for_mixed([[3, 7, -1, -1], [0, 1, 2, -1]], [5, 9], [1, 1], cache_metadata=META)
    assert step_meta.checked is not None
    assert [f.name for f in dataclasses.fields(step_meta)] == FIELDS
    assert len(jax.tree.leaves(step_meta)) == len(jax.tree.leaves(step_meta.replace())) == len(FIELDS)
    assert "proof" not in step_meta.to_dict() and "checked" not in step_meta.to_dict()
    rebuilt = {
        "replace": step_meta.replace(),
        "replace, same arrays": step_meta.replace(positions=step_meta.positions, page_table=step_meta.page_table),
        "dataclasses.replace": dataclasses.replace(step_meta),
        "JSON": type(step_meta).from_json(step_meta.to_json()),
        "tree.map": jax.tree.map(lambda a: a, step_meta),
        "jit": jax.jit(lambda m: m)(step_meta),
        "increment_cache_lengths": increment_cache_lengths(step_meta, page_size=4, num_pages=12),
        "stack_metadata": stack_metadata([step_meta, step_meta]),
    }
    for how, copy in rebuilt.items():
        assert copy.checked is None and host_checked(copy) is None, how
    assert step_meta == step_meta.replace()  # the proof takes no part in equality


def test_a_proof_names_its_attention_kind():
    sliding = HostChecked(num_pages=12, page_size=4, reads=True, page_shards=1, attention="sliding", window=8)
    assert sliding.attention is AttentionKind.SLIDING and sliding.covers(8, None) and not sliding.covers(None, None)
    chunked = HostChecked(12, 4, True, 1, AttentionKind.CHUNKED, 8)
    assert chunked.covers(None, 4) and not chunked.covers(None, 3)
    assert HostChecked(12, 4, True, 1).attention is AttentionKind.FULL
    with pytest.raises(ValueError, match="'local' is not a valid AttentionKind"):
        HostChecked(12, 4, True, 1, "local", 8)


def _sliding_manager_step():
    """A sliding group's decode step from the page manager: 9 tokens cached (positions 0..8),
    the query at 9 reads the window 5..9, pages in columns 1 and 2 (column 0 released)."""
    groups = (LayerGroup((0,), "full", num_pages=10), LayerGroup((1,), "sliding", 5, num_pages=6))
    meta = PagedAttentionCacheMetaData(
        batch_size=3, num_hidden_layers=2, num_pages_per_layer=10, num_pages_per_sequence=8, max_sequences=32,
        page_size=4, num_kv_heads=2, kv_head_dim_size=8, hbm_utilization=0.9, layer_groups=groups)
    m = PageManager(meta)
    s = m.claim(1)[0]
    m.commit(m.schedule([s], [9]), [list(range(1, 10))])
    plan = m.schedule_decode([s], 1)
    m.abort(plan)  # only its metadata is read: the step it describes is never run
    return plan.metadata[1]


def test_a_hole_inside_the_window_of_a_marked_step_is_refused_not_read():
    step_meta = _sliding_manager_step()
    assert step_meta.checked.reads and step_meta.checked.attention is AttentionKind.SLIDING
    assert step_meta.page_table[0, 0] == -1 and (step_meta.page_table[0, 1:3] >= 0).all()
    k, v = _pages(6)
    q = np.random.default_rng(1).standard_normal((step_meta.num_tokens, 4, 8)).astype(np.float32)
    good = paged_attention(q, k, v, step_meta, sliding_window=5)
    np.testing.assert_allclose(np.asarray(good), np.asarray(paged_attention_reference(q, k, v, step_meta,
                                                                                      sliding_window=5)),
                               atol=2e-6)
    # Its issuer released the window's first page one step early and issued the proof anyway.
    early = step_meta.page_table.copy()
    early[0, 1] = -1
    with pytest.raises(ValueError, match=r"proof= carries the proof of another step's arrays"):
        dataclasses.replace(step_meta, page_table=early,
                            proof=step_meta.checked)  # nobody else can move a proof onto it
    bad = mark_checked(dataclasses.replace(step_meta, page_table=early), step_meta.checked)
    assert host_checked(bad) == step_meta.checked
    with pytest.raises(ValueError, match=r"metadata.page_table\[0, 1\] = -1 is not a page of the pool \(0..5\) but "
                                         r"sequence 0 of the step reads it \(keys 4.. up to position 9\), and the step "
                                         r"is marked as checked"):
        paged_attention(q, k, v, bad, sliding_window=5)


@pytest.mark.parametrize("form", ["mixed", "decode"])
def test_a_hole_anywhere_a_marked_step_reads_is_refused(form):
    table = np.array([[3, 7, 5, -1], [0, 1, 2, 4]], np.int32)
    if form == "mixed":
        step_meta = PagedAttentionMetadata.for_mixed(table, [9, 13], [1, 2], cache_metadata=META)
        name, holed = "page_table", dict(page_table=np.where(np.arange(4) == 1, -1, step_meta.page_table))
    else:
        step_meta = PagedAttentionMetadata.for_decode(table, [9, 14], cache_metadata=META)
        name, holed = "decodes_page_table", dict(decodes_page_table=np.where(np.arange(4) == 1, -1, table))
    k, v = _pages(12)
    q = np.zeros((step_meta.num_tokens, 4, 8), np.float32)
    paged_attention(q, k, v, step_meta)
    bad = mark_checked(dataclasses.replace(step_meta, **holed), step_meta.checked)  # an issuer in error
    with pytest.raises(ValueError, match=rf"metadata.{name}\[0, 1\] = -1 is not a page of the pool .* but sequence 0 "
                                         r"of the step reads it"):
        paged_attention(q, k, v, bad)
    far = mark_checked(dataclasses.replace(step_meta, **{name: np.where(np.arange(4) == 0, 12, getattr(step_meta,
                                                                                                       name))}),
                       step_meta.checked)
    with pytest.raises(ValueError, match=rf"metadata.{name}\[0, 0\] = 12 is not a page of the pool \(0..11\)"):
        paged_attention(q, k, v, far)


def _count(monkeypatch, *where):
    calls = {name: 0 for _, name in where}
    for module, name in where:
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def test_a_marked_step_entering_attention_is_checked_in_one_pass(monkeypatch):
    step_meta = PagedAttentionMetadata.for_decode([[3, 7, -1, -1], [0, 1, 2, -1]], [5, 10], cache_metadata=META)
    k, v = _pages(12)
    q = np.zeros((2, 4, 8), np.float32)
    calls = _count(monkeypatch, (runtime_metadata, "step_form"), (runtime_checks, "host_checked"),
                   (runtime_checks, "int_field"), (runtime_checks, "check_vouched_reads"),
                   (runtime_checks, "bad_read"))
    paged_attention(q, k, v, step_meta)
    # the form and the proof once; the two fields of EasyDeL's decode form once each (the mixed
    # form built from them is not checked again); the pages read once, and found readable
    assert calls == {"step_form": 1, "host_checked": 1, "int_field": 2, "check_vouched_reads": 1, "bad_read": 0}
    paged_attention(q, k, v, step_meta)  # the next layer: converted once per step, its pages read checked once
    assert calls == {"step_form": 1, "host_checked": 2, "int_field": 2, "check_vouched_reads": 1, "bad_read": 0}
    paged_attention(q, k, v, step_meta, sliding_window=3)  # another read of the same step: its pages are checked
    assert calls["check_vouched_reads"] == 2


@st.composite
def _tables(draw):
    rows, width, pool = draw(st.integers(1, 5)), draw(st.integers(1, 6)), draw(st.integers(1, 9))
    table = np.array(draw(st.lists(st.lists(st.integers(-3, pool + 1), min_size=width, max_size=width),
                                   min_size=rows, max_size=rows)), draw(st.sampled_from([np.int32, np.int64])))
    first = np.array(draw(st.lists(st.integers(0, width + 1), min_size=rows, max_size=rows)))
    end = np.array(draw(st.lists(st.integers(-1, width + 1), min_size=rows, max_size=rows)))
    return table, first, end, pool


@given(_tables())
def test_the_scan_of_the_pages_read_agrees_with_the_rule(case):
    table, first, end, pool = case
    precise = runtime_checks.bad_read("page_table", table, first, end, end * 4 - 1, num_pages=pool, page_size=4,
                                      page_shards=1)
    assert runtime_checks.any_unreadable(table, first, end, pool) == bool(precise)


@given(st.data())
def test_read_spans_are_each_sequences_reads(data):
    """Against a plain loop: a sequence reads from its earliest query's first visible key to its
    last query (none: nothing), whatever its tokens' order."""
    seqs = data.draw(st.integers(1, 4))
    counts = data.draw(st.lists(st.integers(0, 3), min_size=seqs, max_size=seqs))
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    pad = data.draw(st.integers(0, 2))
    pos = np.array(data.draw(st.lists(st.integers(-1, 30), min_size=int(qsl[-1]) + pad,
                                      max_size=int(qsl[-1]) + pad)), np.int32)
    num_seqs = data.draw(st.integers(0, seqs))
    window, chunk = data.draw(st.none() | st.integers(1, 9)), data.draw(st.none() | st.integers(1, 9))
    first, end, last = runtime_checks.read_spans(pos, qsl, num_seqs, page_size=4, window=window, chunk=chunk)
    for b in range(seqs):
        mine = pos[qsl[b]:qsl[b + 1]] if b < num_seqs else pos[:0]
        seen = mine[mine >= 0]
        assert last[b] == max(mine.max(initial=-1), -1)
        if not seen.size:
            assert end[b] <= first[b]  # reads nothing
            continue
        starts = np.zeros_like(seen)
        if window is not None:
            starts = np.maximum(starts, seen - window + 1)
        if chunk is not None:
            starts = np.maximum(starts, seen - seen % chunk)
        assert (first[b], end[b]) == (starts.min() // 4, seen.max() // 4 + 1)
