"""The top-level ``easykv`` namespace: ``__all__`` sorted and every name in it importable, the
lazily loaded names listed by ``dir(easykv)`` without being loaded by it, and an unknown name an
AttributeError that names it."""

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
