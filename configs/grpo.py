"""GRPO training of the librarian builder.

    python -m librarian_jax.main --config=configs/grpo.py[:preset] [--config.<key>=<value> ...]

The presets and what each sets: `librarian_jax/presets/grpo.py` (re-exported here, so the package resolves
presets without importing this folder); every key, its default and bounds: `librarian_jax/config_schema.py`.
"""

from librarian_jax.presets.grpo import DEFAULT_PRESET, PRESETS, get_config

__all__ = ["DEFAULT_PRESET", "PRESETS", "get_config"]
