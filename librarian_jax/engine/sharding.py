"""Logical-axis sharding rules for params, KV cache and recurrent state.

Params and cache leaves carry logical axis names (``embed``, ``heads``, ``cache_batch``, ...). A rule set maps
each logical name to a mesh axis (or a tuple of mesh axes, or ``None`` for replication). A dimension whose
size the mapped mesh axes do not divide, or whose mesh axis is already used by an earlier dimension of the
same array, is replicated instead (with a debug log), so the same code path works for any mesh shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = Mapping[str, str | tuple[str, ...] | None] | Sequence[tuple[str, str | tuple[str, ...] | None]]


def default_rules() -> dict[str, str | tuple[str, ...] | None]:
    """A copy of the models package's ``DEFAULT_RULES`` (already on this engine's ``data``/``fsdp``/``tensor``
    mesh axes, ``engine.mesh.MESH_AXES``)."""
    from librarian_jax.models.partitioning import DEFAULT_RULES

    return normalize_rules(DEFAULT_RULES)


def normalize_rules(rules: Rules) -> dict[str, str | tuple[str, ...] | None]:
    """Accepts a mapping or a sequence of ``(logical, mesh_axes)`` pairs (first match wins)."""
    if isinstance(rules, Mapping):
        return dict(rules)
    out: dict[str, str | tuple[str, ...] | None] = {}
    for item in rules:
        if len(item) != 2:
            raise ValueError(f"sharding rule {item!r} is not a (logical_name, mesh_axes) pair")
        name, axes = item
        out.setdefault(name, tuple(axes) if isinstance(axes, list) else axes)
    return out


def logical_to_spec(
    logical: Sequence[str | None] | None,
    shape: Sequence[int],
    mesh: Mesh,
    rules: Mapping[str, str | tuple[str, ...] | None],
    *,
    what: str = "array",
) -> PartitionSpec:
    """The ``PartitionSpec`` of one array from its logical axis names.

    Args:
      logical: one logical name (or None) per dimension; ``None`` for the whole array replicates it.
      shape: the array's shape.
      mesh: the target mesh.
      rules: logical name -> mesh axis / axes / None.
      what: a name for log and error messages.
    """
    if logical is None:
        return PartitionSpec()
    if len(logical) != len(shape):
        raise ValueError(f"{what}: logical axes {tuple(logical)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec: list[Any] = []
    for dim, (name, size) in enumerate(zip(logical, shape, strict=True)):
        target = rules.get(name) if name is not None else None
        if target is None:
            spec.append(None)
            continue
        axes = (target,) if isinstance(target, str) else tuple(target)
        axes = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)
        if not axes:
            spec.append(None)
            continue
        if used & set(axes):
            logging.debug("%s dim %d (%s): mesh axes %s already used; replicating", what, dim, name, axes)
            spec.append(None)
            continue
        ways = int(np.prod([mesh.shape[a] for a in axes]))
        if size % ways:
            logging.debug(
                "%s dim %d (%s, size %d) not divisible by mesh axes %s (%d); replicating",
                what, dim, name, size, axes, ways,
            )
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def _variable_logical_axes(var: Any) -> tuple[str | None, ...] | None:
    """Logical axis names stored on an ``nnx.Variable`` (``out_sharding`` / ``sharding_names`` metadata)."""
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = meta.get(key)
        if names is not None and not isinstance(names, (NamedSharding, PartitionSpec)):
            return tuple(names)
        if isinstance(names, PartitionSpec):
            return tuple(names)
    return None


def param_shardings(state: Any, mesh: Mesh, rules: Mapping[str, str | tuple[str, ...] | None]) -> Any:
    """``NamedSharding`` for every variable of an ``nnx.State`` (same tree structure, shardings as values).

    Variables without logical axis metadata are replicated. ``jax.device_put(state, param_shardings(...))``
    places a state on the mesh.
    """
    from flax import nnx

    def one(path, var):
        if not isinstance(var, nnx.Variable):
            return NamedSharding(mesh, PartitionSpec())
        value = var.get_value() if hasattr(var, "get_value") else var.value
        names = _variable_logical_axes(var)
        spec = logical_to_spec(names, value.shape, mesh, rules, what=jax.tree_util.keystr(path))
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def tree_shardings(
    tree: Any, logical_tree: Any, mesh: Mesh, rules: Mapping[str, str | tuple[str, ...] | None]
) -> Any:
    """``NamedSharding`` for every array leaf of ``tree`` given a parallel tree of logical-name tuples.

    Used for the slot cache: ``tree`` is the ``Cache`` of arrays (or ``ShapeDtypeStruct``s) and
    ``logical_tree`` is ``cache_logical_axes(config)`` (tuples of names at the leaves).
    """
    leaves, treedef = jax.tree.flatten(tree)
    is_names = lambda x: isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x)
    names, names_def = jax.tree.flatten(logical_tree, is_leaf=is_names)
    if len(names) != len(leaves):
        raise ValueError(
            f"logical axes tree has {len(names)} leaves but the array tree has {len(leaves)}: "
            f"{names_def} vs {treedef}"
        )
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    shardings = [
        NamedSharding(mesh, logical_to_spec(n, leaf.shape, mesh, rules, what=f"cache{p}"))
        for n, leaf, p in zip(names, leaves, paths, strict=True)
    ]
    return jax.tree.unflatten(treedef, shardings)
