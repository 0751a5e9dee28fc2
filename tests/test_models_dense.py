"""`models.layers.Dense`: nnx.Linear's values; the kernel's gradient computed without a transposed copy."""

from __future__ import annotations

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from librarian_jax.models.layers import Dense


def _transposing_ops(hlo: str) -> list[str]:
    """Instructions of an optimised HLO module that move data into another order: transposes and copies (and
    fusions XLA named after them)."""
    out = []
    for line in hlo.splitlines():
        lhs = line.split("=")[0]
        if any(k in lhs for k in ("transpose", "copy")) and "ENTRY" not in line:
            out.append(line.strip()[:120])
    return out


def test_dense_equals_linear_and_its_kernel_gradient_copies_nothing():
    """On `[batch, seq, d_in]` inputs Dense gives nn.Linear's outputs and gradients; XLA:CPU compiles the
    kernel's gradient of nn.Linear with transposed copies of the cotangent (JAX's transpose rule for a
    product with two leading dims), of Dense with none (the input flattened to `[tokens, d_in]` first)."""
    d_in, d_out = 32, 96
    dense = Dense(d_in, d_out, use_bias=False, rngs=nnx.Rngs(0))
    linear = nnx.Linear(d_in, d_out, use_bias=False, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 64, d_in)).astype(np.float32))

    results, hlos = {}, {}
    for name, layer in (("dense", dense), ("linear", linear)):
        graphdef, state = nnx.split(layer)

        def loss(state, x, graphdef=graphdef):
            return jnp.sum(jnp.tanh(nnx.merge(graphdef, state)(x)) ** 2)

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        results[name] = grad(state, x)
        hlos[name] = grad.lower(state, x).compile().as_text()
    (v0, (gk0, gx0)), (v1, (gk1, gx1)) = results["linear"], results["dense"]
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(gk0), jax.tree.leaves(gk1), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gx1), np.asarray(gx0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dense(x)), np.asarray(linear(x)), rtol=1e-6, atol=1e-6)
    assert dense(x[0]).shape == (64, d_out)  # 2-D inputs as they are
    assert _transposing_ops(hlos["linear"]), "the check no longer sees nn.Linear's copies"
    assert not _transposing_ops(hlos["dense"]), _transposing_ops(hlos["dense"])
