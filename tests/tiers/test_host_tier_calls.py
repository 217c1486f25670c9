"""The host tier's calls cost the work they have (issue 42): a call runs nothing on the device
for the kinds of work it lacks (no gather for absent offloads, no fresh staging array for absent
onloads), moves pages one way only, and reuses its staging arrays without ever mixing their
pages: any mix of offloads, copies, onloads and scrubs, split into calls of a few widths, leaves
the pool and the host pages exactly as a numpy model of the documented order does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv.sharding import PartitionAxis, PartitionManager
from easykv.tiers import host as host_module

PAGES = 24  # device and host pages per layer


def tiered(mesh):
    """A 24-page pool (2 layers, 8 kv heads, pages of 4 tokens, bf16) with 24 host pages, every
    element distinct and non-zero, on ``mesh`` (pages split over ``dp`` when it has two)."""
    dp = mesh.shape["dp"]
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp", page_axis="dp" if dp > 1 else None))
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 4, 2, 16, 4, 8, 8, 0.5, jnp.bfloat16, partition_manager=pm, num_pages_per_layer=PAGES,
    ).replace(host_pages_per_layer=PAGES)
    cache = numbered(easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm))
    return cache, easykv.HostTier(cache)


def numbered(cache):
    """``cache`` with every page element numbered (distinct within a leaf, non-zero), made on the devices."""

    def number(a, seed):
        return jax.jit(lambda: (jnp.arange(a.size).reshape(a.shape) % 60000 + 1 + seed).astype(a.dtype),
                       out_shardings=a.sharding)()

    return cache.replace(key_pages=tuple(number(a, 0) for a in cache.key_pages),
                         value_pages=tuple(number(a, 7) for a in cache.value_pages))


def leaves_of(cache) -> list[np.ndarray]:
    return [np.asarray(a).copy() for a in jax.tree.leaves((cache.key_pages[0], cache.value_pages[0]))]


class Spy:
    """Records, for every call of the host tier's program, each group's staging arrays going in
    (device buffer address and contents) and coming out."""

    def __init__(self, monkeypatch):
        self.calls: list[dict] = []
        real = host_module._move

        def spy(pools, off_ids, staging, on_ids, device_ids, **kwargs):
            record = dict(inputs=[_address(s) for s in staging], contents=[_contents(s) for s in staging])
            new_pools, staged = real(pools, off_ids, staging, on_ids, device_ids, **kwargs)
            record.update(outputs=[_address(s) for s in staged], results=[_contents(s) for s in staged])
            self.calls.append(record)
            return new_pools, staged

        monkeypatch.setattr(host_module, "_move", spy)


def _address(staged: list[jax.Array]) -> tuple[int, ...]:
    return tuple(shard.data.unsafe_buffer_pointer() for a in staged for shard in a.addressable_shards)


def _contents(staged: list[jax.Array]) -> list[np.ndarray]:
    # Read through a device copy: numpy's view of an array (cached on it) would keep XLA from
    # reusing its buffer when the program takes it.
    return [np.asarray(jnp.copy(a)) for a in staged]


def test_a_call_runs_nothing_for_the_work_it_lacks(tp8, monkeypatch):
    """A call without offloads hands its staging arrays back untouched (no gather of padding
    pages into them); a call without onloads takes the staging arrays an earlier call of its
    width left (no zeroed array made per call, nor a program to make it), also once an offload
    from them has landed. Fails on a program that gathers padded offload ids and stages zeroed
    blanks whatever the call holds."""
    cache, tier = tiered(tp8)
    spy = Spy(monkeypatch)
    empty = np.zeros(0, np.int32)
    def two(first: int) -> np.ndarray:
        return np.array([first, first + 1], np.int32)

    nothing = ((empty,) * 5,)
    cache = tier.apply(cache, nothing, scrubs=(two(3),))  # width 2: its first staging arrays
    cache = tier.apply(cache, nothing, scrubs=(two(14),))
    cache = tier.apply(cache, ((empty, empty, two(0), two(20), empty),))  # onload 2 pages
    cache = tier.apply(cache, ((two(5), two(10), empty, empty, empty),))  # offload 2 pages
    cache = tier.apply(cache, ((two(7), two(12), empty, empty, empty),))  # the first landed: reused
    tier.flush()
    first, second, onload, offload, again = spy.calls
    for call in (first, second, onload):  # nothing offloaded: handed back as they came
        for before, after in zip(call["contents"], call["results"]):
            np.testing.assert_array_equal(after, before)
    # Arrays put from numpy may borrow its memory on CPU (then XLA copies them once); from then on
    # the same buffers go round: in place through the program, kept, taken by the next call.
    assert second["inputs"] == first["outputs"] and second["outputs"] == second["inputs"]
    assert onload["inputs"] != second["outputs"]  # the onloaded pages: a new copy from the host
    assert offload["inputs"] == second["outputs"] and offload["outputs"] == offload["inputs"]  # one kept a width
    assert again["inputs"] == offload["outputs"]  # free once its pages landed in the host's
    assert not any(np.array_equal(a, b) for a, b in zip(offload["results"], again["results"]))


class Model:
    """The pool and host pages in numpy, applied in the documented order: host scrubs, offloads
    read, copies, onloads (reading the host pages as they were before this call's offloads
    land), scrubs, then the offloads land."""

    def __init__(self, cache):
        self.device = leaves_of(cache)
        self.host = [np.zeros_like(a) for a in self.device]

    def apply(self, off_src, off_dst, on_src, on_dst, host_scrubs, copy_src, copy_dst, scrubs):
        for d, h in zip(self.device, self.host):
            h[:, :, host_scrubs] = 0
            offloaded = d[:, :, off_src].copy()
            d[:, :, copy_dst] = d[:, :, copy_src].copy()
            d[:, :, on_dst] = h[:, :, on_src]
            d[:, :, scrubs] = 0
            h[:, :, off_dst] = offloaded


def draw(rng, replicas: int, most: int) -> dict[str, np.ndarray]:
    """One apply's random work: every pair within a replica's slice, each kind's destinations
    distinct, no onload from a host page this apply offloads into; any kind may be empty."""
    local = PAGES // replicas
    per = [rng.permutation(local) for _ in range(replicas)]
    host = [rng.permutation(local) for _ in range(replicas)]

    def take(pool: list[np.ndarray], n: int, r: int) -> np.ndarray:
        ids, pool[r] = pool[r][:n], pool[r][n:]
        return ids + r * local

    work = {name: [] for name in ("off_src", "off_dst", "on_src", "on_dst", "host_scrubs", "copy_src",
                                  "copy_dst", "scrubs")}
    for r in range(replicas):
        n_off, n_on, n_copy, n_scrub = (int(rng.integers(0, most + 1)) * int(rng.random() < 0.6) for _ in range(4))
        work["off_src"].append(rng.permutation(local)[:n_off] + r * local)
        work["off_dst"].append(take(host, n_off, r))
        work["on_src"].append(take(host, n_on, r))
        work["on_dst"].append(rng.permutation(local)[:n_on] + r * local)
        work["host_scrubs"].append(rng.permutation(local)[: int(rng.integers(0, 3))] + r * local)
        work["copy_dst"].append(take(per, n_copy, r))
        work["copy_src"].append(rng.integers(0, local, n_copy) + r * local)
        work["scrubs"].append(rng.permutation(local)[:n_scrub] + r * local)
    return {name: np.concatenate(parts).astype(np.int32) for name, parts in work.items()}


@pytest.mark.parametrize("chunk", [4, 64], ids=["chunks-of-4", "chunks-of-64"])
@pytest.mark.parametrize("mesh", ["tp8", "dp2tp4"])
def test_any_mix_of_work_lands_exactly_where_the_model_says(mesh, chunk, request, monkeypatch):
    """Thirty applies of random offloads, copies, onloads and scrubs (split into calls of their
    own widths; with chunks of 4 pages, also into chunks), every staging array reused as soon as
    it is free: after each, the pool is bit for bit the model's; at the end every host page,
    onloaded back, is too."""
    monkeypatch.setattr(host_module, "TRANSFER_CHUNK", chunk)
    mesh = request.getfixturevalue(mesh)
    replicas = mesh.shape["dp"]
    cache, tier = tiered(mesh)
    model = Model(cache)
    rng = np.random.default_rng(5)
    for _ in range(30):
        w = draw(rng, replicas, most=PAGES // replicas // 2)
        transfers = ((w["off_src"], w["off_dst"], w["on_src"], w["on_dst"], w["host_scrubs"]),)
        cache = tier.apply(cache, transfers, copies=((w["copy_src"], w["copy_dst"]),), scrubs=(w["scrubs"],))
        model.apply(*w.values())
        for got, want in zip(leaves_of(cache), model.device):
            np.testing.assert_array_equal(got, want)
    empty = np.zeros(0, np.int32)
    every = np.arange(PAGES, dtype=np.int32)
    cache = tier.apply(cache, ((empty, empty, every, every, empty),))  # each host page onto its device page
    for got, want in zip(leaves_of(cache), model.host):
        np.testing.assert_array_equal(got, want)


def test_an_offload_of_many_chunks_goes_round_one_staging_array_on_cpu(tp8, monkeypatch):
    """On CPU devices (their buffers are host memory) an offload split into chunks lands each
    chunk when the next one needs its width: the chunks go through one staging array (each call
    takes the one the call before returned), not zeros put on the devices per chunk, and every
    page lands where it was sent. Fails on a tier that stages a fresh array for each chunk while
    the earlier ones are in flight."""
    monkeypatch.setattr(host_module, "TRANSFER_CHUNK", 4)
    cache, tier = tiered(tp8)
    spy = Spy(monkeypatch)
    empty = np.zeros(0, np.int32)
    src = np.arange(12, dtype=np.int32) * 2  # twelve pages: three calls of four
    dst = np.arange(12, dtype=np.int32) + 6
    before = leaves_of(cache)
    cache = tier.apply(cache, ((src, dst, empty, empty, empty),))
    first, second, third = spy.calls
    assert second["inputs"] == first["outputs"] and third["inputs"] == second["outputs"]
    back = np.arange(12, dtype=np.int32)
    cache = tier.apply(cache, ((empty, empty, dst, back, empty),))  # every offloaded page onto device pages 0..11
    for got, want in zip(leaves_of(cache), before):
        np.testing.assert_array_equal(got[:, :, back], want[:, :, src])


def test_elsewhere_an_offload_of_many_chunks_lands_only_at_flush(tp8, monkeypatch):
    """Where device buffers are not host memory (an accelerator, faked here), no chunk lands
    inside `apply`: landing there could wait for its copy to the host, and the step never waits
    for offloads. Each chunk stages its own array and every page lands at `flush`."""
    monkeypatch.setattr(host_module, "TRANSFER_CHUNK", 4)
    cache, tier = tiered(tp8)
    tier._groups[0].host_resident = False
    spy = Spy(monkeypatch)
    empty = np.zeros(0, np.int32)
    src = np.arange(12, dtype=np.int32) * 2
    dst = np.arange(12, dtype=np.int32) + 6
    before = leaves_of(cache)
    cache = tier.apply(cache, ((src, dst, empty, empty, empty),))
    first, second, third = spy.calls
    assert len({tuple(call["inputs"]) for call in (first, second, third)}) == 3
    assert not any(a.any() for shards in tier._groups[0].shards for a in shards.values())  # nothing landed yet
    back = np.arange(12, dtype=np.int32)
    cache = tier.apply(cache, ((empty, empty, dst, back, empty),))  # its flush lands them first
    for got, want in zip(leaves_of(cache), before):
        np.testing.assert_array_equal(got[:, :, back], want[:, :, src])
