"""The manager's layout holds: one allocator class per attention kind chosen by a map, imports
pointing one way (only manager.py imports state and consistency; nothing imports manager.py;
nothing imports storage, attention, checkpoint or tiers), no attention kind spelled as a string,
and files and functions of a readable size."""

import ast
import pathlib

import pytest

import easykv.manager
from easykv import LayerGroup, PagedAttentionCacheMetaData, PageManager
from easykv.manager.allocators import ALLOCATORS, ChunkedTable, FullAttentionTable, SlidingWindowTable
from easykv.spec.groups import AttentionKind

PACKAGE = pathlib.Path(easykv.manager.__file__).parent
MODULES = {p.stem: ast.parse(p.read_text()) for p in sorted(PACKAGE.glob("*.py"))}


def imported(tree):
    """Every module a tree imports, lazily or not (``from x import y`` also as ``x.y``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_each_attention_kind_has_its_allocator_class():
    assert ALLOCATORS == {AttentionKind.FULL: FullAttentionTable, AttentionKind.SLIDING: SlidingWindowTable,
                          AttentionKind.CHUNKED: ChunkedTable}
    groups = (LayerGroup((0,), "full", num_pages=8), LayerGroup((1,), "sliding", 8, num_pages=8),
              LayerGroup((2,), "chunked", 8, num_pages=8))
    meta = PagedAttentionCacheMetaData(
        batch_size=2, num_hidden_layers=3, num_pages_per_layer=8, num_pages_per_sequence=4, max_sequences=16,
        page_size=4, num_kv_heads=2, kv_head_dim_size=8, hbm_utilization=0.9, layer_groups=groups)
    m = PageManager(meta)
    # The manager's own tables, reached on purpose: which class keeps each group is internal by design.
    assert [type(table) for table in m._groups] == [FullAttentionTable, SlidingWindowTable, ChunkedTable]
    assert [table.windowed for table in m._groups] == [False, True, True]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_one_way(name):
    mods = imported(MODULES[name])
    for never in ("easykv.storage", "easykv.attention", "easykv.checkpoint", "easykv.tiers"):
        assert not any(m == never or m.startswith(never + ".") for m in mods), (name, never)
    if name != "manager":
        assert "easykv.manager.manager" not in mods, name
    if name not in ("manager", "__init__"):
        assert not {"easykv.manager.state", "easykv.manager.consistency"} & mods, name


def test_no_attention_kind_is_compared_as_a_string():
    for name, tree in MODULES.items():
        words = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not words & {"full", "sliding", "chunked"}, name


def _docstring_lines(node) -> int:
    """Lines of the docstring that opens a module, class or function body (0 if none)."""
    body = getattr(node, "body", None)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0].end_lineno - body[0].lineno + 1
    return 0


@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_and_functions_stay_readable(name):
    """Code stays short; docstrings are not counted, since they are the API reference (the
    facade's Args: sections with every parameter)."""
    tree = MODULES[name]
    assert ast.get_docstring(tree), f"{name} says what it holds"
    docs = sum(_docstring_lines(n) for n in ast.walk(tree)
               if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
    assert (PACKAGE / f"{name}.py").read_text().count("\n") - docs <= 620, name
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno - node.lineno - _docstring_lines(node) < 80, (name, node.name)
