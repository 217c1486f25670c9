"""What `easykv demo` can be asked to run: `DemoOptions`, and the values each of its fields allows.

The allowed values are declared once, here (`INT_RANGES`, `MESH_AXIS_SIZES`, `MODEL_NAMES`,
`DTYPES`, `demo_quantizer`): `DemoOptions` checks every field against them when it is built, and
the CLI's ``easykv demo`` flags read the same tables for their ranges, choices and defaults, so
``run_demo(DemoOptions(seed=-1))`` and ``easykv demo --seed -1`` refuse the same values and the
two cannot drift apart (tests/cli/test_numeric_flags.py compares them).

Fields valid one by one can still be a demo that never runs; `DemoOptions` refuses those
combinations too, naming both fields and the fix, before any work: pools that cannot hold one
sequence of `MAX_LEN` tokens (`pool_pages` is how the demo splits ``pages`` among its layer
groups, and the groups' own `LayerGroup.pages_per_sequence` what one sequence needs: the
metadata's rule), a step budget smaller than the sequences it runs, and one sequence slot for a
demo whose fork needs a second (the engine would wait for that slot forever).

Light on purpose: the CLI imports it to build its parser for every command, so nothing here
loads the demo's model (flax) or the checkpoint code (orbax).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from easykv.quantization import Quantizer, get_quantizer, scales_per_page
from easykv.spec.groups import AttentionKind, LayerGroup
from easykv.validation import integer, show

# The longest sequence the demo's cache holds: its longest prompt (system prompt and an opening,
# 128 byte tokens) and at most 128 generated tokens.
MAX_LEN = 256
LONGEST_PROMPT = 128  # tests/demo/test_demo_options.py checks it against the workload's prompts
_MOST_REQUESTS = 64  # a demo, not a load test: 64 requests still finish in minutes on CPU

# Every int field of DemoOptions and its inclusive range, the one declaration of each.
INT_RANGES: Mapping[str, tuple[int, int]] = MappingProxyType({
    "requests": (1, _MOST_REQUESTS),
    # Generation lengths are drawn from max(2, n // 2)..n; with the longest prompt they fit MAX_LEN.
    "max_new_tokens": (2, MAX_LEN - LONGEST_PROMPT),
    "page_size": (1, MAX_LEN),  # a page longer than the longest sequence holds nothing more
    # The sliding-window layers' pool is a quarter of ``pages``, so at least one page; every
    # sequence slot of MAX_LEN tokens at page size 1 is the most the demo can ever use.
    "pages": (4, _MOST_REQUESTS * MAX_LEN),
    # Prefill chunks are half the budget (at least one token); a step never holds more tokens
    # than every slot's whole sequence.
    "token_budget": (2, _MOST_REQUESTS * MAX_LEN),
    "max_seqs": (1, _MOST_REQUESTS),  # sequence slots: more than the requests are never used
    "seed": (0, 2**32 - 1),  # the seeds every numpy generator accepts (np.random.seed's range)
    "decode_steps": (1, 64),  # decode steps per device loop; more than a request generates only pads
})  # fmt: skip
# The size of each axis of ``mesh`` and ``restore_mesh``: named exactly (no -1 for "the rest");
# whether the devices are there is create_mesh's check when the demo starts.
MESH_AXIS_SIZES = (1, 1 << 20)
# Each demo model's sliding window, None for a model whose layers all attend fully: the hybrid one
# alternates sliding-window and full-attention layers. easykv.demo.run.MODELS builds the models'
# configurations with these windows (tests/demo/test_demo_options.py compares their layer groups).
HYBRID_WINDOW = 32
MODEL_WINDOWS: Mapping[str, int | None] = MappingProxyType({"hybrid": HYBRID_WINDOW, "uniform": None})
MODEL_NAMES = tuple(MODEL_WINDOWS)  # easykv.demo.run.MODELS holds their configurations
# The sliding-window layers' pool is this fraction of ``pages``: their sequences keep only the
# pages of their window.
SLIDING_POOL_SHARE = 4
DTYPES = ("float32", "bfloat16")  # the cache and model dtypes the demo's reference check is run with


@functools.cache
def model_groups(model: str) -> tuple[LayerGroup, ...]:
    """The kinds of layer group demo model ``model``'s cache has, one sizing unit of each (a full
    group, and for a model with a window a sliding group)."""
    window = MODEL_WINDOWS[model]
    full = LayerGroup(layers=(0,))
    if window is None:
        return (full,)
    return full, LayerGroup(layers=(1,), attention=AttentionKind.SLIDING, window=window)


def pool_pages(group: LayerGroup, pages: int) -> int:
    """The pages per layer of ``group``'s pool out of ``DemoOptions.pages``: all of them for full
    attention, a `SLIDING_POOL_SHARE` part for sliding-window layers (`easykv.demo.run` sizes the
    cache with it)."""
    return pages // SLIDING_POOL_SHARE if group.attention is AttentionKind.SLIDING else pages


def _short_pool(model: str, pages: int, page_size: int) -> tuple[LayerGroup, int, int] | None:
    """(group, its pool, the pages one sequence needs in it) for the first group of ``model``
    whose pool out of ``pages`` cannot hold one sequence of `MAX_LEN` tokens; None if all can."""
    for group in model_groups(model):
        need, pool = group.pages_per_sequence(MAX_LEN, page_size), pool_pages(group, pages)
        if pool < need:
            return group, pool, need
    return None


def _least(field: str, short: Any) -> int | None:
    """The least value of int field ``field`` (in its `INT_RANGES`) for which ``short(value)`` is None."""
    low, high = INT_RANGES[field]
    return next((value for value in range(low, high + 1) if short(value) is None), None)


def demo_quantizer(name: str) -> Quantizer:
    """The quantizer ``name`` the demo can check: its dense reference stores each token as the
    quantizer would alone, which a format with per-page scales (``int4-ch``) does not; ValueError."""
    quantizer = get_quantizer(name)
    if scales_per_page(quantizer):
        raise ValueError(f"the demo cannot check {quantizer.name}: its codes depend on how tokens arrive in a page "
                         "(a page's scales grow as it fills), which the demo's dense reference does not model; use "
                         "--quant int4-rot or int4-asym-rot for 4 bits "
                         "(tests/quantization/test_quantization_channel.py checks "
                         "int4-ch against a model of its pages)")
    return quantizer


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """What one `easykv.demo.run.run_demo` does; every field is checked when the options are built.

    Raises:
      TypeError: a field of the wrong type (a bool is not an int; a mesh is a dict of axis names
        to sizes; paths and names are str).
      ValueError: a value outside what the field allows (`INT_RANGES`, `MESH_AXIS_SIZES`,
        `MODEL_NAMES`, `DTYPES`, a quantizer `demo_quantizer` accepts, a path that names
        something); the message names the field, the value and what to use instead. Also fields
        valid one by one that cannot run together (pools that cannot hold one sequence,
        ``max_seqs`` above ``token_budget``, one sequence slot for a demo with a fork): the
        message names both fields and the fix.
    """

    requests: int = 12
    max_new_tokens: int = 24
    quant: str = "none"
    dtype: str = "float32"
    mesh: dict[str, int] = dataclasses.field(default_factory=lambda: {"tp": 8})
    restore_mesh: dict[str, int] = dataclasses.field(default_factory=lambda: {"dp": 2, "tp": 4})
    page_size: int = 8
    pages: int = 256
    token_budget: int = 64
    max_seqs: int = 8
    seed: int = 0
    checkpoint_dir: str | os.PathLike[str] | None = None  # None: a new temporary directory
    progress: bool = True
    model: str = "hybrid"  # or "uniform"
    decode_steps: int = 8  # decode steps per device loop (1: back to the host after every token)
    # "trained": the model's shipped weights; "random": seeded random ones; or the path of an
    # .npz that tools/train_demo_model.py wrote for this model.
    weights: str = "trained"
    # A shared prefix store's URL (file:///dir, redis://host:port/db, ...; None: no store): the cache gets a
    # host-memory tier and reads and writes prompt pages there (easykv.tiers.store.PrefixStore).
    store: str | None = None

    def __post_init__(self) -> None:
        # A frozen dataclass: the checked values (exact Python ints, copied meshes) replace the
        # caller's through object.__setattr__, so a numpy int or a dict mutated later cannot leak in.
        for name, (low, high) in INT_RANGES.items():
            object.__setattr__(self, name, _int_field(name, getattr(self, name), low, high))
        for name in ("mesh", "restore_mesh"):
            object.__setattr__(self, name, _mesh_field(name, getattr(self, name)))
        _choice_field("model", self.model, MODEL_NAMES)
        _choice_field("dtype", self.dtype, DTYPES)
        _quant_field(self.quant)
        if self.checkpoint_dir is not None:
            _path_field("checkpoint_dir", self.checkpoint_dir, "a directory, or None for a temporary one")
        _path_field("weights", self.weights, "'trained', 'random' or the path of an .npz", kinds=(str,))
        if self.store is not None:
            _store_field(self.store)
        if not isinstance(self.progress, bool):
            raise TypeError(f"DemoOptions.progress must be True or False, got {show(self.progress)} "
                            f"of type {type(self.progress).__name__}")
        self._check_together()

    def _check_together(self) -> None:
        """Refuse fields valid one by one that together make a demo that cannot run (see the module doc)."""
        short = _short_pool(self.model, self.pages, self.page_size)
        if short is not None:
            group, pool, need = short
            # Both fixes, each the least change of one field (a larger page needs fewer pages).
            fixes = [f"{name} >= {least}" for name, least in (
                ("pages", _least("pages", lambda p: _short_pool(self.model, p, self.page_size))),
                ("page_size", _least("page_size", lambda s: _short_pool(self.model, self.pages, s))))
                if least is not None]  # fmt: skip
            layers = ("full-attention" if group.attention is AttentionKind.FULL
                      else f"sliding-window (window {group.window})")  # fmt: skip
            share = f"a 1/{SLIDING_POOL_SHARE} share of pages" if group.attention is AttentionKind.SLIDING else "pages"
            raise ValueError(f"DemoOptions.pages={self.pages} with DemoOptions.page_size={self.page_size} cannot hold "
                             f"one sequence of the demo's {MAX_LEN} tokens: the {self.model} model's {layers} layers "
                             f"need {need} pages of {self.page_size} token{'s' * (self.page_size > 1)} per sequence "
                             f"but their pool holds {pool} ({share}); use {' or '.join(fixes)}")
        if self.max_seqs > self.token_budget:
            raise ValueError(f"DemoOptions.max_seqs={self.max_seqs} exceeds DemoOptions.token_budget="
                             f"{self.token_budget}: a step decodes one token of every running sequence within its "
                             f"budget; use token_budget >= {self.max_seqs} or max_seqs <= {self.token_budget}")
        if self.requests > 1 and self.max_seqs < 2:
            raise ValueError(f"DemoOptions.max_seqs={self.max_seqs} with DemoOptions.requests={self.requests}: the "
                             "demo's last request is a parallel sample (a fork) of its first and runs beside it, in a "
                             "second sequence slot, which the engine would wait for forever; use max_seqs >= 2 (or "
                             "requests=1)")


def _store_field(value: Any) -> None:
    """TypeError unless ``value`` is a str, ValueError unless it is a store URL (`parse_store_url`'s message)."""
    from easykv.tiers.store.url import parse_store_url

    if not isinstance(value, str):
        raise TypeError(f"DemoOptions.store must be a store URL (str) or None, got {show(value)} of type "
                        f"{type(value).__name__}")
    try:
        parse_store_url(value)
    except ValueError as err:
        raise ValueError(f"DemoOptions.store: {err}") from None


def _int_field(name: str, value: Any, low: int, high: int) -> int:
    """``value`` as an exact int in ``low..high``: TypeError for a non-int (a bool, a float, a
    str), ValueError for an int outside the range, each naming ``DemoOptions.<name>``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"DemoOptions.{name} must be an int in {low}..{high}, got {show(value)} "
                        f"of type {type(value).__name__}")
    return integer(f"DemoOptions.{name}", value, lo=low, hi=high)


def _mesh_field(name: str, value: Any) -> dict[str, int]:
    """A copy of mesh ``value``: at least one axis, each a non-empty str name with an int size in
    `MESH_AXIS_SIZES`."""
    if not isinstance(value, Mapping):
        raise TypeError(f"DemoOptions.{name} must be a dict of mesh axis names to sizes, e.g. {{'tp': 8}}, "
                        f"got {show(value)} of type {type(value).__name__}")
    if not value:
        raise ValueError(f"DemoOptions.{name} = {{}} names no mesh axis; give at least one, e.g. {{'tp': 8}}")
    axes = {}
    for axis, size in value.items():
        if not isinstance(axis, str):
            raise TypeError(f"DemoOptions.{name} has axis name {show(axis)} of type {type(axis).__name__}; "
                            "name each axis with a str, e.g. {'tp': 8}")
        if not axis:
            raise ValueError(f"DemoOptions.{name} = {show(value)} has an empty axis name; name each axis, e.g. 'tp'")
        axes[axis] = _int_field(f"{name}[{axis!r}]", size, *MESH_AXIS_SIZES)
    return axes


def _choice_field(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str):
        raise TypeError(f"DemoOptions.{name} must be a str, one of {', '.join(choices)}; got {show(value)} "
                        f"of type {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"DemoOptions.{name} = {show(value)} is not one of {', '.join(choices)}")


def _quant_field(value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"DemoOptions.quant must be a quantizer's name (a str, e.g. 'int8'), got {show(value)} "
                        f"of type {type(value).__name__}")
    try:
        demo_quantizer(value)
    except ValueError as err:  # the quantizer's own words, with the field they came from
        raise ValueError(f"DemoOptions.quant = {show(value)}: {err}") from None


def _path_field(name: str, value: Any, meaning: str, *, kinds: tuple[type, ...] = (str, os.PathLike)) -> None:
    """A path (or a word) that names something: not empty, no NUL byte (which no file name holds)."""
    if not isinstance(value, kinds):
        raise TypeError(f"DemoOptions.{name} must be {meaning} ({' or '.join(k.__name__ for k in kinds)}), "
                        f"got {show(value)} of type {type(value).__name__}")
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str):
        raise TypeError(f"DemoOptions.{name} must be {meaning} as a str path, got the bytes path {show(text)}")
    if not text or "\x00" in text:
        raise ValueError(f"DemoOptions.{name} = {show(value)} is empty or holds a NUL byte; use {meaning}")
