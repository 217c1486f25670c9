"""`easykv demo`: a small model generating through the paged cache, checked against a dense cache.

The model is hybrid by default, as Gemma and gpt-oss are: sliding-window layers (window 32)
alternate with full-attention ones, the layers run under one `lax.scan`, and the cache holds two
layer groups, the sliding group in a pool a quarter the size (its sequences keep only their
window's pages). ``model="uniform"`` serves a plain full-attention model with unrolled layers.

The run: size and shard a cache on the mesh, serve the requests with continuous batching
(chunked prefill mixed with decodes, prefix caching across the shared system prompt, one forked
request), checkpoint cache + manager midway, restore both onto another mesh, finish there, then
generate every request again with a plain dense per-request cache and require identical greedy
tokens. Prints a progress bar while it runs and a report at the end, with a sample of the text.

The weights are the trained ones shipped in easykv/demo/weights/ by default (a byte-level model
trained on the project's docs by tools/train_demo_model.py, so the sample reads as English), or
seeded random ones (``weights="random"``: the same checks of the cache, on bytes that read as noise).

What a run can be asked for is `DemoOptions` (options.py), which checks every field against the
one table of allowed values that the CLI's flags read too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import string
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

import jax.numpy as jnp
import numpy as np

from easykv.checkpoint.checkpointer import restore_cache, save_cache
from easykv.demo.engine import NEAR_TIE, Engine, Request, reference_disagreements
from easykv.demo.model import CompiledModel, DemoConfig, DemoModel
from easykv.demo.options import HYBRID_WINDOW, MAX_LEN, DemoOptions, demo_quantizer, pool_pages
from easykv.demo.weights import load_model, read_weights, shipped_weights
from easykv.demo.workload import decode, make_requests
from easykv.errors import InvariantError
from easykv.manager.manager import PageManager
from easykv.quantization import is_compressing
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh
from easykv.spec.groups import known_size
from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.storage.cache import PagedAttentionCache
from easykv.tiers.host import HostTier
from easykv.tiers.store.prefix_store import PrefixStore, StoreMetrics

STORE_HOST_BYTES = 32 << 20  # the host tier a demo with a store gets: the store's pages land there

_BARS = "▁▂▃▄▅▆▇█"


# The demo's models: a hybrid (sliding window 32 + full attention, alternating, scanned) and a
# plain full-attention one, unrolled. Small enough that each trains on 2 CPU cores in minutes
# and ships as float16 in a few MB (tools/train_demo_model.py); 8 kv heads so that tp=8 and
# dp=2 x tp=4 meshes each hold whole heads.
_UNIFORM = DemoConfig(layers=4, hidden=128, q_heads=8, kv_heads=8, head_dim=16, mlp=384)
# Keyed by options.MODEL_NAMES, the names DemoOptions and the CLI accept, each with its window in
# options.MODEL_WINDOWS, from which DemoOptions checks the pools (a test compares the layer groups).
MODELS = {"hybrid": dataclasses.replace(_UNIFORM, pattern="SF", window=HYBRID_WINDOW, scan=True), "uniform": _UNIFORM}


@dataclasses.dataclass(frozen=True)
class DemoReport:
    requests: int
    generated: int
    seconds: float
    tokens_per_second: float
    steps: int
    checkpoint_step: int
    matched: bool
    mismatches: tuple[int, ...]
    prefix_hit_rate: float
    copies: int
    text: str
    sample: str  # request 1's generated text
    readable: float  # the fraction of the sample's characters that are letters, spaces or punctuation
    store: StoreMetrics | None = None  # what the shared prefix store did (None: no store)


_READABLE = frozenset(string.ascii_letters + string.punctuation + " \n")


def readable_fraction(text: str) -> float:
    """The fraction of ``text``'s characters that are ASCII letters, spaces (a newline counts as
    one) or punctuation: what a person reads as text, unlike digits runs, control bytes or the
    replacement character of a broken UTF-8 sequence. 0.0 for no text."""
    return sum(c in _READABLE for c in text) / len(text) if text else 0.0


def _weights_file(name: str, weights: str) -> Path | None:
    """The .npz that ``weights`` names for demo model ``name``; None for random weights."""
    if weights == "random":
        return None
    return shipped_weights(name) if weights == "trained" else Path(weights)


def check_weights(name: str, weights: str) -> None:
    """ValueError if ``weights`` names a file that does not fit demo model ``name`` (see
    `demo_model`); builds nothing, so the CLI can refuse it before any device work."""
    path = _weights_file(name, weights)
    if path is not None:
        read_weights(path, MODELS[name])


def demo_model(name: str, weights: str = "trained") -> DemoModel:
    """Demo model ``name`` (`MODELS`) with ``weights``: "trained" (its shipped .npz), "random"
    (seeded) or the path of an .npz; a file that does not fit the model is a ValueError."""
    path = _weights_file(name, weights)
    return DemoModel(MODELS[name]) if path is None else load_model(MODELS[name], path)


def _sparkline(values: list[int], top: int, width: int = 60) -> str:
    if not values:
        return ""
    idx = np.linspace(0, len(values) - 1, min(width, len(values))).astype(int)
    return "".join(_BARS[min(len(_BARS) - 1, int(values[i] / max(top, 1) * (len(_BARS) - 1) + 0.5))] for i in idx)


def _progress(out: TextIO, done: int, total: int, step: int, used: int, pages: int) -> None:
    width = 30
    fill = int(width * done / max(total, 1))
    out.write(f"\r  [{'#' * fill}{'.' * (width - fill)}] {done}/{total} tokens, step {step}, pages used {used}/{pages}")
    out.flush()


def run_demo(options: DemoOptions, *, out: TextIO | None = None, err: TextIO | None = None) -> DemoReport:
    if not isinstance(options, DemoOptions):  # its fields are checked when it is built, nowhere else
        raise TypeError(f"run_demo takes a DemoOptions, got {type(options).__name__}")
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    cfg = MODELS[options.model]
    model = CompiledModel(demo_model(options.model, options.weights))  # a bad weights file fails first
    dtype = jnp.dtype(options.dtype)
    quantizer = demo_quantizer(options.quant)
    # Both meshes before any work: one that does not fit the devices is refused naming its
    # field, not after half the demo has run.
    mesh, mesh2 = _mesh(options, "mesh"), _mesh(options, "restore_mesh")
    pm = PartitionManager(PartitionAxis())
    max_len = MAX_LEN
    meta = _metadata(options, cfg, mesh, pm, dtype, quantizer, max_len)
    cache = PagedAttentionCache.init_cache(mesh, dtype, meta, pm, quantizer=quantizer)
    manager = PageManager(meta)
    host = HostTier(cache) if options.store is not None else None
    store = None if options.store is None else PrefixStore(options.store, model_id=_model_id(options))
    requests = make_requests(options.requests, options.max_new_tokens, seed=options.seed)
    for r in requests:
        if len(r.prompt) + r.max_new_tokens > max_len:
            raise ValueError(f"request {r.rid} needs {len(r.prompt) + r.max_new_tokens} tokens > max length {max_len}")
    total = sum(r.max_new_tokens for r in requests)
    engine = Engine(model, cache, manager, token_budget=options.token_budget, max_seqs=options.max_seqs,
                    prefill_chunk=options.token_budget // 2, decode_steps=options.decode_steps, host=host,
                    store=store)  # fmt: skip

    def on_step(eng: Engine, reqs: list[Request]) -> None:
        if options.progress:
            m = eng.manager.metrics
            _progress(err, sum(len(r.output) for r in reqs), total, eng.step_index, m.used_pages, m.total_pages)

    _print_plan(out, cfg, meta, mesh, len(requests), dtype, quantizer, options.weights)

    t0 = time.perf_counter()
    # First half of the run on the first mesh.
    halfway = _halfway_step(requests)
    engine.run(requests, until_step=halfway, on_step=on_step)
    # Checkpoint cache + manager, restore onto another mesh, finish there.
    directory = tempfile.mkdtemp(prefix="easykv-demo-") if options.checkpoint_dir is None else options.checkpoint_dir
    with warnings.catch_warnings():
        if host is not None:  # a checkpoint holds no host tier: its pending transfers land first, its cached
            engine.runner.apply_pending()  # pages are left out (the store holds them: no warning for that)
            warnings.filterwarnings("ignore", "the checkpoint leaves out the host-memory tier", UserWarning)
        step = save_cache(directory, engine.cache, engine.manager, step=engine.step_index)
    restored = restore_cache(directory, mesh=mesh2, partition_manager=pm)
    if restored.manager is None:  # saved with the manager above: restore_cache returns it
        raise InvariantError(f"the checkpoint at {directory} came back without its manager", where="demo")
    engine.restore(restored.cache, restored.manager,
                   host=None if host is None else HostTier(restored.cache))
    engine.run(requests, on_step=on_step)
    if store is not None:  # every queued page written before the report counts them
        store.close()
    seconds = time.perf_counter() - t0
    if options.progress:
        err.write("\n")

    # The check: the same model with a plain dense cache per request, fed each request's tokens.
    round_trip = quantizer if is_compressing(quantizer) else None
    mismatches = tuple(
        r.rid for r in requests
        if reference_disagreements(model, r, max_len=max_len, dtype=dtype, quantizer=round_trip)
    )  # fmt: skip
    generated = sum(len(r.output) for r in requests)
    sample = decode(requests[min(1, len(requests) - 1)].output)
    readable = readable_fraction(sample)
    m = engine.manager.metrics
    lines = [
        f"  requests: {len(requests)} (one forked), steps: {engine.step_index}, tokens generated: {generated}",
        f"  throughput: {generated / seconds:.1f} tokens/s over {seconds:.1f} s (compilation included)",
    ]
    for g, group in enumerate(meta.groups):
        used = [h.group_pages[g] for h in engine.history]
        name = "pages used over time" if len(meta.groups) == 1 else f"{group.attention} layers' pages used"
        lines.append(f"  {name} (peak {max(used, default=0)} of {group.num_pages}): "
                     f"{_sparkline(used, known_size(group.num_pages))}")
    lines += [
        f"  prefix cache: {m.prefix_hits}/{m.prefix_queries} prompts hit, {m.prefix_hit_tokens} of "
        f"{m.prefix_query_tokens} prompt tokens needed no prefill ({m.token_hit_rate:.0%})",
        f"  copy-on-write page copies: {engine.copies}",
        f"  checkpoint: step {step} saved at mesh {dict(mesh.shape)}, restored onto {dict(mesh2.shape)} "
        f"({restored.metadata.kv_heads_per_device} kv heads per device), generation finished there",
        f"  sample (request 1): {sample!r} ({readable:.0%} letters, spaces, punctuation)",
    ]
    store_metrics = None if store is None else store.metrics()
    if store_metrics is not None:
        lines.insert(-1, _store_line(store_metrics))
    if mismatches:
        lines.append(f"  CHECK FAILED: requests {list(mismatches)} differ from the dense-cache reference")
    else:
        lines.append(f"  check: every greedy token of all {len(requests)} requests is the dense-cache reference's "
                     f"choice given the same history (ties closer than {NEAR_TIE:g} in its logits either way)")
    text = "\n".join(lines)
    print(text, file=out)
    return DemoReport(
        requests=len(requests), generated=generated, seconds=seconds, tokens_per_second=generated / seconds,
        steps=engine.step_index, checkpoint_step=step, matched=not mismatches, mismatches=mismatches,
        prefix_hit_rate=m.token_hit_rate, copies=engine.copies, text=text, sample=sample, readable=readable,
        store=store_metrics,
    )  # fmt: skip


def _model_id(options: DemoOptions) -> str:
    """The store's model id of the demo's weights: the model and 'trained', 'random', or the weights file's sha256."""
    weights = options.weights
    if weights not in ("trained", "random"):
        weights = "sha256:" + hashlib.sha256(Path(weights).read_bytes()).hexdigest()[:32]
    return f"easykv-demo/{options.model}/{weights}"


def _store_line(m: StoreMetrics) -> str:
    return (f"  store: {m.pages_read} pages read, {m.values_written} values written ({m.values_present} already "
            f"there), {m.tokens_served} prompt tokens served from the store, {m.refused} entries refused, "
            f"{m.dropped} pages dropped, {m.failures} failed calls ({m.url})")


def _mesh(options: DemoOptions, name: str) -> Any:
    """The mesh of ``options.<name>`` on this process's devices; a ValueError names the field."""
    axes = getattr(options, name)
    try:
        return create_mesh(axes)
    except ValueError as err:
        raise ValueError(f"DemoOptions.{name} = {axes}: {err}") from None


def _metadata(options: DemoOptions, cfg: DemoConfig, mesh: Any, pm: PartitionManager, dtype: Any, quantizer: Any,
              max_len: int) -> PagedAttentionCacheMetaData:
    """The demo cache's metadata: one pool of ``options.pages``, or for a hybrid model a full
    group of that many and a sliding group of a share (`pool_pages`: its sequences hold their
    window only). DemoOptions checked that each pool holds one sequence of ``max_len`` tokens."""
    groups = cfg.layer_groups()
    if groups is not None:
        groups = tuple(dataclasses.replace(g, num_pages=pool_pages(g, options.pages)) for g in groups)
    return PagedAttentionCacheMetaData.create(
        mesh, options.max_seqs, cfg.layers, max_len, options.page_size, cfg.kv_heads, cfg.head_dim, 0.9, dtype,
        partition_manager=pm, quantizer=quantizer, layer_groups=groups,
        num_pages_per_layer=options.pages if groups is None else None,
        host_memory_bytes=None if options.store is None else STORE_HOST_BYTES,
    )  # fmt: skip


def _print_plan(out: TextIO, cfg: DemoConfig, meta: PagedAttentionCacheMetaData, mesh: Any, requests: int, dtype: Any,
                quantizer: Any, weights: str) -> None:
    kind = (f"hybrid {cfg.layers}-layer model (sliding window {cfg.window} and full attention, pattern "
            f"{cfg.pattern!r}, layers {'scanned' if cfg.scan else 'unrolled'})" if cfg.layer_groups() is not None
            else f"{cfg.layers}-layer model")
    source = {"trained": "trained on easykv's docs", "random": "random"}.get(weights, f"from {weights}")
    print(f"easykv demo: {requests} requests, {kind} ({cfg.q_heads} q / {cfg.kv_heads} kv heads, "
          f"head_dim {cfg.head_dim}, weights {source}), {dtype.name} cache, quantizer {quantizer.name}",
          file=out)  # fmt: skip
    pools = ", ".join(f"layers {g.span} ({g.attention}{f' {g.window}' if g.window else ''}): {g.num_pages}"
                      for g in meta.groups)
    print(f"  plan: pages of {meta.page_size} tokens per layer [{pools}] on mesh "
          f"{dict(mesh.shape)}, kv heads {meta.kv_heads_per_device} per device, "
          f"{meta.bytes_per_device / 2**20:.2f} MiB per device, {meta.bytes_per_token} B per token",
          file=out)  # fmt: skip


def _halfway_step(requests: list[Request]) -> int:
    """A step by which every request has arrived and some are still generating."""
    return max(r.arrival for r in requests) + 3
