"""Checkpoints written before stacked storage (format 2, and format 1 of easykv 0.1: one page
array per layer) restore into today's stacked caches: the fixture in
``tests/checkpoint/fixtures/checkpoint_v2_layers`` was written by easykv e42ee6d
(``make_checkpoint_v2_layers.py`` there); every gathered token must equal what that
code gathered before saving, on the mesh it was saved from and on another, and a migrated cache
saves again in format 3 bit-exact."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

import easykv
from easykv import PagedAttentionCacheMetaData, gather_kv
from easykv.checkpoint.inspect import inspect_checkpoint
from easykv.cli import main
from easykv.errors import CheckpointIntegrityError
from easykv.quantization import QuantizedPages
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh
from tests.support.checkpoints import load_record, make_legacy, manager_path, write_record

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoint_v2_layers"
LAYERS = 3
CACHES = {  # name -> the mesh it was saved from
    "bf16_dp2": {"dp": 2, "tp": 4},
    "int8_dp4tp2": {"dp": 4, "tp": 2},
}
DP = PartitionManager(PartitionAxis(page_axis="dp"))


@pytest.fixture(scope="module")
def want():
    with np.load(FIXTURE / "expected.npz") as data:
        return dict(data)


def _restore(directory, dims, **kw):
    return easykv.restore_cache(directory, mesh=create_mesh(dims), partition_manager=DP, **kw)


def _check_tokens(name, want, cache, manager):
    seqs = want[f"{name}/seq_ids"].tolist()
    lengths, table = want[f"{name}/lengths"], want[f"{name}/page_tables"]
    assert sorted(manager.active_ids) == seqs and [manager.length(s) for s in seqs] == lengths.tolist()
    assert np.array_equal(manager.page_table(seqs), table)
    for layer in range(LAYERS):
        for i, s in enumerate(seqs):
            k, v = gather_kv(cache, layer, table[i], int(lengths[i]))
            for side, got in (("keys", k), ("values", v)):
                assert np.array_equal(np.asarray(got, np.float32), want[f"{name}/{side}/{layer}/{s}"]), (
                    name, side, layer, s)


@pytest.mark.parametrize("name", list(CACHES))
def test_format_2_restores_stacked_and_saves_as_format_3(name, want, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # format 2 is no legacy: no warning
        restored = _restore(FIXTURE / name, CACHES[name])
    cache, manager = restored
    meta = PagedAttentionCacheMetaData.from_json(str(want[f"{name}/metadata_json"]))
    assert restored.saved_metadata == meta == cache.metadata
    assert manager.state_dict() == json.loads(str(want[f"{name}/manager_state_json"]))
    # The layers are now one stack per K and V, the stored bits those of the per-layer arrays.
    k = cache.key_pages[0]
    leaf = k.values if isinstance(k, QuantizedPages) else k
    assert len(cache.key_pages) == 1 and leaf.shape[:3] == (LAYERS, 2, meta.num_pages_per_layer)
    part = "values" if isinstance(k, QuantizedPages) else "pages"
    for layer in range(LAYERS):
        raw = np.asarray(leaf[layer])
        assert np.array_equal(raw.view(f"u{raw.dtype.itemsize}"), want[f"{name}/raw/{layer}/key_{part}"])
    _check_tokens(name, want, cache, manager)
    # Saved again: format 3, one stacked array per K and V (and per part when quantized).
    easykv.save_cache(tmp_path, cache, manager)
    record = load_record(tmp_path)
    assert record["format_version"] == 3
    assert [a["name"].split(".")[0] for a in record["arrays"]] == ["group_000"] * len(record["arrays"])
    again, manager2 = _restore(tmp_path, CACHES[name])
    _check_tokens(name, want, again, manager2)


def test_format_2_restores_onto_another_mesh(want):
    cache, manager = easykv.restore_cache(FIXTURE / "bf16_dp2", mesh=create_mesh({"tp": 8}),
                                          partition_manager=PartitionManager(PartitionAxis()))
    assert cache.key_pages[0].sharding.spec[0] is None  # the layer axis is never split
    _check_tokens("bf16_dp2", want, cache, manager)


def test_format_2_damage_is_named_by_its_layer_array(tmp_path):
    directory = tmp_path / "ck"
    shutil.copytree(FIXTURE / "bf16_dp2", directory)
    record = load_record(directory)
    assert record["format_version"] == 2 and record["arrays"][3]["name"] == "layer_001.value_pages"
    record["arrays"][3]["fingerprint"] = "0" * 32
    write_record(directory, record)
    with pytest.raises(CheckpointIntegrityError, match="layer_001.value_pages") as err:
        _restore(directory, CACHES["bf16_dp2"])
    assert err.value.array == "layer_001.value_pages"
    assert "DAMAGED" in inspect_checkpoint(directory)


def test_version_1_checkpoint_restores_with_a_warning_and_consistency_checks(tmp_path, want):
    directory = tmp_path / "ck"
    shutil.copytree(FIXTURE / "bf16_dp2", directory)
    make_legacy(directory)
    dims = CACHES["bf16_dp2"]
    with pytest.warns(UserWarning, match="format version 1.*checked for consistency only"):
        cache, manager = _restore(directory, dims)
    _check_tokens("bf16_dp2", want, cache, manager)
    report = inspect_checkpoint(directory)
    assert "format version 1" in report and "verify   OK" in report
    assert main(["inspect", str(directory)]) == 0
    # Consistency checks: the manager summary, its presence, the schema; the arrays' fingerprints.
    state = json.loads(manager_path(directory).read_text())
    state["sequences"][0]["length"] += 1
    manager_path(directory).write_text(json.dumps(state))
    with pytest.warns(UserWarning), pytest.raises(CheckpointIntegrityError, match="does not match the record's sum"):
        _restore(directory, dims)
    manager_path(directory).unlink()
    with pytest.warns(UserWarning), pytest.raises(CheckpointIntegrityError, match="is missing"):
        _restore(directory, dims)
    record = load_record(directory)
    record["manager_sha256"] = None  # a field version 1 never had
    write_record(directory, record, reseal=False)
    with pytest.raises(CheckpointIntegrityError, match="unknown"):
        _restore(directory, dims)
    record = load_record(directory)
    del record["manager_sha256"]
    record["arrays"][0]["shape"][0] = "2"
    write_record(directory, record, reseal=False)
    with pytest.raises(CheckpointIntegrityError, match=r"arrays\[0\].shape\[0\]"):
        _restore(directory, dims)
