"""The restore's reader (`easykv.checkpoint.reader`): every shard read straight into its device
buffer and checksummed as read. Checked against checkpoints written by the code before it
(``fixtures/checkpoint_v3``, saved by 3d8cc3c through orbax with ``zlib.crc32`` fingerprints):
every stored bit comes back on the saving mesh and on another, and damage is still named. Then
crafted chunk files that must be refused before they are read (a FIFO would block, a sparse file
make the read allocate), chunk files swapped between shards, ISA-L's CRC against zlib's, and
orbax's own restore of a step saved today against what easykv reads back."""

from __future__ import annotations

import json
import os
import shutil
import warnings
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv.checkpoint.inspect import inspect_checkpoint
from easykv.checkpoint.integrity import FINGERPRINT_ALGORITHM, fingerprints, host_cells
from easykv.errors import CheckpointIntegrityError
from easykv.sharding import PartitionAxis, PartitionManager, ShardingAdjustedWarning, create_mesh
from tests.support.checkpoints import new_qcache, qsetup, raw_leaves

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoint_v3"
ARRAYS = {  # cache -> its arrays (expected.npz holds them in jax.tree.leaves order, the record by group)
    "bf16_hybrid": ["group_000.key_pages", "group_001.key_pages", "group_000.value_pages", "group_001.value_pages"],
    "int8": ["group_000.key_pages.values", "group_000.key_pages.scales", "group_000.value_pages.values",
             "group_000.value_pages.scales"],
}
MESHES = {  # the saving mesh (pages over dp) and tp=8 with pages unsplit (heads replicated where they do not divide)
    "saved": ({"dp": 2, "tp": 4}, PartitionAxis(page_axis="dp")),
    "tp8": ({"tp": 8}, PartitionAxis()),
}


@pytest.fixture(scope="module")
def want():
    with np.load(FIXTURE / "expected.npz") as data:
        return dict(data)


def _restore(directory, where="saved", **kw):
    dims, axis = MESHES[where]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        return easykv.restore_cache(directory, mesh=create_mesh(dims), partition_manager=PartitionManager(axis), **kw)


def _copy(name, tmp_path) -> Path:
    directory = tmp_path / name
    shutil.copytree(FIXTURE / name, directory)
    return directory


@pytest.mark.parametrize("where", list(MESHES))
@pytest.mark.parametrize("name", list(ARRAYS))
def test_checkpoints_of_the_orbax_reader_restore_bit_for_bit(name, where, want):
    restored = _restore(FIXTURE / name, where)
    record = json.loads((FIXTURE / name / "0" / "easykv" / "checkpoint.json").read_text())
    assert record["fingerprint_algorithm"] == FINGERPRINT_ALGORITHM == "cellcrc32-sha256/1"
    assert sorted(e["name"] for e in record["arrays"]) == sorted(ARRAYS[name])
    got = raw_leaves(restored.cache)
    assert len(got) == len(ARRAYS[name])
    for i, bits in enumerate(got):
        assert np.array_equal(bits, want[f"{name}/{i}"]), (name, where, i)
    assert restored.extra_metadata["easykv_commit"] == "3d8cc3c"
    assert f"verify   OK: {len(got)} arrays match their fingerprints" in inspect_checkpoint(FIXTURE / name, verify=True)


@pytest.mark.parametrize("name", list(ARRAYS))
def test_a_flipped_bit_in_an_old_checkpoint_is_named(name, tmp_path):
    directory = _copy(name, tmp_path)
    array = ARRAYS[name][-1]
    chunk = sorted((directory / "0" / "pages" / array).glob("[0-9]*"))[-1]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 3] ^= 0x10
    chunk.write_bytes(bytes(data))
    for where in MESHES:
        with pytest.raises(CheckpointIntegrityError, match=array.replace(".", r"\.")) as err:
            _restore(directory, where)
        assert err.value.array == array and "does not match the fingerprint" in str(err.value)
    _restore(directory, verify=False)  # explicit: the damage is then the caller's to own


def test_chunk_files_swapped_between_shards_are_named(tmp_path, want):
    """Two chunks of one array, the same size: every byte is intact, only their places moved."""
    directory = _copy("bf16_hybrid", tmp_path)
    pages = directory / "0" / "pages" / "group_000.value_pages"
    a, b = pages / "0.0.0.0.0", pages / "0.1.0.0.0"
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
    tmp = pages / "swap"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    with pytest.raises(CheckpointIntegrityError, match=r"group_000\.value_pages of step 0 .* does not match"):
        _restore(directory)


CRAFTED = ["fifo", "dev-zero", "sparse-huge", "one-byte-more", "one-byte-less", "directory", "missing", "renamed",
           "link-to-a-copy"]


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("kind", CRAFTED)
def test_a_chunk_that_is_not_one_chunk_in_a_regular_file_is_refused_before_reading(kind, verify, tmp_path):
    directory = _copy("int8", tmp_path)
    array = "group_000.value_pages.values"
    chunk = sorted((directory / "0" / "pages" / array).glob("[0-9]*"))[0]
    size = chunk.stat().st_size
    data = chunk.read_bytes()
    chunk.unlink()
    if kind == "fifo":
        os.mkfifo(chunk)  # reading it would block forever
    elif kind == "dev-zero":
        chunk.symlink_to("/dev/zero")
    elif kind == "sparse-huge":
        with open(chunk, "wb") as f:
            f.truncate(1 << 33)
    elif kind == "directory":
        chunk.mkdir()
    elif kind == "missing":
        pass  # it would read as zeros
    elif kind == "renamed":
        chunk.with_name("zzz").write_bytes(data)  # left unread, its place read as zeros
    elif kind == "link-to-a-copy":
        (tmp_path / "elsewhere").write_bytes(data)
        chunk.symlink_to(tmp_path / "elsewhere")  # easykv writes no links: refused, not followed
    else:
        chunk.write_bytes(data + b"\0" if kind == "one-byte-more" else data[:-1])
    with pytest.raises(CheckpointIntegrityError, match=array.replace(".", r"\.")) as err:
        _restore(directory, verify=verify)
    assert err.value.array == array
    why = {"fifo": "it is a FIFO", "dev-zero": "it is a link", "directory": "it is a directory",
           "link-to-a-copy": "it is a link", "missing": f"['{chunk.name}'] are missing",
           "renamed": "['zzz'] are not among them"}.get(kind, f"not a regular file of one chunk's {size} bytes")
    assert why in str(err.value)


ZARRAY_EDITS = {  # each a .zarray that tensorstore opens, but that easykv never writes
    "compressor": {"compressor": {"id": "zlib", "level": 1}},
    "order": {"order": "F"},
    "shape": {"shape": [2, 4, 8, 4, 9], "chunks": [2, 4, 8, 4, 9]},
    "dtype": {"dtype": "<i2"},
    "filters": {"filters": [{"id": "delta", "dtype": "<u2"}]},
    "byte order": {"dtype": ">u2"},  # tensorstore would byte-swap every value
    "structured dtype": {"dtype": [["a", "<u2"]]},  # a list: refused by name, not a TypeError
    "separator": {"dimension_separator": "/"},  # chunks looked up as 0/0/0/0/0: zeros
    "chunks regridded": {"chunks": [2, 1, 8, 2, 8]},  # same bytes and count per chunk, other places
    "one-element chunks": {"chunks": [1, 1, 1, 1, 1]},  # a grid as large as the array (issue 42)
    "fill value": {"fill_value": 0},  # a missing chunk would read as this
    "zarr format": {"zarr_format": 3},
    "an unknown field": {"attributes": {"a": 1}},
    "no separator": {"dimension_separator": None},  # the key removed: zarr's default is "."
}


@pytest.mark.parametrize("edit", list(ZARRAY_EDITS))
def test_a_zarray_that_is_not_what_easykv_writes_is_refused(edit, tmp_path):
    directory = _copy("bf16_hybrid", tmp_path)
    path = directory / "0" / "pages" / "group_001.key_pages" / ".zarray"
    zarray = {**json.loads(path.read_text()), **ZARRAY_EDITS[edit]}
    path.write_text(json.dumps({k: v for k, v in zarray.items() if v is not None or k != "dimension_separator"}))
    with pytest.raises(CheckpointIntegrityError, match=r"group_001\.key_pages .*\.zarray is not the one") as err:
        _restore(directory, verify=False)
    assert err.value.array == "group_001.key_pages"


@pytest.mark.parametrize("kind", ["fifo", "sparse-huge"])
@pytest.mark.parametrize("name", ["_METADATA", "group_000.key_pages.values/.zarray"])
def test_a_metadata_file_that_is_not_a_small_regular_file_is_refused(name, kind, tmp_path):
    """A FIFO would block the read forever, a sparse 8 GiB file fill memory."""
    directory = _copy("int8", tmp_path)
    path = directory / "0" / "pages" / name
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        with open(path, "wb") as f:
            f.truncate(1 << 33)
    for verify in (True, False):
        with pytest.raises(CheckpointIntegrityError, match="not a regular file" if kind == "fifo" else "more than"):
            _restore(directory, verify=verify)


def test_orbax_tree_metadata_must_stay_readable(tmp_path):
    directory = _copy("int8", tmp_path)
    (directory / "0" / "pages" / "_METADATA").write_text("{not json")
    with pytest.raises(CheckpointIntegrityError, match="orbax's metadata of the pages of step 0"):
        _restore(directory)
    assert "DAMAGED" in inspect_checkpoint(directory, verify=True)


# ---- the checksum itself ------------------------------------------------------------------------
@pytest.mark.parametrize("cell_bytes", [1, 3, 4, 64, 4096, 4099])
def test_host_cells_are_zlib_crc32_of_each_cell(cell_bytes):
    rng = np.random.default_rng(cell_bytes)
    block = rng.integers(0, 256, size=(2, 3, 5, cell_bytes), dtype=np.uint8)
    cells = host_cells(block, FINGERPRINT_ALGORITHM, 3)
    assert cells.shape == (2, 3, 5) and cells.dtype == np.uint32
    for idx in np.ndindex(2, 3, 5):
        assert int(cells[idx]) == zlib.crc32(block[idx].tobytes())
    # the device kernel (GPU/TPU, other processes' shards) computes the same cells
    assert fingerprints([block], grid=3) == fingerprints([jnp.asarray(block)], grid=3, on_device=True)


@pytest.mark.parametrize("quantizer", ["none", "int8"])
def test_orbax_itself_reads_the_bits_easykv_writes_and_reads(quantizer, tmp_path):
    """The reference nobody here wrote: orbax's own restore of a step easykv saved today returns,
    array by array, the bits that easykv's reader returns and that were saved."""
    import orbax.checkpoint as ocp

    rng = np.random.default_rng(7)
    cache = new_qcache("dp", quantizer)  # pages over dp, heads over tp: shards on both axes
    leaves = [jax.device_put(rng.integers(0, 256, size=x.nbytes, dtype=np.uint8).view(x.dtype).reshape(x.shape),
                             x.sharding) for x in jax.tree.leaves(cache)]
    cache = jax.tree.unflatten(jax.tree.structure(cache), leaves)
    easykv.save_cache(tmp_path / "ck", cache)
    record = json.loads((tmp_path / "ck" / "0" / "easykv" / "checkpoint.json").read_text())
    pages = (tmp_path / "ck" / "0" / "pages").resolve()
    meta = ocp.PyTreeCheckpointer().metadata(pages).item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    theirs = ocp.PyTreeCheckpointer().restore(pages, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    mesh, pm, _ = qsetup("dp", quantizer)
    ours = raw_leaves(easykv.restore_cache(tmp_path / "ck", mesh=mesh, partition_manager=pm).cache)
    saved = raw_leaves(cache)
    assert len(record["arrays"]) == len(ours) == len(saved) >= 2
    for i, entry in enumerate(record["arrays"]):  # the record lists arrays in jax.tree.leaves order
        node = theirs
        for key in entry["path"]:
            node = node[key]
        bits = np.asarray(node).view(saved[i].dtype)
        assert np.array_equal(bits, saved[i]) and np.array_equal(ours[i], saved[i]), entry["name"]


@pytest.mark.parametrize("where", list(MESHES))
def test_restored_cpu_pages_are_donated_in_place_by_the_first_write(where):
    """The read fills buffers XLA allocated: a buffer XLA:CPU merely adopted cannot be donated,
    and the first donated write would copy the whole pool (tp8 replicates heads: the shards
    copied to the other devices are XLA's too)."""
    leaves = jax.tree.leaves(_restore(FIXTURE / "bf16_hybrid", where).cache)
    before = [[s.data.unsafe_buffer_pointer() for s in x.addressable_shards] for x in leaves]
    assert len({p for ps in before for p in ps}) == sum(len(ps) for ps in before)  # no two shards alias
    write = jax.jit(lambda t: [x.at[(0,) * x.ndim].set(jnp.zeros((), x.dtype)) for x in t], donate_argnums=0)
    after = [[s.data.unsafe_buffer_pointer() for s in x.addressable_shards] for x in write(leaves)]
    assert after == before


def test_a_failed_read_waits_for_the_read_in_flight_before_its_buffer_is_freed(tmp_path, monkeypatch):
    """The first shard's chunk is truncated: its read fails while the next shard's read is in
    flight, and the reader must wait for that read before the error unwinds (it writes into
    XLA-owned memory, and nothing may go on reading behind the error)."""
    import time

    import easykv.checkpoint.reader as reader

    directory = _copy("bf16_hybrid", tmp_path)
    chunk = directory / "0" / "pages" / "group_000.key_pages" / "0.0.0.0.0"
    chunk.write_bytes(chunk.read_bytes()[:-7])
    original, reads = reader._LocalArray.read, []

    def read(self, index, buf):  # the failing read fails late, the others take longer: one is in flight
        first = all(s.start == 0 for s in index)
        reads.append(("started", first))
        try:
            time.sleep(0.2 if first else 0.4)
            original(self, index, buf)
        finally:
            reads.append(("ended", first))

    monkeypatch.setattr(reader._LocalArray, "read", read)
    with pytest.raises(CheckpointIntegrityError, match=r"group_000\.key_pages of step 0 .*0\.0\.0\.0\.0 is not a "
                       r"regular file of one chunk's \d+ bytes: it holds"):
        _restore(directory)
    assert ("started", False) in reads  # a read was in flight when the first failed ...
    assert reads.count(("started", False)) == reads.count(("ended", False))  # ... and none is left running
