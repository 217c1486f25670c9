"""`easykv plan`: the table's figures, presets, and one-line errors with exit code 2."""

import re

import pytest

from easykv.cli import PRESETS, main, parse_bytes, parse_mesh


def _plan(capsys, *argv):
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _row(out: str, key: str) -> str:
    m = re.search(rf"^  {re.escape(key)}\s+(.*)$", out, re.M)
    assert m, f"row {key!r} missing from:\n{out}"
    return m.group(1)


def test_plan_llama8b_on_a_pod_without_its_devices(capsys):
    # 16 GiB per device, dp=2 x tp=8 with pages split over dp: each device holds 1 of the 8
    # kv heads, so one page costs 2 (K,V) x 1 x 16 x 128 x 2 B x 32 layers = 256 KiB.
    code, out, err = _plan(capsys, "--preset", "llama-3.1-8b", "--mesh", "dp=2,tp=8",
                           "--memory", "16GiB", "--page-axis", "dp")
    assert code == 0 and err == ""
    per_device = 16 * 2**30 // (256 * 2**10)
    assert _row(out, "pages per layer") == f"{2 * per_device} ({per_device} per device)"
    assert _row(out, "bytes per token (all layers)") == "128.00 KiB"
    assert _row(out, "kv heads") == "8 split over ('tp',) -> 1 per device"
    assert _row(out, "sequences of max length").startswith(f"{2 * (per_device // 512)} x 8192 tokens")
    assert _row(out, "mesh") == "dp=2, tp=8 (16 devices)"


def test_plan_reports_replicated_heads(capsys):
    # Qwen2.5-7B has 4 kv heads: on tp=8 every device stores all 4 (bytes really stored).
    code, out, _ = _plan(capsys, "--preset", "qwen2.5-7b", "--mesh", "tp=8", "--memory", "1GiB",
                         "--max-seq", "1024")
    assert code == 0
    assert _row(out, "kv heads") == "replicated: every device stores all 4"
    assert "does not divide 4" in _row(out, "adjustment")
    page_bytes = 2 * 4 * 16 * 128 * 2 * 28
    assert _row(out, "pages per layer") == f"{2**30 // page_bytes} ({2**30 // page_bytes} per device)"


def test_plan_on_local_simulated_devices(capsys):
    code, out, _ = _plan(capsys, "--layers", "2", "--kv-heads", "8", "--head-dim", "64", "--mesh", "tp=8",
                         "--max-seq", "256")
    assert code == 0
    assert "measured device memory" in out
    pages = int(_row(out, "pages per layer").split()[0])
    assert pages >= 16  # the host rule gives this machine room for at least one sequence


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--layers", "2"], "--preset NAME or all of"),
        (["--preset", "nope"], "invalid choice"),
        (["--preset", "mistral-7b", "--memory", "12 parsecs"], "is not a size"),
        (["--preset", "mistral-7b", "--memory", "0"], "must be a positive size"),
        (["--preset", "mistral-7b", "--mesh", "tp:8"], "is not NAME=SIZE"),
        (["--preset", "mistral-7b", "--mesh", "tp=2,tp=4", "--memory", "1GiB"], "twice"),
        (["--preset", "mistral-7b", "--dtype", "int8", "--memory", "1GiB", "--mesh", "tp=8"], "quantizer"),
        (["--preset", "mistral-7b", "--quant", "int3", "--memory", "1GiB", "--mesh", "tp=8"], "unknown quantizer"),
        (["--preset", "mistral-7b", "--utilization", "1.5"], "argument --utilization: 1.5 is out of range; use (0, 1]"),
        (["--preset", "mistral-7b", "--memory", "1MiB", "--mesh", "tp=8"], "lower max_sequences"),
        (["--preset", "mistral-7b", "--mesh", "tp=3"], "device"),
        (["--preset", "mistral-7b", "--page-size", "0", "--memory", "1GiB", "--mesh", "tp=8"],
         "argument --page-size: 0 is out of range; use 1..2147483647"),
    ],
)
def test_bad_flags_give_one_line_and_exit_2(capsys, argv, words):
    code, out, err = _plan(capsys, *argv)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("easykv") and "error:" in lines[0]
    assert words in lines[0]


def test_presets_are_plausible_shapes():
    for name, p in PRESETS.items():
        assert p.layers > 0 and p.num_kv_heads > 0 and p.head_dim in (64, 128, 256, 576), name
        assert sum(g.num_layers for g in p.layer_groups()) == p.layers, name


def test_parsers():
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("1.5G") == 3 * 2**29
    assert parse_bytes("800MB") == 800 * 10**6
    assert parse_bytes("4096") == 4096
    assert parse_mesh("dp=2, tp=4") == {"dp": 2, "tp": 4}
    assert list(parse_mesh("tp=4,dp=2")) == ["tp", "dp"]


# ---- inspect --------------------------------------------------------------------------------
def test_inspect_reports_and_verifies_a_checkpoint(capsys, tmp_path):
    import jax.numpy as jnp

    import easykv
    from easykv.sharding import PartitionAxis, PartitionManager, create_mesh

    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 2, 2, 32, 4, 8, 16, 0.9, jnp.bfloat16,
                                                     partition_manager=pm, num_pages_per_layer=16)  # fmt: skip
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm)
    easykv.save_cache(str(tmp_path / "ck"), cache, easykv.PageManager(meta), step=7)
    code = main(["inspect", str(tmp_path / "ck")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "step 7" in out and "verify   OK: 2 arrays match their fingerprints" in out


def test_inspect_reports_damage_as_text_and_exits_1(capsys, tmp_path):
    """Damaged data, a damaged manager state, a newer format: text and exit code 1, never a
    traceback; an intact step beside them is still reported OK."""
    import json

    import jax.numpy as jnp

    import easykv
    from easykv.checkpoint.record import record_digest
    from easykv.sharding import PartitionAxis, PartitionManager, create_mesh

    mesh = create_mesh({"tp": 8})
    pm = PartitionManager(PartitionAxis())
    meta = easykv.PagedAttentionCacheMetaData.create(mesh, 2, 2, 32, 4, 8, 16, 0.9, jnp.bfloat16,
                                                     partition_manager=pm, num_pages_per_layer=16)  # fmt: skip
    cache = easykv.PagedAttentionCache.init_cache(mesh, jnp.bfloat16, meta, pm)
    directory = tmp_path / "ck"
    for step in range(4):
        easykv.save_cache(str(directory), cache, easykv.PageManager(meta), step=step)
    chunk = directory / "1" / "pages" / "group_000.key_pages" / "0.0.0.0.0"
    chunk.write_bytes(b"\x01" + chunk.read_bytes()[1:])  # the zero pages are no longer zero
    (directory / "2" / "easykv" / "manager.json").write_text("{}")
    record_path = directory / "3" / "easykv" / "checkpoint.json"
    record = json.loads(record_path.read_text())
    record["format_version"] = 7  # what a newer easykv might write, sealed as it would be
    record["record_sha256"] = record_digest(record)
    record_path.write_text(json.dumps(record))
    code = main(["inspect", str(directory)])
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in out + err, err
    report = {block.split()[1].rstrip(":"): block for block in out.split("\n\n")[1:]}
    assert "verify   OK" in report["0"]
    assert "DAMAGED" in report["1"] and "group_000.key_pages" in report["1"]
    assert "DAMAGED" in report["2"] and "manager.json does not match" in report["2"]
    assert "UNREADABLE" in report["3"] and "upgrade easykv" in report["3"]


def test_inspect_of_a_plain_directory_is_a_one_line_error(capsys, tmp_path):
    code = main(["inspect", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("easykv inspect: error:")


# ---- demo flags (the run itself is in test_demo.py) --------------------------------------------
@pytest.mark.parametrize(
    "argv, words",
    [
        (["--requests", "0"], "argument --requests: 0 is out of range; use 1..64"),
        (["--max-new-tokens", "1"], "argument --max-new-tokens: 1 is out of range; use 2..128"),
        (["--seed", "-1"], "argument --seed: -1 is out of range; use 0..4294967295"),
        (["--quant", "int3"], "unknown quantizer"),
        (["--dtype", "float64"], "invalid choice"),
        (["--mesh", "tp8"], "is not NAME=SIZE"),
        (["--weights", "/nonexistent/w.npz"], "cannot read demo weights"),
    ],
)
def test_demo_bad_flags_give_one_line_and_exit_2(capsys, argv, words):
    code = main(["demo", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words in err[0], err


def test_plan_shows_a_host_tier(capsys):
    assert main(["plan", "--preset", "llama-3.1-8b", "--memory", "16GiB", "--mesh", "tp=8",
                 "--host-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    # 64 GiB over 8 devices: 8 GiB each; a page of 32 layers, 1 kv head per device, 16 x 128 x 2 x 2 bytes = 256 KiB
    assert "host tier                               32768 pages per layer (524,288 tokens), 8.00 GiB" in out
    assert main(["plan", "--preset", "llama-3.1-8b", "--memory", "16GiB", "--mesh", "tp=8",
                 "--host-memory", "1KB"]) == 2
    assert "holds 0 host page(s)" in capsys.readouterr().err


def test_version_prints_the_package_version(capsys):
    import easykv

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"easykv {easykv.__version__}\n"
