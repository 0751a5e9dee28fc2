"""Policy losses (a registry), returned as (sum, count) so micro-batching gives the full-batch gradient.

Per token, with `r = exp(clip(logp - logp_old, -20, 20))`:
  PPO clip      `l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`
  dual clip     for A < 0: `l = min(l, -c A)` (c = `dual_clip`, 3 by default; 0 turns it off)
  TIS           `l *= stop_gradient(min(exp(logp_old - logp_sampler), tis_cap))` — truncated importance
                sampling against the sampler's log-probs (`tis_cap = 0` turns it off)
  KL (optional) `l += beta * k3`, `k3 = exp(ref - logp) - (ref - logp) - 1` (low-variance estimator)
Log-probs come from the trainer's logits divided by the sampling temperature (`token_logprobs`, or
`chunked_token_logprobs` from the final hidden states, a sequence chunk of logits at a time).

Aggregations (every one is `sum / count`; sums and counts add over micro-batches):
  `token_mean`     sum = sum_{b,t} w_b m_bt l_bt,             count = sum_{b,t} w_b m_bt        (DAPO)
  `sequence_mean`  sum = sum_b w_b (sum_t m l / sum_t m),     count = sum_b w_b [row has tokens] (GRPO)
  `drgrpo`         sum = sum_{b,t} w_b m_bt l_bt,             count = sum_b w_b * norm_length  (Dr.GRPO)
with `w_b` the row weights (1 / rows of the episode; 0 for padding) and `m` the loss mask.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

AGGREGATIONS = ("token_mean", "sequence_mean", "drgrpo")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    name: str = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float = 3.0
    tis_cap: float = 2.0
    kl_beta: float = 0.0
    temperature: float = 1.0
    aggregation: str = "token_mean"
    norm_length: int = 0  # Dr.GRPO's L_max; 0 = the padded row length of the batch.


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0
                   ) -> tuple[jax.Array, jax.Array]:
    """Log-prob of each token under the previous position's temperature-scaled logits, and the entropy.

    logits `[B, T, V]` (position t predicts token t + 1), tokens int `[B, T]`.
    Returns (logprobs `[B, T]`, entropy `[B, T]`), both float32, aligned with `tokens`; position 0 (which
    nothing predicts) gets 0.
    """
    logits = logits[:, :-1].astype(jnp.float32) / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    lp = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    pad = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return jnp.concatenate([pad, lp], axis=1), jnp.concatenate([pad, ent], axis=1)


def chunked_token_logprobs(project: Callable[[jax.Array], jax.Array], hidden: jax.Array, tokens: jax.Array,
                           temperature: float = 1.0, chunk: int = 1024) -> tuple[jax.Array, jax.Array]:
    """`token_logprobs(project(hidden), tokens, temperature)` without ever holding all `[B, T, V]` logits.

    project: hidden `[B, c, H]` -> logits float32 `[B, c, V]` (e.g. `Transformer.project`); hidden `[B, T, H]`
    (final-norm states, activation dtype); tokens int `[B, T]`. The T positions are cut into
    `n = ceil(T / chunk)` equal chunks of `c = ceil(T / n) <= chunk` positions (the last padded by fewer than
    `n` positions); `lax.map` runs one rematerialised (`jax.checkpoint`) chunk at a time, so the forward pass
    keeps only each chunk's `[B, c]` outputs and the backward pass recomputes one chunk's `[B, c, V]` logits
    at a time. Values and gradients equal `token_logprobs`'s (up to fp32 summation order).
    Returns (logprobs `[B, T]`, entropy `[B, T]`) float32; position 0 gets 0.
    """
    b, t, _ = hidden.shape
    if tokens.shape != (b, t):
        raise ValueError(f"chunked_token_logprobs: tokens {tokens.shape} do not match hidden {hidden.shape}")
    # position p predicts token p + 1; the last position predicts nothing (target 0, cut)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
    lp, ent = _chunked_target_logprobs(project, hidden, targets, temperature, chunk)
    zero = jnp.zeros((b, 1), jnp.float32)
    return jnp.concatenate([zero, lp[:, :-1]], axis=1), jnp.concatenate([zero, ent[:, :-1]], axis=1)


def positioned_token_logprobs(project: Callable[[jax.Array], jax.Array], hidden: jax.Array, tokens: jax.Array,
                              positions: jax.Array, temperature: float = 1.0, chunk: int = 1024
                              ) -> tuple[jax.Array, jax.Array]:
    """`chunked_token_logprobs` at the positions `positions` only; every other position gets 0.

    The LM head (`project`, `[H] -> [V]` per position) is the largest matmul of a small model and the
    softmax over the vocabulary the costliest elementwise op; a loss needs neither where its mask is 0 (the
    prompt and the observations of a row: ~85% of an SFT row, most of a GRPO row). hidden `[B, T, H]`,
    tokens int `[B, T]`, positions int `[B, K]`: the token positions (>= 1) whose log-probs are wanted, each
    row padded with 0 (position 0, which nothing predicts, stays 0). The states at `positions - 1` are
    gathered (`[B, K, H]`), run through `project` `chunk` positions at a time (rematerialised as in
    `chunked_token_logprobs`), and the results scattered back. Values and gradients at `positions` equal
    `chunked_token_logprobs`'s. Returns (logprobs `[B, T]`, entropy `[B, T]`) float32.
    """
    b, t, _ = hidden.shape
    if tokens.shape != (b, t) or positions.ndim != 2 or positions.shape[0] != b:
        raise ValueError(f"positioned_token_logprobs: tokens {tokens.shape} / positions {positions.shape} do "
                         f"not match hidden {hidden.shape}")
    real = positions > 0
    states = jnp.take_along_axis(hidden, jnp.maximum(positions - 1, 0)[..., None], axis=1)  # [B, K, H]
    targets = jnp.take_along_axis(tokens, positions, axis=1)  # [B, K]
    lp, ent = _chunked_target_logprobs(project, states, targets, temperature, chunk)  # [B, K]
    rows = jnp.arange(b)[:, None]
    # padding entries all write 0 to position 0, which is 0 anyway
    lp_full = jnp.zeros((b, t), jnp.float32).at[rows, positions].set(jnp.where(real, lp, 0.0))
    ent_full = jnp.zeros((b, t), jnp.float32).at[rows, positions].set(jnp.where(real, ent, 0.0))
    return lp_full, ent_full


def _chunked_target_logprobs(project: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array,
                             temperature: float, chunk: int) -> tuple[jax.Array, jax.Array]:
    """Log-prob of `targets[b, n]` under `project(hidden[b, n])` and the entropy, `[B, N]` float32 each,
    `chunk` positions at a time (see `chunked_token_logprobs`). hidden `[B, N, H]`, targets int `[B, N]`."""
    if chunk <= 0:
        raise ValueError(f"chunked_token_logprobs: chunk must be > 0, got {chunk}")
    b, t, h = hidden.shape
    n = -(-t // chunk)
    c = -(-t // n)
    pad = n * c - t
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    hidden = hidden.reshape(b, n, c, h).swapaxes(0, 1)  # [n, B, c, H]
    targets = targets.reshape(b, n, c).swapaxes(0, 1)  # [n, B, c]

    # nothing saved but the chunk's inputs; lax.map (a scan) already keeps the recomputation from being CSE'd
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one_chunk(xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        h_c, tgt = xs
        logits = project(h_c).astype(jnp.float32) / temperature
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        lp = jnp.take_along_axis(logp_all, tgt[..., None], axis=-1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return lp, ent

    lp, ent = jax.lax.map(one_chunk, (hidden, targets))  # [n, B, c] each
    lp = lp.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    ent = ent.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    return lp, ent


def aggregate(per_token: jax.Array, loss_mask: jax.Array, row_weights: jax.Array, mode: str,
              norm_length: int) -> tuple[jax.Array, jax.Array]:
    """`[B, T]` per-token values -> (sum, count) scalars under aggregation `mode` (see module doc)."""
    m = loss_mask.astype(jnp.float32)
    w = row_weights.astype(jnp.float32)
    if mode == "token_mean":
        return jnp.sum(w[:, None] * m * per_token), jnp.sum(w[:, None] * m)
    if mode == "sequence_mean":
        n = jnp.sum(m, axis=1)
        seq_mean = jnp.sum(m * per_token, axis=1) / jnp.maximum(n, 1.0)
        return jnp.sum(w * seq_mean), jnp.sum(w * (n > 0))
    if mode == "drgrpo":
        length = norm_length or per_token.shape[1]
        return jnp.sum(w[:, None] * m * per_token), jnp.sum(w) * float(length)
    raise ValueError(f"unknown loss aggregation {mode!r}; known: {AGGREGATIONS}")


LossFn = Callable[..., tuple[jax.Array, jax.Array, dict[str, jax.Array]]]
LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    def wrap(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        LOSSES[name] = fn
        return fn

    return wrap


def get_loss_fn(name: str) -> LossFn:
    if name not in LOSSES:
        raise KeyError(f"unknown loss {name!r}; known: {sorted(LOSSES)}")
    return LOSSES[name]


def _metric_sums(values: dict[str, jax.Array], loss_mask: jax.Array) -> dict[str, jax.Array]:
    m = loss_mask.astype(jnp.float32)
    out = {k: jnp.sum(v.astype(jnp.float32) * m) for k, v in values.items()}
    out["tokens"] = jnp.sum(m)
    return out


def _tis_and_kl(loss: jax.Array, logprobs: jax.Array, old_logprobs: jax.Array, sampler_logprobs: jax.Array,
                ref_logprobs: jax.Array | None, config: LossConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Applies the TIS weight and adds the k3 KL term. Returns (loss, tis weight, k3) all `[B, T]`."""
    tis = jnp.ones_like(loss)
    if config.tis_cap:
        log_w = jnp.clip(old_logprobs - sampler_logprobs, -20.0, 20.0)
        tis = jax.lax.stop_gradient(jnp.minimum(jnp.exp(log_w), config.tis_cap))
        loss = loss * tis
    kl = jnp.zeros_like(loss)
    if ref_logprobs is not None:
        d = ref_logprobs - logprobs
        kl = jnp.exp(d) - d - 1.0
        if config.kl_beta:
            loss = loss + config.kl_beta * kl
    return loss, tis, kl


@register_loss("ppo")
def ppo_loss(logprobs: jax.Array, old_logprobs: jax.Array, sampler_logprobs: jax.Array,
             advantages: jax.Array, loss_mask: jax.Array, row_weights: jax.Array,
             ref_logprobs: jax.Array | None = None, entropy: jax.Array | None = None, *,
             config: LossConfig) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """PPO clip (eps_low/eps_high) + dual clip + TIS + optional k3 KL.

    All per-token inputs `[B, T]` float32 aligned with the tokens; row_weights `[B]`.
    Returns (loss sum, count, metric sums over loss tokens: `clip`, `dual_clip`, `kl`, `tis`, `ratio`,
    `entropy`, `tokens`) — divide a metric sum by `tokens` for its mean.
    """
    a = advantages
    ratio = jnp.exp(jnp.clip(logprobs - old_logprobs, -20.0, 20.0))
    clipped = jnp.clip(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
    unclipped_loss = -a * ratio
    clipped_loss = -a * clipped
    loss = jnp.maximum(unclipped_loss, clipped_loss)
    clip_active = clipped_loss > unclipped_loss
    dual_active = jnp.zeros_like(clip_active)
    if config.dual_clip:
        dual = jnp.minimum(loss, -config.dual_clip * a)
        dual_active = (a < 0) & (dual < loss)
        loss = jnp.where(a < 0, dual, loss)
    loss, tis, kl = _tis_and_kl(loss, logprobs, old_logprobs, sampler_logprobs, ref_logprobs, config)
    total, count = aggregate(loss, loss_mask, row_weights, config.aggregation, config.norm_length)
    metrics = {"clip": clip_active, "dual_clip": dual_active, "kl": kl, "tis": tis, "ratio": ratio}
    if entropy is not None:
        metrics["entropy"] = entropy
    return total, count, _metric_sums(metrics, loss_mask)


@register_loss("pg")
def pg_loss(logprobs: jax.Array, old_logprobs: jax.Array, sampler_logprobs: jax.Array,
            advantages: jax.Array, loss_mask: jax.Array, row_weights: jax.Array,
            ref_logprobs: jax.Array | None = None, entropy: jax.Array | None = None, *,
            config: LossConfig) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Plain policy gradient `-A * logp` (with TIS and optional KL) — no ratio clipping. `[B, T]` inputs."""
    loss = -advantages * logprobs
    loss, tis, kl = _tis_and_kl(loss, logprobs, old_logprobs, sampler_logprobs, ref_logprobs, config)
    total, count = aggregate(loss, loss_mask, row_weights, config.aggregation, config.norm_length)
    zeros = jnp.zeros_like(loss)
    metrics = {"clip": zeros, "dual_clip": zeros, "kl": kl, "tis": tis, "ratio": jnp.ones_like(loss)}
    if entropy is not None:
        metrics["entropy"] = entropy
    return total, count, _metric_sums(metrics, loss_mask)


@register_loss("nll")
def nll_loss(logprobs: jax.Array, old_logprobs: jax.Array, sampler_logprobs: jax.Array,
             advantages: jax.Array, loss_mask: jax.Array, row_weights: jax.Array,
             ref_logprobs: jax.Array | None = None, entropy: jax.Array | None = None, *,
             config: LossConfig) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Supervised fine-tuning: the negative log-likelihood `-logp` of the loss tokens (advantages and the
    sampler's log-probs are unused; optional KL as in the other losses). `[B, T]` inputs."""
    # no importance weight: the tokens are demonstrations, not samples of an older policy
    loss, _, kl = _tis_and_kl(-logprobs, logprobs, old_logprobs, sampler_logprobs, ref_logprobs,
                              dataclasses.replace(config, tis_cap=0.0))
    total, count = aggregate(loss, loss_mask, row_weights, config.aggregation, config.norm_length)
    zeros = jnp.zeros_like(loss)
    ones = jnp.ones_like(loss)
    metrics = {"clip": zeros, "dual_clip": zeros, "kl": kl, "tis": ones, "ratio": ones}
    if entropy is not None:
        metrics["entropy"] = entropy
    return total, count, _metric_sums(metrics, loss_mask)
