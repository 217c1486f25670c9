"""A step's files as damage or an attacker leaves them (issue 42): each file the restore and
`inspect` read is opened once, non-blocking and without following a link, and checked on that
descriptor, so a FIFO or a link to /dev/zero swapped in at any moment is refused instead of
hanging; a chunk file deleted after the listing is `CheckpointIntegrityError`, not a raw
FileNotFoundError; every field of each ``.zarray`` and of orbax's ``_METADATA`` is compared with
what the record implies before anything a file claims is acted on, so a crafted chunk grid costs
milliseconds and no memory, for a 4 GiB pool too; and a FIFO marker makes `inspect` fail, naming
it. The chunk reads themselves (runs straight into the shard's buffer, or staged) are checked
against numpy."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import threading
import time
import tracemalloc
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from easykv.checkpoint import stored_files
from easykv.checkpoint.checkpointer import restore_cache, save_cache
from easykv.checkpoint.format import MARKER_FILE
from easykv.checkpoint.inspect import inspect_report
from easykv.checkpoint.reader import copy_chunk_part
from easykv.checkpoint.record import expected_leaves
from easykv.cli import main
from easykv.errors import CheckpointError, CheckpointIntegrityError
from easykv.sharding import ShardingAdjustedWarning
from tests.support.checkpoints import (
    assert_same_bits,
    checkpoint_files,
    engine_run,
    file_kind,
    load_record,
    qsetup,
    write_record,
)

HANG = 60  # seconds: a call still running then is hung (each finishes in well under one)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, cache, manager) of a step saved from an engine run with a manager, heads over tp=8."""
    cache, manager, _ = engine_run("heads")
    directory = tmp_path_factory.mktemp("saved") / "ck"
    save_cache(directory, cache, manager)
    return directory, cache, manager


@pytest.fixture
def step(saved, tmp_path):
    """A fresh copy of the saved step, to damage."""
    directory = tmp_path / "ck"
    shutil.copytree(saved[0], directory)
    return directory


def _restore(directory, **kw):
    mesh, pm, _ = qsetup("heads")
    return restore_cache(directory, mesh=mesh, partition_manager=pm, **kw)


def _within(seconds, fn, fifos=()):
    """``fn()`` on a thread: its result, or its exception raised here; a call still running after
    ``seconds`` fails the test (its FIFOs are then opened for writing and closed, so that the
    hung read ends instead of blocking the session)."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001  re-raised on the test's thread
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"{fn} still running after {seconds} s: hung on a FIFO or an endless file")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _swap(path: Path, kind: str) -> list[Path]:
    """Replace ``path`` by a FIFO or a link to /dev/zero; the FIFOs made."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        return [path]
    path.symlink_to("/dev/zero")
    return []


# ---- FIFOs and endless files in place of each file read -------------------------------------------
READ_FILES = {  # each file the restore and inspect open, and what the refusal names
    "record": ("0/easykv/checkpoint.json", "checkpoint.json"),
    "manager": ("0/easykv/manager.json", "manager.json"),
    "zarray": ("0/pages/group_000.value_pages/.zarray", ".zarray"),
    "tree metadata": ("0/pages/_METADATA", "_METADATA"),
    "marker": (MARKER_FILE, MARKER_FILE),
}


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
@pytest.mark.parametrize("name", list(READ_FILES))
def test_a_fifo_or_endless_file_in_place_of_a_file_read_is_refused_promptly(step, name, kind):
    relative, named = READ_FILES[name]
    fifos = _swap(step / relative, kind)
    what = "a FIFO" if kind == "fifo" else "a link"
    with pytest.raises(CheckpointIntegrityError, match=rf"{named.replace('.', '[.]')} is not .*it is {what}"):
        _within(HANG, lambda: _restore(step), fifos)
    report, intact = _within(HANG, lambda: inspect_report(step), fifos)
    assert not intact and "DAMAGED" in report and named in report and f"it is {what}" in report


@pytest.mark.parametrize("name", [n for n in READ_FILES if n != "marker"])
def test_a_file_that_turns_into_a_fifo_after_any_check_of_its_path_cannot_hang_the_restore(saved, step, name,
                                                                                           monkeypatch):
    """Every stat of the file's path reports the regular file it was, and leaves a FIFO in its
    place: the file swapped right after any check on the path. A reader that checks the path and
    then opens it blocks forever (each of these did); one that checks the descriptor it reads
    refuses the FIFO, or never checked the path and read the file intact."""
    target = step / READ_FILES[name][0]
    regular, real_stat, real_lstat = os.stat(target), os.stat, os.lstat

    def lying(real):
        def check(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and os.fspath(path) == str(target):
                if not stat.S_ISFIFO(real_lstat(target).st_mode):
                    os.unlink(target)
                    os.mkfifo(target)
                return regular
            return real(path, *args, **kwargs)
        return check

    monkeypatch.setattr(os, "stat", lying(real_stat))
    monkeypatch.setattr(os, "lstat", lying(real_lstat))
    try:
        restored = _within(HANG, lambda: _restore(step), [target])
    except CheckpointIntegrityError as err:
        assert READ_FILES[name][1] in str(err) and "it is a FIFO" in str(err)
    else:
        assert_same_bits(restored.cache, saved[1])
        assert restored.manager.state_dict() == saved[2].state_dict()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_chunk_swapped_for_a_fifo_after_the_listing_is_refused_on_its_descriptor(step, kind, monkeypatch):
    """tensorstore opened chunk files by path after easykv's checks: a FIFO swapped in between
    hung the restore forever. The chunk is now opened once, non-blocking, and checked there."""
    listed, fifos, swapped = stored_files.chunk_files_problem, [], []
    array = "group_000.value_pages"

    def list_then_swap(array_dir, grid):
        problem = listed(array_dir, grid)
        if array_dir.endswith(array) and not swapped:
            fifos.extend(_swap(Path(array_dir) / "0.3.0.0.0", kind))
            swapped.append(True)
        return problem

    monkeypatch.setattr(stored_files, "chunk_files_problem", list_then_swap)
    with pytest.raises(CheckpointIntegrityError, match=r"0\.3\.0\.0\.0 is not a regular file of one chunk's") as err:
        _within(HANG, lambda: _restore(step), fifos)
    assert swapped
    assert err.value.array == array and ("it is a FIFO" if kind == "fifo" else "it is a link") in str(err.value)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_no_file_of_a_step_can_hang_a_restore_or_inspect(saved, tmp_path, kind):
    """Every kind of file a step holds, orbax's own included, swapped for a FIFO or a link to
    /dev/zero: the restore and inspect each end within the time limit, the restore either
    intact (a file it does not read) or with a CheckpointError, never another error."""
    directory = saved[0]
    kinds = {}
    for path in checkpoint_files(directory):
        kinds.setdefault(file_kind(path, directory), path.relative_to(directory))
    outcomes = {}
    for role, relative in kinds.items():
        copy = tmp_path / role.replace("/", "_").replace("*", "x")
        shutil.copytree(directory, copy)
        fifos = _swap(copy / relative, kind)
        try:
            _within(HANG, lambda c=copy: _restore(c))
            outcomes[role] = "restored"
        except CheckpointError as err:
            outcomes[role] = type(err).__name__
        _within(HANG, lambda c=copy: inspect_report(c), fifos)
    read = {"easykv_checkpoint.json", "<step>/easykv/checkpoint.json", "<step>/easykv/manager.json",
            "<step>/pages/_METADATA", "pages/*/.zarray", "pages/*/chunk"}
    assert {role for role, outcome in outcomes.items() if outcome != "restored"} == read
    assert {outcomes[role] for role in read} == {"CheckpointIntegrityError"}


# ---- a chunk deleted between the listing and its open ---------------------------------------------
def test_a_chunk_deleted_after_the_listing_is_an_integrity_error_naming_the_array(step, monkeypatch):
    """The directory is listed, then a chunk vanishes before it is opened (a second writer's
    cleanup, a disk going away): it raised a raw FileNotFoundError from the reader's stat."""
    real, array_dir = os.scandir, step / "0" / "pages" / "group_000.key_pages"

    class Listing:  # what os.scandir returned, the chunk deleted once listed
        def __init__(self, path):
            with real(path) as it:
                self.entries = list(it)
            (array_dir / "0.5.0.0.0").unlink()

        def __enter__(self):
            return iter(self.entries)

        def __exit__(self, *exc):
            return False

        def __iter__(self):
            return iter(self.entries)

        def close(self):
            pass

    monkeypatch.setattr(os, "scandir", lambda path=".": Listing(path) if Path(path) == array_dir else real(path))
    with pytest.raises(CheckpointIntegrityError, match=r"group_000\.key_pages .*'0\.5\.0\.0\.0' is missing") as err:
        _restore(step, verify=False)
    assert err.value.array == "group_000.key_pages" and err.value.step == 0


# ---- a crafted chunk grid costs what was saved --------------------------------------------------------
def _craft_chunks(directory, chunks, *, tree_too: bool) -> None:
    """Every array's .zarray claims ``chunks`` (and, with ``tree_too``, orbax's _METADATA the same
    write_shape); the chunk files are deleted."""
    pages = directory / "0" / "pages"
    tree = json.loads((pages / "_METADATA").read_text())
    for array in pages.glob("group_*"):
        zarray = json.loads((array / ".zarray").read_text())
        for chunk in array.glob("[0-9]*"):
            chunk.unlink()
        (array / ".zarray").write_text(json.dumps({**zarray, "chunks": chunks}))
    if tree_too:
        for node in tree["tree_metadata"].values():
            node["value_metadata"]["write_shape"] = chunks
        (pages / "_METADATA").write_text(json.dumps(tree))


@contextlib.contextmanager
def _memory_ceiling(extra: int):
    """Inside, the process may map ``extra`` more bytes of data: a check that enumerates a crafted
    grid fails with MemoryError instead of exhausting the machine (as it did: 15 GB and growing)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    with open("/proc/self/status") as f:
        used = next(int(line.split()[1]) for line in f if line.startswith("VmData:")) * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (used + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _refused_cheaply(directory, where: str) -> None:
    """The restore refuses ``directory`` in under a second, having allocated under 8 MiB, naming
    the first array, the file that says so and the crafted chunks."""
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        with pytest.raises(CheckpointIntegrityError) as err, _memory_ceiling(1 << 30):
            _restore(directory, verify=False)
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < 3.0 and peak < 8 << 20, (seconds, peak)
    assert err.value.array == "group_000.key_pages" and where in str(err.value)
    assert "chunks" in str(err.value) and "[1, 1, 1, 1, 1]" in str(err.value)


@pytest.mark.parametrize("tree_too", [False, True])
def test_one_element_chunks_over_a_16_mib_array_are_refused_in_milliseconds(tmp_path, tree_too):
    """The issue's file: a .zarray edited to chunks [1, 1, 1, 1, 1], its chunk files deleted. The
    reader built one string per element before refusing (7.9 s and +675 MiB for 16 MiB)."""
    mesh, pm, meta = qsetup("heads", pages=16384)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        from easykv.storage.cache import PagedAttentionCache

        cache = PagedAttentionCache.init_cache(mesh, meta.dtype, meta, pm)
    assert jax.tree.leaves(cache)[0].nbytes == 16 << 20
    save_cache(tmp_path / "ck", cache)
    _craft_chunks(tmp_path / "ck", [1, 1, 1, 1, 1], tree_too=tree_too)
    _refused_cheaply(tmp_path / "ck", "_METADATA" if tree_too else ".zarray")


@pytest.mark.parametrize("tree_too", [False, True])
def test_one_element_chunks_over_a_4_gib_pool_are_refused_before_any_per_element_work(step, tree_too):
    """The same crafted grid over a record (sealed again) that claims a 4 GiB pool: 2**31
    elements, which a check enumerating the grid could not survive. Nothing of 4 GiB is written;
    the refusal comes from comparing a few fields with the record."""
    _, _, big = qsetup("heads", pages=2 << 20)
    record = load_record(step)
    record["metadata"] = big.to_dict()
    record["manager"] = record["manager_sha256"] = None
    (step / "0" / "easykv" / "manager.json").unlink()
    leaves = expected_leaves(big, record["storage"]["platform"])
    for entry, (_, _, sds) in zip(record["arrays"], leaves):
        entry["shape"] = list(sds.shape)
        entry["nbytes"] = int(np.prod(sds.shape)) * np.dtype(sds.dtype).itemsize
    assert sum(e["nbytes"] for e in record["arrays"]) == 4 << 30
    write_record(step, record)
    pages = step / "0" / "pages"
    tree = json.loads((pages / "_METADATA").read_text())
    for node in tree["tree_metadata"].values():  # the shard of the big pool: as orbax would write it
        node["value_metadata"]["write_shape"] = [2, 1, 2 << 20, 4, 8]
    (pages / "_METADATA").write_text(json.dumps(tree))
    for array in pages.glob("group_*"):
        zarray = json.loads((array / ".zarray").read_text())
        (array / ".zarray").write_text(json.dumps({**zarray, "shape": [2, 8, 2 << 20, 4, 8]}))
    _craft_chunks(step, [1, 1, 1, 1, 1], tree_too=tree_too)
    _refused_cheaply(step, "_METADATA" if tree_too else ".zarray")


# ---- orbax's _METADATA as a whole ------------------------------------------------------------------
def _tree_edits():
    """(name, edit of the parsed _METADATA): each leaves every key present, which is all that was checked."""
    key = "('group_000', 'value_pages')"

    def node(tree):
        return tree["tree_metadata"][key]

    return {
        "a flipped letter in a key name": lambda t: node(t)["key_metadata"][1].update(key="walue_pages"),
        "a key type": lambda t: node(t)["key_metadata"][0].update(key_type=1),
        "a value type": lambda t: node(t)["value_metadata"].update(value_type="np.ndarray"),
        "skip_deserialize": lambda t: node(t)["value_metadata"].update(skip_deserialize=True),
        "0 for false": lambda t: node(t)["value_metadata"].update(skip_deserialize=0),
        "a write shape": lambda t: node(t)["value_metadata"].update(write_shape=[2, 1, 24, 2, 8]),
        "an unknown field": lambda t: node(t)["value_metadata"].update(sharding=None),
        "an array the record lacks": lambda t: t["tree_metadata"].update({"('group_001', 'key_pages')": node(t)}),
        "ocdbt": lambda t: t.update(use_ocdbt=True),
        "zarr3": lambda t: t.update(use_zarr3=True),
        "custom metadata": lambda t: t.update(custom_metadata={"x": 1}),
        "an unknown top-level key": lambda t: t.update(extra=1),
    }


@pytest.mark.parametrize("edit", list(_tree_edits()))
def test_orbax_metadata_is_compared_as_a_whole_with_the_record(step, edit):
    path = step / "0" / "pages" / "_METADATA"
    tree = json.loads(path.read_text())
    _tree_edits()[edit](tree)
    path.write_text(json.dumps(tree))
    for verify in (True, False):
        with pytest.raises(CheckpointIntegrityError, match=r"orbax's metadata of the pages of step 0 .*_METADATA"):
            _restore(step, verify=verify)
    report, intact = inspect_report(step)
    assert not intact and "verify   DAMAGED" in report and "_METADATA" in report and "verify   OK" not in report


def test_the_issue_flip_in_metadata_is_named_by_its_place(step):
    """One letter of 'value_pages' flipped inside the file (its key_metadata): orbax could no longer
    read the step, yet it restored and inspect said 'verify OK'."""
    path = step / "0" / "pages" / "_METADATA"
    text = path.read_text()
    at = text.index('"key": "value_pages"')
    path.write_text(text[:at] + '"key": "walue_pages"' + text[at + len('"key": "value_pages"'):])
    with pytest.raises(CheckpointIntegrityError, match=r"group_000\.value_pages as saved: .*key_metadata\[1\]\.key "
                       r"is 'walue_pages', expected 'value_pages'") as err:
        _restore(step)
    assert err.value.array == "group_000.value_pages"
    assert "DAMAGED" in inspect_report(step)[0]


# ---- a FIFO marker --------------------------------------------------------------------------------
@pytest.mark.parametrize("with_steps", [True, False])
def test_a_fifo_marker_makes_inspect_fail_naming_it(tmp_path, saved, with_steps, capsys):
    """`easykv inspect` reported "0 complete step(s)" and exited 0."""
    directory = tmp_path / "ck"
    if with_steps:
        shutil.copytree(saved[0], directory)
        (directory / MARKER_FILE).unlink()
    else:
        directory.mkdir()
    os.mkfifo(directory / MARKER_FILE)
    report, intact = _within(HANG, lambda: inspect_report(directory), [directory / MARKER_FILE])
    assert not intact and f"marker   DAMAGED: {directory / MARKER_FILE} is not the regular file" in report
    assert "it is a FIFO" in report and ("1 complete step(s): 0" if with_steps else "0 complete step(s)") in report
    assert main(["inspect", str(directory)]) == 1
    out = capsys.readouterr().out
    assert MARKER_FILE in out and "FIFO" in out
    with pytest.raises(CheckpointIntegrityError, match=rf"{MARKER_FILE} is not the regular file .*it is a FIFO"):
        _within(HANG, lambda: _restore(directory), [directory / MARKER_FILE])


def test_an_intact_step_restores_and_inspects_as_before(saved):
    directory, cache, manager = saved
    restored = _restore(directory)
    assert_same_bits(restored.cache, cache)
    assert restored.manager.state_dict() == manager.state_dict()
    report, intact = inspect_report(directory)
    assert intact and "verify   OK: 2 arrays match their fingerprints" in report


# ---- the chunk reads, against numpy ----------------------------------------------------------------
CASES = [  # (array shape, chunk shape, target region as (start, stop) per axis)
    ((2, 8, 24, 4, 8), (2, 2, 12, 4, 8), ((0, 2), (0, 1), (0, 24), (0, 4), (0, 8))),  # heads finer, pages wider
    ((2, 8, 24, 4, 8), (2, 1, 24, 4, 8), ((0, 2), (0, 8), (0, 12), (0, 4), (0, 8))),  # pages finer, heads wider
    ((3, 2, 12, 4, 16), (3, 2, 6, 1, 16), ((0, 3), (0, 2), (0, 12), (0, 4), (0, 16))),  # a replica-split axis
    ((3, 2, 12, 4, 16), (1, 2, 12, 4, 16), ((0, 3), (1, 2), (3, 9), (0, 4), (0, 16))),  # split layers
    ((2, 24, 4, 8), (2, 6, 1, 8), ((1, 2), (5, 19), (0, 4), (0, 8))),  # per-layer, scattered both ways
    ((2, 3000, 2), (2, 3000, 1), ((0, 2), (0, 3000), (0, 2))),  # 6000 runs of one element: staged
]


@pytest.mark.parametrize("shape, chunks, region", CASES)
def test_chunk_parts_land_where_numpy_puts_them(tmp_path, shape, chunks, region):
    rng = np.random.default_rng(0)
    full = rng.integers(0, 2**16, size=shape, dtype=np.uint16)
    lo = [a for a, _ in region]
    buf = np.zeros([b - a for a, b in region], np.uint16)
    grid = [range(-(-n // c)) for n, c in zip(shape, chunks)]
    for position in np.ndindex(*[len(g) for g in grid]):
        start = [p * c for p, c in zip(position, chunks)]
        part = np.zeros(chunks, np.uint16)  # an edge chunk is padded to a whole chunk
        block = full[tuple(slice(s, s + c) for s, c in zip(start, chunks))]
        part[tuple(slice(0, n) for n in block.shape)] = block
        if any(s >= b or s + c <= a for s, c, (a, b) in zip(start, chunks, region)):
            continue
        path = tmp_path / ".".join(map(str, position))
        path.write_bytes(part.tobytes())
        fd = os.open(path, os.O_RDONLY)
        try:
            copy_chunk_part(fd, str(path), chunks, start, buf, lo)
        finally:
            os.close(fd)
    assert np.array_equal(buf, full[tuple(slice(a, b) for a, b in region)])


@pytest.mark.parametrize("name", ["zarray", "tree metadata"])
def test_a_json_file_larger_than_the_record_implies_is_refused_before_it_is_parsed(step, name):
    """A 2 MiB .zarray or _METADATA of nested lists (an outside attack's 16 MiB one took 5 s and
    +800 MiB to parse before the comparison refused it): refused by its size, unparsed."""
    relative, names = READ_FILES[name]
    body = "[" + ",".join(["[]"] * (1 << 20)) + "]"
    (step / relative).write_text('{"x":' + body + "}")
    tracemalloc.start()
    try:
        start = time.perf_counter()
        with pytest.raises(CheckpointIntegrityError, match=rf"{re.escape(names)}.* holds \d+ bytes, more than"):
            _restore(step)
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < 3.0 and peak < 8 << 20, (seconds, peak)


@pytest.mark.parametrize("kind", ["fifo", "file", "dangling-link"])
def test_a_step_name_that_is_not_a_directory_makes_inspect_fail_naming_it(step, kind, capsys):
    """An outside attack replaced the only step '0' by a FIFO, a file or a link to nothing:
    inspect said '0 complete step(s): none' and exited 0, while an empty directory '0' was DAMAGED."""
    shutil.rmtree(step / "0")
    {"fifo": lambda p: os.mkfifo(p), "file": lambda p: p.write_bytes(b"x"),
     "dangling-link": lambda p: p.symlink_to(step / "nowhere")}[kind](step / "0")
    report, ok = _within(30, lambda: inspect_report(step), fifos=(step / "0",) if kind == "fifo" else ())
    assert not ok and "step 0 DAMAGED: it is" in report and "not a step directory" in report, report
    assert _within(30, lambda: main(["inspect", str(step)])) == 1
