"""Supervised fine-tuning (the warm start before GRPO) on chat conversations.

    python -m librarian_jax.main --config=configs/sft.py[:preset] [--config.<key>=<value> ...]

The presets and what each sets: `librarian_jax/presets/sft.py` (re-exported here, so the package resolves
presets without importing this folder); every key, its default and bounds: `librarian_jax/config_schema.py`.
"""

from librarian_jax.presets.sft import PRESETS, get_config

__all__ = ["PRESETS", "get_config"]
