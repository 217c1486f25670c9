"""The top-level ``easykv`` namespace: ``__all__`` sorted and every name in it importable, the
lazily loaded names listed by ``dir(easykv)`` without being loaded by it, and an unknown name an
AttributeError that names it."""

import importlib
import re
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


# ---- every name a deprecated path offered before it moved ----------------------------------------
# easykv's top-level __all__ at 44ece89^ (44ece89 moved 39 of them into their packages, easykv._MOVED).
TOP_LEVEL_0_1 = (
    "ATTENTION_KINDS", "AttentionKind", "CacheCheckpointer", "CacheFullError", "CheckpointError",
    "CheckpointIntegrityError", "CheckpointLockedError", "CheckpointMismatchError", "CheckpointWriteError",
    "ExportedGroup", "GroupPoolMetrics", "GroupedSequenceExport", "HostTier", "HostTierMetrics", "InvariantError",
    "LayerGroup", "LockstepError", "ManagerStateError", "MemoryBudget", "MemoryUnavailableError", "ModelPreset",
    "MultiProcessError", "NotACheckpointError", "PAD_PAGE", "PAD_SLOT", "PRESETS", "PageLayout", "PageManager",
    "PageManagerMetrics", "PagedAttentionCache", "PagedAttentionCacheMetaData", "PagedAttentionCacheView",
    "PagedAttentionMetadata", "QuantizedPages", "Quantizer", "RestoredCache", "SUPPORTED_DTYPES", "SequenceExport",
    "SerializationError", "SleepingCache", "StepNotFoundError", "UnknownSequenceError", "VersionMetrics",
    "available_quantizers", "device_bytes", "device_memory_budget", "export_sequence", "gather_kv", "get_quantizer",
    "group_pattern", "import_sequence", "increment_cache_lengths", "inspect_checkpoint", "list_steps",
    "paged_attention", "paged_attention_implementation", "paged_attention_reference", "register_quantizer",
    "restore_cache", "save_cache", "single_group", "sleep", "storage_dtype", "tokens_per_gib", "view_attention",
    "wake",
)  # fmt: skip

# The public names each deprecated module had, read off its source at the commit before the move:
# what it defined, and what it kept importable after moving it out (distributed.py's exceptions,
# moved to easykv.errors in 58475fe and bb71a1c). Its imports of other modules' helpers (jax, numpy,
# typing, easykv.validation) were never its API. Each name maps to its home now.
OLD_MODULES = {
    # easykv/distributed.py at 9af7079^ (9af7079 moved it to easykv.multihost).
    "easykv.distributed": {
        **dict.fromkeys(("assert_lockstep", "fingerprint", "initialize", "initialize_from_env", "launch_local"),
                        "easykv.multihost"),
        **dict.fromkeys(("LockstepError", "MultiProcessError"), "easykv.errors"),
    },
    # easykv/runtime.py at ed247fe^ (ed247fe moved it to easykv.step.metadata).
    "easykv.runtime": dict.fromkeys((
        "FORM_FIELDS", "INVALID_SLOT", "MixedStep", "PAD_PAGE", "PAD_POSITION", "PAD_SLOT", "PagedAttentionMetadata",
        "array_module", "as_mixed", "build_mixed", "group_runtime", "increment_cache_lengths", "slots_from_table",
        "stack_metadata", "step_form"), "easykv.step.metadata"),
    # sharding/__init__.py, axes.py, manager.py and mesh.py at ed247fe^ (ed247fe moved them to easykv.sharding).
    "sharding": dict.fromkeys((
        "BATCH", "HEAD", "HEAD_DIM", "HIDDEN", "KV_HEAD", "PAGE", "PAGE_SIZE", "SEQUENCE", "PartitionAxis",
        "PartitionManager", "ShardingAdjustedWarning", "create_mesh", "mesh_axis_size", "shard_count"),
        "easykv.sharding"),
    "sharding.axes": dict.fromkeys((
        "BATCH", "HEAD", "HEAD_DIM", "HIDDEN", "KV_HEAD", "LOGICAL_AXES", "MeshAxes", "PAGE", "PAGE_SIZE",
        "PartitionAxis", "SEQUENCE"), "easykv.sharding.axes"),
    "sharding.manager": dict.fromkeys(("PartitionManager", "ShardingAdjustedWarning", "shard_count"),
                                      "easykv.sharding.manager"),
    "sharding.mesh": dict.fromkeys(("AxisDims", "create_mesh", "mesh_axis_size"), "easykv.sharding.mesh"),
}  # fmt: skip
# What each deprecated package says on its first import (the submodules of `sharding` import it first).
MOVED_TO = {"easykv.distributed": "easykv.distributed moved to easykv.multihost",
            "easykv.runtime": "easykv.runtime moved to easykv.step.metadata",
            "sharding": "the top-level package 'sharding' moved to 'easykv.sharding'"}  # fmt: skip
OLD_NAMES = [pytest.param(module, name, home, id=f"{module}.{name}")
             for module, names in OLD_MODULES.items() for name, home in names.items()]  # fmt: skip


def test_every_top_level_name_of_0_1_is_still_offered():
    assert len(TOP_LEVEL_0_1) == 66
    gone = sorted(set(TOP_LEVEL_0_1) - set(easykv.__all__) - set(easykv._MOVED))
    assert not gone, f"top-level names of easykv 0.1 no longer importable from easykv: {gone}"


@pytest.mark.parametrize("module, name, home", OLD_NAMES)
def test_a_deprecated_module_offers_every_name_it_had_warning_once_imported(module, name, home, monkeypatch):
    package = module.split(".")[0] if module.startswith("sharding") else module
    for loaded in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
        monkeypatch.delitem(sys.modules, loaded)  # so the import runs (and warns) again; restored after
    namespace: dict = {}
    with pytest.warns(DeprecationWarning, match=f"^{re.escape(MOVED_TO[package])} and will be removed in easykv 0.3"):
        exec(f"from {module} import {name}", namespace)
    assert namespace[name] is getattr(importlib.import_module(home), name)
    star = getattr(sys.modules[module], "__all__", None)
    assert star is None or name in star, f"from {module} import * no longer gives {name}"
