"""An EasyDeL 0.1 user program, written from EasyDeL's PagedAttentionCache documentation
(../shared/reference/easydel-PagedAttentionCache.txt), run on easykv with only its imports
changed, and checked value by value against a plain numpy model of the pages.

What the program relies on, as the reference states it: the metadata built from its nine
fields, ``init_cache(mesh, dtype, metadata, partition_manager)`` deciding the dtype, views in
a list (``views: List[PagedAttentionCacheView]``), ``write_prefill_to_cache`` /
``write_decodes_to_cache`` that "return self after updating the pages" (inside a jitted
model step and outside), ``PagedAttentionMetadata`` built from its five fields with absent
modes as shape-() arrays, and ``to_dict`` / ``from_dict`` / ``to_json`` / ``from_json`` /
``replace`` / ``init_empty`` on the cache, the view and the metadata.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# EasyDeL 0.1:
#   from easydel.layers.caching.paged_attention.paged_attention_cache import (
#       PagedAttentionCache, PagedAttentionCacheMetaData, PagedAttentionCacheView, PagedAttentionMetadata)
#   from eformer.escale import PartitionAxis, PartitionManager
from easykv import PagedAttentionCache, PagedAttentionCacheMetaData, PagedAttentionCacheView, PagedAttentionMetadata
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh

LAYERS, HEADS, DIM, PAGE, PAGES = 2, 8, 16, 4, 32


class NumpyPages:
    """The pages as plain numpy: token t of a sequence lives in page table[t // PAGE] at t % PAGE."""

    def __init__(self):
        self.k = np.zeros((LAYERS, HEADS, PAGES, PAGE, DIM), np.float32)
        self.v = np.zeros_like(self.k)

    def put(self, layer, table, position, k, v):
        page, offset = table[position // PAGE], position % PAGE
        self.k[layer, :, page, offset], self.v[layer, :, page, offset] = k, v

    def check(self, cache):
        for layer, view in enumerate(cache.views):
            np.testing.assert_array_equal(np.asarray(view.key_pages), self.k[layer])
            np.testing.assert_array_equal(np.asarray(view.value_pages), self.v[layer])


def absent():
    return jnp.zeros((), jnp.int32)


@pytest.mark.parametrize("mesh_axes", [{"tp": 8}, {"dp": 1, "tp": 8}], ids=["tp8", "dp1-tp8"])
def test_an_easydel_0_1_program_runs_unchanged(mesh_axes):
    rng = np.random.default_rng(0)
    model = NumpyPages()
    mesh = create_mesh(mesh_axes)
    partition_manager = PartitionManager(PartitionAxis(kv_head_axis="tp"))

    # ---- the program -------------------------------------------------------------------------
    metadata = PagedAttentionCacheMetaData(
        batch_size=4, num_hidden_layers=LAYERS, num_pages_per_layer=PAGES, num_pages_per_sequence=4,
        max_sequences=16, page_size=PAGE, num_kv_heads=HEADS, kv_head_dim_size=DIM, hbm_utilization=0.9)
    cache = PagedAttentionCache.init_cache(mesh=mesh, dtype=jnp.float32, metadata=metadata,
                                           partition_manager=partition_manager)
    assert isinstance(cache.views, list) and len(cache.views) == LAYERS

    @jax.jit
    def prefill_step(cache, keys, values, runtime):
        for i, view in enumerate(cache.views):
            view.write_prefill_to_cache(keys[i], values[i], runtime)  # updates the view: result unused
        return cache

    @jax.jit
    def decode_step(cache, keys, values, runtime):
        for i in range(len(cache.views)):
            cache.views[i] = cache.views[i].write_decodes_to_cache(keys[i], values[i], runtime)
        return cache

    tables = {0: [3, 7, 1, -1], 1: [12, 5, -1, -1], 2: [30, 0, 21, 25]}
    lengths = {0: 6, 1: 5, 2: 9}
    for seq, length in lengths.items():  # one prefill per sequence, padded to 12 tokens
        k = rng.normal(size=(LAYERS, 12, HEADS, DIM)).astype(np.float32)
        v = rng.normal(size=(LAYERS, 12, HEADS, DIM)).astype(np.float32)
        runtime = PagedAttentionMetadata(
            prefill_length=jnp.asarray(length), prefill_position=jnp.arange(12),
            prefill_page_table=jnp.asarray(tables[seq]), decodes_position=absent(), decodes_page_table=absent())
        cache = prefill_step(cache, k, v, runtime)
        for layer in range(LAYERS):
            for t in range(length):  # the padding tokens are never written
                model.put(layer, tables[seq], t, k[layer, t], v[layer, t])
    model.check(cache)

    for step in range(4):  # decodes crossing page boundaries; row 3 is an empty batch slot
        positions = np.array([lengths[0] + step, lengths[1] + step, lengths[2] + step, -1])
        table = np.array([tables[0], tables[1], tables[2], [-1] * 4])
        table[1, 2] = 17  # sequence 1 reaches its third page at position 8
        tables[1] = table[1].tolist()
        k = rng.normal(size=(LAYERS, 4, HEADS, DIM)).astype(np.float32)
        v = rng.normal(size=(LAYERS, 4, HEADS, DIM)).astype(np.float32)
        runtime = PagedAttentionMetadata(prefill_length=absent(), prefill_position=absent(),
                                         prefill_page_table=absent(), decodes_position=jnp.asarray(positions),
                                         decodes_page_table=jnp.asarray(table))
        assert runtime.is_decode_mode() and not runtime.is_prefill_mode()
        if step % 2:
            cache = decode_step(cache, k, v, runtime)
        else:  # outside jit the views are updated in place just the same
            for i, view in enumerate(cache.views):
                assert view.write_decodes_to_cache(k[i], v[i], runtime) is view
        for layer in range(LAYERS):
            for row in range(3):
                model.put(layer, table[row], positions[row], k[layer, row], v[layer, row])
        model.check(cache)

    # dict / JSON forms, replace, init_empty
    restored = PagedAttentionCache.from_json(cache.to_json())
    model.check(restored)
    view = PagedAttentionCacheView.from_dict(cache.views[1].to_dict())
    np.testing.assert_array_equal(np.asarray(view.key_pages), model.k[1])
    assert PagedAttentionCacheMetaData.from_json(metadata.to_json()) == metadata
    back = PagedAttentionMetadata.from_json(runtime.to_json())
    np.testing.assert_array_equal(back.decodes_page_table, table)
    assert back.decodes_position.dtype == np.asarray(runtime.decodes_position).dtype
    moved = runtime.replace(decodes_position=jnp.asarray(positions + 1))
    assert moved.decodes_position.tolist() == (positions + 1).tolist()
    assert PagedAttentionCache.init_empty() is None
    assert PagedAttentionMetadata.init_empty().prefill_page_table.shape == ()
    with pytest.raises(ValueError, match=r"views\[0\] must be layer 0 of this cache, but the view's layout differs"):
        cache.views[0] = restored.views[0]  # rebuilt on one device: another layout
    on_mesh = PagedAttentionCache.from_json(cache.to_json(), mesh=mesh, partition_manager=partition_manager)
    cache.views[0] = on_mesh.views[0].replace()  # a list with item assignment, as the reference says
    model.check(cache)


def test_the_dtype_given_to_init_cache_governs_and_the_head_layout_follows_the_mesh():
    mesh = create_mesh({"tp": 8})
    metadata = PagedAttentionCacheMetaData(
        batch_size=2, num_hidden_layers=1, num_pages_per_layer=8, num_pages_per_sequence=4, max_sequences=16,
        page_size=PAGE, num_kv_heads=HEADS, kv_head_dim_size=DIM, hbm_utilization=0.9)
    assert metadata.dtype is None and metadata.kv_head_shards is None
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        cache = PagedAttentionCache.init_cache(mesh, dtype, metadata, PartitionManager(PartitionAxis()))
        assert cache.metadata.dtype == np.dtype(dtype)
        assert (cache.metadata.kv_head_mesh_axes, cache.metadata.kv_head_shards) == (("tp",), 8)
        assert cache.views[0].key_pages.addressable_shards[0].data.shape[0] == 1  # one head per device
    fixed = metadata.replace(dtype=jnp.float16)
    with pytest.raises(ValueError, match="dtype float32 differs from metadata.dtype float16"):
        PagedAttentionCache.init_cache(mesh, jnp.float32, fixed, PartitionManager(PartitionAxis()))
    sized = PagedAttentionCacheMetaData.create(create_mesh({"dp": 1, "tp": 8}), 2, 1, 16, PAGE, HEADS, DIM, 0.9,
                                               jnp.float32, num_pages_per_layer=8)
    # a size-1 mesh axis splits nothing: the same layout as a mesh without it
    cache = PagedAttentionCache.init_cache(mesh, jnp.float32, sized, PartitionManager(PartitionAxis()))
    assert cache.metadata == sized


def test_json_forms_refuse_what_they_cannot_hold_exactly():
    mesh = create_mesh({"tp": 8})
    metadata = PagedAttentionCacheMetaData(
        batch_size=2, num_hidden_layers=1, num_pages_per_layer=8, num_pages_per_sequence=4, max_sequences=16,
        page_size=PAGE, num_kv_heads=HEADS, kv_head_dim_size=DIM, hbm_utilization=0.9)
    cache = PagedAttentionCache.init_cache(mesh, jnp.bfloat16, metadata, PartitionManager(PartitionAxis()))
    data = cache.to_dict()
    assert data["views"][0]["key_pages"]["dtype"] in ("uint16", "bfloat16")  # the stored bits, not str(array)
    assert "..." not in json.dumps(data)
    bad = json.loads(json.dumps(data))
    bad["views"][0]["key_pages"]["shape"][1] = 9
    with pytest.raises(ValueError, match=r"do not hold a .* array of shape \(8, 9, 4, 16\)"):
        PagedAttentionCache.from_dict(bad)
    bad = json.loads(json.dumps(data))
    bad["views"][0]["layer_index"] = 3
    with pytest.raises(ValueError, match=r"layer_index must be a non-negative int, got 3"):
        PagedAttentionCache.from_dict(bad)
    with pytest.raises(ValueError, match=r"nests deeper"):
        PagedAttentionCache.from_json("[" * 100 + "]" * 100)
    with pytest.raises(ValueError, match=r"not a 'easykv.PagedAttentionCache'"):
        PagedAttentionCache.from_dict(data["views"][0])
    with pytest.raises(ValueError, match=r"ndarray"):
        PagedAttentionMetadata.from_dict({**PagedAttentionMetadata.init_empty().to_dict(), "num_seqs": [1, 2]})
