"""Our side of the whole-model benchmarks: a model's prefill and greedy cached decode, jitted and timed
(`bench.prefill` for Qwen3.5, `bench.moe` for Qwen3.5-MoE)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from librarian_jax import models
from librarian_jax.bench.common import best_time, compile_seconds


@jax.jit
def _prefill(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, cache: models.Cache):
    """tokens `[batch, seq]` -> (last-position logits `[batch, vocab]`, max |logit|, filled cache)."""
    logits, cache = nnx.merge(graphdef, state)(tokens, cache=cache)
    return logits[:, -1], jnp.max(jnp.abs(logits)), cache


@functools.partial(jax.jit, static_argnames=("steps",))
def _decode(graphdef: nnx.GraphDef, state: nnx.State, token: jax.Array, cache: models.Cache, steps: int):
    """Greedy decode of `steps` tokens from `token` `[batch, 1]`, on device: -> tokens `[batch, steps]`."""
    model = nnx.merge(graphdef, state)

    def step(carry, _):
        tok, cache = carry
        logits, cache = model(tok, cache=cache)
        nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        return (nxt, cache), nxt[:, 0]

    (_, cache), toks = jax.lax.scan(step, (token, cache), None, length=steps)
    return toks.T, cache


def ours_prefill(
    model: models.Transformer, tokens: np.ndarray, repeats: int
) -> tuple[float, float, np.ndarray]:
    """(compile seconds, best run seconds, last-position logits `[batch, vocab]`) of one cached prefill."""
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(tokens, jnp.int32)
    cache = models.init_cache(model.config, ids.shape[0], ids.shape[1])
    prefill, compile_s = compile_seconds(_prefill, graphdef, state, ids, cache)

    def run():
        last, top, _ = prefill(graphdef, state, ids, cache)
        return np.asarray(jax.block_until_ready(last)), float(top)

    seconds, (last, _) = best_time(run, repeats)
    return compile_s, seconds, last


def ours_decode(
    model: models.Transformer, prompts: np.ndarray, steps: int, repeats: int
) -> tuple[float, float, np.ndarray]:
    """(compile seconds of the decode loop, best run seconds, tokens `[batch, steps]`) of `steps` greedy
    tokens after a prefill of `prompts` `[batch, prompt]` (the prefill is neither compiled nor timed here)."""
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(prompts, jnp.int32)
    cache = models.init_cache(model.config, ids.shape[0], ids.shape[1] + steps)
    last, _, cache = _prefill(graphdef, state, ids, cache)
    first = jnp.argmax(last, axis=-1).astype(jnp.int32)[:, None]
    decode, compile_s = compile_seconds(_decode, graphdef, state, first, cache, steps=steps)

    def run():
        toks, _ = decode(graphdef, state, first, cache)
        return np.asarray(jax.block_until_ready(toks))

    seconds, toks = best_time(run, repeats)
    return compile_s, seconds, toks
