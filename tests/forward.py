"""The tests' reference forward pass, compiled.

A model called outside `jit` runs op by op, and JAX compiles each op for each new shape: one eager forward
of a 2-layer model compiled ~100 small programs (~40 ms each on 2 cores), which was most of
tests/test_engine.py's time (1,630 programs, 106 s; 183 programs, 61 s with this). `logits` compiles one
program per model structure and input shape.
"""

from __future__ import annotations

import jax
from flax import nnx


@nnx.jit
def logits(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """`model(tokens)`'s logits `[batch, seq, vocab]` (int32 `tokens` `[batch, seq]`), no cache."""
    return model(tokens)[0]
