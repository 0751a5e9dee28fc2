"""The decoder-only transformer shared by Qwen3, Gemma 3 text, Llama 3, the Qwen3.5 hybrid and Qwen3.5-MoE.

    logits, cache = model(tokens, positions=None, cache=None, mask=None)

One call serves training/scoring (no cache), chunked prefill and single-token decode (with a cache whose rows
may hold different lengths); see `Transformer.__call__`.
"""

from __future__ import annotations

import math

import flax.nnx as nnx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from librarian_jax.models.cache import Cache
from librarian_jax.models.config import ModelConfig
from librarian_jax.models.gated_deltanet import GatedDeltaNet
from librarian_jax.models.layers import INIT_STD, MLP, Attention, RMSNorm, dense, rope_inv_freq, rope_tables
from librarian_jax.models.moe import SparseMoE, bind_mesh
from librarian_jax.models.partitioning import Rules, state_shardings


class DecoderLayer(nnx.Module):
    """Pre-norm block: token mixer (attention or Gated DeltaNet) then gated MLP (or, with
    `config.num_experts`, the sparse MoE of `models/moe.py`), each with a residual.

    Gemma 3 (`post_norms`) also normalises each sublayer's output: post_attention_layernorm after attention,
    pre/post_feedforward_layernorm around the MLP. Otherwise `post_attention_layernorm` is the pre-MLP norm
    (HF naming).
    """

    def __init__(self, config: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs):
        self.layer_type = config.layer_types[layer_idx]
        norm = dict(eps=config.rms_norm_eps, plus_one=config.norm_plus_one,
                    param_dtype=config.jnp_param_dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm)
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, rngs=rngs)
        else:
            self.self_attn = Attention(config, self.layer_type, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.post_norms = config.post_norms
        if config.post_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, **norm)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, **norm)
        self.moe = config.num_experts > 0
        if self.moe:
            self.mlp = SparseMoE(config, rngs=rngs)
        else:
            self.mlp = MLP(config, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array] | None,
        *,
        mask: jax.Array,
        cache: dict[str, jax.Array] | None = None,
        lengths: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        """x `[batch, seq, hidden]` -> (`[batch, seq, hidden]`, new layer cache or None).

        rope: (cos, sin) `[batch, seq, rotary_dim // 2]` for attention layers (None for linear attention);
        mask bool `[batch, seq]`; cache/lengths as in `Attention.__call__` / the GatedDeltaNet contract.
        """
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h, new_cache = self.linear_attn(h, cache=cache, mask=mask)
        else:
            h, new_cache = self.self_attn(h, rope, mask=mask, cache=cache, lengths=lengths)
        if self.post_norms:
            x = x + self.post_attention_layernorm(h)
            x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        else:
            x = x + h
            h = self.post_attention_layernorm(x)
            x = x + (self.mlp(h, mask) if self.moe else self.mlp(h))
        return x, new_cache


class Transformer(nnx.Module):
    """Decoder-only LM: embed_tokens -> layers -> norm -> lm_head (or tied embedding). Logits float32."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=config.jnp_dtype, param_dtype=config.jnp_param_dtype,
            embedding_init=nnx.with_partitioning(
                nnx.initializers.normal(INIT_STD), ("vocab", "embed"), eager_sharding=False
            ),
            rngs=rngs,
        )
        self.layers = nnx.List([DecoderLayer(config, i, rngs=rngs) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, plus_one=config.norm_plus_one,
                            param_dtype=config.jnp_param_dtype)
        if not config.tie_embeddings:
            self.lm_head = dense(config, config.hidden_size, config.vocab_size, ("embed", "vocab"), rngs)

    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        cache: Cache | None = None,
        mask: jax.Array | None = None,
    ) -> tuple[jax.Array, Cache | None]:
        """tokens int32 `[batch, seq]` -> (logits float32 `[batch, seq, vocab]`, cache).

        Without `cache`: positions default to arange(seq), causal attention, `mask` (bool `[batch, seq]`,
        True = real token, padding a suffix) defaults to all True; returns (logits, None).
        With `cache`: token t of row b sits at position cache.lengths[b] + t and sees every cached position
        < lengths[b] plus the new tokens up to t; padded tokens (mask False) are never written to the cache,
        so they never change what later tokens see; returns the cache with lengths + mask.sum(1).
        The caller keeps lengths[b] + mask[b].sum() <= max_len (writes past the end are dropped).
        `positions` (int32 `[batch, seq]`) only overrides the RoPE positions.
        """
        hidden, cache = self.hidden(tokens, positions=positions, cache=cache, mask=mask)
        return self.project(hidden), cache

    def hidden(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        cache: Cache | None = None,
        mask: jax.Array | None = None,
    ) -> tuple[jax.Array, Cache | None]:
        """As `__call__` but returns the final-norm hidden states `[batch, seq, hidden]` (activation dtype)
        instead of logits, so callers can project only the positions they need (see `project`)."""
        config = self.config
        b, s = tokens.shape
        mask = jnp.ones((b, s), jnp.bool_) if mask is None else mask.astype(jnp.bool_)
        lengths = None if cache is None else cache.lengths.astype(jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
            if lengths is not None:
                positions = positions + lengths[:, None]

        x = self.embed_tokens(tokens)
        if config.embed_scale:
            x = x * jnp.asarray(math.sqrt(config.hidden_size), config.jnp_dtype)

        ropes = {
            t: rope_tables(positions, rope_inv_freq(config, t))
            for t in sorted(set(config.layer_types)) if t != "linear_attention"
        }
        new_layers = []
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else cache.layers[i]
            x, new_layer_cache = layer(
                x, ropes.get(layer.layer_type), mask=mask, cache=layer_cache, lengths=lengths
            )
            new_layers.append(new_layer_cache)
        x = self.norm(x)
        if cache is None:
            return x, None
        return x, Cache(lengths=lengths + mask.sum(axis=1, dtype=jnp.int32), layers=tuple(new_layers))

    def project(self, hidden: jax.Array) -> jax.Array:
        """hidden `[..., hidden]` -> logits float32 `[..., vocab]` (tied embedding or lm_head, softcapped)."""
        config = self.config
        if config.tie_embeddings:
            w = self.embed_tokens.embedding[...].astype(hidden.dtype)
            logits = jnp.einsum("...e,ve->...v", hidden, w, preferred_element_type=jnp.float32)
        else:
            w = self.lm_head.kernel[...].astype(hidden.dtype)
            logits = jnp.einsum("...e,ev->...v", hidden, w, preferred_element_type=jnp.float32)
        if config.final_logit_softcapping:
            cap = config.final_logit_softcapping
            logits = jnp.tanh(logits / cap) * cap
        return logits


def init_model(config: ModelConfig, *, seed: int = 0, mesh: Mesh | None = None,
               rules: Rules | None = None) -> Transformer:
    """A randomly initialised Transformer, built in one compiled program.

    With `mesh`, every parameter is created directly in its NamedSharding (logical axes through `rules`),
    so a large model never exists unsharded on one device. Same values as
    `Transformer(config, rngs=nnx.Rngs(seed))`.
    """
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(seed)))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = None
    if mesh is not None:
        shardings = state_shardings(abstract_state, mesh, rules)

    def init(key: jax.Array) -> nnx.State:
        return nnx.state(Transformer(config, rngs=nnx.Rngs(key)))

    state = jax.jit(init, out_shardings=shardings)(jax.random.key(seed))
    model = nnx.merge(graphdef, state)
    if mesh is not None and config.num_experts:
        bind_mesh(model, mesh, rules)
    return model
