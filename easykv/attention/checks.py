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
from easykv.quantization import Fp8Quantizer, Int8Quantizer, QuantizedPages, Rotation, rotation_of, scales_per_page
from easykv.step.metadata import PagedAttentionMetadata, as_mixed, step_form
from easykv.step.checks import check_step, dtype_of, shape_of
from easykv.validation import integer


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

    decode_only: bool  # EasyDeL's decode form: query row b is sequence b's one token
    dtype: np.dtype  # logical dtype of the pages
    scale: float
    window: int | None
    chunk: int | None
    cap: float | None
    sinks: bool  # per-q-head sink logits join the softmax
    latent_value_dim: int | None  # no value pages: a value is its key's first dims
    layout: PageLayout | None
    implementation: str  # "xla" | one of KERNELS
    block_pages: int
    query_block: int
    num_pages: int  # global pages per layer
    page_size: int
    # The quantizer rotates tokens (``-rot``): keys and values are read in its rotated basis,
    # the query is rotated and the output rotated back instead (None: no rotation). The values'
    # own rotation (their head_dim may differ); a latent cache's values are its keys'.
    rotation: Rotation | None = None
    value_rotation: Rotation | None = None


def view_pages(view: Any) -> tuple[Any, Any, Any]:
    """A cache view's group pages and layer, ``(group_key_pages, group_value_pages, layer)``;
    anything that is not a view is refused by name."""
    if not all(hasattr(view, a) for a in ("group_key_pages", "group_value_pages", "layer", "layout", "dtype")):
        raise ValueError(
            f"view must be a PagedAttentionCacheView (group_key_pages, group_value_pages, layer, layout, dtype), "
            f"got {type(view).__name__}"
        )
    return view.group_key_pages, view.group_value_pages, view.layer


def check_layer(layer: Any, num_layers: int) -> None:
    """``layer`` of a stack of ``num_layers``: an int in range, or an integer scalar array
    (traced: a scan over the layers; its value cannot be checked before the call)."""
    if isinstance(layer, (jax.Array, np.ndarray, np.generic)) and not isinstance(layer, np.bool_):
        if np.shape(layer) != () or not np.issubdtype(np.dtype(layer.dtype), np.integer):
            raise ValueError(f"layer must be an integer scalar, got {np.dtype(layer.dtype).name} of shape "
                             f"{np.shape(layer)}")
        if isinstance(layer, jax.core.Tracer):
            return
    integer("layer", layer, lo=0, hi=num_layers - 1, hint=f"the stacked pages hold {num_layers} layers")


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


def _infer_layout(pages: Any, stacked: bool) -> PageLayout | None:
    """The PageLayout of concrete pages placed with a NamedSharding (a stack's layer axis
    unsplit); None otherwise."""
    sharding = getattr(pages, "sharding", None) if isinstance(pages, jax.Array) else None
    if not isinstance(sharding, NamedSharding) or sharding.mesh.size == 1:
        return None
    spec = tuple(sharding.spec) + (None,) * (pages.ndim - len(sharding.spec))
    if stacked:
        if spec[0] is not None:
            raise ValueError(f"stacked pages are sharded as {sharding.spec}; the layer axis may not be split "
                             "(PartitionSpec(None, heads, pages, None, None))")
        spec = spec[1:]

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
    sinks: Any = None,
    layer: Any = None,
    infer_layout: bool = True,
) -> tuple[Config, PagedAttentionMetadata]:
    """Check every shape, dtype and (host) metadata value against ``options`` (already checked on
    their own when built); return the static config, the options resolved against the pages,
    and the metadata in the mixed form (`runtime.as_mixed`). Host values a validated
    constructor already checked against this pool are not checked again. ``layer``: the pages
    are stacked ``(layers, ...)`` and this layer is read (None: one layer's pages).
    ``infer_layout=False``: no layout is read off the pages' sharding (the dense reference)."""
    # -- q and pages -----------------------------------------------------------------------------
    qs = shape_of(q)
    if len(qs) != 3:
        raise ValueError(f"q must be (tokens, num_q_heads, head_dim), got shape {qs}")
    q_dtype = dtype_of(q)
    if q_dtype.name not in FLOAT_DTYPES:
        raise ValueError(f"q has dtype {q_dtype.name}; use one of {', '.join(FLOAT_DTYPES)}")
    key_pages_given = key_pages
    latent = value_pages is None
    if latent != (options.value_head_dim is not None):
        raise ValueError(
            "value_pages=None (a latent cache: each key's first value_head_dim dims are its value) goes with "
            f"value_head_dim=, and value_head_dim with value_pages=None only; got value_pages="
            f"{'None' if latent else type(value_pages).__name__} and value_head_dim={options.value_head_dim}"
        )
    if latent:
        value_pages = key_pages  # checked as the keys; the values are their leading dims
    stacked = layer is not None
    if stacked:
        for name, pages in (("key_pages", key_pages), ("value_pages", value_pages)):
            shape = shape_of(stored_pages(pages))
            if len(shape) < 5:
                raise ValueError(f"with layer= the {name} are a stack (layers, num_kv_heads, num_pages, page_size, "
                                 f"head_dim), got shape {shape}; pass one layer's pages without layer=")
        num_layers = shape_of(stored_pages(key_pages))[0]
        if shape_of(stored_pages(value_pages))[0] != num_layers:
            raise ValueError(f"key_pages stack {num_layers} layers but value_pages "
                             f"{shape_of(stored_pages(value_pages))[0]}; they must match")
        check_layer(layer, num_layers)
        key_pages, value_pages = _one_layer(key_pages), _one_layer(value_pages)
    quantized = isinstance(key_pages, QuantizedPages) or isinstance(value_pages, QuantizedPages)
    v_dim = qs[-1]
    if quantized:
        if isinstance(value_pages, QuantizedPages) and not latent:  # values may have their own head_dim
            v_dim = _quantized_head_dim(value_pages, qs[-1])
        _check_quantized(key_pages, value_pages, qs[-1], v_dim)
        if options.dtype is None:
            raise ValueError("quantized pages need dtype= (the logical cache dtype), or use view_attention")
    ks = _logical_page_shape(key_pages, qs[-1])
    vs = _logical_page_shape(value_pages, v_dim)
    if len(ks) != 4:
        raise ValueError(
            f"key_pages must be (num_kv_heads, num_pages, page_size, head_dim), got shape {ks}"
        )
    if len(vs) != 4 or ks[:3] != vs[:3]:
        raise ValueError(
            f"key_pages has shape {ks} but value_pages has shape {vs}; they must match in (num_kv_heads, "
            "num_pages, page_size) (value pages may have their own head_dim)"
        )
    k_dtype, v_dtype = dtype_of(stored_pages(key_pages)), dtype_of(stored_pages(value_pages))
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
    if latent:
        if options.value_head_dim > head_dim:
            raise ValueError(f"value_head_dim={options.value_head_dim} exceeds the keys' head_dim {head_dim}: a "
                             "latent cache's values are the first value_head_dim dims of each key")
        vs = vs[:3] + (options.value_head_dim,)
    if min(num_pages, page_size, head_dim, vs[3]) <= 0:
        raise ValueError(f"pages of shapes {ks} and {vs} hold nothing; every dimension must be positive")
    if sinks is not None:
        s_shape, s_dtype = shape_of(sinks), dtype_of(sinks)
        if s_shape != (num_q_heads,) or s_dtype.name not in FLOAT_DTYPES:
            raise ValueError(f"sinks must be (num_q_heads,) = ({num_q_heads},) floats, one logit per q head; got "
                             f"shape {s_shape} of {s_dtype.name}")
    logical = _logical_dtype(options.dtype, options.dtype if quantized else k_dtype)

    # -- options' defaults, resolved against the pages -------------------------------------------
    scale = head_dim**-0.5 if options.scale is None else options.scale
    block_pages = options.pages_per_block or max(1, _DEFAULT_BLOCK_TOKENS // page_size)
    qblock = options.query_block or _DEFAULT_QUERY_BLOCK
    window = options.sliding_window

    # -- layout ----------------------------------------------------------------------------------
    layout = options.layout
    if layout is None and infer_layout:
        layout = _infer_layout(stored_pages(key_pages_given), stacked)
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
    step = as_mixed(metadata, page_size=page_size, num_pages=num_pages)
    check_step(step.rt, step.names, tokens=tokens, num_pages=num_pages, page_size=page_size,
               page_shards=1 if layout is None else layout.page_shards, window=window, chunk=options.chunk_size)

    cfg = Config(
        decode_only=step.decode_only, dtype=logical, scale=float(scale), window=window, chunk=options.chunk_size,
        cap=options.logit_soft_cap, sinks=sinks is not None, latent_value_dim=options.value_head_dim,
        layout=layout, implementation="xla", block_pages=block_pages, query_block=qblock,
        num_pages=num_pages, page_size=page_size,
        rotation=rotation_of(key_pages.quantizer, head_dim) if quantized else None,
        value_rotation=rotation_of(value_pages.quantizer, vs[3]) if quantized and not latent else None,
    )  # fmt: skip
    fit = _Fit(cfg, stored=k_dtype, head_dims=(head_dim, vs[3]), form=step_form(metadata),
               platform=_platform(layout, stored_pages(key_pages_given)), table_width=shape_of(step.rt.page_table)[1],
               quantizer=key_pages.quantizer if quantized else None)
    chosen = options.implementation
    if chosen == "auto":
        chosen = next((kernel for kernel in KERNELS[:2] if not fit.why_not(kernel)), "xla")
    elif chosen != "xla":
        why_not = fit.why_not(chosen)
        if why_not:
            raise ValueError(f"implementation={chosen!r} cannot run this call: {why_not}; use 'xla' or 'auto'")
    return dataclasses.replace(cfg, implementation=chosen), step.rt


# The Pallas kernels, in the order "auto" tries them (the interpreted GPU kernel only when asked).
KERNELS = ("pallas_tpu", "pallas_gpu", "pallas_gpu_interpret")


@dataclasses.dataclass(frozen=True)
class _Fit:
    """What decides whether a Pallas kernel can take a call (see ``pallas.py``)."""

    cfg: Config
    stored: np.dtype  # the pages' stored dtype (values when quantized)
    head_dims: tuple[int, int]  # the keys' and the values'
    form: str  # the metadata's form, for messages
    platform: str
    table_width: int
    quantizer: Any  # None: plain pages

    def why_not(self, kernel: str) -> str:
        """Why ``kernel`` cannot take this call ('' when it can)."""
        cfg = self.cfg
        gpu = kernel != "pallas_tpu"
        if self.quantizer is not None and not gpu:  # its int8 path broadcasts scales to head_dim in memory
            return "the Pallas TPU kernel does not read easykv's compact quantized pages"
        if self.quantizer is not None and not isinstance(self.quantizer, (Int8Quantizer, Fp8Quantizer)):
            return (f"it reads plain pages and int8 / fp8 pages with one scale per token and head, not "
                    f"{self.quantizer.name} pages")
        if kernel != "pallas_gpu_interpret" and self.platform != kernel[len("pallas_"):]:
            where = "TPU" if kernel == "pallas_tpu" else "GPU"
            hint = " ('pallas_gpu_interpret' runs it in Pallas interpret mode anywhere)" if gpu else ""
            return f"it runs on {where} only and the pages are on {self.platform}{hint}"
        if cfg.chunk is not None or cfg.sinks or len(set(self.head_dims)) > 1 or cfg.latent_value_dim is not None:
            return "it has no chunked attention, no sinks, no latent cache, and one head_dim for keys and values"
        if not cfg.decode_only:
            return f"it serves decode only (EasyDeL's decode form), this is {self.form} metadata"
        if cfg.window is not None:
            return "it has no sliding window"
        if cfg.layout is not None and cfg.layout.page_shards > 1:
            return "it cannot read a page pool split over data-parallel replicas"
        return self._gpu_unfit() if gpu else self._tpu_unfit()

    def _tpu_unfit(self) -> str:
        cfg, head_dim = self.cfg, self.head_dims[0]
        if self.stored != cfg.dtype or cfg.dtype.name not in ("bfloat16", "float32"):
            return f"it needs bfloat16/float32 pages stored as such, these are {self.stored.name} holding {cfg.dtype.name}"
        if head_dim % 128:
            return f"it needs head_dim a multiple of 128, got {head_dim}"
        return ""

    def _gpu_unfit(self) -> str:
        cfg, head_dim = self.cfg, self.head_dims[0]
        if cfg.dtype.name not in ("bfloat16", "float16"):
            # Its dots take the query's dtype; on float32 they would run in TF32 (10-bit mantissa).
            return f"it needs a bfloat16/float16 cache (its float32 dots run in TF32), this one is {cfg.dtype.name}"
        if head_dim < 16 or head_dim & (head_dim - 1) or cfg.page_size & (cfg.page_size - 1):
            return f"it needs head_dim >= 16 and page_size powers of two, got {head_dim} and {cfg.page_size}"
        if gpu_blocks(self.table_width, cfg.page_size) is None:
            return (f"page tables {self.table_width} pages wide with page_size {cfg.page_size} give no block of a "
                    "power-of-two number (>= 16) of tokens")
        return ""


def gpu_blocks(width: int, page_size: int) -> tuple[int, int] | None:
    """``(k_splits, pages_per_compute_block)`` for the GPU kernel over page tables ``width``
    wide: the most splits (up to 16, dividing the width) whose partitions hold a block of a
    power-of-two number of tokens, at least 16 (Triton's smallest dot); None when none does."""
    for splits in (16, 8, 4, 2, 1):
        if width % splits:
            continue
        per_split = width // splits
        for pages in (8, 4, 2, 1):
            tokens = pages * page_size
            if per_split % pages == 0 and tokens >= 16 and tokens & (tokens - 1) == 0:
                return splits, pages
    return None


def _one_layer(pages: Any) -> Any:
    """Shapes and dtypes of one layer of stacked pages (for the checks; nothing is sliced)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(shape_of(a)[1:], dtype_of(a)), pages)


def stored_pages(pages: Any) -> Any:
    """The array whose shape, dtype and sharding describe the pages (values when quantized)."""
    return pages.values if isinstance(pages, QuantizedPages) else pages


def _logical_page_shape(pages: Any, head_dim: int) -> tuple[int, ...]:
    if isinstance(pages, QuantizedPages):
        return shape_of(pages.values)[:3] + (head_dim,)
    return shape_of(pages)


def _quantized_head_dim(pages: QuantizedPages, fallback: int) -> int:
    """The logical head_dim of quantized pages (`QuantizedPages.head_dim`); ``fallback`` when
    their shapes fit none (then `_check_quantized` names the mismatch)."""
    try:
        return pages.head_dim
    except ValueError:
        return fallback


def _check_quantized(key_pages: Any, value_pages: Any, head_dim: int, value_head_dim: int) -> None:
    for name, pages, head_dim in (("key_pages", key_pages, head_dim), ("value_pages", value_pages, value_head_dim)):
        if not isinstance(pages, QuantizedPages):
            raise ValueError(f"{name} is not quantized but the other pages are; pass both as QuantizedPages or neither")
        q = pages.quantizer
        tail, _ = q.value_shape(head_dim)
        vshape, sshape = shape_of(pages.values), shape_of(pages.scales)
        per_page = scales_per_page(q)  # scales (heads, pages, ...) rather than (heads, pages, page_size, ...)
        want_s = vshape[:2 if per_page else 3] + tuple(q.scale_shape(head_dim))
        if len(vshape) != 3 + len(tail) or vshape[3:] != tuple(tail) or sshape != want_s:
            raise ValueError(
                f"{name} ({q.name}) has values {vshape} and scales {sshape}; for head_dim {head_dim} "
                f"expected values (heads, pages, page_size, {', '.join(map(str, tail))}) and scales {want_s}"
                + (" (one row per page)" if per_page else "")
            )
    if key_pages.quantizer != value_pages.quantizer:
        raise ValueError(f"key_pages use {key_pages.quantizer.name} but value_pages use {value_pages.quantizer.name}")
