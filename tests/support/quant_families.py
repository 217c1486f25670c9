"""Data families for quantizer error bounds, and the errors measured on them (float64 numpy).

Shared by tests/quantization/test_quantization_families.py (the documented bounds) and
benchmarks/bench_quantizer_families.py (the tables of docs/quantization.md), so both measure the same
thing.

Families (tokens x kv heads x head_dim, float32), at any head_dim (a multiple of 16 for the x50
family); without one, at the head_dim each was first defined at (DEFAULT_DIM), draw for draw as
then:
  * ``gaussian``: N(0, 1), first at head_dim 128.
  * ``outliers-4x50``: N(0, 1) with 1 of 16 channels 50x larger, the same channels for every
    token of a head (as real keys: a few fixed channels tens of times larger); first at head_dim
    64, 4 of 64 channels (hence the name).
  * ``outliers-1x100``: one channel 100x larger, fixed per head; first at head_dim 128.
  * ``student-t3``: Student's t with 3 degrees of freedom (heavy tails, no fixed channel); first
    at head_dim 128.

Errors (relative, ``|approx - exact| / |exact|`` over every token and head):
  * ``all``: the whole round trip; ``ordinary``: the channels that are not outliers only (the
    whole hides them: on the outlier families it is dominated by the large channels).
  * ``attention``: softmax attention of Gaussian queries over keys and values of the family, each
    quantized, against the same on the exact tokens, per head. The softmax scale makes the exact
    logits of each head unit-variance: real attention logits are O(1), while with 50x channels
    and the plain ``head_dim ** -0.5`` the softmax would be one-hot and the error would count
    argmax flips rather than quantization.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from easykv.quantization import scales_per_page
from easykv.storage.writes import scatter_page_scaled_local

FAMILIES = ("gaussian", "outliers-4x50", "outliers-1x100", "student-t3")
# The head_dim each family had before it took one (the tests that do not name a head_dim).
DEFAULT_DIM = {"gaussian": 128, "outliers-4x50": 64, "outliers-1x100": 128, "student-t3": 128}


def family(name: str, tokens: int, heads: int, seed: int, head_dim: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(x, ordinary)``: x ``(tokens, heads, head_dim)`` float32 and, per head, a boolean mask of
    its ordinary (not outlier) channels ``(heads, head_dim)``. ``head_dim`` None: the family's
    original dim (DEFAULT_DIM)."""
    dim = DEFAULT_DIM[name] if head_dim is None else head_dim
    rng = np.random.default_rng(seed)
    if name == "student-t3":
        x = rng.standard_t(3, size=(tokens, heads, dim))
        return x.astype(np.float32), np.ones((heads, dim), bool)
    count, factor = outlier_channels(name, dim)
    x = rng.standard_normal((tokens, heads, dim))
    ordinary = np.ones((heads, dim), bool)
    for h in range(heads):
        channels = rng.choice(dim, count, replace=False)
        x[:, h, channels] *= factor
        ordinary[h, channels] = False
    return x.astype(np.float32), ordinary


def outlier_channels(name: str, head_dim: int) -> tuple[int, float]:
    """``(count, factor)``: how many channels of each head family ``name`` makes ``factor`` times
    larger at ``head_dim``."""
    if name == "outliers-4x50":
        if head_dim % 16:
            raise ValueError(f"outliers-4x50 makes 1 of 16 channels outliers; head_dim {head_dim} is no multiple of 16")
        return head_dim // 16, 50.0
    return {"gaussian": (0, 1.0), "outliers-1x100": (1, 100.0), "student-t3": (0, 1.0)}[name]


def rel(approx: np.ndarray, exact: np.ndarray) -> float:
    approx, exact = np.asarray(approx, np.float64), np.asarray(exact, np.float64)
    return float(np.linalg.norm(approx - exact) / np.linalg.norm(exact))


PAGE_SIZE = 16  # of the pages a quantizer with per-page scales (int4-ch) groups tokens into


def round_trip(quantizer, x: np.ndarray, *, decode: bool = False) -> np.ndarray:
    """``x`` ``(tokens, heads, dim)`` stored and read back. A quantizer with per-page scales
    stores pages of PAGE_SIZE consecutive tokens: written whole, or with ``decode`` one token per
    write through the cache's write path (each page's scales grow as it fills)."""
    if not scales_per_page(quantizer):
        return np.asarray(quantizer.quantize(jnp.asarray(x)).dequantize(jnp.float32), np.float64)
    tokens, heads, dim = x.shape
    pages = jnp.asarray(x).reshape(tokens // PAGE_SIZE, PAGE_SIZE, heads, dim).transpose(2, 0, 1, 3)[None]
    if decode:
        stored = jax.tree.map(jnp.zeros_like, quantizer.quantize(pages))
        for t in range(tokens):
            stored = _write_one(stored, jnp.asarray(x[t])[None], jnp.asarray([t], jnp.int32))
    else:
        stored = quantizer.quantize(pages)
    back = stored.dequantize(jnp.float32)[0]  # (heads, pages, page_size, dim)
    return np.asarray(back.transpose(1, 2, 0, 3).reshape(tokens, heads, dim), np.float64)


@jax.jit
def _write_one(stored, row, slot):
    return scatter_page_scaled_local(stored, row, slot, 0, layout=None)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Softmax attention per head in float64: q ``(queries, heads, dim)``, k and v ``(tokens,
    heads, dim)``, one softmax scale per head."""
    logits = np.einsum("qhd,thd->hqt", q, k) * scale[:, None, None]
    logits -= logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hqt,thd->qhd", weights, v)


def errors(quantizer, name: str, *, tokens: int = 512, heads: int = 8, queries: int = 32, seed: int = 0,
           decode: bool = False, head_dim: int | None = None) -> dict:
    """``{"all", "ordinary", "attention"}`` of ``quantizer`` on family ``name`` at ``head_dim``
    (None: the family's DEFAULT_DIM; K and V drawn independently from it; the round-trip errors
    are the keys'). ``decode``: see `round_trip`."""
    k, ordinary = family(name, tokens, heads, seed, head_dim)
    v, _ = family(name, tokens, heads, seed + 1, head_dim)
    q = np.random.default_rng(seed + 2).standard_normal((queries, heads, k.shape[-1]))
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    scale = 1.0 / np.einsum("qhd,thd->hqt", q, k64).reshape(heads, -1).std(axis=-1)
    kq, vq = round_trip(quantizer, k, decode=decode), round_trip(quantizer, v, decode=decode)
    mask = np.broadcast_to(ordinary, k.shape)
    return {
        "all": rel(kq, k64),
        "ordinary": rel(kq[mask], k64[mask]),
        "attention": rel(attention(q, kq, vq, scale), attention(q, k64, v64, scale)),
    }
