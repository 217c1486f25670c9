"""Pool sizing helpers in Modular MAX's terms: how much memory a batch needs, how big a batch
memory holds. Both count what one device stores for one page in every layer."""

from __future__ import annotations

from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.validation import INT64_MAX, non_negative_int, positive_int


def estimated_memory_size(metadata: PagedAttentionCacheMetaData, available_cache_memory: int, *,
                          max_batch_size: int | None = None, max_seq_len: int | None = None) -> int:
    """Bytes per device the pool should take: pages for ``max_batch_size`` sequences of
    ``max_seq_len`` tokens (defaults: the metadata's), never more than that batch can use
    and never more than ``available_cache_memory`` (per device) holds."""
    per_page, per_seq, shards = _page_cost(metadata, max_seq_len)
    batch = positive_int("max_batch_size", metadata.batch_size if max_batch_size is None else max_batch_size)
    budget = non_negative_int("available_cache_memory", available_cache_memory, hi=INT64_MAX) // per_page
    return min(-(-batch // shards) * per_seq, budget) * per_page

def infer_optimal_batch_size(metadata: PagedAttentionCacheMetaData, available_cache_memory: int, *,
                             max_seq_len: int | None = None) -> int:
    """How many sequences of ``max_seq_len`` tokens (default the metadata's max_sequences)
    ``available_cache_memory`` bytes per device hold, over all data-parallel replicas."""
    per_page, per_seq, shards = _page_cost(metadata, max_seq_len)
    pages = non_negative_int("available_cache_memory", available_cache_memory, hi=INT64_MAX) // per_page
    if pages < per_seq:
        raise ValueError(
            f"available_cache_memory={available_cache_memory} bytes per device hold {pages} pages but one "
            f"sequence needs {per_seq} ({per_seq * per_page} bytes); give more memory or shorten max_seq_len")
    return shards * (pages // per_seq)


def tokens_per_gib(metadata: PagedAttentionCacheMetaData, context: int, *, uniform: bool = False) -> float:
    """Tokens of ``context``-token sequences one GiB of a device holds, once the pages that
    left a window are released; ``uniform``: the same model with every layer full attention
    (its groups' geometry kept), the baseline a grouped cache is measured against.

    Args:
      metadata: the cache's `PagedAttentionCacheMetaData`.
      context: tokens per sequence, a positive int.
      uniform: every layer keeps all ``ceil(context / page_size)`` pages (default False).
    """
    if not isinstance(metadata, PagedAttentionCacheMetaData):
        raise ValueError(f"metadata must be a PagedAttentionCacheMetaData, got {type(metadata).__name__}")
    context = positive_int("context", context, hi=None)
    if uniform:
        pages = -(-context // metadata.page_size)
        per_sequence = sum(metadata.group_page_bytes(g) * pages * g.num_layers for g in metadata.groups)
    else:
        per_sequence = metadata.bytes_per_sequence(context)
    return 2**30 / per_sequence * context


def _page_cost(metadata: PagedAttentionCacheMetaData, max_seq_len: int | None) -> tuple[int, int, int]:
    """(bytes per page on one device across layers, pages per sequence, data-parallel replicas)."""
    if not isinstance(metadata, PagedAttentionCacheMetaData):
        raise ValueError(f"metadata must be a PagedAttentionCacheMetaData, got {type(metadata).__name__}")
    length = positive_int("max_seq_len", metadata.max_sequences if max_seq_len is None else max_seq_len)
    if not metadata.is_uniform:
        raise ValueError("estimated_memory_size and infer_optimal_batch_size size a uniform cache; for layer groups "
                         "use metadata.bytes_per_sequence(tokens) (the bytes per device one sequence needs)")
    per_page = int(metadata.page_bytes_per_device) * int(metadata.num_hidden_layers)
    return per_page, -(-length // int(metadata.page_size)), int(getattr(metadata, "page_shards", 1))
