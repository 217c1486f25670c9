"""`DemoOptions` checks every field when it is built, against the one table of allowed values in
easykv/demo/options.py (issue 42: ``run_demo(DemoOptions(seed=-1))`` failed inside numpy without
naming the field; the CLI refused ``--seed -1`` but Python callers got no such check).

Every field has bad values below (a field added later without any fails the coverage test);
each is refused with a TypeError (wrong type: a bool is not an int) or a ValueError (a value
outside the field's range) naming ``DemoOptions.<field>``, the value and what to use."""

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest

import easykv.demo.run as demo_run
from easykv.cli import main
from easykv.demo.options import DTYPES, INT_RANGES, LONGEST_PROMPT, MAX_LEN, MESH_AXIS_SIZES, MODEL_NAMES, DemoOptions


def _int_cases(field: str) -> list[tuple]:
    low, high = INT_RANGES[field]
    out_of_range = [(v, ValueError, [repr(v), f"{low}..{high}"]) for v in (low - 1, high + 1, -(2**64), 2**64)]
    wrong_type = [(v, TypeError, ["must be an int", f"{low}..{high}"])
                  for v in (True, False, np.bool_(True), 1.0, np.float64(2.0), "3", None, [1])]  # fmt: skip
    return out_of_range + wrong_type


def _mesh_cases() -> list[tuple]:
    low, high = MESH_AXIS_SIZES
    return [
        ({}, ValueError, ["names no mesh axis", "{'tp': 8}"]),
        ({"tp": 0}, ValueError, ["['tp']", "0", f"{low}..{high}"]),
        ({"tp": -1}, ValueError, ["['tp']", "-1", f"{low}..{high}"]),
        ({"dp": 2, "tp": high + 1}, ValueError, ["['tp']", str(high + 1), f"{low}..{high}"]),
        ({"tp": True}, TypeError, ["['tp']", "must be an int"]),
        ({"tp": 8.0}, TypeError, ["['tp']", "must be an int"]),
        ({8: 8}, TypeError, ["axis name 8", "name each axis with a str"]),
        ({"": 8}, ValueError, ["empty axis name"]),
        ([("tp", 8)], TypeError, ["must be a dict of mesh axis names to sizes", "list"]),
        ("tp=8", TypeError, ["must be a dict of mesh axis names to sizes", "str"]),
        (None, TypeError, ["must be a dict of mesh axis names to sizes"]),
    ]


BAD = {
    **{field: _int_cases(field) for field in INT_RANGES},
    "mesh": _mesh_cases(),
    "restore_mesh": _mesh_cases(),
    "quant": [("int3", ValueError, ["'int3'", "unknown quantizer", "available"]),
              ("int4-ch", ValueError, ["cannot check int4-ch", "int4-rot"]),
              (3, TypeError, ["quantizer's name", "int"]), (None, TypeError, ["quantizer's name"])],
    "dtype": [("float64", ValueError, ["'float64'", "float32, bfloat16"]),
              ("float16", ValueError, ["'float16'", "float32, bfloat16"]),
              (np.float32, TypeError, ["must be a str", "float32, bfloat16"])],
    "model": [("llama", ValueError, ["'llama'", "hybrid, uniform"]), ("Hybrid", ValueError, ["hybrid, uniform"]),
              (None, TypeError, ["must be a str", "hybrid, uniform"])],
    # "" used to mean a temporary directory (``checkpoint_dir or mkdtemp()``): a silent guess.
    "checkpoint_dir": [("", ValueError, ["''", "None for a temporary one"]),
                       ("ck\x00pt", ValueError, ["NUL byte"]), (3, TypeError, ["str or PathLike"]),
                       (b"ck", TypeError, ["str or PathLike", "bytes"])],
    "progress": [(1, TypeError, ["True or False", "int"]), ("yes", TypeError, ["True or False"]),
                 (None, TypeError, ["True or False"])],
    "weights": [("", ValueError, ["''", "'trained', 'random' or the path of an .npz"]),
                ("w\x00.npz", ValueError, ["NUL byte"]), (None, TypeError, ["'trained', 'random'"]),
                (Path("w.npz"), TypeError, ["'trained', 'random'", "Path"])],
    "store": [(3, TypeError, ["DemoOptions.store must be a store URL", "int"]),
              (Path("/tmp/s"), TypeError, ["store URL (str) or None", "PosixPath"]),
              ("ftp://x/y", ValueError, ["DemoOptions.store", "ftp"]),
              ("file://relative/dir", ValueError, ["DemoOptions.store", "relative"]),
              ("", ValueError, ["DemoOptions.store"])],
}  # fmt: skip


def test_every_field_has_bad_values_here():
    assert set(BAD) == {f.name for f in dataclasses.fields(DemoOptions)}


CASES = [pytest.param(field, value, error, words, id=f"{field}={value!r:.20}")
         for field, cases in BAD.items() for value, error, words in cases]  # fmt: skip


@pytest.mark.parametrize("field, value, error, words", CASES)
def test_a_bad_field_is_refused_naming_it_the_value_and_the_fix(field, value, error, words):
    mesh, before = {"tp": 8}, copy.deepcopy(value)
    with pytest.raises(error) as caught:
        DemoOptions(**{field: value}, mesh=mesh) if field != "mesh" else DemoOptions(mesh=value)
    assert type(caught.value) is error  # not a subclass standing in for the other kind
    message = str(caught.value)
    assert f"DemoOptions.{field}" in message and f"DemoOptions.restore_{field}" not in message, message
    for word in words:
        assert word in message, (word, message)
    assert mesh == {"tp": 8} and value == before  # the caller's arguments are left as they were


def test_the_issues_seed_is_refused_by_name_before_the_demo_starts(monkeypatch):
    """The issue's reproduction: numpy's 'expected non-negative integer' from deep inside the run."""
    monkeypatch.setattr(demo_run, "create_mesh", lambda *a, **k: pytest.fail("the demo started"))
    with pytest.raises(ValueError, match=r"^DemoOptions\.seed must be a non-negative int, got -1 "
                                         r"\(valid: 0\.\.4294967295\)$"):
        demo_run.run_demo(DemoOptions(seed=-1, weights="random", progress=False))


def test_the_documented_ranges():
    """docs/cli.md gives these; the CLI's flags read them (tests/cli/test_numeric_flags.py)."""
    assert {f: INT_RANGES[f] for f in ("requests", "max_new_tokens", "decode_steps", "seed")} == {
        "requests": (1, 64), "max_new_tokens": (2, 128), "decode_steps": (1, 64), "seed": (0, 2**32 - 1)}
    assert set(INT_RANGES) <= {f.name for f in dataclasses.fields(DemoOptions)}


# The fields an end of a range needs beside it to make a demo that runs (the cross-field checks).
_COMPANIONS = {("pages", "low"): {"page_size": 256}, ("token_budget", "low"): {"max_seqs": 2},
               ("max_seqs", "low"): {"requests": 1}}  # fmt: skip


@pytest.mark.parametrize("field", sorted(INT_RANGES))
def test_each_end_of_a_range_is_accepted_as_an_exact_int(field):
    low, high = INT_RANGES[field]
    for end, value in (("low", low), ("high", high), ("low", np.int64(low)),
                       ("high", np.uint32(high) if high < 2**32 else high)):  # fmt: skip
        options = DemoOptions(**{field: value}, **_COMPANIONS.get((field, end), {}))
        assert getattr(options, field) == value and type(getattr(options, field)) is int


def test_the_defaults_are_valid_and_a_mesh_is_copied():
    mesh = {"dp": np.int64(2), "tp": 4}
    options = DemoOptions(mesh=mesh, restore_mesh={"tp": 8}, checkpoint_dir=Path("ck"), dtype="bfloat16",
                          model="uniform", quant="int8", weights="random", progress=False)
    mesh["tp"] = 0  # a later change of the caller's dict does not reach the checked options
    assert options.mesh == {"dp": 2, "tp": 4} and type(options.mesh["dp"]) is int
    assert all(lo <= getattr(DemoOptions(), f) <= hi for f, (lo, hi) in INT_RANGES.items())


def test_the_tables_match_the_demo_they_describe():
    """MODEL_NAMES are the models run_demo has; the longest prompt plus the most new tokens is
    the demo's sequence length, so no request of any allowed size outgrows its cache."""
    from easykv.demo.workload import make_requests

    assert tuple(demo_run.MODELS) == MODEL_NAMES and DTYPES == ("float32", "bfloat16")
    requests = make_requests(INT_RANGES["requests"][1], INT_RANGES["max_new_tokens"][1], seed=0)
    assert max(len(r.prompt) for r in requests) == LONGEST_PROMPT
    assert max(len(r.prompt) + r.max_new_tokens for r in requests) <= MAX_LEN
    assert LONGEST_PROMPT + INT_RANGES["max_new_tokens"][1] == MAX_LEN  # and not a token less


@pytest.mark.parametrize("field", ["mesh", "restore_mesh"])
def test_a_mesh_that_does_not_fit_the_devices_is_refused_by_field_before_any_work(field, monkeypatch):
    """The restore mesh was built only after half the demo had run and a checkpoint was written."""
    monkeypatch.setattr(demo_run, "_metadata", lambda *a, **k: pytest.fail("the demo started before the check"))
    with pytest.raises(ValueError, match=rf"^DemoOptions\.{field} = {{'tp': 16}}: create_mesh: .* 8 devices"):
        demo_run.run_demo(DemoOptions(**{field: {"tp": 16}}, weights="random", progress=False))


@pytest.mark.parametrize("flag", ["--mesh", "--restore-mesh"])
@pytest.mark.parametrize("axes", ["tp=4", "tp=16", "dp=2,tp=2"])
def test_the_cli_names_a_mesh_flag_whose_axes_do_not_multiply_to_the_devices(flag, axes, capsys, monkeypatch):
    """tp=4 on 8 devices passed the CLI's check (it compared with '>') and failed in create_mesh
    without naming the flag."""
    monkeypatch.setattr(demo_run, "run_demo", lambda *a, **k: pytest.fail("the demo ran"))
    assert main(["demo", flag, axes, "--weights", "random"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"easykv demo: error: {flag} {{"), lines
    assert "multiply to this process's 8 devices" in lines[0], lines


def test_run_demo_takes_only_checked_options():
    with pytest.raises(TypeError, match="run_demo takes a DemoOptions, got dict"):
        demo_run.run_demo({"seed": -1})


# ---- fields valid one by one that cannot run together (issue 42) ------------------------------------
def test_the_attacks_pools_are_refused_naming_both_fields_and_the_fix(monkeypatch):
    """It failed 2 s into run_demo, in the metadata, naming max_sequences (no DemoOptions field)."""
    monkeypatch.setattr(demo_run, "create_mesh", lambda *a, **k: pytest.fail("the demo started"))
    mesh = {"tp": 8}
    with pytest.raises(ValueError) as caught:
        demo_run.run_demo(DemoOptions(pages=4, page_size=1, weights="random", model="uniform", requests=3,
                                      max_new_tokens=2, progress=False, mesh=mesh))  # fmt: skip
    assert type(caught.value) is ValueError and mesh == {"tp": 8}
    assert str(caught.value) == (
        "DemoOptions.pages=4 with DemoOptions.page_size=1 cannot hold one sequence of the demo's 256 tokens: the "
        "uniform model's full-attention layers need 256 pages of 1 token per sequence but their pool holds 4 (pages); "
        "use pages >= 256 or page_size >= 64")


def test_a_sliding_pool_too_small_is_named_with_its_share():
    with pytest.raises(ValueError) as caught:
        DemoOptions(pages=4, page_size=64)  # the full layers need 4 pages of 4; the sliding ones 2 of 4 // 4
    assert str(caught.value) == (
        "DemoOptions.pages=4 with DemoOptions.page_size=64 cannot hold one sequence of the demo's 256 tokens: the "
        "hybrid model's sliding-window (window 32) layers need 2 pages of 64 tokens per sequence but their pool holds "
        "1 (a 1/4 share of pages); use pages >= 8 or page_size >= 256")


PAGE_SIZES = (1, 2, 3, 7, 8, 9, 16, 31, 32, 33, 64, 100, 128, 255, 256)
PAGES = (4, 5, 7, 8, 9, 31, 32, 33, 35, 36, 37, 63, 64, 65, 127, 128, 129, 255, 256, 257, 16384)


def _cache_builds(model: str, pages: int, page_size: int, mesh, pm) -> bool:
    """Whether the demo's cache metadata (as run_demo sizes it) accepts ``pages`` of ``page_size``."""
    import jax.numpy as jnp

    from easykv.quantization import get_quantizer

    unchecked = object.__new__(DemoOptions)  # the pair as run_demo would size it, before any check
    for name, value in (("pages", pages), ("page_size", page_size), ("max_seqs", 8)):
        object.__setattr__(unchecked, name, value)
    try:
        demo_run._metadata(unchecked, demo_run.MODELS[model], mesh, pm, jnp.dtype("float32"), get_quantizer("none"),
                           MAX_LEN)  # fmt: skip
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_the_pools_options_accept_are_exactly_those_the_cache_builds(model):
    """DemoOptions' check and the metadata's own agree on every pages x page_size pair around the
    bounds: none accepted that the cache refuses, none refused that it builds."""
    from easykv.sharding import PartitionAxis, PartitionManager, create_mesh

    mesh, pm = create_mesh({"tp": 8}), PartitionManager(PartitionAxis())
    disagree, outcomes = [], set()
    for page_size in PAGE_SIZES:
        for pages in PAGES:
            try:
                DemoOptions(pages=pages, page_size=page_size, model=model)
                accepted = True
            except ValueError as err:
                assert str(err).startswith(f"DemoOptions.pages={pages} with DemoOptions.page_size={page_size} "), err
                accepted = False
            outcomes.add(accepted)
            if accepted != _cache_builds(model, pages, page_size, mesh, pm):
                disagree.append((pages, page_size, accepted))
    assert not disagree, disagree
    assert outcomes == {True, False}  # the grid straddles the bound


def test_the_model_table_options_check_is_the_models_layer_groups():
    from easykv.demo.options import model_groups

    for name in MODEL_NAMES:
        groups = demo_run.MODELS[name].layer_groups() or (model_groups("uniform")[0],)
        assert {(g.attention, g.window) for g in groups} == {(g.attention, g.window) for g in model_groups(name)}


def test_more_sequences_than_the_step_budget_is_refused_naming_both_fields():
    """It failed in the engine, after the model was built, naming the engine's arguments."""
    with pytest.raises(ValueError) as caught:
        DemoOptions(token_budget=2, max_seqs=8)
    assert type(caught.value) is ValueError and str(caught.value) == (
        "DemoOptions.max_seqs=8 exceeds DemoOptions.token_budget=2: a step decodes one token of every running sequence "
        "within its budget; use token_budget >= 8 or max_seqs <= 2")
    assert DemoOptions(token_budget=8, max_seqs=8).max_seqs == 8


def test_one_sequence_slot_for_a_demo_with_a_fork_is_refused():
    """The attack's 'hang': with max_seqs=1 the engine kept the one slot for the fork still to come,
    admitted nothing and stepped on, empty, forever (an endless loop of no work after the midway
    checkpoint)."""
    with pytest.raises(ValueError) as caught:
        DemoOptions(pages=4, page_size=256, requests=3, max_new_tokens=2, token_budget=2, max_seqs=1, weights="random")
    assert str(caught.value) == (
        "DemoOptions.max_seqs=1 with DemoOptions.requests=3: the demo's last request is a parallel sample (a fork) of "
        "its first and runs beside it, in a second sequence slot, which the engine would wait for forever; use "
        "max_seqs >= 2 (or requests=1)")
    assert DemoOptions(requests=1, max_seqs=1).max_seqs == 1


@pytest.mark.parametrize("requests", [1, 2, 3, 64])
def test_a_demo_of_more_than_one_request_has_a_fork(requests):
    """What the rule above assumes of the workload."""
    from easykv.demo.workload import make_requests

    forks = [r for r in make_requests(requests, 8, seed=0) if r.fork_of is not None]
    assert len(forks) == (1 if requests > 1 else 0)


def test_an_engine_that_can_never_schedule_a_request_raises_instead_of_spinning():
    """The attack's options (one sequence slot, a fork still to come) passed DemoOptions' checks
    once, and the engine kept its one slot for the fork and ran empty steps forever. DemoOptions
    refuses them now; the engine itself must also stop: options built past those checks make it
    raise CacheFullError at the first step that can change nothing, naming the requests."""
    from easykv.errors import CacheFullError
    from tests.support.hostile_files import finishes_within

    unchecked = object.__new__(DemoOptions)
    fields = dataclasses.asdict(DemoOptions(weights="random", progress=False, pages=4, page_size=256, requests=1,
                                            max_new_tokens=2, token_budget=2, max_seqs=1))
    for name, value in {**fields, "requests": 3}.items():
        object.__setattr__(unchecked, name, value)

    def run() -> BaseException | None:
        try:
            demo_run.run_demo(unchecked)
        except CacheFullError as err:
            return err
        return None

    err = finishes_within(run, seconds=120)
    assert err is not None, "the demo finished, which one slot and a fork to come cannot do"
    assert "can never run" in str(err) and "max_seqs=1" in str(err) and err.resource == "sequence slots"
