"""Validation for paged attention: every shape, dtype and host-side metadata value is checked
here, against the call's options (checked on their own in ``options.py``), before anything runs,
and the static configuration of a call is built.

Split from the computation (api.py, xla.py, pallas.py, reference.py) so it reads on its own;
messages quote what they got.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from easykv.attention.options import FLOAT_DTYPES, AttentionOptions
from easykv.storage.pages import PageLayout
from easykv.quantization import QuantizedPages
from easykv.runtime import PagedAttentionMetadata


# Default block sizes of the XLA path (measured on XLA:CPU, see benchmarks/bench_attention.py):
# tokens per key/value block, and query rows per block for prefill / mixed batches.
_DEFAULT_BLOCK_TOKENS = 256
_DEFAULT_QUERY_BLOCK = 32



# ---- configuration and validation ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    """Everything static about one call (hashable: a jit static argument): the call's
    :class:`AttentionOptions` resolved against its pages and metadata (defaults filled in, the
    layout and implementation chosen), built by :func:`prepare`."""

    mode: str  # "decode" | "prefill" | "mixed"
    dtype: np.dtype  # logical dtype of the pages
    scale: float
    window: int | None
    cap: float | None
    layout: PageLayout | None
    implementation: str  # "xla" | "pallas_tpu"
    block_pages: int
    query_block: int
    num_pages: int  # global pages per layer
    page_size: int


def view_pages(view: Any) -> tuple[Any, Any]:
    """A cache view's ``(key_pages, value_pages)``; anything that is not a view is refused by name."""
    if not all(hasattr(view, a) for a in ("key_pages", "value_pages", "layout", "dtype")):
        raise ValueError(
            f"view must be a PagedAttentionCacheView (key_pages, value_pages, layout, dtype), got "
            f"{type(view).__name__}"
        )
    return view.key_pages, view.value_pages


def _mode(metadata: Any) -> str:
    if not isinstance(metadata, PagedAttentionMetadata):
        raise ValueError(f"metadata must be a PagedAttentionMetadata, got {type(metadata).__name__}")
    if metadata.is_mixed_mode():
        return "mixed"
    if metadata.is_decode_mode():
        return "decode"
    if metadata.is_prefill_mode():
        return "prefill"
    raise ValueError(
        "metadata names no attention mode: it needs decodes_page_table (decode), "
        "prefill_page_table (prefill) or slot_mapping (mixed), and only one of them; build it "
        "with PagedAttentionMetadata.for_decode / for_prefill / for_mixed"
    )


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in np.shape(x))


def _dtype_of(x: Any) -> np.dtype:
    dt = getattr(x, "dtype", None)  # arrays and tracers: never pull values to the host
    return np.dtype(dt) if dt is not None else np.asarray(x).dtype


def _is_host(*xs: Any) -> bool:
    return all(isinstance(x, (np.ndarray, np.generic, int)) for x in xs)


def _logical_dtype(dtype: np.dtype | None, stored: np.dtype) -> np.dtype:
    """The pages' logical dtype: ``dtype`` (an option, already a float dtype) when given, which
    the stored pages must hold as such or as raw bits of its width; else the stored dtype."""
    if dtype is None:
        if stored.name in FLOAT_DTYPES:
            return stored
        fits = [d for d in FLOAT_DTYPES if np.dtype(d).itemsize == stored.itemsize]
        raise ValueError(
            f"the pages are stored as {stored.name} (raw bits); pass dtype= with their logical "
            f"dtype ({' or '.join(fits) or 'a float dtype'}), or use view_attention, which takes "
            "it from the view"
        )
    if stored != dtype and not (stored.kind == "u" and stored.itemsize == dtype.itemsize):
        raise ValueError(
            f"pages stored as {stored.name} cannot hold {dtype.name} values (expected {dtype.name} or "
            f"uint{8 * dtype.itemsize} raw bits); pass the dtype the cache was created with"
        )
    return dtype


def _infer_layout(pages: Any) -> PageLayout | None:
    """The PageLayout of concrete pages placed with a 4-D NamedSharding; None otherwise."""
    sharding = getattr(pages, "sharding", None) if isinstance(pages, jax.Array) else None
    if not isinstance(sharding, NamedSharding) or sharding.mesh.size == 1:
        return None
    spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))

    def axes(entry: Any) -> tuple[str, ...]:
        if entry is None:
            return ()
        return (entry,) if isinstance(entry, str) else tuple(entry)

    if spec[2] is not None or spec[3] is not None:
        raise ValueError(
            f"pages are sharded as {sharding.spec}; only the kv-head and page axes may be split "
            "(PartitionSpec(heads, pages, None, None))"
        )
    return PageLayout(mesh=sharding.mesh, head_axes=axes(spec[0]), page_axes=axes(spec[1]))


def _platform(layout: PageLayout | None, pages: Any) -> str:
    if layout is not None:
        return layout.mesh.devices.flat[0].platform
    if isinstance(pages, jax.Array) and not isinstance(pages, jax.core.Tracer):
        return next(iter(pages.devices())).platform
    return jax.default_backend()


def prepare(
    q: Any,
    key_pages: Any,
    value_pages: Any,
    metadata: Any,
    options: AttentionOptions,
    *,
    infer_layout: bool = True,
) -> Config:
    """Check every shape, dtype and (host) metadata value against ``options`` (already checked on
    their own when built); return the static config, the options resolved against the pages.
    ``infer_layout=False``: no layout is read off the pages' sharding (the dense reference)."""
    # -- q and pages -----------------------------------------------------------------------------
    qs = _shape(q)
    if len(qs) != 3:
        raise ValueError(f"q must be (tokens, num_q_heads, head_dim), got shape {qs}")
    q_dtype = _dtype_of(q)
    if q_dtype.name not in FLOAT_DTYPES:
        raise ValueError(f"q has dtype {q_dtype.name}; use one of {', '.join(FLOAT_DTYPES)}")
    quantized = isinstance(key_pages, QuantizedPages) or isinstance(value_pages, QuantizedPages)
    if quantized:
        _check_quantized(key_pages, value_pages, qs[-1])
        if options.dtype is None:
            raise ValueError("quantized pages need dtype= (the logical cache dtype), or use view_attention")
    ks = _logical_page_shape(key_pages, qs[-1])
    vs = _logical_page_shape(value_pages, qs[-1])
    if len(ks) != 4:
        raise ValueError(
            f"key_pages must be (num_kv_heads, num_pages, page_size, head_dim), got shape {ks}"
        )
    if ks != vs:
        raise ValueError(f"key_pages has shape {ks} but value_pages has shape {vs}; they must match")
    k_dtype, v_dtype = _dtype_of(stored_pages(key_pages)), _dtype_of(stored_pages(value_pages))
    if k_dtype != v_dtype:
        raise ValueError(f"key_pages are {k_dtype.name} but value_pages are {v_dtype.name}; they must match")
    num_kv_heads, num_pages, page_size, head_dim = ks
    tokens, num_q_heads, q_dim = qs
    if q_dim != head_dim:
        raise ValueError(f"q has head_dim {q_dim} but the pages have head_dim {head_dim} (q shape {qs}, pages {ks})")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q has {num_q_heads} heads, not a multiple of the {num_kv_heads} kv heads of the pages "
            "(grouped-query attention needs num_q_heads = group * num_kv_heads)"
        )
    if min(num_pages, page_size, head_dim) <= 0:
        raise ValueError(f"pages of shape {ks} hold nothing; every dimension must be positive")
    logical = _logical_dtype(options.dtype, options.dtype if quantized else k_dtype)

    # -- options' defaults, resolved against the pages -------------------------------------------
    scale = head_dim**-0.5 if options.scale is None else options.scale
    block_pages = options.pages_per_block or max(1, _DEFAULT_BLOCK_TOKENS // page_size)
    qblock = options.query_block or _DEFAULT_QUERY_BLOCK
    window = options.sliding_window

    # -- layout ----------------------------------------------------------------------------------
    layout = options.layout
    if layout is None and infer_layout:
        layout = _infer_layout(stored_pages(key_pages))
    if layout is not None:
        head_shards = math.prod(layout.mesh.shape[a] for a in layout.head_axes)
        if num_kv_heads % head_shards:
            raise ValueError(
                f"layout splits kv heads over {layout.head_axes} ({head_shards} shards) but the pages "
                f"have {num_kv_heads} kv heads, not a multiple"
            )
        if num_pages % layout.page_shards:
            raise ValueError(
                f"layout splits pages over {layout.page_axes} ({layout.page_shards} shards) but the "
                f"pool has {num_pages} pages, not a multiple"
            )
        if layout.mesh.size == 1:
            layout = None

    # -- metadata --------------------------------------------------------------------------------
    mode = _mode(metadata)
    _check_metadata(
        mode, metadata, tokens=tokens, num_pages=num_pages, page_size=page_size, layout=layout, window=window
    )

    cfg = Config(
        mode=mode, dtype=logical, scale=float(scale), window=window, cap=options.logit_soft_cap, layout=layout,
        implementation="xla", block_pages=block_pages, query_block=qblock,
        num_pages=num_pages, page_size=page_size,
    )  # fmt: skip
    why_not = _pallas_unfit(cfg, k_dtype, head_dim, _platform(layout, stored_pages(key_pages)))
    if quantized:  # its int8 path broadcasts scales to head_dim in memory, which we never do
        why_not = "the Pallas TPU kernel does not read easykv's compact quantized pages"
    if options.implementation == "pallas_tpu":
        if why_not:
            raise ValueError(f"implementation='pallas_tpu' cannot run this call: {why_not}; use 'xla' or 'auto'")
        cfg = dataclasses.replace(cfg, implementation="pallas_tpu")
    elif options.implementation == "auto" and not why_not:
        cfg = dataclasses.replace(cfg, implementation="pallas_tpu")
    return cfg


def _pallas_unfit(cfg: Config, stored: np.dtype, head_dim: int, platform: str) -> str:
    """Why the Pallas TPU kernel cannot take this call ('' when it can)."""
    if platform != "tpu":
        return f"it runs on TPU only and the pages are on {platform}"
    if cfg.mode != "decode":
        return f"it serves decode only, this is {cfg.mode} metadata"
    if cfg.window is not None:
        return "it has no sliding window"
    if stored != cfg.dtype or cfg.dtype.name not in ("bfloat16", "float32"):
        return f"it needs bfloat16/float32 pages stored as such, these are {stored.name} holding {cfg.dtype.name}"
    if head_dim % 128:
        return f"it needs head_dim a multiple of 128, got {head_dim}"
    if cfg.layout is not None and cfg.layout.page_shards > 1:
        return "it cannot read a page pool split over data-parallel replicas"
    return ""


def _int_array(name: str, x: Any, shape: tuple[int, ...] | None = None, ndim: int | None = None) -> None:
    s = _shape(x)
    if shape is not None and s != shape:
        raise ValueError(f"metadata.{name} must have shape {shape}, got {s}")
    if ndim is not None and len(s) != ndim:
        raise ValueError(f"metadata.{name} must have {ndim} dimension(s), got shape {s}")
    dt = _dtype_of(x)
    if not np.issubdtype(dt, np.integer):
        raise ValueError(f"metadata.{name} must hold integers, got dtype {dt.name}")


def _check_metadata(
    mode: str, md: PagedAttentionMetadata, *, tokens: int, num_pages: int, page_size: int,
    layout: PageLayout | None, window: int | None,
) -> None:  # fmt: skip
    """Shapes always; values when they are host (numpy) arrays."""
    rows = dict(num_pages=num_pages, page_size=page_size, layout=layout, window=window)
    if mode == "decode":
        _int_array("decodes_position", md.decodes_position, ndim=1)
        _int_array("decodes_page_table", md.decodes_page_table, ndim=2)
        batch = _shape(md.decodes_position)[0]
        if batch != tokens:
            raise ValueError(f"decode q has {tokens} rows but metadata.decodes_position has {batch} sequences")
        if _shape(md.decodes_page_table)[0] != batch:
            raise ValueError(
                f"metadata.decodes_page_table has {_shape(md.decodes_page_table)[0]} rows but "
                f"decodes_position has {batch} entries"
            )
        if _is_host(md.decodes_position, md.decodes_page_table):
            pos = np.asarray(md.decodes_position, np.int64)
            _check_positions("decodes_position", pos)
            table = np.asarray(md.decodes_page_table, np.int64)
            _check_rows("decodes_page_table", table, np.arange(batch), pos, **rows)
    elif mode == "prefill":
        _int_array("prefill_length", md.prefill_length, shape=())
        _int_array("prefill_position", md.prefill_position, ndim=1)
        _int_array("prefill_page_table", md.prefill_page_table, ndim=1)
        padded = _shape(md.prefill_position)[0]
        if padded != tokens:
            raise ValueError(f"prefill q has {tokens} rows but metadata.prefill_position has {padded}")
        if _is_host(md.prefill_length, md.prefill_position, md.prefill_page_table):
            length = int(md.prefill_length)
            if not 0 <= length <= padded:
                raise ValueError(f"metadata.prefill_length={length} is outside 0..{padded} (the padded chunk)")
            pos = np.asarray(md.prefill_position, np.int64)[:length]
            _check_positions("prefill_position", pos)
            table = np.asarray(md.prefill_page_table, np.int64)[None]
            _check_rows("prefill_page_table", table, np.zeros(length, np.int64), pos, **rows)
    else:
        _int_array("positions", md.positions, ndim=1)
        _int_array("query_start_loc", md.query_start_loc, ndim=1)
        _int_array("page_table", md.page_table, ndim=2)
        _int_array("context_lens", md.context_lens, ndim=1)
        _int_array("num_seqs", md.num_seqs, shape=())
        n_tok = _shape(md.positions)[0]
        if n_tok != tokens:
            raise ValueError(f"mixed q has {tokens} rows but metadata.positions has {n_tok} tokens")
        seqs = _shape(md.page_table)[0]
        if _shape(md.query_start_loc)[0] != seqs + 1 or _shape(md.context_lens)[0] != seqs:
            raise ValueError(
                f"metadata.page_table has {seqs} rows, so query_start_loc needs {seqs + 1} entries and "
                f"context_lens {seqs}; got {_shape(md.query_start_loc)[0]} and {_shape(md.context_lens)[0]}"
            )
        arrays = (md.positions, md.query_start_loc, md.page_table, md.context_lens, md.num_seqs)
        if _is_host(*arrays):
            pos, qsl, table, ctx = (np.asarray(a, np.int64) for a in arrays[:4])
            n = int(md.num_seqs)
            if not 0 <= n <= seqs:
                raise ValueError(f"metadata.num_seqs={n} is outside 0..{seqs} (the rows of page_table)")
            if qsl[0] != 0 or np.any(np.diff(qsl) < 0) or qsl[-1] > n_tok:
                raise ValueError(
                    f"metadata.query_start_loc {qsl.tolist()} must start at 0, never decrease and end "
                    f"at most at the {n_tok} tokens"
                )
            real = int(qsl[n])
            pos = pos[:real]  # tokens past the real sequences are padding
            _check_positions("positions", pos)
            owner = np.searchsorted(qsl[1:], np.arange(real), side="right")
            last = np.full(seqs, -1, np.int64)
            np.maximum.at(last, owner, pos)
            over = last >= ctx
            if np.any(over):
                b = int(np.argmax(over))
                raise ValueError(
                    f"sequence {b} has a query at position {int(last[b])} but context_lens[{b}] = "
                    f"{int(ctx[b])}; a query sees keys up to its own position, which must be cached"
                )
            _check_rows("page_table", table, owner, pos, **rows)


def _check_positions(name: str, pos: np.ndarray) -> None:
    if np.any(pos < -1):
        i = int(np.argmax(pos < -1))
        raise ValueError(f"metadata.{name}[{i}] = {int(pos[i])}; positions are >= 0, or -1 for padding")


def _check_rows(
    name: str, table: np.ndarray, owner: np.ndarray, pos: np.ndarray, *, num_pages: int,
    page_size: int, layout: PageLayout | None, window: int | None,
) -> None:  # fmt: skip
    """Every page holding a key that a query (row ``owner[t]`` of ``table``, at ``pos[t]``;
    -1: padding) can see must be a page of the pool; with a split pool, of one replica's slice.
    With a sliding window the pages before the window may be unassigned (-1)."""
    real = pos >= 0
    owner, pos = owner[real], pos[real]
    seqs, width = table.shape
    hi = np.full(seqs, -1, np.int64)  # last key seen by the row
    np.maximum.at(hi, owner, pos)
    lo = np.full(seqs, np.iinfo(np.int64).max, np.int64)  # first key seen by the row
    np.minimum.at(lo, owner, pos if window is None else np.maximum(pos - window + 1, 0))
    if window is None:
        lo = np.minimum(lo, 0)
    first, end = lo // page_size, (hi + page_size) // page_size  # pages [first, end) are read
    if np.any(end > width):
        b = int(np.argmax(end > width))
        raise ValueError(
            f"row {b} of metadata.{name} must cover {int(hi[b]) + 1} tokens ({int(end[b])} pages of "
            f"{page_size}) but the table has only {width} columns"
        )
    cols = np.arange(width)[None, :]
    used = (cols >= first[:, None]) & (cols < end[:, None])
    bad = used & ((table < 0) | (table >= num_pages))
    if np.any(bad):
        b, c = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"metadata.{name}[{b}, {c}] = {int(table[b, c])} is not a page of the pool (0..{num_pages - 1}) "
            f"but row {b} reads it (keys up to position {int(hi[b])})"
        )
    if layout is not None and layout.page_shards > 1:
        per = num_pages // layout.page_shards
        replica = np.where(used, table // per, -1)
        home = replica.max(axis=1, keepdims=True)
        split = used & (replica != home)
        if np.any(split):
            b, c = (int(i) for i in np.argwhere(split)[0])
            other = int(np.argmax(replica[b] == home[b, 0]))
            raise ValueError(
                f"row {b} of metadata.{name} uses pages of two data-parallel replicas (page "
                f"{int(table[b, c])} in slice {int(replica[b, c])}, page {int(table[b, other])} in slice "
                f"{int(home[b, 0])}; {per} pages per slice); a sequence's pages must stay in one slice"
            )



def stored_pages(pages: Any) -> Any:
    """The array whose shape, dtype and sharding describe the pages (values when quantized)."""
    return pages.values if isinstance(pages, QuantizedPages) else pages


def _logical_page_shape(pages: Any, head_dim: int) -> tuple[int, ...]:
    if isinstance(pages, QuantizedPages):
        return _shape(pages.values)[:3] + (head_dim,)
    return _shape(pages)


def _check_quantized(key_pages: Any, value_pages: Any, head_dim: int) -> None:
    for name, pages in (("key_pages", key_pages), ("value_pages", value_pages)):
        if not isinstance(pages, QuantizedPages):
            raise ValueError(f"{name} is not quantized but the other pages are; pass both as QuantizedPages or neither")
        q = pages.quantizer
        tail, _ = q.value_shape(head_dim)
        vshape, sshape = _shape(pages.values), _shape(pages.scales)
        want_s = vshape[:3] + tuple(q.scale_shape(head_dim))
        if len(vshape) != 3 + len(tail) or vshape[3:] != tuple(tail) or sshape != want_s:
            raise ValueError(
                f"{name} ({q.name}) has values {vshape} and scales {sshape}; for head_dim {head_dim} "
                f"expected values (heads, pages, page_size, {', '.join(map(str, tail))}) and scales {want_s}"
            )
    if key_pages.quantizer != value_pages.quantizer:
        raise ValueError(f"key_pages use {key_pages.quantizer.name} but value_pages use {value_pages.quantizer.name}")
