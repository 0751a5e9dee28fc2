"""librarian_jax.tokenizers."""
