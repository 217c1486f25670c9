"""`easykv` command line: `plan` prints how a cache would be laid out and sized; `demo` runs a
small model through the cache; `inspect` describes and verifies a checkpoint; `store stats` and
`store gc` show and trim a shared prefix store.

Bad flags give one line on stderr and exit code 2. Every numeric flag is parsed by one
`NumberFlag` (an argparse ``type=``) that knows its range, so a negative, zero or huge value is
refused naming the flag before any command runs. The demo's flags take their ranges, choices and
defaults from `easykv.demo.options`, the table `DemoOptions` checks its fields against.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from easykv.demo.options import DTYPES, INT_RANGES, MESH_AXIS_SIZES, MODEL_NAMES, DemoOptions
from easykv.spec.groups import ATTENTION_KINDS, AttentionKind
from easykv.spec.presets import PRESETS
from easykv.validation import INT32_MAX

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}  # fmt: skip


class UsageError(Exception):
    """A flag the user must fix; printed as one line, exit code 2. ``prog``: the (sub)command
    whose parser refused it, when argparse did."""

    def __init__(self, message: str, *, prog: str | None = None):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message, prog=self.prog)


_MAX_AXIS = 1 << 20  # devices along one mesh axis: far beyond any pod
_MAX_CPU_DEVICES = 512  # simulated CPU devices: each costs the process memory and start-up time


class NumberFlag:
    """An argparse ``type=`` for a numeric flag: an ``int`` (or ``float``) in ``low..high`` (a
    float's ``low`` excluded when ``low_open``). argparse names the flag in the refusal
    (``argument --seed: -1 is out of range; use 0..4294967295``), exit code 2."""

    def __init__(self, kind: type[int] | type[float], low: float, high: float, *, low_open: bool = False):
        self.kind, self.low, self.high, self.low_open = kind, low, high, low_open

    @property
    def range(self) -> str:
        return f"({self.low:g}, {self.high:g}]" if self.low_open else f"{self.low}..{self.high}"

    def __call__(self, text: str) -> int | float:
        out_of_range = argparse.ArgumentTypeError(f"{text[:40]} is out of range; use {self.range}")
        try:
            value = self.kind(text)
        except ValueError:
            if text.strip().lstrip("+-").isdigit():  # an integer of more digits than Python converts
                raise out_of_range from None
            name = "an integer" if self.kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not {name}; use {self.range}") from None
        too_low = value <= self.low if self.low_open else value < self.low
        if too_low or not value <= self.high:  # "not <=": nan is out of every range
            raise out_of_range
        return value


_COUNT = NumberFlag(int, 1, INT32_MAX)  # layers, heads, tokens, sequences: what the metadata accepts
_FRACTION = NumberFlag(float, 0.0, 1.0, low_open=True)


def parse_bytes(text: str, flag: str = "--memory") -> int:
    """'16GiB', '1.5G', '800MB' or a plain number of bytes (``flag`` names the option in errors)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"{flag} {text!r} is not a size; write e.g. 16GiB, 800MB or 1073741824")
    number = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not 0 < number < 2**63:  # also a number of 400 digits, which float reads as inf
        raise UsageError(f"{flag} {text!r} must be a positive size below 8 EiB")
    return int(number)


def parse_mesh(text: str) -> dict[str, int]:
    """'dp=2,tp=4' -> {'dp': 2, 'tp': 4} (order kept)."""
    axes: dict[str, int] = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(-?[0-9]+)\s*", part)
        if not m:
            raise UsageError(f"--mesh {text!r}: {part!r} is not NAME=SIZE; write e.g. dp=1,tp=8")
        if m.group(1) in axes:
            raise UsageError(f"--mesh {text!r} names axis {m.group(1)!r} twice")
        size = int(m.group(2))
        if abs(size) > _MAX_AXIS:
            raise UsageError(f"--mesh {text!r}: axis {m.group(1)} of size {size}; "
                             f"a mesh axis holds at most {_MAX_AXIS} devices")
        axes[m.group(1)] = size
    return axes


def _format_bytes(n: float) -> str:
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.2f} {unit}"
    return f"{n / 1024:.2f} TiB"


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="easykv", description="A sharded, paged KV cache for JAX.")
    from easykv import __version__

    parser.add_argument("--version", action="version", version=f"easykv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser("plan", help="print how a cache is sharded and sized")
    plan.add_argument("--preset", choices=sorted(PRESETS), help="take layers / kv heads / head dim from a model")
    plan.add_argument("--layers", type=_COUNT, help="num_hidden_layers")
    plan.add_argument("--kv-heads", type=_COUNT, help="num_kv_heads")
    plan.add_argument("--head-dim", type=_COUNT, help="kv_head_dim_size")
    plan.add_argument("--max-seq", type=_COUNT, default=8192, help="longest sequence in tokens (max_sequences)")
    plan.add_argument("--uniform", action="store_true",
                      help="plan a grouped preset as if every layer were full attention")
    plan.add_argument("--page-size", type=_COUNT, default=16, help="tokens per page (default 16)")
    plan.add_argument("--batch-size", type=_COUNT, default=32, help="sequences one step may hold (default 32)")
    plan.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 or float16")
    plan.add_argument("--quant", default="none", help="quantizer name (see easykv.available_quantizers())")
    plan.add_argument("--group-quant", action="append", default=[], metavar="KIND=NAME",
                      help="a quantizer of their own for the layers of one attention kind (full, sliding, "
                           "chunked) of a patterned preset, e.g. full=int8; repeatable")
    plan.add_argument("--mesh", default=None, help="mesh axes, e.g. dp=1,tp=8 (default: tp=<local devices>)")
    plan.add_argument("--kv-head-axis", default="tp", help="mesh axis (or a,b) for kv heads; 'none' to replicate")
    plan.add_argument("--page-axis", default="none", help="mesh axis (or a,b) splitting the page pool, e.g. dp")
    plan.add_argument("--utilization", type=_FRACTION, default=0.9, help="hbm_utilization in (0, 1]")
    plan.add_argument("--memory", default=None,
                      help="per-device bytes for the cache (e.g. 16GiB); "
                           "plans any mesh without its devices")  # fmt: skip
    plan.add_argument("--cpu-devices", type=NumberFlag(int, 1, _MAX_CPU_DEVICES), default=None,
                      help="simulate this many CPU devices (for meshes larger than this machine)")  # fmt: skip
    plan.add_argument("--host-memory", default=None,
                      help="host bytes per host for a host-memory tier (e.g. 64GiB): "
                           "evicted prefixes, swapped sequences")
    demo = sub.add_parser("demo", help="a small model generating through the cache, checked against a dense cache")
    defaults = DemoOptions()
    _demo_number(demo, defaults, "--requests", "number of requests (one of them forked)")
    _demo_number(demo, defaults, "--max-new-tokens", "tokens to generate per request")
    demo.add_argument("--model", default=defaults.model, choices=MODEL_NAMES,
                      help="hybrid: sliding-window and full-attention layers, scanned (two layer groups); "
                           "uniform: full attention, unrolled")
    demo.add_argument("--quant", default=defaults.quant, help="quantizer name (see easykv.available_quantizers())")
    demo.add_argument("--dtype", default=defaults.dtype, choices=DTYPES, help="cache and model dtype")
    demo.add_argument("--mesh", default=None, help="mesh to serve on (default tp=8 on 8 simulated CPU devices)")
    demo.add_argument("--restore-mesh", default=None,
                      help="mesh to restore the midway checkpoint onto (default dp=2,tp=4)")
    demo.add_argument("--cpu-devices", type=NumberFlag(int, 1, 64), default=8,
                      help="simulated CPU devices when running on a CPU, 1..64")
    demo.add_argument("--checkpoint-dir", default=None, help="where the midway checkpoint goes (default: a temp dir)")
    _demo_number(demo, defaults, "--decode-steps",
                 "decode steps per device loop, sampling on the device (1: one host round trip per token)")
    demo.add_argument("--weights", default=defaults.weights,
                      help="trained: the model's weights shipped with easykv (trained on its docs: the sample "
                           "reads as English); random: seeded random weights; or the path of an .npz written by "
                           "tools/train_demo_model.py")
    _demo_number(demo, defaults, "--seed", "seed of the requests' generation lengths")
    demo.add_argument("--store", default=None, help="a shared prefix store's URL (file:///dir, redis://host:port/0): "
                      "prompt pages are read from it and written to it; a second run serves the shared opening there")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    insp = sub.add_parser("inspect", help="describe a checkpoint directory and verify its data")
    insp.add_argument("directory")
    insp.add_argument("--no-verify", action="store_true", help="skip re-reading the arrays")
    _add_store_parser(sub)
    return parser


def _add_store_parser(sub: Any) -> None:
    store = sub.add_parser("store", help="what a shared prefix store holds; collect its oldest entries")
    actions = store.add_subparsers(dest="store_command", required=True, parser_class=_Parser)
    stats = actions.add_parser("stats", help="entries, bytes and age of the values under a key prefix")
    stats.add_argument("url", help="file:///abs/dir, memory://name, gs://..., s3://..., redis://host:port/db")
    stats.add_argument("--prefix", default=None, help="count only keys starting with this, inside the store's key "
                       "scheme easykv-v1/ (default: every easykv key)")
    stats.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    gc = actions.add_parser("gc", help="delete the oldest values until at most --max-bytes are left (file:// stores)")
    gc.add_argument("url", help="file:///abs/dir (Redis / Valkey evict by themselves: set maxmemory-policy)")
    gc.add_argument("--max-bytes", type=_max_bytes, required=True,
                    help="bytes to keep, e.g. 500GiB, 800MB or 1073741824 (0: delete everything)")
    gc.add_argument("--prefix", default=None, help="collect only keys starting with this, inside the store's key "
                    "scheme easykv-v1/ (default: every easykv key)")


def _max_bytes(text: str) -> int:
    """An argparse ``type=``: a size as `parse_bytes` reads it, or 0; argparse names the flag."""
    if text.strip() == "0":
        return 0
    try:
        return parse_bytes(text, "--max-bytes")
    except UsageError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a size; write e.g. 500GiB, 800MB, 1073741824 "
                                         "or 0") from None


def _demo_number(demo: argparse.ArgumentParser, defaults: DemoOptions, flag: str, text: str) -> None:
    """Add ``flag``, the flag of the `DemoOptions` field of its name, with that field's range
    (`INT_RANGES`) and default: the flag and ``run_demo(DemoOptions(...))`` refuse the same values."""
    field = flag.removeprefix("--").replace("-", "_")
    flag_type = NumberFlag(int, *INT_RANGES[field])
    demo.add_argument(flag, type=flag_type, default=getattr(defaults, field), help=f"{text}, {flag_type.range}")


def cmd_inspect(args: argparse.Namespace) -> int:
    """Exit 0: every step intact; 1: damage (or a step this easykv cannot read) was found and
    is described in the report; 2: not a checkpoint directory. Never a traceback."""
    from easykv.checkpoint.inspect import inspect_report
    from easykv.errors import CheckpointError, NotACheckpointError

    try:
        report, intact = inspect_report(args.directory, verify=not args.no_verify)
    except NotACheckpointError as err:
        raise UsageError(str(err)) from err
    except (CheckpointError, OSError) as err:  # the directory itself cannot be listed or read
        print(f"easykv inspect: {args.directory}: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    print(report)
    return 0 if intact else 1


def cmd_store(args: argparse.Namespace) -> int:
    """``store stats`` / ``store gc``. Exit 0 done; 1 the store did not answer (one line on
    stderr); 2 a bad URL, prefix or size, or gc on a store that evicts by itself."""
    import json
    import time

    from easykv.errors import StoreUnavailableError
    from easykv.tiers.store.namespace import KEY_SCHEME
    from easykv.tiers.store.url import open_backend

    # Only easykv's own keys: a prefix outside the scheme (or "") would reach whatever else a
    # directory or a database holds.
    scheme = f"{KEY_SCHEME}/"
    prefix = scheme if args.prefix is None else args.prefix
    if not prefix.startswith(scheme):
        raise UsageError(f"--prefix {prefix[:80]!r} is outside the store's keys: every easykv key starts with "
                         f"{scheme!r}; write e.g. --prefix {scheme}<model slug>/ or leave --prefix out")

    def when(seconds: float | None) -> str:
        return "-" if seconds is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))

    try:
        backend = open_backend(args.url, create=False)  # a mistyped path is an error, never a new directory
        try:
            if args.store_command == "gc":
                result = backend.gc(args.max_bytes, prefix=prefix)
                foreign = result.foreign_entries
                rows = [("removed", f"{result.removed_entries} entries, {_format_bytes(result.removed_bytes)}"),
                        ("kept", f"{result.kept_entries} entries, {_format_bytes(result.kept_bytes)} "
                                 f"(at most {_format_bytes(args.max_bytes)} asked)")]
            else:
                stats = backend.stats(prefix=prefix)
                foreign = stats.foreign_entries
                if args.json:
                    print(json.dumps({"url": backend.url, "prefix": prefix, **dataclasses.asdict(stats)}))
                    return 0
                rows = [("entries", f"{stats.entries:,}"), ("bytes", f"{_format_bytes(stats.bytes)} ({stats.bytes:,})"),
                        ("oldest", when(stats.oldest)), ("newest", when(stats.newest))]
            if foreign:
                rows.append(("left alone", f"{foreign:,} entries that are no easykv value (other files, links)"))
        finally:
            backend.close()
    except StoreUnavailableError as err:
        print(f"easykv store {args.store_command}: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    width = max(len(key) for key, _ in rows)
    print(f"easykv store {args.store_command} {backend.url}" + (f" (prefix {args.prefix!r})" if args.prefix else ""))
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    from easykv.demo.options import demo_quantizer
    from easykv.demo.run import check_weights, run_demo

    demo_quantizer(args.quant)  # a bad name fails here, before any device work
    check_weights(args.model, args.weights)  # so does a weights file that does not fit the model

    n = jax.device_count()
    mesh = parse_mesh(args.mesh) if args.mesh else {"tp": n}
    restore = (parse_mesh(args.restore_mesh) if args.restore_mesh
               else {"dp": 2, "tp": n // 2} if n % 2 == 0 else {"tp": n})
    low, high = MESH_AXIS_SIZES
    for flag, axes in (("--mesh", mesh), ("--restore-mesh", restore)):  # checked before half a demo runs
        size = math.prod(axes.values())
        if any(not low <= v <= high for v in axes.values()) or size != n:
            raise UsageError(f"{flag} {axes} needs {size} devices and axis sizes in {low}..{high}; "
                             f"the axes must multiply to this process's {n} devices")
    options = DemoOptions(requests=args.requests, max_new_tokens=args.max_new_tokens, quant=args.quant,
                          dtype=args.dtype, mesh=mesh, restore_mesh=restore, seed=args.seed,
                          checkpoint_dir=args.checkpoint_dir,
                          progress=not args.no_progress, model=args.model, decode_steps=args.decode_steps,
                          weights=args.weights, store=args.store)  # fmt: skip
    from easykv.errors import CheckpointError

    try:
        report = run_demo(options)
    except CheckpointError as err:  # e.g. --checkpoint-dir names a file or an unwritable place
        print(f"easykv demo: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    return 0 if report.matched else 1


def _axes_flag(text: str) -> str | tuple[str, ...] | None:
    if text.lower() == "none":
        return None
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    return parts[0] if len(parts) == 1 else parts


def _model_dims(args: argparse.Namespace) -> tuple[int, int, int, str, Any]:
    """(layers, kv heads, head dim, model name, layer groups or None)."""
    explicit = (args.layers, args.kv_heads, args.head_dim)
    if args.preset:
        preset = PRESETS[args.preset]
        if not preset.is_uniform and not args.uniform and any(e is not None for e in explicit):
            raise UsageError(f"--preset {args.preset} has a layer pattern; --layers / --kv-heads / --head-dim "
                             "would change it (add --uniform to plan every layer as full attention)")
        layers, heads, dim = (e if e is not None else p for e, p in
                              zip(explicit, (preset.layers, preset.num_kv_heads, preset.head_dim)))
        groups = None if preset.is_uniform or args.uniform else preset.layer_groups()
        return layers, heads, dim, args.preset, _group_quantizers(args, groups)
    if None in explicit:
        raise UsageError("give --preset NAME or all of --layers, --kv-heads and --head-dim")
    if args.group_quant:
        raise UsageError("--group-quant needs a --preset with a layer pattern (gemma-3-27b, gpt-oss-20b, ...)")
    return *explicit, "custom", None


def _group_quantizers(args: argparse.Namespace, groups: Any) -> Any:
    """``groups`` with the quantizers ``--group-quant KIND=NAME`` gives the groups of each kind."""
    chosen: dict[AttentionKind, str] = {}
    for item in args.group_quant:
        kind, sep, name = item.partition("=")
        if not sep or kind not in ATTENTION_KINDS or not name:
            raise UsageError(f"--group-quant {item!r}: write KIND=NAME with KIND full, sliding or chunked, "
                             "e.g. full=int8")
        if kind in chosen:
            raise UsageError(f"--group-quant names {kind} twice ({chosen[kind]!r} and {name!r})")
        chosen[AttentionKind(kind)] = name
    if not chosen:
        return groups
    # The kinds' names, not the enums: the messages list ['sliding', ...] as they always did.
    kinds = sorted({g.attention.value for g in groups or ()})
    missing = sorted(kind.value for kind in set(chosen) if kind not in kinds)
    if missing:
        plan = f"--preset {args.preset}{' --uniform' * args.uniform}"
        raise UsageError(f"--group-quant names {missing}, but the plan of {plan} has layer groups of kinds "
                         f"{kinds or ['none (one uniform cache: use --quant)']}")
    return tuple(dataclasses.replace(g, quantization=chosen[g.attention]) if g.attention in chosen else g
                 for g in groups)


def _mesh(args: argparse.Namespace) -> Any:
    import jax
    from jax.sharding import AbstractMesh, AxisType

    from easykv.sharding import create_mesh

    if args.cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    axes = parse_mesh(args.mesh) if args.mesh else None
    if args.memory is not None and axes is not None:
        if any(size <= 0 for size in axes.values()):
            raise UsageError(f"--mesh {args.mesh!r}: with --memory every axis needs an explicit positive size")
        # With the budget given, no device needs to exist: plan a pod from a laptop.
        return AbstractMesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes))
    return create_mesh(axes if axes is not None else {"tp": jax.device_count()})


def cmd_plan(args: argparse.Namespace) -> int:
    import warnings

    from easykv.sharding import PartitionAxis, PartitionManager
    from easykv.spec.layout import plan_layout
    from easykv.spec.metadata import PagedAttentionCacheMetaData, known_dtype
    from easykv.spec.sizing import tokens_per_gib

    layers, heads, dim, model, groups = _model_dims(args)
    memory = parse_bytes(args.memory) if args.memory is not None else None
    host_memory = parse_bytes(args.host_memory, "--host-memory") if args.host_memory is not None else None
    mesh = _mesh(args)
    pm = PartitionManager(PartitionAxis(kv_head_axis=_axes_flag(args.kv_head_axis),
                                        page_axis=_axes_flag(args.page_axis)))
    layout = plan_layout(mesh, num_kv_heads=heads, partition_manager=pm, emit_warnings=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same adjustments are printed in the table below
        meta = PagedAttentionCacheMetaData.create(
            mesh, args.batch_size, layers, args.max_seq, args.page_size, heads, dim, args.utilization,
            args.dtype, partition_manager=pm, quantizer=args.quant, memory_bytes_per_device=memory,
            layer_groups=groups, host_memory_bytes=host_memory,
        )  # fmt: skip
    if meta.head_shards > 1:  # create() sets kv_head_shards: head_shards is it
        head_line = f"{heads} split over {meta.kv_head_mesh_axes} -> {meta.kv_heads_per_device} per device"
    else:
        head_line = f"replicated: every device stores all {heads}"
    mesh_line = ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    rows = [
        ("model", f"{model}: {layers} layers, {heads} kv heads, head_dim {dim}"),
        ("mesh", f"{mesh_line} ({mesh.size} devices)"),
        ("dtype / quantization", f"{known_dtype(meta.dtype).name} / {meta.quantization}"),
        ("memory budget per device", _format_bytes(meta.memory_bytes_per_device or 0)),
        ("kv heads", head_line),
        ("page axis", f"split over {meta.page_mesh_axes} into {meta.page_shards} slices"
                      if meta.page_shards > 1 else "not split (every device holds every page id)"),  # fmt: skip
        ("page size", f"{meta.page_size} tokens"),
    ]
    if meta.is_uniform:
        rows += [
            ("pages per layer", f"{meta.num_pages_per_layer} ({meta.pages_per_shard} per device)"),
            ("tokens held per layer", f"{meta.tokens_per_layer:,}"),
            ("bytes per page per device (all layers)", _format_bytes(meta.page_bytes_per_device * layers)),
        ]
    else:
        rows += [(f"group {i}", _group_line(meta, g)) for i, g in enumerate(meta.groups)]
    rows += [
        ("bytes per token (all layers)", _format_bytes(meta.bytes_per_token)),
        ("pool bytes per device", _format_bytes(meta.bytes_per_device)),
        ("sequences of max length", f"{meta.max_full_sequences} x {meta.max_sequences} tokens "
                                    f"({meta.num_pages_per_sequence} pages each)"),  # fmt: skip
    ]
    if meta.host_pages_per_layer is not None:  # meta.has_host_tier
        rows.append(("host tier", f"{meta.host_pages_per_layer} pages per layer "
                                  f"({meta.host_pages_per_layer * meta.page_size:,}"
                                  f" tokens{' in the largest group' * (not meta.is_uniform)}), "
                                  f"{_format_bytes(meta.host_bytes_per_device)} of host memory per device"))
    held, uniform = tokens_per_gib(meta, meta.max_sequences), tokens_per_gib(meta, meta.max_sequences, uniform=True)
    rows.append((f"tokens per GiB at {meta.max_sequences:,} context",
                 f"{held:,.0f} ({held / uniform:.2f}x the {uniform:,.0f} of every layer full attention)"))
    rows += [("adjustment", note) for note in layout.adjustments]
    width = max(len(k) for k, _ in rows)
    print(f"easykv plan ({'given --memory' if memory else 'measured device memory'})")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    return 0


def _group_line(meta: Any, g: Any) -> str:
    kind = {AttentionKind.FULL: "full", AttentionKind.SLIDING: f"sliding window {g.window}",
            AttentionKind.CHUNKED: f"chunks of {g.window}"}[g.attention]
    dims = (f"latent of {g.key_head_dim} (value: first {g.value_head_dim})" if g.latent
            else f"K {g.key_head_dim} / V {g.value_head_dim}")
    per = g.num_pages // meta.page_shards
    return (f"layers {g.span} ({g.num_layers}): {kind}; {g.num_kv_heads} kv heads "
            f"({g.num_kv_heads // (g.kv_head_shards or 1)}"
            f" per device), {dims}; {g.num_pages} pages ({per} per device, "
            f"{g.pages_per_sequence(meta.max_sequences, meta.page_size)} per sequence), "
            f"{_format_bytes(meta.group_page_bytes(g) * per * g.num_layers)} per device{g.format_note}")


def _quiet_orbax() -> None:
    # orbax logs routine notes (read-only managers, OCDBT merges) as absl warnings; the CLI's
    # own output says what happened. Errors still show.
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_orbax()
    parser = _build_parser()
    command = ""
    try:
        args = parser.parse_args(argv)
        command = args.command
        return {"plan": cmd_plan, "demo": cmd_demo, "inspect": cmd_inspect, "store": cmd_store}[command](args)
    except (UsageError, ValueError) as err:
        # The CLI is the user's boundary: a bad flag or value becomes one line and exit code 2.
        message = " ".join(str(err).split())
        prog = getattr(err, "prog", None) or f"easykv{' ' + command if command else ''}"
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
