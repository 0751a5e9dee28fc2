"""ml_collections configs for `python -m librarian_jax.main --config=configs/<name>.py[:preset]`."""
