"""`easykv demo` end to end: generation through the paged cache equals the dense-cache
reference, the checkpoint midway restores onto another mesh, and a mismatch is caught."""

import subprocess
import sys

import easykv.demo.run as demo_run
from easykv.demo.run import DemoOptions, run_demo


def test_demo_matches_dense_reference_and_catches_a_mismatch(monkeypatch, tmp_path, capsys):
    real = demo_run.reference_generate
    seen = {}

    def reference_with_one_wrong(model, request, **kwargs):
        tokens = real(model, request, **kwargs)
        seen[request.rid] = tokens
        return tokens if request.rid != 2 else [(tokens[0] + 1) % 256, *tokens[1:]]

    monkeypatch.setattr(demo_run, "reference_generate", reference_with_one_wrong)
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


def test_easykv_demo_command_succeeds(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "easykv.cli", "demo", "--requests", "3", "--max-new-tokens", "4", "--no-progress",
         "--quant", "int8", "--checkpoint-dir", str(tmp_path / "ck")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "check: greedy tokens of all 3 requests equal the dense-cache reference" in done.stdout
    assert "quantizer int8" in done.stdout


def test_engine_under_slot_pressure_keeps_the_fork_and_matches_reference():
    """More requests than sequence slots: admissions wait for releases, the fork still gets a
    slot at its fork point, and every request equals the dense reference."""
    import jax.numpy as jnp

    import easykv
    from easykv.demo.engine import Engine, reference_generate
    from easykv.demo.model import CompiledModel, DemoConfig, DemoModel
    from easykv.demo.workload import make_requests
    from sharding import PartitionAxis, PartitionManager, create_mesh

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
