"""Validation for paged attention, in the order a call meets it: every shape and dtype
(`check_inputs`), the options resolved against the pages (`resolve_layout`, `resolve_options`;
the options are checked on their own in ``options.py``), the step metadata converted once to the
ragged form and checked against the pool (``step.metadata.as_mixed`` and
`StepEntry.check_reads`), then the implementation (`choose_implementation`); `prepare` runs them
and returns the static configuration of the call.

Split from the computation (api.py, xla.py, pallas.py, reference.py) so it reads on its own;
messages quote what they got.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from easykv.attention.options import FLOAT_DTYPES, AttentionOptions
from easykv.quantization import (
    Fp8Quantizer,
    Int8Quantizer,
    QuantizedPages,
    Quantizer,
    Rotation,
    rotation_of,
    scales_per_page,
)
from easykv.step.checks import Array, dtype_of, shape_of
from easykv.step.metadata import StepInput, as_mixed
from easykv.step.ragged import RaggedStep
from easykv.storage.pages import Layer, PageLayout
from easykv.validation import integer

if TYPE_CHECKING:
    from easykv.storage.view import PagedAttentionCacheView

# One layer's pages, or a layer group's stack of them.
Pages = jax.Array | np.ndarray | QuantizedPages[jax.Array] | QuantizedPages[np.ndarray]
_FLOATS = frozenset(np.dtype(name) for name in FLOAT_DTYPES)


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


def view_pages(view: PagedAttentionCacheView) -> tuple[Pages, Pages | None, Layer]:
    """A cache view's group pages and layer, ``(group_key_pages, group_value_pages, layer)``;
    anything that is not a view is refused by name."""
    if not all(hasattr(view, a) for a in ("group_key_pages", "group_value_pages", "layer", "layout", "dtype")):
        raise ValueError(
            f"view must be a PagedAttentionCacheView (group_key_pages, group_value_pages, layer, layout, dtype), "
            f"got {type(view).__name__}"
        )
    return view.group_key_pages, view.group_value_pages, view.layer


def check_layer(layer: object, num_layers: int) -> None:
    """``layer`` of a stack of ``num_layers``: an int in range, or an integer scalar array
    (traced: a scan over the layers; its value cannot be checked before the call)."""
    if isinstance(layer, (jax.Array, np.ndarray, np.generic)) and not isinstance(layer, np.bool_):
        if np.shape(layer) != () or not np.issubdtype(np.dtype(layer.dtype), np.integer):
            raise ValueError(f"layer must be an integer scalar, got {np.dtype(layer.dtype).name} of shape "
                             f"{np.shape(layer)}")
        if isinstance(layer, jax.core.Tracer):
            return
    integer("layer", layer, lo=0, hi=num_layers - 1, hint=f"the stacked pages hold {num_layers} layers")


def _is_float(dtype: np.dtype) -> bool:
    return dtype in _FLOATS or dtype.name in FLOAT_DTYPES  # the set first: a dtype's name is slow to build


def _logical_dtype(dtype: np.dtype | None, stored: np.dtype) -> np.dtype:
    """The pages' logical dtype: ``dtype`` (an option, already a float dtype) when given, which
    the stored pages must hold as such or as raw bits of its width; else the stored dtype."""
    if dtype is None:
        if _is_float(stored):
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
    # An abstract mesh (no devices) says nothing about where concrete pages live.
    if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh) or sharding.mesh.size == 1:
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
    platform: str
    if layout is not None:
        platform = layout.mesh.devices.flat[0].platform
    elif isinstance(pages, jax.Array) and not isinstance(pages, jax.core.Tracer):
        platform = next(iter(pages.devices())).platform
    else:
        platform = jax.default_backend()
    return platform


class Inputs(NamedTuple):
    """What `check_inputs` found: the call's geometry and its pages' formats."""

    tokens: int
    num_kv_heads: int
    num_pages: int
    page_size: int
    head_dim: int  # the keys' (and the queries')
    value_dim: int
    stored: np.dtype  # the pages' stored dtype (their values' when quantized)
    dtype: np.dtype  # their logical dtype
    key_quantizer: Quantizer | None  # None: plain pages
    value_quantizer: Quantizer | None  # None: plain pages, or a latent cache (its values are its keys)
    stacked: bool  # the pages are a layer group's stack, read at ``layer``


def prepare(
    q: Array,
    key_pages: Pages,
    value_pages: Pages | None,
    metadata: StepInput,
    options: AttentionOptions,
    *,
    sinks: Array | None = None,
    layer: Layer | None = None,
    infer_layout: bool = True,
) -> tuple[Config, RaggedStep]:
    """Check every shape and dtype (`check_inputs`), resolve ``options`` (already checked on
    their own when built) against the pages (`resolve_layout`, `resolve_options`), check the
    metadata once against the pool (`as_mixed`, attention's one conversion of EasyDeL's forms,
    then `StepEntry.check_reads`: values its builder proved for this pool are not checked again
    but for the pages read) and choose the implementation (`choose_implementation`). Returns the
    static config and the step in the ragged form. ``layer``: the pages are stacked ``(layers,
    ...)`` and this layer is read (None: one layer's pages). ``infer_layout=False``: no layout is read off the pages'
    sharding (the dense reference)."""
    inputs = check_inputs(q, key_pages, value_pages, options, sinks=sinks, layer=layer)
    layout = resolve_layout(options, inputs, stored_pages(key_pages) if infer_layout else None)
    entry = as_mixed(metadata, page_size=inputs.page_size, num_pages=inputs.num_pages)
    entry.check_reads(tokens=inputs.tokens, num_pages=inputs.num_pages, page_size=inputs.page_size,
                      page_shards=1 if layout is None else layout.page_shards, window=options.sliding_window,
                      chunk=options.chunk_size)
    cfg = resolve_options(options, inputs, layout, decode_only=entry.decode_only, sinks=sinks is not None)
    fit = _Fit(cfg, stored=inputs.stored, head_dims=(inputs.head_dim, inputs.value_dim), form=entry.form,
               platform=_platform(layout, stored_pages(key_pages)), table_width=shape_of(entry.step_meta.page_table)[1],
               quantizer=inputs.key_quantizer)
    chosen = choose_implementation(options.implementation, fit)
    return (cfg if chosen == cfg.implementation else dataclasses.replace(cfg, implementation=chosen)), entry.step_meta


# ---- shapes and dtypes --------------------------------------------------------------------------
def check_inputs(q: Array, key_pages: Pages, value_pages: Pages | None, options: AttentionOptions, *,
                 sinks: Array | None = None, layer: Layer | None = None) -> Inputs:
    """Every shape and dtype of a call, against ``options``' value_head_dim and dtype."""
    tokens, num_q_heads, q_dim = _check_q(q)
    latent = value_pages is None
    if latent != (options.value_head_dim is not None):
        raise ValueError(
            "value_pages=None (a latent cache: each key's first value_head_dim dims are its value) goes with "
            f"value_head_dim=, and value_head_dim with value_pages=None only; got value_pages="
            f"{'None' if latent else type(value_pages).__name__} and value_head_dim={options.value_head_dim}"
        )
    if value_pages is None:
        value_pages = key_pages  # checked as the keys; the values are their leading dims
    if layer is not None:
        key_pages, value_pages = _check_stack(key_pages, value_pages, layer)
    ks, vs = _page_shapes(key_pages, value_pages, q_dim, latent, options)
    k_dtype, v_dtype = dtype_of(stored_pages(key_pages)), dtype_of(stored_pages(value_pages))
    if k_dtype != v_dtype:
        raise ValueError(f"key_pages are {k_dtype.name} but value_pages are {v_dtype.name}; they must match")
    num_kv_heads, num_pages, page_size, head_dim = ks
    if q_dim != head_dim:
        raise ValueError(f"q has head_dim {q_dim} but the pages have head_dim {head_dim} (q shape "
                         f"{(tokens, num_q_heads, q_dim)}, pages {ks})")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q has {num_q_heads} heads, not a multiple of the {num_kv_heads} kv heads of the pages "
            "(grouped-query attention needs num_q_heads = group * num_kv_heads)"
        )
    value_head_dim = options.value_head_dim  # given exactly when latent (checked above)
    if value_head_dim is not None:
        if value_head_dim > head_dim:
            raise ValueError(f"value_head_dim={value_head_dim} exceeds the keys' head_dim {head_dim}: a "
                             "latent cache's values are the first value_head_dim dims of each key")
        vs = vs[:3] + (value_head_dim,)
    if min(num_pages, page_size, head_dim, vs[3]) <= 0:
        raise ValueError(f"pages of shapes {ks} and {vs} hold nothing; every dimension must be positive")
    if sinks is not None:
        s_shape, s_dtype = shape_of(sinks), dtype_of(sinks)
        if s_shape != (num_q_heads,) or not _is_float(s_dtype):
            raise ValueError(f"sinks must be (num_q_heads,) = ({num_q_heads},) floats, one logit per q head; got "
                             f"shape {s_shape} of {s_dtype.name}")
    key_q, value_q = (_quantizer(key_pages), None if latent else _quantizer(value_pages))
    # Quantized pages hold the dtype they were given (checked given in _page_shapes).
    logical = _logical_dtype(options.dtype, k_dtype if key_q is None or options.dtype is None else options.dtype)
    return Inputs(tokens, num_kv_heads, num_pages, page_size, head_dim, vs[3], k_dtype, logical, key_q, value_q,
                  layer is not None)


def _check_q(q: Array) -> tuple[int, int, int]:
    qs = shape_of(q)
    if len(qs) != 3:
        raise ValueError(f"q must be (tokens, num_q_heads, head_dim), got shape {qs}")
    q_dtype = dtype_of(q)
    if not _is_float(q_dtype):
        raise ValueError(f"q has dtype {q_dtype.name}; use one of {', '.join(FLOAT_DTYPES)}")
    return qs[0], qs[1], qs[2]


def _check_stack(key_pages: Pages, value_pages: Pages, layer: Layer) -> tuple[Pages, Pages]:
    """Stacked pages ``(layers, ...)`` read at ``layer``: the shapes and dtypes of one layer."""
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
    return _one_layer(key_pages), _one_layer(value_pages)


def _page_shapes(key_pages: Pages, value_pages: Pages, head_dim: int, latent: bool,
                 options: AttentionOptions) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The logical shapes of one layer's key and value pages, ``(num_kv_heads, num_pages,
    page_size, head_dim)`` each (quantized pages checked against their quantizer first)."""
    v_dim = head_dim
    if isinstance(key_pages, QuantizedPages) or isinstance(value_pages, QuantizedPages):
        if isinstance(value_pages, QuantizedPages) and not latent:  # values may have their own head_dim
            v_dim = _quantized_head_dim(value_pages, head_dim)
        _check_quantized(key_pages, value_pages, head_dim, v_dim)
        if options.dtype is None:
            raise ValueError("quantized pages need dtype= (the logical cache dtype), or use view_attention")
    ks = _logical_page_shape(key_pages, head_dim)
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
    return ks, vs


def _quantizer(pages: Pages) -> Quantizer | None:
    return pages.quantizer if isinstance(pages, QuantizedPages) else None


# ---- the options, resolved against the pages ----------------------------------------------------
def resolve_layout(options: AttentionOptions, inputs: Inputs, pages: Array | None) -> PageLayout | None:
    """The layout of the call: ``options.layout``, else the one read off ``pages``' sharding
    (None: not read), checked against the heads and pages it splits; None on one device."""
    layout = options.layout
    if layout is None and pages is not None:
        layout = _infer_layout(pages, inputs.stacked)
    if layout is None:
        return None
    head_shards = math.prod(layout.mesh.shape[a] for a in layout.head_axes)
    if inputs.num_kv_heads % head_shards:
        raise ValueError(
            f"layout splits kv heads over {layout.head_axes} ({head_shards} shards) but the pages "
            f"have {inputs.num_kv_heads} kv heads, not a multiple"
        )
    if inputs.num_pages % layout.page_shards:
        raise ValueError(
            f"layout splits pages over {layout.page_axes} ({layout.page_shards} shards) but the "
            f"pool has {inputs.num_pages} pages, not a multiple"
        )
    return None if layout.mesh.size == 1 else layout


def resolve_options(options: AttentionOptions, inputs: Inputs, layout: PageLayout | None, *, decode_only: bool,
                    sinks: bool) -> Config:
    """The static config of a call: ``options`` with their defaults filled in from the pages
    (scale from ``head_dim``, key/value blocks from ``page_size``), the quantizers' rotations,
    and the XLA path (`choose_implementation` may pick a kernel)."""
    key_q, value_q = inputs.key_quantizer, inputs.value_quantizer
    return Config(
        decode_only=decode_only, dtype=inputs.dtype,
        scale=float(inputs.head_dim**-0.5 if options.scale is None else options.scale),
        window=options.sliding_window, chunk=options.chunk_size, cap=options.logit_soft_cap, sinks=sinks,
        latent_value_dim=options.value_head_dim, layout=layout, implementation="xla",
        block_pages=options.pages_per_block or max(1, _DEFAULT_BLOCK_TOKENS // inputs.page_size),
        query_block=options.query_block or _DEFAULT_QUERY_BLOCK, num_pages=inputs.num_pages,
        page_size=inputs.page_size, rotation=None if key_q is None else rotation_of(key_q, inputs.head_dim),
        value_rotation=None if value_q is None else rotation_of(value_q, inputs.value_dim),
    )  # fmt: skip


# ---- the implementation -------------------------------------------------------------------------
def choose_implementation(requested: str, fit: _Fit) -> str:
    """``requested`` (an ``AttentionOptions.implementation``) for the call ``fit`` describes:
    "auto" takes the first Pallas kernel that can run it, else "xla"; a named kernel that cannot
    is refused, saying why."""
    if requested == "auto":
        return next((kernel for kernel in KERNELS[:2] if not fit.why_not(kernel)), "xla")
    if requested != "xla":
        why_not = fit.why_not(requested)
        if why_not:
            raise ValueError(f"implementation={requested!r} cannot run this call: {why_not}; use 'xla' or 'auto'")
    return requested


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
            return (f"it needs bfloat16/float32 pages stored as such, these are {self.stored.name} holding "
                    f"{cfg.dtype.name}")
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


def stored_pages(pages: Pages) -> Array:
    """The array whose shape, dtype and sharding describe the pages (values when quantized)."""
    return pages.values if isinstance(pages, QuantizedPages) else pages


def _logical_page_shape(pages: Any, head_dim: int) -> tuple[int, ...]:
    if isinstance(pages, QuantizedPages):
        return shape_of(pages.values)[:3] + (head_dim,)
    return shape_of(pages)


def _quantized_head_dim(pages: QuantizedPages[jax.Array] | QuantizedPages[np.ndarray], fallback: int) -> int:
    """The logical head_dim of quantized pages (`QuantizedPages.head_dim`); ``fallback`` when
    their shapes fit none (then `_check_quantized` names the mismatch)."""
    try:
        return pages.head_dim
    except ValueError:
        return fallback


def _check_quantized(key_pages: Any, value_pages: Any, head_dim: int, value_head_dim: int) -> None:
    for name, pages, dim in (("key_pages", key_pages, head_dim), ("value_pages", value_pages, value_head_dim)):
        if not isinstance(pages, QuantizedPages):
            raise ValueError(f"{name} is not quantized but the other pages are; pass both as QuantizedPages or neither")
        q = pages.quantizer
        tail, _ = q.value_shape(dim)
        vshape, sshape = shape_of(pages.values), shape_of(pages.scales)
        per_page = scales_per_page(q)  # scales (heads, pages, ...) rather than (heads, pages, page_size, ...)
        want_s = vshape[:2 if per_page else 3] + tuple(q.scale_shape(dim))
        if len(vshape) != 3 + len(tail) or vshape[3:] != tuple(tail) or sshape != want_s:
            raise ValueError(
                f"{name} ({q.name}) has values {vshape} and scales {sshape}; for head_dim {dim} "
                f"expected values (heads, pages, page_size, {', '.join(map(str, tail))}) and scales {want_s}"
                + (" (one row per page)" if per_page else "")
            )
    if key_pages.quantizer != value_pages.quantizer:
        raise ValueError(f"key_pages use {key_pages.quantizer.name} but value_pages use {value_pages.quantizer.name}")
