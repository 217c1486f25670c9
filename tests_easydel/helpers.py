"""A tiny EasyDeL Llama, a word-level tokenizer, and a small greedy engine driving EasyDeL's own
forward from host-built metadata (shared by the tests and benchmarks/bench_easydel.py)."""

from __future__ import annotations

import contextlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

VOCAB = 128
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 16, 8, 8
MESH_DIMS = (1, 1, 1, 8, 1)  # EasyDeL's (dp, fsdp, ep, tp, sp): kv heads over tp=8


def make_tokenizer(path: str) -> None:
    """A word-level tokenizer (``w4`` .. ``w127``) saved where eSurge's workers can load it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)


def tiny_llama(dtype, *, mechanism: str = "ragged_page_attention_v3", seed: int = 0):
    """2 layers, 16 query / 8 kv heads of 8 dims, random weights from ``seed``, on tp=8."""
    import easydel as ed
    from flax import nnx

    config = ed.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, intermediate_size=256, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=512,
        initializer_range=0.1, sharding_axis_dims=MESH_DIMS, attn_mechanism=mechanism, kvdtype=dtype, attn_dtype=dtype,
    )  # fmt: skip
    return ed.LlamaForCausalLM(config=config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(seed))


@contextlib.contextmanager
def easydel_pool_of(num_pages: int, dtype, page_size: int):
    """Make EasyDeL's own RaggedPagesCacheConfig.create size exactly ``num_pages`` pages (on CPU it
    otherwise assumes 4 GiB per device), so both caches schedule the same pool."""
    import easydel.caching.ragged_page.cache as rpc

    page_bytes = 2 * LAYERS * page_size * KV_HEADS * HEAD_DIM * np.dtype(dtype).itemsize
    original = rpc.per_device_hbm_budget_bytes
    # EasyDeL multiplies the per-device budget by the kv-head shard count (8 on tp=8).
    rpc.per_device_hbm_budget_bytes = lambda *args, **kwargs: num_pages * page_bytes // KV_HEADS
    try:
        yield
    finally:
        rpc.per_device_hbm_budget_bytes = original


class GreedyEngine:
    """One jitted step of the model's own forward on ``cache`` (EasyDeL's RaggedPagesCache or
    an EasyKVCache), fed EasyDeL metadata; the cache is donated and replaced every step."""

    def __init__(self, model, cache, version: str):
        from flax import nnx

        self.cache, self.version = cache, version
        graphdef, self.state, self.other = model.split_module()
        mesh = model.mesh

        @partial(jax.jit, donate_argnums=(2,))
        def step(state, other, cache, ids, positions, md):
            from easydel.utils import set_inference_mode

            with mesh, set_inference_mode():
                m = nnx.merge(graphdef, state, other)
                out = m(input_ids=ids[None], position_ids=positions[None], past_key_values=cache, cache_metadata=md)
            return out.logits[0], out.past_key_values

        self._step = step

    def forward(self, ids: np.ndarray, md) -> np.ndarray:
        logits, self.cache = self._step(self.state, self.other, self.cache, jnp.asarray(ids),
                                        jnp.asarray(md.position_ids), md)
        return np.asarray(logits)


def run_greedy(engines, prompts, new_tokens, *, meta, tokens_per_step=32, arrive_every=2, follow=None,
               after_step=None):
    """Greedy decoding of several sequences with continuous batching: sequence ``b`` arrives at
    step ``b * arrive_every``, so steps mix prefill chunks and decodes; every step is planned
    with easykv's validated mixed form and handed to each engine as EasyDeL metadata. Sequence
    ``b``'s logical page ``j`` is physical page ``1 + j * B + b`` (interleaved; never page 0,
    which EasyDeL's engine keeps as its null page). Each engine decodes its own tokens, or all
    follow engine ``follow``'s (teacher forcing). Returns each engine's new tokens."""
    import easykv
    from easykv.integrations.easydel import easydel_metadata_from_easykv

    batch, per_seq = len(prompts), meta.num_pages_per_sequence
    table = np.array([[1 + j * batch + b for j in range(per_seq)] for b in range(batch)], np.int32)
    assert table.max() < meta.num_pages_per_layer
    seqs = [[list(p) for p in prompts] for _ in engines]
    outs = [[[] for _ in prompts] for _ in engines]
    cached, step = [0] * batch, 0
    while any(len(o) < new_tokens for o in outs[0]):
        new_lens = np.array([len(seqs[0][b]) - cached[b] if step >= b * arrive_every and len(outs[0][b]) < new_tokens
                             else 0 for b in range(batch)], np.int32)
        cached_lens = np.array([cached[b] if new_lens[b] else 0 for b in range(batch)], np.int32)
        step_meta = easykv.PagedAttentionMetadata.for_mixed(table, cached_lens, new_lens, cache_metadata=meta,
                                                     pad_tokens_to=tokens_per_step, pad_seqs_to=batch)
        mds = {v: easydel_metadata_from_easykv(step_meta, page_size=meta.page_size, version=v) for v in ("v2", "v3")}
        last = np.asarray(step_meta.query_start_loc)[1 : batch + 1] - 1
        picks = []
        for e, engine in enumerate(engines):
            ids = np.zeros(tokens_per_step, np.int32)
            flat = [t for b in range(batch) for t in seqs[e][b][cached[b] : cached[b] + new_lens[b]]]
            ids[: len(flat)] = flat
            picks.append(engine.forward(ids, mds[engine.version]).argmax(axis=-1)[last])
        for e in range(len(engines)):
            for b in np.flatnonzero(new_lens):
                outs[e][b].append(int(picks[e][b]))
                seqs[e][b].append(int(picks[e if follow is None else follow][b]))
        cached = [cached[b] + int(new_lens[b]) for b in range(batch)]
        if after_step is not None:
            after_step(step)
        step += 1
    return outs
