"""Tiny Tunix models with random weights (Tunix zero-initialises some MLP kernels, which would make
every token the same), a byte tokenizer, and the references the tests compare with: Tunix's own
``Sampler`` and Tunix's model run without a cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

PAD, BOS, EOS = 0, 1, 2
VOCAB = 64


class ByteTokenizer:
    """Tunix's tokenizer protocol: ids 3.. for bytes, 0 pad, 1 bos, 2 eos."""

    def encode(self, text, **kw):
        return [3 + (b % (VOCAB - 3)) for b in text.encode()]

    def decode(self, ids, **kw):
        return "".join(chr(97 + (i - 3) % 26) for i in ids if i >= 3)

    def bos_id(self):
        return BOS

    def eos_id(self):
        return EOS

    def pad_id(self):
        return PAD


def randomize(model, seed=1, scale=0.05):
    state = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(model, jax.tree.unflatten(tree, [a + (scale * jax.random.normal(k, a.shape)).astype(a.dtype)
                                                for a, k in zip(leaves, keys)]))  # fmt: skip
    return model


def make(family, *, layers=2, window=6, remat=None, seed=0):
    """A tiny float32 model of ``family`` (gemma3: local layers of ``window``, the sixth global)."""
    if family == "qwen3":
        from tunix.models.qwen3 import model as lib

        extra = {} if remat is None else {"remat_config": getattr(lib.RematConfig, remat)}
        cfg = lib.ModelConfig(num_layers=layers, vocab_size=VOCAB, embed_dim=32, hidden_dim=64, num_heads=4,
                              head_dim=8, num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-6, **extra)
        return randomize(lib.Qwen3(cfg, rngs=nnx.Rngs(seed)), seed + 1)
    if family == "llama3":
        from tunix.models.llama3 import model as lib

        extra = {} if remat is None else {"remat_config": getattr(lib.RematConfig, remat)}
        cfg = lib.ModelConfig(num_layers=layers, vocab_size=VOCAB, embed_dim=32, hidden_dim=64, num_heads=4,
                              head_dim=8, num_kv_heads=2, rope_theta=500_000, norm_eps=1e-5, **extra)
        return randomize(lib.Llama3(cfg, rngs=nnx.Rngs(seed)), seed + 1)
    from tunix.models.gemma3 import model as lib

    extra = {} if remat is None else {"remat_config": getattr(lib.RematConfig, remat)}
    cfg = lib.ModelConfig(num_layers=layers, num_embed=VOCAB, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8,
                          num_kv_heads=2, sliding_window_size=window, param_dtype=jnp.float32, **extra)
    return randomize(lib.Gemma3(cfg, rngs=nnx.Rngs(seed)), seed + 1)


def ids_of(text):
    return [BOS] + ByteTokenizer().encode(text)


def tunix_greedy(model, prompts, new_tokens, *, cache_size=256):
    """Tunix's own Sampler, greedy, float32."""
    from tunix.generate import sampler as sampler_lib

    c = model.config
    sampler = sampler_lib.Sampler(model, ByteTokenizer(), sampler_lib.CacheConfig(
        cache_size=cache_size, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim))
    out = sampler(prompts, max_generation_steps=new_tokens, max_prompt_length=64, temperature=0.0, eos_tokens=[EOS])
    return [np.asarray(t).tolist() for t in out.tokens]


def uncached_logits(model, ids):
    """Tunix's model over the whole sequence without a cache: ``(len(ids), vocab)``."""
    n = len(ids)
    logits, _ = model(jnp.asarray([ids]), jnp.arange(n)[None], None, jnp.tril(jnp.ones((n, n), bool))[None])
    return np.asarray(logits[0], np.float32)


def uncached_greedy(model, ids, new_tokens):
    """Greedy continuation recomputed from scratch each token (the oracle no cache can fool)."""
    seq, out = list(ids), []
    for _ in range(new_tokens):
        token = int(np.argmax(uncached_logits(model, seq)[-1]))
        if token == EOS:
            break
        out.append(token)
        seq.append(token)
    return out


# The projections Tunix's GRPO scripts give LoRA adapters (Gemma 3 names its attention projections einsums).
LORA_MODULES = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj|.*up_proj"
GEMMA3_LORA_MODULES = ".*q_einsum|.*kv_einsum|.*gate_proj|.*down_proj|.*up_proj|.*attn_vec_einsum"


def apply_lora(base, family, *, module_path=None, skip_nnx_init=False, **provider_options):
    """``base`` with qwix LoRA adapters (rank 4, alpha 8) applied as Tunix's GRPO scripts apply them; the
    LoRA model holds ``base``'s parameter arrays in variables of its own, so its updates leave ``base`` as
    it was. ``provider_options`` add to or override the ``qwix.LoraProvider`` options
    (``weight_qtype="int8"``: QLoRA). qwix starts every B matrix at zero, so the model computes what ``base``
    does until `randomize_adapters`."""
    import qwix

    if module_path is None:
        module_path = GEMMA3_LORA_MODULES if family == "gemma3" else LORA_MODULES
    provider = qwix.LoraProvider(module_path=module_path, **{"rank": 4, "alpha": 8.0, **provider_options})
    extra = {"skip_nnx_init": True} if skip_nnx_init else {}
    return qwix.apply_lora_to_model(base, provider, rngs=nnx.Rngs(3), **base.get_model_input(), **extra)


def randomize_adapters(model, seed, scale=0.2):
    """Sets every ``nnx.LoRAParam`` of ``model`` to new random values (A and B alike) and returns them as the
    ``nnx.State`` it set."""
    state = nnx.state(model, nnx.LoRAParam)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = jax.tree.unflatten(tree, [(scale * jax.random.normal(k, a.shape)).astype(a.dtype)
                                    for a, k in zip(leaves, keys)])  # fmt: skip
    nnx.update(model, new)
    return new
