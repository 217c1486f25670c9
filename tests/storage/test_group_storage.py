"""Caches of several layer groups, each stored in its own geometry: a sliding group of 4 kv heads,
a full group of 8 kv heads whose values are narrower than its keys, and a latent group (one
replicated head, no value pages). Each group is one stack per K and V with its own pool; views,
writes (per layer and all at once), reads and attention follow the group; step metadata is one
per group. Checked against numpy on a tp=8 mesh and on dp=2 x tp=4 (pages split by replica)."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv import LayerGroup, PagedAttentionCache, PagedAttentionCacheMetaData, PagedAttentionMetadata
from easykv.sharding import PartitionAxis, PartitionManager, ShardingAdjustedWarning, create_mesh
from tests.support.attention import numpy_attention

PS, MAX_LEN, WINDOW = 4, 32, 6
# (layers, attention, kv heads, K dim, V dim, latent, pages)
GROUPS = (((0, 2), "sliding", 4, 8, 8, False, 16), ((1, 3), "full", 8, 16, 8, False, 24),
          ((4,), "full", 1, 12, 8, True, 24))
LAYERS = 5


def grouped_meta(layout: str):
    mesh = create_mesh({"dp": 1, "tp": 8}) if layout == "tp8" else create_mesh({"dp": 2, "tp": 4})
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp", page_axis="dp" if layout == "dp2tp4" else None))
    groups = tuple(LayerGroup(layers, attention=kind, window=WINDOW if kind == "sliding" else None, num_kv_heads=h,
                              key_head_dim=dk, value_head_dim=dv, latent=latent, num_pages=pages)
                   for layers, kind, h, dk, dv, latent, pages in GROUPS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)  # the latent's one head is replicated
        meta = PagedAttentionCacheMetaData.create(mesh, 2, LAYERS, MAX_LEN, PS, 8, 16, 0.9, "float32",
                                                  partition_manager=pm, layer_groups=groups)
        cache = PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    return mesh, pm, cache.metadata, cache


def tables(meta):
    """Per group, two sequences' page rows inside their replica's slice (permuted)."""
    rng = np.random.default_rng(7)
    out = []
    for g in meta.groups:
        half = g.num_pages // meta.page_shards
        if meta.page_shards > 1:
            rows = [rng.permutation(half)[: MAX_LEN // PS] + r * half for r in range(2)]
        else:  # one pool: the two rows must not share pages
            perm = rng.permutation(g.num_pages)
            rows = [perm[: MAX_LEN // PS], perm[MAX_LEN // PS: 2 * MAX_LEN // PS]]
        out.append(np.asarray(rows, np.int32))
    return out


def step_metadata(meta, rows, cached, new):
    return tuple(PagedAttentionMetadata.for_mixed(r, cached, new, cache_metadata=meta, group=g)
                 for g, r in enumerate(rows))


def new_tokens(rng, meta, n):
    """Per layer (K, V) rows in the layer's group geometry (V None for the latent layer)."""
    out = []
    for i in range(LAYERS):
        g = meta.groups[meta.group_of(i)[0]]
        k = rng.standard_normal((n, g.num_kv_heads, g.key_head_dim)).astype(np.float32)
        v = rng.standard_normal((n, g.num_kv_heads, g.value_head_dim)).astype(np.float32) if g.has_values else None
        out.append((k, v))
    return out


@pytest.fixture(params=["tp8", "dp2tp4"])
def grouped(request):
    return grouped_meta(request.param)


def test_each_group_is_one_stack_in_its_own_geometry_and_placement(grouped):
    mesh, _, meta, cache = grouped
    for g, (group, k, v) in enumerate(zip(meta.groups, cache.key_pages, cache.value_pages)):
        assert k.shape == (group.num_layers, group.num_kv_heads, group.num_pages, PS, group.key_head_dim)
        assert (v is None) == group.latent
        if v is not None:
            assert v.shape == (group.num_layers, group.num_kv_heads, group.num_pages, PS, group.value_head_dim)
        # 8 heads split over tp; 4 heads over tp=4 but replicated on tp=8; the latent's one head replicated
        split = group.num_kv_heads % mesh.shape["tp"] == 0
        assert group.kv_head_shards == (mesh.shape["tp"] if split else 1)
        assert k.sharding.spec[1] == ("tp" if split else None), (g, k.sharding.spec)
        assert k.sharding.spec[2] == ("dp" if meta.page_shards > 1 else None)
    assert [cache[i].group for i in range(LAYERS)] == [0, 1, 0, 1, 2]
    assert [cache[i].layer for i in range(LAYERS)] == [0, 0, 1, 1, 0]
    assert cache[3].key_pages.shape == (8, 24, PS, 16) and cache[4].value_pages is None


def test_writes_and_attention_follow_each_group_against_numpy(grouped):
    """Two steps (a 9- and 5-token prefill, then one decode token each), written through views
    for the first step and with cache.write for the second; every layer's attention against
    numpy on the tokens written, with the group's window and the latent's value dims."""
    mesh, _, meta, cache = grouped
    rng = np.random.default_rng(0)
    rows = tables(meta)
    hist = [[None, None] for _ in range(LAYERS)]  # per layer, per sequence: (K, V) so far
    for step, (cached, new) in enumerate((([0, 0], [9, 5]), ([9, 5], [1, 1]))):
        rts = step_metadata(meta, rows, cached, new)
        n = sum(new)
        toks = new_tokens(rng, meta, n)
        if step == 0:
            for i, (k, v) in enumerate(toks):
                view = cache.views[i]
                view = view.write_mixed_to_cache(k, v, rts)
                cache.views[i] = view
        else:
            cache, dropped = cache.write([k for k, _ in toks], [v for _, v in toks], rts)
            assert int(dropped) == 0
        t = 0
        for s, c in enumerate(new):
            for i, (k, v) in enumerate(toks):
                pair = (k[t:t + c], None if v is None else v[t:t + c])
                old = hist[i][s]
                hist[i][s] = pair if old is None else tuple(
                    None if a is None else np.concatenate([a, b]) for a, b in zip(old, pair))
            t += c
        for i in range(LAYERS):
            g = meta.groups[meta.group_of(i)[0]]
            hq = 2 * g.num_kv_heads
            q = rng.standard_normal((n, hq, g.key_head_dim)).astype(np.float32)
            out = np.asarray(easykv.view_attention(q, cache.views[i], rts))
            t = 0
            for s, c in enumerate(new):
                k, v = hist[i][s]
                values = k[..., : g.value_head_dim] if g.latent else v
                pos = np.arange(cached[s], cached[s] + c)
                want = numpy_attention(q[t:t + c], k, values, pos,
                                       window=g.window if g.attention == "sliding" else None)
                np.testing.assert_allclose(out[t:t + c], want, rtol=2e-5, atol=2e-5, err_msg=f"layer {i} seq {s}")
                t += c
    # gather_kv reads a layer's tokens back in its group's geometry
    for i in (0, 3, 4):
        g = meta.groups[meta.group_of(i)[0]]
        k, v = easykv.gather_kv(cache, i, rows[meta.group_of(i)[0]][1], 6)
        np.testing.assert_array_equal(np.asarray(k), hist[i][1][0])
        assert (v is None) == g.latent
        if v is not None:
            np.testing.assert_array_equal(np.asarray(v), hist[i][1][1])


def test_a_scan_over_one_group_matches_the_views(grouped):
    mesh, _, meta, cache = grouped
    rng = np.random.default_rng(1)
    rows = tables(meta)
    rts = step_metadata(meta, rows, [0, 0], [3, 2])
    toks = new_tokens(rng, meta, 5)
    group_ks = jnp.asarray(np.stack([toks[i][0] for i in (1, 3)]))
    group_vs = jnp.asarray(np.stack([toks[i][1] for i in (1, 3)]))

    @jax.jit
    def scanned(cache, ks, vs, rts):
        def body(view, xs):
            i, k, v = xs
            return view.at_layer(i).write_mixed_to_cache(k, v, rts), None

        view, _ = jax.lax.scan(body, cache.group_view(1), (jnp.arange(2), ks, vs))
        cache.update(view)
        return cache

    out = scanned(cache, group_ks, group_vs, jax.tree.map(jnp.asarray, rts))
    for i in (1, 3):
        k, v = easykv.gather_kv(out, i, rows[1][0], 3)
        np.testing.assert_array_equal(np.asarray(k), toks[i][0][:3])
        np.testing.assert_array_equal(np.asarray(v), toks[i][1][:3])
    assert not np.any(np.asarray(out.key_pages[0])) and not np.any(np.asarray(out.key_pages[2]))
    assert cache.group_view(1).at_layer(1).layer_index == 3  # the group's second layer is model layer 3


def test_copy_and_zero_take_one_id_array_per_group():
    _, _, meta, cache = grouped_meta("tp8")
    rng = np.random.default_rng(2)
    rows = tables(meta)
    toks = new_tokens(rng, meta, 8)
    cache, _ = cache.write([k for k, _ in toks], [v for _, v in toks], step_metadata(meta, rows, [0, 0], [4, 4]))
    src = tuple(np.asarray([r[0, 0]], np.int32) for r in rows)
    dst = (np.asarray([15], np.int32), np.asarray([23], np.int32), np.asarray([-1], np.int32))
    before = [np.asarray(k).copy() for k in cache.key_pages]
    cache = cache.copy_pages(src, dst)
    after = [np.asarray(k) for k in cache.key_pages]
    np.testing.assert_array_equal(after[0][:, :, 15], before[0][:, :, rows[0][0, 0]])
    np.testing.assert_array_equal(after[1][:, :, 23], before[1][:, :, rows[1][0, 0]])
    np.testing.assert_array_equal(after[2], before[2])  # padding only: the latent group unchanged
    cache = cache.zero_pages((np.asarray([15]), np.asarray([-1]), np.asarray([rows[2][0, 0]])))
    assert not np.any(np.asarray(cache.key_pages[0])[:, :, 15])
    np.testing.assert_array_equal(np.asarray(cache.key_pages[1]), after[1])
    assert not np.any(np.asarray(cache.key_pages[2])[:, :, rows[2][0, 0]])
    with pytest.raises(ValueError, match=r"src holds 2 arrays of page ids but the cache has 3 layer group"):
        cache.copy_pages(src[:2], dst[:2])
    with pytest.raises(ValueError, match=r"dst\[0\].*16"):  # page 16 is past group 0's 16 pages
        cache.copy_pages(src, (np.asarray([16]), *dst[1:]))


def test_a_grouped_cache_round_trips_through_json():
    mesh, pm, meta, cache = grouped_meta("tp8")
    rng = np.random.default_rng(3)
    toks = new_tokens(rng, meta, 8)
    cache, _ = cache.write([k for k, _ in toks], [v for _, v in toks], step_metadata(meta, tables(meta), [0, 0],
                                                                                    [4, 4]))
    with pytest.warns(ShardingAdjustedWarning, match="replicated along 'tp'"):  # said again for the rebuilt pages
        back = PagedAttentionCache.from_json(cache.to_json(), mesh=mesh, partition_manager=pm)
    assert back.metadata == cache.metadata
    for a, b in zip(jax.tree.leaves((cache.key_pages, cache.value_pages)), jax.tree.leaves((back.key_pages,
                                                                                           back.value_pages))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    assert back.value_pages[2] is None


def test_bad_grouped_input_is_refused_before_anything_changes():
    _, _, meta, cache = grouped_meta("tp8")
    rng = np.random.default_rng(4)
    rows = tables(meta)
    rts = step_metadata(meta, rows, [0, 0], [2, 2])
    toks = new_tokens(rng, meta, 4)
    before = [np.asarray(x).copy() for x in jax.tree.leaves((cache.key_pages, cache.value_pages))]
    k0, v0 = toks[0]
    k4, _ = toks[4]
    cases = [
        (lambda: cache.views[4].write_mixed_to_cache(k4, k4[..., :8], rts), r"value must be None for a latent"),
        (lambda: cache.views[4].write_mixed_to_cache(k4[..., :8], None, rts),
         r"key has shape \(4, 1, 8\), expected .* = \(4, 1, 12\) \(layers \[4\]: 1 kv heads of 12 dims, latent\)"),
        (lambda: cache.views[1].write_mixed_to_cache(toks[1][0], toks[1][0], rts),
         r"value has shape \(4, 8, 16\), expected .* = \(4, 8, 8\)"),
        (lambda: cache.views[0].write_mixed_to_cache(k0, v0, rts[:2]), r"holds 2 item\(s\) but the cache has 3"),
        (lambda: cache.write([k for k, _ in toks], [v for _, v in toks][:4] + [k4], rts), r"values\[4\] must be None"),
        (lambda: cache.write(np.zeros((5, 4, 8, 16), np.float32), [v for _, v in toks], rts),
         r"keys has shape \(4, 8, 16\), expected .* = \(4, 4, 8\) \(layers \[0, 2\]"),
        (lambda: cache.views.__setitem__(1, cache.views[0]), r"must be layer 1 of this cache, but the view's "
                                                              r"layer_index and group and layout differ"),
        (lambda: easykv.view_attention(np.zeros((4, 8, 8), np.float32), cache.views[0], rts, sliding_window=3),
         r"layers \[0, 2\]\) is sliding \(window 6\), so sliding_window=6; got sliding_window=3"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
        after = [np.asarray(x) for x in jax.tree.leaves((cache.key_pages, cache.value_pages))]
        assert all(np.array_equal(a, b) for a, b in zip(before, after))
    # a page id valid in the largest pool but not in the sliding group's 16 pages
    far = PagedAttentionMetadata.for_mixed([[20, -1, -1, -1, -1, -1, -1, -1]], [0], [1], cache_metadata=meta)
    with pytest.raises(ValueError, match=r"outside the pool's 64 slots"):
        cache.views[0].write_mixed_to_cache(k0[:1], v0[:1], far)
    # built for the group, the metadata proves its ids against that group's pool (the write then
    # skips the host check) and refuses the page itself
    from easykv.step.checks import host_checked

    assert [host_checked(step_meta).num_pages for step_meta in step_metadata(meta, tables(meta), [0, 0],
                                                                             [1, 1])] == [16, 24, 24]
    with pytest.raises(ValueError, match=r"page_table.* 20.*16"):
        PagedAttentionMetadata.for_mixed([[20, -1, -1, -1, -1, -1, -1, -1]], [0], [1], cache_metadata=meta, group=0)
    with pytest.raises(ValueError, match=r"group must .*got 3 \(valid: 0..2"):
        PagedAttentionMetadata.for_decode([[1]], [0], cache_metadata=meta, group=3)


def test_a_grouped_cache_saved_with_another_pools_manager_is_refused_before_anything_is_written(tmp_path):
    """The manager saved beside the pages must schedule exactly these pools (checkpoints of grouped
    caches themselves: tests/checkpoint/test_group_checkpoint.py)."""
    _, _, meta, cache = grouped_meta("tp8")
    other = meta.replace(layer_groups=tuple(dataclasses.replace(g, window=8) if g.attention == "sliding" else g
                                            for g in meta.groups))
    target = tmp_path / "ckpt"
    with pytest.raises(ValueError, match=r"layer groups \(attention, window, pages\): cache \[\('sliding', 6, 16\)"):
        easykv.save_cache(target, cache, easykv.PageManager(other))
    assert not target.exists()
    with easykv.CacheCheckpointer(tmp_path / "async") as ckpt:
        with pytest.raises(ValueError, match="the manager was built for another pool"):
            ckpt.save(cache, easykv.PageManager(other))
        assert ckpt.all_steps() == []
        assert ckpt.save(cache, easykv.PageManager(meta)) == 0
