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
    assert [type(gt) for gt in m._groups] == [FullAttentionTable, SlidingWindowTable, ChunkedTable]
    assert [gt.windowed for gt in m._groups] == [False, True, True]


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


@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_and_functions_stay_readable(name):
    tree = MODULES[name]
    assert ast.get_docstring(tree), f"{name} says what it holds"
    assert (PACKAGE / f"{name}.py").read_text().count("\n") <= 620, name
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno - node.lineno < 80, (name, node.name)
