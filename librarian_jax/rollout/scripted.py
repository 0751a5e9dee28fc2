"""Moved to `librarian_jax.testing` (the one doubles module): `ScriptedEngine`, `FakeSession` and `Result`.

These names stay here only for `bench.update`, which imports them from this path; import them from
`librarian_jax.testing`.
"""

from librarian_jax.testing import FakeSession, Result, ScriptedEngine

__all__ = ["FakeSession", "Result", "ScriptedEngine"]
