"""Build one workspace over a folder of documents with a trained builder, and export it.

    python -m librarian_jax.main --config=configs/build.py[:preset] [--config.<key>=<value> ...]

The presets and what each sets: `librarian_jax/presets/build.py` (re-exported here, so the package resolves
presets without importing this folder); every key, its default and bounds: `librarian_jax/config_schema.py`.
"""

from librarian_jax.presets.build import get_config

__all__ = ["get_config"]
