"""easykv: a distributed, sharded, paged key/value cache for LLM inference in JAX."""

from typing import TYPE_CHECKING, Any

from easykv.attention.api import (
    paged_attention,
    paged_attention_implementation,
    paged_attention_reference,
    view_attention,
)
from easykv.errors import (
    CacheFullError,
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointLockedError,
    CheckpointMismatchError,
    CheckpointWriteError,
    InvariantError,
    LockstepError,
    ManagerStateError,
    MemoryUnavailableError,
    MultiProcessError,
    NotACheckpointError,
    SerializationError,
    StepNotFoundError,
    UnknownSequenceError,
)
from easykv.manager.host_tier import HostTierMetrics
from easykv.manager.manager import GroupPoolMetrics, PageManager, PageManagerMetrics, VersionMetrics, single_group
from easykv.quantization import (
    QuantizedPages,
    Quantizer,
    available_quantizers,
    get_quantizer,
    register_quantizer,
)
from easykv.spec.groups import ATTENTION_KINDS, AttentionKind, LayerGroup, group_pattern
from easykv.spec.memory import MemoryBudget, device_memory_budget
from easykv.spec.metadata import SUPPORTED_DTYPES, PagedAttentionCacheMetaData
from easykv.spec.presets import PRESETS, ModelPreset
from easykv.spec.sizing import tokens_per_gib
from easykv.step.metadata import PAD_PAGE, PAD_SLOT, PagedAttentionMetadata, increment_cache_lengths
from easykv.storage.cache import PagedAttentionCache, PagedAttentionCacheView, gather_kv
from easykv.storage.pages import PageLayout, storage_dtype

__version__ = "0.1.0"

# Checkpointing brings orbax (about 0.35 s to import): load it on first use only.
_LAZY = {
    **dict.fromkeys(("save_cache", "restore_cache", "CacheCheckpointer", "RestoredCache", "list_steps"),
                    "easykv.checkpoint.checkpointer"),
    **dict.fromkeys(("export_sequence", "import_sequence", "SequenceExport"), "easykv.checkpoint.transfer"),
    **dict.fromkeys(("GroupedSequenceExport", "ExportedGroup"), "easykv.checkpoint.grouped_export"),
    "inspect_checkpoint": "easykv.checkpoint.inspect",
    **dict.fromkeys(("sleep", "wake", "SleepingCache", "device_bytes"), "easykv.tiers.sleep"),
    "HostTier": "easykv.tiers.host",
}

if TYPE_CHECKING:  # the lazy names' types, for type checkers only (never imported here at run time)
    from easykv.checkpoint.checkpointer import (
        CacheCheckpointer,
        RestoredCache,
        list_steps,
        restore_cache,
        save_cache,
    )
    from easykv.checkpoint.grouped_export import ExportedGroup, GroupedSequenceExport
    from easykv.checkpoint.inspect import inspect_checkpoint
    from easykv.checkpoint.transfer import SequenceExport, export_sequence, import_sequence
    from easykv.tiers.host import HostTier
    from easykv.tiers.sleep import SleepingCache, device_bytes, sleep, wake


def __dir__() -> list[str]:
    """The module's names and the lazily loaded ones (``dir(easykv)`` and completion see them all)."""
    return sorted({*globals(), *_LAZY})


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'easykv' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = [
    "ATTENTION_KINDS",
    "AttentionKind",
    "CacheCheckpointer",
    "CacheFullError",
    "CheckpointError",
    "CheckpointIntegrityError",
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "ExportedGroup",
    "GroupPoolMetrics",
    "GroupedSequenceExport",
    "HostTier",
    "HostTierMetrics",
    "InvariantError",
    "LayerGroup",
    "LockstepError",
    "ManagerStateError",
    "MemoryBudget",
    "MemoryUnavailableError",
    "ModelPreset",
    "MultiProcessError",
    "NotACheckpointError",
    "PAD_PAGE",
    "PAD_SLOT",
    "PRESETS",
    "PageLayout",
    "PageManager",
    "PageManagerMetrics",
    "PagedAttentionCache",
    "PagedAttentionCacheMetaData",
    "PagedAttentionCacheView",
    "PagedAttentionMetadata",
    "QuantizedPages",
    "Quantizer",
    "RestoredCache",
    "SUPPORTED_DTYPES",
    "SequenceExport",
    "SerializationError",
    "SleepingCache",
    "StepNotFoundError",
    "UnknownSequenceError",
    "VersionMetrics",
    "available_quantizers",
    "device_bytes",
    "device_memory_budget",
    "export_sequence",
    "gather_kv",
    "get_quantizer",
    "group_pattern",
    "import_sequence",
    "increment_cache_lengths",
    "inspect_checkpoint",
    "list_steps",
    "paged_attention",
    "paged_attention_implementation",
    "paged_attention_reference",
    "register_quantizer",
    "restore_cache",
    "save_cache",
    "single_group",
    "sleep",
    "storage_dtype",
    "tokens_per_gib",
    "view_attention",
    "wake",
]
