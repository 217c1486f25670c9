"""The top-level ``easykv`` namespace: ``__all__`` sorted and every name in it importable, the
lazily loaded names listed by ``dir(easykv)`` without being loaded by it, and an unknown name an
AttributeError that names it."""

import importlib
import subprocess
import sys

import pytest

import easykv


def test_all_is_sorted_and_every_name_resolves():
    assert easykv.__all__ == sorted(easykv.__all__)
    assert len(set(easykv.__all__)) == len(easykv.__all__)
    for name in easykv.__all__:
        assert getattr(easykv, name) is not None, name


def test_dir_lists_the_lazy_names_without_loading_them():
    code = ("import sys, easykv; names = dir(easykv); "
            "assert {'save_cache', 'sleep', 'HostTier', 'export_sequence'} <= set(names), names; "
            "assert 'easykv.checkpoint.checkpointer' not in sys.modules; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert set(easykv._LAZY) <= set(dir(easykv)) and set(easykv.__all__) <= set(dir(easykv))


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="module 'easykv' has no attribute 'no_such_name'"):
        easykv.no_such_name  # noqa: B018


def test_the_top_level_is_at_most_thirty_names_and_none_of_them_is_deprecated():
    assert len(easykv.__all__) <= 30, easykv.__all__
    assert not set(easykv.__all__) & set(easykv._MOVED)
    assert "errors" in easykv.__all__ and easykv.errors.CheckpointMismatchError.__module__ == "easykv.errors"


@pytest.mark.parametrize("name", sorted(easykv._MOVED))
def test_a_moved_name_still_imports_with_a_warning_naming_its_home(name):
    home = importlib.import_module(easykv._MOVED[name])
    fix = rf"from {home.__name__} import {name}\)"
    with pytest.warns(DeprecationWarning, match=rf"^easykv\.{name} is deprecated: .*{fix}"):
        old = getattr(easykv, name)
    assert old is getattr(home, name)
    with pytest.warns(DeprecationWarning, match=rf"easykv\.{name} is deprecated"):
        exec(f"from easykv import {name}", {})


def test_the_moved_names_are_not_listed_and_fail_the_suite_when_used():
    assert not set(easykv._MOVED) & set(dir(easykv))
    # pyproject.toml's filterwarnings turns the warning into an error inside the suite, so no
    # test, example or benchmark it runs can lean on an old name unseen
    with pytest.raises(DeprecationWarning, match="easykv.PRESETS is deprecated"):
        easykv.PRESETS  # noqa: B018
