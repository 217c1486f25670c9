"""PagedAttentionCache / PagedAttentionCacheView: allocation, placement on the mesh, storage
dtype, pytree behaviour (jit, donation), page copies and zeroing, gather_kv and init errors."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import easykv
from easykv import PagedAttentionCache, PagedAttentionCacheView, PagedAttentionMetadata, gather_kv
from easykv.sharding import PartitionAxis, PartitionManager, ShardingAdjustedWarning
from easykv.storage.pages import storage_dtype
from tests.support.pools import (
    HEAD_DIM,
    LAYERS,
    PAGE_SIZE,
    PAGES,
    PoolModel,
    assert_unchanged,
    mesh_for,
    new_cache,
    random_tokens,
    setup,
    snapshot,
)

# layout -> (spec of the pages, shape of each device's shard, number of shards)
EXPECTED = {
    "single": (P("tp", None, None, None), (8, PAGES, PAGE_SIZE, HEAD_DIM), 1),
    "heads": (P("tp", None, None, None), (1, PAGES, PAGE_SIZE, HEAD_DIM), 8),
    "replicated": (P(None, None, None, None), (4, PAGES, PAGE_SIZE, HEAD_DIM), 8),
    "dp": (P("tp", "dp", None, None), (2, PAGES // 2, PAGE_SIZE, HEAD_DIM), 8),
}


# ---------------------------------------------------------------------------- placement
@pytest.mark.parametrize("layout", list(EXPECTED))
def test_init_cache_places_each_shard_on_its_device(layout):
    spec, shard_shape, n_shards = EXPECTED[layout]
    mesh, _, meta = setup(layout)
    cache = new_cache(layout)
    heads = meta.num_kv_heads
    assert len(cache) == LAYERS and [v.layer_index for v in cache] == [0, 1] and [v.layer for v in cache] == [0, 1]
    stacked = P(None, *spec)
    # One stacked array per K and V holds every layer: (layers, heads, pages, page_size, head_dim).
    assert len(cache.key_pages) == len(cache.value_pages) == 1
    for pages in (cache.key_pages[0], cache.value_pages[0]):
        assert pages.shape == (LAYERS, heads, PAGES, PAGE_SIZE, HEAD_DIM)
        assert pages.dtype == np.uint16  # bf16 stored as raw bits on CPU
        assert pages.sharding.is_equivalent_to(NamedSharding(mesh, stacked), 5)
        assert pages.sharding.spec == stacked or (layout == "replicated" and pages.sharding.is_fully_replicated)
        shards = pages.addressable_shards
        assert len(shards) == n_shards
        assert {s.device for s in shards} == set(mesh.devices.flat)
        assert all(s.data.shape == (LAYERS, *shard_shape) for s in shards)
        assert not np.any(np.asarray(pages))
    for view in cache:
        assert view.metadata == meta and view.dtype == np.dtype(jnp.bfloat16)
        assert view.group_key_pages is cache.key_pages[0] and view.group_value_pages is cache.value_pages[0]
        assert view.key_pages.shape == (heads, PAGES, PAGE_SIZE, HEAD_DIM)  # the layer's slice, as EasyDeL's
    # Which device holds which heads/pages follows the mesh coordinates.
    if layout == "dp":
        k = cache.key_pages[0]
        for s in k.addressable_shards:
            dp, tp = (int(i[0]) for i in np.where(mesh.devices == s.device))
            assert s.index[1] == slice(2 * tp, 2 * tp + 2) and s.index[2] == slice(12 * dp, 12 * dp + 12)


def test_replicated_heads_warn_at_init():
    mesh, pm, meta = setup("replicated")
    with pytest.warns(ShardingAdjustedWarning, match=r"does not divide 4"):
        cache = PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm)
    # what the warning announces: every device stores all 4 heads (the pages are replicated)
    assert cache.key_pages[0].sharding.is_fully_replicated
    assert {s.data.shape[1] for s in cache.key_pages[0].addressable_shards} == {4}


def test_storage_dtype_policy():
    assert storage_dtype(jnp.bfloat16, "cpu") == np.uint16
    assert storage_dtype(np.float16, "cpu") == np.uint16
    assert storage_dtype(np.float32, "cpu") == np.float32
    assert storage_dtype(jnp.bfloat16, "gpu") == np.dtype(jnp.bfloat16)
    assert storage_dtype(jnp.bfloat16, "tpu") == np.dtype(jnp.bfloat16)
    f32 = new_cache("heads", "float32")
    assert f32[0].key_pages.dtype == np.float32 and f32[1].value_pages.dtype == np.float32
    f16 = new_cache("heads", "float16")
    assert f16[0].key_pages.dtype == np.uint16 and f16[0].dtype == np.float16


def test_view_init_allocates_one_layer():
    mesh, pm, meta = setup("dp")
    view = PagedAttentionCacheView.init(mesh, jnp.bfloat16, meta, 1, pm)
    assert view.layer_index == 1 and view.layer == 0 and view.key_pages.shape == (8, PAGES, PAGE_SIZE, HEAD_DIM)
    assert view.group_key_pages.shape == (1, 8, PAGES, PAGE_SIZE, HEAD_DIM)
    assert view.group_key_pages.sharding.spec == P(None, "tp", "dp", None, None)
    with pytest.raises(ValueError, match=r"layer_index must be a non-negative int, got 2 \(valid: 0\.\.1\)"):
        PagedAttentionCacheView.init(mesh, jnp.bfloat16, meta, 2, pm)


def test_init_cache_rejects_mismatches():
    mesh, pm, meta = setup("heads")
    with pytest.raises(ValueError, match=r"dtype float32 differs from metadata.dtype bfloat16"):
        PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    with pytest.raises(ValueError, match=r"dtype='int7' is not a dtype"):
        PagedAttentionCache.init_cache(mesh, "int7", meta, pm)
    with pytest.raises(ValueError, match=r"unknown quantizer 'int3'"):
        PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm, quantizer="int3")
    with pytest.raises(ValueError, match=r"quantizer 'int8' differs from metadata.quantization 'none'"):
        PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm, quantizer="int8")

    class Fake:
        name = "fp8"

        def bytes_per_token_head(self, head_dim, dtype):
            return head_dim

        def validate(self, head_dim, dtype):
            return None

    with pytest.raises(ValueError, match=r"not registered under its name 'fp8'.*register_quantizer"):
        PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm, quantizer=Fake())
    # Sized for heads over tp=8; this mesh splits heads over tp=4 and pages over dp=2.
    with pytest.raises(ValueError, match=r"split the pages as .*\(\('tp',\), 4, \('dp',\), 2\)"
                                         r".*sized for .*\(\('tp',\), 8, \(\), 1\)"):
        PagedAttentionCache.init_cache(mesh_for("dp"), jnp.bfloat16, meta,
                                       PartitionManager(PartitionAxis(page_axis="dp")))
    # Same mesh, but the partition manager replicates the heads.
    with pytest.raises(ValueError, match=r"sized for"):
        PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, PartitionManager(PartitionAxis(kv_head_axis=None)))
    with pytest.raises(ValueError, match=r"metadata must be a PagedAttentionCacheMetaData, got dict"):
        PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta.to_dict(), pm)


def test_cache_constructor_checks_arrays_and_from_views_stacks():
    cache = new_cache("single")
    k, v = cache.key_pages[0], cache.value_pages[0]
    with pytest.raises(ValueError, match=r"2 key and 1 value page arrays for 1 layer group"):
        PagedAttentionCache(cache.metadata, (k, k), (v,), cache.layout)
    with pytest.raises(ValueError, match=r"key_pages\[0\] has shape \(1, 8, 24, 4\).*needs .* = \(2, 8, 24, 4\)"):
        PagedAttentionCache(cache.metadata, (k[:1],), (v,), cache.layout)
    with pytest.raises(ValueError, match=r"metadata must be a PagedAttentionCacheMetaData, got dict"):
        PagedAttentionCache(cache.metadata.to_dict(), (k,), (v,), cache.layout)
    # from_views stacks per-layer views (the JSON form's) and checks them
    mesh, pm, meta = setup("single")
    rng = np.random.default_rng(5)
    views = [PagedAttentionCacheView.init(mesh, jnp.bfloat16, meta, i, pm) for i in range(LAYERS)]
    md = PagedAttentionMetadata(slot_mapping=np.array([5, 9], np.int32))
    toks = random_tokens(rng, (LAYERS, 2, 8, HEAD_DIM))
    for i, view in enumerate(views):
        view.write_tokens(toks[i], toks[i], md.slot_mapping)
    stacked = PagedAttentionCache.from_views(views)
    for i in range(LAYERS):
        assert np.array_equal(np.asarray(stacked.key_pages[0][i]), np.asarray(views[i].key_pages))
    with pytest.raises(ValueError, match=r"views\[0\] has layer_index=1"):
        PagedAttentionCache.from_views(views[::-1])
    with pytest.raises(ValueError, match=r"1 views for metadata with num_hidden_layers=2"):
        PagedAttentionCache.from_views(views[:1])
    with pytest.raises(ValueError, match=r"non-empty list"):
        PagedAttentionCache.from_views([])


def test_easydel_placeholders():
    cache = new_cache("single")
    with pytest.raises(NotImplementedError, match=r"no contiguous buffer"):
        cache[0].concatenate_to_cache(jnp.zeros(3), jnp.zeros(3))
    assert PagedAttentionCache.init_empty(4) is None


# ---------------------------------------------------------------------------- pytree / jit
def test_pytree_round_trip():
    cache = new_cache("dp")
    leaves, tree = jax.tree.flatten(cache)
    assert len(leaves) == 2  # one stacked array per K and V
    assert leaves[0] is cache.key_pages[0] and leaves[1] is cache.value_pages[0]
    back = jax.tree.unflatten(tree, leaves)
    assert isinstance(back, PagedAttentionCache) and back.metadata == cache.metadata and back.layout == cache.layout
    assert all(b.layout == c.layout and b.layer_index == c.layer_index for b, c in zip(back, cache))
    view_leaves, view_tree = jax.tree.flatten(cache[1])
    assert len(view_leaves) == 3 and view_leaves[2] == 1  # the group's K and V, and the layer in the group
    assert jax.tree.unflatten(view_tree, view_leaves).layer_index == 1


def test_jit_takes_and_returns_the_cache():
    cache = new_cache("heads")

    @jax.jit
    def bump(c):
        return c.replace(key_pages=tuple(k + 1 for k in c.key_pages))

    out = bump(cache)
    assert isinstance(out, PagedAttentionCache) and out.metadata == cache.metadata
    assert out.key_pages[0].sharding.spec == P(None, "tp", None, None, None)
    assert np.all(np.asarray(out[1].key_pages) == 1) and not np.any(np.asarray(out[1].value_pages))
    assert not np.any(np.asarray(cache[1].key_pages))  # not donated: the input is intact


@pytest.mark.parametrize("layout", ["heads", "dp"])
def test_write_copy_zero_donate_the_old_buffers(layout):
    _, _, meta = setup(layout)
    cache = new_cache(layout)
    old = [*cache.key_pages, *cache.value_pages]
    md = PagedAttentionMetadata.for_decode([[3, -1, -1, -1]], [0], cache_metadata=meta)
    keys = random_tokens(np.random.default_rng(0), (LAYERS, 1, meta.num_kv_heads, HEAD_DIM))
    cache, dropped = cache.write(keys, keys, md)
    assert int(dropped) == 0 and all(a.is_deleted() for a in old)
    for op in (lambda c: c.copy_pages([3], [4]), lambda c: c.zero_pages([3])):
        old = [*cache.key_pages, *cache.value_pages]
        new = op(cache)
        assert all(a.is_deleted() for a in old)
        assert all(not a.is_deleted() for a in (*new.key_pages, *new.value_pages))
        cache = new
    k = np.asarray(cache[0].key_pages)
    assert not np.any(k[:, 3]) and np.array_equal(k[:, 4, 0], keys[0, 0].view(np.uint16))


# ---------------------------------------------------------------------------- copy / zero
def _fill(cache, meta, model, rng):
    """Write random tokens into every slot of every page (one mixed write, slots permuted)."""
    slots = rng.permutation(PAGES * PAGE_SIZE).astype(np.int32)
    keys = random_tokens(rng, (LAYERS, slots.size, meta.num_kv_heads, HEAD_DIM))
    values = random_tokens(rng, keys.shape)
    cache, dropped = cache.write(keys, values, PagedAttentionMetadata(slot_mapping=slots))
    assert int(dropped) == 0
    for t, s in enumerate(slots):
        model.put(keys, values, t, int(s))
    return cache


@pytest.mark.parametrize("layout", ["single", "heads", "replicated", "dp"])
def test_copy_and_zero_pages_match_numpy(layout):
    rng = np.random.default_rng(1)
    _, _, meta = setup(layout)
    model = PoolModel(meta)
    cache = _fill(new_cache(layout), meta, model, rng)
    model.check_pool(cache)
    # Pages 0..11 and 12..23 are the two dp replicas' slices: pairs stay inside one slice.
    # 3 -> 5 and 5 -> 7 in one call: 7 receives the old page 5 (sources read first).
    src, dst = [3, 5, -1, 14, 20, 9], [5, 7, 9, 20, -1, 9]
    cache = cache.copy_pages(src, dst)
    model.copy(src, dst)
    model.check_pool(cache)
    assert not np.array_equal(model.k[:, :, 7], model.k[:, :, 3])  # the chain really differs
    ids = [7, -1, 20, 0]
    cache = cache.zero_pages(np.array(ids))
    model.zero(ids)
    model.check_pool(cache)
    assert not model.k[:, :, [0, 7, 20]].any() and model.k[:, :, 1].any()
    cache = cache.copy_pages([], [])  # nothing to do
    model.check_pool(cache)


def test_copy_and_zero_reject_bad_ids_and_change_nothing():
    rng = np.random.default_rng(2)
    _, _, meta = setup("dp")
    model = PoolModel(meta)
    cache = _fill(new_cache("dp"), meta, model, rng)
    before = snapshot(cache)
    cases = [
        (lambda: cache.copy_pages([24], [0]),
         r"src\[0\] = 24 is out of range \(valid: -1\.\.23; page ids of a pool of 24 pages, -1 for padding\)"),
        (lambda: cache.copy_pages([0, 1], [2, -2]), r"dst\[1\] = -2 is out of range"),
        (lambda: cache.copy_pages([0, 1], [2]), r"src has shape \(2,\) but dst has shape \(1,\)"),
        (lambda: cache.copy_pages([[0]], [[1]]), r"src must have 1 dimension"),
        (lambda: cache.copy_pages([1.7], [2]), r"src\[0\] must be an int, got 1\.7 \(a float"),
        (lambda: cache.copy_pages([3, 4], [5, 15]), r"copy 4 -> 15 crosses data-parallel replicas"),
        (lambda: cache.zero_pages([1, 99]), r"pages\[1\] = 99 is out of range"),
        (lambda: cache.zero_pages([-3]), r"pages\[0\] = -3"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
        assert_unchanged(cache, before)
    model.check_pool(cache)


# ---------------------------------------------------------------------------- gather_kv
def test_gather_kv_reads_only_the_pages_it_needs_and_checks_them():
    rng = np.random.default_rng(3)
    _, _, meta = setup("heads")
    model = PoolModel(meta)
    cache = new_cache("heads")
    row = [17, 2, -1, -1]
    md = PagedAttentionMetadata.for_prefill(row[:2], 6, cache_metadata=meta)
    keys = random_tokens(rng, (LAYERS, 6, 8, HEAD_DIM))
    values = random_tokens(rng, keys.shape)
    cache, _ = cache.write(keys, values, md)
    for t in range(6):
        model.put(keys, values, t, row[t // 4] * 4 + t % 4, seq="a", pos=t)
    model.check_gather(cache, 1, "a", row)  # -1 entries past the length are never read
    model.check_gather(cache[0], 0, "a", row[:2])  # a view works too
    k, v = gather_kv(cache, 0, row, 0)
    assert k.shape == v.shape == (0, 8, HEAD_DIM)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"page_table_row\[1\] = -1 is unassigned but is needed for length=6"):
        gather_kv(cache, 0, [17, -1, 3], 6)
    with pytest.raises(ValueError, match=r"page_table_row\[0\] = 24 is out of range \(valid: -1\.\.23; "
                                         r"page ids of a pool of 24 pages, -1 unassigned\)"):
        gather_kv(cache, 0, [24], 2)
    with pytest.raises(ValueError, match=r"length=9 needs 3 pages but page_table_row has 2"):
        gather_kv(cache, 0, [17, 2], 9)
    with pytest.raises(ValueError, match=r"at most 16 tokens"):
        gather_kv(cache, 0, [0, 1, 2, 3, 4], 17)
    with pytest.raises(ValueError, match=r"page_table_row must have 1 dimension"):
        gather_kv(cache, 0, [[17, 2]], 6)
    with pytest.raises(ValueError, match=r"length must be a non-negative int"):
        gather_kv(cache, 0, row, -1)
    assert_unchanged(cache, before)


def test_public_names():
    for name in ("PagedAttentionCache", "PagedAttentionCacheView", "PagedAttentionCacheMetaData",
                 "PagedAttentionMetadata", "gather_kv"):  # fmt: skip
        assert getattr(easykv, name).__name__ == name
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new_cache("heads")  # a clean layout warns about nothing
