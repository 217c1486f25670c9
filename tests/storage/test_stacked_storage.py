"""Stacked per-group storage: every layer of a group in one array per K and V, ``(layers, heads,
pages, page_size, head_dim)``. Views index the stack (writes and attention never slice a layer
out), stale views are refused before anything changes, a model may run its layers under
``lax.scan`` (compiled once, equal to the unrolled model), and ``paged_attention(..., layer=)``
reads a stack as the dense reference reads the layer's slice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv import PagedAttentionCache, PagedAttentionCacheMetaData, PagedAttentionMetadata
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh
from tests.support.pools import HEAD_DIM, PAGE_SIZE, PAGES, assert_unchanged, new_cache, random_tokens, setup, snapshot
from tests.support.tiers import SLOW


def test_stale_view_is_refused_before_anything_changes():
    rng = np.random.default_rng(0)
    _, _, meta = setup("dp")
    cache = new_cache("dp")
    v0, v1 = cache.views[0], cache.views[1]  # both taken before any write
    toks = random_tokens(rng, (2, 8, HEAD_DIM))
    v0.write_tokens(toks, toks, [5, 9])  # goes through to the cache
    assert np.array_equal(np.asarray(cache[0].key_pages[:, 1, 1]).view(np.uint16), toks[0].view(np.uint16))
    before = snapshot(cache)
    # v1 still names the arrays from before v0's write: writing it would undo that write, and
    # its arrays were donated to that write, so it cannot be put back either.
    for call, message in ((lambda: v1.write_tokens(toks, toks, [6, 7]), "taken from other page arrays than this "
                           "cache holds now"), (lambda: cache.views.__setitem__(1, v1), "given to a later write")):
        with pytest.raises(ValueError, match=message):
            call()
        assert_unchanged(cache, before)
    fresh = cache.views[1]
    fresh.write_tokens(toks, toks, [6, 7])
    cache.views[1] = fresh  # accepted: it is the cache's own arrays
    assert np.array_equal(np.asarray(cache[1].key_pages[:, 1, 2]).view(np.uint16), toks[0].view(np.uint16))
    assert np.array_equal(np.asarray(cache[0].key_pages[:, 1, 1]).view(np.uint16), toks[0].view(np.uint16))
    # Views are made on access; the list refuses to grow or shrink.
    assert isinstance(cache.views, list) and len(cache.views) == 2 and [v.layer for v in cache.views] == [0, 1]
    with pytest.raises(ValueError, match=r"exactly one view per layer"):
        cache.views.append(fresh)
    with pytest.raises(ValueError, match=r"layer must be an int, got 2 \(valid: -2\.\.1"):
        cache[2]


def test_view_from_jax_goes_back_with_update_or_as_a_copy_of_its_layer():
    rng = np.random.default_rng(1)
    cache = new_cache("heads")
    toks = random_tokens(rng, (1, 8, HEAD_DIM))
    write = jax.jit(lambda v, slot: v.write_tokens(toks, toks, slot))
    out = write(cache.views[1], jnp.array([3], jnp.int32))
    cache.update(out)  # takes the view's arrays: no copy
    assert np.array_equal(np.asarray(cache[1].key_pages[:, 0, 3]).view(np.uint16), toks[0].view(np.uint16))
    # cache.views[i] = view copies the view's own layer only: layer 1 written after the view was
    # computed keeps that write (taking the view's whole group would undo it).
    out = write(cache.views[0], jnp.array([5], jnp.int32))  # jit returns new arrays
    later = cache.views[1]
    later.write_tokens(toks * 2, toks * 2, [7])
    before = snapshot(cache)
    cache.views[0] = out
    after = snapshot(cache)
    assert np.array_equal(after[0][0][:, 1, 1].view(np.uint16), toks[0].view(np.uint16))
    assert np.array_equal(after[1][0], before[1][0]) and np.array_equal(after[1][1], before[1][1])
    assert np.array_equal(after[1][0][:, 1, 3].view(np.uint16), (toks * 2)[0].view(np.uint16))
    other = new_cache("dp")
    with pytest.raises(ValueError, match=r"metadata or layout differs"):
        other.update(out)


@pytest.mark.parametrize("layout", ["heads", "dp"])
def test_attention_on_a_stack_matches_the_reference_on_the_layer(layout):
    rng = np.random.default_rng(2)
    _, _, meta = setup(layout)
    cache = new_cache(layout)
    slots = rng.permutation(PAGES * PAGE_SIZE).astype(np.int32)
    keys = random_tokens(rng, (2, slots.size, 8, HEAD_DIM))
    cache, _ = cache.write(keys, random_tokens(rng, keys.shape), PagedAttentionMetadata(slot_mapping=slots))
    half = PAGES // 2  # each dp replica's slice
    table = np.array([rng.permutation(half)[:4], half + rng.permutation(half)[:4]], np.int32)
    md = PagedAttentionMetadata.for_decode(table, np.array([13, 6]), cache_metadata=meta)
    q = jnp.asarray(rng.standard_normal((2, 16, HEAD_DIM)), jnp.bfloat16)
    for layer in (0, 1):
        got = easykv.paged_attention(q, cache.key_pages[0], cache.value_pages[0], md, None, layer,
                                     layout=cache.layout, dtype=meta.dtype)
        want = easykv.paged_attention_reference(q, np.asarray(cache[layer].key_pages),
                                                np.asarray(cache[layer].value_pages), md, dtype=meta.dtype)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)
        via_view = easykv.view_attention(q, cache[layer], md)
        assert np.array_equal(np.asarray(via_view), np.asarray(got))
    k, v = cache.key_pages[0], cache.value_pages[0]
    for bad, match in ((2, r"layer must be .*got 2.*hold 2 layers"), (1.0, r"layer must be .*got 1\.0"),
                       (jnp.zeros(2, jnp.int32), r"layer must be an integer scalar")):
        with pytest.raises(ValueError, match=match):
            easykv.paged_attention(q, k, v, md, None, bad, dtype=meta.dtype)
    with pytest.raises(ValueError, match=r"with layer= the key_pages are a stack"):
        easykv.paged_attention(q, cache[0].key_pages, cache[0].value_pages, md, None, 0, dtype=meta.dtype)


def _scan_model(layers: int):
    mesh = create_mesh({"tp": 4}, devices=jax.devices()[:4])
    pm = PartitionManager(PartitionAxis())
    meta = PagedAttentionCacheMetaData.create(mesh, 2, layers, 16, 4, 4, 8, 0.9, jnp.float32, partition_manager=pm,
                                              num_pages_per_layer=8)
    w = jnp.asarray(np.random.default_rng(3).standard_normal((layers, 8, 8)) * 0.3, jnp.float32)
    return mesh, pm, meta, w


TRACED = []


def _layer(view, w, h, md):
    TRACED.append(1)  # one per layer traced: a scan traces its body once
    k = jnp.tanh(h @ w)[:, None, :].repeat(4, axis=1)
    view = view.write_mixed_to_cache(k, -k, md)
    out = easykv.view_attention(jnp.repeat(h[:, None, :], 8, axis=1), view, md)
    return view, h + out.mean(axis=1)


@SLOW
def test_scanned_32_layer_model_compiles_once_and_matches_unrolled():
    layers = 32
    mesh, pm, meta, w = _scan_model(layers)

    @jax.jit
    def scanned(cache, h, md):
        def body(carry, xs):
            view, h = carry
            i, wi = xs
            view, h = _layer(view.at_layer(i), wi, h, md)
            return (view, h), None

        (view, h), _ = jax.lax.scan(body, (cache.group_view(0), h), (jnp.arange(layers), w))
        cache.update(view)
        return cache, h

    @jax.jit
    def unrolled(cache, h, md):
        for i in range(layers):
            view, h = _layer(cache.views[i], w[i], h, md)
            cache.views[i] = view
        return cache, h

    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    h0 = np.random.default_rng(4).standard_normal((3, 8)).astype(np.float32)
    results, traced = {}, {}
    for name, fn in (("scan", scanned), ("unrolled", unrolled)):
        cache = PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
        h = h0
        TRACED.clear()
        for step in range(2):  # two chunks of 3 tokens: the second step runs the same compiled program
            md = PagedAttentionMetadata.for_mixed([[0, 1, -1, -1]], [step * 3], [3], cache_metadata=meta,
                                                  pad_tokens_to=3)
            cache, h = fn(cache, jax.device_put(h, replicated), md)
        traced[name] = len(TRACED)
        results[name] = (np.asarray(h), np.asarray(cache.key_pages[0]))
    assert scanned._cache_size() == 1 and traced == {"scan": 1, "unrolled": layers}
    np.testing.assert_allclose(results["scan"][0], results["unrolled"][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results["scan"][1], results["unrolled"][1], rtol=1e-5, atol=1e-5)
    assert np.any(results["scan"][1][layers - 1])  # the last layer was written too
