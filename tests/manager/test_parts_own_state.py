"""Parts own their state: no module of ``easykv/manager`` writes into another object's fields.

The sequence table, the page pools, the per-kind tables, the prefix index (`SequenceHashes`), the
version log, the host-tier policy and the copy counter each change only through their own methods
(as vLLM's ``BlockPool`` does through ``get_new_blocks``, ``touch``, ``free_blocks``). The checker
below walks the AST of every module of the package and reports every write whose target is a field
of an object other than ``self`` (or ``cls``):

- an assignment, augmented assignment, annotated assignment or ``del`` whose target is ``x.f``,
  ``x.f[...]``, ``x.f.g[...]``, ``x[i].f``, ``self.part.f[...]``: any attribute chain whose field's
  owner is not the bare name ``self`` / ``cls`` (tuple targets are split);
- a call of a mutating container or array method on such a field (``x.f.clear()``, ``x.f.append``,
  ``x.f.fill``, ``x.f.setflags``, ... `MUTATING_METHODS`), or of a mutating function on it
  (``np.copyto(x.f, ...)``, ``heapq.heappush(x.f, ...)``, ``np.add.at(x.f, ...)``, ``setattr(x, ...)``,
  ``object.__setattr__(x, ...)``, ... `MUTATING_FUNCTIONS`), or any call with ``out=x.f``;
- the same through a local alias: a name bound in the same function (by ``=``, a tuple
  assignment, ``:=`` or a ``for`` loop over it) to another object's field or a subscript of one,
  then subscript-assigned, attribute-assigned, deleted into or mutated through a method above
  (``lens = seqs.lens; lens[i] = 0``). ``starts = self.start; starts[i] = 0`` is the owner's own.

Limits (what it cannot see, kept out of the code by review): a foreign field passed as an argument
to a function that writes its parameter in place (``fill(seqs.lens)``); aliases made through a call
or a container (``a = np.asarray(seqs.lens)``, ``xs = [seqs.lens]``, ``for a, b in zip(x.f, y.g)``)
or across functions (a field returned, stored, or captured by a closure); mutating methods outside
the list (a part's own method names are not container mutators: `SequenceHashes.extend` is named
``record_tokens`` so that it is not read as ``list.extend``); ``getattr``/``vars`` tricks. A local
bound to a *copy* made by fancy indexing (``lens = seqs.lens[rows]``) is flagged if written: write
``seqs.lens[rows].copy()`` to say it is a copy.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "easykv" / "manager"
OWNERS = frozenset({"self", "cls"})
MUTATING_METHODS = frozenset({
    # list / dict / set / deque / OrderedDict
    "append", "appendleft", "clear", "difference_update", "discard", "extend", "extendleft", "insert",
    "intersection_update", "move_to_end", "pop", "popitem", "popleft", "remove", "reverse", "rotate", "setdefault",
    "sort", "symmetric_difference_update", "update", "add",
    # numpy arrays
    "fill", "itemset", "partition", "put", "resize", "setfield", "setflags", "byteswap",
})
# Functions that write into an argument: the dotted name -> the position of the argument written.
MUTATING_FUNCTIONS = {
    "np.copyto": 0, "numpy.copyto": 0, "np.put": 0, "np.place": 0, "np.putmask": 0, "np.put_along_axis": 0,
    "np.fill_diagonal": 0, "heapq.heappush": 0, "heapq.heappop": 0, "heapq.heapify": 0, "heapq.heapreplace": 0,
    "heapq.heappushpop": 0, "setattr": 0, "delattr": 0, "object.__setattr__": 0, "object.__delattr__": 0,
    "random.shuffle": 0, "bisect.insort": 0,
}


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of names, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _strip_subscripts(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Subscript, ast.Starred)):
        node = node.value
    return node


def _foreign_field(node: ast.expr) -> bool:
    """Whether ``node`` (subscripts stripped) is a field of an object other than ``self``/``cls``:
    an attribute whose owner expression is anything but the bare name ``self`` or ``cls``."""
    node = _strip_subscripts(node)
    if not isinstance(node, ast.Attribute):
        return False
    owner = node.value
    return not (isinstance(owner, ast.Name) and owner.id in OWNERS)


def _targets(node: ast.expr) -> list[ast.expr]:
    """The single targets of an assignment target (tuples and lists split, starred unwrapped)."""
    if isinstance(node, (ast.Tuple, ast.List)):
        return [t for elt in node.elts for t in _targets(elt)]
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    return [node]


class _Scope(ast.NodeVisitor):
    """The writes of one function (or module) body; nested functions get their own scope."""

    def __init__(self, report: list[tuple[int, str]]):
        self.report = report
        self.aliases: dict[str, int] = {}  # local name -> line where it was bound to a foreign field

    # ---- scopes -----------------------------------------------------------------------------------
    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(default)
        for decorator in node.decorator_list:
            self.visit(decorator)
        inner = _Scope(self.report)
        for stmt in node.body:
            inner.visit(stmt)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        _Scope(self.report).visit(node.body)

    # ---- bindings -----------------------------------------------------------------------------------
    def _bind(self, target: ast.expr, value: ast.expr | None) -> None:
        """Track ``target = value``: a name bound to a foreign field becomes an alias, any other
        binding of it ends one."""
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self._bind(t, v)
            return
        for t in _targets(target):
            if isinstance(t, ast.Name):
                if value is not None and self._is_foreign_or_alias(value):
                    self.aliases[t.id] = value.lineno
                else:
                    self.aliases.pop(t.id, None)

    def _is_foreign_or_alias(self, node: ast.expr) -> bool:
        if _foreign_field(node):
            return True
        base = _strip_subscripts(node)
        return isinstance(base, ast.Name) and base.id in self.aliases

    def _written(self, target: ast.expr, what: str) -> None:
        """Report a write into ``target`` when it is another object's field, or a local alias of one."""
        for t in _targets(target):
            if isinstance(t, ast.Name):
                continue  # a local rebound
            if _foreign_field(t):
                self.report.append((t.lineno, what))
                continue
            base = _strip_subscripts(t)
            if base is not t and isinstance(base, ast.Name) and base.id in self.aliases:
                self.report.append((t.lineno, f"{what} through {base.id!r}, an alias of another object's field "
                                              f"(bound on line {self.aliases[base.id]})"))
            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in self.aliases:
                self.report.append((t.lineno, f"{what} through {t.value.id!r}, an alias of another object's field"))

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self._written(target, "assignment")
            self.visit(target)
        for target in node.targets:
            self._bind(target, node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        self._written(node.target, "assignment")
        self._bind(node.target, node.value)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        self._written(node.target, "augmented assignment")

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._written(target, "del")

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self._bind(node.target, node.value)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self.visit(node.iter)
        if isinstance(node.target, ast.Name) and self._is_foreign_or_alias(node.iter):
            self.aliases[node.target.id] = node.lineno  # each item of another object's container
        else:
            self._bind(node.target, None)
        for stmt in node.body + node.orelse:
            self.visit(stmt)

    visit_AsyncFor = visit_For

    # ---- calls --------------------------------------------------------------------------------------
    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in MUTATING_METHODS:
            receiver = func.value
            if _foreign_field(receiver):
                self.report.append((node.lineno, f".{func.attr}() on another object's field"))
            elif self._is_foreign_or_alias(receiver):
                self.report.append((node.lineno, f".{func.attr}() through an alias of another object's field"))
        name = _dotted(func)
        position = MUTATING_FUNCTIONS.get(name) if name is not None else None
        if position is None and isinstance(func, ast.Attribute) and func.attr == "at" \
                and (_dotted(func.value) or "").startswith(("np.", "numpy.")):
            position = 0  # a ufunc's unbuffered in-place ``at``
        if position is not None and len(node.args) > position:
            arg = node.args[position]
            first_is_owner = isinstance(arg, ast.Name) and arg.id in OWNERS
            if name in ("setattr", "delattr", "object.__setattr__", "object.__delattr__"):
                if not first_is_owner:
                    self.report.append((node.lineno, f"{name}() on an object other than self"))
            elif self._is_foreign_or_alias(arg):
                self.report.append((node.lineno, f"{name or 'ufunc.at'}() writes into another object's field"))
        for keyword in node.keywords:
            if keyword.arg == "out" and self._is_foreign_or_alias(keyword.value):
                self.report.append((node.lineno, "out= another object's field"))
        self.generic_visit(node)


def violations_in(source: str) -> list[tuple[int, str]]:
    """(line, what) of every write into another object's fields in ``source``."""
    report: list[tuple[int, str]] = []
    scope = _Scope(report)
    for stmt in ast.parse(source).body:
        scope.visit(stmt)
    return sorted(set(report))


def package_violations() -> list[str]:
    """``path:line: code  (what)`` of every write into another object's fields in the package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for line, what in violations_in(text):
            out.append(f"{path.relative_to(PACKAGE.parents[1])}:{line}: {lines[line - 1].strip()}  ({what})")
    return out


def test_no_module_writes_into_another_parts_fields():
    found = package_violations()
    assert not found, ("writes into another object's fields (make each a method of the owning part):\n"
                       + "\n".join(found))


def test_the_package_has_modules_to_check():
    # A moved package would make the test above pass vacuously.
    assert len(list(PACKAGE.glob("*.py"))) > 10


VIOLATIONS = {
    "field": "def f(table):\n    table.offloads = {}",
    "subscript": "def f(seqs, rows):\n    seqs.lens[rows] = 0",
    "nested subscript": "def f(seqs, rows, passed):\n    seqs.floor[rows[passed]] = 0",
    "2-d slice": "def f(table, row, a, b):\n    table.table[row, a:b] = -1",
    "deep chain": "def f(seqs, row):\n    seqs.hashes.hashable[row] = False",
    "a part of self": "class C:\n    def m(self):\n        self.pool.refcount[0] = 1",
    "an item's field": "def f(groups):\n    groups[0].start[1] = 0",
    "augmented": "def f(seqs, rows):\n    seqs.edits[rows] += 1",
    "annotated": "def f(x):\n    x.n: int = 1",
    "tuple target": "def f(seqs, r):\n    seqs.lens[r], seqs.npages[r] = 0, 0",
    "starred target": "def f(x):\n    a, *x.rest = [1, 2]",
    "del item": "def f(x, k):\n    del x.swapped[k]",
    "del field": "def f(x):\n    del x.swapped",
    "clear": "def f(gt):\n    gt.copies.clear()",
    "append": "def f(x):\n    x.items.append(1)",
    "setflags": "def f(plan):\n    plan.limits.setflags(write=True)",
    "method on an item": "def f(x, r):\n    x.lru[r].move_to_end(3)",
    "alias": "def f(seqs):\n    lens = seqs.lens\n    lens[0] = 0",
    "alias of an item": "def f(pool, r):\n    free = pool.free[r]\n    free[0] = 1",
    "alias by tuple": "def f(seqs):\n    a, lens = 1, seqs.lens\n    lens[0] += 1",
    "alias method": "def f(x):\n    copies = x.copies\n    copies.clear()",
    "alias attribute": "def f(x):\n    part = x.part\n    part.n = 1",
    "alias by walrus": "def f(x):\n    if (lens := x.lens) is not None:\n        lens[0] = 1",
    "alias by loop": "def f(x):\n    for q in x.queues:\n        q.clear()",
    "alias of an alias": "def f(x):\n    a = x.lens\n    b = a\n    b[1] = 2",
    "copyto": "import numpy as np\ndef f(x, y):\n    np.copyto(x.field, y)",
    "heappush": "import heapq\ndef f(x):\n    heapq.heappush(x.free, 3)",
    "ufunc at": "import numpy as np\ndef f(x, i):\n    np.add.at(x.counts, i, 1)",
    "out=": "import numpy as np\ndef f(x, a, b):\n    np.minimum(a, b, out=x.field)",
    "setattr": "def f(x):\n    setattr(x, 'field', 1)",
    "object.__setattr__": "def f(plan):\n    object.__setattr__(plan, '_ended', 'x')",
    "in a nested function": "def f(seqs):\n    def g():\n        seqs.lens[0] = 1",
    "another instance of the class": "class C:\n    def m(self, other):\n        other.x = 1",
    "a call's result": "def f(m):\n    m.parts().seqs.lens[0] = 1",
}


@pytest.mark.parametrize("source", VIOLATIONS.values(), ids=VIOLATIONS.keys())
def test_the_checker_finds_each_form_of_write(source):
    found = violations_in(textwrap.dedent(source))
    assert len(found) == 1, found
    assert found[0][0] == len(source.splitlines())  # the write's own line


FINE = {
    "own fields": ("class C:\n    def m(self, r):\n        self.lens[r] = 1\n        self.n += 1\n"
                   "        self.copies.clear()\n        del self.swapped[r]\n"
                   "        object.__setattr__(self, 'a', 1)"),
    "own alias": "class C:\n    def m(self):\n        starts = self.start\n        starts[0] = 1",
    "cls": "class C:\n    @classmethod\n    def m(cls):\n        cls.count = 1",
    "a part's method": "def f(table):\n    table.pool.release([1])\n    table.reset_row(0)",
    "locals": "def f(seqs):\n    out = []\n    out.append(seqs.lens[0])\n    d = {}\n    d['a'] = 1",
    "a copy": "def f(seqs):\n    lens = seqs.lens.copy()\n    lens[0] = 0",
    "read-only alias": "def f(x):\n    lens = x.lens\n    return lens[0] + 1",
    "rebound alias": "def f(x):\n    lens = x.lens\n    lens = [0]\n    lens[0] = 1",
    "a new array": "import numpy as np\ndef f(x, a):\n    np.minimum(a, x.b, out=a)\n    np.copyto(a, x.b)",
    "reads into a local": "def f(x):\n    for q in x.queues:\n        print(q)\n    total = x.n\n    total += 1",
}


@pytest.mark.parametrize("source", FINE.values(), ids=FINE.keys())
def test_the_checker_lets_a_part_write_its_own_fields(source):
    assert violations_in(textwrap.dedent(source)) == []


def test_no_part_names_a_method_like_a_container_mutator():
    # A part's method named ``extend`` or ``clear`` would read as a write into a container here.
    names = {node.name for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert not names & MUTATING_METHODS
