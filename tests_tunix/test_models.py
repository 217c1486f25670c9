"""Tunix's Qwen3, Llama3 and Gemma3 over easykv pages: the paged forward equals Tunix's own forward,
greedy generation equals Tunix's own Sampler and the model recomputed without a cache (prompts
longer than Gemma 3's window, one device loop per 1 or 8 tokens, remat on), forks of one prompt
equal each sample recomputed alone, and every model or option easykv cannot serve is refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tunix")

from flax import nnx  # noqa: E402
from helpers import EOS, PAD, ids_of, make, tunix_greedy, uncached_greedy, uncached_logits  # noqa: E402

from easykv.integrations.tunix import Sampling, TunixPagedEngine, family_of  # noqa: E402

FAMILIES = ["qwen3", "llama3", "gemma3"]
PROMPTS = ["hello there, pages", "hi", "a paged cache for rollouts in jax", "abc def ghi jkl"]


def engine(model, **kw):
    opts = dict(max_length=128, batch_size=8, page_size=4, num_pages=160, decode_steps=8, prefill_tokens=32)
    return TunixPagedEngine(model, **{**opts, **kw})


@pytest.mark.parametrize("family", FAMILIES)
def test_the_paged_forward_is_tunix_s_own_forward(family):
    from easykv.integrations._tunix_model import forward

    model = make(family, layers=6 if family == "gemma3" else 2, window=4)  # gemma3: five local layers, one global
    eng = engine(model)
    ids = ids_of("a prompt longer than the window")
    [seq] = eng.manager.claim(1)
    plan = eng.manager.schedule([seq], [len(ids)], pad_tokens_to=64)
    tokens = np.zeros(64, np.int32)
    tokens[: len(ids)] = ids
    logits, _ = jax.jit(lambda c, t, m: forward(eng.model, c, t, m))(eng.cache, jnp.asarray(tokens), plan.metadata)
    eng.manager.abort(plan)
    np.testing.assert_allclose(np.asarray(logits)[: len(ids)], uncached_logits(model, ids), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("steps", [1, 8])
def test_greedy_tokens_are_tunix_sampler_s_and_the_uncached_model_s(family, steps):
    model = make(family, layers=6 if family == "gemma3" else 2, window=6, seed=6)
    reference = tunix_greedy(model, PROMPTS, 40)
    # Tunix's Sampler masks generated tokens equal to the pad id (see easykv.integrations.tunix);
    # with these weights (seed 6) no prompt generates it, so its tokens are the model's own.
    assert not any(PAD in r for r in reference) and min(map(len, reference)) > 10
    tokens, logp = engine(model, decode_steps=steps).generate([ids_of(p) for p in PROMPTS], 40, eos_ids=[EOS])
    assert [t.tolist() for t in tokens] == reference
    for p, t in zip(PROMPTS, tokens):
        assert t.tolist() == uncached_greedy(model, ids_of(p), 40)
    assert all(np.all(lp <= 0) and lp.shape == t.shape for lp, t in zip(logp, tokens))


@pytest.mark.parametrize("remat", ["BLOCK", "DECODER"])
def test_remat_settings_change_nothing(remat):
    plain, rematted = make("qwen3"), make("qwen3", remat=remat)
    ids = [ids_of(p) for p in PROMPTS[:2]]
    a, _ = engine(plain).generate(ids, 16)
    b, _ = engine(rematted).generate(ids, 16)
    assert [t.tolist() for t in a] == [t.tolist() for t in b]


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_forks_of_one_prompt_equal_each_sample_recomputed_alone(family):
    """Eight samples of one prompt (temperature sampling) share its prefill through forks; each
    sample's log-probabilities are the uncached model's for that very token sequence."""
    model = make(family, layers=6 if family == "gemma3" else 2, window=6)
    eng = engine(model)
    prompt = ids_of("one prompt, eight samples")
    tokens, logp = eng.generate([prompt] * 8, 24, sampling=Sampling(temperature=0.8, top_p=1.0), seed=3)
    assert len({tuple(t.tolist()) for t in tokens}) > 1  # the samples differ
    assert eng.manager.metrics.prefix_queries == 1  # one prefill for the group
    for t, lp in zip(tokens, logp):
        seq = prompt + t.tolist()
        logits = uncached_logits(model, seq)[len(prompt) - 1 : len(seq) - 1] / 0.8
        expected = jax.nn.log_softmax(logits, axis=-1)[np.arange(len(t)), t]
        np.testing.assert_allclose(lp, expected, atol=2e-4)


def test_peak_pages_of_a_group_count_the_prompt_once():
    model = make("qwen3")
    eng = engine(model, num_pages=400)
    prompt = ids_of("p" * 63)  # 64 tokens: 16 full pages of 4
    eng.generate([prompt] * 8, 32)
    # 16 shared prompt pages + 8 samples x 8 pages of their own 31 written tokens (the last one sampled, not written)
    assert eng.peak_pages == 16 + 8 * 8


def test_a_finished_sample_gives_its_pages_to_the_running_ones():
    """A 14-page pool holds a 20-token prompt finished after one token and an 8-token prompt that
    runs 38 tokens only if the first is released as soon as it is done."""
    model = make("llama3", seed=2)
    eng = engine(model, max_length=48, num_pages=14, decode_steps=8)
    rng = np.random.default_rng(0)
    a, b = rng.integers(3, 64, 20).tolist(), rng.integers(3, 64, 8).tolist()
    tokens, _ = eng.generate([a, b], [1, 38])
    assert [len(t) for t in tokens] == [len(uncached_greedy(model, a, 1)), len(uncached_greedy(model, b, 38))]
    assert tokens[1].tolist() == uncached_greedy(model, b, 38)
    assert eng.manager.metrics.active_sequences == 0


def test_a_failure_inside_the_decode_loop_leaves_no_sequence_or_plan_behind(monkeypatch):
    eng = engine(make("qwen3"))

    def broken(*args, **kwargs):
        raise RuntimeError("the device loop failed")

    monkeypatch.setattr(eng, "_decode_loop", broken)
    with pytest.raises(RuntimeError, match="the device loop failed"):
        eng.generate([ids_of("hello"), ids_of("world")], 8)
    # An open plan would have refused generate's release of its sequences (ValueError, not this error).
    m = eng.manager.metrics
    assert (m.active_sequences, m.used_pages) == (0, 0)
    eng.manager.check_invariants()


def test_models_and_options_it_cannot_serve_are_refused_by_name():
    from tunix.models.qwen3 import model as qwen3

    with pytest.raises(TypeError, match="takes a Tunix model"):
        family_of("qwen3")
    with pytest.raises(ValueError,
                       match=r"\.Linear is not a Tunix model family easykv serves \(qwen3, llama3, gemma3\)"):
        family_of(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    model = make("qwen3")

    class Changed(qwen3.Attention):
        pass

    # A plain subclass is refused; qwix's LoRA and quantization wrappers, which record the Tunix class they
    # wrap, are served (test_lora.py).
    class Subclassed(qwen3.Qwen3):
        pass

    subclassed = make("qwen3")
    subclassed.__class__ = Subclassed
    with pytest.raises(ValueError, match=r"Subclassed is a changed Tunix Qwen3 \(a subclass other than qwix's LoRA "
                                         r"and quantization wrappers\): .* cannot vouch for a changed one"):
        family_of(subclassed)
    model.layers[1].attn.__class__ = Changed
    with pytest.raises(ValueError, match="layer 1 of the qwen3 model is a .*Changed, not Tunix's Attention"):
        TunixPagedEngine(model)
    from tunix.models.qwen2 import model as qwen2  # another family Tunix ships

    tiny = qwen2.ModelConfig(num_layers=1, vocab_size=8, embed_dim=8, hidden_dim=8, num_heads=2, head_dim=4,
                             num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6)
    with pytest.raises(ValueError, match=r"qwen2\.model\.Qwen2 is not a Tunix model family easykv serves"):
        family_of(qwen2.Qwen2(tiny, rngs=nnx.Rngs(0)))
    gemma = make("gemma3")
    object.__setattr__(gemma.config, "vision_config", object())
    with pytest.raises(ValueError, match="vision tower"):
        TunixPagedEngine(gemma)


def test_bad_generate_calls_are_refused_with_nothing_held():
    eng = engine(make("llama3"))
    cases = [
        (([], 4), "non-empty list"),
        (([[1, 2]] * 9, 4), "9 prompts but the cache holds batch_size=8"),
        (([[1, -2]], 4), r"prompts\[0\] must be a non-empty list of token ids >= 0"),
        (([[]], 4), r"prompts\[0\] must be"),
        (([[1, 2]], 0), "max_new_tokens must be a positive int, got 0"),
        (([[1] * 100], 40), r"prompts\[0\] has 100 tokens and asks for 40"),
        (([[1], [2]], [3]), "max_new_tokens has 1 entries for 2 prompts"),
        (([[1, 64]], 4), r"prompts\[0\] holds token id 64, outside the model's vocabulary of 64"),
        (([[1, 2**32 + 5]], 4), r"holds token id 4294967301, outside"),  # never wrapped into range
    ]
    for (prompts, n), match in cases:
        with pytest.raises(ValueError, match=match):
            eng.generate(prompts, n)
        assert eng.manager.metrics.active_sequences == 0 and eng.manager.metrics.used_pages == 0
    with pytest.raises(ValueError, match="decode_steps must be .* at most max_length"):
        engine(make("llama3"), decode_steps=129)
    with pytest.raises(ValueError, match="top_p=1.5 must be in"):
        Sampling(top_p=1.5)
    with pytest.raises(ValueError, match="temperature=0 must be > 0 when sampling"):
        Sampling(temperature=0, top_p=0.9)
