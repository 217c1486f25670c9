"""Cache shapes of open models, from their public configs: layers, kv heads, head dim, and the
layer pattern of the models whose layers differ (sliding and chunked windows, latent caches).

A pattern letter per layer, repeating: ``F`` full attention, ``S`` a sliding window, ``C``
chunked-local attention, ``L`` a latent (MLA) cache. Sinks (gpt-oss) are weights of attention,
not part of the cache, so they do not show here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from easykv.spec.groups import AttentionKind, LayerGroup, group_pattern


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """``num_kv_heads`` heads of ``head_dim`` (a latent preset: one head of ``head_dim`` dims,
    of which the first ``value_head_dim`` are the value).

    Attributes:
      layers: the model's layers.
      num_kv_heads: kv heads per layer.
      head_dim: head dim of the keys and values (of the latent, for ``L``).
      pattern: one letter per layer, repeating (module doc); ``"F"``: every layer full.
      window: the sliding window or chunk size of ``S`` / ``C`` layers, in tokens.
      value_head_dim: the latent's leading dims read as the value (``L`` only).
      source: a note on the config the shape comes from.
    """

    layers: int
    num_kv_heads: int
    head_dim: int
    pattern: str = "F"
    window: int | None = None
    value_head_dim: int | None = None
    source: str = ""

    @property
    def is_uniform(self) -> bool:
        return self.pattern == "F"

    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """One `LayerGroup` per letter of ``pattern`` (`group_pattern`), ``num_kv_heads`` and
        ``key_head_dim`` left None (the cache's)."""
        kinds: dict[str, dict[str, Any]] = {
            "F": dict(attention=AttentionKind.FULL),
            "S": dict(attention=AttentionKind.SLIDING, window=self.window),
            "C": dict(attention=AttentionKind.CHUNKED, window=self.window),
            "L": dict(attention=AttentionKind.FULL, latent=True, value_head_dim=self.value_head_dim)}
        return group_pattern(self.layers, self.pattern, **{k: v for k, v in kinds.items() if k in self.pattern})


PRESETS: dict[str, ModelPreset] = {
    "llama-3.2-1b": ModelPreset(16, 8, 64),
    "llama-3.2-3b": ModelPreset(28, 8, 128),
    "llama-3.1-8b": ModelPreset(32, 8, 128),
    "llama-3.1-70b": ModelPreset(80, 8, 128),
    "mistral-7b": ModelPreset(32, 8, 128, source="Mistral-7B-v0.2 and later: no sliding window"),
    "qwen2.5-7b": ModelPreset(28, 4, 128),
    "qwen2.5-72b": ModelPreset(80, 8, 128),
    "mistral-7b-v0.1": ModelPreset(32, 8, 128, "S", 4096, source="sliding_window 4096 on every layer"),
    "gemma-2-9b": ModelPreset(42, 8, 256, "SF", 4096, source="even layers slide over 4096 tokens, odd ones are full"),
    "gemma-3-27b": ModelPreset(62, 16, 128, "SSSSSF", 1024, source="five 1024-token sliding layers per full one"),
    "gpt-oss-20b": ModelPreset(24, 8, 64, "SF", 128, source="128-token windows alternating with full layers; "
                                                             "sinks on every layer"),
    "llama-4-scout": ModelPreset(48, 8, 128, "CCCF", 8192, source="three 8192-token chunked layers per full "
                                                                   "(NoPE) one"),
    "deepseek-v3": ModelPreset(61, 1, 576, "L", value_head_dim=512, source="MLA: one latent of 512 + 64 rope "
                                                                           "dims per token"),
}

__all__ = ["ModelPreset", "PRESETS"]
