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
