"""The import contract of easykv (DESIGN.md, "Arrows point down only"): which package may import
which, no import circles inside a package, private modules stay private, and the package
docstrings' import claims agree with the table below. The checker (tests/support/layering.py)
reads the source with ``ast``: nothing of easykv is imported, so this runs in well under a second.

What counts: every import statement anywhere in a module -- at module level, lazy inside a
function, relative, ``importlib.import_module("easykv...")`` with a literal name. Imports under
``if TYPE_CHECKING:`` count for circles and private modules but not for the layer table: they never
run, and naming another layer's type in an annotation does not make a dependency at run time.

The second half injects one violation into an in-memory copy of the real tree and checks that the
checker reports exactly that one, so the contract cannot pass by checking nothing.
"""

import tomllib
from pathlib import Path

import pytest

from tests.support.layering import (
    ISOLATED,
    UNIMPORTED,
    Contract,
    Row,
    Violation,
    check,
    load_tree,
    parse_claims,
)

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.numpy_only  # no jax at all: run once, in the first CI environment

# ---- the table: bottom to top; each unit may import what its row lists, nothing else ----------------
FOUNDATION = ("errors", "validation", "checked_files")
ARRAYS = (*FOUNDATION, "sharding", "quantization", "spec", "step")  # what the pages are made of
MIDDLE = (*ARRAYS, "storage", "attention", "manager")  # what the facade `import easykv` loads
TOP = ("tiers", "runner", "checkpoint", "integrations")


def row(may_import, why, must_say=()):
    return Row(frozenset(may_import), why, frozenset(must_say))


LAYERS = {
    "errors": row((), "every public exception, in one place: the bottom of the house"),
    "validation": row(("errors",), "one function per rule, raising the public exceptions"),
    "checked_files": row(("errors",), "every file read back is opened once and checked on its descriptor: one place"),
    "sharding": row((), "meshes and axes only: it knows nothing of caches", must_say=[ISOLATED]),
    "multihost": row(FOUNDATION, "the process launcher stands apart: it needs jax and the foundation, and "
                     "no part of the cache depends on how processes were started", must_say=[UNIMPORTED]),
    "quantization": row(FOUNDATION, "how tokens become stored values and scales; knows no cache"),
    "spec": row((*FOUNDATION, "sharding", "quantization"),
                "the static description of a cache (it sizes pages from the quantizer's bytes and the "
                "mesh's shards) is built before any page array or step: no storage, step or manager"),
    "step": row(("validation", "spec"),
                "the one per-step form the manager writes and storage and attention read: none of them "
                "may change it under the others", must_say=["manager", "storage", "attention"]),
    "storage": row(ARRAYS, "the only code that allocates, places, writes and reads page arrays; what to write "
                   "where comes from the step metadata, never from the page manager", must_say=["manager"]),
    "attention": row((*ARRAYS, "storage"), "reads pages (through storage) and the step metadata only, never "
                     "the page manager", must_say=["manager"]),
    "manager": row(("errors", "validation", "spec", "step"),
                   "the host-side brain: pure numpy, deterministic on every host, never touches page arrays, "
                   "so neither storage nor attention (nor the jax-side sharding and quantization)",
                   must_say=["storage", "attention"]),
    "easykv": row(MIDDLE, "the facade: re-exports the middle eagerly; tiers and checkpoint load lazily, by name, "
                  "so only the top may import the facade"),
    "tiers": row((*MIDDLE, "easykv"), "moves pages between device and host memory; never checkpoint, which "
                 "brings orbax and files (what both need, a metadata for another mesh, belongs in spec)"),
    "runner": row((*MIDDLE, "easykv", "tiers"), "applies a manager's plans to a cache and its host tier: the one "
                  "engine loop, above the manager (which never sees a cache or a tier), storage and the tiers"),
    "checkpoint": row((*MIDDLE, "easykv", "runner"), "joins a cache's pages with its manager's state on disk; sits "
                      "on top (sequence import runs its writes through the runner)"),
    "integrations": row((*MIDDLE, "easykv", "tiers", "runner"),
                        "bridges to other libraries, each loaded only when used; an RL rollout puts its cache to "
                        "sleep between calls (tiers) and runs its steps through the runner, none writes checkpoints"),
    "demo": row((*MIDDLE, "easykv", *TOP), "the engine loop behind `easykv demo`, over everything but the cli"),
    "cli": row((*MIDDLE, "easykv", *TOP, "demo"), "the `easykv` command: the very top"),
}
# Aliases kept for one release (until easykv 0.3): the old top-level `sharding`, `easykv.distributed`.
CONTRACT = Contract(root="easykv", rows=LAYERS, deprecated={"sharding": "easykv.sharding"},
                    moved={"distributed": "multihost", "runtime": "step"})


@pytest.fixture(scope="module")
def tree():
    return load_tree(REPO, "easykv")


@pytest.fixture(scope="module")
def found(tree):
    return check(CONTRACT, tree)


def report(violations):
    return f"{len(violations)} violation(s) of the import contract (tests/test_layering.py):\n" + "\n".join(
        f"  {v}" for v in violations)


# ---- the contract on the real tree --------------------------------------------------------------


def test_the_table_points_down_only():
    order, remaining = [], {unit: set(r.may_import) for unit, r in LAYERS.items()}
    for unit, may in remaining.items():
        assert may <= set(LAYERS), f"{unit}'s row names {sorted(may - set(LAYERS))}, which have no row"
    while remaining:  # peel the table from the bottom: a circle would leave rows that never empty
        ready = [u for u, may in remaining.items() if not may - set(order)]
        assert ready, f"the table has a circle among {sorted(remaining)}"
        order += ready
        for u in ready:
            del remaining[u]
    assert not [u for u, r in LAYERS.items() if "multihost" in r.may_import], "nothing in easykv imports multihost"


@pytest.mark.parametrize("rule", ["layer", "unplaced", "shim", "syntax"])
def test_every_import_follows_the_layer_table(found, rule):
    bad = [v for v in found if v.rule == rule]
    assert not bad, report(bad)


def test_no_import_circle_inside_a_package(found):
    bad = [v for v in found if v.rule == "circle"]
    assert not bad, report(bad)


def test_private_modules_are_imported_only_inside_their_package(found):
    bad = [v for v in found if v.rule == "private"]
    assert not bad, report(bad)


def test_package_docstrings_say_what_the_table_says(found):
    bad = [v for v in found if v.rule == "docstring"]
    assert not bad, report(bad)


def test_the_checker_reads_the_whole_tree(tree):
    # Guard against a checker that passes by reading nothing: the tree has its known packages.
    for unit in ("errors", "validation", "sharding", "spec", "step", "storage", "attention", "manager"):
        assert f"easykv.{unit}" in tree, unit


# ---- the checker catches what it should: one injected violation, exactly one report ---------------


def inject(tree, module, snippet):
    """A copy of the tree with ``snippet`` appended to ``module``; the line of its first line."""
    path, source = tree[module]
    source = source if source.endswith("\n") else source + "\n"
    first = source.count("\n") + 1
    return {**tree, module: (path, source + snippet)}, first


def new_violations(tree, changed):
    before, after = set(check(CONTRACT, tree)), set(check(CONTRACT, changed))  # the tree's own: cached parses
    assert not before - after, f"the injection hid violations: {sorted(before - after)}"
    return sorted(after - before)


UPWARD = [  # (snippet, line of the import inside it, how it is reported)
    ("from easykv.manager import manager\n", 0, "module level"),
    ("import easykv.manager.manager\n", 0, "module level"),
    ("from easykv.manager.manager import PageManager\n", 0, "module level"),
    ("from ..manager import manager\n", 0, "module level"),
    ("def f():\n    from easykv.manager import manager\n", 1, "lazy, inside a function"),
    ("class C:\n    from easykv.manager import manager\n", 1, "module level"),
    ("try:\n    import easykv.manager.manager\nexcept ImportError:\n    pass\n", 1, "module level"),
    ("def f():\n    import importlib\n    return importlib.import_module('easykv.manager.manager')\n", 2,
     "lazy, inside a function"),
]


@pytest.mark.parametrize("snippet, offset, kind", UPWARD, ids=lambda x: repr(x) if isinstance(x, str) else None)
def test_an_injected_upward_import_is_reported_once(tree, snippet, offset, kind):
    changed, first = inject(tree, "easykv.storage.writes", snippet)
    new = new_violations(tree, changed)
    assert len(new) == 1, report(new)
    (v,) = new
    assert (v.rule, v.where) == ("layer", f"easykv/storage/writes.py:{first + offset}"), str(v)
    assert v.message.startswith(f"easykv.storage.writes imports easykv.manager.manager ({kind}): "
                                "storage may not import manager. Rule for storage:"), str(v)


def test_the_facade_and_multihost_are_off_limits_below(tree):
    changed, first = inject(tree, "easykv.spec.sizing", "import easykv\nfrom easykv.multihost import launch\n")
    new = new_violations(tree, changed)
    assert [(v.rule, v.where) for v in new] == [("layer", f"easykv/spec/sizing.py:{first}"),
                                                 ("layer", f"easykv/spec/sizing.py:{first + 1}")], report(new)
    assert "spec may not import easykv (the package's own __init__.py)" in new[0].message
    assert "spec may not import multihost" in new[1].message


def test_a_type_checking_import_does_not_count_for_layers(tree):
    snippet = ("from typing import TYPE_CHECKING\n"
               "if TYPE_CHECKING:\n    from easykv.storage.cache import PagedAttentionCache\n")
    changed, _ = inject(tree, "easykv.manager.growth", snippet)
    assert new_violations(tree, changed) == []


def test_an_injected_circle_is_reported_once(tree):
    # step.metadata imports step.checks; a lazy import back closes the circle.
    changed, first = inject(tree, "easykv.step.checks", "def f():\n    from easykv.step import metadata\n")
    new = new_violations(tree, changed)
    assert len(new) == 1, report(new)
    (v,) = new
    assert (v.rule, v.where) == ("circle", f"easykv/step/checks.py:{first + 1}"), str(v)
    assert v.message.startswith("import circle in easykv.step: checks -> metadata "
                                f"(checks.py:{first + 1}, lazy, inside a function) -> checks (metadata.py:"), str(v)


def test_a_circle_under_type_checking_counts(tree):
    snippet = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from easykv.step.metadata import PAD_SLOT\n"
    changed, first = inject(tree, "easykv.step.checks", snippet)
    new = new_violations(tree, changed)
    assert [(v.rule, v.where) for v in new] == [("circle", f"easykv/step/checks.py:{first + 2}")], report(new)
    assert "under TYPE_CHECKING" in new[0].message


def test_an_injected_private_import_is_reported_once(tree):
    changed, first = inject(tree, "easykv.storage.pages", "from easykv.quantization._builtin import Int8Quantizer\n")
    new = new_violations(tree, changed)
    assert [(v.rule, v.where) for v in new] == [("private", f"easykv/storage/pages.py:{first}")], report(new)
    assert "a private module of easykv.quantization" in new[0].message


def test_an_unplaced_module_and_a_deprecated_alias_are_reported(tree):
    changed = {**tree, "easykv.newthing": ("easykv/newthing.py", "from sharding import create_mesh\n")}
    new = new_violations(tree, changed)
    assert [(v.rule, v.where) for v in new] == [("shim", "easykv/newthing.py:1"),
                                                 ("unplaced", "easykv/newthing.py:1")], report(new)


def test_the_moved_alias_reexports_its_new_home_only_and_nobody_imports_it(tree):
    changed, first = inject(tree, "easykv.distributed", "from easykv.manager import manager\n")
    changed, second = inject(changed, "easykv.checkpoint.writer", "from easykv.distributed import launch_local\n")
    new = new_violations(tree, changed)
    assert [(v.rule, v.where) for v in new] == [("shim", f"easykv/checkpoint/writer.py:{second}"),
                                                 ("shim", f"easykv/distributed.py:{first}")], report(new)
    assert "import from easykv.multihost instead" in new[0].message
    assert "re-exports easykv.multihost only" in new[1].message


def test_the_multihost_package_as_designed_passes(tree):
    changed = {m: f for m, f in tree.items() if m != "easykv.distributed"}
    changed["easykv.multihost"] = ("easykv/multihost/__init__.py",
                                   '"""Processes: start, check lock-step, launch. Nothing else in easykv imports '
                                   'this package."""\n')
    changed["easykv.multihost.launch"] = ("easykv/multihost/launch.py",
                                          "import jax\nfrom easykv.errors import MultiProcessError\n"
                                          "from easykv.validation import integer\n")
    after = set(check(CONTRACT, changed))
    assert after == {v for v in check(CONTRACT, tree) if v.where.split(":")[0] != "easykv/distributed.py"}
    undocumented = {**changed, "easykv.multihost": ("easykv/multihost/__init__.py", '"""Processes."""\n')}
    new = sorted(set(check(CONTRACT, undocumented)) - after)
    assert [(v.rule, v.where) for v in new] == [("docstring", "easykv/multihost/__init__.py:1")], report(new)
    assert "does not say that nothing in easykv imports it" in new[0].message


def with_docstring(tree, module, old, new):
    path, source = tree[module]
    assert old in source, f"{module}'s docstring changed: update this test ({old!r})"
    return {**tree, module: (path, source.replace(old, new, 1))}


def test_a_docstring_that_drops_a_rule_is_reported(tree):
    changed = with_docstring(tree, "easykv.manager", "this package imports neither ``storage`` nor ``attention``",
                             "this package imports neither ``storage`` nor ``tiers``")
    new = new_violations(tree, changed)
    assert [(v.rule, v.where) for v in new] == [("docstring", "easykv/manager/__init__.py:1")], report(new)
    assert "does not say that it never imports attention" in new[0].message


def test_a_docstring_that_contradicts_the_table_is_reported(tree):
    changed = with_docstring(tree, "easykv.storage", "which this package does not import",
                             "which this package does not import; this package never imports ``spec``")
    new = new_violations(tree, changed)
    assert [(v.rule, v.where) for v in new] == [("docstring", "easykv/storage/__init__.py:1")], report(new)
    assert "says it never imports spec, but the table lets storage import it" in new[0].message


def test_a_docstring_that_says_nothing_is_imported_is_held_to_it(tree):
    changed, first = inject(tree, "easykv.storage", "from easykv.storage import pages\n")
    new = new_violations(tree, changed)
    assert [(v.rule, v.where) for v in new] == [("docstring", "easykv/storage/__init__.py:1")], report(new)
    assert f"says nothing is imported there, but line {first} imports" in new[0].message


@pytest.mark.parametrize("text, never, only, isolated, unimported, empty_init", [
    ("This package imports neither ``storage`` nor ``attention``; nothing is imported here.",
     {"storage", "attention"}, None, False, False, True),
    ("This package imports ``spec`` and ``validation`` only: never ``manager``, ``storage`` or ``attention``.",
     {"manager", "storage", "attention"}, {"spec", "validation"}, False, False, False),
    ("They read pages only: the page manager is never imported here; nothing is imported by this file.",
     {"manager"}, None, False, False, True),
    ("They know nothing of caches, and this package imports nothing else of easykv.", set(), None, True, False, False),
    ("Nothing in easykv imports this package.", set(), None, False, True, False),
    ("It launches processes; nothing else imports it.", set(), None, False, True, False),
    ("No other package imports this one, and this package imports ``errors`` and ``validation`` only.",
     set(), {"errors", "validation"}, False, True, False),
    # Not claims: no word of this package / here, or no unit named.
    ("They bring orbax, which ``import easykv`` loads only on first use.", set(), None, False, False, False),
    ("Each step's metadata is built by the manager only.", set(), None, False, False, False),
])  # fmt: skip
def test_docstring_claims_are_read(text, never, only, isolated, unimported, empty_init):
    claims = parse_claims(text, LAYERS, own="probe")
    assert (claims.never, claims.only, claims.isolated, claims.unimported, claims.no_init_imports, claims.unclear) == (
        never, only, isolated, unimported, empty_init, [])


def test_violations_read_well():
    v = Violation("layer", "easykv/x.py:3", "m imports n")
    assert str(v) == "easykv/x.py:3: [layer] m imports n"


# ---- the type check covers what the wheel ships (pyproject.toml [tool.mypy], a step of .ci/run) ------

# All a per-module override of easykv's own modules may do: relax the two rules that a base class or an
# annotation from a library shipping no types breaks (EasyDeL's, Tunix's). More (ignore_errors, a
# disabled error code, a package wildcard) would hide easykv's own mistakes.
RELAXABLE = {"disallow_subclassing_any": False, "disallow_any_unimported": False}


def mypy_config():
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_mypy_checks_every_module_the_wheel_ships(tree):
    config = mypy_config()
    files = config["tool"]["mypy"]["files"]

    def covered(path):
        return any(path == f or path.startswith(f.rstrip("/") + "/") for f in files)

    assert len(tree) > 100, len(tree)  # the package was read
    missing = sorted(path for path, _ in tree.values() if not covered(path))
    assert not missing, f"[tool.mypy] files in pyproject.toml leave out modules of easykv: {missing}"
    shipped = [pattern.rstrip("*") for pattern in config["tool"]["setuptools"]["packages"]["find"]["include"]]
    assert "easykv" in shipped, shipped
    unchecked = [name for name in shipped if not covered(f"{name}/__init__.py")]
    assert not unchecked, f"[tool.mypy] files leave out packages the wheel ships: {unchecked}"
    assert (REPO / "easykv" / "py.typed").is_file(), "easykv/py.typed (PEP 561) is missing"
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["easykv"]


def test_mypy_overrides_relax_only_untyped_bases_of_named_modules(tree):
    for override in mypy_config()["tool"]["mypy"].get("overrides", []):
        modules = [override["module"]] if isinstance(override["module"], str) else override["module"]
        ours = [m for m in modules if m == "easykv" or m.startswith("easykv.")]
        if not ours:
            continue
        assert ours == modules, f"an override mixes easykv's modules with others: {modules}"
        unknown = [m for m in ours if m not in tree]  # a wildcard, or a module that is gone
        assert not unknown, f"[[tool.mypy.overrides]] names {unknown}: name existing easykv modules one by one"
        settings = {key: value for key, value in override.items() if key != "module"}
        assert settings and settings.items() <= RELAXABLE.items(), (
            f"the override of {ours} sets {settings}; easykv's modules may relax only {RELAXABLE}")
