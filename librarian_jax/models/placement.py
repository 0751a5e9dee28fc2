"""Placing a whole model on a mesh: every variable on its NamedSharding (`partitioning`'s rules), and each
mixture-of-experts layer told the mesh its experts live on (`moe.bind_mesh`). The one helper the loader,
evaluation and tests use to move a built model onto a mesh.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from librarian_jax.models.moe import bind_mesh
from librarian_jax.models.partitioning import Rules, shard_state


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules | None = None) -> nnx.Module:
    """Moves every variable of `model` to its NamedSharding (in place) and returns the model."""
    nnx.update(model, shard_state(nnx.state(model), mesh, rules))
    bind_mesh(model, mesh, rules)
    return model


def placed_copy(model: nnx.Module, mesh: Mesh, rules: Rules | None = None) -> nnx.Module:
    """A new module holding `model`'s values placed on `mesh` (new Variables and arrays), `model` left as it
    was: updating the copy (e.g. restoring a checkpoint into it) never changes the original."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree.map(lambda x: x, state) if mesh is None else
                     shard_state(state, mesh, rules))
    bind_mesh(copy, mesh, rules)
    return copy
