"""The tests' reference forward passes, compiled.

A model called outside `jit` runs op by op, and JAX compiles each op for each new shape: one eager forward
of a 2-layer model compiled ~100 small programs (~40 ms each on 2 cores), which was most of
tests/test_engine.py's time (1,630 programs, 106 s; 183 programs, 61 s with this). These compile one program
per model structure and input shape.
"""

from __future__ import annotations

import jax
from flax import nnx


@jax.jit
def forward(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Logits `[batch, seq, vocab]` of one uncached forward over int32 `tokens` `[batch, seq]` (bool `mask`
    `[batch, seq]` of real positions, or None)."""
    return nnx.merge(graphdef, state)(tokens, mask=mask)[0]


@jax.jit
def cached(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, cache, mask: jax.Array | None):
    """(logits, the updated cache) of one call through `cache` (a prefill chunk or decode steps)."""
    return nnx.merge(graphdef, state)(tokens, cache=cache, mask=mask)


@jax.jit
def _hidden(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state).hidden(tokens)[0]


def logits(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """`model(tokens)`'s logits `[batch, seq, vocab]`, no cache, no mask."""
    return forward(*nnx.split(model), tokens, None)


def hidden(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """`model.hidden(tokens)`'s final-norm hidden states `[batch, seq, hidden]`, no cache, no mask."""
    return _hidden(*nnx.split(model), tokens)
