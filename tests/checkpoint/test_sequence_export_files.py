"""`SequenceExport.load` / `GroupedSequenceExport.load` of a path read the file through the one
descriptor that was checked (issue 42): a FIFO (``np.load`` of one blocked forever), a device, a
directory or a link to one is refused at once as `FileRefusedError` naming it; so is a file that
holds more than its zip members account for (a huge sparse gap), one that changes while read, and
a compressed member (a few bytes that could claim any size). A file object and bytes still load.
A zip declaring more members than any export holds is refused from its end records before
``zipfile`` parses its directory, a path holding a NUL byte is refused naming it, and a message
lists a few of the names from a file, with their count."""

import io
import json
import os
import pickle
import struct
import time
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

import easykv.checkpoint.export_file as export_file
from easykv.checkpoint.grouped_export import GroupedSequenceExport
from easykv.checkpoint.transfer import SequenceExport
from easykv.errors import FileRefusedError
from tests.support.hostile_files import crafted_zip, finishes_within, hostile_paths, sparse_file


def _export(length: int = 6) -> SequenceExport:
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    shape = (2, length, 2, 8)
    return SequenceExport(length=length, num_hidden_layers=2, num_kv_heads=2, kv_head_dim_size=8, dtype="bfloat16",
                          quantization="none", raw=False, keys=rng.standard_normal(shape).astype(jnp.bfloat16),
                          values=rng.standard_normal(shape).astype(jnp.bfloat16),
                          token_ids=np.arange(length), source_page_size=4)  # fmt: skip


@pytest.mark.parametrize("cls", [SequenceExport, GroupedSequenceExport])
@pytest.mark.parametrize("name", ["fifo", "dev-zero", "directory", "link-to-fifo", "link-to-dev-zero"])
def test_a_path_that_is_no_regular_file_is_refused_at_once_naming_it(tmp_path, cls, name):
    path, words = hostile_paths(tmp_path)[name]
    for given in (path, str(path), str(path).encode()):
        err = finishes_within(lambda g=given: cls.load(g), fifos=(tmp_path / "weights.fifo",))
        assert type(err) is FileRefusedError, err
        assert str(err).startswith(f"{path} {words}") and "the regular .npz file SequenceExport.save writes" in str(
            err), err
        assert err.path == str(path)


def _with_gap(blob: bytes, gap: int) -> tuple[bytes, bytes]:
    """``blob`` (a zip without comment) cut where its central directory starts, and the rest with
    the directory's offset moved ``gap`` bytes on: the two halves of a file with a hole between."""
    sig, disk, cd_disk, n_disk, n_total, cd_size, cd_offset, comment = struct.unpack("<4s4H2LH", blob[-22:])
    assert sig == b"PK\x05\x06" and comment == 0
    end = struct.pack("<4s4H2LH", sig, disk, cd_disk, n_disk, n_total, cd_size, cd_offset + gap, comment)
    return blob[:cd_offset], blob[cd_offset:-22] + end


def test_a_file_with_a_huge_sparse_gap_is_refused_by_what_its_members_account_for(tmp_path):
    export = _export()
    head, tail = _with_gap(export.to_bytes(), 2**31)
    path = sparse_file(tmp_path / "gap.npz", len(head) + 2**31, head=head)
    with open(path, "ab") as f:
        f.write(tail)
    with pytest.raises(FileRefusedError, match=rf"^sequence export file '{path}' holds {path.stat().st_size} bytes, "
                                               r"but its 4 members account for at most \d+; the rest is not part"):
        SequenceExport.load(path)
    with pytest.raises(FileRefusedError, match=r"^the \d+ bytes given holds \d+ bytes, but its 4 members"):
        SequenceExport.from_bytes(head + bytes(2**20) + _with_gap(export.to_bytes(), 2**20)[1])
    export.save(tmp_path / "ok.npz")  # what save wrote is within the bound
    assert SequenceExport.load(tmp_path / "ok.npz") == export


def test_a_huge_sparse_file_of_nothing_is_refused_promptly(tmp_path):
    path = sparse_file(tmp_path / "huge.npz", 1 << 40)
    err = finishes_within(lambda: SequenceExport.load(path))
    assert isinstance(err, ValueError) and "is not a readable easykv sequence export" in str(err), err


def test_a_compressed_member_is_refused_before_it_is_inflated():
    export = _export()
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(export.to_bytes())) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    with pytest.raises(ValueError, match=r"holds the member '\w+(\.\w+)?\.npy' compressed \(zip method 8\); "
                                         "SequenceExport.save stores every member uncompressed"):
        SequenceExport.from_bytes(out.getvalue())


def test_a_file_that_changes_while_read_is_refused(tmp_path, monkeypatch):
    export = _export()
    path = tmp_path / "e.npz"
    export.save(path)
    real = export_file._check_file_size

    def then_append(*args, **kwargs):  # a writer adds to the file while the loader reads it
        real(*args, **kwargs)
        with open(path, "ab") as f:
            f.write(b"\0" * 16)

    monkeypatch.setattr(export_file, "_check_file_size", then_append)
    size = path.stat().st_size
    with pytest.raises(FileRefusedError, match=rf"^sequence export file '{path}' changed while it was read \(it held "
                                               rf"{size} bytes, now {size + 16}\)"):
        SequenceExport.load(path)


def test_a_link_a_file_object_and_bytes_still_load(tmp_path):
    export = _export()
    export.save(tmp_path / "e.npz")
    (tmp_path / "link.npz").symlink_to(tmp_path / "e.npz")  # a path the user names may be a link
    assert SequenceExport.load(tmp_path / "link.npz") == export
    with open(tmp_path / "e.npz", "rb") as f:
        assert SequenceExport.load(f) == export
    assert SequenceExport.from_bytes(export.to_bytes()) == export


# ---- a zip's directory is bounded before zipfile parses it (issue 42) ------------------------------
def _loads(path) -> list:
    """Each way to load the file at ``path``: the path, a file object, its bytes (as callables)."""
    blob = path.read_bytes()
    return [lambda: SequenceExport.load(path), lambda: SequenceExport.load(io.BytesIO(blob)),
            lambda: SequenceExport.from_bytes(blob), lambda: GroupedSequenceExport.load(str(path))]


@pytest.mark.parametrize("entries, declared, words", [
    (300_000, None, "declares 300000 zip members, more than the 4098 a sequence export may hold"),
    (300_000, 3, "declares a zip directory of 17400000 bytes, more than the 565524 that the 4098 members a sequence "
                 "export may hold take"),
    (3, 2**40, f"declares {2**40} zip members"),
], ids=["the-attack", "count-lies-low", "count-lies-high"])  # fmt: skip
def test_a_zip_of_more_members_than_any_export_is_refused_before_its_directory_is_parsed(tmp_path, entries, declared,
                                                                                        words):
    """The attack: 300,000 directory entries in 17 MB made load parse them all (5.25 s, +145 MiB)
    before refusing the file for having no 'header' member."""
    path = tmp_path / "many.npz"
    path.write_bytes(crafted_zip(entries, declared=declared, zip64=True))
    for load in _loads(path):
        tracemalloc.start()
        start = time.perf_counter()
        try:
            with pytest.raises(FileRefusedError) as caught:
                load()
            seconds, (_, peak) = time.perf_counter() - start, tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert words in str(caught.value) and "nothing was parsed" in str(caught.value), caught.value
        assert seconds < 2.0 and peak < 4 * 2**20, (seconds, peak)  # the parse took 5 s and 145 MiB


def test_no_zip_is_refused_as_one_and_never_read_as_a_npy_or_a_pickle(tmp_path):
    out = io.BytesIO()
    np.save(out, np.zeros(3))
    for blob in (out.getvalue(), pickle.dumps({"header": 1}), b"text"):
        path = tmp_path / "x.npz"
        path.write_bytes(blob)
        for load in _loads(path):
            with pytest.raises(ValueError, match=r"is not a readable easykv sequence export \(it is no zip: no end of "
                                                 r"central directory record; SequenceExport.save writes an \.npz\)$"):
                load()


def test_the_member_bound_is_what_the_largest_export_holds():
    """MOST_MEMBERS: every group raw (codes and scales of keys and values: 4 arrays), the most
    groups a header may hold (grouped_export refuses one more), the header and the token ids."""
    export = _export()
    names = {info.filename for info in zipfile.ZipFile(io.BytesIO(export.to_bytes())).infolist()}
    assert names == {"keys.dense.npy", "values.dense.npy", "token_ids.npy", "header.npy"}
    assert export_file.MOST_MEMBERS == 4 * export_file.MOST_GROUPS + 2
    header = {"format": export_file.GROUPED_FORMAT, "length": 1, "dtype": "float32", "quantization": "int8",
              "raw": True, "source_page_size": None, "groups": [{}] * (export_file.MOST_GROUPS + 1), "dtypes": {}}
    out = io.BytesIO()
    np.savez(out, header=np.frombuffer(json.dumps(header).encode(), np.uint8))
    with pytest.raises(ValueError, match=rf"'groups' must be a list of 1\.\.{export_file.MOST_GROUPS} group"):
        GroupedSequenceExport.from_bytes(out.getvalue())


def _raw_groups(count: int) -> GroupedSequenceExport:
    """A raw int8 export of ``count`` one-layer groups of one token (4 members each)."""
    from easykv.checkpoint.grouped_export import ExportedGroup
    from easykv.quantization import get_quantizer

    specs = export_file.member_specs(1, 1, 1, 8, np.dtype("float32"), get_quantizer("int8"), True)
    part = {kind: {sub: np.zeros(*specs[f"{kind}.{sub}"]) for sub in ("values", "scales")}
            for kind in ("keys", "values")}  # fmt: skip
    groups = tuple(ExportedGroup(layers=(layer,), num_kv_heads=1, key_head_dim=8, value_head_dim=8, latent=False,
                                 first_position=0, keys=part["keys"], values=part["values"]) for layer in range(count))
    return GroupedSequenceExport(length=1, groups=groups, dtype="float32", quantization="int8", raw=True,
                                 token_ids=np.zeros(1, np.int32))  # fmt: skip


def test_the_largest_export_loads_and_a_larger_one_is_not_saved():
    """MOST_GROUPS raw groups make MOST_MEMBERS members and a 264 kB header: save wrote them but
    load refused the header (64 KiB at most), and a save of more groups than load reads wrote a
    file that no load reads; such an export is refused when it is made now."""
    export = _raw_groups(export_file.MOST_GROUPS)
    blob = export.to_bytes()
    assert len(zipfile.ZipFile(io.BytesIO(blob)).infolist()) == export_file.MOST_MEMBERS
    assert GroupedSequenceExport.from_bytes(blob) == export
    # More groups than load reads: refused when the export is made, before any file exists.
    with pytest.raises(ValueError, match=rf"^GroupedSequenceExport.groups must be a tuple of "
                                         rf"1..{export_file.MOST_GROUPS} ExportedGroup \(what load reads back\)"):
        _raw_groups(export_file.MOST_GROUPS + 1)


def test_a_message_lists_a_few_of_a_files_member_names_and_their_count():
    """Every name from the file went into the message: 4,000 extra members made it 80 kB long."""
    blob = _export().to_bytes()
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(blob)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info))
        for i in range(4000):
            dst.writestr(f"extra_{i:05d}.npy", b"")
    with pytest.raises(ValueError) as caught:
        SequenceExport.from_bytes(out.getvalue())
    message = str(caught.value)
    assert message == ("the 426000 bytes given holds the arrays ['extra_00000', 'extra_00001', 'extra_00002', "
                       "'extra_00003', 'extra_00004', 'extra_00005', 'extra_00006', 'extra_00007', ... and 3992 more, "
                       "4000 in all], which its header does not imply"), message
    assert len(message) < 1000, len(message)


@pytest.mark.parametrize("given", ["/tmp/a\x00b", b"/tmp/a\x00b", Path("/tmp/a\x00b")])
def test_a_path_holding_a_nul_byte_is_refused_naming_it(given):
    """Python's bare 'ValueError: embedded null byte' named neither the file nor the fix."""
    for cls in (SequenceExport, GroupedSequenceExport):
        with pytest.raises(FileRefusedError) as caught:
            cls.load(given)
        assert str(caught.value) == ("the path '/tmp/a\\x00b' holds a NUL byte, which no file name can hold; name the "
                                     "file without it; a sequence export is the regular .npz file SequenceExport.save "
                                     "writes")
        assert caught.value.path == "/tmp/a\x00b"


def test_other_path_problems_name_the_file(tmp_path):
    long = "/tmp/" + "a" * 5000
    for path, words in ((tmp_path / "absent.npz", "FileNotFoundError"), (long, "OSError"),
                        (b"/tmp/\xff\xfe-absent", "FileNotFoundError")):  # fmt: skip
        with pytest.raises(ValueError) as caught:
            SequenceExport.load(path)
        message = str(caught.value)
        shown = repr(os.fsdecode(path))[:200]
        assert message.startswith(f"sequence export file {shown}") and words in message, message
