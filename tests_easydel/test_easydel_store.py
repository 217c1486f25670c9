"""eSurge's prefix cache extended to a shared prefix store (attach_store): engines of one model on one store
read each other's prompt pages, the tokens unchanged; a damaged value is refused, the tokens still right."""

import types
import uuid

import pytest

pytest.importorskip("easydel", reason="EasyDeL 0.3 is not installed: pip install 'easykv[easydel]'")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from helpers import tiny_llama  # noqa: E402

from easykv.integrations.easydel import attach_store, use_easykv  # noqa: E402
from easykv.manager.prefix_hash import NO_SALT, ROOT_DIGEST, iter_page_digests  # noqa: E402
from easykv.tiers.store import PrefixStore  # noqa: E402

NUM_PAGES, PAGE_SIZE = 64, 16
# 40 prompt tokens each: two full pages a lookup may take (the third holds the last prompt token), 8 new tokens.
# The second prompt shares the first's two full pages and differs after them.
PROMPT = " ".join(f"w{i}" for i in range(4, 44))
SHARING = " ".join([*(f"w{i}" for i in range(4, 36)), *(f"w{i}" for i in range(100, 108))])
PROMPT_PAGES = (40 - 1) // PAGE_SIZE
MODEL_ID = "tests/tiny-llama@seed0"


def serve(tokenizer_path, prompt, store_url=None, *, by_url=False, dtype=jnp.float32):
    """Generate ``prompt`` greedily on a fresh eSurge engine (a fresh cache), with the store at ``store_url`` attached
    (None: without; ``by_url``: opened by attach_store from the URL, else a PrefixStore reading by the ``wait``
    policy), detached at the end; returns (token ids, the detached store or None)."""
    import easydel as ed
    from transformers import AutoTokenizer

    model = use_easykv(tiny_llama(dtype), num_pages_per_layer=NUM_PAGES)
    engine = ed.eSurge(model=model, tokenizer=AutoTokenizer.from_pretrained(tokenizer_path), dtype=dtype,
                       max_model_len=128, max_num_seqs=2, max_num_seq_buckets=[2], min_input_pad=4,
                       max_num_batched_tokens=16, page_size=PAGE_SIZE, hbm_utilization=0.5, silent_mode=True)
    attached = None
    try:
        if by_url:
            attached = attach_store(engine, store_url, model_id=MODEL_ID)
        elif store_url is not None:
            attached = attach_store(engine, PrefixStore(store_url, model_id=MODEL_ID, read="wait"))
        engine.initiate()
        params = ed.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        [out] = engine.generate([prompt], params, use_tqdm=False)
        if attached is not None:
            assert attached.flush(60.0)
            attached.detach()
            assert not {"schedule", "update_from_output"} & set(vars(engine.scheduler))  # eSurge's own again
        return list(out.outputs[0].token_ids), attached
    finally:
        thread = engine._scheduler_thread
        engine.terminate()
        if thread is not None:
            thread.join()
        engine._worker_manager.shutdown()


@pytest.mark.slow
def test_second_engine_reads_prompt_pages_from_the_store_and_refuses_a_damaged_value(tokenizer_path):
    want, _ = serve(tokenizer_path, PROMPT)
    want_sharing, _ = serve(tokenizer_path, SHARING)
    url = f"memory://esurge-{uuid.uuid4().hex}"

    first, writer = serve(tokenizer_path, PROMPT, url, by_url=True)  # an empty store: computes all, writes full pages
    assert first == want and writer.pages_read == 0
    written = writer.store.metrics()
    heads = writer.namespace.group_heads[0]
    assert written.values_written >= PROMPT_PAGES * heads and written.dropped == 0

    second, reader = serve(tokenizer_path, SHARING, url)  # another engine and cache: the shared pages from the store
    assert second == want_sharing
    assert reader.pages_read == PROMPT_PAGES and reader.store.metrics().tokens_served == PROMPT_PAGES * PAGE_SIZE
    assert reader.store.metrics().refused == 0

    # Damage the second page's value of one head: the third engine takes the first page only, and computes the rest.
    ns = reader.namespace
    keys = sorted(k for k in reader.store.backend.list_keys(ns.group_prefix(0)) if k.endswith("/3"))
    backend = reader.store.backend
    values = dict(zip(keys, backend.get_many(keys)))
    second_page = list(iter_page_digests(np.arange(4, 44), PAGE_SIZE, 2, NO_SALT, ROOT_DIGEST))[1]  # easykv's digest
    damaged = [k for k in keys if f"/{second_page.hex()}/" in k]
    assert len(damaged) == 1
    good = values[damaged[0]]
    backend.delete_many(damaged)
    assert backend.put_if_absent([(damaged[0], good[:-1] + bytes([good[-1] ^ 0xFF]))]) == [True]

    third, refusing = serve(tokenizer_path, SHARING, url)
    assert third == want_sharing
    metrics = refusing.store.metrics()
    assert metrics.refused == 1 and refusing.pages_read == 1


def _fake_engine(cache):
    """An object shaped like an eSurge engine as far as attach_store's checks read it."""
    manager = types.SimpleNamespace(enable_caching=True, num_kv_cache_groups=1)
    return types.SimpleNamespace(scheduler=types.SimpleNamespace(kv_cache_manager=manager, data_parallel_size=1),
                                 runner=types.SimpleNamespace(executor_manager=types.SimpleNamespace(kv_pages=cache)))


def test_bad_arguments_are_refused_before_anything_changes():
    engine = _fake_engine(cache=object())
    with pytest.raises(TypeError, match="eSurge engine"):
        attach_store(object(), "memory://x", model_id=MODEL_ID)
    with pytest.raises(ValueError, match="needs model_id="):
        attach_store(engine, "memory://x")
    with pytest.raises(TypeError, match="store must be a store URL"):
        attach_store(engine, 3, model_id=MODEL_ID)
    store = PrefixStore("memory://bad-args", model_id=MODEL_ID)
    try:
        with pytest.raises(ValueError, match="carries its own"):
            attach_store(engine, store, model_id=MODEL_ID)
        with pytest.raises(ValueError, match="not an EasyKVCache; build the engine on use_easykv"):
            attach_store(engine, store)
        assert store.metrics().values_written == 0 and store._owner is None
    finally:
        store.close()
    assert not hasattr(engine.scheduler, "schedule")  # nothing was wrapped
