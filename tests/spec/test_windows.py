"""The window rule of each attention kind (easykv.spec.windows), alone: the first position a query
reads against its definition, on ints, numpy and jax arrays alike (the host and the device ask
the same expression), the columns a length releases, the pages a sequence keeps, which reads a
kept table serves, and the bad windows refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from easykv.spec.groups import AttentionKind, LayerGroup
from easykv.spec.windows import ChunkedRule, FullAttentionRule, SlidingWindowRule, first_seen, read_rules

POSITIONS = np.arange(41)


def seen_by_definition(p, window=None, chunk=None):
    """The first key a query at ``p`` sees, by scanning the keys: ``(p - window, p]`` and
    ``[p - p % chunk, p]``, whichever apply."""
    return min(j for j in range(p + 1)
               if (window is None or j > p - window) and (chunk is None or j // chunk == p // chunk))


RULES = [FullAttentionRule(), SlidingWindowRule(1), SlidingWindowRule(6), SlidingWindowRule(16), ChunkedRule(4),
         ChunkedRule(8)]


def definition(rule):
    window = rule.size if isinstance(rule, SlidingWindowRule) else None
    chunk = rule.size if isinstance(rule, ChunkedRule) else None
    return [seen_by_definition(p, window, chunk) for p in POSITIONS.tolist()]


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_the_first_needed_position_follows_the_definition_on_ints_and_numpy_arrays(rule):
    want = definition(rule)
    assert [rule.first_needed_position(p) for p in POSITIONS.tolist()] == want
    assert all(type(rule.first_needed_position(p)) is int for p in (0, 9))
    for dtype in (np.int32, np.int64):
        got = rule.first_needed_position(POSITIONS.astype(dtype))
        assert got.dtype == dtype and got.tolist() == want


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_the_device_reads_the_same_rule_through_jax_numpy(rule):
    positions = jnp.asarray(POSITIONS, jnp.int32)
    eager = first_seen(positions, (rule,), jnp)
    traced = jax.jit(lambda p: first_seen(p, (rule,), jnp))(positions)
    assert eager.dtype == jnp.int32 and np.asarray(eager).tolist() == np.asarray(traced).tolist() == definition(rule)


@pytest.mark.parametrize("window, chunk", [(None, None), (5, None), (None, 8), (5, 8), (12, 8), (3, 4)])
def test_a_read_with_a_window_and_chunks_sees_what_both_allow(window, chunk):
    rules = read_rules(window, chunk)
    assert rules == (() if window is None else (SlidingWindowRule(window),)) + (
        () if chunk is None else (ChunkedRule(chunk),))
    want = [seen_by_definition(p, window, chunk) for p in POSITIONS.tolist()]
    assert first_seen(POSITIONS, rules, np).tolist() == want
    assert np.asarray(first_seen(jnp.asarray(POSITIONS, jnp.int32), rules, jnp)).tolist() == want


def test_released_columns_are_the_columns_wholly_before_the_next_query():
    lens = np.array([0, 4, 5, 9, 13, 16, 21])
    assert SlidingWindowRule(6).released_columns(lens, 4).tolist() == [0, 0, 0, 1, 2, 2, 4]
    assert ChunkedRule(8).released_columns(lens, 4).tolist() == [0, 0, 0, 2, 2, 4, 4]
    assert FullAttentionRule().released_columns(lens, 4).tolist() == [0] * 7
    assert SlidingWindowRule(6).released_columns(lens, 4).dtype == np.int32


def test_the_first_kept_position_is_the_windows_start_or_the_floor():
    sliding, chunked = SlidingWindowRule(6), ChunkedRule(8)
    assert sliding.first_kept_position(14, 0) == 9 and sliding.first_kept_position(14, 12) == 12
    assert chunked.first_kept_position(23, 0) == 16 and chunked.first_kept_position(23, 20) == 20
    assert FullAttentionRule().first_kept_position(1000, 0) == 0


@pytest.mark.parametrize("rule, kept", [(FullAttentionRule(), [1, 3, 10]), (SlidingWindowRule(1), [1, 1, 1]),
                                        (SlidingWindowRule(5), [1, 2, 2]), (SlidingWindowRule(6), [1, 3, 3]),
                                        (ChunkedRule(8), [1, 2, 2]), (ChunkedRule(16), [1, 3, 4])])
def test_pages_kept_is_the_most_pages_one_window_spans(rule, kept):
    assert [rule.pages_kept(n, 4) for n in (1, 3, 10)] == kept


def test_a_table_kept_for_a_window_serves_reads_that_start_no_earlier():
    sliding, chunked, full = SlidingWindowRule(8), ChunkedRule(8), FullAttentionRule()
    reads = [(8, None), (4, None), (9, None), (None, None), (None, 8), (8, 4)]
    assert [sliding.covers(w, c) for w, c in reads] == [True, True, False, False, False, True]
    reads = [(None, 8), (None, 4), (None, 3), (None, 16), (None, None), (8, None)]
    assert [chunked.covers(w, c) for w, c in reads] == [True, True, False, False, False, False]
    assert all(full.covers(w, c) for w, c in [(None, None), (3, None), (None, 5)])


def test_each_kind_maps_to_its_rule_once():
    assert AttentionKind.FULL.rule(None) == FullAttentionRule()
    assert AttentionKind.SLIDING.rule(6) == SlidingWindowRule(6) and AttentionKind.CHUNKED.rule(8) == ChunkedRule(8)
    assert LayerGroup((0,), "sliding", 6).rule == SlidingWindowRule(6) and LayerGroup((0,)).rule == FullAttentionRule()
    assert AttentionKind.SLIDING.rule(np.int64(6)) == SlidingWindowRule(6)


@pytest.mark.parametrize("make, words", [
    (lambda: AttentionKind.FULL.rule(8), r"full attention takes no window, got window=8; use attention='sliding'"),
    (lambda: AttentionKind.SLIDING.rule(None), "window must be a positive int, got None"),
    (lambda: AttentionKind.SLIDING.rule(0), "window must be a positive int, got 0"),
    (lambda: AttentionKind.SLIDING.rule(True), "window must be a positive int, got True"),
    (lambda: AttentionKind.CHUNKED.rule([8]), r"window \(the chunk size\) must be a positive int, got \[8\]"),
    (lambda: ChunkedRule(2.0), r"window \(the chunk size\) must be a positive int, got 2.0"),
    (lambda: read_rules(0, None), "window must be a positive int, got 0"),
    (lambda: read_rules(None, -4), r"window \(the chunk size\) must be a positive int, got -4"),
    (lambda: read_rules(True, None), "window must be a positive int, got True"),
])
def test_a_bad_window_is_refused_by_name(make, words):
    AttentionKind.SLIDING.rule(1), read_rules(1, None)  # cached: True must not be served as 1
    with pytest.raises(ValueError, match=words):
        make()
