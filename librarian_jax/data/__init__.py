"""librarian_jax.data."""
