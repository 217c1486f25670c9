"""Moving one sequence between caches: a prefill host hands a sequence to a decode host.

    exported = export_sequence(cache, manager, seq_id, token_ids=prompt)   # host numpy arrays
    exported.save("seq.npz"); exported = SequenceExport.load("seq.npz")    # across hosts
    cache, new_id = import_sequence(other_cache, other_manager, exported)

The export holds the sequence's K/V token-major, ``(layers, length, kv_heads, head_dim)``, either
dense in the source's logical dtype (``dequantize=True``) or raw (quantized values in their value
dtype plus compact scales, per token and head: independent of the page layout). The importing
cache may have another mesh, page size, pool size or batch size; the manager there allocates
the pages (reusing cached prefix pages when the token ids are known) and one jitted, donating
write fills them. A raw export imported into a cache with the same quantizer is bit-exact;
otherwise the values are dequantized and re-encoded by the target (cast to its dtype).

Token ids: the PageManager keeps digests, not token ids, so pass ``token_ids=`` to
`export_sequence` (or give the manager a ``token_ids(seq_id)`` method). Without them the
import commits the tokens with ``manager.advance`` (no prefix caching for that sequence).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from easykv.cache import PagedAttentionCache
from easykv.errors import CacheFullError
from easykv.pages import from_storage, read_pages, run_local, to_storage
from easykv.quantization import QuantizedPages, get_quantizer
from easykv.writes import scatter_encoded_local  # the encoded-token scatter every write uses

_EXPORT_FORMAT = "easykv.SequenceExport/1"


@dataclasses.dataclass(frozen=True)
class SequenceExport:
    """One sequence's tokens and K/V, on the host.

    keys / values: dense ``(layers, length, kv_heads, head_dim)`` arrays in ``dtype``, or, when
    ``raw``, dicts ``{"values": (layers, length, kv_heads, packed), "scales": (layers, length,
    kv_heads[, groups])}`` of the ``quantization`` format.
    """

    length: int
    num_hidden_layers: int
    num_kv_heads: int
    kv_head_dim_size: int
    dtype: np.dtype
    quantization: str
    raw: bool
    keys: Any
    values: Any
    token_ids: np.ndarray | None = None
    source_page_size: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in jax.tree.leaves((self.keys, self.values)))

    def dense(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) as dense ``(layers, length, kv_heads, head_dim)`` in ``dtype``."""
        if not self.raw:
            return self.keys, self.values
        q = get_quantizer(self.quantization)
        out = []
        for part in (self.keys, self.values):
            pages = QuantizedPages(jnp.asarray(part["values"]), jnp.asarray(part["scales"]), q)
            out.append(np.asarray(pages.dequantize(self.dtype)))
        return out[0], out[1]

    # ---- files ---------------------------------------------------------------------------------
    def save(self, file: Any) -> None:
        """Write to a path or binary file (numpy .npz; bf16/fp8 stored as their raw bits)."""
        arrays: dict[str, np.ndarray] = {}
        dtypes: dict[str, str] = {}
        for part in ("keys", "values"):
            data = getattr(self, part)
            items = data.items() if self.raw else [("dense", data)]
            for sub, arr in items:
                arr = np.asarray(arr)
                dtypes[f"{part}.{sub}"] = arr.dtype.name
                arrays[f"{part}.{sub}"] = arr.view(f"u{arr.dtype.itemsize}") if arr.dtype.kind not in "iu" else arr
        if self.token_ids is not None:
            arrays["token_ids"] = np.asarray(self.token_ids)
        header = {"format": _EXPORT_FORMAT, "length": self.length, "num_hidden_layers": self.num_hidden_layers,
                  "num_kv_heads": self.num_kv_heads, "kv_head_dim_size": self.kv_head_dim_size,
                  "dtype": self.dtype.name, "quantization": self.quantization, "raw": self.raw,
                  "source_page_size": self.source_page_size, "dtypes": dtypes}
        arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
        np.savez(file, **arrays)

    @classmethod
    def load(cls, file: Any) -> SequenceExport:
        """Read what `save` wrote; ValueError when the file is not a sequence export."""
        try:
            with np.load(file) as z:
                data = {k: z[k] for k in z.files}
            header = json.loads(data.pop("header").tobytes().decode())
        except (OSError, ValueError, KeyError, EOFError) as err:
            raise ValueError(f"{file!r} is not a readable easykv sequence export: {err}") from err
        if header.get("format") != _EXPORT_FORMAT:
            raise ValueError(f"{file!r} is not an easykv sequence export (format {header.get('format')!r})")
        parts: dict[str, Any] = {"keys": {}, "values": {}}
        for name, dt in header["dtypes"].items():
            part, sub = name.split(".")
            parts[part][sub] = data[name].view(np.dtype(dt))
        keys, values = (parts[p] if header["raw"] else parts[p]["dense"] for p in ("keys", "values"))
        return cls(length=header["length"], num_hidden_layers=header["num_hidden_layers"],
                   num_kv_heads=header["num_kv_heads"], kv_head_dim_size=header["kv_head_dim_size"],
                   dtype=np.dtype(header["dtype"]), quantization=header["quantization"], raw=header["raw"],
                   keys=keys, values=values, token_ids=data.get("token_ids"),
                   source_page_size=header.get("source_page_size"))

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        self.save(buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes) -> SequenceExport:
        return cls.load(io.BytesIO(blob))


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _tokens_major(x: jax.Array) -> jax.Array:
    """(heads, n, page_size, *tail) -> (n * page_size, heads, *tail)."""
    perm = (1, 2, 0) + tuple(range(3, x.ndim))
    y = jnp.transpose(x, perm)
    return y.reshape((-1,) + y.shape[2:])


@partial(jax.jit, static_argnames=("dequantize",))
def _gather_sequence(cache: PagedAttentionCache, ids: jax.Array, dequantize: bool) -> Any:
    meta = cache.metadata
    out: dict[str, list[Any]] = {"k": [], "v": []}
    for view in cache.views:
        for name, pages in (("k", view.key_pages), ("v", view.value_pages)):
            if isinstance(pages, QuantizedPages) and not dequantize:
                value_dtype = pages.quantizer.value_shape(2)[1]
                vals = from_storage(jnp.take(pages.values, ids, axis=1), value_dtype)
                out[name].append({"values": _tokens_major(vals),
                                  "scales": _tokens_major(jnp.take(pages.scales, ids, axis=1))})
            else:
                out[name].append(_tokens_major(read_pages(pages, ids, meta.dtype)))
    return jax.tree.map(lambda *xs: jnp.stack(xs), *out["k"]), jax.tree.map(lambda *xs: jnp.stack(xs), *out["v"])


def _manager_token_ids(manager: Any, seq_id: int) -> np.ndarray | None:
    fn = getattr(manager, "token_ids", None)
    return np.asarray(fn(seq_id)) if callable(fn) else None


def export_sequence(cache: PagedAttentionCache, manager: Any, seq_id: int, *, token_ids: Any = None,
                    dequantize: bool = True) -> SequenceExport:
    """Sequence ``seq_id``'s committed tokens (``manager.length``) read from ``cache`` into host
    arrays; only its pages are read. ``dequantize=False`` keeps a quantized cache's values and
    scales as stored (bit-exact into a cache with the same quantizer)."""
    if not isinstance(cache, PagedAttentionCache):
        raise ValueError(f"cache must be a PagedAttentionCache, got {type(cache).__name__}")
    meta = cache.metadata
    length = int(manager.length(seq_id))  # UnknownSequenceError for a bad id
    if length == 0:
        raise ValueError(f"sequence {seq_id} has no committed tokens to export")
    ids = np.asarray(manager.pages(seq_id), np.int64)[: math.ceil(length / meta.page_size)]
    if ids.size * meta.page_size < length or np.any((ids < 0) | (ids >= meta.num_pages_per_layer)):
        raise ValueError(f"sequence {seq_id} holds pages {ids.tolist()} that cannot hold its {length} tokens in this "
                         f"cache of {meta.num_pages_per_layer} pages; is the manager the one of this cache?")
    if token_ids is None:
        token_ids = _manager_token_ids(manager, seq_id)
    if token_ids is not None:
        token_ids = np.asarray(token_ids)
        if token_ids.shape != (length,) or token_ids.dtype.kind not in "iu":
            raise ValueError(f"token_ids must be {length} integer ids (the sequence's committed tokens), got "
                             f"shape {token_ids.shape} dtype {token_ids.dtype}")
        token_ids = token_ids.astype(np.int32)
    padded = np.zeros(_pow2(ids.size), np.int32)  # few shapes for jit; page 0 is a valid filler
    padded[: ids.size] = ids
    raw = meta.quantizer.name != "none" and not dequantize
    keys, values = jax.device_get(_gather_sequence(cache, jnp.asarray(padded), dequantize=not raw))
    cut = lambda a: np.ascontiguousarray(np.asarray(a)[:, :length])  # noqa: E731
    return SequenceExport(length=length, num_hidden_layers=meta.num_hidden_layers, num_kv_heads=meta.num_kv_heads,
                          kv_head_dim_size=meta.kv_head_dim_size, dtype=meta.dtype, quantization=meta.quantization,
                          raw=raw, keys=jax.tree.map(cut, keys), values=jax.tree.map(cut, values),
                          token_ids=token_ids, source_page_size=meta.page_size)


@partial(jax.jit, donate_argnums=0)
def _write_raw(cache: PagedAttentionCache, keys: Any, values: Any, slots: jax.Array) -> PagedAttentionCache:
    views = []
    for i, view in enumerate(cache.views):
        kp, vp = view.key_pages, view.value_pages
        new = tuple(
            QuantizedPages(to_storage(part["values"][i], pages.values.dtype), part["scales"][i], pages.quantizer)
            for part, pages in ((keys, kp), (values, vp)))
        layout = view.layout

        def local(pages: Any, upd: Any, s: jax.Array, layout: Any = layout) -> Any:
            return scatter_encoded_local(pages, upd, s, layout=layout)

        kp, vp = run_local(local, layout, (kp, vp), new, (slots,), token_major=True)
        views.append(dataclasses.replace(view, key_pages=kp, value_pages=vp))
    return PagedAttentionCache(tuple(views))


def _check_import(meta: Any, exported: SequenceExport) -> None:
    if not isinstance(exported, SequenceExport):
        raise ValueError(f"exported must be a SequenceExport (from export_sequence), got {type(exported).__name__}")
    fields = ("num_hidden_layers", "num_kv_heads", "kv_head_dim_size")
    diff = [f"{f}: export {getattr(exported, f)}, cache {getattr(meta, f)}"
            for f in fields if getattr(exported, f) != getattr(meta, f)]
    if diff:
        raise ValueError("the sequence comes from a model of another shape (" + "; ".join(diff) + "); import it into "
                         "a cache of the same model")
    if exported.length > meta.max_sequences:
        raise ValueError(f"the sequence holds {exported.length} tokens but the target cache allows at most "
                         f"max_sequences={meta.max_sequences}")


def _check_room(manager: Any, length: int, tokens: Any, salt: Any) -> None:
    """CacheFullError before any state changes when the pool clearly lacks the pages (the
    manager's own check still runs, per data-parallel replica)."""
    metrics = getattr(manager, "metrics", None)
    if metrics is None:
        return
    ps = int(manager.page_size)
    matched = 0
    if tokens is not None and callable(getattr(manager, "cached_prefix_length", None)):
        matched = int(manager.cached_prefix_length(tokens, salt=salt)) // ps
    need = -(-int(length) // ps) - matched
    available = int(metrics.free_pages) + int(metrics.cached_pages)
    if need > available:
        raise CacheFullError(
            f"importing a sequence of {length} tokens needs {need} new pages but only {available} are free or "
            "evictable; release or preempt sequences first", resource="pages", needed=need, available=available)


def import_sequence(cache: PagedAttentionCache, manager: Any, exported: SequenceExport, *, seq_id: int | None = None,
                    salt: Any = None, reuse_prefix: bool = True) -> tuple[PagedAttentionCache, int]:
    """Give ``exported`` a sequence id in ``manager`` (``seq_id``, or the lowest free one), pages in
    ``cache``, and write its K/V. Returns ``(cache, seq_id)``; like ``cache.write`` the cache
    passed in is donated. With token ids and ``reuse_prefix``, pages already cached for the
    same prefix (same ``salt``) are shared instead of written. The manager's pending
    copy-on-write copies and scrubs are applied first (they must precede any write). On
    CacheFullError or bad input nothing changes (a CacheFullError that only one data-parallel
    replica's slice reveals releases the claimed id again) and the cache is untouched."""
    if not isinstance(cache, PagedAttentionCache):
        raise ValueError(f"cache must be a PagedAttentionCache, got {type(cache).__name__}")
    meta = cache.metadata
    _check_import(meta, exported)
    tokens = exported.token_ids
    raw_exact = exported.raw and exported.quantization == meta.quantization
    if raw_exact:
        keys, values = exported.keys, exported.values
    else:
        keys, values = exported.dense()
        keys, values = np.asarray(keys).astype(meta.dtype), np.asarray(values).astype(meta.dtype)
    _check_room(manager, exported.length, tokens if reuse_prefix else None, salt)
    if seq_id is None:
        [seq] = manager.claim(1)
    else:
        manager.external_claim([seq_id])
        seq = int(seq_id)
    try:
        done = manager.match_prefix(seq, tokens, salt=salt) if (tokens is not None and reuse_prefix) else 0
        n = exported.length - done
        step_meta = manager.build_step_metadata([seq], [n], pad_tokens_to=_pow2(n))
    except Exception:
        manager.release(seq)
        raise
    cache, _ = manager.apply_pending(cache)
    pad = _pow2(n) - n

    def window(a: np.ndarray) -> np.ndarray:
        a = np.asarray(a)[:, done:]
        return np.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) if pad else a

    if raw_exact:
        slots = jnp.asarray(step_meta.slot_mapping, jnp.int32)
        cache = _write_raw(cache, jax.tree.map(window, keys), jax.tree.map(window, values), slots)
    else:
        cache, dropped = cache.write(window(keys), window(values), step_meta)
        if int(dropped):
            raise AssertionError(f"easykv bug: import_sequence dropped {int(dropped)} tokens")
    if tokens is not None:
        manager.step([seq], [np.asarray(tokens)[done:]])
    else:
        manager.advance(seq, n)
    return cache, seq


__all__ = ["SequenceExport", "export_sequence", "import_sequence"]
