"""The JSON form of a cache view and of a whole cache (EasyDeL's ``to_dict`` / ``from_dict`` /
``to_json`` / ``from_json``, and ``replace``: `EasyDeLForms`): every page array written exactly
(dtype, shape, bytes). The view and the cache import this module; it knows them only by what
they hold, so the forms are one-way.

Meant for small caches, tests and debugging: a JSON of a real pool is the pool's size again,
base64-encoded, built on one host. Checkpoints (`easykv.save_cache`) are for real pools: they
write each shard from its own device, verify every byte and restore onto other meshes.

Pages are written as stored (bf16 as raw uint16 on CPU, see ``pages.py``) and read back into
the storage of the devices they are placed on, bit for bit. The mesh cannot be written: a view
read back lives on ``mesh`` (laid out as its metadata says, like ``init_cache``), or on one
device when no mesh is given.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, Sharding, SingleDeviceSharding

from easykv.errors import SerializationError
from easykv.quantization import QuantizedPages
from easykv.sharding import PartitionManager
from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.spec.serialization import decode_array, encode_array
from easykv.storage.pages import StoredPages, group_page_templates
from easykv.storage.placement import checked_layout, group_layouts
from easykv.validation import integer, parse_json, show

VIEW_SCHEMA = "easykv.PagedAttentionCacheView"
CACHE_SCHEMA = "easykv.PagedAttentionCache"
_VERSION = 1
_V = TypeVar("_V")


class _View(Protocol):
    """What the dict form reads of a `PagedAttentionCacheView` (this module never imports it)."""

    @property
    def metadata(self) -> PagedAttentionCacheMetaData: ...

    @property
    def layer_index(self) -> int | None: ...

    @property
    def key_pages(self) -> StoredPages: ...

    @property
    def value_pages(self) -> StoredPages | None: ...


class _Cache(Protocol):
    """What the dict form reads of a `PagedAttentionCache`: its views."""

    @property
    def views(self) -> Iterable[_View]: ...


class EasyDeLForms:
    """EasyDeL's ``replace`` and JSON forms of the view and the cache (dataclasses); each class
    gives its dict form (``to_dict`` / ``from_dict``, built from the functions below) and JSON is
    that dict."""

    if TYPE_CHECKING:  # the view and the cache are dataclasses: `dataclasses.replace` takes them
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def replace(self, **changes: object) -> Self:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, data: object, *, mesh: Mesh | None = None, partition_manager: PartitionManager | None = None
                  ) -> Self:
        raise NotImplementedError

    def to_json(self, **json_kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **json_kwargs)

    @classmethod
    def from_json(cls, text: str | bytes, *, mesh: Mesh | None = None,
                  partition_manager: PartitionManager | None = None) -> Self:
        return cls.from_dict(parse_json(text, what=f"the JSON of a {cls.__name__}", error=SerializationError),
                             mesh=mesh, partition_manager=partition_manager)


def _encode_pages(pages: StoredPages | None, field: str) -> Any:
    if pages is None:  # a latent group's values
        return None
    if isinstance(pages, QuantizedPages):
        return {"values": encode_array(pages.values, f"{field}.values"),
                "scales": encode_array(pages.scales, f"{field}.scales")}
    return encode_array(pages, field)


def view_to_dict(view: _View) -> dict[str, Any]:
    """The dict form of a `PagedAttentionCacheView`: its metadata and its layer's pages."""
    return {"__schema__": VIEW_SCHEMA, "__version__": _VERSION, "metadata": view.metadata.to_dict(),
            "layer_index": view.layer_index, "key_pages": _encode_pages(view.key_pages, "key_pages"),
            "value_pages": _encode_pages(view.value_pages, "value_pages")}


def cache_to_dict(cache: _Cache) -> dict[str, Any]:
    """The dict form of a `PagedAttentionCache`: the dict of each of its views."""
    return {"__schema__": CACHE_SCHEMA, "__version__": _VERSION, "views": [view_to_dict(v) for v in cache.views]}


def _header(data: object, schema: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise SerializationError(f"a {schema} dict is needed, got {type(data).__name__}")
    if data.get("__schema__") != schema:
        raise SerializationError(f"the dict is a {show(data.get('__schema__'))}, not a {schema!r}")
    if data.get("__version__") != _VERSION:
        raise SerializationError(f"{schema} version {show(data.get('__version__'))}: this easykv reads version "
                                 f"{_VERSION}; upgrade easykv")
    fields = {"__schema__", "__version__", *keys}
    if set(data) != fields:
        raise SerializationError(f"a {schema} dict has exactly the keys {sorted(fields)}, got {sorted(map(str, data))}")
    return data


def _decode_pages(data: Any, template: Any, field: str) -> Any:
    """Stored arrays checked against the template: same shape, same width (bitcast to the
    target platform's storage, e.g. raw uint16 bits written on CPU, bfloat16 on GPU)."""
    if template is None or data is None:
        if template is not None or data is not None:
            raise SerializationError(f"field {field!r} is {'null' if data is None else 'given'} but the layer's group "
                                     f"{'stores values' if template is not None else 'is latent: it stores no values'}")
        return None
    if isinstance(template, QuantizedPages):
        if not isinstance(data, dict) or set(data) != {"values", "scales"}:
            raise SerializationError(f"field {field!r} of quantized pages must hold 'values' and 'scales'")
        return QuantizedPages(_decode_pages(data["values"], template.values, f"{field}.values"),
                              _decode_pages(data["scales"], template.scales, f"{field}.scales"), template.quantizer)
    arr = decode_array(data, field)
    want = np.dtype(template.dtype)
    if arr.shape != tuple(template.shape) or arr.dtype.itemsize != want.itemsize:
        raise SerializationError(f"field {field!r} is {arr.dtype.name}{list(arr.shape)} but the metadata implies "
                                 f"{want.name}{list(template.shape)}")
    return arr.view(want)


def view_from_dict(cls: Callable[..., _V], data: object, mesh: Mesh | None, partition_manager: PartitionManager | None
                   ) -> _V:
    """A view of class ``cls`` (`PagedAttentionCacheView`) read from its dict form, its pages
    placed on ``mesh`` by the rule `init_cache` follows, or on one device without a mesh."""
    data = _header(data, VIEW_SCHEMA, ("metadata", "layer_index", "key_pages", "value_pages"))
    meta = PagedAttentionCacheMetaData.from_dict(data["metadata"])
    if meta.dtype is None:
        raise SerializationError("the view's metadata has no dtype; a view's metadata is complete")
    layer = integer("layer_index", data["layer_index"], lo=0, hi=meta.num_hidden_layers - 1)
    g, _ = meta.group_of(layer)
    sharding: Callable[[int], Sharding]
    if mesh is None:
        device = jax.devices()[0]
        layout, sharding = None, lambda ndim: SingleDeviceSharding(device)
        group = meta.groups[g]
        stacked = group_page_templates(meta, group, device.platform)
    else:
        if not isinstance(mesh, Mesh):
            raise ValueError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
        meta, cache_layout, templates = checked_layout(mesh, meta.dtype, meta, partition_manager, meta.quantization)
        layout = group_layouts(meta, cache_layout)[g]
        stacked = templates(g, 1)
        sharding = layout.sharding_for
    # The JSON holds one layer's pages (EasyDeL's view form); the view holds them as a stack of one.
    one_layer = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape[1:], t.dtype), stacked)
    pages = [_decode_pages(data[name], t, name) for name, t in zip(("key_pages", "value_pages"), one_layer)]
    k, v = (jax.tree.map(lambda a: jax.device_put(a[None], sharding(a.ndim + 1)), p) for p in pages)
    return cls(metadata=meta, layer_index=layer, group_key_pages=k, group_value_pages=v, layer=0, layout=layout,
               group=g)


def cache_view_dicts(data: object) -> list[object]:
    """The view dicts of a cache's dict form (each read by `view_from_dict`)."""
    data = _header(data, CACHE_SCHEMA, ("views",))
    views = data["views"]
    if not isinstance(views, list) or not views:
        raise SerializationError(f"'views' must be a non-empty list of view dicts, got {show(views)}")
    return views


__all__ = ["EasyDeLForms", "cache_to_dict", "cache_view_dicts", "view_from_dict", "view_to_dict"]
