"""A tiny EasyDeL gpt-oss (learned attention sinks on every layer, sliding-window and full layers
alternating, mixture of experts) decoding greedily inside EasyDeL's own forward on easykv pages.
EasyDeL hands its sinks to the attention as ``softmax_aux``; easykv attends with them as
``sinks``.

Two references, each where it is exact:

* EasyDeL's own RaggedPagesCache (the same EasyDeL metadata each step) with prompts no longer
  than the window. Its XLA ragged-page kernel starts reading a chunk's keys at the page of
  ``context_len - window`` for every query of the chunk, so a longer prefill chunk loses keys its
  early queries should see (a 23-token prompt under a 12-token window: tokens differ from the
  second one on); easykv keeps every query's own window.
* The same model recomputing whole sequences without a cache (EasyDeL's ``vanilla`` attention),
  with full-attention layers and long prompts. (With windows it is no reference: it reads
  ``sliding_window + 1`` keys, where HF, EasyDeL's ragged kernels and easykv read
  ``sliding_window``.)
"""

import pytest

pytest.importorskip("easydel", reason="EasyDeL 0.3 is not installed: pip install 'easykv[easydel]'")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from helpers import HEAD_DIM, HEADS, KV_HEADS, MESH_DIMS, VOCAB, GreedyEngine, run_greedy  # noqa: E402

from easykv.integrations.easydel import easydel_config_from_metadata, use_easykv  # noqa: E402

PAGE_SIZE, MAX_LEN, NUM_PAGES, WINDOW = 8, 64, 48, 12
WINDOWED = ["sliding_attention", "full_attention"]
FULL = ["full_attention", "full_attention"]


def tiny_gpt_oss(layer_types, *, mechanism: str = "ragged_page_attention_v3", seed: int = 0):
    """2 layers, 16 query / 8 kv heads of 8 dims, 4 experts (2 per token), f32, on tp=8."""
    import easydel as ed
    from flax import nnx

    config = ed.GptOssConfig(
        vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, layer_types=layer_types, max_position_embeddings=512,
        initializer_range=0.1, sharding_axis_dims=MESH_DIMS, attn_mechanism=mechanism, kvdtype=jnp.float32,
        attn_dtype=jnp.float32,
    )  # fmt: skip
    model = ed.GptOssForCausalLM(config=config, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(seed))
    # Learned sinks; EasyDeL draws them near zero. Logits of a few units make them matter.
    for i, layer in enumerate(model.model.layers):
        sinks = layer.self_attn.sinks
        sinks[...] = jnp.linspace(-2.0, 3.0, sinks[...].shape[0], dtype=jnp.float32) + i
    return model


def _easykv(layer_types, prompts):
    model = use_easykv(tiny_gpt_oss(layer_types), num_pages_per_layer=NUM_PAGES)
    cache = model.init_operations_cache(len(prompts), MAX_LEN, page_size=PAGE_SIZE)
    return GreedyEngine(model, cache, "v3"), cache.easykv_metadata


def test_tokens_identical_to_easydel_cache_with_sinks_and_windows():
    # Prompts within the window, 24 tokens each: decode steps slide the window across pages.
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20 + i for i in range(12)], [40, 41, 42], [60 + i for i in range(11)]]
    ours, meta = _easykv(WINDOWED, prompts)
    theirs_model = tiny_gpt_oss(WINDOWED)
    config = easydel_config_from_metadata(meta, version="v3")
    theirs = GreedyEngine(theirs_model, theirs_model.init_operations_cache(len(prompts), MAX_LEN, page_size=PAGE_SIZE,
                                                                           ragged_config=config), "v3")
    want, got = run_greedy([theirs, ours], prompts, 24, meta=meta)
    assert got == want
    assert len({t for seq in got for t in seq}) > 8


def test_tokens_identical_to_recomputing_without_a_cache():
    # Long prompts (prefill chunks across pages) with sinks on every layer.
    prompts = [[5, 6, 7, 8, 9], [20 + i for i in range(19)], [40, 41, 42], [60 + i for i in range(23)]]
    ours, meta = _easykv(FULL, prompts)
    (got,) = run_greedy([ours], prompts, 16, meta=meta)
    ref = tiny_gpt_oss(FULL, mechanism="vanilla")
    graphdef, state, other = ref.split_module()

    @jax.jit
    def logits(state, other, ids):
        from flax import nnx

        with ref.mesh:
            return nnx.merge(graphdef, state, other)(input_ids=ids[None]).logits[0, -1]

    want = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(16):
            seq.append(int(np.asarray(logits(state, other, jnp.asarray(seq, jnp.int32))).argmax()))
        want.append(seq[len(prompt):])
    assert got == want
    assert len({t for seq in got for t in seq}) > 8


def test_use_easykv_gives_a_gpt_oss_cache_its_layer_groups(tmp_path):
    """gpt-oss alternates sliding-window and full layers: use_easykv's cache says so (one sliding
    and one full group in the one pool EasyDeL's single page table addresses), the window each
    layer attends with is checked against its group, and the grouped cache checkpoints."""
    import easykv
    from easykv.integrations._easydel_model import EasyKVCache

    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20 + i for i in range(12)]]
    ours, meta = _easykv(WINDOWED, prompts)
    assert [(g.layers, g.attention, g.window, g.num_pages) for g in meta.groups] == [
        ((0,), "sliding", WINDOW, NUM_PAGES), ((1,), "full", None, NUM_PAGES)]
    assert _easykv(FULL, prompts)[1].is_uniform
    # EasyDeL's config of the grouped cache is the uniform cache's: one table, one geometry.
    uniform = meta.replace(layer_groups=None)
    assert easydel_config_from_metadata(meta, version="v3") == easydel_config_from_metadata(uniform, version="v3")
    (got,) = run_greedy([ours], prompts, 6, meta=meta)
    cache = ours.cache.to_easykv()
    easykv.save_cache(tmp_path, cache)
    restored = easykv.restore_cache(tmp_path, mesh=cache.layout.mesh).cache
    assert restored.metadata.groups == cache.metadata.groups
    for a, b in zip(jax.tree.leaves(restored.key_pages), jax.tree.leaves(cache.key_pages)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # A cache that declares another window than the model attends with is refused by name.
    import dataclasses

    wider = meta.replace(layer_groups=(dataclasses.replace(meta.groups[0], window=WINDOW + 4), meta.groups[1]))
    model = use_easykv(tiny_gpt_oss(WINDOWED), num_pages_per_layer=NUM_PAGES)
    other = EasyKVCache.from_easykv(easykv.PagedAttentionCache(wider, cache.key_pages, cache.value_pages, cache.layout))
    with pytest.raises(ValueError, match=rf"layer 0 attends with sliding_window={WINDOW}, but its cache group "
                                         rf"\(layers \[0\]\) is sliding {WINDOW + 4}"):
        run_greedy([GreedyEngine(model, other, "v3")], prompts[:1], 1, meta=wider)
