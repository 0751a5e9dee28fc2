"""Build one workspace over a user's folder of .txt/.md files with a trained builder, and export it.

    python -m librarian_jax.main --config=configs/build.py --config.run=/runs/q4b \\
        --config.data.path=~/notes --config.out=~/notes_workspace

The export is a plain directory tree: README.md, raw_docs/ (the documents, unchanged), the synthetic files
(each with its title, direct sources and transitive raw sources with content hashes), history/ and
manifest.json; any agent can browse it.

An incremental update (`--config.update_from=OLD_EXPORT`) starts from the old export instead of the raw
documents: the builder sees what changed and which synthetic files went stale, and rewrites only those (at
most `update_max_turns` turns); the result goes to `out`, the old directory is only read.
The keys and their defaults are declared in `librarian_jax.config_schema.BuildConfig`; the one preset,
`default`, is those defaults.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from librarian_jax import config_schema

PRESETS: dict[str, dict[str, Any]] = {"default": {}}


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
    if preset not in (None, "", *PRESETS):
        raise ValueError(f"configs/build.py: unknown preset {preset!r}; known: {list(PRESETS)}")
    return config_schema.BuildConfig.preset_config(PRESETS[preset or "default"])
