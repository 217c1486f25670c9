"""The same tiny Llama served by EasyDeL's eSurge engine, on EasyDeL's own cache and on easykv's
(use_easykv), the same requests: greedy tokens identical."""

import pytest

pytest.importorskip("easydel", reason="EasyDeL 0.3 is not installed: pip install 'easykv[easydel]'")

import jax.numpy as jnp  # noqa: E402
from helpers import easydel_pool_of, tiny_llama  # noqa: E402

from easykv.integrations.easydel import EasyKVCache, use_easykv  # noqa: E402

# Four requests of 3..18 prompt tokens, 40 new tokens each: up to 58 tokens, three page boundaries
# at page_size 16; with a 16-token step budget long prompts are prefilled in chunks beside decodes.
PROMPTS = ["w5 w6 w7", "w9 w10 w11 w12 w13", " ".join(f"w{i}" for i in range(20, 38)), "w40"]
NUM_PAGES, PAGE_SIZE = 64, 16


def serve(model, tokenizer_path, dtype, max_tokens=40):
    """Generate PROMPTS greedily with eSurge; returns (token ids per request, the engine's cache)."""
    import easydel as ed
    from transformers import AutoTokenizer

    engine = ed.eSurge(model=model, tokenizer=AutoTokenizer.from_pretrained(tokenizer_path), dtype=dtype,
                       max_model_len=128, max_num_seqs=4, max_num_seq_buckets=[4], min_input_pad=4,
                       max_num_batched_tokens=16, page_size=PAGE_SIZE, hbm_utilization=0.5, silent_mode=True)
    try:
        cache = engine.runner.executor_manager.kv_pages
        assert engine.runner.metadata.num_pages == NUM_PAGES
        engine.initiate()
        params = ed.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = engine.generate(PROMPTS, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], cache
    finally:
        thread = engine._scheduler_thread
        engine.terminate()
        if thread is not None:  # terminate may give up waiting (it holds the lock the thread needs)
            thread.join()
        engine._worker_manager.shutdown()  # what eSurge's destructor does: stop its tokenizer worker processes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_esurge_tokens_identical(dtype, tokenizer_path):
    with easydel_pool_of(NUM_PAGES, dtype, PAGE_SIZE):
        want, theirs = serve(tiny_llama(dtype), tokenizer_path, dtype)
    got, ours = serve(use_easykv(tiny_llama(dtype), num_pages_per_layer=NUM_PAGES), tokenizer_path, dtype)
    assert type(theirs).__name__ == "HybridCache" and isinstance(ours, EasyKVCache)
    assert ours.easykv_metadata.num_pages_per_layer == NUM_PAGES
    assert got == want
    assert all(len(seq) == 40 for seq in got) and len({t for seq in got for t in seq}) > 8
