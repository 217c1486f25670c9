"""easykv: a distributed, sharded, paged key/value cache for LLM inference and RL rollouts in JAX.

The top level holds what an engine touches on every path: the metadata, the cache and its
views, the page manager and its step plans, the runner that applies them, the step metadata,
attention, quantizers, checkpoints and sequence transfer, sleep / wake and the host tier, and the
two errors a serving loop handles (`CacheFullError`, `CheckpointIntegrityError`; every other one
is in `easykv.errors`).
Everything else lives in its package (`easykv.spec`, `easykv.manager`, `easykv.storage`, ...);
the names that used to be here too still import for one release, with a DeprecationWarning
that names their home.
"""

from typing import TYPE_CHECKING, Any

from easykv import errors
from easykv.attention.api import paged_attention, paged_attention_reference, view_attention
from easykv.errors import CacheFullError, CheckpointIntegrityError
from easykv.manager.manager import PageManager
from easykv.quantization import Quantizer, available_quantizers, get_quantizer, register_quantizer
from easykv.spec.groups import LayerGroup, group_pattern
from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.step.metadata import PAD_SLOT, PagedAttentionMetadata
from easykv.storage.cache import PagedAttentionCache, PagedAttentionCacheView, gather_kv

__version__ = "0.1.0"

# Checkpointing brings orbax (about 0.35 s to import): load it on first use only.
_LAZY = {
    **dict.fromkeys(("save_cache", "restore_cache", "CacheCheckpointer"), "easykv.checkpoint.checkpointer"),
    **dict.fromkeys(("export_sequence", "import_sequence"), "easykv.checkpoint.transfer"),
    "inspect_checkpoint": "easykv.checkpoint.inspect",
    **dict.fromkeys(("sleep", "wake"), "easykv.tiers.sleep"),
    "HostTier": "easykv.tiers.host",
    **dict.fromkeys(("Runner", "apply_pending"), "easykv.runner"),
}

# Names that were top-level in 0.1 and now live only in their package: still importable from
# here, with a DeprecationWarning naming the new import, until 0.2.
_MOVED = {
    **dict.fromkeys(("ATTENTION_KINDS", "AttentionKind"), "easykv.spec.groups"),
    **dict.fromkeys(("CheckpointError", "CheckpointLockedError", "CheckpointMismatchError", "CheckpointWriteError",
                     "InvariantError", "LockstepError", "ManagerStateError", "MemoryUnavailableError",
                     "MultiProcessError", "NotACheckpointError", "SerializationError", "StepNotFoundError",
                     "UnknownSequenceError"), "easykv.errors"),
    **dict.fromkeys(("ExportedGroup", "GroupedSequenceExport"), "easykv.checkpoint.grouped_export"),
    **dict.fromkeys(("GroupPoolMetrics", "PageManagerMetrics", "VersionMetrics", "single_group"),
                    "easykv.manager.manager"),
    "HostTierMetrics": "easykv.manager.host_tier",
    **dict.fromkeys(("MemoryBudget", "device_memory_budget"), "easykv.spec.memory"),
    **dict.fromkeys(("ModelPreset", "PRESETS"), "easykv.spec.presets"),
    **dict.fromkeys(("PAD_PAGE", "increment_cache_lengths"), "easykv.step.metadata"),
    **dict.fromkeys(("PageLayout", "storage_dtype"), "easykv.storage.pages"),
    "QuantizedPages": "easykv.quantization",
    **dict.fromkeys(("RestoredCache", "list_steps"), "easykv.checkpoint.checkpointer"),
    "SUPPORTED_DTYPES": "easykv.spec.metadata",
    "SequenceExport": "easykv.checkpoint.transfer",
    **dict.fromkeys(("SleepingCache", "device_bytes"), "easykv.tiers.sleep"),
    "paged_attention_implementation": "easykv.attention.api",
    "tokens_per_gib": "easykv.spec.sizing",
}

if TYPE_CHECKING:  # the lazy names' types, for type checkers only (never imported here at run time)
    from easykv.checkpoint.checkpointer import CacheCheckpointer, restore_cache, save_cache
    from easykv.checkpoint.inspect import inspect_checkpoint
    from easykv.checkpoint.transfer import export_sequence, import_sequence
    from easykv.runner import Runner, apply_pending
    from easykv.tiers.host import HostTier
    from easykv.tiers.sleep import sleep, wake


def __dir__() -> list[str]:
    """The public names, the lazily loaded ones among them (``dir(easykv)`` and completion see
    them all without loading them), and ``__version__``; the deprecated names are left out, so
    nothing new is written against them."""
    return sorted({*__all__, "__version__"})


def __getattr__(name: str) -> Any:
    import importlib
    import warnings

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _MOVED:
        home = _MOVED[name]
        warnings.warn(f"easykv.{name} is deprecated: import it from its package instead "
                      f"(from {home} import {name}); the top-level name goes away in easykv 0.2",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module 'easykv' has no attribute {name!r}")


__all__ = [
    "CacheCheckpointer",
    "CacheFullError",
    "CheckpointIntegrityError",
    "HostTier",
    "LayerGroup",
    "PAD_SLOT",
    "PageManager",
    "PagedAttentionCache",
    "PagedAttentionCacheMetaData",
    "PagedAttentionCacheView",
    "PagedAttentionMetadata",
    "Quantizer",
    "Runner",
    "apply_pending",
    "available_quantizers",
    "errors",
    "export_sequence",
    "gather_kv",
    "get_quantizer",
    "group_pattern",
    "import_sequence",
    "inspect_checkpoint",
    "paged_attention",
    "paged_attention_reference",
    "register_quantizer",
    "restore_cache",
    "save_cache",
    "sleep",
    "view_attention",
    "wake",
]
