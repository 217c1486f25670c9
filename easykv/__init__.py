"""easykv: a distributed, sharded, paged key/value cache for LLM inference in JAX."""

from easykv.cache import PagedAttentionCache, PagedAttentionCacheView, gather_kv
from easykv.memory import MemoryBudget, MemoryUnavailableError, device_memory_budget
from easykv.metadata import SUPPORTED_DTYPES, PagedAttentionCacheMetaData
from easykv.pages import PageLayout, storage_dtype
from easykv.quantization import Quantizer, available_quantizers, get_quantizer
from easykv.runtime import PAD_PAGE, PAD_SLOT, PagedAttentionMetadata
from easykv.serialization import SerializationError

__version__ = "0.1.0"

__all__ = [
    "MemoryBudget",
    "MemoryUnavailableError",
    "PAD_PAGE",
    "PAD_SLOT",
    "PageLayout",
    "PagedAttentionCache",
    "PagedAttentionCacheMetaData",
    "PagedAttentionCacheView",
    "PagedAttentionMetadata",
    "Quantizer",
    "SUPPORTED_DTYPES",
    "SerializationError",
    "available_quantizers",
    "device_memory_budget",
    "gather_kv",
    "get_quantizer",
    "storage_dtype",
]
