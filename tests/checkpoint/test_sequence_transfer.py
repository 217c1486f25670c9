"""export_sequence / import_sequence: one sequence moves between caches of other meshes, page
sizes and formats (a prefill host handing a sequence to a decode host)."""

from __future__ import annotations

import copy
import dataclasses

import jax
import numpy as np
import pytest

from easykv.checkpoint.transfer import SequenceExport, export_sequence, import_sequence
from easykv.errors import CacheFullError, UnknownSequenceError
from easykv.manager.manager import PageManager
from easykv.runner import apply_pending
from easykv.storage.cache import gather_kv
from tests.support.checkpoints import engine_run, new_qcache, qsetup, raw_leaves
from tests.support.pools import LAYERS, bits

PROMPT_A = list(range(10)) + [40, 41]  # what engine_run committed for sequence 0 (a)


def read(cache, manager, seq):
    row, n = np.asarray(manager.page_table([seq])[0]), manager.length(seq)
    return [tuple(bits(x) for x in gather_kv(cache, layer, row, n)) for layer in range(LAYERS)]


def target(layout, quantizer="none", page_size=8):
    cache = new_qcache(layout, quantizer, page_size=page_size)
    return cache, PageManager(qsetup(layout, quantizer, page_size=page_size)[2])


def test_dense_export_imports_onto_other_mesh_and_page_size():
    cache, manager, _ = engine_run("heads")
    src = read(cache, manager, 0)
    exported = export_sequence(cache, manager, 0, token_ids=PROMPT_A[: manager.length(0)])
    assert not exported.raw and exported.keys.shape == (LAYERS, manager.length(0), 8, 8)
    assert np.array_equal(bits(exported.keys[1]), src[1][0])
    dst_cache, dst_mgr = target("dp", page_size=8)
    dst_cache, seq = import_sequence(dst_cache, dst_mgr, exported)
    assert dst_mgr.length(seq) == manager.length(0)
    got = read(dst_cache, dst_mgr, seq)
    assert all(np.array_equal(g[i], s[i]) for g, s in zip(got, src) for i in (0, 1))
    dst_mgr.check_invariants()
    # Same tokens again: the full pages are found in the prefix cache and shared, not written.
    dst_cache, seq2 = import_sequence(dst_cache, dst_mgr, exported)
    assert dst_mgr.metrics.prefix_hits == 1 and dst_mgr.pages(seq2)[0] == dst_mgr.pages(seq)[0]
    got2 = read(dst_cache, dst_mgr, seq2)
    assert all(np.array_equal(g[i], s[i]) for g, s in zip(got2, src) for i in (0, 1))


@pytest.mark.parametrize("quant", ["int8", "int4-ol"])
def test_raw_quantized_export_is_bit_exact_into_the_same_quantizer(quant):
    cache, manager, _ = engine_run("heads", quant)
    exported = export_sequence(cache, manager, 1, dequantize=False)  # b: no token ids
    assert exported.raw and exported.token_ids is None
    want = {"int8": (np.int8, np.float32, ()), "int4-ol": (np.uint8, np.uint8, (8,))}[quant]  # int4-ol: side bytes
    assert exported.keys["values"].dtype == want[0] and exported.keys["scales"].dtype == want[1]
    assert exported.keys["scales"].shape == (LAYERS, manager.length(1), 8, *want[2])
    assert SequenceExport.from_bytes(exported.to_bytes()).keys["scales"].dtype == want[1]
    dst_cache, dst_mgr = target("single", quant, page_size=8)
    dst_cache, seq = import_sequence(dst_cache, dst_mgr, exported, seq_id=2)
    assert seq == 2
    again = export_sequence(dst_cache, dst_mgr, 2, dequantize=False)
    for part in ("keys", "values"):
        for sub in ("values", "scales"):
            assert np.array_equal(bits(getattr(again, part)[sub]), bits(getattr(exported, part)[sub]))
    # The dense view of the raw export equals what the source cache reads.
    src = read(cache, manager, 1)
    dense_k, _ = exported.dense()
    assert np.array_equal(bits(dense_k[0]), src[0][0])


def test_quantized_export_into_bf16_cache_and_fp8_files():
    cache, manager, _ = engine_run("heads", "fp8")
    raw = SequenceExport.from_bytes(export_sequence(cache, manager, 0, dequantize=False).to_bytes())
    assert raw.keys["values"].dtype == np.dtype("float8_e4m3fn")
    dense = export_sequence(cache, manager, 0)
    loaded = SequenceExport.from_bytes(dense.to_bytes())
    assert np.array_equal(bits(loaded.keys), bits(dense.keys)) and loaded.dtype == dense.dtype
    dst_cache, dst_mgr = target("heads", "none", page_size=4)
    dst_cache, seq = import_sequence(dst_cache, dst_mgr, raw)  # dequantized, written as bf16
    got = read(dst_cache, dst_mgr, seq)
    assert all(np.array_equal(g[0], bits(dense.keys[layer])) for layer, g in enumerate(got))


def test_bad_imports_change_nothing():
    cache, manager, _ = engine_run("heads")
    exported = export_sequence(cache, manager, 0, token_ids=PROMPT_A[: manager.length(0)])
    dst_cache, dst_mgr = target("replicated", page_size=4)  # 4 kv heads, not 8
    state, before = dst_mgr.state_dict(), raw_leaves(dst_cache)
    with pytest.raises(ValueError, match="num_kv_heads"):
        import_sequence(dst_cache, dst_mgr, exported)
    assert dst_mgr.state_dict() == state
    dst_cache, dst_mgr = target("heads", page_size=4)
    dst_mgr.claim(4)  # every sequence slot taken
    state = dst_mgr.state_dict()
    with pytest.raises(CacheFullError):
        import_sequence(dst_cache, dst_mgr, exported)
    assert dst_mgr.state_dict() == state
    small = new_qcache("heads", pages=8)
    small_mgr = PageManager(qsetup("heads", pages=8)[2])
    small_mgr.schedule(small_mgr.claim(2), [16, 16])  # all 8 pages in use, 2 slots free
    state, before = small_mgr.state_dict(), raw_leaves(small)
    with pytest.raises(CacheFullError, match="needs 3 new pages"):
        import_sequence(small, small_mgr, exported)
    assert small_mgr.state_dict() == state and all(np.array_equal(a, b) for a, b in zip(before, raw_leaves(small)))
    with pytest.raises(UnknownSequenceError):
        export_sequence(cache, manager, 3)  # released
    with pytest.raises(ValueError, match="token_ids"):
        export_sequence(cache, manager, 0, token_ids=[1, 2])
    with pytest.raises(ValueError, match="SequenceExport"):
        import_sequence(dst_cache, dst_mgr, {"keys": 1})
    with pytest.raises(ValueError, match="not a readable"):
        SequenceExport.from_bytes(b"not an npz")


def test_export_waits_for_pending_copy_on_write():
    """A fork truncated inside the shared, partly filled page it will write again gets a private
    copy of it; until the copy is applied the cache does not hold its tokens there, so export
    refuses."""
    cache, manager, _ = engine_run("heads")
    child = manager.fork(0)
    length = manager.length(child) - 1
    manager.truncate(child, length)  # copy-on-write of the partly filled last page, pending
    state, before = manager.state_dict(), raw_leaves(cache)
    with pytest.raises(ValueError, match="pending copy-on-write"):
        export_sequence(cache, manager, child)
    assert manager.state_dict() == state and all(np.array_equal(a, b) for a, b in zip(before, raw_leaves(cache)))
    cache, copied = apply_pending(manager, cache)
    assert copied == 1
    parent, forked = export_sequence(cache, manager, 0), export_sequence(cache, manager, child)
    assert forked.length == length and length % 4  # the copied page holds the fork's last tokens
    assert np.array_equal(bits(forked.keys), bits(parent.keys)[:, :length])
    assert np.array_equal(bits(forked.values), bits(parent.values)[:, :length])


def test_salted_imports_stay_in_their_namespace():
    cache, manager, _ = engine_run("heads")
    n = manager.length(0)
    exported = export_sequence(cache, manager, 0, token_ids=PROMPT_A[:n])
    dst_cache, dst_mgr = target("heads", page_size=4)
    dst_cache, _ = import_sequence(dst_cache, dst_mgr, exported, salt="tenant", reuse_prefix=False)
    assert dst_mgr.cached_prefix_length(PROMPT_A[:n]) == 0  # not keyed under "no salt"
    dst_cache, _ = import_sequence(dst_cache, dst_mgr, exported, salt="tenant")
    assert dst_mgr.cached_prefix_length(PROMPT_A[:n], salt="tenant") == 8
    assert dst_mgr.cached_prefix_length(PROMPT_A[:n]) == 0 and dst_mgr.cached_prefix_length(PROMPT_A[:n], salt="x") == 0
    dst_mgr.check_invariants()


def test_a_malformed_export_leaves_the_cache_usable():
    """The attack that started it: token ids shorter than the sequence (or any broken field)
    used to be found after claim, reserve and the cache's donation."""
    cache, manager, _ = engine_run("heads")
    n = manager.length(0)
    exported = export_sequence(cache, manager, 0, token_ids=PROMPT_A[:n])
    with pytest.raises(ValueError, match="token_ids"):
        dataclasses.replace(exported, token_ids=PROMPT_A[: n - 1])
    short = copy.copy(exported)
    object.__setattr__(short, "token_ids", np.asarray(PROMPT_A[: n - 1]))  # past the constructor
    dst_cache, dst_mgr = target("dp", page_size=8)
    state, before = dst_mgr.state_dict(), raw_leaves(dst_cache)
    with pytest.raises(ValueError, match="token_ids holds 10 ids"):
        import_sequence(dst_cache, dst_mgr, short)
    assert dst_mgr.state_dict() == state and all(np.array_equal(a, b) for a, b in zip(before, raw_leaves(dst_cache)))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(dst_cache))
    dst_cache, seq = import_sequence(dst_cache, dst_mgr, exported)  # the same cache, still usable
    assert dst_mgr.length(seq) == n and SequenceExport.from_bytes(exported.to_bytes()) == exported
