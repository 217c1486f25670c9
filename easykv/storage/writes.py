"""The one write primitive: scatter new K/V tokens into pages by slot.

A slot is ``page_id * page_size + offset``. ``PAD_SLOT`` (-1) marks padding and is dropped
without notice; any other slot outside the pool is dropped and counted, never clipped into a
neighbouring page. Prefill, decode and mixed writes only differ in how they derive the slots.

Values of host-side (numpy) metadata are checked before anything is written; inside jit, where
values are unknown until run time, the count of dropped tokens is returned instead.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.storage.pages import PageLayout, encode_tokens, run_local
from easykv.validation import integer_array
from easykv.runtime import (
    PAD_SLOT,
    PagedAttentionMetadata,
    array_module,
    check_distinct_slots,
    slots_from_table,
)

def token_slots(
    metadata: PagedAttentionMetadata, *, page_size: int, num_pages: int, pages_per_sequence: int | None = None
) -> Any:
    """The slot of every token row a write with ``metadata`` receives, shape (num_tokens,)."""
    if not isinstance(metadata, PagedAttentionMetadata):
        raise ValueError(f"the runtime metadata must be a PagedAttentionMetadata, got {type(metadata).__name__}")
    if metadata.is_mixed_mode():
        return metadata.slot_mapping
    if metadata.is_decode_mode():
        return slots_from_table(metadata.decodes_page_table, metadata.decodes_position, page_size=page_size,
                                num_pages=num_pages, pages_per_sequence=pages_per_sequence)
    if metadata.is_prefill_mode():
        xp = array_module(metadata.prefill_position, metadata.prefill_page_table, metadata.prefill_length)
        pos = metadata.prefill_position
        pos = xp.where(xp.arange(pos.shape[0]) < metadata.prefill_length, pos, -1)
        table = xp.broadcast_to(metadata.prefill_page_table, (pos.shape[0],) + metadata.prefill_page_table.shape)
        return slots_from_table(table, pos, page_size=page_size, num_pages=num_pages,
                                pages_per_sequence=pages_per_sequence)
    raise ValueError("the PagedAttentionMetadata is empty (init_empty): it names no tokens to write")


def count_dropped(slots: Any, capacity: int) -> Any:
    """Real tokens (not padding) whose slot lies outside ``[0, capacity)``."""
    xp = array_module(slots)
    return xp.sum((slots != PAD_SLOT) & ((slots < 0) | (slots >= capacity))).astype(np.int32)


def check_slots_on_host(slots: Any, capacity: int) -> Any:
    """Host (numpy) slots checked before anything is written: integers, each a slot of the pool
    or padding, no slot twice. Returns them as int32; device arrays pass through (their bad
    slots are dropped and counted inside the write)."""
    if isinstance(slots, jax.Array):
        return slots
    slots = integer_array("slots", slots, ndim=1, lo=None, hi=None, dtype=np.int64)
    bad = (slots != PAD_SLOT) & ((slots < 0) | (slots >= capacity))
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(
            f"token {i} would be written to slot {int(slots[i])}, outside the pool's {capacity} "
            "slots (its page is unassigned, outside the pool, or past the page table); "
            "nothing was written — assign pages before writing"
        )
    check_distinct_slots(slots, "write")
    return slots.astype(np.int32)


def check_new_tokens(
    key: Any, value: Any, *, metadata: PagedAttentionCacheMetaData, num_tokens: int, name: str | None = None
) -> None:
    """New K/V must be (num_tokens, num_kv_heads, head_dim) in the cache dtype."""
    want = (num_tokens, metadata.num_kv_heads, metadata.kv_head_dim_size)
    pairs = ((name, key),) if name is not None else (("key", key), ("value", value))
    for name, x in pairs:
        shape, dtype = tuple(getattr(x, "shape", np.shape(x))), getattr(x, "dtype", None)
        if shape != want:
            raise ValueError(
                f"{name} has shape {shape}, expected (num_tokens, num_kv_heads, head_dim) = {want}"
            )
        if dtype is None or np.dtype(dtype) != metadata.dtype:
            raise ValueError(
                f"{name} has dtype {dtype}, but the cache stores {metadata.dtype.name}; "
                f"cast with .astype({metadata.dtype.name}) first (a silent cast would hide a model bug)"
            )


def scatter_encoded_local(pages: Any, new: Any, slots: jax.Array, *, layout: PageLayout | None) -> Any:
    """One shard: put token row ``new[t]`` (heads, ...) at slot ``slots[t]`` for local slots."""

    def one(leaf: jax.Array, upd: jax.Array) -> jax.Array:
        h, p, s = leaf.shape[:3]
        cap = p * s
        offset = layout.local_page_offset(p) * s if layout is not None else 0
        local = slots - offset
        idx = jnp.where((slots >= 0) & (local >= 0) & (local < cap), local, cap)
        flat = leaf.reshape((h, cap) + leaf.shape[3:])
        # Updates stay token-major (num_tokens, heads, ...): the window dims map onto the
        # operand's head and trailing dims, so no transpose of the new tokens is needed.
        dims = jax.lax.ScatterDimensionNumbers(
            update_window_dims=tuple(range(1, flat.ndim)),
            inserted_window_dims=(1,),
            scatter_dims_to_operand_dims=(1,),
        )
        out = jax.lax.scatter(flat, idx[:, None], upd, dims, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
        return out.reshape(leaf.shape)

    return jax.tree.map(one, pages, new)


def scatter_kv(
    key_pages: Any,
    value_pages: Any,
    key: jax.Array,
    value: jax.Array,
    slots: Any,
    *,
    layout: PageLayout | None,
) -> tuple[Any, Any]:
    """Write token rows ``key[t]``/``value[t]`` (num_tokens, heads, head_dim) at ``slots[t]``.

    Each device writes only into its own shard: the new tokens are split by kv head like the
    pages, and each page slice keeps the slots that fall inside it.
    """
    new = (encode_tokens(jnp.asarray(key), key_pages), encode_tokens(jnp.asarray(value), value_pages))

    def local(pages: Any, upd: Any, s: jax.Array) -> Any:
        return scatter_encoded_local(pages, upd, s, layout=layout)

    return run_local(local, layout, (key_pages, value_pages), new, (jnp.asarray(slots, jnp.int32),), token_major=True)
