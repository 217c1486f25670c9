"""Caches of several layer groups for the storage, checkpoint, transfer and sleep tests: a
sliding group of 4 kv heads, a full group of 8 heads whose values are narrower than its keys and
a latent group (``GROUPS``), the same groups each in a page format of its own
(``FORMAT_GROUPS``), the meshes they are placed on, engine runs that fill them, and reads of
what each group still holds."""

from __future__ import annotations

import io
import json
import warnings
import zipfile

import jax
import jax.numpy as jnp
import numpy as np

import easykv
from easykv import LayerGroup, PagedAttentionCache, PagedAttentionCacheMetaData, PageManager
from easykv.sharding import PartitionAxis, PartitionManager, ShardingAdjustedWarning, create_mesh

PS = 4
GROUPS = (LayerGroup((0, 2), "sliding", 6, num_kv_heads=4, key_head_dim=8, value_head_dim=8, num_pages=16),
          LayerGroup((1, 3), "full", num_kv_heads=8, key_head_dim=16, value_head_dim=8, num_pages=24),
          LayerGroup((4,), "full", num_kv_heads=1, key_head_dim=12, value_head_dim=8, latent=True, num_pages=24))
LAYERS = 5


def mesh_and_rule(layout):
    mesh = {"tp8": create_mesh({"dp": 1, "tp": 8}), "dp2tp4": create_mesh({"dp": 2, "tp": 4}),
            "tp2": create_mesh({"dp": 1, "tp": 2}, devices=np.array(jax.devices()[:2]))}[layout]
    return mesh, PartitionManager(PartitionAxis(kv_head_axis="tp", page_axis="dp" if layout == "dp2tp4" else None))


def filled(layout, dtype="float32"):
    """A grouped cache and its manager after two prompts, a fork and a few decode steps."""
    mesh, rule = mesh_and_rule(layout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        meta = PagedAttentionCacheMetaData.create(mesh, 4, LAYERS, 32, PS, 8, 16, 0.9, dtype, partition_manager=rule,
                                                  layer_groups=GROUPS)
        cache = PagedAttentionCache.init_cache(mesh, jnp.dtype(dtype), meta, rule)
    m = PageManager(cache.metadata, scrub_released=True)
    runner = easykv.Runner(m, cache)
    rng = np.random.default_rng(0)
    groups = [cache.metadata.groups[cache.metadata.group_of(i)[0]] for i in range(LAYERS)]

    def step(seqs, tokens):
        n = sum(map(len, tokens))
        ks = [rng.standard_normal((n, g.num_kv_heads, g.key_head_dim)).astype(dtype) for g in groups]
        vs = [rng.standard_normal((n, g.num_kv_heads, g.value_head_dim)).astype(dtype) if g.has_values else None
              for g in groups]
        plan = m.schedule(seqs, [len(t) for t in tokens])
        runner.run(plan, lambda cache, plan: cache.write(ks, vs, plan.metadata), token_ids=tokens)

    a, b = m.claim(2)
    step([a, b], [list(range(11)), list(range(50, 56))])
    m.fork(a)
    seqs = m.active_ids
    for t in range(3):
        step(seqs, [[t]] * len(seqs))
    return runner.cache, m


def read(cache, m, seq):
    """Per layer, the K (and V) of the positions the sequence's group still holds."""
    meta, out = cache.metadata, []
    for i in range(LAYERS):
        g, _ = meta.group_of(i)
        first = m.sequence(seq).first_kept[g]
        pages = np.asarray(m.pages(seq, group=g))
        k, v = easykv.gather_kv(cache, i, np.where(pages < 0, 0, pages), m.length(seq))
        out.append((np.asarray(k)[first:], None if v is None else np.asarray(v)[first:]))
    return out


def same(a, b):
    for (k1, v1), (k2, v2) in zip(a, b):
        assert k1.dtype == k2.dtype
        np.testing.assert_array_equal(k1, k2)
        assert (v1 is None) == (v2 is None)
        if v1 is not None:
            np.testing.assert_array_equal(v1, v2)


def with_header(blob, edit):
    """An export file's bytes with its JSON header changed by ``edit(header)`` (a crafted file)."""
    src = zipfile.ZipFile(io.BytesIO(blob))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "header.npy":
                header = json.loads(np.load(io.BytesIO(data)).tobytes())
                edit(header)
                buf = io.BytesIO()
                np.save(buf, np.frombuffer(json.dumps(header).encode(), np.uint8))
                data = buf.getvalue()
            z.writestr(info.filename, data)
    return out.getvalue()


# sliding int8 (4 heads, K 8 / V 8); full bfloat16 (8 heads, K 16 / V 8); latent fp8 (1 head of 12)
FORMAT_GROUPS = (LayerGroup((0, 2), "sliding", 6, num_kv_heads=4, key_head_dim=8, value_head_dim=8, num_pages=16,
                     quantization="int8"),
          LayerGroup((1, 3), "full", num_kv_heads=8, key_head_dim=16, value_head_dim=8, num_pages=24,
                     dtype="bfloat16"),
          LayerGroup((4,), "full", num_kv_heads=1, key_head_dim=12, value_head_dim=8, latent=True, num_pages=24,
                     quantization="fp8"))
FORMATS = ((np.dtype("float32"), "int8"), (np.dtype("bfloat16"), "none"), (np.dtype("float32"), "fp8"))


def create_formats(layout, groups=FORMAT_GROUPS, quantizer=None):
    mesh, rule = mesh_and_rule(layout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        meta = PagedAttentionCacheMetaData.create(mesh, 4, LAYERS, 32, PS, 8, 16, 0.9, "float32",
                                                  partition_manager=rule, layer_groups=groups, quantizer=quantizer)
        cache = PagedAttentionCache.init_cache(mesh, jnp.float32, meta, rule, quantizer=quantizer)
    return cache, PageManager(cache.metadata)


def rows_for(meta, rng, n):
    """Per layer (K, V) in its group's geometry and dtype (V None for the latent layer)."""
    out = []
    for i in range(LAYERS):
        g = meta.groups[meta.group_of(i)[0]]
        dt = meta.group_dtype(g)
        k = rng.standard_normal((n, g.num_kv_heads, g.key_head_dim)).astype(dt)
        v = rng.standard_normal((n, g.num_kv_heads, g.value_head_dim)).astype(dt) if g.has_values else None
        out.append((k, v))
    return out


def filled_formats(layout="tp8", n=7):
    cache, m = create_formats(layout)
    [s] = m.claim(1)
    plan = m.schedule([s], [n])
    toks = rows_for(cache.metadata, np.random.default_rng(5), n)
    cache, dropped = cache.write([k for k, _ in toks], [v for _, v in toks], plan.metadata)
    assert int(dropped) == 0
    m.commit(plan, [list(range(n))])
    return cache, m, s, toks
