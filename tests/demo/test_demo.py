"""`easykv demo` end to end: generation through the paged cache equals the dense-cache
reference, the checkpoint midway restores onto another mesh, and a mismatch is caught."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

import easykv.demo.run as demo_run
from easykv.demo.run import DemoOptions, run_demo
from tests.support.tiers import SLOW


@SLOW
def test_demo_matches_dense_reference_and_catches_a_mismatch(monkeypatch, tmp_path, capsys):
    real = demo_run.reference_disagreements
    seen = {}

    def reference_with_one_wrong(model, request, **kwargs):
        seen[request.rid] = list(request.output)
        found = real(model, request, **kwargs)
        assert found == [], (request.rid, found)
        return found if request.rid != 2 else [0]

    monkeypatch.setattr(demo_run, "reference_disagreements", reference_with_one_wrong)
    report = run_demo(DemoOptions(requests=5, max_new_tokens=6, checkpoint_dir=str(tmp_path / "ck"), progress=False))
    out = capsys.readouterr().out
    # Every request but the tampered one equals the real dense reference; the tampered one is
    # reported, so the demo would fail loudly on a real mismatch.
    assert report.mismatches == (2,)
    assert "CHECK FAILED: requests [2]" in out
    assert set(seen) == {0, 1, 2, 3, 4}
    assert report.generated == sum(len(t) for t in seen.values())
    assert report.copies >= 1  # the forked request wrote into a shared page
    assert report.prefix_hit_rate > 0  # requests share the system prompt
    assert "restored onto {'dp': 2, 'tp': 4}" in out
    assert (tmp_path / "ck").exists()


def test_the_reference_check_flags_a_wrong_token_and_forgives_a_near_tie():
    """The demo's check feeds the dense reference the engine's tokens and flags a step whose
    token trails the reference's choice by more than the near-tie margin (a last-bit difference
    a quantized cache can turn into another code), and nothing else."""
    import jax.numpy as jnp

    from easykv.demo.engine import _reference_steps, reference_disagreements, reference_generate
    from easykv.demo.model import CompiledModel, DemoConfig, DemoModel
    from easykv.demo.workload import make_requests

    model = CompiledModel(DemoModel(DemoConfig(layers=2)))
    request = dataclasses.replace(make_requests(2, 2, seed=1)[0], max_new_tokens=2)
    request.output = reference_generate(model, request, max_len=128, dtype=jnp.float32)
    assert reference_disagreements(model, request, max_len=128, dtype=jnp.float32) == []
    (_, _), (best, row) = _reference_steps(model, request, max_len=128, dtype=jnp.float32, quantizer=None)
    runner_up = int(np.argsort(row)[-2])
    gap = float(row[best] - row[runner_up])
    request.output = [request.output[0], runner_up]
    assert reference_disagreements(model, request, max_len=128, dtype=jnp.float32, near_tie=gap / 2) == [1]
    assert reference_disagreements(model, request, max_len=128, dtype=jnp.float32, near_tie=gap * 2) == []
    request.output = request.output[:1]  # a missing token
    assert reference_disagreements(model, request, max_len=128, dtype=jnp.float32) == [1]


@pytest.mark.examples
@pytest.mark.parametrize("quant", ["int8", "int4-ol"])
@SLOW
def test_easykv_demo_command_succeeds(tmp_path, quant):
    done = subprocess.run(
        [sys.executable, "-m", "easykv.cli", "demo", "--requests", "3", "--max-new-tokens", "4", "--no-progress",
         "--quant", quant, "--checkpoint-dir", str(tmp_path / "ck")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "check: every greedy token of all 3 requests is the dense-cache reference's choice" in done.stdout
    assert f"quantizer {quant}" in done.stdout


def test_engine_under_slot_pressure_keeps_the_fork_and_matches_reference():
    """More requests than sequence slots: admissions wait for releases, the fork still gets a
    slot at its fork point, and every request equals the dense reference."""
    import jax.numpy as jnp

    import easykv
    from easykv.demo.engine import Engine, reference_generate
    from easykv.demo.model import CompiledModel, DemoConfig, DemoModel
    from easykv.demo.workload import make_requests
    from easykv.sharding import PartitionAxis, PartitionManager, create_mesh

    cfg = DemoConfig(layers=2)
    model = CompiledModel(DemoModel(cfg))
    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    meta = easykv.PagedAttentionCacheMetaData.create(
        mesh, 3, cfg.layers, 128, 8, cfg.kv_heads, cfg.head_dim, 0.9, jnp.float32,
        partition_manager=pm, num_pages_per_layer=96,
    )  # fmt: skip  # batch_size=3: three sequence slots for six requests
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
    manager = easykv.PageManager(meta)
    requests = make_requests(6, 4, seed=3)
    seen_active = []
    engine = Engine(model, cache, manager, token_budget=32, max_seqs=3, prefill_chunk=16)
    engine.run(requests, on_step=lambda eng, _: seen_active.append(eng.manager.metrics.active_sequences))
    assert max(seen_active) == 3  # the slots were the bottleneck
    assert requests[-1].fork_of == 0 and len(requests[-1].output) == requests[-1].max_new_tokens
    assert engine.copies >= 1
    for r in requests:
        assert r.output == reference_generate(model, r, max_len=128, dtype=jnp.float32), r.rid


@SLOW
def test_the_hybrid_demo_checks_its_windows():
    """The default demo model is hybrid (sliding window 32 + full attention, scanned): the paged
    run equals a dense reference that masks each sliding layer to its window, and a reference
    that forgets the window disagrees, so the check would catch a cache that read too far back."""
    import jax.numpy as jnp

    from easykv.demo.engine import reference_generate
    from easykv.demo.model import CompiledModel, DemoModel

    report = run_demo(DemoOptions(requests=4, max_new_tokens=8, progress=False))
    assert report.matched and "sliding layers' pages used" in report.text
    cfg = demo_run.MODELS["hybrid"]
    assert cfg.scan and cfg.layer_groups()[0].attention == "sliding"
    unwindowed = CompiledModel(DemoModel(dataclasses.replace(cfg, window=10**6, scan=False)))
    model = CompiledModel(DemoModel(cfg))
    from easykv.demo.workload import make_requests

    requests = make_requests(4, 8, seed=0)
    differ = [r.rid for r in requests
              if reference_generate(model, r, max_len=256, dtype=jnp.float32)
              != reference_generate(unwindowed, r, max_len=256, dtype=jnp.float32)]
    assert differ  # prompts of ~120 tokens: a window of 32 changes the greedy tokens


def test_scanned_and_unrolled_steps_give_the_same_logits_and_pages():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import easykv
    from easykv.demo.model import CompiledModel, DemoConfig, DemoModel
    from easykv.sharding import PartitionAxis, PartitionManager, create_mesh

    cfg = DemoConfig(layers=4, pattern="SF", window=12, scan=True)
    mesh, pm = create_mesh({"tp": 8}), PartitionManager(PartitionAxis())
    groups = tuple(dataclasses.replace(g, num_pages=48) for g in cfg.layer_groups())
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 2, cfg.layers, 64, 8, cfg.kv_heads, cfg.head_dim, 0.9,
                                                     jnp.float32, partition_manager=pm, layer_groups=groups)
    out = {}
    tokens = jnp.arange(32, dtype=jnp.int32) % 200
    for scan in (True, False):
        model = CompiledModel(DemoModel(dataclasses.replace(cfg, scan=scan)))
        cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm)
        manager = easykv.PageManager(meta)
        runner = easykv.Runner(manager, cache)
        a, b = manager.claim(2)
        logits = []

        def step(cache, plan, model=model):
            step_logits, cache = model.paged_step(cache, tokens, plan.metadata)
            return cache, step_logits

        for counts in ([20, 9], [1, 1], [1, 1]):  # prefill past the window, then decodes
            plan = manager.schedule([a, b], counts, pad_tokens_to=32, pad_seqs_to=2)
            step_logits = runner.run(plan, step)  # committed without ids: the planned tokens
            logits.append(np.asarray(step_logits)[: sum(counts)])
        cache = runner.cache
        out[scan] = logits, [np.asarray(x) for x in jax.tree.leaves((cache.key_pages, cache.value_pages))]
    for x, y in zip(out[True][0], out[False][0]):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    for x, y in zip(out[True][1], out[False][1]):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


# ---- trained weights -----------------------------------------------------------------------------
def test_the_shipped_weights_fit_their_models_and_say_how_they_were_trained():
    from easykv.demo.weights import param_shapes, read_weights, shipped_weights

    for name, cfg in demo_run.MODELS.items():
        path = shipped_weights(name)
        assert path.stat().st_size < 3.5 * 2**20, name  # commit-sized
        params, training = read_weights(path, cfg)
        assert {k: v.shape for k, v in params.items()} == param_shapes(cfg)
        assert all(v.dtype == np.float32 for v in params.values())
        assert len(training["corpus_sha256"]) == 64 and not training["quick"]
        assert training["heldout_bits_per_byte"] < 3.0, training  # far below 8 (random bytes): it learned English


def _rewritten(tmp_path, edit):
    """The shipped hybrid weights with ``edit(arrays)`` applied, saved to a new .npz."""
    from easykv.demo.weights import shipped_weights

    with np.load(shipped_weights("hybrid"), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    edit(arrays)
    path = tmp_path / "bad.npz"
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def _set(key, value):
    return lambda arrays: arrays.__setitem__(key, value)


def _other_config(arrays):
    import json

    cfg = json.loads(str(arrays["config"]))
    arrays["config"] = np.array(json.dumps({**cfg, "window": 16}))


@pytest.mark.parametrize("edit, words", [
    (_set("blocks.1.q.kernel", np.zeros((128, 64), np.float16)), "'blocks.1.q.kernel' is float16 of shape (128, 64)"),
    (lambda a: a.pop("blocks.3.down.kernel"), "missing key(s) ['blocks.3.down.kernel']"),
    (_set("blocks.9.q.kernel", np.zeros((128, 128), np.float16)), "unexpected key(s) ['blocks.9.q.kernel']"),
    (_other_config, "fields ['window'] differ"),
    (_set("norm.scale", np.zeros(128, np.int32)), "'norm.scale' is int32"),
    (_set("norm.scale", np.full(128, np.nan, np.float16)), "'norm.scale' holds inf or nan"),
    (_set("config", np.array(b"{}")), "'config' must be a JSON string"),
    (lambda a: a.pop("training"), "missing key(s) ['training']"),
    (_set("norm.scale", np.array([{"pickled": 1}] * 128, dtype=object)), "'norm.scale' is object"),  # never unpickled
    (_set("training", np.array("[1, 2]")), "must be JSON objects"),
], ids=["shape", "missing", "extra", "config", "dtype", "nan", "config-not-json-text", "no-record", "pickle",
        "record-not-object"])  # fmt: skip
def test_a_weights_file_that_does_not_fit_is_refused_by_name_before_the_demo_starts(tmp_path, monkeypatch, edit,
                                                                                     words):
    from easykv.demo.weights import read_weights

    path = _rewritten(tmp_path, edit)
    with pytest.raises(ValueError, match="rerun tools/train_demo_model.py") as err:
        read_weights(path, demo_run.MODELS["hybrid"])
    assert words in str(err.value)

    def no_mesh(*args, **kwargs):
        raise AssertionError("the demo started before refusing the weights")

    monkeypatch.setattr(demo_run, "create_mesh", no_mesh)
    with pytest.raises(ValueError, match="rerun tools/train_demo_model.py"):
        run_demo(DemoOptions(weights=str(path), progress=False))


@pytest.mark.parametrize("content", [b"not a zip file at all", b"PK\x03\x04 cut short", None],
                         ids=["text", "zip", "npy"])
def test_a_file_that_is_no_npz_is_refused(tmp_path, content):
    from easykv.demo.weights import read_weights

    path = tmp_path / "w.npz"
    if content is None:
        with open(path, "wb") as f:
            np.save(f, np.zeros(3))  # an .npy: one array, no keys
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=r"w\.npz: (cannot read|not an \.npz).*rerun tools/train_demo_model.py"):
        read_weights(path, demo_run.MODELS["hybrid"])
    with pytest.raises(ValueError, match="cannot read demo weights"):
        read_weights(tmp_path / "absent.npz", demo_run.MODELS["hybrid"])


def test_the_trained_model_continues_the_demo_prompt_in_readable_text():
    """Request 1 of the default demo (its sample) generated by the trained model with the dense
    reference: the engine must produce the same tokens (the slow test below runs it)."""
    import jax.numpy as jnp

    from easykv.demo.engine import reference_generate
    from easykv.demo.model import CompiledModel
    from easykv.demo.workload import decode, make_requests

    defaults = DemoOptions()
    assert defaults.weights == "trained"
    model = CompiledModel(demo_run.demo_model(defaults.model, defaults.weights))
    request = make_requests(defaults.requests, defaults.max_new_tokens, seed=defaults.seed)[1]
    text = decode(reference_generate(model, request, max_len=256, dtype=jnp.float32))
    assert demo_run.readable_fraction(text) >= 0.8, text


@SLOW
@pytest.mark.parametrize("options", [{}, {"quant": "int8", "requests": 6}, {"dtype": "bfloat16", "requests": 6},
                                     {"model": "uniform", "requests": 6}],
                         ids=["default", "int8", "bfloat16", "uniform"])
def test_the_demo_with_trained_weights_matches_and_reads_as_text(options):
    """The default demo (and, with fewer requests, its quantized, bfloat16 and uniform-model
    variants): every token is the dense reference's and the sample reads as text."""
    report = run_demo(DemoOptions(progress=False, **options))
    assert report.matched, report.text
    assert report.readable >= 0.8 and f"sample (request 1): {report.sample!r}" in report.text, report.text
    assert report.prefix_hit_rate > 0 and report.copies >= 1


def test_readable_fraction_counts_letters_spaces_and_punctuation():
    assert demo_run.readable_fraction("a b, c.\n") == 1.0
    assert demo_run.readable_fraction("ab12") == 0.5  # digits are not text a person reads as words
    assert demo_run.readable_fraction("a\ufffd\x08j") == 0.5
    assert demo_run.readable_fraction("") == 0.0


@SLOW
def test_the_training_script_runs_quick(tmp_path):
    from pathlib import Path

    from easykv.demo.weights import read_weights

    script = Path(__file__).resolve().parents[2] / "tools" / "train_demo_model.py"
    out = tmp_path / "quick.npz"
    done = subprocess.run([sys.executable, str(script), "--quick", "--out", str(out)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sha256" in done.stdout and "held out" in done.stdout and "steps: 3" in done.stdout
    _, training = read_weights(out, demo_run.MODELS["hybrid"])
    assert training["quick"] and training["steps"] == 3
    refused = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "give --out" in refused.stderr  # never overwrites the shipped file


@SLOW
def test_a_second_demo_serves_the_shared_opening_from_the_store(tmp_path, capsys):
    """Two demo runs on one file store (issue 44): the first writes every page it fills, the second (a new cache,
    its host tier empty) reads the shared opening from the store, and its tokens still equal the dense reference's."""
    url = f"file://{tmp_path / 'store'}"
    options = DemoOptions(requests=5, max_new_tokens=6, progress=False, store=url)
    first = run_demo(dataclasses.replace(options, checkpoint_dir=str(tmp_path / "ck1")))
    assert first.matched and first.store is not None
    assert first.store.values_written > 0 and first.store.pages_read == 0 and first.store.tokens_served == 0
    second = run_demo(dataclasses.replace(options, checkpoint_dir=str(tmp_path / "ck2")))
    out = capsys.readouterr().out
    assert second.matched and second.store is not None
    assert second.store.pages_read > 0 and second.store.tokens_served >= 8 * second.store.pages_read // 2
    assert second.store.refused == second.store.failures == second.store.dropped == 0
    assert second.prefix_hit_rate > first.prefix_hit_rate
    assert second.sample == first.sample  # the same tokens with pages from the store
    assert "prompt tokens served from the store, 0 entries refused" in out and url in out
