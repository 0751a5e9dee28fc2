"""Placing a whole model on a mesh: every variable on its NamedSharding (`partitioning`'s rules), and each
mixture-of-experts layer told the mesh its experts live on (`moe.bind_mesh`). The one helper the loader,
evaluation and tests use to move a built model onto a mesh.
"""

from __future__ import annotations

from flax import nnx
from jax.sharding import Mesh

from librarian_jax.models.moe import bind_mesh
from librarian_jax.models.partitioning import Rules, shard_state


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules | None = None) -> nnx.Module:
    """Moves every variable of `model` to its NamedSharding (in place) and returns the model."""
    nnx.update(model, shard_state(nnx.state(model), mesh, rules))
    bind_mesh(model, mesh, rules)
    return model
