"""Layer groups: the layers of a model that share one page geometry and one attention kind.

A cache is a set of groups. Each group has its own pool of pages (its own page ids) because its
pages have their own size and its sequences keep their own number of them:

- ``attention="full"``: a sequence keeps every page it wrote.
- ``attention="sliding", window=W``: a query at position p sees keys p - W + 1 .. p (Mistral,
  Gemma 2/3, gpt-oss); pages wholly before the window of a sequence's next query are dead.
- ``attention="chunked", window=C``: a query sees only the keys of its own chunk
  ``[k*C, (k+1)*C)`` (Llama 4's local layers). C must be a multiple of the page size, so no page
  straddles two chunks and a sequence holds exactly the pages of its current chunk.

Each kind's rule (what a query reads, so which pages leave) is written once, in
`easykv.spec.windows`; a group's is ``LayerGroup.rule``.

Geometry: ``num_kv_heads`` heads of ``key_head_dim`` keys and ``value_head_dim`` values, or, with
``latent=True``, one vector of ``key_head_dim`` per token and head and no value pages (DeepSeek's
MLA: one head of 512 + 64; attention reads the first ``value_head_dim`` dims as the value).

Format: ``dtype`` and ``quantization`` (a quantizer name) of the group's pages; None takes the
cache's (``PagedAttentionCacheMetaData.dtype`` / ``quantization``), and a checked metadata keeps
None wherever a group's format equals the cache's, so changing the cache's format changes every
group that did not choose its own. E.g. int8 pages for the sliding layers of a bf16 model.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Any, ClassVar, cast, overload

import numpy as np

from easykv.quantization import get_quantizer
from easykv.spec.dtypes import canonical_dtype
from easykv.spec.serialization import Serializable
from easykv.spec.windows import AttentionRule, ChunkedRule, FullAttentionRule, SlidingWindowRule
from easykv.validation import INT32_MAX, boolean, integer, positive_int, show


def known_size(value: int | None) -> int:
    """``value``, a size a checked group always has, typed as the int it is there.

    A `LayerGroup` leaves ``num_kv_heads``, the head dims and ``num_pages`` open (None) until a
    metadata fills and sizes it, and a windowed group's ``window`` is None only for full
    attention; so the fields are ``int | None``, but every group of a checked
    `PagedAttentionCacheMetaData` (``metadata.groups``) has them all. Nothing is checked here:
    the metadata's checks did that when it was built."""
    # cast: "filled and sized" is an invariant of a checked metadata that the field types cannot carry.
    return cast(int, value)


class AttentionKind(enum.StrEnum):
    """What a layer group's queries read, and so which pages its sequences keep (module doc).
    A ``str``: it equals its name (``AttentionKind.SLIDING == "sliding"``) and is written as it in
    JSON, so metadata written before the type existed reads back unchanged."""

    FULL = "full"
    SLIDING = "sliding"
    CHUNKED = "chunked"

    def __repr__(self) -> str:
        # As the name it equals: messages, `show` and a LayerGroup's repr read as they did before.
        return repr(self.value)

    @property
    def windowed(self) -> bool:
        """Whether sequences release the pages that left the window (sliding or chunked)."""
        return self is not AttentionKind.FULL

    def rule(self, window: int | None) -> AttentionRule:
        """The window rule of this kind (`easykv.spec.windows`): which keys a query at position p
        reads, so which pages a sequence may release. The one map from a kind to its rule.

        Args:
          window: the sliding window or chunk size, in tokens (None for full attention).

        Raises:
          ValueError: ``window`` is given for full attention, or is no positive int for a
            sliding or chunked one.
        """
        if window is None or isinstance(window, (int, np.integer)):
            return _cached_rule(self, window)  # a step's proof asks on every build: one rule per kind and window
        return _new_rule(self, window)  # no int (nor hashable, maybe): the rule's check refuses it


def _new_rule(kind: AttentionKind, window: int | None) -> AttentionRule:
    """`AttentionKind.rule`, uncached."""
    if kind is AttentionKind.SLIDING:
        return SlidingWindowRule(cast(int, window))  # the rule checks it is a positive int
    if kind is AttentionKind.CHUNKED:
        return ChunkedRule(cast(int, window))
    if window is not None:
        raise ValueError(f"full attention takes no window, got window={show(window)}; use attention='sliding' "
                         "or 'chunked'")
    return FullAttentionRule()


# typed: a window of True is refused, never served as the cached rule of window 1.
_cached_rule = functools.lru_cache(maxsize=256, typed=True)(_new_rule)


ATTENTION_KINDS: tuple[str, ...] = tuple(kind.value for kind in AttentionKind)


@dataclasses.dataclass(frozen=True)
class LayerGroup(Serializable):
    """One group of layers (see the module doc).

    Attributes:
      layers: the model layers of the group, distinct ints ``>= 0`` (kept sorted).
      attention: ``"full"`` (default), ``"sliding"`` or ``"chunked"`` (an `AttentionKind`).
      window: a sliding group's window or a chunked group's chunk size, in tokens (None for
        full attention).
      num_kv_heads: kv heads per layer (None: the cache's ``num_kv_heads``).
      key_head_dim: head dim of the keys, or of the latent (None: the cache's
        ``kv_head_dim_size``).
      value_head_dim: head dim of the values (None: ``key_head_dim``); of a latent group, the
        leading dims of the latent read as the value (at most ``key_head_dim``).
      latent: one vector per token and head, no value pages (DeepSeek's MLA).
      num_pages: the group's pool (pages per layer, over all data-parallel replicas); ``None``
        until ``PagedAttentionCacheMetaData.create`` sizes it.
      kv_head_mesh_axes: mesh axes this group's heads are split over (None: left to ``create``
        / ``init_cache``, as the cache-wide fields).
      kv_head_shards: slices of this group's heads (given with ``kv_head_mesh_axes``, or neither).
      dtype: the group's own page dtype (None: the cache's).
      quantization: the group's own quantizer name (None: the cache's).
    """

    SCHEMA: ClassVar[str] = "easykv.LayerGroup"
    SCHEMA_VERSION: ClassVar[int] = 2  # 2: dtype and quantization

    layers: tuple[int, ...] = dataclasses.field(metadata={"codec": "tuple"})
    attention: AttentionKind = AttentionKind.FULL  # a name ("sliding") is taken and converted
    window: int | None = None
    num_kv_heads: int | None = None
    key_head_dim: int | None = None
    value_head_dim: int | None = None
    latent: bool = False
    num_pages: int | None = None
    kv_head_mesh_axes: tuple[str, ...] | None = dataclasses.field(default=None, metadata={"codec": "tuple"})
    kv_head_shards: int | None = None
    dtype: np.dtype | None = dataclasses.field(default=None, metadata={"codec": "dtype", "since": 2})
    quantization: str | None = dataclasses.field(default=None, metadata={"since": 2})

    def __post_init__(self) -> None:
        raw = self.layers
        if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
            raise ValueError(f"layers must be a sequence of layer indices, got {show(raw)}")
        layers = tuple(integer("a layer index", i, lo=0) for i in raw)
        if not layers:
            raise ValueError("a layer group needs at least one layer; drop the empty group")
        if len(set(layers)) != len(layers):
            twice = sorted({i for i in layers if layers.count(i) > 1})
            raise ValueError(f"layers {twice} appear twice in one group's layers {show(raw)}")
        object.__setattr__(self, "layers", tuple(sorted(layers)))
        if not isinstance(self.attention, str) or self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {show(self.attention)}")
        kind = AttentionKind(self.attention)
        object.__setattr__(self, "attention", kind)
        if not kind.windowed:
            if self.window is not None:
                raise ValueError(f"a full-attention group takes no window, got window={show(self.window)}; "
                                 "use attention='sliding' or 'chunked'")
        else:
            name = "window" if kind is AttentionKind.SLIDING else "window (the chunk size)"
            object.__setattr__(self, "window", positive_int(name, self.window,
                                                            hint=f"a {kind.value} group needs its size in tokens"))
        for name in ("num_kv_heads", "key_head_dim", "value_head_dim", "num_pages", "kv_head_shards"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, positive_int(f"{name} of layers {self.span}", value))
        object.__setattr__(self, "latent", boolean("latent", self.latent))
        if self.latent and self.value_head_dim is not None and self.key_head_dim is not None \
                and self.value_head_dim > self.key_head_dim:
            raise ValueError(
                f"a latent group reads the first value_head_dim={self.value_head_dim} dims of its "
                f"key_head_dim={self.key_head_dim}-wide latent as the value; value_head_dim must be <= key_head_dim")
        if (self.kv_head_mesh_axes is None) != (self.kv_head_shards is None):
            raise ValueError(f"kv_head_mesh_axes={show(self.kv_head_mesh_axes)} and kv_head_shards="
                             f"{show(self.kv_head_shards)} of layers {self.span}: give both or neither")
        if self.kv_head_mesh_axes is not None:
            axes = self.kv_head_mesh_axes
            axes = (axes,) if isinstance(axes, str) else tuple(axes) if isinstance(axes, (tuple, list)) else None
            if axes is None or not all(isinstance(a, str) and a for a in axes):
                raise ValueError(f"kv_head_mesh_axes must be a tuple of mesh axis names, got "
                                 f"{show(self.kv_head_mesh_axes)}")
            object.__setattr__(self, "kv_head_mesh_axes", axes)
        if self.dtype is not None:
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.quantization is not None:
            quantizer = get_quantizer(self.quantization)
            # cast: the set difference drops None, which mypy does not follow.
            for dim in cast("set[int]", {self.key_head_dim, self.value_head_dim if self.has_values else None} - {None}):
                quantizer.validate(dim, np.dtype("bfloat16") if self.dtype is None else self.dtype)
            object.__setattr__(self, "quantization", quantizer.name)

    @property
    def span(self) -> str:
        """The layers, written short for messages (``0..5`` or ``[0, 6, 12]``)."""
        ls = self.layers
        if len(ls) > 1 and ls == tuple(range(ls[0], ls[-1] + 1)):
            return f"{ls[0]}..{ls[-1]}"
        return show(list(ls))

    @property
    def format_note(self) -> str:
        """The group's own format for messages (``"; own format int8 / float32"``), or ""."""
        if self.dtype is None and self.quantization is None:
            return ""
        parts = [p for p in (self.quantization, None if self.dtype is None else self.dtype.name) if p]
        return "; own format " + " / ".join(parts)

    @property
    def num_layers(self) -> int:
        """How many layers the group holds."""
        return len(self.layers)

    @property
    def has_values(self) -> bool:
        """Whether the group stores value pages (False for a latent cache)."""
        return not self.latent

    def filled(self, *, num_kv_heads: int, head_dim: int) -> LayerGroup:
        """This group with the cache-wide head count and head dim where it leaves them open.

        Args:
          num_kv_heads: the cache's kv heads per layer.
          head_dim: the cache's head dim, for ``key_head_dim`` (and ``value_head_dim``, which
            otherwise takes the key head dim).
        """
        k = self.key_head_dim if self.key_head_dim is not None else head_dim
        return dataclasses.replace(
            self, num_kv_heads=self.num_kv_heads if self.num_kv_heads is not None else num_kv_heads,
            key_head_dim=k, value_head_dim=self.value_head_dim if self.value_head_dim is not None else k)

    def own_format(self, *, dtype: np.dtype | None, quantization: str) -> LayerGroup:
        """This group with None for a dtype or quantizer equal to the cache's: the one form of
        "the cache's format".

        Args:
          dtype: the cache's dtype (None while it is left to ``init_cache``).
          quantization: the cache's quantizer name.
        """
        return dataclasses.replace(self, dtype=None if self.dtype == dtype else self.dtype,
                                   quantization=None if self.quantization == quantization else self.quantization)

    @property
    def rule(self) -> AttentionRule:
        """The group's window rule (`AttentionKind.rule` of its kind and window): what its
        queries read, so which pages its sequences release."""
        return self.attention.rule(self.window)

    def pages_per_sequence(self, max_tokens: int, page_size: int) -> int:
        """Pages one sequence of up to ``max_tokens`` keeps at once in one layer of this group
        once the pages that left its window are released (the sizing unit of the group;
        `AttentionRule.pages_kept`).

        Args:
          max_tokens: the sequence's most tokens.
          page_size: tokens per page.
        """
        return self.rule.pages_kept(math.ceil(max_tokens / page_size), page_size)

    @overload
    def first_needed_position(self, next_position: int) -> int: ...
    @overload
    def first_needed_position(self, next_position: np.ndarray) -> np.ndarray: ...

    def first_needed_position(self, next_position: int | np.ndarray) -> int | np.ndarray:
        """The first token position a query at ``next_position`` or later can still read
        (`AttentionRule.first_needed_position`).

        Args:
          next_position: an int position, or a numpy array of positions (then elementwise).
        """
        return self.rule.first_needed_position(next_position)

    @property
    def windowed(self) -> bool:
        """Whether the group's sequences release pages that left its window (sliding, chunked)."""
        return self.attention.windowed


def check_groups(groups: tuple[LayerGroup, ...], *, num_layers: int, page_size: int) -> None:
    """Every layer 0..num_layers-1 in exactly one group; chunks aligned to pages; sizes bounded."""
    owner: dict[int, int] = {}
    for g, group in enumerate(groups):
        if not isinstance(group, LayerGroup):
            raise ValueError(f"layer_groups[{g}] must be a LayerGroup, got {type(group).__name__}")
        for layer in group.layers:
            if layer >= num_layers:
                raise ValueError(f"layer_groups[{g}] names layer {layer}, but the model has num_hidden_layers="
                                 f"{num_layers} (layers 0..{num_layers - 1})")
            if layer in owner:
                raise ValueError(f"layer {layer} is in layer_groups[{owner[layer]}] and layer_groups[{g}]; "
                                 "a layer belongs to exactly one group")
            owner[layer] = g
        if group.attention is AttentionKind.CHUNKED and known_size(group.window) % page_size:
            raise ValueError(
                f"layer_groups[{g}] has chunk size {group.window}, not a multiple of page_size={page_size}: a page "
                "would straddle two chunks and could be neither kept nor freed whole; use a page size that divides it")
        if group.num_pages is not None and group.num_pages * page_size > INT32_MAX:
            raise ValueError(f"layer_groups[{g}]: num_pages * page_size = {group.num_pages * page_size} slots "
                             "exceeds int32 slot ids; use fewer pages")
    missing = [i for i in range(num_layers) if i not in owner]
    if missing:
        raise ValueError(f"layers {show(missing)} belong to no group; every layer 0..{num_layers - 1} needs one "
                         "(add them to a group, e.g. LayerGroup(layers=..., attention='full'))")


def group_pattern(num_layers: int, pattern: Any, **kinds: dict[str, Any]) -> tuple[LayerGroup, ...]:
    """Groups from a repeating per-layer pattern: ``group_pattern(62, "SSSSSF", S=dict(attention=
    "sliding", window=1024), F=dict(attention="full"))`` puts layer i in the group of letter
    ``pattern[i % len(pattern)]`` (groups in order of first appearance).

    Args:
      num_layers: the model's layers, a positive int.
      pattern: a non-empty string, one group letter per layer, repeated over the layers.
      **kinds: for each letter of ``pattern``, the `LayerGroup` keywords of its group (all but
        ``layers``); a letter with none is a ValueError.

    Returns:
      One `LayerGroup` per letter that occurs in the first ``num_layers`` layers.
    """
    num_layers = positive_int("num_layers", num_layers)
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern must be a non-empty string of group letters, got {show(pattern)}")
    unknown = sorted(set(pattern) - set(kinds))
    if unknown:
        raise ValueError(f"pattern letters {unknown} have no group; pass them as keywords, e.g. "
                         f"{unknown[0]}=dict(attention='full')")
    order = list(dict.fromkeys(pattern[i % len(pattern)] for i in range(num_layers)))
    return tuple(LayerGroup(layers=tuple(i for i in range(num_layers) if pattern[i % len(pattern)] == letter),
                            **kinds[letter]) for letter in order)


__all__ = ["ATTENTION_KINDS", "AttentionKind", "LayerGroup", "check_groups", "group_pattern", "known_size"]
