"""The Pallas kernel paths of paged attention: JAX's TPU and GPU ``paged_attention`` kernels, whose
page layout ``(num_kv_heads, num_pages, page_size, head_dim)`` (and, on GPU, scale layout
``(num_kv_heads, num_pages, page_size)``) is easykv's own. ``api.py`` holds the entry points;
``checks.py`` decides when a call fits a kernel.

Both serve decode (EasyDeL's decode form) with no window, chunk, sinks or latent cache, one head
dim for keys and values, on an unsplit page axis; each is called per device inside the same
``shard_map`` as the XLA path, on that device's kv heads.

* **TPU**: bf16/f32 pages stored as such, ``head_dim % 128 == 0``.
* **GPU**: bf16/f16 pages, or int8 / fp8 pages (``-rot`` too: ``api.run`` rotates the query and
  the output) with their compact scales, which the kernel applies to the logits and the weights;
  ``head_dim`` and ``page_size`` powers of two, ``head_dim >= 16``, and a table width that splits
  into blocks of at least 16 tokens (Triton's smallest dot). ``implementation="pallas_gpu_interpret"``
  runs it in Pallas interpret mode on any platform (tests; slow).

The kernels take one layer's pages, so a stack of several layers is sliced at ``layer`` first:
the slice is contiguous, but XLA may copy it. :func:`paged_attention_implementation` says which
path a call takes; ``implementation=`` forces one.

A page id outside the pool (possible only in device metadata, which cannot be checked on the
host) ends its sequence's keys there: a kernel reads whole pages, so such an id must never reach
it, and is neither clipped onto another page nor read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from easykv.attention.checks import Config, gpu_blocks
from easykv.attention.rows import Rows
from easykv.quantization import QuantizedPages
from easykv.storage.pages import StoredPages, from_storage


def _kernel_lengths_and_table(rows: Rows, num_pages: int, page_size: int) -> tuple[jax.Array, jax.Array]:
    """Keys per sequence (0 for padding rows) and a table the kernels may read whole: ids outside
    ``0 .. num_pages - 1`` become page 0 and the sequence ends before the first of them."""
    positions, table = rows.positions, rows.table
    lengths = jnp.where(positions >= 0, positions + 1, 0).astype(jnp.int32)
    bad = (table < 0) | (table >= num_pages)
    first_bad = jnp.min(jnp.where(bad, jnp.arange(table.shape[1]), table.shape[1]), axis=1)
    lengths = jnp.minimum(lengths, first_bad * page_size)
    return lengths, jnp.where(bad, 0, table)


def pallas_decode_local(
    q: jax.Array,
    kp: jax.Array,
    vp: jax.Array,
    rows: Rows,
    sinks: jax.Array,
    layer: jax.Array,
    *,
    cfg: Config,
) -> jax.Array:
    """Decode through JAX's Pallas TPU kernel (one layer's pages in its layout, one device's
    heads): ``q`` ``(batch, local q heads, head_dim)``; one query row per sequence, so only the
    rows' positions and page table are read. ``sinks`` are all -inf here: calls with sinks go to
    the XLA path."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as pallas_paged

    width = rows.table.shape[1]
    block = next(b for b in (16, 8, 4, 2, 1) if width % b == 0)
    lengths, table = _kernel_lengths_and_table(rows, kp.shape[2], cfg.page_size)
    out = pallas_paged(
        (q.astype(jnp.float32) * cfg.scale).astype(q.dtype),
        kp[layer], vp[layer], lengths, table,
        attn_logits_soft_cap=cfg.cap, pages_per_compute_block=block,
    )  # fmt: skip
    return jnp.where((rows.positions >= 0)[:, None, None], out, 0).astype(q.dtype)


def _kernel_pages(pages: StoredPages, layer: jax.Array, dtype: np.dtype) -> tuple[jax.Array, jax.Array | None]:
    """One layer's pages as the GPU kernel reads them: values in their own dtype (raw bits
    reinterpreted; no cast) and the compact per-token scales (None for plain pages)."""
    if isinstance(pages, QuantizedPages):
        return from_storage(pages.values[layer], pages.quantizer.value_shape(2)[1]), pages.scales[layer]
    return from_storage(pages[layer], dtype), None


def pallas_gpu_decode_local(q: jax.Array, kp: StoredPages, vp: StoredPages, rows: Rows, sinks: jax.Array,
                            layer: jax.Array, *, cfg: Config, interpret: bool = False) -> jax.Array:
    """Decode through JAX's Pallas GPU kernel on one device's heads (see the module doc); the
    query is scaled in float32 and given to the kernel in the pages' logical dtype (the kernel
    casts int8 / fp8 codes to it and multiplies the logits and weights by the scales)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as pallas_paged

    keys, key_scales = _kernel_pages(kp, layer, cfg.dtype)
    values, value_scales = _kernel_pages(vp, layer, cfg.dtype)
    blocks = gpu_blocks(rows.table.shape[1], cfg.page_size)
    if blocks is None:  # the dispatch's fit check (checks.py, _gpu_unfit) routes such tables elsewhere
        raise ValueError(f"page tables {rows.table.shape[1]} pages wide with page_size {cfg.page_size} give the "
                         "Pallas GPU kernel no block; use implementation='xla' or a page table width with one")
    splits, pages = blocks
    lengths, table = _kernel_lengths_and_table(rows, keys.shape[1], cfg.page_size)
    out = pallas_paged(
        (q.astype(jnp.float32) * cfg.scale).astype(cfg.dtype), keys, values, table, lengths,
        key_scales, value_scales, k_splits=splits, pages_per_compute_block=pages,
        attn_logits_soft_cap=cfg.cap, interpret=interpret,
    )  # fmt: skip
    return jnp.where((rows.positions >= 0)[:, None, None], out, 0).astype(q.dtype)
