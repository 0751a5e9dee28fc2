"""librarian_jax.bench."""
