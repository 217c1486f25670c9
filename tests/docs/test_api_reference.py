"""The API reference (docs/api/*.md, rendered by mkdocstrings from the docstrings): every name
of ``easykv.__all__`` has an entry, and every public function, method and class constructor
shown there documents each of its parameters in a Google-style ``Args:`` section (classes may
use ``Attributes:``), read with griffe, the parser the docs build uses. Where a parameter is an
array its entry gives its shape; that part is a reviewer's check, not this test's.

Needs the ``docs`` extra (griffe); CI's docs step runs it with the strict build."""

import pathlib
import re

import pytest

import easykv

griffe = pytest.importorskip("griffe", reason="the docs extra (pip install -e '.[docs]') brings griffe")

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENTRY = re.compile(r"^::: ([\w.]+)\s*\n((?:    .*\n)*)", re.M)  # the path, then its indented options
_SKIP = {"self", "cls"}


def _entries(*, with_members: bool = False) -> list[str]:
    """The paths of the entries (with ``with_members``: only those that render their members;
    a module shown for its notes alone says ``members: false``)."""
    pages = sorted((ROOT / "docs" / "api").glob("*.md"))
    found = [m for page in pages for m in ENTRY.finditer(page.read_text() + "\n")]
    return [m.group(1) for m in found if not (with_members and "members: false" in m.group(2))]


@pytest.fixture(scope="module")
def package():
    loader = griffe.GriffeLoader(docstring_parser=griffe.Parser.google, search_paths=[str(ROOT)])
    loader.load("easykv")
    loader.resolve_aliases(implicit=True, external=False)
    return loader.modules_collection


def _target(obj):
    return obj.final_target if obj.is_alias else obj


def _documented(obj) -> set[str]:
    if obj.docstring is None:
        return set()
    names = set()
    for section in obj.docstring.parse(griffe.Parser.google):
        if section.kind.value in ("parameters", "attributes", "other parameters"):
            names |= {item.name.lstrip("*") for item in section.value}
    return names


def _shown(obj):
    """The objects an entry renders: itself, and a class's or module's public members."""
    yield obj
    if obj.is_module or obj.is_class:
        for name, member in obj.members.items():
            if name.startswith("_") or (obj.is_module and member.is_alias):
                continue
            member = _target(member)
            if member.is_function or member.is_class:
                yield member


def _missing(obj) -> list[str]:
    if obj.is_class:
        if obj.name.endswith(("Error", "Warning")):  # raised by easykv, not built by callers
            return [] if obj.docstring else ["(no docstring)"]
        init = obj.members.get("__init__")
        params = [p.name for p in _target(init).parameters] if init is not None else []
    elif obj.is_function:
        params = [p.name for p in obj.parameters]
    else:
        return []
    if obj.docstring is None:
        return ["(no docstring)"]
    return [p for p in params if p not in _SKIP and p not in _documented(obj)]


def test_every_top_level_name_has_an_api_entry(package):
    shown = {_target(package[path]).path for path in _entries(with_members=True)}
    for obj in list(shown):
        target = package[obj]
        shown |= {_target(m).path for m in _shown(target)}
    missing = []
    for name in easykv.__all__:
        obj = package[f"easykv.{name}"]
        obj = _target(obj)
        if name != "errors" and obj.path not in shown and not obj.is_attribute:  # a module; constants
            missing.append(name)
    assert not missing, f"names of easykv.__all__ with no entry in docs/api/*.md: {missing}"


def test_every_documented_callable_describes_each_parameter(package):
    bad = {}
    for path in _entries():
        target = _target(package[path])
        for obj in _shown(target) if path in _entries(with_members=True) else [target]:
            gaps = _missing(obj)
            if gaps:
                bad[obj.path] = gaps
    assert not bad, "parameters with no Args: entry:\n" + "\n".join(f"  {k}: {v}" for k, v in sorted(bad.items()))
