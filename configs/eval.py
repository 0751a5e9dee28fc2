"""Evaluation of a trained builder against baselines on held-out corpora (docs/eval.md).

    python -m librarian_jax.main --config=configs/eval.py[:preset] [--config.<key>=<value> ...]

The presets and what each sets: `librarian_jax/presets/eval.py` (re-exported here, so the package resolves
presets without importing this folder); every key, its default and bounds: `librarian_jax/config_schema.py`.
"""

from librarian_jax.presets.eval import PRESETS, get_config

__all__ = ["PRESETS", "get_config"]
