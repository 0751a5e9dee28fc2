"""Top-k / top-p truncation without a vocabulary-wide sort equals the sort-based truncation it replaced."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from librarian_jax.engine.sampling import _NEG_INF, _sample_general, _truncate


def _truncate_by_sort(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The sampler's truncation before issue 15 (a descending sort of every row, a cumulative sum), verbatim
    but for one fix: ``top_p == 1`` is off, where the cumulative sum reaching 1.0 in float32 used to drop the
    tail of the vocabulary (tokens of probability ~1e-7 and below) from rows that did not ask for top-p."""
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    sorted_desc = jnp.where(sorted_desc >= kth, sorted_desc, _NEG_INF)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)) & (sorted_desc > _NEG_INF / 2)
    keep = keep.at[:, 0].set(True)
    num_keep = keep.sum(-1)
    threshold = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(threshold, kth)
    return jnp.where(scaled >= threshold, scaled, _NEG_INF)


def _cases(rng: np.random.Generator, n: int, vocab: int) -> dict:
    return dict(
        scaled=jnp.asarray(rng.normal(size=(n, vocab)) * rng.uniform(0.3, 8, (n, 1)), jnp.float32),
        top_k=jnp.asarray(np.where(rng.random(n) < 0.5, 0, rng.integers(1, vocab + 5, n)), jnp.int32),
        top_p=jnp.asarray(np.where(rng.random(n) < 0.3, 1.0, rng.uniform(0.05, 0.99, n)), jnp.float32),
    )


def test_truncate_keeps_the_sorted_set():
    rng = np.random.default_rng(0)
    kw = _cases(rng, 64, 512)
    # Ties at the top-k / top-p boundary are all kept; negative and zero logits order correctly.
    ties = np.full((4, 512), -1e30, np.float32)
    ties[:, :7] = [2.0, 1.0, 1.0, 1.0, -0.0, 0.0, -3.0]
    kw["scaled"] = kw["scaled"].at[:4].set(ties)
    kw["top_k"] = kw["top_k"].at[:4].set(jnp.asarray([2, 0, 5, 8]))
    kw["top_p"] = kw["top_p"].at[:4].set(jnp.asarray([1.0, 0.6, 1.0, 0.999]))
    got, want = np.asarray(jax.jit(_truncate)(**kw)), np.asarray(jax.jit(_truncate_by_sort)(**kw))
    # Same kept set, kept logits unchanged (a boundary within float rounding of p could differ; these cases
    # have none).
    np.testing.assert_array_equal(got, want)
    assert (got[0] > -1e29).sum() == 4 and (got[2] > -1e29).sum() == 6  # 2.0, three tied 1.0s (+ both zeros)
    kept = (got > -1e29).sum(-1)
    assert kept.min() == 1 and kept.max() == 512 and len(set(kept)) > 20  # the cases span the range


def test_sample_tokens_identical_to_sort_based_sampler():
    # The same keys draw the same tokens (and log-probs) as the sampler with the sorting truncation.

    rng = np.random.default_rng(3)
    n, vocab = 32, 512
    kw = dict(
        temperature=jnp.asarray(np.where(rng.random(n) < 0.2, 0.0, rng.uniform(0.5, 1.5, n)), jnp.float32),
        top_k=jnp.asarray(rng.choice([0, 1, 5, 40, 500], n), jnp.int32),
        top_p=jnp.asarray(rng.choice([1.0, 0.3, 0.9, 0.95], n), jnp.float32),
        seeds=jnp.asarray(rng.integers(0, 1000, n), jnp.int32),
        streams=jnp.arange(n, dtype=jnp.int32),
    )
    logits = jnp.asarray(rng.normal(size=(n, vocab)) * 3, jnp.float32)
    new = [jax.jit(_sample_general)(logits, positions=jnp.full((n,), p, jnp.int32), **kw) for p in range(20)]
    by_sort = functools.partial(_sample_general, truncate=_truncate_by_sort)
    old = [jax.jit(by_sort)(logits, positions=jnp.full((n,), p, jnp.int32), **kw) for p in range(20)]
    for a, b in zip(new, old, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert len({int(t[0][1]) for t in new}) > 1  # the draws do vary with the position
