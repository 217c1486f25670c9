"""Long prompts that outgrow the device pool: the host-memory tier turns their misses into hits.

    python examples/long_prompts.py

Six long documents (128 tokens each) are each asked three questions, one round after the other,
through the demo model on 8 simulated devices. The device pool holds 32 pages of 8 tokens: less
than two documents, so by the time a document is asked again its pages were evicted. Run twice:
without a host tier every question prefills its document again; with one
(`host_memory_bytes` in the metadata, an `easykv.HostTier` holding the host pages) the evicted
pages waited in host memory and come back with the question. Both runs generate exactly what a
dense per-request cache does; the tiered one computes far fewer prefill tokens.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import easykv  # noqa: E402
from easykv.demo.engine import Engine, Request, reference_generate  # noqa: E402
from easykv.demo.model import CompiledModel, DemoConfig, DemoModel  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402

DOCS, DOC_TOKENS, MAX_LEN, NEW = 6, 128, 160, 4
rng = np.random.default_rng(0)
DOCUMENTS = [rng.integers(32, 127, DOC_TOKENS).tolist() for _ in range(DOCS)]


def requests() -> list[Request]:
    out = []
    for round_ in range(3):
        for d, doc in enumerate(DOCUMENTS):
            out.append(Request(rid=len(out), prompt=doc + list(f"\nQ{round_}: part {d}?\nA:".encode()),
                               max_new_tokens=NEW))
    return out


def serve(model: CompiledModel, host_memory: int | None):
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    cfg = model.cfg
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 1, cfg.layers, MAX_LEN, 8, cfg.kv_heads, cfg.head_dim, 0.9, jnp.float32, partition_manager=pm,
        num_pages_per_layer=32, host_memory_bytes=host_memory)
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    manager = easykv.PageManager(meta)
    tier = easykv.HostTier(cache) if meta.has_host_tier else None
    engine = Engine(model, cache, manager, token_budget=64, max_seqs=1, prefill_chunk=64, host=tier)
    reqs = requests()
    engine.run(reqs)
    for r in reqs:
        assert r.output == reference_generate(model, r, max_len=MAX_LEN, dtype=jnp.float32), r.rid
    return reqs, manager.metrics


def main() -> None:
    model = CompiledModel(DemoModel(DemoConfig(layers=2)))
    plain, plain_metrics = serve(model, None)
    tiered, metrics = serve(model, 8 << 20)  # 8 MiB of host memory: 256 host pages, every document
    computed = [sum(len(r.prompt) - r.cached for r in reqs) for reqs in (plain, tiered)]
    host = metrics.host
    print(f"host tier: {metrics.host.total_pages} pages; {host.offloaded_pages} pages offloaded, "
          f"{host.onloaded_pages} brought back")
    print(f"prefill tokens computed: {computed[0]} without the tier, {computed[1]} with it "
          f"({computed[0] / computed[1]:.2f}x fewer)")
    print(f"prefix hits: device {plain_metrics.prefix_hits} without the tier; with it {metrics.prefix_hits} "
          f"({host.host_hits} from the host tier, {host.host_hit_tokens} tokens)")
    assert [r.output for r in plain] == [r.output for r in tiered]
    assert host.host_hits == 2 * DOCS and computed[1] * 2 < computed[0]


if __name__ == "__main__":
    main()
