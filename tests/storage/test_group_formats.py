"""Layer groups with a page format of their own: a float32 cache whose sliding group stores int8
pages, whose full group stores bfloat16 and whose latent group stores fp8. Each group is sized,
allocated, written, read and attended in its own format; checkpoints keep (or, on request,
convert) each group's format; sequence exports carry it per group (raw codes where the group
compresses, dense values elsewhere); EasyDeL's one-table form refuses it by name."""

from __future__ import annotations

import dataclasses
import io
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv import LayerGroup, PagedAttentionCacheMetaData
from easykv.checkpoint.grouped_export import GroupedSequenceExport
from easykv.checkpoint.transfer import SequenceExport, export_sequence, import_sequence
from easykv.errors import CheckpointMismatchError
from easykv.quantization import QuantizedPages
from easykv.sharding import ShardingAdjustedWarning
from tests.support.attention import numpy_attention
from tests.support.groups import (
    FORMAT_GROUPS,
    FORMATS,
    LAYERS,
    PS,
    create_formats,
    filled_formats,
    mesh_and_rule,
    read,
    rows_for,
    same,
    with_header,
)


def stored(meta, layer, x):
    """What the layer's group keeps of new rows ``x``: quantized and back, in float64."""
    g = meta.groups[meta.group_of(layer)[0]]
    q = meta.group_quantizer(g)
    x = jnp.asarray(x)
    if q.name != "none":
        x = q.quantize(x).dequantize(meta.group_dtype(g))
    return np.asarray(x.astype(jnp.float32), np.float64)


def test_each_group_is_sized_and_stored_in_its_own_format():
    cache, _ = create_formats("tp8")
    meta = cache.metadata
    assert meta.group_formats == FORMATS and not meta.has_one_format
    # bytes of one page of one layer on one device, by hand: heads held x page_size x per-token bytes
    int8 = 8 + 4  # 8 codes + one float32 scale per token and head
    assert meta.group_page_bytes(meta.groups[0]) == 4 * PS * 2 * int8  # 4 heads replicated over tp=8
    assert meta.group_page_bytes(meta.groups[1]) == 1 * PS * (16 + 8) * 2  # one bf16 head per device
    assert meta.group_page_bytes(meta.groups[2]) == 1 * PS * (12 + 4)  # the fp8 latent, replicated
    # ... and what the devices really hold is exactly what the sizing counted
    held = sum(shard.data.nbytes for leaf in jax.tree.leaves(cache) for shard in leaf.addressable_shards
               if shard.device == jax.devices()[0])
    assert held == meta.bytes_per_device
    k0, k1, k2 = cache.key_pages
    assert isinstance(k0, QuantizedPages) and k0.quantizer.name == "int8"
    assert isinstance(k2, QuantizedPages) and k2.quantizer.name == "fp8" and cache.value_pages[2] is None
    assert not isinstance(k1, QuantizedPages) and k1.dtype == np.uint16  # bf16 as raw bits on CPU
    assert [cache.views[i].dtype for i in range(LAYERS)] == [np.float32, np.dtype("bfloat16")] * 2 + [np.float32]


def test_a_groups_format_equal_to_the_caches_is_the_caches_and_json_keeps_the_rest():
    meta = create_formats("tp8")[0].metadata
    text = meta.to_json()
    back = PagedAttentionCacheMetaData.from_json(text)
    assert back == meta and back.group_formats == FORMATS
    groups = json.loads(text)["layer_groups"]
    assert [(g.get("dtype"), g.get("quantization")) for g in groups] == [(None, "int8"), ("bfloat16", None),
                                                                           (None, "fp8")]
    assert [g["__version__"] for g in groups] == [2, 2, 2]
    # naming the cache's own format is the same as naming none
    plain = tuple(LayerGroup(g.layers, g.attention, g.window, num_kv_heads=g.num_kv_heads, key_head_dim=g.key_head_dim,
                             value_head_dim=g.value_head_dim, latent=g.latent, num_pages=g.num_pages)
                  for g in FORMAT_GROUPS)
    named = tuple(LayerGroup(g.layers, g.attention, g.window, num_kv_heads=g.num_kv_heads,
                             key_head_dim=g.key_head_dim, value_head_dim=g.value_head_dim, latent=g.latent,
                             num_pages=g.num_pages, dtype="float32", quantization="none") for g in FORMAT_GROUPS)
    a, b = create_formats("tp8", plain)[0].metadata, create_formats("tp8", named)[0].metadata
    assert a == b and a.has_one_format and all(g.dtype is None and g.quantization is None for g in b.groups)
    # a group of version 1 (no format fields) still reads: the cache's format
    old = json.loads(a.to_json())
    assert [g["__version__"] for g in old["layer_groups"]] == [1, 1, 1]
    assert PagedAttentionCacheMetaData.from_dict(old) == a
    # one group of every layer with a format of its own is the uniform cache in that format
    mesh, rule = mesh_and_rule("tp8")
    one = PagedAttentionCacheMetaData.create(mesh, 4, LAYERS, 32, PS, 8, 16, 0.9, "float32", partition_manager=rule,
                                             layer_groups=[LayerGroup(range(LAYERS), quantization="int4",
                                                                      dtype="bfloat16", num_pages=16)])
    assert one.is_uniform and (one.dtype, one.quantization) == (np.dtype("bfloat16"), "int4")


@pytest.mark.parametrize("kwargs, words", [
    (dict(quantization="int9"), "unknown quantizer 'int9'"),
    (dict(quantization="int4", key_head_dim=7), "head_dim"),
    (dict(quantization=3), "quantizer must be None, a name"),
    (dict(dtype="int32"), "dtype int32 is not a cache dtype"),
    (dict(dtype=">f4"), "byte order"),
])
def test_a_bad_group_format_is_refused_by_name(kwargs, words):
    with pytest.raises(ValueError, match=words):
        LayerGroup((0,), **{"key_head_dim": 8, **kwargs})


def test_a_groups_quantizer_is_checked_against_the_dims_it_takes_from_the_cache():
    """A group that leaves its head dim to the cache is checked once the dim is known; a latent
    group against its one vector (here 12 is fine, 13 is not)."""
    mesh, rule = mesh_and_rule("tp8")
    open_dims = (LayerGroup((0, 2, 4), "sliding", 8, num_pages=24, quantization="int4"),
                 LayerGroup((1, 3), num_pages=24))
    with pytest.raises(ValueError, match="int4 packs two values per byte along head_dim.*got 15"):
        PagedAttentionCacheMetaData.create(mesh, 4, LAYERS, 32, PS, 8, 15, 0.9, "float32", partition_manager=rule,
                                           layer_groups=open_dims)
    with pytest.raises(ValueError, match="got 13"):
        LayerGroup((4,), "full", num_kv_heads=1, key_head_dim=13, value_head_dim=8, latent=True, quantization="int4")


@pytest.mark.parametrize("layout", ["tp8", "dp2tp4"])
def test_writes_reads_and_attention_follow_each_groups_format(layout):
    cache, m, s, toks = filled_formats(layout)
    meta = cache.metadata
    got = read(cache, m, s)
    first = m.sequence(s).first_kept[0]
    for i, ((k, v), (gk, gv)) in enumerate(zip(toks, got)):
        g = meta.groups[meta.group_of(i)[0]]
        assert gk.dtype == meta.group_dtype(g)
        skip = first if g.attention == "sliding" else 0
        np.testing.assert_array_equal(np.asarray(gk, np.float64), stored(meta, i, k)[skip:])
        if v is not None:
            np.testing.assert_array_equal(np.asarray(gv, np.float64), stored(meta, i, v)[skip:])
    # one decode token: attention of every layer against numpy on what its group stores
    plan = m.schedule([s], [1])
    rts = plan.metadata
    new = rows_for(meta, np.random.default_rng(6), 1)
    runner = easykv.Runner(m, cache)
    runner.run(plan, lambda cache, plan: cache.write([k for k, _ in new], [v for _, v in new], plan.metadata))
    cache = runner.cache
    rng = np.random.default_rng(7)
    for i in range(LAYERS):
        g = meta.groups[meta.group_of(i)[0]]
        step_meta = rts[meta.group_of(i)[0]]
        q = rng.standard_normal((step_meta.slot_mapping.shape[0], 2 * g.num_kv_heads,
                                 g.key_head_dim)).astype(np.float32)
        out = np.asarray(easykv.view_attention(jnp.asarray(q, meta.group_dtype(g)), cache.views[i], rts), np.float64)
        keys = np.concatenate([stored(meta, i, toks[i][0]), stored(meta, i, new[i][0])])
        values = keys[..., : g.value_head_dim] if g.latent else np.concatenate(
            [stored(meta, i, toks[i][1]), stored(meta, i, new[i][1])])
        qq = np.asarray(jnp.asarray(q, meta.group_dtype(g)).astype(jnp.float32))
        want = numpy_attention(qq[:1], keys, values, np.array([7]),
                               window=g.window if g.attention == "sliding" else None)
        tol = 2e-2 if meta.group_dtype(g) == np.dtype("bfloat16") else 2e-5
        np.testing.assert_allclose(out[:1], want, rtol=tol, atol=tol, err_msg=f"layer {i}")


def test_a_write_in_another_dtype_than_its_groups_is_refused_and_writes_nothing():
    cache, m, s, toks = filled_formats()
    before = read(cache, m, s)
    runner = easykv.Runner(m, cache)
    plan = runner.schedule([s], [1])  # its device work applied: only the refused write is left to change a page
    cache, rts = runner.cache, plan.metadata
    new = rows_for(cache.metadata, np.random.default_rng(8), 1)
    bad = [(k.astype(np.float32), None if v is None else v.astype(np.float32)) for k, v in new]
    with pytest.raises(ValueError, match=r"cache stores bfloat16 \(layers \[1, 3\]: 8 kv heads"):
        cache.write([k for k, _ in bad], [v for _, v in bad], rts)
    view = cache.views[1]
    with pytest.raises(ValueError, match="cache stores bfloat16"):
        view.write_mixed_to_cache(bad[1][0], bad[1][1], rts)
    m.abort(plan)
    same(read(cache, m, s), before)


@pytest.mark.parametrize("source, target", [("dp2tp4", "tp8"), ("tp8", "tp2")])
def test_a_checkpoint_keeps_each_groups_format_onto_other_meshes(tmp_path, source, target):
    cache, m, s, _ = filled_formats(source)
    want = read(cache, m, s)
    easykv.save_cache(tmp_path, cache, m)
    mesh, rule = mesh_and_rule(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        restored = easykv.restore_cache(tmp_path, mesh=mesh, partition_manager=rule)
    assert restored.metadata.group_formats == FORMATS
    same(read(restored.cache, restored.manager, s), want)
    assert "own format int8" in easykv.inspect_checkpoint(tmp_path)
    assert "own format bfloat16" in easykv.inspect_checkpoint(tmp_path)


def test_a_checkpoint_converts_groups_formats_only_on_request(tmp_path):
    cache, m, s, _ = filled_formats()
    want = read(cache, m, s)
    easykv.save_cache(tmp_path, cache, m)
    mesh, rule = mesh_and_rule("tp8")
    with pytest.raises(CheckpointMismatchError, match=r"layers \[1, 3\]: the checkpoint holds bfloat16 pages with "
                                                      r"quantizer 'none', but float32") as err:
        easykv.restore_cache(tmp_path, mesh=mesh, partition_manager=rule, dtype="float32")
    assert "layers [0, 2]" not in str(err.value)  # the float32 groups keep their dtype
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        wide = easykv.restore_cache(tmp_path, mesh=mesh, partition_manager=rule, dtype="float32", convert=True)
        plain = easykv.restore_cache(tmp_path, mesh=mesh, partition_manager=rule, quantizer="none", convert=True)
    # dtype= sets every group's dtype and keeps each group's quantizer; quantizer= the reverse
    assert wide.metadata.group_formats == ((np.dtype("float32"), "int8"), (np.dtype("float32"), "none"),
                                           (np.dtype("float32"), "fp8"))
    assert plain.metadata.group_formats == ((np.dtype("float32"), "none"), (np.dtype("bfloat16"), "none"),
                                            (np.dtype("float32"), "none"))
    for got in (read(wide.cache, wide.manager, s), read(plain.cache, plain.manager, s)):
        for (k1, v1), (k2, v2) in zip(got, want):  # every value as the source held it (bf16 -> f32 is exact)
            np.testing.assert_array_equal(np.asarray(k1, np.float32), np.asarray(k2, np.float32))
            if v1 is not None:
                np.testing.assert_array_equal(np.asarray(v1, np.float32), np.asarray(v2, np.float32))
    # a target metadata whose sliding group is unquantized: only that group changes
    target = cache.metadata.with_formats(((np.dtype("float32"), "none"),) + FORMATS[1:], dtype="float32",
                                         quantization="none")
    with pytest.raises(CheckpointMismatchError, match=r"layers \[0, 2\]: the checkpoint holds float32 pages with "
                                                      "quantizer 'int8'"):
        easykv.restore_cache(tmp_path, mesh=mesh, partition_manager=rule, metadata=target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        one = easykv.restore_cache(tmp_path, mesh=mesh, partition_manager=rule, metadata=target, convert=True)
    assert one.metadata.group_formats == ((np.dtype("float32"), "none"),) + FORMATS[1:]
    same(read(one.cache, one.manager, s), want)
    assert one.cache.key_pages[1] is not None and np.asarray(one.cache.key_pages[1]).dtype == np.uint16


def test_a_raw_export_holds_codes_where_a_group_compresses_and_moves_bit_exact(tmp_path):
    cache, m, s, _ = filled_formats()
    exported = export_sequence(cache, m, s, dequantize=False)
    assert isinstance(exported, GroupedSequenceExport) and exported.raw
    assert [exported.group_raw(i) for i in range(3)] == [True, False, True]
    assert exported.groups[0].keys["values"].dtype == np.int8
    assert exported.groups[1].keys.dtype == np.dtype("bfloat16") and exported.groups[1].dtype == np.dtype("bfloat16")
    blob = exported.to_bytes()
    header = json.loads(np.load(io.BytesIO(blob))["header"].tobytes())
    assert [(g.get("dtype"), g.get("quantization")) for g in header["groups"]] == [(None, "int8"), ("bfloat16", None),
                                                                                    (None, "fp8")]
    back = SequenceExport.load(io.BytesIO(blob))
    assert back == exported
    dst, dm = create_formats("dp2tp4")
    dst, seq = import_sequence(dst, dm, back)
    assert export_sequence(dst, dm, seq, dequantize=False) == exported
    same(read(dst, dm, seq), read(cache, m, s))
    # dense: every group in its own dtype, equal to what the groups hold
    dense = export_sequence(cache, m, s)
    assert not dense.raw and [g.keys.dtype for g in dense.groups] == [np.float32, np.dtype("bfloat16"), np.float32]
    for (k, v), (dk, dv) in zip(dense.dense(), exported.dense()):
        np.testing.assert_array_equal(k, dk)
        assert (v is None) == (dv is None) and (v is None or np.array_equal(v, dv))


def test_an_export_imports_into_a_cache_of_other_group_formats():
    cache, m, s, _ = filled_formats()
    exported = export_sequence(cache, m, s, dequantize=False)
    plain_groups = tuple(LayerGroup(g.layers, g.attention, g.window, num_kv_heads=g.num_kv_heads,
                                    key_head_dim=g.key_head_dim, value_head_dim=g.value_head_dim, latent=g.latent,
                                    num_pages=g.num_pages) for g in FORMAT_GROUPS)
    dst, dm = create_formats("tp8", plain_groups)  # everything float32, unquantized
    dst, seq = import_sequence(dst, dm, exported)
    for (k1, v1), (k2, v2) in zip(read(dst, dm, seq), read(cache, m, s)):
        np.testing.assert_array_equal(k1, np.asarray(k2, np.float32))
        if v1 is not None:
            np.testing.assert_array_equal(v1, np.asarray(v2, np.float32))
    # and back: a plain export into the mixed cache is quantized and cast per group. Quantizing
    # dequantized codes gives the same codes, but the scale is recomputed from the absmax
    # (127 s / 127) and may differ in its last bit: equal to float32 rounding, not bit for bit.
    again, am = create_formats("tp8")
    again, seq2 = import_sequence(again, am, export_sequence(dst, dm, seq))
    for (k1, v1), (k2, v2) in zip(read(again, am, seq2), read(cache, m, s)):
        assert k1.dtype == k2.dtype
        np.testing.assert_allclose(np.asarray(k1, np.float32), np.asarray(k2, np.float32), rtol=4e-7, atol=0)
        if v1 is not None:
            np.testing.assert_allclose(np.asarray(v1, np.float32), np.asarray(v2, np.float32), rtol=4e-7, atol=0)


@pytest.mark.parametrize("change, words", [
    (lambda h: h["groups"][0].update(quantization="int9"), r"'groups'\[0\].quantization: unknown quantizer 'int9'"),
    (lambda h: h["groups"][1].update(dtype="int32"), r"'groups'\[1\].dtype: dtype int32 is not a cache dtype"),
    (lambda h: h["groups"][0].update(colour="red"),
     r"unknown entries \['colour'\].*may hold \['dtype', 'quantization'\]"),
    (lambda h: h["groups"][0].pop("quantization"), "'dtypes' is"),  # then the codes do not fit the header
    (lambda h: h["groups"][1].update(dtype="float16"), "'dtypes' is"),
])
def test_a_crafted_group_format_in_an_export_file_is_refused_by_field(change, words):
    cache, m, s, _ = filled_formats()
    blob = export_sequence(cache, m, s, dequantize=False).to_bytes()
    with pytest.raises(ValueError, match=words):
        SequenceExport.load(io.BytesIO(with_header(blob, change)))


def test_a_raw_export_needs_a_compressing_group():
    cache, m, s, _ = filled_formats()
    exported = export_sequence(cache, m, s)
    assert exported.groups[0].quantization == "int8" and not exported.raw
    only_dense = tuple(dataclasses.replace(g, quantization=None) for g in exported.groups)
    with pytest.raises(ValueError, match="raw=True needs a group with a compressing quantizer.*'none'"):
        GroupedSequenceExport(length=exported.length, groups=only_dense, dtype=exported.dtype,
                              quantization="none", raw=True)
    # dense parts where a group's quantizer says raw codes: refused by field
    with pytest.raises(ValueError, match=r"groups\[0\].keys of a raw export must be a dict"):
        GroupedSequenceExport(length=exported.length, groups=exported.groups, dtype=exported.dtype,
                              quantization="none", raw=True)


def test_easydels_one_table_form_refuses_groups_of_their_own_format():
    from easykv.integrations._easydel_config import config_dict_from_metadata, shares_one_table

    mesh, rule = mesh_and_rule("tp8")
    groups = (LayerGroup((0, 2, 4), "sliding", 8, num_pages=24, quantization="int8"), LayerGroup((1, 3), num_pages=24))
    meta = PagedAttentionCacheMetaData.create(mesh, 4, LAYERS, 32, PS, 8, 16, 0.9, "float32", partition_manager=rule,
                                              layer_groups=groups)
    assert not shares_one_table(meta)
    with pytest.raises(ValueError, match="own format int8.*geometry and format with the same pool"):
        config_dict_from_metadata(meta)
