"""The demo model's paged steps take its parameters replicated over the cache's mesh, put there
once: parameters left on one device were copied to every device of the mesh on every step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import easykv
from easykv.demo import model as model_module
from easykv.demo.model import CompiledModel, DemoConfig, DemoModel
from easykv.sharding import PartitionAxis, PartitionManager


def cache_on(mesh, cfg: DemoConfig):
    pm = PartitionManager(PartitionAxis())
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 2, cfg.layers, 32, 8, cfg.kv_heads, cfg.head_dim, 0.5,
                                                     jnp.float32, partition_manager=pm, num_pages_per_layer=16)
    return easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_paged_steps_take_the_parameters_replicated_over_the_cache_mesh_once(tp8, dp2tp4, monkeypatch, scan):
    """Each step's parameters (and a scanned model's stacked blocks) are laid out over every
    device of the cache's mesh, the same arrays step after step, put again only for another
    mesh or new parameters; the dense reference keeps them where they were. Fails on a model
    that hands the jitted step its parameters on one device."""
    cfg = DemoConfig(layers=2, scan=scan)
    model = CompiledModel(DemoModel(cfg))
    seen: list[tuple] = []

    def record(*args, **kwargs):
        seen.append(args)
        return None, args[-3]  # the cache, unchanged: nothing runs

    monkeypatch.setattr(model_module, "_scanned_jit" if scan else "_paged_jit", record)
    tokens = np.zeros(4, np.int32)
    first = cache_on(tp8, cfg)
    for cache in (first, first, cache_on(dp2tp4, cfg), first):
        model.paged_step(cache, tokens, None)
    weights = [jax.tree.leaves((args[1], args[3] if scan else None)) for args in seen]
    for leaves, mesh in zip(weights, (tp8, tp8, dp2tp4, tp8)):
        for leaf in leaves:
            assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh
            assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 8
    assert all(a is b for a, b in zip(weights[0], weights[1]))  # put once, not per step
    assert all(a is b for a, b in zip(weights[0], weights[3]))  # kept while another mesh was served
    model.params = jax.tree.map(lambda a: a + 1, model.params)  # new parameters: put again
    model.paged_step(first, tokens, None)
    assert jax.tree.leaves(seen[-1][1])[0] is not weights[0][0]
    assert all(len(leaf.sharding.device_set) == 1 for leaf in jax.tree.leaves(model.params))
