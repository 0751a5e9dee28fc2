"""librarian_jax.rl."""
