"""librarian_jax.eval: evaluation of trained builders against baselines, and building workspaces for users.

One layer above `rollout/` (it reuses the scheduler, episodes and agents): `stats` (the paper's statistics),
`restore` (a run's builder from its Orbax checkpoints onto this mesh), `pipeline` (build and answer phases,
BM25, periodic eval), `report` (tables, plots, files), `cli` (`run_eval`, `run_build`, `evaluate_run`).
See docs/eval.md.
"""

from __future__ import annotations

from typing import Any


def evaluate_run(run_dir: str, **kwargs: Any) -> dict[str, Any]:
    """`cli.evaluate_run`: a training workdir on its held-out split; writes `run_dir/eval/<name>/`."""
    from librarian_jax.eval import cli

    return cli.evaluate_run(run_dir, **kwargs)


def format_table(results: dict[str, Any]) -> str:
    """`report.format_table`: the held-out table as plain text."""
    from librarian_jax.eval import report

    return report.format_table(results)


__all__ = ["evaluate_run", "format_table"]
