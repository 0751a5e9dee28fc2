"""librarian_jax.eval."""
