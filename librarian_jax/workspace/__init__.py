"""librarian_jax.workspace."""
