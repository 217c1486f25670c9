"""Every numeric flag of every ``easykv`` subcommand, read off the parser itself (a flag added
later is covered without touching this file): a value outside its range, a huge one or no
number at all is refused by argparse naming the flag, one line and exit code 2, before the
command runs; never numpy's or Python's message (issue 42: ``easykv demo --seed -1``)."""

import argparse
import dataclasses
import math

import pytest

from easykv.cli import NumberFlag, _build_parser, main


def _options() -> list[tuple[str, argparse.Action]]:
    """``(subcommand, action)`` of every option of every subcommand."""
    (commands,) = [a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return [(name, action) for name, sub in commands.choices.items() for action in sub._actions
            if action.option_strings]  # fmt: skip


def _is_numeric(action: argparse.Action) -> bool:
    numeric_default = isinstance(action.default, (int, float)) and not isinstance(action.default, bool)
    return action.type in (int, float) or isinstance(action.type, NumberFlag) or (
        numeric_default and action.nargs != 0)  # store_true and the like take no value


NUMERIC = [(command, action.option_strings[-1], action.type) for command, action in _options() if _is_numeric(action)]


def _outside(flag_type: NumberFlag) -> list[str]:
    """Values ``flag_type`` must refuse: just past each end, signs, zero, huge, and no number."""
    low = flag_type.low if flag_type.low_open else flag_type.low - (1 if flag_type.kind is int else 1e-9)
    candidates = [low, flag_type.high + (1 if flag_type.kind is int else 1e-9), -1, 0, 2**64, -(2**64), 10**400]
    values = [str(v) for v in candidates if not _inside(flag_type, v)]
    return values + ["abc", "", "1.5" if flag_type.kind is int else "1,5", "nan", "inf", "-inf", "9" * 5000]


def _inside(flag_type: NumberFlag, value: float) -> bool:
    above_low = value > flag_type.low if flag_type.low_open else value >= flag_type.low
    return above_low and value <= flag_type.high


def test_the_numeric_flags_are_found_and_each_is_parsed_by_a_number_flag():
    found = {(command, flag) for command, flag, _ in NUMERIC}
    assert {("demo", "--seed"), ("demo", "--requests"), ("demo", "--decode-steps"), ("plan", "--page-size"),
            ("plan", "--batch-size"), ("plan", "--utilization"), ("plan", "--cpu-devices")} <= found, found
    plain = sorted((command, flag) for command, flag, flag_type in NUMERIC if not isinstance(flag_type, NumberFlag))
    assert not plain, f"numeric flags parsed without a range (give them type=NumberFlag(...)): {plain}"


CASES = [pytest.param(command, flag, value, id=f"{command}{flag}={value[:12]}")
         for command, flag, flag_type in NUMERIC if isinstance(flag_type, NumberFlag)
         for value in _outside(flag_type)]  # fmt: skip


@pytest.mark.parametrize("command, flag, value", CASES)
def test_a_value_outside_a_numeric_flags_range_is_refused_naming_the_flag(command, flag, value, capsys):
    code = main([command, f"{flag}={value}"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and captured.out == "", (code, captured)
    assert len(lines) == 1 and lines[0].startswith(f"easykv {command}: error: argument {flag}: "), lines
    assert "; use " in lines[0] and "Traceback" not in lines[0], lines  # the range to use instead


@pytest.mark.parametrize("command, flag, flag_type", [(c, f, t) for c, f, t in NUMERIC if isinstance(t, NumberFlag)],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_each_end_of_a_range_is_accepted(command, flag, flag_type):
    parser = _build_parser()
    ends = [flag_type.high] + ([] if flag_type.low_open else [flag_type.low])
    for value in ends:
        parsed = vars(parser.parse_args([command, f"{flag}={value}"]))
        assert parsed[flag.lstrip("-").replace("-", "_")] == value
        assert type(parsed[flag.lstrip("-").replace("-", "_")]) is flag_type.kind


def test_the_issues_seed_is_refused_before_the_demo_starts(capsys, monkeypatch):
    import easykv.cli

    monkeypatch.setattr(easykv.cli, "cmd_demo", lambda args: pytest.fail("the demo ran with --seed -1"))
    assert main(["demo", "--seed", "-1"]) == 2
    assert capsys.readouterr().err == ("easykv demo: error: argument --seed: -1 is out of range; use 0..4294967295\n")


@pytest.mark.parametrize("text, expected", [("0.5", 0.5), ("1", 1.0), ("1e-3", 1e-3)])
def test_a_fraction_flag_takes_any_number_in_its_half_open_range(text, expected):
    assert math.isclose(NumberFlag(float, 0.0, 1.0, low_open=True)(text), expected)


# ---- the demo's flags and DemoOptions: one table -------------------------------------------------
def _demo_actions() -> dict[str, argparse.Action]:
    return {action.dest: action for command, action in _options() if command == "demo"}


def test_the_demos_flags_take_their_ranges_choices_and_defaults_from_demo_options():
    """``easykv demo --seed -1`` and ``run_demo(DemoOptions(seed=-1))`` refuse the same values:
    every numeric flag of the demo that sets a DemoOptions field has exactly that field's range
    in easykv.demo.options.INT_RANGES (the only other one, --cpu-devices, configures the process)."""
    from easykv.demo.options import DTYPES, INT_RANGES, MODEL_NAMES, DemoOptions

    actions, defaults = _demo_actions(), DemoOptions()
    fields = {f.name for f in dataclasses.fields(DemoOptions)}
    numeric = {dest for dest, action in actions.items() if isinstance(action.type, NumberFlag)}
    assert numeric - fields == {"cpu_devices"}, numeric
    assert {"requests", "max_new_tokens", "decode_steps", "seed"} <= numeric & set(INT_RANGES)
    for dest in sorted(numeric & fields):
        flag_type = actions[dest].type
        assert (flag_type.kind, flag_type.low, flag_type.high, flag_type.low_open) == (int, *INT_RANGES[dest], False)
    assert actions["model"].choices == MODEL_NAMES and actions["dtype"].choices == DTYPES
    for dest in sorted(set(actions) & fields - {"mesh", "restore_mesh"}):  # the meshes default to the devices
        assert actions[dest].default == getattr(defaults, dest), dest


@pytest.mark.parametrize("dest", ["requests", "max_new_tokens", "decode_steps", "seed"])
def test_the_flag_and_the_field_refuse_and_accept_the_same_values(dest, capsys):
    from easykv.demo.options import DemoOptions

    action = _demo_actions()[dest]
    low, high = action.type.low, action.type.high
    flag = action.option_strings[-1]
    for value in (low - 1, high + 1):
        assert main(["demo", f"{flag}={value}"]) == 2
        assert f"argument {flag}: {value} is out of range; use {low}..{high}" in capsys.readouterr().err
        refusal = rf"^DemoOptions\.{dest} must be .* got {value} \(valid: {low}\.\.{high}\)$"
        with pytest.raises(ValueError, match=refusal):
            DemoOptions(**{dest: value})
    parser = _build_parser()
    for value in (low, high):
        parsed = vars(parser.parse_args(["demo", f"{flag}={value}"]))[dest]
        assert getattr(DemoOptions(**{dest: parsed}), dest) == value
