"""A minimal continuous-batching loop: the PageManager schedules each step as a plan, the runner
applies it (the plan's device work, one jitted step that writes every layer's K/V and attends
through the page tables, then the commit of the tokens written).

    python examples/engine_loop.py

The "model" here is a stand-in (random projections of token embeddings) so the loop itself
stays in view; `easykv demo` runs the same loop with a real decoder.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

from functools import partial  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import easykv  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402

LAYERS, KV_HEADS, Q_HEADS, DIM = 2, 8, 16, 32


@partial(jax.jit, donate_argnums=0)
def step(cache, tokens, meta):
    """Stand-in model step: K/V/Q from token ids, write then attend, every layer in one jit."""
    outs = []
    for i in range(len(cache)):
        view = cache.views[i]  # layer i of the group's stacked pages; its write goes into the stack
        emb = jax.nn.one_hot(tokens % DIM, DIM, dtype=jnp.float32)  # (tokens, DIM)
        k = jnp.broadcast_to(emb[:, None, :], (tokens.shape[0], KV_HEADS, DIM)) * (view.layer_index + 1)
        q = jnp.broadcast_to(emb[:, None, :], (tokens.shape[0], Q_HEADS, DIM))
        view = view.write_mixed_to_cache(k, -k, meta)
        outs.append(easykv.view_attention(q, view, meta))
        cache.views[i] = view  # EasyDeL's models put the view back; the cache already holds its write
    return cache, jnp.stack(outs)


def main() -> None:
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 4, LAYERS, 128, 8, KV_HEADS, DIM, 0.9, jnp.float32, partition_manager=pm, num_pages_per_layer=64
    )
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    manager = easykv.PageManager(meta)
    runner = easykv.Runner(manager, cache)  # holds the cache from now on

    def model(tokens):  # the runner's step: (cache, plan) -> (cache, out)
        return lambda cache, plan: step(cache, jnp.asarray(tokens), plan.metadata)

    prompts = {0: list(range(1, 21)), 1: list(range(1, 21)) + [99, 98], 2: list(range(50, 61))}
    generated = {rid: [] for rid in prompts}
    seq = {}
    for rid, prompt in prompts.items():  # admit: claim a sequence, reuse cached prefix pages
        seq[rid] = manager.claim(1)[0]
        skipped = manager.match_prefix(seq[rid], prompt)
        pending = prompt[skipped:]
        plan = manager.schedule([seq[rid]], [len(pending)], pad_tokens_to=32, pad_seqs_to=4)
        tokens = np.zeros(32, np.int32)
        tokens[: len(pending)] = pending
        runner.run(plan, model(tokens), token_ids=[pending])
        print(f"request {rid}: prompt {len(prompt)} tokens, {skipped} from the prefix cache")
        generated[rid].append(prompt[-1] + 1)

    for _ in range(6):  # decode all three together, one token each per step
        ids = [seq[r] for r in prompts]
        plan = manager.schedule(ids, [1, 1, 1], pad_tokens_to=32, pad_seqs_to=4)
        tokens = np.zeros(32, np.int32)
        tokens[:3] = [generated[r][-1] for r in prompts]
        runner.run(plan, model(tokens), token_ids=[[generated[r][-1]] for r in prompts])
        for r in prompts:
            generated[r].append(generated[r][-1] + 1)
    manager.check_invariants()
    m = manager.metrics
    assert m.prefix_hit_tokens == 16, m  # request 1 shares two full pages of request 0's prompt
    for r in prompts:
        manager.release(seq[r])
    print(f"decoded 6 steps for 3 requests; pages used at the end {m.used_pages}, "
          f"prefix hit tokens {m.prefix_hit_tokens}; released, {manager.metrics.cached_pages} pages stay cached")


if __name__ == "__main__":
    main()
