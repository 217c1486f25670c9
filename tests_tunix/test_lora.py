"""qwix LoRA and weight-quantized Tunix models over easykv pages, as Tunix's GRPO scripts make them: greedy
tokens equal Tunix's own Sampler on the same model (and differ from the base model's, so the adapters act),
an adapter update (``update_params`` or the trainer's in-place update of the shared model) starts exactly
one new weight version and no prefix of the old adapters is found again, the frozen base pushed again
starts none, scores equal Tunix's ``compute_per_token_logps`` before and after an update, and every qwix
option easykv cannot run is refused by name with its fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tunix")
qwix = pytest.importorskip("qwix")

from flax import nnx  # noqa: E402
from helpers import EOS, PAD, apply_lora, ids_of, make, randomize_adapters, tunix_greedy  # noqa: E402

from easykv.integrations.tunix import TunixPagedEngine, family_of  # noqa: E402

FAMILIES = ["qwen3", "llama3", "gemma3"]
PROMPTS = ["hello there, pages", "hi", "a paged cache for rollouts in jax", "abc def ghi jkl"]
IDS = [ids_of(p) for p in PROMPTS]
NEW = 20  # greedy tokens per prompt
PAGE = 4
# Prompts with a full page before their last token: those a repeated generate finds in the prefix cache
# ("hi" is 3 tokens, shorter than a page).
CACHEABLE = sum(len(p) > PAGE for p in IDS)
BASE_ONLY = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # the frozen base: every parameter but the adapters


def engine(model, **kw):
    opts = dict(max_length=128, batch_size=8, page_size=PAGE, num_pages=160, decode_steps=8, prefill_tokens=32)
    return TunixPagedEngine(model, **{**opts, **kw})


def generate(eng):
    tokens, _ = eng.generate(IDS, NEW, eos_ids=[EOS])
    return [t.tolist() for t in tokens]


def by_version(eng):
    return {v.version: v for v in eng.manager.metrics.versions}


def lookups(eng, version):
    """(prefix lookups, prefix hits) the engine's manager counted under ``version`` so far."""
    v = by_version(eng).get(version)
    return (0, 0) if v is None else (v.prefix_queries, v.prefix_hits)


def assert_idle(eng):
    m = eng.manager.metrics
    assert (m.active_sequences, m.open_plans) == (0, 0)


class Setup:
    """One family's shared models: the base (as test_models.py makes it), its LoRA model with random
    adapters, their Tunix Sampler tokens, and an engine over the LoRA model (compiled once for the module)."""

    def __init__(self, family):
        self.family = family
        self.base = make(family, layers=6 if family == "gemma3" else 2, window=6, seed=6)
        self.lora = apply_lora(self.base, family)
        self.adapters = randomize_adapters(self.lora, seed=15)
        self.base_tokens = tunix_greedy(self.base, PROMPTS, NEW)
        self.lora_tokens = tunix_greedy(self.lora, PROMPTS, NEW)
        self.engine = engine(self.lora)

    def restore(self):
        """The LoRA model's first adapters, whatever a test set (a new weight version if it changed them)."""
        nnx.update(self.lora, self.adapters)

    def other_adapters(self, seed):
        """A second LoRA model of the same base (a clone) with adapters of ``seed``, and its Sampler tokens."""
        other = nnx.clone(self.lora)
        randomize_adapters(other, seed)
        tokens = tunix_greedy(other, PROMPTS, NEW)
        assert not any(PAD in t for t in tokens) and min(map(len, tokens)) > 10  # as for the first adapters
        return other, tokens


@pytest.fixture(scope="module")
def setups():
    built = {}

    def get(family):
        if family not in built:
            built[family] = Setup(family)
        return built[family]

    return get


@pytest.fixture
def setup(setups, request):
    s = setups(request.param)
    s.restore()
    yield s
    s.restore()


FAMILY_SETUPS = pytest.mark.parametrize("setup", FAMILIES, indirect=True)


@FAMILY_SETUPS
def test_lora_tokens_are_tunix_sampler_s_and_not_the_base_model_s(setup):
    # Tunix's Sampler masks generated pad ids (see test_models.py): these adapters (seed 15) generate none.
    assert not any(PAD in t for t in setup.lora_tokens) and min(map(len, setup.lora_tokens)) > 10
    assert all(a != b for a, b in zip(setup.lora_tokens, setup.base_tokens))  # every prompt: the adapters act
    assert generate(setup.engine) == setup.lora_tokens
    assert_idle(setup.engine)


@FAMILY_SETUPS
def test_an_adapter_update_starts_one_version_and_finds_no_prefix_of_the_old_adapters(setup):
    eng, lora = setup.engine, setup.lora
    other, other_tokens = setup.other_adapters(seed=20)
    assert generate(eng) == setup.lora_tokens  # the old adapters' prompt pages are cached now
    v = eng.version
    queries, hits = lookups(eng, v)
    assert generate(eng) == setup.lora_tokens and lookups(eng, v) == (queries + len(IDS), hits + CACHEABLE)

    # Tunix's trainer hands the rollout the adapters (the LoRA parameters) it trained.
    eng.update_params(nnx.state(other, nnx.LoRAParam))
    assert eng.version == v + 1
    assert generate(eng) == other_tokens != setup.lora_tokens
    assert lookups(eng, v + 1) == (len(IDS), 0)  # nothing of the old adapters served
    assert generate(eng) == other_tokens and lookups(eng, v + 1) == (2 * len(IDS), CACHEABLE)  # its own pages

    # The trainer updates the LoRA model it shares with the rollout in place.
    third = randomize_adapters(nnx.clone(lora), seed=28)
    nnx.update(lora, third)
    third_tokens = tunix_greedy(lora, PROMPTS, NEW)
    assert not any(PAD in t for t in third_tokens)
    assert eng.version == v + 1  # noticed at the next call, not before
    assert generate(eng) == third_tokens and third_tokens not in (other_tokens, setup.lora_tokens)
    assert eng.version == v + 2 and lookups(eng, v + 2) == (len(IDS), 0)
    assert generate(eng) == third_tokens and lookups(eng, v + 2) == (2 * len(IDS), CACHEABLE)
    assert eng.version == v + 2 and [x.version for x in eng.manager.metrics.versions if x.current] == [v + 2]
    assert_idle(eng)


@FAMILY_SETUPS
def test_the_frozen_base_pushed_again_starts_no_version_and_its_prefixes_stay_found(setup):
    eng = setup.engine
    generate(eng)
    v = eng.version
    queries, hits = lookups(eng, v)
    # The engine's own base arrays, then the reference model's (Tunix's reference shares the base's arrays).
    eng.update_params(nnx.state(eng.model, BASE_ONLY))
    eng.update_params(nnx.state(setup.base, nnx.Param))
    assert generate(eng) == setup.lora_tokens
    assert eng.version == v and lookups(eng, v) == (queries + len(IDS), hits + CACHEABLE)
    assert_idle(eng)


SCORED_PROMPTS, SCORED_CACHEABLE = 4, 3  # score_batch's distinct prompts, those with a full page before the last


def score_batch(seed):
    """Left-padded prompts of different lengths (one repeated: a group of two) and completions with an early
    end token, right padding and one full row."""
    rng = np.random.default_rng(seed)
    prompts = np.full((5, 14), PAD, np.int32)
    for i, n in enumerate([5, 14, 9, 2, 9]):
        prompts[i, 14 - n:] = rng.integers(3, 64, n)
    prompts[4] = prompts[2]
    completions = rng.integers(3, 64, (5, 11)).astype(np.int32)
    completions[0, 6:] = PAD
    completions[2, 3], completions[2, 4:] = EOS, PAD
    completions[3, 1:] = PAD
    return prompts, completions


def assert_scores_are_tunix_s(scores, model, prompts, completions, temperature=1.0):
    from tunix.rl.common import compute_per_token_logps

    graphdef, state = nnx.split(model)
    expected = compute_per_token_logps(graphdef, state, jnp.asarray(prompts), jnp.asarray(completions), PAD, EOS,
                                       temperature=temperature)  # fmt: skip
    mask = completions != PAD  # Tunix's: a pad id is padding wherever it sits (here only right padding)
    scores = np.asarray(scores)
    assert scores.shape == completions.shape and scores.dtype == np.float32
    np.testing.assert_allclose(scores[mask], np.asarray(expected)[mask], atol=1e-5, rtol=0)
    assert (scores[~mask] == 0).all()


@FAMILY_SETUPS
def test_lora_scores_are_tunix_s_before_and_after_an_adapter_update(setup):
    eng, lora = setup.engine, setup.lora
    prompts, completions = score_batch(0)
    before = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert_scores_are_tunix_s(before, lora, prompts, completions)
    v = eng.version
    queries, hits = lookups(eng, v)
    again = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)  # the prompts' pages are found now
    np.testing.assert_allclose(again, before, atol=1e-6)
    assert lookups(eng, v) == (queries + SCORED_PROMPTS, hits + SCORED_CACHEABLE)

    randomize_adapters(lora, seed=14)  # in place, as Tunix's trainer does
    after = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert eng.version == v + 1 and lookups(eng, v + 1) == (SCORED_PROMPTS, 0)  # no page of the old adapters
    assert_scores_are_tunix_s(after, lora, prompts, completions)
    assert np.abs(np.asarray(after) - np.asarray(before)).max() > 1e-2  # the new adapters' scores
    hot = eng.score(prompts, completions, pad_id=PAD, eos_id=EOS, temperature=0.7)
    assert_scores_are_tunix_s(hot, lora, prompts, completions, temperature=0.7)
    assert_idle(eng)


def int8_leaves(model):
    return [a for a in jax.tree.leaves(nnx.state(model, nnx.Param)) if a.dtype == jnp.int8]


@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_qlora_tokens_are_tunix_sampler_s(setups, family):
    s = setups(family)
    qlora = apply_lora(s.base, family, weight_qtype="int8")
    randomize_adapters(qlora, seed=30)
    assert int8_leaves(qlora)  # the base's weights really are int8 in the model easykv runs
    reference = tunix_greedy(qlora, PROMPTS, NEW)
    assert min(map(len, reference)) > 10 and not any(PAD in t for t in reference)
    assert reference not in (s.base_tokens, s.lora_tokens)
    eng = engine(qlora)
    assert generate(eng) == reference
    assert_idle(eng)


def test_ptq_weight_only_tokens_are_tunix_sampler_s(setups):
    s = setups("llama3")
    rule = qwix.QuantizationRule(module_path=".*", weight_qtype="int8")
    quantized = qwix.quantize_model(s.base, qwix.PtqProvider([rule]), **s.base.get_model_input())
    assert int8_leaves(quantized)
    reference = tunix_greedy(quantized, PROMPTS, NEW)
    assert reference != s.base_tokens  # int8 weights change these tiny models' tokens: easykv must run them
    assert generate(engine(quantized)) == reference


# ---- refusals: each a ValueError naming the option and its fix, raised before any engine exists -------------
def _act_quantized(base):
    rule = qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype="int8")
    return qwix.quantize_model(base, qwix.PtqProvider([rule]), **base.get_model_input())


def _qt(base):
    rule = qwix.QuantizationRule(module_path=".*", weight_qtype="int8")
    return qwix.quantize_model(base, qwix.QtProvider([rule]), **base.get_model_input())


def _attention_adapter(base):
    model = apply_lora(base, "llama3")
    model.layers[0].attn.bogus_lora_a = nnx.LoRAParam(jnp.zeros((2, 2)))
    return model


def _subclass(base):
    class Subclassed(type(base)):  # not qwix's wrapper: a changed model easykv cannot vouch for
        pass

    base.__class__ = Subclassed
    return base


def _dressed_as_qwix(base):
    """A subclass that claims to wrap Tunix's class as qwix records it, with no qwix provider behind it."""
    cls = type(base)
    base.__class__ = type(cls.__name__, (cls,), {"_unquantized_type": cls})
    return base


REFUSALS = {
    "act_qtype": ("llama3", _act_quantized, r"act_qtype=int8\).*quantize weights only \(weight_qtype\)"),
    "lora_act_qtype": ("llama3", lambda b: apply_lora(b, "llama3", weight_qtype="int8", act_qtype="int8"),
                       r"act_qtype=int8\).*quantize weights only \(weight_qtype\)"),
    "dropout": ("llama3", lambda b: apply_lora(b, "llama3", dropout=0.1), r"dropout=0\.1: .*use dropout=0"),
    "qt_provider": ("llama3", _qt, r"a qwix QtProvider model: easykv serves qwix\.LoraProvider .*qwix\.PtqProvider"),
    "disable_jit": ("llama3", lambda b: apply_lora(b, "llama3", disable_jit=True), r"disable_jit=True: easykv's"),
    "skip_nnx_init": ("llama3", lambda b: apply_lora(b, "llama3", skip_nnx_init=True),
                      r"without adapters: .*skip_nnx_init=True .*call qwix\.apply_lora_to_model with the model's inp"),
    "nothing_matches": ("gemma3", lambda b: apply_lora(b, "gemma3", module_path="nothing_matches"),
                        r"without adapters: none of its rules \(module paths \['nothing_matches'\]\) matched a "
                        r"projection.*call qwix\.apply_lora_to_model"),
    "adapter_on_attention": ("llama3", _attention_adapter,
                             r"layer 0's attention module itself carries qwix's 'bogus_lora_a'.*target the projection"),
    "qwen3_qlora": ("qwen3", lambda b: apply_lora(b, "qwen3", weight_qtype="int8"),
                    r"qwix-quantized weights in a qwen3 model: Tunix's Qwen3 Einsum .*use a LoRA without weight_qtype"),
    "subclass": ("qwen3", _subclass,
                 r"\.Subclassed is a changed Tunix Qwen3 \(a subclass other than qwix's .*cannot vouch"),
    "dressed_as_qwix": ("qwen3", _dressed_as_qwix, "a qwix model whose provider easykv cannot find"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_qwix_models_easykv_cannot_run_are_refused_by_name(case):
    family, build, match = REFUSALS[case]
    model = build(make(family, layers=1))  # one layer: these only need building (qwix runs the model once)
    with pytest.raises(ValueError, match=match):
        family_of(model)
    with pytest.raises(ValueError, match=match):
        TunixPagedEngine(model, max_length=16, batch_size=1, page_size=PAGE, num_pages=8)
