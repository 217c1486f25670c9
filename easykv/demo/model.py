"""A small Llama-style decoder (flax nnx) and its two attention back ends.

The model has RoPE, grouped-query attention, RMSNorm and a SwiGLU MLP and a byte-level
vocabulary; its weights are random from a fixed seed, or the trained ones shipped with the
package (weights.py loads them; tools/train_demo_model.py trains them), so it needs no
download. ``pattern`` makes it hybrid the way Gemma and gpt-oss are: layer ``i`` is a
sliding-window layer (``S``, window ``window``) or a full-attention one (``F``) after
``pattern[i % len(pattern)]``; each kind is one layer group of the cache. One block is written
once (`_block`) and run three ways:

* `paged_step`: a ragged batch of prefill chunks and decodes; each layer writes its new K/V
  into the paged cache and attends through the page tables (the easykv path), the layers
  unrolled or, with ``scan=True``, under one `lax.scan` over repeats of the pattern (the
  parameters stacked per pattern position, each group's pages carried as one view);
* `dense_step`: one sequence with a plain preallocated per-request cache, every layer unrolled
  and masked to its window (the reference the demo compares against).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from easykv.attention.api import view_attention
from easykv.manager.step_plan import StepPlan
from easykv.quantization import CompressingQuantizer
from easykv.spec.groups import LayerGroup
from easykv.step.loop import DecodeOutput, decode_loop
from easykv.step.ragged import RaggedStep
from easykv.storage.cache import PagedAttentionCache

VOCAB = 256  # bytes


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    layers: int = 4
    hidden: int = 256
    q_heads: int = 16
    kv_heads: int = 8
    head_dim: int = 32
    mlp: int = 512
    rope_theta: float = 10000.0
    seed: int = 0
    pattern: str = "F"  # per layer, repeating: S = sliding window, F = full attention
    window: int = 32
    scan: bool = False

    def __post_init__(self) -> None:
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads={self.q_heads} must be a multiple of kv_heads={self.kv_heads}")
        if not self.pattern or set(self.pattern) - {"S", "F"}:
            raise ValueError(f"pattern must be a string of S (sliding) and F (full), got {self.pattern!r}")
        if self.window <= 0:
            raise ValueError(f"window must be positive, got {self.window}")
        if self.scan and self.layers % len(self.pattern):
            raise ValueError(f"a scanned model repeats its pattern: layers={self.layers} must be a multiple of "
                             f"len(pattern)={len(self.pattern)}")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer``, None for a full-attention layer."""
        return self.window if self.pattern[layer % len(self.pattern)] == "S" else None

    def layer_groups(self) -> tuple[LayerGroup, ...] | None:
        """The cache's layer groups (None: one full-attention group, a uniform cache)."""
        if set(self.pattern) == {"F"}:
            return None
        from easykv.spec.groups import group_pattern

        return group_pattern(self.layers, self.pattern, S=dict(attention="sliding", window=self.window),
                             F=dict(attention="full"))


class Block(nnx.Module):
    def __init__(self, cfg: DemoConfig, rngs: nnx.Rngs) -> None:
        h, d = cfg.hidden, cfg.head_dim
        self.attn_norm = nnx.RMSNorm(h, rngs=rngs)
        self.q = nnx.Linear(h, cfg.q_heads * d, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(h, cfg.kv_heads * d, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(h, cfg.kv_heads * d, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(cfg.q_heads * d, h, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(h, rngs=rngs)
        self.gate = nnx.Linear(h, cfg.mlp, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(h, cfg.mlp, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp, h, use_bias=False, rngs=rngs)


class DemoModel(nnx.Module):
    def __init__(self, cfg: DemoConfig) -> None:
        rngs = nnx.Rngs(cfg.seed)
        self.cfg = cfg
        self.embed = nnx.Embed(VOCAB, cfg.hidden, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.hidden, rngs=rngs)
        self.head = nnx.Linear(cfg.hidden, VOCAB, use_bias=False, rngs=rngs)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of (tokens, heads, head_dim) at per-token positions (rotate-half form)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.maximum(positions, 0).astype(jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


AttendFn = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]
DenseKV = tuple[jax.Array, jax.Array]  # a dense cache's (keys, values)


def _block(cfg: DemoConfig, blk: Block, x: jax.Array, positions: jax.Array, state: Any, layer: Any,
           attend: AttendFn) -> tuple[jax.Array, Any]:
    """One decoder block on the residual stream ``x`` (tokens, hidden)."""
    n = x.shape[0]
    h = blk.attn_norm(x)
    q = rope(blk.q(h).reshape(n, cfg.q_heads, cfg.head_dim), positions, cfg.rope_theta)
    k = rope(blk.k(h).reshape(n, cfg.kv_heads, cfg.head_dim), positions, cfg.rope_theta)
    v = blk.v(h).reshape(n, cfg.kv_heads, cfg.head_dim)
    out, state = attend(layer, q, k, v, state)
    x = x + blk.o(out.reshape(n, cfg.q_heads * cfg.head_dim))
    h = blk.mlp_norm(x)
    return x + blk.down(jax.nn.silu(blk.gate(h)) * blk.up(h)), state


def _forward(model: DemoModel, tokens: jax.Array, positions: jax.Array, state: Any,
             attend: AttendFn) -> tuple[jax.Array, Any]:
    """Logits (tokens, VOCAB) for token ids at positions, layers unrolled; ``attend(layer, q, k,
    v, state)`` stores the new K/V wherever the back end keeps them and returns (output, state)."""
    x = model.embed(tokens)
    for i, blk in enumerate(model.blocks):
        x, state = _block(model.cfg, blk, x, positions, state, i, attend)
    return model.head(model.norm(x)), state


def _paged_attend(metadata: Any) -> AttendFn:
    """``attend(_, q, k, v, view)``: write a layer's new K/V through its view and attend (the view
    applies its group's window); returns (output, the written view)."""
    def attend(_: Any, q: jax.Array, k: jax.Array, v: jax.Array, view: Any) -> tuple[jax.Array, Any]:
        view = view.write_mixed_to_cache(k.astype(view.dtype), v.astype(view.dtype), metadata)
        return view_attention(q.astype(view.dtype), view, metadata).astype(q.dtype), view
    return attend


def _scanned_forward(model: DemoModel, block_def: Any, stacked: list[Any], cache: PagedAttentionCache,
                     tokens: jax.Array, metadata: Any) -> tuple[jax.Array, PagedAttentionCache]:
    """`_forward` with the layers under one `lax.scan` over repeats of the pattern (compile time
    flat in the number of layers): ``stacked[p]`` holds the parameters of every block at pattern
    position ``p``, stacked over repeats; each layer group's pages ride in the carry as one view
    and each iteration writes and attends its layers through ``view.at_layer``."""
    cfg, pattern = model.cfg, model.cfg.pattern
    letters = list(dict.fromkeys(pattern))  # groups in order of first appearance (group_pattern's order)
    count = {c: pattern.count(c) for c in letters}
    occurrence = [pattern[:p].count(c) for p, c in enumerate(pattern)]
    positions = metadata[0].positions  # one metadata per layer group: the same positions
    attend = _paged_attend(metadata)

    def body(carry: Any, xs: Any) -> tuple[Any, None]:
        x, views = carry
        r, params = xs
        views = list(views)
        for p, letter in enumerate(pattern):
            g = letters.index(letter)
            view = views[g].at_layer(r * count[letter] + occurrence[p])
            x, views[g] = _block(cfg, nnx.merge(block_def, params[p]), x, positions, view, None, attend)
        return (x, tuple(views)), None

    views = tuple(cache.group_view(g) for g in range(len(letters)))
    (x, views), _ = jax.lax.scan(body, (model.embed(tokens), views),
                                 (jnp.arange(cfg.layers // len(pattern)), stacked))
    for view in views:
        cache.update(view)
    return model.head(model.norm(x)), cache


def _paged_step(model: DemoModel, cache: PagedAttentionCache, tokens: jax.Array,
                metadata: tuple[RaggedStep, ...]) -> tuple[jax.Array, PagedAttentionCache]:
    """One engine step for all layers in one jit: write each layer's new K/V into its pages
    (the cache is donated) and attend through the page tables of the mixed metadata."""

    paged = _paged_attend(metadata)

    def attend(i: int, q: jax.Array, k: jax.Array, v: jax.Array, cache: PagedAttentionCache) -> tuple[jax.Array, Any]:
        out, _ = paged(i, q, k, v, cache[i])  # the view writes through to the cache
        return out, cache

    # One metadata per layer group: the same positions (asarray: no operation on the traced array).
    positions = jnp.asarray(metadata[0].positions)
    return _forward(model, tokens, positions, cache, attend)


def _visible(keys: jax.Array, queries: jax.Array, window: int | None) -> jax.Array:
    """Causal mask of key positions for query positions, narrowed to the last ``window``."""
    seen = keys <= queries
    return seen if window is None else seen & (keys > queries - window)


def _dense_step(model: DemoModel, keys: jax.Array, values: jax.Array, tokens: jax.Array, start: jax.Array,
               kv_round_trip: CompressingQuantizer | None = None,
               ) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """Reference step for ONE sequence with a dense cache (layers, max_len, kv_heads, head_dim):
    tokens (n,) at positions start..start+n-1 are written, then attend causally to 0..pos.
    ``kv_round_trip`` (a quantizer) makes the dense cache hold what a quantized cache holds."""
    cfg = model.cfg
    n = tokens.shape[0]
    positions = start + jnp.arange(n, dtype=jnp.int32)
    group = cfg.q_heads // cfg.kv_heads

    def attend(i: int, q: jax.Array, k: jax.Array, v: jax.Array, kv: DenseKV) -> tuple[jax.Array, DenseKV]:
        kc, vc = kv
        if kv_round_trip is not None:
            k = kv_round_trip.quantize(k.astype(kc.dtype)).dequantize(kc.dtype)
            v = kv_round_trip.quantize(v.astype(vc.dtype)).dequantize(vc.dtype)
        kc = kc.at[i].set(jax.lax.dynamic_update_slice_in_dim(kc[i], k.astype(kc.dtype), start, axis=0))
        vc = vc.at[i].set(jax.lax.dynamic_update_slice_in_dim(vc[i], v.astype(vc.dtype), start, axis=0))
        kk = jnp.repeat(kc[i].astype(jnp.float32), group, axis=1)  # (max_len, q_heads, dim)
        vv = jnp.repeat(vc[i].astype(jnp.float32), group, axis=1)
        qf = q.astype(kc.dtype).astype(jnp.float32)
        scores = jnp.einsum("thd,shd->hts", qf, kk) * cfg.head_dim**-0.5
        visible = _visible(jnp.arange(kc.shape[1])[None, :], positions[:, None], cfg.window_of(i))
        scores = jnp.where(visible[None], scores, -jnp.inf)
        out = jnp.einsum("hts,shd->thd", jax.nn.softmax(scores, axis=-1), vv)
        return out.astype(kc.dtype).astype(q.dtype), (kc, vc)

    logits, (keys, values) = _forward(model, tokens, positions, (keys, values), attend)
    return logits, keys, values


# nnx.jit re-walks the module graph on every call (milliseconds per step here); the engine
# splits the model once and jits pure functions of (graphdef, params) instead.
@partial(jax.jit, static_argnums=0, donate_argnums=2)
def _paged_jit(graphdef: Any, params: Any, cache: PagedAttentionCache, tokens: jax.Array,
               metadata: tuple[RaggedStep, ...]) -> tuple[jax.Array, PagedAttentionCache]:  # fmt: skip
    return _paged_step(nnx.merge(graphdef, params), cache, tokens, metadata)


@partial(jax.jit, static_argnums=(0, 2), donate_argnums=4)
def _scanned_jit(graphdef: Any, params: Any, block_def: Any, stacked: list[Any], cache: PagedAttentionCache,
                 tokens: jax.Array, metadata: Any) -> tuple[jax.Array, PagedAttentionCache]:  # fmt: skip
    return _scanned_forward(nnx.merge(graphdef, params), block_def, stacked, cache, tokens, metadata)


@partial(jax.jit, static_argnums=(0, 6), donate_argnums=(2, 3))
def _dense_jit(graphdef: Any, params: Any, keys: jax.Array, values: jax.Array, tokens: jax.Array, start: jax.Array,
               kv_round_trip: CompressingQuantizer | None) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    return _dense_step(nnx.merge(graphdef, params), keys, values, tokens, start, kv_round_trip)


@partial(jax.jit, static_argnums=(0, 2), static_argnames=("num_steps", "page_size", "num_pages", "eos_id"),
         donate_argnums=4)
def _decode_jit(graphdef: Any, params: Any, block_def: Any, stacked: Any, cache: PagedAttentionCache,
                tokens: jax.Array, metadata: Any, limits: jax.Array, *, num_steps: int, page_size: int,
                num_pages: tuple[int, ...], eos_id: int | None) -> DecodeOutput:  # fmt: skip
    model = nnx.merge(graphdef, params)

    def step(cache: PagedAttentionCache, tokens: jax.Array, metadata: Any) -> tuple[jax.Array, PagedAttentionCache]:
        if block_def is not None:
            return _scanned_forward(model, block_def, stacked, cache, tokens, metadata)
        return _paged_step(model, cache, tokens, metadata)

    return decode_loop(step, cache, tokens, metadata, num_steps=num_steps, page_size=page_size, num_pages=num_pages,
                       limits=limits, eos_id=eos_id)


class CompiledModel:
    """A DemoModel split once into (graphdef, params) with its two jitted steps. The paged
    steps take the parameters replicated over the cache's mesh, put there on the first step of
    each mesh (left on one device, every step would copy them to every device); the dense
    reference takes them where they are."""

    def __init__(self, model: DemoModel) -> None:
        self.cfg = cfg = model.cfg
        self.graphdef, self.params = nnx.split(model)
        self.stacked: list[Any] | None = None
        if cfg.scan:  # each pattern position's blocks stacked over the repeats
            period = len(cfg.pattern)
            self.block_def = nnx.split(model.blocks[0])[0]
            self.stacked = [jax.tree.map(lambda *xs: jnp.stack(xs),
                                         *(nnx.split(model.blocks[r * period + p])[1]
                                           for r in range(cfg.layers // period)))
                            for p in range(period)]
        # mesh -> (the params and stacked blocks replicated over it, the params they copy)
        self._replicated: dict[Mesh, tuple[tuple[Any, Any], Any]] = {}

    def _weights_for(self, cache: PagedAttentionCache) -> tuple[Any, Any]:
        """(params, stacked blocks) on ``cache``'s devices: replicated over its mesh, put once per
        mesh and again when ``params`` was replaced; as they are for a cache on one device."""
        if cache.layout is None:
            return self.params, self.stacked
        mesh = cache.layout.mesh
        placed = self._replicated.get(mesh)
        if placed is None or placed[1] is not self.params:
            weights = jax.device_put((self.params, self.stacked), NamedSharding(mesh, PartitionSpec()))
            placed = self._replicated[mesh] = (weights, self.params)
        return placed[0]

    def paged_step(self, cache: PagedAttentionCache, tokens: jax.Array, metadata: tuple[RaggedStep, ...]
                   ) -> tuple[jax.Array, PagedAttentionCache]:  # fmt: skip
        """See `_paged_step` (`_scanned_forward` for a scanned model); the cache is donated.
        ``metadata``: one step metadata per layer group (`StepPlan.metadata`)."""
        params, stacked = self._weights_for(cache)
        out: tuple[jax.Array, PagedAttentionCache]
        if self.cfg.scan:
            out = _scanned_jit(self.graphdef, params, self.block_def, stacked, cache, tokens, metadata)
        else:
            out = _paged_jit(self.graphdef, params, cache, tokens, metadata)
        return out

    def paged_decode(self, cache: PagedAttentionCache, tokens: jax.Array, plan: StepPlan, limits: jax.Array, *,
                     eos_id: int | None = None) -> DecodeOutput:
        """``plan``'s decode steps (`PageManager.schedule_decode`) in one jitted device loop with greedy
        sampling (`easykv.step.loop.decode_loop`); the cache is donated and comes back as the
        output's ``state``. ``tokens``, ``limits``: ``(plan.padded_rows,)``."""
        params, stacked = self._weights_for(cache)
        block_def = self.block_def if self.cfg.scan else None
        out: DecodeOutput = _decode_jit(self.graphdef, params, block_def, stacked, cache, tokens, plan.metadata,
                                        limits, num_steps=plan.num_steps, page_size=plan.page_size,
                                        num_pages=plan.num_pages, eos_id=eos_id)
        return out

    def dense_step(self, keys: jax.Array, values: jax.Array, tokens: jax.Array, start: jax.Array,
                   kv_round_trip: CompressingQuantizer | None = None,
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
        """See `_dense_step`; keys and values are donated."""
        out: tuple[jax.Array, jax.Array, jax.Array] = _dense_jit(self.graphdef, self.params, keys, values, tokens,
                                                                 start, kv_round_trip)
        return out

    def dense_batch_step(self, keys: jax.Array, values: jax.Array, tokens: jax.Array, rows: jax.Array,
                         positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
        """See `_dense_batch_step` (the baseline the benchmark compares with)."""
        out: tuple[jax.Array, jax.Array, jax.Array] = _dense_batch_jit(self.graphdef, self.params, keys, values,
                                                                       tokens, rows, positions)
        return out


def _dense_batch_step(model: DemoModel, keys: jax.Array, values: jax.Array, tokens: jax.Array, rows: jax.Array,
                      positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """The baseline engine step: every request owns a dense cache row preallocated at max length,
    keys/values (layers, rows, max_len, kv_heads, head_dim); token t belongs to row ``rows[t]``
    at ``positions[t]`` (-1: padding) and attends over that row's whole max length, masked."""
    cfg = model.cfg
    group = cfg.q_heads // cfg.kv_heads
    max_len = keys.shape[2]
    where = jnp.where(positions >= 0, positions, max_len)  # padding writes are dropped

    def attend(i: int, q: jax.Array, k: jax.Array, v: jax.Array, kv: DenseKV) -> tuple[jax.Array, DenseKV]:
        kc, vc = kv
        kc = kc.at[i, rows, where].set(k.astype(kc.dtype), mode="drop")
        vc = vc.at[i, rows, where].set(v.astype(vc.dtype), mode="drop")
        kk = jnp.repeat(kc[i][rows].astype(jnp.float32), group, axis=2)  # (tokens, max_len, q_heads, dim)
        vv = jnp.repeat(vc[i][rows].astype(jnp.float32), group, axis=2)
        scores = jnp.einsum("thd,tshd->ths", q.astype(jnp.float32), kk) * cfg.head_dim**-0.5
        visible = _visible(jnp.arange(max_len)[None, :], positions[:, None], cfg.window_of(i))
        scores = jnp.where(visible[:, None, :], scores, -jnp.inf)
        weights = jnp.where(positions[:, None, None] >= 0, jax.nn.softmax(scores, axis=-1), 0.0)
        return jnp.einsum("ths,tshd->thd", weights, vv).astype(q.dtype), (kc, vc)

    logits, (keys, values) = _forward(model, tokens, positions, (keys, values), attend)
    return logits, keys, values


@partial(jax.jit, static_argnums=0, donate_argnums=(2, 3))
def _dense_batch_jit(graphdef: Any, params: Any, keys: jax.Array, values: jax.Array, tokens: jax.Array,
                     rows: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    return _dense_batch_step(nnx.merge(graphdef, params), keys, values, tokens, rows, positions)
