"""librarian_jax.eval: evaluation of trained builders against baselines, and building workspaces for users.

One layer above `rollout/` (it reuses the scheduler, episodes and agents): `stats` (the paper's statistics),
`restore` (a run's builder from its Orbax checkpoints onto this mesh), `pipeline` (build and answer phases,
BM25, periodic eval), `report` (tables, plots, files), `cli` (`run_eval`, `run_build`, `evaluate_run`).
See docs/eval.md.
"""

from __future__ import annotations

from librarian_jax.eval.cli import evaluate_run
from librarian_jax.eval.report import format_figures, format_table

__all__ = ["evaluate_run", "format_figures", "format_table"]
