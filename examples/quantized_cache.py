"""An int8 cache: twice the pages of bf16 in the same memory, written and read like any other;
then keys with outlier channels (as real keys have), where the rotated quantizers hold.

    python examples/quantized_cache.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import easykv  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402


def main() -> None:
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    args = dict(batch_size=8, num_hidden_layers=2, max_sequences=512, page_size=16, num_kv_heads=8,
                kv_head_dim_size=128, hbm_utilization=0.9, dtype=jnp.bfloat16, partition_manager=pm,
                memory_bytes_per_device=8 * 2**20)  # fmt: skip
    plain = easykv.PagedAttentionCacheMetaData.create(mesh=mesh, **args)
    meta = easykv.PagedAttentionCacheMetaData.create(mesh=mesh, quantizer="int8", **args)
    print(f"same memory: bf16 {plain.num_pages_per_layer} pages, int8 {meta.num_pages_per_layer} pages "
          f"({meta.num_pages_per_layer / plain.num_pages_per_layer:.2f}x)")  # fmt: skip
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm, quantizer="int8")
    print(f"layer 0 keys: values {cache[0].key_pages.values.shape} {cache[0].key_pages.values.dtype}, "
          f"scales {cache[0].key_pages.scales.shape}")  # fmt: skip

    rng = np.random.default_rng(0)
    keys = jnp.asarray(rng.normal(size=(2, 100, 8, 128)), jnp.bfloat16)
    step = easykv.PagedAttentionMetadata.for_prefill([4, 9, 2, 30, 7, 11, 12], 100, cache_metadata=meta)
    cache, _ = cache.write(keys, keys, step)
    back, _ = easykv.gather_kv(cache, 0, np.array([4, 9, 2, 30, 7, 11, 12]), 100)
    a, b = np.asarray(back, np.float32), np.asarray(keys[0], np.float32)
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert err < 1e-2, err
    print(f"100 tokens written and read back with relative error {err:.4f}")

    # Real keys carry a few channels tens of times larger than the rest: 4 of 128 here, 50x.
    outliers = rng.normal(size=(1, 100, 8, 128))
    outliers[..., [3, 40, 77, 101]] *= 50
    outliers = jnp.asarray(outliers, jnp.bfloat16)
    ordinary = np.setdiff1d(np.arange(128), [3, 40, 77, 101])
    exact = np.asarray(outliers[0], np.float32)[..., ordinary]
    errors = {}
    for name in ("int8", "int8-rot", "int4", "int4-rot"):
        m = easykv.PagedAttentionCacheMetaData.create(mesh=mesh, quantizer=name, **{**args, "num_hidden_layers": 1})
        c = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, m, pm, quantizer=name)
        c, _ = c.write(outliers, outliers, easykv.PagedAttentionMetadata.for_prefill([0, 1, 2, 3, 4, 5, 6], 100,
                                                                                    cache_metadata=m))
        back, _ = easykv.gather_kv(c, 0, np.arange(7), 100)
        got = np.asarray(back, np.float32)[..., ordinary]
        errors[name] = np.linalg.norm(got - exact) / np.linalg.norm(exact)
        print(f"{name:9s} error on the ordinary channels: {errors[name]:.3f}")
    assert errors["int8-rot"] < errors["int8"] / 3 and errors["int4-rot"] < errors["int4"] / 3, errors


if __name__ == "__main__":
    main()
