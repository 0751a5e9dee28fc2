"""Per-slot token sampling: greedy, temperature, top-k, top-p, with per-slot seeds.

Every slot of a decode batch carries its own sampling parameters, so one compiled decode loop serves greedy
answerer probes and temperature-1 builder turns side by side. All functions here are pure and jit-friendly.

Log-probs. For each sampled token two log-probs are returned:
- ``logprobs``: under the *full* temperature-scaled distribution, ``log_softmax(logits / T)`` over the whole
  vocabulary — exactly what a trainer recomputes from its own logits (top-k / top-p truncation is not part
  of it; truncating would bias the importance ratio). Greedy slots (``T == 0``) report ``log_softmax(logits)``
  (``T = 1``).
- ``processed_logprobs``: under the distribution that was actually sampled from (temperature, then top-k,
  then top-p truncation, renormalised). Equal to ``logprobs`` when no truncation is active.

Randomness. A slot's key is ``fold_in(fold_in(PRNGKey(seed), stream), position)`` where ``position`` is the
absolute position of the token being sampled in its session. Samples therefore depend only on the seed, the
stream, the position and the logits — not on the slot a session happens to occupy, the other sessions in the
batch, or how the decode was split into rounds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one turn samples.

    Attributes:
      temperature: 0 means greedy (argmax); otherwise logits are divided by it before sampling.
      top_p: nucleus sampling mass in (0, 1]; 1 disables it.
      top_k: keep the k most likely tokens; 0 disables it. ``top_k=1`` is greedy.
      seed: PRNG seed of this turn's samples.
      stream: a second seed component, so sessions sharing ``seed`` draw independent samples
        (``generate`` uses the row index).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stream: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


GREEDY = SamplingParams()


def _ordered_keys(x: jax.Array) -> jax.Array:
    """float32 ``[...]`` -> uint32 ``[...]`` keys in the floats' order (``a < b`` iff ``key(a) < key(b)``).

    Negative floats have all their bits flipped, the others their sign bit set (NaN-free inputs); -0.0 is
    first made +0.0, as the two compare equal.
    """
    x = x.astype(jnp.float32)
    i = jax.lax.bitcast_convert_type(jnp.where(x == 0.0, 0.0, x), jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.where(i < 0, ~i, i ^ jnp.int32(-(2**31))), jnp.uint32)


def _smallest_true(pred: Callable[[jax.Array], jax.Array], lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Per row the smallest uint32 ``t`` in ``(lo, hi]`` with ``pred(t)``, by 32 exact halvings.

    Args:
      pred: uint32 ``[slots]`` -> bool ``[slots]``, monotone in ``t`` (False, then True); ``pred(hi)`` True.
      lo, hi: uint32 ``[slots]``. Where ``pred(lo)`` is True too, the answer is ``lo + 1``.
    Returns:
      uint32 ``[slots]``.
    """

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = pred(mid)
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def _truncate(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks ``scaled`` logits outside each row's top-k / top-p set to a large negative value.

    The kept set is the one a full descending sort gives (top-k: every logit >= the k-th largest; top-p over
    the top-k-renormalised distribution: every logit >= the smallest one whose mass of strictly larger logits
    is < p, so ties at the boundary are kept), found without sorting: each threshold is a bisection over the
    logits' order-preserving uint32 keys (32 passes of a compare and a count / masked sum over ``[slots,
    vocab]``), run only when some row of the batch uses it. The only difference from the sorted version is
    float rounding of the boundary mass (a masked sum instead of a cumulative sum).

    Args:
      scaled: float32 ``[slots, vocab]`` temperature-scaled logits.
      top_k: int32 ``[slots]``, 0 = off.
      top_p: float32 ``[slots]``, 1 = off.
    Returns:
      float32 ``[slots, vocab]``; at least the most likely token of each row is always kept.
    """
    vocab = scaled.shape[-1]
    keys = _ordered_keys(scaled)  # [slots, vocab]
    lo = jnp.min(keys, axis=-1) - jnp.uint32(1)  # every key is > lo (the key of -inf is > 0)
    hi = jnp.max(keys, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)

    def kth_key(_: jax.Array) -> jax.Array:
        # The k-th largest key: the smallest t with fewer than k keys above it.
        return _smallest_true(lambda t: jnp.sum(keys > t[:, None], axis=-1) < k, lo, hi)

    kth = jax.lax.cond(jnp.any(top_k > 0), kth_key, lambda _: lo + jnp.uint32(1), keys)
    in_k = keys >= kth[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, scaled, _NEG_INF), axis=-1)

    def nucleus_key(_: jax.Array) -> jax.Array:
        # The smallest kept key: the smallest t whose strictly larger tokens hold less than p of the mass.
        def below_p(t: jax.Array) -> jax.Array:
            return jnp.sum(jnp.where(keys > t[:, None], probs, 0.0), axis=-1) < top_p

        return jnp.where(top_p < 1.0, _smallest_true(below_p, lo, hi), lo + jnp.uint32(1))

    smallest = jax.lax.cond(jnp.any(top_p < 1.0), nucleus_key, lambda _: lo + jnp.uint32(1), keys)
    keep = in_k & (keys >= smallest[:, None])
    return jnp.where(keep, scaled, _NEG_INF)


def _logp_at(x: jax.Array, tokens: jax.Array) -> jax.Array:
    """``log_softmax(x)[s, tokens[s]]``.

    Written as a gather from the full log-softmax, exactly as the sampler always computed it: XLA fuses the
    gather into the elementwise tail, and hand-written "gather then subtract" variants came out 1 ulp
    different on CPU for small vocabularies.

    Args:
      x: float32 ``[slots, vocab]``.
      tokens: int32 ``[slots]``.
    Returns:
      float32 ``[slots]``.
    """
    return jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), tokens[:, None], axis=-1)[:, 0]


def _argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (first maximum; first NaN if any) as a max and a min over an iota.

    Two plain reductions instead of one variadic (value, index) reduction, which XLA:CPU does not vectorise:
    ~5x faster on ``[32, 8000]`` float32.

    Args:
      x: float ``[..., vocab]``.
    Returns:
      int32 ``[...]``.
    """
    vocab = x.shape[-1]
    x_max = jnp.max(x, axis=-1, keepdims=True)  # NaN if the row holds one (max propagates NaN)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where((x == x_max) | jnp.isnan(x), iota, vocab), axis=-1)


def _draw(scaled: jax.Array, seeds: jax.Array, streams: jax.Array, positions: jax.Array) -> jax.Array:
    """One categorical draw per row of ``scaled`` ``[slots, vocab]`` with its slot key; int32 ``[slots]``.

    Exactly ``jax.random.categorical(key, row)`` (``argmax(gumbel(key, row.shape) + row)``), with the faster
    ``_argmax``.
    """

    def one(seed, stream, pos, row):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), stream), pos)
        return _argmax(jax.random.gumbel(key, row.shape, row.dtype) + row)

    return jax.vmap(one)(seeds, streams, positions, scaled).astype(jnp.int32)


# Batch-level paths of ``sample`` (the ``lax.switch`` index).
_PATH_GREEDY = 0  # every slot greedy: argmax + one log-prob, no draws, no vocab-wide sort
_PATH_TEMPERATURE = 1  # no slot truncates: draws, but no sort / cumulative sum over the vocabulary
_PATH_GENERAL = 2  # some slot uses top-k / top-p


def _sample_general(
    logits: jax.Array,
    *,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    seeds: jax.Array,
    streams: jax.Array,
    positions: jax.Array,
    truncate: Callable[[jax.Array, jax.Array, jax.Array], jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The general path of ``sample`` (any mix of greedy / temperature / top-k / top-p slots); same contract.

    ``sample`` calls it only when some slot truncates; it is correct for every batch, and the tests check the
    fast paths against it bit for bit. ``truncate``: the top-k / top-p mask (default ``_truncate``, the
    bisection; the tests pass a sorting one, to check that the same keys draw the same tokens either way).
    """
    truncate = truncate or _truncate
    logits = logits.astype(jnp.float32)
    greedy = (temperature <= 0.0) | (top_k == 1)
    safe_t = jnp.where(temperature > 0.0, temperature, 1.0)
    scaled = logits / safe_t[:, None]
    full_logp = jax.nn.log_softmax(scaled, axis=-1)
    truncating = ((top_k > 0) | (top_p < 1.0)) & ~greedy

    processed = jax.lax.cond(
        jnp.any(truncating),
        lambda s: jnp.where(truncating[:, None], truncate(s, top_k, top_p), s),
        lambda s: s,
        scaled,
    )

    def draw(proc: jax.Array) -> jax.Array:
        sampled = _draw(proc, seeds, streams, positions)
        return jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)

    tokens = jax.lax.cond(
        jnp.all(greedy),
        lambda p: jnp.argmax(logits, axis=-1).astype(jnp.int32),
        draw,
        processed,
    )
    logp = jnp.take_along_axis(full_logp, tokens[:, None], axis=-1)[:, 0]
    proc_logp_all = jax.lax.cond(
        jnp.any(truncating),
        lambda p: jax.nn.log_softmax(p, axis=-1),
        lambda p: full_logp,
        processed,
    )
    proc_logp = jnp.take_along_axis(proc_logp_all, tokens[:, None], axis=-1)[:, 0]
    # A greedy slot samples from a point mass; its processed log-prob is 0.
    proc_logp = jnp.where(greedy, 0.0, proc_logp)
    return tokens, logp, proc_logp


def sample(
    logits: jax.Array,
    *,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    seeds: jax.Array,
    streams: jax.Array,
    positions: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Samples one token per slot.

    One ``lax.switch`` on the batch picks the cheapest exact path: all slots greedy -> argmax and the
    log-prob of the argmax only; no slot using top-k / top-p -> temperature draws without any sort or
    cumulative sum over the vocabulary; otherwise the general path (``_sample_general``). All paths return
    bit-identical results for the slots they serve.

    Args:
      logits: float ``[slots, vocab]``.
      temperature: float32 ``[slots]``; 0 = greedy.
      top_p: float32 ``[slots]``.
      top_k: int32 ``[slots]``.
      seeds, streams: int32 ``[slots]``, the per-slot key components.
      positions: int32 ``[slots]``, absolute position of the token being sampled (folded into the key).
    Returns:
      ``(tokens int32 [slots], logprobs float32 [slots], processed_logprobs float32 [slots])``; see the
      module docstring for the two log-probs.
    """
    logits = logits.astype(jnp.float32)
    greedy = (temperature <= 0.0) | (top_k == 1)
    truncating = ((top_k > 0) | (top_p < 1.0)) & ~greedy
    path = jnp.where(
        jnp.all(greedy), _PATH_GREEDY, jnp.where(jnp.any(truncating), _PATH_GENERAL, _PATH_TEMPERATURE)
    )

    def scale(x: jax.Array) -> jax.Array:
        return x / jnp.where(temperature > 0.0, temperature, 1.0)[:, None]

    def all_greedy(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        # ``top_k == 1`` slots with T > 0 are greedy too; their log-prob is under T, like every slot's.
        tokens = _argmax(x)
        return tokens, _logp_at(scale(x), tokens), jnp.zeros(tokens.shape, jnp.float32)

    def temperature_only(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        scaled = scale(x)
        tokens = jnp.where(greedy, _argmax(x), _draw(scaled, seeds, streams, positions))
        logp = _logp_at(scaled, tokens)
        return tokens, logp, jnp.where(greedy, 0.0, logp)

    def general(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return _sample_general(
            x,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seeds=seeds,
            streams=streams,
            positions=positions,
        )

    return jax.lax.switch(path, (all_greedy, temperature_only, general), logits)
