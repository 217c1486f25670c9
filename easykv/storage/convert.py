"""Page arrays converted between formats: bitcasts between one platform's storage and
another's (bf16 pages are raw uint16 bits on CPU, bf16 on GPU/TPU: the bits are the same), and
the explicit, lossy re-encoding into another dtype or quantizer (dequantize, cast, quantize).
A checkpoint restore uses both; nothing here knows where the arrays came from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from easykv.errors import CheckpointMismatchError
from easykv.quantization import QuantizedPages
from easykv.storage.pages import PageLayout, PageTemplate, StoredPages, decode_pages, encode_pages, to_storage

_BITCAST = jax.jit(lambda tree, dtypes: jax.tree.map(to_storage, tree, dtypes), static_argnums=1, donate_argnums=0)


def to_storage_dtypes(arrays: list[jax.Array], dtypes: list[np.dtype]) -> list[jax.Array]:
    """Bitcast each array to its target storage dtype (same width; a no-op where equal)."""
    if all(np.dtype(a.dtype) == np.dtype(d) for a, d in zip(arrays, dtypes)):
        return arrays
    for a, d in zip(arrays, dtypes):
        if np.dtype(a.dtype).itemsize != np.dtype(d).itemsize:
            raise CheckpointMismatchError(
                f"saved storage dtype {np.dtype(a.dtype).name} and target storage dtype {np.dtype(d).name} "
                "differ in width; the checkpoint does not hold this cache's format")
    return list(_BITCAST(tuple(arrays), tuple(np.dtype(d) for d in dtypes)))


def convert_pages(pages: StoredPages, src_dtype: np.dtype, dst_dtype: np.dtype, dst_template: PageTemplate,
                  layout: PageLayout) -> StoredPages:
    """One page array of logical ``src_dtype`` re-encoded as ``dst_template`` of ``dst_dtype``
    (dequantize, cast, quantize); lossy where the target is coarser. Runs as one jit with the
    target shardings."""
    out_shardings = jax.tree.map(lambda t: layout.sharding_for(len(t.shape)), dst_template)

    def run(p: StoredPages) -> StoredPages:
        # Quantized pages dequantize straight to float32: a detour through src_dtype would round twice.
        values = decode_pages(p, jnp.float32) if isinstance(p, QuantizedPages) else decode_pages(p, src_dtype)
        return encode_pages(values.astype(jnp.float32).astype(dst_dtype), dst_template)

    converted: StoredPages = jax.jit(run, out_shardings=out_shardings)(pages)
    return converted


__all__ = ["convert_pages", "to_storage_dtypes"]
