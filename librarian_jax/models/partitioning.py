"""Logical axis names -> mesh axes.

Every parameter carries logical axis names (`vocab, embed, heads, kv_heads, mlp, norm, conv, lin_heads,
expert`)
in its `out_sharding` metadata (set with `nnx.with_partitioning`); the KV cache uses `cache_batch, kv_heads,
cache_seq, head_dim, lin_heads` (see `cache_logical_axes`). `DEFAULT_RULES` maps them onto a mesh with axes
named `data` (batch), `fsdp` (parameter sharding over the embedding dim), `expert` (expert parallelism: the
routed experts of MoE layers, see `models/moe.py`; meshes without it keep every expert on each device) and
`tensor` (tensor parallel), the axes of `engine.mesh.MESH_AXES`. Mesh axes a rule names but the mesh lacks,
and mesh axes that do not divide a dimension, are dropped (that dimension is replicated), so the same rules
work on 1 device, a CPU test mesh and a pod slice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import flax.nnx as nnx
import jax
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = Mapping[str, str | tuple[str, ...] | None]

DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    # parameters
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
    "conv": "tensor",
    "lin_heads": "tensor",
    # routed experts: over `expert`, and over `fsdp` too, so that FSDP meshes also split them (each device
    # then computes its own experts for every token of its data shard: expert parallelism, models/moe.py)
    "expert": ("expert", "fsdp"),
    # cache
    "cache_batch": "data",
    "cache_seq": None,
    "head_dim": None,
}


def logical_to_spec(
    axes: Sequence[str | None] | None,
    mesh: Mesh,
    rules: Rules | None = None,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """PartitionSpec for an array with logical `axes` on `mesh`.

    A mesh axis is used at most once, only if the mesh has it, and (when `shape` is given) only if it divides
    the dimension; otherwise that dimension stays replicated.
    """
    rules = DEFAULT_RULES if rules is None else rules
    if not axes:
        return PartitionSpec()
    used: set[str] = set()
    out: list[str | tuple[str, ...] | None] = []
    for dim, name in enumerate(axes):
        target = rules.get(name) if name is not None else None
        names = (target,) if isinstance(target, str) else tuple(target or ())
        keep: list[str] = []
        size = 1
        for m in names:
            if m not in mesh.shape or m in used:
                continue
            if shape is not None and shape[dim] % (size * mesh.shape[m]):
                logging.log_first_n(
                    logging.INFO,
                    "logical axis %r: mesh axis %r (size %d) does not divide dim %d; replicated",
                    8, name, m, mesh.shape[m], shape[dim],
                )
                continue
            keep.append(m)
            size *= mesh.shape[m]
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    return PartitionSpec(*out)


def named_sharding(
    axes: Sequence[str | None] | None, mesh: Mesh, shape: Sequence[int], rules: Rules | None = None
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, mesh, rules, shape))


def variable_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names stored on an `nnx.Variable` (None when it has none)."""
    meta = variable.get_metadata()
    axes = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    return tuple(axes) if axes else None


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules | None = None) -> nnx.State:
    """A tree like `state` whose leaves are the NamedSharding of each variable."""

    def one(v: nnx.Variable) -> NamedSharding:
        return named_sharding(variable_axes(v), mesh, v.get_value().shape, rules)

    return jax.tree.map(lambda v: v.replace(one(v)), state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules | None = None) -> nnx.Module:
    """Moves every variable of `model` to its NamedSharding (in place) and returns the model."""
    state = nnx.state(model)
    shardings = state_shardings(state, mesh, rules)
    nnx.update(model, jax.device_put(state, shardings))
    from librarian_jax.models.moe import bind_mesh  # local: moe imports this module

    bind_mesh(model, mesh, rules)
    return model


def tree_shardings(tree, axes_tree, mesh: Mesh, rules: Rules | None = None):
    """NamedShardings for a pytree of arrays given a matching tree of logical-axis tuples (e.g. the cache)."""
    return jax.tree.map(lambda x, axes: named_sharding(axes, mesh, x.shape, rules), tree, axes_tree)
