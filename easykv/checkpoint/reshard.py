"""What a restore may change of a saved cache, and what it may not: `check_same_cache` (a
target metadata must describe the saved model and pools; only layout and format may differ) and
`check_format` (the saved metadata in the dtype and quantizer a restore asks for; another format
only with ``convert=True``, per layer group).

`easykv.checkpoint.restore` then lays that metadata out for the target mesh
(`easykv.spec.relayout`), converts the arrays (`easykv.storage.convert`) and lets the page
manager follow (`PageManager.reshard`: the manager owns its state format).
"""

from __future__ import annotations

from typing import Any

from jax.typing import DTypeLike

from easykv.errors import CheckpointMismatchError
from easykv.quantization import Quantizer, get_quantizer
from easykv.spec.dtypes import canonical_dtype
from easykv.spec.metadata import PagedAttentionCacheMetaData, known_dtype

# Fields that describe the model and the pool: a restore never changes them.
SHAPE_FIELDS = ("num_hidden_layers", "num_kv_heads", "kv_head_dim_size", "page_size", "num_pages_per_layer",
                "max_sequences", "batch_size")


def check_same_cache(saved: PagedAttentionCacheMetaData, expected: PagedAttentionCacheMetaData) -> None:
    """CheckpointMismatchError unless ``expected`` (a restore's target metadata) describes the
    saved model and pool: only layout and format may differ."""
    diff = [f"{f}: checkpoint {getattr(saved, f)!r}, target {getattr(expected, f)!r}"
            for f in SHAPE_FIELDS if getattr(saved, f) != getattr(expected, f)]
    if _geometry(saved) != _geometry(expected):
        diff.append(f"layer groups: checkpoint {_geometry(saved)}, target {_geometry(expected)}")
    if diff:
        raise CheckpointMismatchError(
            "the checkpoint's cache does not match the target metadata (" + "; ".join(diff) + "); "
            "restore with metadata=None to get the saved shape, or create the target metadata with "
            "the saved values (pool contents cannot be re-paged; export_sequence/import_sequence "
            "moves single sequences between caches of different shapes)")


def _geometry(meta: PagedAttentionCacheMetaData) -> list[tuple[Any, ...]]:
    """What each layer group's pages hold (not where they lie): a restore keeps it."""
    # The kind's value, not the enum: the message shows ('sliding', ...) as it always did.
    return [(g.layers, g.attention.value, g.window, g.num_kv_heads, g.key_head_dim, g.value_head_dim, g.latent,
             g.num_pages) for g in meta.groups]


def check_format(saved: PagedAttentionCacheMetaData, dtype: DTypeLike | None, quantizer: str | Quantizer | None,
                 convert: bool, *,
                 like: PagedAttentionCacheMetaData | None) -> PagedAttentionCacheMetaData:
    """``saved`` in the format a restore asks for: each layer group's dtype and quantizer as in
    ``like`` (the target metadata; None: as saved), then ``dtype`` / ``quantizer`` for every group
    where given. A change of any group's format is refused unless ``convert``. ``like`` has the
    saved groups (`check_same_cache`)."""
    base = saved if like is None else like
    want_dtype = None if dtype is None else canonical_dtype(dtype)
    want_q = None if quantizer is None else get_quantizer(quantizer).name
    def first(*choices: Any) -> Any:  # the first given (not None) of the choices
        return next(c for c in choices if c is not None)

    formats = [(first(want_dtype, base.group_dtype(b), saved.group_dtype(s)),
                first(want_q, base.group_quantizer(b).name)) for s, b in zip(saved.groups, base.groups)]
    want = saved.with_formats(formats, dtype=first(want_dtype, base.dtype, saved.dtype),
                              quantization=first(want_q, base.quantization))
    changed = [(g, a, b) for g, a, b in zip(saved.groups, saved.group_formats, want.group_formats) if a != b]
    if changed and not convert:
        what = "; ".join(("" if saved.is_uniform else f"layers {g.span}: ") + f"the checkpoint holds "
                         f"{known_dtype(a[0]).name} pages with quantizer {a[1]!r}, but {known_dtype(b[0]).name} "
                         f"with quantizer {b[1]!r} was asked for"
                         for g, a, b in changed)
        raise CheckpointMismatchError(
            f"{what}; restore without dtype/quantizer to get the saved format bit-exact, or pass convert=True to "
            "dequantize and re-encode every page (lossy when the target is coarser)")
    return want


__all__ = ["SHAPE_FIELDS", "check_format", "check_same_cache"]
