"""librarian_jax.engine."""
