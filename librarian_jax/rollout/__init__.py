"""librarian_jax.rollout."""
