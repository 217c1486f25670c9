"""Checkpoint and restore (easykv.checkpoint.checkpointer): bit-exact round trips for every page
format with a manager mid-run, restore onto other meshes and storage platforms, async saves
under donation, damage detection, crashes mid-save, and every bad input — with the live cache
untouched."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from easykv.checkpoint.checkpointer import CacheCheckpointer, list_steps, restore_cache, save_cache
from easykv.checkpoint.inspect import inspect_checkpoint
from easykv.checkpoint.integrity import (
    LEGACY_FINGERPRINT_ALGORITHM,
    _cell_crcs_device,
    _cell_crcs_host,
    _cell_sums_device,
    _cell_sums_host,
    fingerprints,
)
from easykv.errors import (
    CheckpointIntegrityError,
    CheckpointMismatchError,
    NotACheckpointError,
    StepNotFoundError,
)
from easykv.manager.manager import PageManager
from easykv.quantization import get_quantizer
from easykv.storage.cache import gather_kv
from tests.support.checkpoints import (
    assert_same_bits,
    engine_run,
    new_qcache,
    qsetup,
    raw_leaves,
    write_record,
    write_step,
)
from tests.support.devices import REPO
from tests.support.pools import HEAD_DIM, LAYERS, bits, random_tokens
from tests.support.tiers import tiered

# Reading a damaged file makes orbax drop coroutines that report on garbage collection.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def gathered(cache, manager):
    """Every live sequence's K/V bits per layer, through the manager's page tables."""
    out = {}
    for seq in manager.active_ids:
        row, n = np.asarray(manager.page_table([seq])[0]), manager.length(seq)
        for layer in range(LAYERS):
            k, v = gather_kv(cache, layer, row, n)
            out[seq, layer] = (bits(k), bits(v))
    return out


def continue_run(cache, manager, seed=7):
    """One more mixed step on the restored state: a decode for every live sequence and a new
    sequence that reuses the cached prompt prefix."""
    rng = np.random.default_rng(seed)
    live = manager.active_ids
    [e] = manager.claim(1)
    done = manager.match_prefix(e, list(range(100, 109)))
    return write_step(cache, manager, live + [e], [1] * len(live) + [9 - done],
                      [[200 + s] for s in live] + [list(range(100 + done, 109))], rng)


# ---- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("quantizer", tiered(["none", "int8", "fp8", "int4", "int4-ch", "int4-ol"],
                                              fast={"none", "int8", "int4-ch"}))
def test_round_trip_bit_exact_with_manager_then_continue(tmp_path, quantizer):
    cache, manager, _ = engine_run("heads", quantizer)
    before = raw_leaves(cache)
    step = save_cache(tmp_path, cache, manager, extra_metadata={"model": "tiny", "tokens": [1, 2]})
    assert step == 0 and list_steps(tmp_path) == [0]
    mesh, pm, meta = qsetup("heads", quantizer)
    restored = restore_cache(tmp_path, mesh=mesh, partition_manager=pm)
    assert restored.metadata == meta and restored.saved_metadata == meta
    assert restored.extra_metadata == {"model": "tiny", "tokens": [1, 2]}
    assert restored.saved_mesh["shape"] == {"dp": 1, "tp": 8}
    assert_same_bits(restored.cache, cache)
    assert [x for x in raw_leaves(cache)] and all(np.array_equal(a, b) for a, b in zip(before, raw_leaves(cache)))
    assert restored.manager.state_dict() == manager.state_dict()
    for a, b in zip(jax.tree.leaves(restored.cache), jax.tree.leaves(cache)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim) and a.dtype == b.dtype
    # Continue on both: identical steps give identical pools and reads.
    r_cache, r_mgr = restored
    r_cache = continue_run(r_cache, r_mgr)
    cache = continue_run(cache, manager)
    assert_same_bits(r_cache, cache)
    assert r_mgr.state_dict() == manager.state_dict()
    got, want = gathered(r_cache, r_mgr), gathered(cache, manager)
    assert got.keys() == want.keys() and all(np.array_equal(got[k][i], want[k][i]) for k in got for i in (0, 1))


@pytest.mark.parametrize(("src", "dst", "quant"), tiered(
    [("heads", "dp", "none"), ("heads", "single", "none"), ("dp", "heads", "int8"), ("dp", "heads", "int4-ch"),
     ("single", "dp", "int4-ol")],
    fast={("heads", "dp", "none"), ("dp", "heads", "int8")}))
def test_restore_onto_another_mesh(tmp_path, src, dst, quant):
    cache, manager, _ = engine_run(src, quant)
    quantizer = cache.metadata.quantization
    save_cache(tmp_path, cache, manager)
    mesh, pm, meta = qsetup(dst, quantizer)
    restored = restore_cache(tmp_path, mesh=mesh, partition_manager=pm)
    assert restored.metadata == meta  # layout fields rebuilt for the target mesh
    assert_same_bits(restored.cache, cache)
    layout = restored.cache[0].layout
    for leaf in jax.tree.leaves(restored.cache):
        # the shards landed on the target's devices
        assert leaf.sharding.is_equivalent_to(layout.sharding_for(leaf.ndim), leaf.ndim)
    r_cache, r_mgr = restored
    r_mgr.check_invariants()
    for seq in r_mgr.active_ids:
        pages = r_mgr.pages(seq)
        assert {p // meta.pages_per_shard for p in pages} == {r_mgr.sequence(seq).replica}
    got, want = gathered(r_cache, r_mgr), gathered(cache, manager)
    assert all(np.array_equal(got[k][i], want[k][i]) for k in want for i in (0, 1))
    r_cache = continue_run(r_cache, r_mgr)  # the restored pair keeps working on the new mesh
    r_mgr.check_invariants()
    assert len(gathered(r_cache, r_mgr)) == len(r_mgr.active_ids) * LAYERS


def test_replicated_heads_restore_onto_one_device(tmp_path):
    # 4 kv heads on tp=8: each head is held twice; saved once, restored onto one device.
    cache, manager, _ = engine_run("replicated")
    save_cache(tmp_path, cache, manager)
    mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1])
    restored = restore_cache(tmp_path, mesh=mesh)
    assert restored.metadata.kv_head_shards == 1 and restored.metadata.num_kv_heads == 4
    assert_same_bits(restored.cache, cache)


def test_sequence_straddling_replicas_is_refused(tmp_path):
    cache, manager = new_qcache("heads"), PageManager(qsetup("heads")[2])
    rng = np.random.default_rng(1)
    seqs = manager.claim(4)
    # 11 + 16 + 16 tokens fill pages 0..10; the last sequence gets pages 11 and 12, which a
    # 2-way page split puts in different replicas (12 pages each).
    cache = write_step(cache, manager, seqs[:1], [11], [list(range(11))], rng)
    cache = write_step(cache, manager, seqs[1:2], [16], [list(range(20, 36))], rng)
    cache = write_step(cache, manager, seqs[2:3], [16], [list(range(40, 56))], rng)
    cache = write_step(cache, manager, seqs[3:4], [5], [list(range(60, 65))], rng)
    assert manager.pages(seqs[3]) == [11, 12]
    save_cache(tmp_path, cache, manager)
    mesh, pm, _ = qsetup("dp")
    with pytest.raises(CheckpointMismatchError, match=r"sequence 3.*replicas \[0, 1\]"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm)
    # Without the manager the pages restore; the caller is warned to keep sequences in a slice.
    with pytest.warns(UserWarning, match="one slice"):
        restored = restore_cache(tmp_path, mesh=mesh, partition_manager=pm, restore_manager=False)
    assert restored.manager is None
    assert_same_bits(restored.cache, cache)


def test_pool_that_cannot_be_split_is_refused(tmp_path):
    cache, manager, _ = engine_run("heads")
    save_cache(tmp_path, cache, manager)
    from easykv.sharding import PartitionAxis, PartitionManager, create_mesh

    mesh = create_mesh({"dp": 8, "tp": 1})
    # 24 pages over 8 replicas: 3 per replica, fewer than one sequence (4 pages) needs.
    with pytest.raises(CheckpointMismatchError, match="cannot be laid out"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=PartitionManager(PartitionAxis(page_axis="dp")))


@pytest.mark.parametrize("quantizer", ["none", "fp8"])
def test_storage_bits_cross_platforms(tmp_path, quantizer):
    """CPU stores bf16 / fp8 as raw uint bits; GPU/TPU store them natively. A checkpoint from
    one restores bit-exact on the other (bitcast), both ways."""
    cache, manager, _ = engine_run("heads", quantizer)
    save_cache(tmp_path / "cpu", cache, manager)
    mesh, pm, _ = qsetup("heads", quantizer)
    native = restore_cache(tmp_path / "cpu", mesh=mesh, partition_manager=pm, storage_platform="gpu").cache
    want = np.dtype("bfloat16") if quantizer == "none" else np.dtype("float8_e4m3fn")
    assert jax.tree.leaves(native)[0].dtype == want
    assert_same_bits(native, cache)
    save_cache(tmp_path / "native", native, manager)
    record = json.loads((tmp_path / "native" / "0" / "easykv" / "checkpoint.json").read_text())
    assert record["arrays"][0]["stored_dtype"] == want.name
    back = restore_cache(tmp_path / "native", mesh=mesh, partition_manager=pm).cache
    assert jax.tree.leaves(back)[0].dtype == jax.tree.leaves(cache)[0].dtype
    assert_same_bits(back, cache)


def test_other_format_needs_convert(tmp_path):
    cache, manager, _ = engine_run("heads", "int8")
    save_cache(tmp_path, cache, manager)
    mesh, pm, _ = qsetup("heads")
    with pytest.raises(CheckpointMismatchError, match="convert=True"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm, metadata=qsetup("heads")[2])  # its quantizer: none
    with pytest.raises(CheckpointMismatchError, match="convert=True"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm, dtype="float32")
    restored = restore_cache(tmp_path, mesh=mesh, partition_manager=pm, quantizer="none", convert=True)
    assert restored.metadata.quantization == "none"
    got, want = gathered(restored.cache, restored.manager), gathered(cache, manager)
    # Dequantized pages equal what the int8 cache reads back (same dequantize, same cast).
    assert all(np.array_equal(got[k][i], want[k][i]) for k in want for i in (0, 1))
    requant = restore_cache(tmp_path, mesh=mesh, partition_manager=pm, quantizer="int4", convert=True)
    assert requant.metadata.quantization == "int4"
    k, _ = gather_kv(requant.cache, 0, np.asarray(manager.page_table([0])[0]), manager.length(0))
    ref = want[0, 0][0].view("bfloat16").astype(np.float32)
    assert np.max(np.abs(np.asarray(k, np.float32) - ref)) <= np.max(np.abs(ref)) / 7 + 1e-3
    # Into int4-ol (uint8 side bytes per token): each token quantized from the int8 cache's values.
    outliers = restore_cache(tmp_path, mesh=mesh, partition_manager=pm, quantizer="int4-ol", convert=True)
    k, _ = gather_kv(outliers.cache, 0, np.asarray(manager.page_table([0])[0]), manager.length(0))
    expect = get_quantizer("int4-ol").quantize(jnp.asarray(ref)).dequantize(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(k, np.float32), np.asarray(expect, np.float32))


# ---- async saves and step management -----------------------------------------------------------
def test_async_save_then_donated_writes_keep_the_snapshot(tmp_path):
    cache, manager, rng = engine_run("heads")
    want = raw_leaves(cache)
    state = manager.state_dict()
    with CacheCheckpointer(tmp_path, max_to_keep=2) as ckpt:
        assert ckpt.save(cache, manager, step=5) == 5
        for i in range(3):  # donate the saved buffers right away, while the write is in flight
            cache = write_step(cache, manager, [0], [1], [[300 + i]], rng)
        assert not np.array_equal(raw_leaves(cache)[0], want[0])
        ckpt.save(cache, manager)  # step 6
        ckpt.save(cache, manager)  # step 7; max_to_keep=2 drops step 5
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [6, 7] and ckpt.latest_step() == 7
    mesh, pm, _ = qsetup("heads")
    restored6 = restore_cache(tmp_path, mesh=mesh, partition_manager=pm, step=6)
    assert_same_bits(restored6.cache, cache)
    # The snapshot of step 5 survived the donations: save it again from a fresh run and compare.
    cache5, manager5, _ = engine_run("heads")
    assert all(np.array_equal(a, b) for a, b in zip(raw_leaves(cache5), want)) and manager5.state_dict() == state
    with CacheCheckpointer(tmp_path / "b") as ckpt:
        ckpt.save(cache5, manager5, step=5)
        for i in range(2):
            cache5 = write_step(cache5, manager5, [0], [1], [[300 + i]], rng)
    back = restore_cache(tmp_path / "b", mesh=mesh, partition_manager=pm)
    assert all(np.array_equal(a, b) for a, b in zip(raw_leaves(back.cache), want))
    assert back.manager.state_dict() == state


def test_existing_step_and_bad_save_arguments_write_nothing(tmp_path):
    cache, manager, _ = engine_run("heads")
    save_cache(tmp_path, cache, manager, step=3)
    listing = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError, match="step 3 already exists"):
        save_cache(tmp_path, cache, manager, step=3)
    with pytest.raises(ValueError, match="JSON-safe"):
        save_cache(tmp_path, cache, manager, extra_metadata={"x": object()})
    with pytest.raises(ValueError, match="step must be"):
        save_cache(tmp_path, cache, manager, step=-1)
    other = PageManager(qsetup("dp")[2])
    with pytest.raises(ValueError, match="another pool"):
        save_cache(tmp_path, cache, other)
    with pytest.raises(ValueError, match="PagedAttentionCache"):
        save_cache(tmp_path, raw_leaves(cache), manager)
    assert sorted(os.listdir(tmp_path)) == listing
    assert save_cache(tmp_path, cache) == 4  # next step; without a manager
    assert restore_cache(tmp_path, mesh=qsetup("heads")[0]).manager is None
    plan = manager.schedule([0], [1])
    cache2, _ = cache.write(random_tokens(np.random.default_rng(0), (LAYERS, 1, 8, HEAD_DIM)),
                            random_tokens(np.random.default_rng(1), (LAYERS, 1, 8, HEAD_DIM)), plan.metadata)
    manager.abort(plan)  # the manager as it was: only the cache, donated to that write, is refused
    with pytest.raises(ValueError, match="donated"):
        save_cache(tmp_path, cache, manager)


# ---- damage -------------------------------------------------------------------------------------
def _marked_cache():
    """A cache whose layer-1 value pages hold a distinctive byte pattern (to find on disk)."""
    cache, manager, rng = engine_run("heads")
    plan = manager.schedule([0], [1], pad_tokens_to=1)
    keys = random_tokens(rng, (LAYERS, 1, 8, HEAD_DIM))
    marker = np.arange(8 * HEAD_DIM, dtype=np.uint16).reshape(1, 8, HEAD_DIM) * 0 + 0x3F3D  # 1.0-ish bf16
    marker[0, 0, :4] = [0x1234, 0x5678, 0x1357, 0x2468]
    values = np.stack([random_tokens(rng, (1, 8, HEAD_DIM)), marker.view("bfloat16")])
    cache, _ = cache.write(keys, values, plan.metadata)
    manager.commit(plan, [[999]])
    return cache, manager, np.array([0x1234, 0x5678, 0x1357, 0x2468], "<u2").tobytes()


def _data_files(step_dir: Path) -> list[Path]:
    """The files holding array data (zarr chunks, or OCDBT data files), smallest first."""
    meta = {"commit_success.txt", "manifest.ocdbt"}
    files = [p for p in (step_dir / "pages").rglob("*") if p.is_file() and p.name not in meta
             and not p.name.startswith((".", "_")) and "array_metadatas" not in p.parts]
    return sorted(files, key=lambda p: p.stat().st_size)


def test_flipped_byte_is_detected_and_names_the_array(tmp_path):
    cache, manager, pattern = _marked_cache()
    save_cache(tmp_path, cache, manager)
    hits = [(p, p.read_bytes().find(pattern)) for p in _data_files(tmp_path / "0")]
    path, offset = next((p, o) for p, o in hits if o >= 0)
    blob = bytearray(path.read_bytes())
    blob[offset + 1] ^= 0x01
    path.write_bytes(bytes(blob))
    before = raw_leaves(cache)
    mesh, pm, _ = qsetup("heads")
    with pytest.raises(CheckpointIntegrityError, match="group_000.value_pages") as err:
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm)
    assert err.value.array == "group_000.value_pages" and err.value.step == 0
    assert all(np.array_equal(a, b) for a, b in zip(before, raw_leaves(cache)))  # live cache untouched
    # verify=False returns the damaged data (the fingerprint is the only guard); inspect reports it.
    restore_cache(tmp_path, mesh=mesh, partition_manager=pm, verify=False)
    report = inspect_checkpoint(tmp_path)
    assert "DAMAGED" in report and "group_000.value_pages" in report


def test_truncated_or_missing_data_file_is_an_integrity_error(tmp_path):
    cache, manager, _ = engine_run("heads")
    save_cache(tmp_path, cache, manager, step=0)
    save_cache(tmp_path, cache, manager, step=1)
    biggest = _data_files(tmp_path / "1")[-1]
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    mesh, pm, _ = qsetup("heads")
    with pytest.raises(CheckpointIntegrityError) as err:
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm)
    assert err.value.step == 1 and "restore another step" in str(err.value)
    restore_cache(tmp_path, mesh=mesh, partition_manager=pm, step=0)  # the other step is fine
    shutil.rmtree(tmp_path / "1" / "pages")
    with pytest.raises(CheckpointIntegrityError):
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm, step=1)


def test_damaged_record_and_newer_format(tmp_path):
    cache, manager, _ = engine_run("heads")
    save_cache(tmp_path, cache, manager, step=0)
    record_path = tmp_path / "0" / "easykv" / "checkpoint.json"
    good = record_path.read_text()
    mesh, pm, _ = qsetup("heads")
    record_path.write_text(good[: len(good) // 2])
    with pytest.raises(CheckpointIntegrityError, match="not valid JSON"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm)
    record = json.loads(good)
    record["format_version"] = 99  # what a newer easykv would write (sealed)
    write_record(tmp_path, record)
    with pytest.raises(CheckpointMismatchError, match="upgrade easykv"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm)
    write_record(tmp_path, record, reseal=False)  # the same change as damage: the seal breaks
    with pytest.raises(CheckpointIntegrityError, match="does not match its record_sha256"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm)
    record = json.loads(good)
    record["arrays"][0]["fingerprint"] = "0" * 32
    write_record(tmp_path, record)
    with pytest.raises(CheckpointIntegrityError, match="group_000.key_pages"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm)
    record_path.unlink()
    with pytest.raises(CheckpointIntegrityError, match="lacks easykv/checkpoint.json"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm)


# ---- bad directories, steps and targets ----------------------------------------------------------
def test_not_a_checkpoint_and_missing_steps(tmp_path):
    mesh, pm, meta = qsetup("heads")
    with pytest.raises(NotACheckpointError, match="does not exist"):
        restore_cache(tmp_path / "nope", mesh=mesh)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotACheckpointError, match="is a file"):
        restore_cache(tmp_path / "file", mesh=mesh)
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotACheckpointError, match="not an easykv checkpoint"):
        restore_cache(tmp_path / "empty", mesh=mesh)
    foreign = tmp_path / "foreign"
    with ocp.CheckpointManager(foreign) as mngr:
        mngr.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.ones(3)})))
        mngr.wait_until_finished()
    with pytest.raises(NotACheckpointError, match="not an easykv checkpoint"):
        restore_cache(foreign, mesh=mesh)
    with pytest.raises(NotACheckpointError, match="not easykv checkpoints"):
        CacheCheckpointer(foreign)
    cache, manager, _ = engine_run("heads")
    save_cache(tmp_path / "ok", cache, manager, step=2)
    with pytest.raises(StepNotFoundError, match=r"step 5 .*available steps: \[2\]") as err:
        restore_cache(tmp_path / "ok", mesh=mesh, step=5)
    assert err.value.available == [2]


@pytest.mark.parametrize("field", ["page_size", "num_hidden_layers", "num_kv_heads", "kv_head_dim_size"])
def test_metadata_mismatch_is_refused(tmp_path, field):
    cache, manager, _ = engine_run("heads")
    save_cache(tmp_path, cache, manager)
    mesh, pm, meta = qsetup("heads")
    changes = {"page_size": dict(page_size=8, num_pages_per_sequence=2), "num_hidden_layers": dict(num_hidden_layers=3),
               "num_kv_heads": dict(num_kv_heads=16), "kv_head_dim_size": dict(kv_head_dim_size=16)}[field]
    with pytest.raises(CheckpointMismatchError, match=f"{field}: checkpoint"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm, metadata=meta.replace(**changes))
    assert restore_cache(tmp_path, mesh=mesh, partition_manager=pm, metadata=meta).metadata == meta


# ---- crashes and exits ---------------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import os, sys, time
    from tests.support.devices import configure
    configure()  # 8 CPU devices
    from tests.support.checkpoints import engine_run
    import easykv.checkpoint.checkpointer as ck
    import easykv.checkpoint.format as fmt
    mode, directory = sys.argv[1], sys.argv[2]
    cache, manager, rng = engine_run("heads")
    if mode == "kill":
        ck.save_cache(directory, cache, manager, step=1)
        original = fmt._StateHandler._write
        async def stalled(self, d, args):
            await original(self, d, args)  # the record is written; the step is not committed
            print("PAUSED", flush=True)
            time.sleep(600)
        fmt._StateHandler._write = stalled
        ckpt = ck.CacheCheckpointer(directory)
        ckpt.save(cache, manager, step=2)
        time.sleep(600)
    else:  # exit right after an async save returns, without waiting
        ckpt = ck.CacheCheckpointer(directory)
        ckpt.save(cache, manager, step=1)
        print("RETURNED", flush=True)
""")


def _child(mode: str, directory: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", _CHILD, mode, str(directory)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)


def test_killed_mid_save_leaves_previous_step_restorable(tmp_path):
    proc = _child("kill", tmp_path)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "PAUSED", f"child did not reach the stall: {line!r}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (tmp_path / "easykv_checkpoint.json").exists()
    assert not (tmp_path / "2").exists() and any(".orbax-checkpoint-tmp" in p.name for p in tmp_path.iterdir())
    assert list_steps(tmp_path) == [1]
    mesh, pm, _ = qsetup("heads")
    with pytest.raises(StepNotFoundError, match="interrupted save"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm, step=2)
    restored = restore_cache(tmp_path, mesh=mesh, partition_manager=pm)  # latest complete: 1
    cache, manager, _ = engine_run("heads")
    assert restored.step == 1
    assert_same_bits(restored.cache, cache)
    assert restored.manager.state_dict() == manager.state_dict()
    assert "interrupted save" in inspect_checkpoint(tmp_path, verify=False)
    with CacheCheckpointer(tmp_path) as ckpt:  # a new writer clears the leftovers and saves step 2
        ckpt.save(cache, manager, step=2)
    assert list_steps(tmp_path) == [1, 2]
    assert not any(".orbax-checkpoint-tmp" in p.name for p in tmp_path.iterdir())


def test_clean_exit_finishes_the_async_save(tmp_path):
    proc = _child("exit", tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "RETURNED" in out
    assert list_steps(tmp_path) == [1]
    restored = restore_cache(tmp_path, mesh=qsetup("heads")[0], partition_manager=qsetup("heads")[1])
    cache, _, _ = engine_run("heads")
    assert_same_bits(restored.cache, cache)


# ---- fingerprints and inspect --------------------------------------------------------------------
def test_fingerprint_is_layout_independent_and_sensitive():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**16, size=(8, 24, 4, 8), dtype=np.uint16)
    mesh, pm, meta = qsetup("dp")
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for spec in (P("tp", "dp"), P(None, "dp"), P())]
    digests = {fingerprints([a])[0] for a in placed} | {fingerprints([x])[0]}
    digests |= {fingerprints([placed[0]], on_device=True)[0], fingerprints([x.view("bfloat16")])[0]}
    assert len(digests) == 1
    y = x.copy()
    y[3, 7, 2, 5] ^= 1 << 9
    z = x.copy()
    z[:, [3, 4]] = z[:, [4, 3]]  # two pages swapped
    assert len({fingerprints([a])[0] for a in (x, y, z)}) == 3
    for odd in (rng.integers(0, 255, size=(2, 3, 3), dtype=np.uint8),  # 3-byte cells: trailing bytes
                rng.integers(0, 2**16, size=(2, 3, 4, 5), dtype=np.uint16)):
        assert np.array_equal(_cell_crcs_host(odd), np.asarray(_cell_crcs_device(jax.numpy.asarray(odd))))
        assert np.array_equal(_cell_sums_host(odd), np.asarray(_cell_sums_device(jax.numpy.asarray(odd))))


def test_fingerprint_sees_the_damage_a_word_sum_missed():
    """Two flips of one bit position in opposite directions, and tokens swapped inside a page,
    left the legacy sum of words unchanged; the CRC of each page sees them."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 2**16, size=(4, 6, 4, 8), dtype=np.uint16)
    x[1, 2, 0, 1] |= 0x8000
    x[1, 2, 3, 5] &= 0x7FFF
    flipped = x.copy()
    flipped[1, 2, 0, 1] ^= 0x8000  # 1 -> 0
    flipped[1, 2, 3, 5] ^= 0x8000  # 0 -> 1: the sum of the page's words is unchanged
    swapped = x.copy()
    swapped[2, 4, [0, 1]] = swapped[2, 4, [1, 0]]  # two tokens of one page exchanged
    legacy = {fingerprints([a], algorithm=LEGACY_FINGERPRINT_ALGORITHM)[0] for a in (x, flipped, swapped)}
    assert len(legacy) == 1  # what the old fingerprint could not see
    assert len({fingerprints([a])[0] for a in (x, flipped, swapped)}) == 3


def test_inspect_reports_steps_sizes_mesh_and_verification(tmp_path):
    cache, manager, _ = engine_run("dp", "int4")
    save_cache(tmp_path, cache, manager, step=3, extra_metadata={"run": "abc"})
    report = inspect_checkpoint(tmp_path)
    for text in ("1 complete step(s): 3", "2 layers x 8 kv heads x head_dim 8", "quantization int4",
                 "dp=2 x tp=4", "pages over dp", "3 sequences", '"run": "abc"', "verify   OK: 4 arrays"):
        assert text in report, (text, report)
    assert "skipped" in inspect_checkpoint(tmp_path, verify=False)
    with pytest.raises(NotACheckpointError):
        inspect_checkpoint(tmp_path / "missing")
