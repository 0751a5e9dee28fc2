"""Build one workspace over a user's folder of .txt/.md files with a trained builder, and export it.

    python -m librarian_jax.main --config=configs/build.py --config.run=/runs/q4b \\
        --config.data.path=~/notes --config.out=~/notes_workspace

The export is a plain directory tree: README.md, raw_docs/ (the documents, unchanged), the synthetic files
(each with its title, direct sources and transitive raw sources with content hashes), history/ and
manifest.json; any agent can browse it.

An incremental update (`--config.update_from=OLD_EXPORT`) starts from the old export instead of the raw
documents: the builder sees what changed and which synthetic files went stale, and rewrites only those (at
most `update_max_turns` turns); the result goes to `out`, the old directory is only read.
The keys are declared in `librarian_jax.config_schema.BuildConfig`.
"""

from __future__ import annotations

import ml_collections

from librarian_jax import config_schema


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
    if preset not in (None, "", "default"):
        raise ValueError(f"configs/build.py: unknown preset {preset!r}; known: ['default']")
    c = config_schema.BuildConfig().to_config_dict()
    c.lock()  # only the schema's keys: setting another is a KeyError here
    c.run = ""  # the training workdir whose builder to use
    c.step = -1  # -1 = newest committed checkpoint
    c.builder = ""  # "" = the run's checkpoint; "hf:/path" for a Hugging Face model
    c.train_preset = "embedded"  # configs/grpo.py preset for rollout settings when there is no run
    c.out = ""  # the export directory (must not hold a previous export's files)
    c.seed = 0
    c.builder_temperature = 0.0
    c.update_from = ""  # an old export to update to data.path's documents ("" = build from scratch)
    c.update_max_turns = 8  # the update episode's turn budget
    c.data.update(path="", extensions=".txt,.md")
    c.engine.update(policy_slots=0, frozen_slots=0, max_seq_len=0, round_steps=0)  # 0 = the run's
    c.mesh.shape.update(data=1, fsdp=1, tensor=1)
    c.unlock()
    return c
