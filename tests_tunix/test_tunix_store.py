"""The Tunix engine over a shared prefix store: a second engine (another cache, another mesh) generates the same
tokens as without a store with the prompts' pages read from the store; the store's keys carry the weights'
content, so new weights never read pages of old ones while a restarted engine with the new weights reads what
the updated one wrote; sleep and wake move the store to the woken manager; a bad store argument is refused
before anything is made."""

from __future__ import annotations

import uuid

import jax
import pytest

pytest.importorskip("tunix")

from flax import nnx  # noqa: E402
from helpers import ByteTokenizer, ids_of, make  # noqa: E402

from easykv.integrations.tunix import EasyKVRollout, TunixPagedEngine  # noqa: E402
from easykv.sharding import create_mesh  # noqa: E402
from easykv.tiers.store import PrefixStore  # noqa: E402

MODEL_ID = "tests/tiny-qwen3"
# 39 tokens shared (9 full pages of 4), then 3 of each prompt's own: 10 full pages each looked up (the page of
# the last token never is).
PROMPTS = [ids_of("a shared system prompt, then question one"), ids_of("a shared system prompt, then question two")]
OPTS = dict(max_length=64, batch_size=4, page_size=4, num_pages=96, decode_steps=4, prefill_tokens=32)
NEW = 8


def memory_url():
    return f"memory://{uuid.uuid4().hex}"


def engine(model, **kw):
    return TunixPagedEngine(model, **{**OPTS, **kw})


def reader_store(url):
    return PrefixStore(url, model_id=MODEL_ID, read="wait")  # every page found is waited for: no timing in tests


def generated(eng, prompts=PROMPTS):
    tokens, _ = eng.generate(prompts, NEW)
    return [t.tolist() for t in tokens]


def test_a_second_engine_on_another_mesh_reads_the_prompts_from_the_store():
    model = make("qwen3", seed=3)
    without = generated(engine(model))
    url = memory_url()
    writer = engine(model, store=url, model_id=MODEL_ID)
    assert writer.manager.metadata.has_host_tier  # made for the store: its pages land in host pages
    assert generated(writer) == without
    assert writer.store.flush(30)
    written = writer.store_metrics()
    assert written.pages_read == 0 and written.values_written > 0 and written.dropped == written.refused == 0
    store = reader_store(url)
    reader = engine(model, mesh=create_mesh({"tp": 2}, devices=jax.devices()[:2]), store=store)
    assert generated(reader) == without
    m = reader.store_metrics()
    # The first prompt's 10 pages come from the store; the second finds the 9 it shares on the device and
    # reads its own tenth: 11 pages, 44 prompt tokens not prefilled.
    assert (m.pages_read, m.tokens_served, m.refused) == (11, 44, 0)
    reader.close()  # a store passed in stays open: its owner closes it
    assert store.metrics().available
    store.close()
    writer.close()


def test_new_weights_never_read_pages_of_the_old_ones():
    url = memory_url()
    first = engine(make("qwen3", seed=3), store=url, model_id=MODEL_ID)
    generated(first)
    assert first.store.flush(30)
    updated = engine(make("qwen3", seed=3), store=reader_store(url))
    other = make("qwen3", seed=8)
    updated.update_params(nnx.state(other, nnx.Param))  # the trainer's weight push: a new version
    assert updated.weight_version != first.weight_version and updated.version == 1
    want = generated(engine(other))  # the new weights' own tokens, no store
    assert generated(updated) == want
    m = updated.store_metrics()
    assert (m.pages_read, m.tokens_served) == (0, 0)  # the old weights' pages are never served
    assert updated.store.flush(30)
    # A worker restarted with the pushed weights (its own count of weight changes is 0 again, as the first
    # engine's was) reads what the updated engine wrote, and nothing of the first weights.
    restarted = engine(make("qwen3", seed=8), store=reader_store(url))
    assert restarted.version == 0 and restarted.weight_version == updated.weight_version
    assert generated(restarted) == want
    assert restarted.store_metrics().pages_read == 11
    for eng in (first, updated, restarted):
        eng.store.close()


@pytest.mark.parametrize("level", [1, 2])
def test_the_store_serves_the_woken_cache(level):
    model = make("qwen3", seed=3)
    url = memory_url()
    writer = engine(model, store=url, model_id=MODEL_ID)
    without = generated(writer)
    assert writer.store.flush(30)
    eng = engine(model, store=reader_store(url))
    assert generated(eng) == without and eng.store_metrics().pages_read == 11
    eng.sleep(level)
    assert eng.asleep
    assert generated(eng) == without  # woken: its runner holds the store again
    # level 1 kept the pages (found on the device); level 2 discarded them: read from the store again
    assert eng.store_metrics().pages_read == (11 if level == 1 else 22)
    assert eng.store.namespace is not None
    eng.sleep(level)
    eng.update_params(nnx.state(make("qwen3", seed=8), nnx.Param))  # asleep: the version moves at wake
    generated(eng)
    assert eng.manager.weight_version == eng.weight_version != writer.weight_version
    assert eng.store_metrics().pages_read == (11 if level == 1 else 22)
    for e in (writer, eng):
        e.store.close()


def test_a_bad_store_argument_is_refused_before_anything_is_made(tmp_path):
    model = make("qwen3", seed=3)
    where = tmp_path / "store"
    url = f"file://{where}"
    with pytest.raises(TypeError, match="store must be a store URL .* got int"):
        engine(model, store=7)
    with pytest.raises(ValueError, match="'nope://x'.*unknown scheme"):
        engine(model, store="nope://x", model_id=MODEL_ID)
    with pytest.raises(ValueError, match=r"store='file://.*' needs model_id="):
        engine(model, store=url)
    with pytest.raises(ValueError, match=r"model_id='m' was given without a store"):
        engine(model, model_id="m")
    with pytest.raises(ValueError, match="model_id=''"):
        engine(model, store=url, model_id="")
    with pytest.raises(ValueError, match="needs model_id="):  # through Tunix's rollout engine too
        EasyKVRollout(rollout_actor=model, tokenizer=ByteTokenizer(), store=url, **OPTS)
    assert not where.exists()  # nothing opened
    store = PrefixStore(memory_url(), model_id=MODEL_ID)
    with pytest.raises(ValueError, match=r"model_id='m' was given with a PrefixStore.*'tests/tiny-qwen3'"):
        engine(model, store=store, model_id="m")
    owner = engine(model, store=store)
    with pytest.raises(ValueError, match="serves another runner's manager"):
        engine(model, store=store)
    assert owner.store is store and store.namespace is not None  # still the first engine's
    assert generated(owner) == generated(engine(model))
    store.close()
