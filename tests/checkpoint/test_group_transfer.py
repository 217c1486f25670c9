"""export_sequence / import_sequence for caches of several layer groups: each group exports its
own geometry and only what its window still holds (format version 3), imports onto another mesh
bit for bit, raw quantized pages stay bit-exact, prefix pages are shared when the whole history
is known, and an export that does not fit the target is refused by name with nothing changed."""

from __future__ import annotations

import dataclasses
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from easykv import PagedAttentionCache, PagedAttentionCacheMetaData, PageManager
from easykv.checkpoint.grouped_export import GroupedSequenceExport
from easykv.checkpoint.transfer import SequenceExport, export_sequence, import_sequence
from easykv.sharding import ShardingAdjustedWarning
from tests.support.groups import GROUPS, LAYERS, PS, filled, mesh_and_rule, read, same, with_header

PROMPT = list(range(11))  # what filled() committed for sequence 0 before its three decode tokens


def empty_cache(layout, groups=GROUPS, quantizer=None, dtype="float32", batch=4):
    mesh, rule = mesh_and_rule(layout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        meta = PagedAttentionCacheMetaData.create(mesh, batch, LAYERS, 32, PS, 8, 16, 0.9, dtype,
                                                  partition_manager=rule, layer_groups=groups, quantizer=quantizer)
        cache = PagedAttentionCache.init_cache(mesh, jnp.dtype(dtype), meta, rule, quantizer=quantizer)
    return cache, PageManager(cache.metadata)


def test_a_grouped_sequence_moves_onto_another_mesh_and_shares_its_prefix_there():
    cache, m = filled("tp8")
    length = m.length(0)
    tokens = PROMPT + [0, 1, 2]
    exported = export_sequence(cache, m, 0, token_ids=tokens)
    assert isinstance(exported, GroupedSequenceExport) and exported.length == length == 14
    # the sliding group (window 6) exports only what its window still reads; the others everything
    assert [g.first_position for g in exported.groups] == [9, 0, 0]
    assert exported.groups[0].keys.shape == (2, 5, 4, 8) and exported.groups[1].values.shape == (2, 14, 8, 8)
    assert exported.groups[2].values is None and exported.groups[2].keys.shape == (1, 14, 1, 12)
    back = SequenceExport.load(__import__("io").BytesIO(exported.to_bytes()))
    assert isinstance(back, GroupedSequenceExport) and back == exported
    src = read(cache, m, 0)
    dst, dm = empty_cache("dp2tp4")
    dst, seq = import_sequence(dst, dm, back)
    assert dm.length(seq) == length and dm.sequence(seq).first_kept == (9, 0, 0)
    same(read(dst, dm, seq), src)
    dm.check_invariants()
    # The sliding group's export lacks positions 0..8: that sequence is not entered in the prefix
    # cache (its early sliding pages were written as zeros), so a second import shares nothing.
    assert dm.metrics.cached_pages == 0
    dst, seq2 = import_sequence(dst, dm, back)
    assert dm.metrics.prefix_hits == 0
    same(read(dst, dm, seq2), src)


def test_a_whole_grouped_history_is_matched_and_shared():
    """A sequence whose every group holds all its tokens (here: exported before the sliding
    window moved) enters the target's prefix cache; importing it again shares its pages."""
    cache, m = empty_cache("tp8")
    [s] = m.claim(1)
    plan = m.schedule([s], [5])
    groups = [cache.metadata.groups[cache.metadata.group_of(i)[0]] for i in range(LAYERS)]
    rng = np.random.default_rng(3)
    ks = [rng.standard_normal((5, g.num_kv_heads, g.key_head_dim)).astype(np.float32) for g in groups]
    vs = [None if g.latent else rng.standard_normal((5, g.num_kv_heads, g.value_head_dim)).astype(np.float32)
          for g in groups]
    cache, _ = cache.write(ks, vs, plan.metadata)
    m.commit(plan, [[5, 6, 7, 8, 9]])
    exported = export_sequence(cache, m, s, token_ids=[5, 6, 7, 8, 9])
    assert [g.first_position for g in exported.groups] == [0, 0, 0]
    dst, dm = empty_cache("tp8")
    dst, a = import_sequence(dst, dm, exported)
    dst, b = import_sequence(dst, dm, exported)
    assert dm.metrics.prefix_hits == 1 and all(dm.pages(b, group=g)[0] == dm.pages(a, group=g)[0] for g in range(3))
    same(read(dst, dm, b), read(cache, m, s))


def test_raw_int8_grouped_pages_stay_bit_exact():
    cache, m = empty_cache("tp8", quantizer="int8")
    [s] = m.claim(1)
    plan = m.schedule([s], [7])
    meta = cache.metadata
    groups = [meta.groups[meta.group_of(i)[0]] for i in range(LAYERS)]
    rng = np.random.default_rng(4)
    ks = [rng.standard_normal((7, g.num_kv_heads, g.key_head_dim)).astype(np.float32) for g in groups]
    vs = [None if g.latent else rng.standard_normal((7, g.num_kv_heads, g.value_head_dim)).astype(np.float32)
          for g in groups]
    cache, _ = cache.write(ks, vs, plan.metadata)
    m.commit(plan)
    exported = export_sequence(cache, m, s, dequantize=False)
    assert exported.raw and exported.groups[1].keys["values"].dtype == np.int8
    back = GroupedSequenceExport.from_bytes(exported.to_bytes())
    assert back == exported
    dst, dm = empty_cache("dp2tp4", quantizer="int8")
    dst, seq = import_sequence(dst, dm, back)
    again = export_sequence(dst, dm, seq, dequantize=False)
    assert again == exported


def test_imports_that_do_not_fit_are_refused_by_name_and_change_nothing():
    cache, m = filled("tp8")
    exported = export_sequence(cache, m, 0)
    wider = tuple(dataclasses.replace(g, window=10) if g.attention == "sliding" else g for g in GROUPS)
    other = tuple(dataclasses.replace(g, key_head_dim=16) if g.latent else g for g in GROUPS)
    cases = [
        (empty_cache("tp8", wider), r"positions 9..13 only .* layer group 0 of the target cache \(sliding, window "
                                    r"10\) reads from position 5"),
        (empty_cache("tp8", other), r"another shape .* K dim 12, V dim 8, latent True \| cache: .* K dim 16"),
    ]
    for (dst, dm), words in cases:
        before = dm.state_dict()
        with pytest.raises(ValueError, match=words):
            import_sequence(dst, dm, exported)
        assert dm.state_dict() == before and not any(x.is_deleted() for x in dst.key_pages)
    # a uniform cache's export into the grouped cache, and the other way round
    from tests.support.checkpoints import engine_run

    uniform_cache, uniform_m, _ = engine_run("heads")
    flat = export_sequence(uniform_cache, uniform_m, 0)
    dst, dm = empty_cache("tp8")
    with pytest.raises(ValueError, match="another shape"):
        import_sequence(dst, dm, flat)
    with pytest.raises(ValueError, match="another shape"):
        import_sequence(uniform_cache, uniform_m, exported)


def test_crafted_grouped_exports_are_refused_by_field():
    cache, m = filled("tp8")
    exported = export_sequence(cache, m, 0)
    g0 = exported.groups[0]
    with pytest.raises(ValueError, match=r"groups\[0\].values must be None: a latent group"):
        GroupedSequenceExport(length=14, groups=(dataclasses.replace(g0, latent=True),) + exported.groups[1:],
                              dtype="float32", quantization="none", raw=False)
    with pytest.raises(ValueError, match=r"hold the layers \[1, 3, 4\]; .* every model layer 0..2 exactly once"):
        GroupedSequenceExport(length=14, groups=exported.groups[1:], dtype="float32", quantization="none", raw=False)
    with pytest.raises(ValueError, match=r"groups\[0\].keys has shape \(2, 5, 4, 8\), but .* implies \(2, 4, 4, 8\)"):
        GroupedSequenceExport(length=14, groups=(dataclasses.replace(g0, first_position=10),) + exported.groups[1:],
                              dtype="float32", quantization="none", raw=False)
    blob = exported.to_bytes()
    for edit, words in [
        (lambda h: h["groups"][1].update(key_head_dim=8), "implies"),
        (lambda h: h["groups"][0].update(extra=1), "unknown entries"),
        (lambda h: h["groups"][2].update(first_position=99), "first_position"),
        (lambda h: h.update(groups=[]), "'groups' must be a list of 1..1024"),
    ]:
        with pytest.raises(ValueError, match=words):
            SequenceExport.from_bytes(with_header(blob, edit))
    with pytest.raises(ValueError, match="not a grouped one"):
        from tests.support.checkpoints import engine_run

        uc, um, _ = engine_run("heads")
        GroupedSequenceExport.from_bytes(export_sequence(uc, um, 0).to_bytes())
    with pytest.raises(ValueError, match=r"groups\[1\] must be an ExportedGroup, got tuple"):
        GroupedSequenceExport(length=14, groups=(g0, tuple(exported.groups[1].geometry())), dtype="float32",
                              quantization="none", raw=False)
