"""librarian_jax.agents."""
