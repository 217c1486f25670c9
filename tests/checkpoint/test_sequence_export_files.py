"""`SequenceExport.load` / `GroupedSequenceExport.load` of a path read the file through the one
descriptor that was checked (issue 42): a FIFO (``np.load`` of one blocked forever), a device, a
directory or a link to one is refused at once as `FileRefusedError` naming it; so is a file that
holds more than its zip members account for (a huge sparse gap), one that changes while read, and
a compressed member (a few bytes that could claim any size). A file object and bytes still load."""

import io
import struct
import zipfile

import numpy as np
import pytest

import easykv.checkpoint.export_file as export_file
from easykv.checkpoint.grouped_export import GroupedSequenceExport
from easykv.checkpoint.transfer import SequenceExport
from easykv.errors import FileRefusedError
from tests.support.hostile_files import finishes_within, hostile_paths, sparse_file


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
