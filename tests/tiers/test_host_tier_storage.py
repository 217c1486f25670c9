"""The host tier's pages on 8 simulated devices: evicted prefix pages come back from host memory
bit for bit (bf16 pages over tensor parallelism and over data-parallel slices, int8 pages with
their scales, a sliding + full grouped cache), swapped sequences return unchanged, a HostTier
refuses another cache, and the demo engine preempting to the host tier generates exactly what a
dense reference does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh
from easykv.storage.cache import gather_kv
from tests.support.tiers import SLOW

PS = 4


def setup(layout="tp8", quantizer=None, dtype=jnp.bfloat16, groups=None):
    dp = 2 if layout == "dp2tp4" else 1
    mesh = create_mesh({"dp": dp, "tp": 8 // dp})
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp", page_axis="dp" if dp > 1 else None))
    kw = dict(layer_groups=groups) if groups else dict(num_pages_per_layer=8 * dp)
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 4, 2, 16, PS, 8, 16, 0.5, dtype, partition_manager=pm, quantizer=quantizer, **kw)
    meta = meta.replace(host_pages_per_layer=16 * dp)
    cache = easykv.PagedAttentionCache.init_cache(mesh, dtype, meta, pm, quantizer=quantizer)
    return cache, easykv.HostTier(cache), easykv.PageManager(meta)


def kv_of(prompt_index, n, dtype):
    """The K/V a prompt writes (a function of the prompt only, so a re-prefill writes the same)."""
    rng = np.random.default_rng(prompt_index)
    k = rng.standard_normal((2, n, 8, 16)).astype(np.float32)
    return jnp.asarray(k, dtype), jnp.asarray(-k, dtype)


def read(cache, manager, seq, length):
    out = []
    for layer in range(2):
        g = cache.metadata.group_of(layer)[0]
        group = g if manager.num_groups > 1 else None
        first = manager.sequence(seq).first_kept[g]
        row = manager.page_table([seq], group=group)[0]
        row = np.where(row < 0, 0, row)  # pages a window released: read as page 0, never compared
        k, v = gather_kv(cache, layer, row, length)
        out.append((first, np.asarray(k.astype(jnp.float32)), np.asarray(v.astype(jnp.float32))))
    return out  # per layer: the first position held, then K and V of positions 0 .. length - 1


def writes(k, v):
    """A step (`Runner.run`'s) that writes ``k``, ``v`` where its plan says."""
    def step(cache, plan):
        cache, _ = cache.write(k, v, plan.metadata)
        return cache, None
    return step


def serve(cache, tier, manager, prompts, dtype, rounds=2, first=None):
    """Prefill every prompt ``rounds`` times (one at a time, released after); each prefix found
    (on the device or brought back from the host) must read exactly what was first written
    (``first``: what earlier calls read, by prompt index)."""
    first = {} if first is None else first
    runner = easykv.Runner(manager, cache, host=tier)
    for _ in range(rounds):
        for i, prompt in enumerate(prompts):
            [s] = manager.claim(1)
            done = manager.match_prefix(s, prompt)
            plan = runner.schedule([s], [len(prompt) - done])  # its work (the hit's onloads) applied at once
            if done:
                for (a, k, v), (a0, k0, v0) in zip(read(runner.cache, manager, s, done), first[i]):
                    lo = max(a, a0)  # positions both reads hold (a window keeps the last ones)
                    assert lo < done
                    np.testing.assert_array_equal(k[lo:done], k0[lo:done])
                    np.testing.assert_array_equal(v[lo:done], v0[lo:done])
            k, v = kv_of(i, len(prompt), dtype)
            runner.run(plan, writes(k[:, done:], v[:, done:]), token_ids=[prompt[done:]])
            manager.check_invariants()
            if i not in first:
                first[i] = read(runner.cache, manager, s, len(prompt) - 1)
            manager.release(s)
    return runner.cache


PROMPTS = [[100 * i + t for t in range(13)] for i in range(5)]  # 3 full pages + 1 token each


@pytest.mark.parametrize("layout,quantizer", [("tp8", None), ("dp2tp4", None), ("tp8", "int8")])
def test_prefix_pages_come_back_from_the_host_bit_for_bit(layout, quantizer):
    cache, tier, manager = setup(layout, quantizer)
    cache = serve(cache, tier, manager, PROMPTS, jnp.bfloat16)
    m = manager.metrics
    assert m.host.host_hits >= 3 and m.host.onloaded_pages >= 9 and m.host.offloaded_pages >= 9
    # 5 prompts x 3 full pages do not fit 8 device pages per replica: without the tier the second
    # round would have missed; every one of its prompts hit.
    assert m.prefix_hits == 5
    page_bytes = tier._groups[0].page_bytes  # one page of every layer: K, V (and scales), every head
    assert tier.bytes_onloaded == m.host.onloaded_pages * page_bytes
    assert tier.bytes_offloaded == m.host.offloaded_pages * page_bytes
    assert tier.host_bytes == cache.metadata.host_pages_per_layer * page_bytes  # each shard kept once


def test_a_sliding_and_full_cache_brings_back_the_pages_each_group_needs():
    groups = (easykv.LayerGroup((0,), "sliding", 8, num_pages=8), easykv.LayerGroup((1,), num_pages=8))
    cache, tier, manager = setup(groups=groups)
    serve(cache, tier, manager, PROMPTS, jnp.bfloat16)
    assert manager.metrics.host.host_hits >= 3


def _written(cache, tier, manager, n, seed):
    """A new sequence with ``n`` tokens written (K/V ``kv_of(seed, n)``, ids 100 * seed ...)."""
    runner = easykv.Runner(manager, cache, host=tier)
    [s] = manager.claim(1)
    k, v = kv_of(seed, n, jnp.bfloat16)
    runner.run(manager.schedule([s], [n]), writes(k, v), token_ids=[list(range(100 * seed, 100 * seed + n))])
    return runner.cache, s


def _swapped_sequence(cache, tier, manager):
    """A sequence of 10 written tokens, swapped out (its transfers pending)."""
    cache, s = _written(cache, tier, manager, 10, 9)
    manager.swap_out(s)
    return cache, s


def test_a_swapped_sequence_returns_unchanged():
    cache, tier, manager = setup()
    cache, s = _swapped_sequence(cache, tier, manager)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    k, v = kv_of(9, 10, jnp.bfloat16)
    cache, t = _written(cache, tier, manager, 16, 8)  # takes every device page and writes over them
    manager.release(t)
    manager.swap_in(s)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    for layer, (_, a, b) in enumerate(read(cache, manager, s, 10)):
        np.testing.assert_array_equal(a, np.asarray(k[layer].astype(jnp.float32)))
        np.testing.assert_array_equal(b, np.asarray(v[layer].astype(jnp.float32)))


def test_a_host_tier_refuses_another_cache_and_keeps_the_work_pending():
    cache, tier, manager = setup()
    other, other_tier, _ = setup(quantizer="int8")
    [s] = manager.claim(1)
    plan = manager.schedule([s], [9])
    assert plan.work.empty  # a fresh pool: nothing to apply first
    k, v = kv_of(1, 9, jnp.bfloat16)
    cache, _ = cache.write(k, v, plan.metadata)
    manager.commit(plan, [list(range(9))])
    manager.swap_out(s)
    with pytest.raises(ValueError, match="HostTier of another cache"):
        easykv.apply_pending(manager, cache, host=other_tier)
    with pytest.raises(ValueError, match="pass the cache's tier"):
        easykv.apply_pending(manager, cache)
    assert manager.clone().take_work().has_transfers and not any(a.is_deleted() for a in jax.tree.leaves(cache))
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    assert not manager.has_pending_work
    plain = easykv.PagedAttentionCache.init_cache(
        create_mesh({"dp": 1, "tp": 8}), jnp.bfloat16, cache.metadata.replace(host_pages_per_layer=None),
        PartitionManager(PartitionAxis(kv_head_axis="tp")))
    with pytest.raises(ValueError, match="no host-memory tier"):
        easykv.HostTier(plain)


@SLOW
def test_the_demo_engine_preempts_to_the_host_and_generates_what_a_dense_cache_does():
    from easykv.demo.engine import Engine, reference_generate
    from easykv.demo.model import CompiledModel, DemoConfig, DemoModel
    from easykv.demo.workload import make_requests

    cfg = DemoConfig(layers=2)
    model = CompiledModel(DemoModel(cfg))
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 4, cfg.layers, 256, 8, cfg.kv_heads, cfg.head_dim, 0.9, jnp.float32, partition_manager=pm,
        num_pages_per_layer=40).replace(host_pages_per_layer=128)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    manager = easykv.PageManager(meta)
    requests = make_requests(6, 24, seed=3)
    engine = Engine(model, cache, manager, token_budget=32, max_seqs=4, prefill_chunk=16,
                    host=easykv.HostTier(cache))
    engine.run(requests)
    assert engine.preemptions >= 2 and manager.metrics.host.swap_ins == engine.preemptions
    for r in requests:
        assert r.output == reference_generate(model, r, max_len=256, dtype=jnp.float32), r.rid


def test_checkpoints_leave_the_host_tier_out_and_say_so(tmp_path):
    from easykv.checkpoint.checkpointer import restore_cache, save_cache

    cache, tier, manager = setup()
    cache = serve(cache, tier, manager, PROMPTS, jnp.bfloat16, rounds=1)
    cache, s = _swapped_sequence(cache, tier, manager)
    with pytest.raises(ValueError, match=r"swapped out"):
        save_cache(tmp_path / "a", cache, manager)  # its pages would be lost
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    manager.swap_in(s)
    with pytest.raises(ValueError, match=r"host-tier transfers are pending"):
        save_cache(tmp_path / "a", cache, manager)  # its pages are not back yet
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    before = read(cache, manager, s, 10)
    cached = manager.metrics.host.cached_pages
    assert cached > 0
    with pytest.warns(UserWarning, match=f"its {cached} cached prefix pages are not saved"):
        save_cache(tmp_path / "b", cache, manager)
    from easykv.checkpoint.inspect import inspect_checkpoint

    assert ("host     a host-memory tier of 16 pages per layer; its pages are not saved"
            in inspect_checkpoint(tmp_path / "b"))
    restored, again = restore_cache(tmp_path / "b", mesh=create_mesh({"dp": 1, "tp": 8}),
                                    partition_manager=PartitionManager(PartitionAxis(kv_head_axis="tp")))
    assert again.has_host_tier and again.metrics.host.cached_pages == 0
    assert again.metrics.host.total_pages == manager.metrics.host.total_pages
    for (_, a, b), (_, c, d) in zip(read(restored, again, s, 10), before):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)


def test_sleep_and_wake_with_a_host_tier():
    cache, tier, manager = setup()
    seen = {}
    cache = serve(cache, tier, manager, PROMPTS, jnp.bfloat16, rounds=1, first=seen)
    cache, s = _swapped_sequence(cache, tier, manager)
    with pytest.raises(ValueError, match="device work is pending, with a host tier"):
        easykv.sleep(cache, manager)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    cache, manager = easykv.wake(easykv.sleep(cache, manager))  # the same placement: the tier still holds
    manager.swap_in(s)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    k, v = kv_of(9, 10, jnp.bfloat16)
    np.testing.assert_array_equal(read(cache, manager, s, 10)[0][1], np.asarray(k[0].astype(jnp.float32)))
    cache = serve(cache, tier, manager, PROMPTS[:2], jnp.bfloat16, rounds=1, first=seen)  # hits still right
    manager.swap_out(s)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    sleeping = easykv.sleep(cache, manager)
    other = create_mesh({"dp": 2, "tp": 4})
    with pytest.raises(ValueError, match="swapped out to the host tier"):
        easykv.wake(sleeping, mesh=other, partition_manager=PartitionManager(PartitionAxis(kv_head_axis="tp")))
    manager.swap_in(s)
    cache, manager = easykv.wake(sleeping)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    cached = manager.metrics.host.cached_pages
    assert cached
    moved, manager = easykv.wake(easykv.sleep(cache, manager), mesh=other,
                                 partition_manager=PartitionManager(PartitionAxis(kv_head_axis="tp")))
    # Another placement: the old tier's pages cannot serve it; the manager forgot them.
    assert manager.metrics.host.cached_pages == 0
    with pytest.raises(ValueError, match="HostTier of another cache"):
        easykv.apply_pending(manager, moved, host=tier)
    moved, _ = easykv.apply_pending(manager, moved, host=easykv.HostTier(moved))


def test_sequences_move_between_tiered_caches():
    cache, tier, manager = setup()
    cache, s = _written(cache, tier, manager, 10, 4)
    ids = list(range(400, 410))
    manager.swap_out(s)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    with pytest.raises(ValueError, match="swapped out to the host tier"):
        easykv.export_sequence(cache, manager, s, token_ids=ids)
    manager.swap_in(s)
    with pytest.raises(ValueError, match="pending copy-on-write copy, onload or scrub"):
        easykv.export_sequence(cache, manager, s, token_ids=ids)
    cache, _ = easykv.apply_pending(manager, cache, host=tier)
    exported = easykv.export_sequence(cache, manager, s, token_ids=ids)
    other, other_tier, other_manager = setup()
    before = other_manager.state_dict()
    with pytest.raises(ValueError, match="pass its HostTier"):
        easykv.import_sequence(other, other_manager, exported)
    assert other_manager.state_dict() == before and not any(a.is_deleted() for a in jax.tree.leaves(other))
    other, seq = easykv.import_sequence(other, other_manager, exported, host=other_tier)
    k, v = kv_of(4, 10, jnp.bfloat16)
    for layer, (_, a, b) in enumerate(read(other, other_manager, seq, 10)):
        np.testing.assert_array_equal(a, np.asarray(k[layer].astype(jnp.float32)))
        np.testing.assert_array_equal(b, np.asarray(v[layer].astype(jnp.float32)))
