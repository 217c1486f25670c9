"""Bridges between easykv and other libraries.

* ``easykv.integrations.easydel``: EasyDeL 0.3 models and its eSurge engine on easykv pages
  (``pip install 'easykv[easydel]'``).
* ``easykv.integrations.tunix``: Tunix's Qwen3, Llama3 and Gemma3 (qwix LoRA and weight-quantized
  ones too) generating and scoring over easykv pages, a rollout engine for Tunix's RL cluster and its
  reference scoring (``pip install 'easykv[tunix]'``).

Nothing is imported here: each bridge loads its library only when used.
"""
