"""Every persisted byte of a checkpoint is verified: byte flips in every file (orbax's and
easykv's), crafted records whose seal was recomputed (so only the schema can catch them),
crafted page-manager states, orbax metadata that loses an array, and version-1 checkpoints
(easykv 0.1, no JSON hashes). Each ends in a CheckpointError (or, for a byte no restore reads,
a bit-identical restore) — never different data, never a raw TypeError/KeyError, and
`easykv inspect` reports it as text with a non-zero exit code.

The exhaustive sweep (every byte of every file) is benchmarks/attack_checkpoint_flips.py."""

from __future__ import annotations

import collections
import copy
import hashlib
import json
import shutil

import numpy as np
import pytest

from easykv.checkpoint.checkpointer import restore_cache, save_cache
from easykv.checkpoint.inspect import inspect_checkpoint
from easykv.checkpoint.record import RECORD_SEAL
from easykv.cli import main
from easykv.errors import CheckpointError, CheckpointIntegrityError, CheckpointMismatchError
from tests.support.checkpoints import (
    checkpoint_files,
    file_kind,
    flip_fixture,
    flip_outcome,
    load_record,
    manager_path,
    raw_leaves,
    record_path,
    write_manager,
    write_record,
)

# Reading a damaged file makes orbax drop coroutines that report on garbage collection.
pytestmark = [pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
              pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """The flip fixture saved once: (directory, mesh, pm, array bits, manager state, metadata)."""
    cache, manager, mesh, pm = flip_fixture()
    directory = tmp_path_factory.mktemp("pristine") / "ck"
    save_cache(directory, cache, manager, extra_metadata={"run": "flips"})
    return directory, mesh, pm, raw_leaves(cache), manager.state_dict(), cache.metadata


@pytest.fixture
def ck(pristine, tmp_path):
    """A private copy of the pristine checkpoint (tests damage it)."""
    directory = tmp_path / "ck"
    shutil.copytree(pristine[0], directory)
    return (directory, *pristine[1:])


def _restore(ck, **kw):
    directory, mesh, pm = ck[:3]
    return restore_cache(directory, mesh=mesh, partition_manager=pm, **kw)


def _identical(ck, restored) -> bool:
    bits, state, meta = ck[3:]
    return (all(np.array_equal(a, b) for a, b in zip(raw_leaves(restored.cache), bits))
            and restored.manager.state_dict() == state and restored.metadata == meta)


# ---- (a) byte flips in every file ---------------------------------------------------------------
def _positions(size: int, even: int, rand: int, rng) -> list[int]:
    if size <= even + rand:
        return list(range(size))
    spread = np.linspace(0, size - 1, even).astype(int).tolist()
    return sorted(set(spread) | set(rng.choice(size, rand, replace=False).tolist()))


def test_byte_flips_in_every_file_are_detected_or_harmless(ck):
    """A sample of the exhaustive sweep: every file, an even spread plus seeded random positions,
    a random bit each. Files a restore trusts (record, manager state, chunks) must never restore."""
    directory = ck[0]
    rng = np.random.default_rng(2024)
    files = checkpoint_files(directory)
    kinds = {file_kind(p, directory) for p in files}
    for needed in ("<step>/pages/_METADATA", "<step>/_CHECKPOINT_METADATA", "pages/*/.zarray", "pages/*/chunk",
                   "<step>/pages/_sharding", "<step>/easykv/checkpoint.json", "<step>/easykv/manager.json",
                   "easykv_checkpoint.json", ".easykv-writer-0.lock"):
        assert needed in kinds, (needed, kinds)
    outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures = []
    for path in files:
        kind = file_kind(path, directory)
        size = path.stat().st_size
        if kind == "pages/*/chunk":
            even, rand = 3, 3
        elif kind.endswith((".json", "_METADATA", "_sharding", "process_0")):
            even, rand = 14, 10
        elif kind.endswith(".zarray"):
            even, rand = 8, 6
        else:  # commit markers, the lock: read by no restore
            even, rand = 4, 3
        for i, position in enumerate(_positions(size, even, rand, rng)):
            bit = int(rng.integers(8))
            if i < 2:  # inspect must report the same damage as text, never raise
                outcome, report = flip_outcome(directory, path, position, bit, *ck[1:], inspect=True)
                if report != ("intact" if outcome == "identical" else "damaged"):
                    failures.append((str(path.relative_to(directory)), position, bit, outcome, "inspect", report))
            else:
                outcome = flip_outcome(directory, path, position, bit, *ck[1:])
            outcomes[kind][outcome] += 1
            if outcome not in ("identical", "CheckpointIntegrityError"):
                failures.append((str(path.relative_to(directory)), position, bit, outcome))
    assert not failures, failures[:10]
    for kind in ("<step>/easykv/checkpoint.json", "<step>/easykv/manager.json", "pages/*/chunk"):
        assert set(outcomes[kind]) == {"CheckpointIntegrityError"}, (kind, outcomes[kind])
    assert sum(sum(c.values()) for c in outcomes.values()) > 200  # one stacked array per K and V: few files
    assert _identical(ck, _restore(ck))  # every byte was put back


def test_orbax_metadata_without_an_array_is_named_not_a_placeholder(ck):
    directory = ck[0]
    meta_path = directory / "0" / "pages" / "_METADATA"
    tree = json.loads(meta_path.read_text())
    del tree["tree_metadata"]["('group_000', 'value_pages')"]
    meta_path.write_text(json.dumps(tree))
    with pytest.raises(CheckpointIntegrityError, match="group_000.value_pages") as err:
        _restore(ck)
    assert err.value.array == "group_000.value_pages"
    assert "DAMAGED" in inspect_checkpoint(directory)


# ---- (b) crafted records: each field broken each way, the seal recomputed --------------------------
DELETE, DEEP, NAN = object(), "@@deep@@", "@@nan@@"
BREAKS = {"string": "x", "list": [], "dict": {}, "null": None, "bool": True, "huge": 2**64 - 5, "negative": -1,
          "float": 1.5, "missing": DELETE, "deep": DEEP, "nan": NAN}
FIELDS = [
    "format", "format_version", "easykv_version", "step", "created", "metadata", "metadata.page_size",
    "metadata.num_pages_per_layer", "metadata.num_hidden_layers", "metadata.num_kv_heads", "metadata.dtype",
    "metadata.kv_head_mesh_axes", "metadata.hbm_utilization", "storage", "storage.platform",
    "storage.logical_dtype", "storage.quantization", "mesh", "mesh.platform", "mesh.device_kind",
    "mesh.num_devices", "mesh.process_count", "mesh.axis_names", "mesh.shape", "mesh.shape.tp",
    "mesh.kv_head_mesh_axes", "mesh.page_mesh_axes", "arrays", "arrays.0", "arrays.1.name", "arrays.0.path",
    "arrays.0.role", "arrays.0.shape", "arrays.0.shape.1", "arrays.1.stored_dtype", "arrays.0.nbytes",
    "arrays.1.fingerprint", "fingerprint_algorithm", "manager", "manager.active_sequences", "manager.tokens",
    "manager.free_pages", "manager.cached_pages", "manager.prefix_pages", "extra_metadata", "manager_sha256",
    "record_sha256",
]
# Values that are legitimate for the field (so a sealed record with them is not damage): the
# restore must then succeed with bit-identical pages.
VALID = {("easykv_version", "string"), ("created", "string"), ("mesh.device_kind", "string"),
         ("mesh.page_mesh_axes", "list"), ("extra_metadata", "dict")}
MISMATCH = {("fingerprint_algorithm", "string")}  # another algorithm: a newer easykv's


def _set(record: dict, field: str, value) -> None:
    *parents, last = field.split(".")
    node = record
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    key = int(last) if isinstance(node, list) else last
    if value is DELETE:
        del node[key]
    else:
        node[key] = value


def _crafted_text(record: dict, *, reseal: bool) -> str:
    """The record as easykv writes it, with the seal over its canonical content (computed on
    the text, so that deep nesting and NaN, which json.dumps cannot canonicalize, work too)."""
    def render(value, **kw) -> str:
        text = json.dumps(value, allow_nan=True, **kw)
        return text.replace(f'"{DEEP}"', "[" * 10_000 + "]" * 10_000).replace(f'"{NAN}"', "NaN")

    if reseal and RECORD_SEAL in record:
        body = render({k: v for k, v in record.items() if k != RECORD_SEAL}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True)
        record = {**record, RECORD_SEAL: hashlib.sha256(body.encode()).hexdigest()}
    return render(record, indent=1)


def _cases():
    for i, field in enumerate(FIELDS):
        for j, (name, value) in enumerate(BREAKS.items()):
            # inspect reads the record the same way restore does: check it on a rotating third
            # of the breaks of every field (and on every valid edit), to keep the test fast
            yield field, name, value, (i + j) % 3 == 0 or (field, name) in VALID


def test_crafted_record_fields_raise_precise_errors(ck, capsys):
    directory = ck[0]
    good = load_record(directory)
    original = record_path(directory).read_text()
    failures, counts = [], collections.Counter()
    for field, name, value, with_inspect in _cases():
        record = copy.deepcopy(good)
        _set(record, field, value)
        record_path(directory).write_text(_crafted_text(record, reseal=field != RECORD_SEAL))
        want = "valid" if (field, name) in VALID else \
            "CheckpointMismatchError" if (field, name) in MISMATCH else "CheckpointIntegrityError"
        try:
            restored = _restore(ck)
            got = "valid" if _identical(ck, restored) else "SILENT"
        except CheckpointError as err:
            got = type(err).__name__
            if want != "valid" and "\n" not in str(err) and field.split(".")[0] not in str(err) \
                    and name not in ("deep", "nan") and field not in ("format_version", "step"):
                got += " (message does not name the field)"
        except Exception as err:  # noqa: BLE001  the bug this test exists for
            got = f"RAW {type(err).__name__}: {err}"
        counts[got] += 1
        code, inspect_ok, err = None, True, ""
        if with_inspect:
            code = main(["inspect", str(directory)])
            out = capsys.readouterr()
            err = out.err[-300:]
            inspect_ok = "Traceback" not in out.out + out.err and (
                code == 0 if want == "valid" else code == 1 and ("DAMAGED" in out.out or "UNREADABLE" in out.out))
            counts["inspected"] += 1
        if got != want or not inspect_ok:
            failures.append((field, name, got, want, code, err))
        record_path(directory).write_text(original)
    assert not failures, failures[:12]
    assert counts["CheckpointIntegrityError"] > 400, counts


@pytest.mark.parametrize("text", ["[]", "null", '"x"', "{}", "[" * 10_000 + "]" * 10_000, "NaN", "", "\xff\xfe{",
                                  '{"record_sha256": "0", "x": 1e999}', '{"format": "easykv.checkpoint", '
                                  '"format_version": 1e999}'])
def test_record_that_is_not_a_record_object(ck, text):
    record_path(ck[0]).write_bytes(text.encode("latin-1"))
    with pytest.raises(CheckpointIntegrityError, match="damaged"):
        _restore(ck)
    assert main(["inspect", str(ck[0])]) == 1


def test_sealed_record_is_verified_whatever_its_version(ck):
    directory = ck[0]
    text = record_path(directory).read_text()
    assert '"format_version": 3' in text
    record_path(directory).write_text(text.replace('"format_version": 3', '"format_version": 1'))  # one bit
    with pytest.raises(CheckpointIntegrityError, match="does not match its record_sha256"):
        _restore(ck)
    record = json.loads(text)
    del record[RECORD_SEAL]  # a version-3 record without its seal is damaged, not legacy
    write_record(directory, record, reseal=False)
    with pytest.raises(CheckpointIntegrityError, match="lacks its record_sha256"):
        _restore(ck)


# ---- (c) the page-manager state -------------------------------------------------------------------
def test_manager_state_deleted_added_or_altered(ck, pristine):
    directory = ck[0]
    manager_text = manager_path(directory).read_text()
    good = json.loads(manager_text)
    manager_path(directory).unlink()
    with pytest.raises(CheckpointIntegrityError, match="manager was saved but .* is missing"):
        _restore(ck)
    assert _restore(ck, restore_manager=False).manager is None  # the pages alone are intact
    # The record says no manager, yet a manager.json is there.
    write_record(directory, {**load_record(directory), "manager_sha256": None, "manager": None})
    manager_path(directory).write_text(manager_text)
    with pytest.raises(CheckpointIntegrityError, match="no page manager was saved but .* exists"):
        _restore(ck)
    shutil.copy(record_path(pristine[0]), record_path(directory))
    assert _identical(ck, _restore(ck))
    # Altered, the hash recomputed: the state's own validation (or the summary) must refuse it.
    crafted = {
        "scrub a live page": lambda s: s["pool"].__setitem__("scrub", [0]),
        "copy onto the shared prefix page": lambda s: s["copies"].append([4, 0]),
        "copy out of a page waiting for a copy": lambda s: s["copies"].append([5, 3]),
        "a sequence owning another's page": lambda s: s["sequences"][2]["pages"].__setitem__(1, 4),
        "a page both free and owned": lambda s: s["pool"]["free"][0].append(0),
        "a bool length": lambda s: s["sequences"][0].__setitem__("length", True),
        "a huge length": lambda s: s["sequences"][0].__setitem__("length", 2**64 - 5),
        "a string page": lambda s: s["sequences"][0]["pages"].__setitem__(0, "0"),
        "one sequence dropped": lambda s: s["sequences"].pop(),
        "no pool": lambda s: s.pop("pool"),
        "not a state": lambda s: s.clear(),
    }
    for what, change in crafted.items():
        state = copy.deepcopy(good)
        change(state)
        write_manager(directory, json.dumps(state))
        with pytest.raises(CheckpointIntegrityError, match="manager") as err:
            restored = _restore(ck)
            pytest.fail(f"{what}: restored {restored.manager.state_dict()}")
        assert "step 0" in str(err.value), what
        shutil.copy(record_path(pristine[0]), record_path(directory))
    for text in ("[" * 10_000 + "]" * 10_000, '{"format": NaN}', "[]", ""):
        write_manager(directory, text)
        with pytest.raises(CheckpointIntegrityError):
            _restore(ck)


def test_manager_state_with_a_copy_onto_another_sequences_page(ck):
    # a (pages [0, 1], tokens 0..5) and b (pages [0, 4], tokens 0..3, 14, 15): copying a's page 1
    # onto b's page 4 would replace b's K/V of tokens 14, 15 by a's of tokens 4, 5.
    state = json.loads(manager_path(ck[0]).read_text())
    assert state["sequences"][1]["pages"] == [0, 4] and state["sequences"][1]["partial"] == [14, 15]
    state["copies"].append([1, 4])
    write_manager(ck[0], json.dumps(state))
    with pytest.raises(CheckpointIntegrityError, match="manager"):
        _restore(ck)


def test_manager_added_to_a_step_saved_without_one(tmp_path, pristine):
    cache, manager, mesh, pm = flip_fixture()
    save_cache(tmp_path, cache)  # no manager
    assert load_record(tmp_path)["manager_sha256"] is None
    manager_path(tmp_path).write_text(json.dumps(manager.state_dict()))
    with pytest.raises(CheckpointIntegrityError, match="no page manager was saved"):
        restore_cache(tmp_path, mesh=mesh, partition_manager=pm)


def test_schema_rejects_unknown_fingerprint_algorithm_as_newer(ck):
    record = load_record(ck[0])
    record["fingerprint_algorithm"] = "blake3/9"
    write_record(ck[0], record)
    with pytest.raises(CheckpointMismatchError, match="upgrade easykv"):
        _restore(ck)
