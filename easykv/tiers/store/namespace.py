"""Which store keys a cache owns: `StoreNamespace`, the one place store keys are built.

A key names one value: ``easykv-v1/<model slug>/<group namespace>/<page digest>/<kv head>``.

- The model slug is a short, file-system-safe form of the model id the user gives (required,
  never guessed) plus 16 hex digits of its sha256, so two ids never share a slug.
- The group namespace (32 hex digits, 128 bits, of a sha256) covers everything that makes the
  bytes of a layer group's page differ: the codec's layout version, the model id, the group's
  attention kind, window, layers, kv heads, key / value head dims and latent flag, the page size,
  and the stored format (the logical dtype, and the quantizer's name, parameters, scale and value
  layout, the rotation it applies, and its ``format_version`` where it has one). Caches that
  differ in any of these never share an entry.
- The page digest (64 hex digits) is the manager's (`easykv.manager.prefix_hash`): a chained
  sha256 that starts from the weight version's root and covers the salt, so weight versions and
  tenants are kept apart by the digest itself, not by the namespace.
- The kv head is a global kv-head index (decimal): one value per head, so a process reads and
  writes only the heads its shards hold.

Nothing of the mesh is in a key (head or page shard counts and axes), nor any pool size (device
or host pages, batch size, max sequence length, memory budget): a cache on tp=8, one on
dp=2 x tp=4 and one on a single device share every entry.

Keys are ASCII of ``[A-Za-z0-9._/-]``, at most 512 characters, never starting with ``/`` nor
holding ``..`` (the backends' rule, `easykv.tiers.store.backend`): every part is built to keep it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from easykv.manager.prefix_hash import DIGEST_BYTES
from easykv.quantization import (
    Quantizer,
    is_compressing,
    rotation_of,
    scale_dtype,
    scales_per_page,
)
from easykv.spec.groups import LayerGroup, known_size
from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.tiers.store import codec
from easykv.validation import integer, show

#: The key scheme; a scheme change renames every key.
KEY_SCHEME = "easykv-v1"
MODEL_ID_MAX = 200
_MODEL_ID_FIX = ("pass model_id=, the name and revision of the weights, e.g. 'Qwen/Qwen3-8B@main'; easykv never "
                 "guesses it")
_SLUG_MAX = 48
_SLUG_HASH_HEX = 16
GROUP_HEX = 32  # hex digits of a group's namespace digest in its keys
_NAMESPACE_TAG = b"easykv.store.namespace.v1|"
_JSON_SCALARS = (bool, int, float, str, type(None))


def _model_id(model_id: object) -> str:
    if model_id is None:
        raise ValueError(f"model_id=None: the store needs the model's id; {_MODEL_ID_FIX}")
    if not isinstance(model_id, str):
        raise TypeError(f"model_id must be a str, got {type(model_id).__name__} {show(model_id)}; {_MODEL_ID_FIX}")
    if not model_id or len(model_id) > MODEL_ID_MAX or not model_id.isprintable() or model_id.strip() != model_id:
        raise ValueError(f"model_id={show(model_id)} must be 1..{MODEL_ID_MAX} printable characters without "
                         f"surrounding spaces (got {len(model_id)}); {_MODEL_ID_FIX}")
    return model_id


def model_slug(model_id: str) -> str:
    """``model_id``'s key segment: up to 48 characters of ``[A-Za-z0-9_.-]`` (others, and runs of
    dots, become ``-``) and 16 hex digits of its sha256, e.g. ``Qwen-Qwen3-8B-main-<hash>``."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", model_id)
    readable = re.sub(r"\.{2,}", "-", readable).strip("-.")[:_SLUG_MAX].strip("-.") or "model"
    return f"{readable}-{hashlib.sha256(model_id.encode('utf-8')).hexdigest()[:_SLUG_HASH_HEX]}"


def _quantizer_params(quantizer: Quantizer) -> dict[str, Any]:
    """The quantizer's dataclass fields: its parameters (group size, asymmetry, rotation, outliers)."""
    if not dataclasses.is_dataclass(quantizer):
        return {}
    params: dict[str, Any] = {}
    for field in dataclasses.fields(quantizer):
        value = getattr(quantizer, field.name)
        if field.name == "name":
            continue
        if isinstance(value, np.generic):
            value = value.item()
        if not isinstance(value, _JSON_SCALARS):
            raise ValueError(
                f"quantizer {quantizer.name!r} has field {field.name}={show(value)}, which the store cannot write "
                "into a namespace (bool, int, float, str or None only); give it such fields so that two caches "
                "whose stored bits differ never share store entries")
        params[field.name] = value
    return params


def _rotation_id(quantizer: Quantizer, head_dim: int) -> str | None:
    """A fingerprint of the rotation ``quantizer`` applies at ``head_dim`` (None: none): sha256 of
    the sign pattern of its matrix. The codes are readable only with the same matrix; its seed is
    private to ``easykv.quantization``, and the signs identify it exactly on every platform (no
    entry is near zero, so rounding never flips one, while the seeded signs change with the seed)."""
    rotation = rotation_of(quantizer, head_dim)
    if rotation is None:
        return None
    signs = np.packbits(np.asarray(rotation.matrix) < 0)
    return hashlib.sha256(signs.tobytes()).hexdigest()


def _stored_format(quantizer: Quantizer, dtype: np.dtype, head_dims: tuple[int, ...]) -> dict[str, Any]:
    """What decides the stored bits of a page of ``dtype`` under ``quantizer`` for each head dim."""
    fmt: dict[str, Any] = {"dtype": dtype.name, "quantizer": quantizer.name,
                           "quantizer_format_version": getattr(quantizer, "format_version", None),
                           "quantizer_params": _quantizer_params(quantizer)}
    if is_compressing(quantizer):
        fmt["scale_dtype"] = scale_dtype(quantizer).name
        fmt["scales_per_page"] = scales_per_page(quantizer)
        fmt["layout"] = {}
        for dim in head_dims:
            values, value_dtype = quantizer.value_shape(dim)
            fmt["layout"][str(dim)] = {"values": [list(values), np.dtype(value_dtype).name],
                                       "scales": list(quantizer.scale_shape(dim)),
                                       "rotation": _rotation_id(quantizer, dim)}
    return fmt


def _group_spec(metadata: PagedAttentionCacheMetaData, group: LayerGroup, model_id: str) -> dict[str, Any]:
    dtype = metadata.group_dtype(group)
    if dtype is None:
        raise ValueError(
            f"the metadata leaves the page dtype open (dtype=None, left to init_cache), so the stored format of "
            f"layers {group.span} is unknown; pass the cache's own metadata (cache.metadata, completed by "
            "init_cache) or create the metadata with dtype=...")
    key_dim, value_dim = known_size(group.key_head_dim), known_size(group.value_head_dim)
    dims = tuple(sorted({key_dim, value_dim} if group.has_values else {key_dim}))
    return {"codec_format_version": codec.FORMAT_VERSION, "model_id": model_id,
            "attention": group.attention.value, "window": group.window, "layers": list(group.layers),
            "num_kv_heads": known_size(group.num_kv_heads), "key_head_dim": key_dim, "value_head_dim": value_dim,
            "latent": group.latent, "page_size": metadata.page_size,
            "stored": _stored_format(metadata.group_quantizer(group), dtype, dims)}


def _canonical_json(spec: dict[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


@dataclasses.dataclass(frozen=True)
class StoreNamespace:
    """The store keys of one cache's pages (see the module doc); build it with `of`.

    Attributes:
      model_id: the model id the user gave.
      model_slug: its key segment (`model_slug`).
      group_namespaces: per layer group, the 64 hex digits of its namespace digest (keys carry 32).
      group_specs: per layer group, the canonical JSON the digest covers.
      group_heads: per layer group, its kv heads (a key's head is below it).
    """

    model_id: str
    model_slug: str
    group_namespaces: tuple[str, ...]
    group_specs: tuple[str, ...]
    group_heads: tuple[int, ...]

    @classmethod
    def of(cls, metadata: PagedAttentionCacheMetaData, model_id: str) -> StoreNamespace:
        """The namespace of a cache of ``metadata`` holding the weights ``model_id`` names.

        Args:
          metadata: the cache's metadata, its dtype known (a cache's own metadata always is).
          model_id: the name and revision of the weights, e.g. ``'Qwen/Qwen3-8B@main'``: 1..200
            printable characters. Required: easykv never guesses it.

        Raises:
          TypeError: ``metadata`` is no `PagedAttentionCacheMetaData`, or ``model_id`` no str.
          ValueError: ``model_id`` is None, empty, too long or not printable; the metadata leaves
            its dtype open; a custom quantizer has a field the namespace cannot hold.
        """
        if not isinstance(metadata, PagedAttentionCacheMetaData):
            raise TypeError(f"metadata must be a PagedAttentionCacheMetaData, got {type(metadata).__name__} "
                            f"{show(metadata)}; pass cache.metadata")
        model_id = _model_id(model_id)
        specs = tuple(_canonical_json(_group_spec(metadata, g, model_id)) for g in metadata.groups)
        digests = tuple(hashlib.sha256(_NAMESPACE_TAG + s.encode("ascii")).hexdigest() for s in specs)
        return cls(model_id=model_id, model_slug=model_slug(model_id), group_namespaces=digests, group_specs=specs,
                   group_heads=tuple(known_size(g.num_kv_heads) for g in metadata.groups))

    def _group(self, group: object) -> int:
        last = len(self.group_namespaces) - 1
        return integer("group", group, lo=0, hi=last, hint=f"a layer group index of this cache (0..{last})")

    def prefix(self) -> str:
        """The prefix of every key of this model (all its formats and layer groups), for listing."""
        return f"{KEY_SCHEME}/{self.model_slug}/"

    def group_prefix(self, group: int) -> str:
        """The prefix of every key of layer group ``group`` of this cache, for listing.

        Args:
          group: a layer group index, ``0 .. len(metadata.groups) - 1``.

        Raises:
          ValueError: ``group`` is no int in that range.
        """
        return f"{self.prefix()}{self.group_namespaces[self._group(group)][:GROUP_HEX]}/"

    def key(self, group: int, digest: bytes, head: int) -> str:
        """The key of kv head ``head`` of the page ``digest`` of layer group ``group``.

        Args:
          group: a layer group index, ``0 .. len(metadata.groups) - 1``.
          digest: the page's 32-byte digest (`easykv.manager.prefix_hash`).
          head: a global kv-head index of the group, ``0 .. num_kv_heads - 1``.

        Raises:
          ValueError: ``group`` or ``head`` is no int in its range, or ``digest`` no 32 bytes.
          TypeError: ``digest`` is no bytes.
        """
        return self.keys(group, digest, (head,))[0]

    def keys(self, group: int, digest: bytes, heads: Sequence[int]) -> list[str]:
        """`key` of each of ``heads`` of one page (checked once for the page, then each head).

        Args:
          group: a layer group index.
          digest: the page's 32-byte digest.
          heads: global kv-head indices of the group.

        Raises:
          ValueError, TypeError: as `key`'s.
        """
        g = self._group(group)
        if not isinstance(digest, bytes):
            raise TypeError(f"digest must be the page's {DIGEST_BYTES}-byte digest (bytes), got "
                            f"{type(digest).__name__} {show(digest)}; pass the manager's page digest")
        if len(digest) != DIGEST_BYTES:
            raise ValueError(f"digest must be {DIGEST_BYTES} bytes (a page's sha256), got {len(digest)}: "
                             f"{show(digest)}; pass the manager's page digest")
        last = self.group_heads[g] - 1
        stem = f"{self.group_prefix(g)}{digest.hex()}/"
        return [stem + str(integer("head", h, lo=0, hi=last, hint=f"a kv head of layer group {g} (0..{last})"))
                for h in heads]

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (docs, metrics, ``easykv store stats``): the model, the prefix
        and, per group, its namespace digest, key prefix, heads and the spec the digest covers."""
        return {"key_scheme": KEY_SCHEME, "model_id": self.model_id, "prefix": self.prefix(),
                "groups": [{"group": g, "namespace": ns, "prefix": self.group_prefix(g), "kv_heads": heads,
                            "spec": json.loads(spec)}
                           for g, (ns, spec, heads) in enumerate(zip(self.group_namespaces, self.group_specs,
                                                                     self.group_heads))]}


__all__ = ["GROUP_HEX", "KEY_SCHEME", "MODEL_ID_MAX", "StoreNamespace", "model_slug"]
