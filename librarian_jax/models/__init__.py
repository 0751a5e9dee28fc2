"""librarian_jax.models."""
