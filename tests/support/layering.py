"""The import-contract checker behind tests/test_layering.py: it reads the source of every module
of a package with ``ast`` (nothing is imported or run), finds every import (module level, lazy
inside a function, under ``if TYPE_CHECKING:``, relative, ``importlib.import_module("...")`` with
a literal name) and checks them against a ``Contract`` (the table lives in the test). It works on
a source map (module name -> file text), so a test can inject an import into a copy of the real
tree in memory and see exactly what the checker reports.

Rules, each reported as a ``Violation`` naming the file, the line and the rule broken:

* ``layer``: a unit (a top-level module or subpackage of easykv) imports only the units its row
  allows. Imports under ``if TYPE_CHECKING:`` do not count here: they never run, and an
  annotation naming a type of another layer is not a dependency at run time.
* ``unplaced``: every unit of the tree has a row (a new package cannot slip past the table).
* ``shim``: nothing imports a deprecated alias (the top-level ``sharding``, ``easykv.distributed``)
  instead of its new home; an alias inside the root imports its new home only.
* ``circle``: no import circle between the modules of one package. Every import counts, lazy and
  TYPE_CHECKING ones too: a circle closed by a lazy import is still two modules that cannot be
  understood (or moved) apart, and one closed under TYPE_CHECKING breaks as soon as someone makes
  the import real.
* ``private``: a private module (a ``_name`` path component) is imported only from inside the
  package that holds it. Every import counts.
* ``docstring``: each package ``__init__.py`` docstring's import claims ("this package imports
  neither X nor Y", "imports X and Y only", "imports nothing else of easykv", "nothing in easykv
  imports this package", "nothing is imported here") agree with the table, and say what the table
  requires them to say. The code is checked against the table once (``layer``), so a docstring
  that agrees with the table is true of the code.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

MODULE_LEVEL, LAZY, TYPE_CHECKING_ONLY = "module level", "lazy, inside a function", "under TYPE_CHECKING"

ISOLATED = "imports nothing else of easykv"  # a docstring claim / requirement (see Row.must_say)
UNIMPORTED = "nothing in easykv imports it"


@dataclasses.dataclass(frozen=True)
class Row:
    """One unit of the table: what it may import and why, and what its docstring must claim."""

    may_import: frozenset[str]
    why: str
    # Claims the unit's __init__.py docstring must make: unit names it never imports, or
    # ISOLATED / UNIMPORTED. Only for packages (a plain module has no package docstring).
    must_say: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class Contract:
    root: str  # the package checked: "easykv"
    rows: Mapping[str, Row]  # unit -> row; the unit of the root's own __init__.py is the root's name
    deprecated: Mapping[str, str] = dataclasses.field(default_factory=dict)  # old top-level name -> new home
    # A unit of the root kept for one release as an alias of the unit it moved to (``distributed`` ->
    # ``multihost``): it may import its new home only, and nothing else may import it.
    moved: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str  # module name: easykv.storage.writes
    target: str  # the module it resolves to: easykv.manager.manager
    path: str  # easykv/storage/writes.py
    line: int
    kind: str  # MODULE_LEVEL, LAZY or TYPE_CHECKING_ONLY

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclasses.dataclass(frozen=True, order=True)
class Violation:
    rule: str
    where: str  # path:line
    message: str

    def __str__(self) -> str:
        return f"{self.where}: [{self.rule}] {self.message}"


# ---- reading the tree -----------------------------------------------------------------------------


def load_tree(repo: Path, package: str) -> dict[str, tuple[str, str]]:
    """module name -> (path relative to repo, source) for every .py file under repo/package."""
    tree = {}
    for file in sorted((repo / package).rglob("*.py")):
        if "__pycache__" in file.parts:
            continue
        relative = file.relative_to(repo)
        parts = list(relative.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        tree[".".join(parts)] = (relative.as_posix(), file.read_text(encoding="utf-8"))
    return tree


def is_package(tree: Mapping[str, tuple[str, str]], module: str) -> bool:
    return tree[module][0].endswith("/__init__.py")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Finder(ast.NodeVisitor):
    def __init__(self, module: str, package: str):
        self.module, self.package = module, package  # package: the module's own package, for relative imports
        self.depth_def = 0
        self.depth_tc = 0
        self.found: list[tuple[str, list[str], int, str]] = []  # (base, names, line, kind)

    def _kind(self) -> str:
        return TYPE_CHECKING_ONLY if self.depth_tc else LAZY if self.depth_def else MODULE_LEVEL

    def _function(self, node):
        for decorator in node.decorator_list:  # decorators and defaults run at definition time
            self.visit(decorator)
        self.visit(node.args)
        self.depth_def += 1
        for statement in node.body:
            self.visit(statement)
        self.depth_def -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Lambda(self, node):
        self.depth_def += 1
        self.generic_visit(node)
        self.depth_def -= 1

    def visit_If(self, node):
        if _is_type_checking(node.test):
            self.depth_tc += 1
            for statement in node.body:
                self.visit(statement)
            self.depth_tc -= 1
            for statement in node.orelse:
                self.visit(statement)
        else:
            self.generic_visit(node)

    def visit_Import(self, node):
        for alias in node.names:
            self.found.append((alias.name, [], node.lineno, self._kind()))

    def visit_ImportFrom(self, node):
        if node.level:
            anchor = self.package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        self.found.append((base, [alias.name for alias in node.names], node.lineno, self._kind()))

    def visit_Call(self, node):  # importlib.import_module("easykv.x") with a literal name
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            self.found.append((node.args[0].value, [], node.lineno, self._kind()))
        self.generic_visit(node)


@functools.lru_cache(maxsize=4096)
def _imports_in(source: str, path: str, module: str, package: bool):
    """The import statements of one module's source (cached: a test that injects into one module
    re-reads that module only)."""
    try:
        syntax = ast.parse(source, filename=path)
    except SyntaxError as err:
        return Violation("syntax", f"{path}:{err.lineno or 1}", f"{module} does not parse: {err.msg}")
    finder = _Finder(module, module if package else module.rpartition(".")[0])
    finder.visit(syntax)
    return tuple((base, tuple(names), line, kind) for base, names, line, kind in finder.found)


def _resolve(tree: Mapping[str, tuple[str, str]], name: str) -> str:
    """The module a dotted name loads: itself when it is a module of the tree, else its longest
    prefix that is (``from easykv.x.mod import Class`` -> easykv.x.mod)."""
    parts = name.split(".")
    for end in range(len(parts), min(2, len(parts)) - 1, -1):  # easykv.gone stays itself, not easykv
        if ".".join(parts[:end]) in tree:
            return ".".join(parts[:end])
    return name


def find_imports(tree: Mapping[str, tuple[str, str]], roots: Iterable[str]) -> tuple[list[Import], list[Violation]]:
    """Every import in the tree whose target's top-level name is in ``roots``; syntax errors as violations."""
    roots = set(roots)
    imports, broken = [], []
    for module, (path, source) in sorted(tree.items()):
        found = _imports_in(source, path, module, is_package(tree, module))
        if isinstance(found, Violation):
            broken.append(found)
            continue
        for base, names, line, kind in found:
            if base.split(".")[0] not in roots:
                continue
            # `from pkg import name`: the submodule pkg.name when there is one, else pkg itself.
            targets = [f"{base}.{n}" if f"{base}.{n}" in tree else base for n in names] or [base]
            for target in dict.fromkeys(_resolve(tree, t) for t in targets):
                imports.append(Import(module, target, path, line, kind))
    return imports, broken


# ---- the rules ------------------------------------------------------------------------------------


def unit_of(root: str, module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == root else parts[0]


def _describe(unit: str, root: str) -> str:
    return f"{root} (the package's own __init__.py)" if unit == root else unit


def check_layers(contract: Contract, tree, imports: list[Import]) -> list[Violation]:
    root, rows, out = contract.root, contract.rows, []
    seen_units: dict[str, str] = {}
    for module in sorted(tree):
        seen_units.setdefault(unit_of(root, module), module)
    for unit, module in seen_units.items():
        if unit not in rows and unit not in contract.moved:
            out.append(Violation("unplaced", f"{tree[module][0]}:1",
                                 f"{root}.{unit} is in no row of the layer table (tests/test_layering.py): "
                                 "move it into a package that has one, or add a row that says what it may import "
                                 "and why"))
    for imp in imports:
        top = imp.target.split(".")[0]
        if top in contract.deprecated:
            out.append(Violation("shim", imp.where, f"{imp.importer} imports {imp.target} ({imp.kind}), a deprecated "
                                 f"alias: import from {contract.deprecated[top]} instead"))
            continue
        if top != root or imp.kind == TYPE_CHECKING_ONLY:
            continue
        unit, target = unit_of(root, imp.importer), unit_of(root, imp.target)
        if unit == target:
            continue
        if target in contract.moved:
            out.append(Violation("shim", imp.where, f"{imp.importer} imports {imp.target} ({imp.kind}), a deprecated "
                                 f"alias: import from {root}.{contract.moved[target]} instead"))
            continue
        if unit in contract.moved:
            # Its new home, and the errors module: the exceptions the old module raised live there now.
            if target not in (contract.moved[unit], "errors"):
                out.append(Violation("shim", imp.where, f"{imp.importer} imports {imp.target} ({imp.kind}): the "
                                     f"deprecated alias {root}.{unit} re-exports {root}.{contract.moved[unit]} only "
                                     f"(and the exceptions of {root}.errors)"))
            continue
        if unit not in rows:
            continue
        if target not in rows and imp.target not in tree:
            out.append(Violation("layer", imp.where, f"{imp.importer} imports {imp.target} ({imp.kind}), "
                                 f"which is no module of {root}"))
            continue
        row = rows[unit]
        if target not in row.may_import:
            allowed = ", ".join(u for u in rows if u in row.may_import) or f"nothing of {root}"
            out.append(Violation("layer", imp.where,
                                 f"{imp.importer} imports {imp.target} ({imp.kind}): "
                                 f"{_describe(unit, root)} may not import {_describe(target, root)}. "
                                 f"Rule for {unit}: may import {allowed} -- {row.why}"))
    return out


def _strongly_connected(graph: Mapping[str, set[str]]) -> list[list[str]]:
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def check_circles(contract: Contract, tree, imports: list[Import]) -> list[Violation]:
    out: list[Violation] = []
    edges: dict[tuple[str, str], Import] = {}
    strength = {MODULE_LEVEL: 0, LAZY: 1, TYPE_CHECKING_ONLY: 2}
    for imp in imports:  # every kind counts; a pair is named by its module-level import if any, else lazy
        pair = (imp.importer, imp.target)
        if imp.importer != imp.target and imp.target in tree and (
                pair not in edges or strength[imp.kind] < strength[edges[pair].kind]):
            edges[pair] = imp
    short = lambda package, m: "__init__" if m == package else m.rsplit(".", 1)[-1]  # noqa: E731
    for package in sorted(m for m in tree if is_package(tree, m)):
        inside = {m for m in tree if m == package or m.rsplit(".", 1)[0] == package}
        graph: dict[str, set[str]] = {m: set() for m in inside}
        for (a, b) in edges:
            if a in inside and b in inside:
                graph[a].add(b)
        for component in _strongly_connected(graph):
            if len(component) < 2:
                continue
            members, start = set(component), component[0]
            # The shortest way round from the component's first module back to itself.
            parents, queue, last = {start: None}, [start], None
            while last is None:
                node = queue.pop(0)
                for nxt in sorted(graph[node] & members):
                    if nxt == start:
                        last = node
                        break
                    if nxt not in parents:
                        parents[nxt] = node
                        queue.append(nxt)
            path = [start]
            while last is not None:
                path.append(last)
                last = parents[last]
            path.reverse()  # start -> ... -> the module that imports start -> start
            hops = []
            for a, b in zip(path, path[1:]):
                imp = edges[(a, b)]
                hops.append(f"{short(package, b)} ({imp.where.rsplit('/', 1)[-1]}"
                            f"{'' if imp.kind == MODULE_LEVEL else ', ' + imp.kind})")
            first = edges[(path[0], path[1])]
            others = f"; all the modules in the circle: {', '.join(short(package, m) for m in component)}" \
                if len(component) > len(path) - 1 else ""
            out.append(Violation("circle", first.where,
                                 f"import circle in {package}: {short(package, start)} -> " + " -> ".join(hops)
                                 + others + ". Move what they share into a module that imports neither"))
    return out


def check_private(contract: Contract, tree, imports: list[Import]) -> list[Violation]:
    out = []
    for imp in imports:
        parts = imp.target.split(".")
        for i, part in enumerate(parts):
            if part.startswith("_") and not part.startswith("__"):
                owner = ".".join(parts[:i])
                if imp.importer != owner and not imp.importer.startswith(owner + "."):
                    out.append(Violation("private", imp.where,
                                         f"{imp.importer} imports {imp.target} ({imp.kind}), a private module of "
                                         f"{owner}: import what it needs from {owner}'s public modules"))
                break
    return out


# ---- docstring claims -----------------------------------------------------------------------------

_SCOPE = re.compile(r"\b(this package|this file|here)\b", re.I)
_NO_INIT_IMPORTS = re.compile(r"\bnothing is imported (here|by this file)\b", re.I)
_IMPORTS_NOTHING = re.compile(r"\bimports nothing (else )?(of|from|in) easykv\b", re.I)
_UNIMPORTED = re.compile(r"\b(nothing|no module|no other package)( else)?( (in|of) easykv)?( else)? imports "
                         r"(it|this package|this one)\b|\bis (never )?imported by nothing\b", re.I)
_NEGATION = re.compile(r"\b(never|neither|nor|not|no)\b", re.I)


@dataclasses.dataclass
class Claims:
    never: set[str] = dataclasses.field(default_factory=set)
    only: set[str] | None = None
    isolated: bool = False
    unimported: bool = False
    no_init_imports: bool = False
    unclear: list[str] = dataclasses.field(default_factory=list)


def parse_claims(docstring: str, units: Iterable[str], own: str, root: str = "easykv") -> Claims:
    """The import claims of a package docstring. A claim is a clause (between '.' or ';') that says
    "import" and speaks of this package / this file / here; its parts (split at ':') name units
    with "only" (imports those only) or with a negation (never imports those)."""
    names = sorted(set(units) - {own, root}, key=len, reverse=True)
    unit_word = re.compile(r"``?(\w+)``?|\b(" + "|".join(map(re.escape, names)) + r")\b") if names else None
    claims = Claims()
    text = " ".join(docstring.split())
    for clause in re.split(r"(?<=[.;])\s+", text):
        clause = clause.rstrip(".;")
        if _UNIMPORTED.search(clause):
            claims.unimported = True
            clause = _UNIMPORTED.sub("", clause)
        if "import" not in clause.lower() or not _SCOPE.search(clause):
            continue
        for part in clause.split(":"):
            if _NO_INIT_IMPORTS.search(part):
                claims.no_init_imports = True
                continue
            if _IMPORTS_NOTHING.search(part):
                claims.isolated = True
                continue
            named = set()
            for match in unit_word.finditer(part) if unit_word else ():
                word = match.group(1) or match.group(2)
                if word in names:
                    named.add(word)
            if not named:
                continue
            if re.search(r"\bonly\b", part, re.I):
                claims.only = (claims.only or set()) | named
            elif _NEGATION.search(part):
                claims.never |= named
            else:
                claims.unclear.append(part.strip())
    return claims


def check_docstrings(contract: Contract, tree, imports: list[Import]) -> list[Violation]:
    root, rows, out = contract.root, contract.rows, []
    for unit, row in rows.items():
        module = f"{root}.{unit}"
        if module not in tree or not is_package(tree, module):
            continue
        path, source = tree[module]
        try:
            syntax = ast.parse(source)
        except SyntaxError:
            continue  # reported by find_imports
        docstring = ast.get_docstring(syntax) or ""
        line = syntax.body[0].lineno if docstring else 1
        where = f"{path}:{line}"
        claims = parse_claims(docstring, rows, unit, root)
        about = f"{module}'s docstring"
        # B023: say() is called in this iteration only.
        say = lambda message: out.append(Violation("docstring", where, f"{about} {message}"))  # noqa: E731, B023
        for part in claims.unclear:
            say(f"makes an import claim the checker cannot read: {part!r}; say 'this package never imports X' "
                f"or 'this package imports X and Y only'")
        for never in sorted(claims.never & row.may_import):
            say(f"says it never imports {never}, but the table lets {unit} import it: fix the one that is wrong")
        if claims.only is not None and not row.may_import <= claims.only:
            say(f"says it imports {', '.join(sorted(claims.only))} only, but the table lets {unit} import "
                f"{', '.join(sorted(row.may_import - claims.only))} too: fix the one that is wrong")
        if claims.isolated and row.may_import:
            say(f"says it imports nothing else of {root}, but the table lets it import "
                f"{', '.join(sorted(row.may_import))}")
        if claims.unimported:
            users = sorted(u for u, r in rows.items() if unit in r.may_import)
            if users:
                say(f"says nothing in {root} imports it, but the table lets {', '.join(users)} import it")
        if claims.no_init_imports:
            stray = [n for n in ast.walk(syntax) if isinstance(n, (ast.Import, ast.ImportFrom))
                     and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
            if stray:
                say(f"says nothing is imported there, but line {stray[0].lineno} imports")
        for need in sorted(row.must_say):
            if need == ISOLATED:
                ok = claims.isolated
                what = f"that it imports nothing else of {root} (e.g. 'this package imports nothing else of easykv')"
            elif need == UNIMPORTED:
                ok = claims.unimported
                what = f"that nothing in {root} imports it (e.g. 'nothing in easykv imports this package')"
            else:
                ok = need in claims.never
                what = f"that it never imports {need} (e.g. 'this package never imports ``{need}``')"
            if not ok:
                say(f"does not say {what}, a rule of the layer table")
    return out


def check(contract: Contract, tree: Mapping[str, tuple[str, str]]) -> list[Violation]:
    """Every violation of the contract in the tree, sorted by file and line."""
    imports, broken = find_imports(tree, {contract.root, *contract.deprecated})
    found = broken + check_layers(contract, tree, imports) + check_circles(contract, tree, imports) \
        + check_private(contract, tree, imports) + check_docstrings(contract, tree, imports)
    return sorted(set(found), key=lambda v: (v.where.split(":")[0], int(v.where.split(":")[1]), v.rule, v.message))
