"""Size a cache from memory, allocate it sharded over 8 devices, write a prefill chunk and a
decode step, and read one sequence back.

    python examples/init_and_write.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # 8 simulated devices when run on a CPU

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import easykv  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402
from easykv.step.metadata import PAD_PAGE  # noqa: E402


def main() -> None:
    mesh = create_mesh({"dp": 1, "tp": 8})
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp"))
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh=mesh, partition_manager=pm, batch_size=4, num_hidden_layers=2, max_sequences=256,
        page_size=16, num_kv_heads=8, kv_head_dim_size=64, hbm_utilization=0.9, dtype=jnp.bfloat16,
        memory_bytes_per_device=4 * 2**20,
    )  # fmt: skip
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm)
    print(f"{meta.num_pages_per_layer} pages per layer, pages sharded as {cache[0].key_pages.sharding.spec}")

    rng = np.random.default_rng(0)
    pages = [7, 3, 11]  # the physical pages of our sequence (a page manager would choose them)
    prompt = jnp.asarray(rng.normal(size=(2, 40, 8, 64)), jnp.bfloat16)  # (layers, tokens, heads, dim)
    step = easykv.PagedAttentionMetadata.for_prefill(pages, 40, cache_metadata=meta)
    cache, dropped = cache.write(prompt, prompt * 2, step)

    new = jnp.asarray(rng.normal(size=(2, 1, 8, 64)), jnp.bfloat16)
    table = np.full((1, meta.num_pages_per_sequence), PAD_PAGE, np.int32)
    table[0, :3] = pages
    step = easykv.PagedAttentionMetadata.for_decode(table, [40], cache_metadata=meta)
    cache, dropped = cache.write(new, new * 2, step)

    keys, values = easykv.gather_kv(cache, 1, np.asarray(pages), 41)
    assert np.array_equal(np.asarray(keys[:40]), np.asarray(prompt[1]))
    assert np.array_equal(np.asarray(values[40]), np.asarray(new[1, 0] * 2))
    print(f"read back {keys.shape[0]} tokens of layer 1 exactly; dropped tokens: {int(dropped)}")


if __name__ == "__main__":
    main()
