"""The one owner of sharding: logical axis names -> mesh axes, for params, KV cache, recurrent state and the
trainer's state, and the sharding constraints inside compiled programs.

Every parameter carries logical axis names (`vocab, embed, heads, kv_heads, mlp, norm, conv, lin_heads,
expert`)
in its `out_sharding` metadata (set with `nnx.with_partitioning`); the KV cache uses `cache_batch, kv_heads,
cache_seq, head_dim, lin_heads` (see `cache_logical_axes`). `DEFAULT_RULES` maps them onto a mesh with axes
named `data` (batch), `fsdp` (parameter sharding over the embedding dim), `expert` (expert parallelism: the
routed experts of MoE layers, see `models/moe.py`; meshes without it keep every expert on each device) and
`tensor` (tensor parallel), the axes of `engine.mesh.MESH_AXES`.

One rule, in `logical_to_spec`: the mesh axes a logical name maps to are taken in order, each kept only if the
mesh has it with more than one device, no earlier dimension of the same array used it, and it divides the
dimension together with the axes already kept; every other axis is dropped (that share of the dimension is
replicated). So `embed: ("fsdp", "tensor")` on a `data=1, fsdp=4, tensor=2` mesh splits a dimension of 6 over
`tensor` alone, and the same rules work on 1 device, a CPU test mesh and a pod slice. Model loading
(`load_hf`, `init_model`, `shard_model`), the engine (params and slot cache) and the trainer all place their
arrays with the functions below, so new weights move from trainer to engine without resharding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.nnx as nnx
import jax
import numpy as np
import optax
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
    # cache: an engine's slots split over data and fsdp alike. An engine's mesh is FSDP over its host's
    # chips (weights gathered per layer); its slot cache, which the paper's answerer (256 slots x 32,768
    # tokens) makes the largest thing a chip holds, would otherwise be replicated on every one of them, and
    # so would each slot's compute (a TPU plan showed both: planning.plan)
    "cache_batch": ("data", "fsdp"),
    "cache_seq": None,
    "head_dim": None,
}


def normalize_rules(rules: Rules | Sequence[tuple[str, str | tuple[str, ...] | None]] | None) -> dict[
        str, str | tuple[str, ...] | None]:
    """A rules dict from a mapping, a sequence of `(logical, mesh_axes)` pairs (first match wins), or None
    (a copy of `DEFAULT_RULES`)."""
    if rules is None:
        return dict(DEFAULT_RULES)
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
    axes: Sequence[str | None] | None,
    mesh: Mesh,
    rules: Rules | None = None,
    shape: Sequence[int] | None = None,
    *,
    what: str = "array",
) -> PartitionSpec:
    """PartitionSpec for an array with logical `axes` on `mesh` (the rule in the module docstring).

    Args:
      axes: one logical name (or None) per dimension; None or () replicates the whole array.
      mesh: the target mesh (only `mesh.shape`, a name -> size mapping, is read).
      rules: logical name -> mesh axis / axes / None; default `DEFAULT_RULES`.
      shape: the array's shape; without it no divisibility check is made.
      what: a name for log and error messages.
    """
    rules = DEFAULT_RULES if rules is None else rules
    if not axes:
        return PartitionSpec()
    if shape is not None and len(axes) != len(shape):
        raise ValueError(f"{what}: logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    sizes = dict(mesh.shape)
    used: set[str] = set()
    out: list[str | tuple[str, ...] | None] = []
    for dim, name in enumerate(axes):
        target = rules.get(name) if name is not None else None
        names = (target,) if isinstance(target, str) else tuple(target or ())
        keep: list[str] = []
        size = 1
        for m in names:
            if sizes.get(m, 1) == 1 or m in used:
                continue
            if shape is not None and shape[dim] % (size * sizes[m]):
                logging.log_first_n(
                    logging.INFO,
                    "%s: logical axis %r: mesh axis %r (size %d) does not divide dim %d; not split over it",
                    8, what, name, m, sizes[m], shape[dim],
                )
                continue
            keep.append(m)
            size *= sizes[m]
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    return PartitionSpec(*out)


def named_sharding(
    axes: Sequence[str | None] | None, mesh: Mesh, shape: Sequence[int], rules: Rules | None = None,
    *, what: str = "array",
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, mesh, rules, shape, what=what))


def variable_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names stored on an `nnx.Variable` (None when it has none)."""
    meta = variable.get_metadata()
    axes = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    if isinstance(axes, NamedSharding):
        return None
    return tuple(axes) if axes else None


def state_shardings(state: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """A tree like the `nnx.State` `state` whose leaves are the NamedSharding of each variable (variables
    without logical axes, and plain array leaves, are replicated). Used for params, LoRA params and the
    trainer's optimizer state alike."""

    def one(path: Any, v: Any) -> Any:
        if not isinstance(v, nnx.Variable):
            return NamedSharding(mesh, PartitionSpec())
        return v.replace(named_sharding(variable_axes(v), mesh, v.get_value().shape, rules,
                                        what=jax.tree_util.keystr(path)))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_state(state: Any, mesh: Mesh | None, rules: Rules | None = None) -> Any:
    """`state` placed on `mesh` with `state_shardings` (unchanged when `mesh` is None)."""
    if mesh is None:
        return state
    return jax.device_put(state, state_shardings(state, mesh, rules))


def tree_shardings(tree: Any, axes_tree: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """NamedShardings for every array leaf of `tree` (arrays or ShapeDtypeStructs, e.g. the slot cache) given
    a parallel tree with a tuple of logical names at each leaf (e.g. `cache_logical_axes(config)`)."""
    leaves, treedef = jax.tree.flatten(tree)
    is_names = lambda x: isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x)  # noqa: E731
    names, names_def = jax.tree.flatten(axes_tree, is_leaf=is_names)
    if len(names) != len(leaves):
        raise ValueError(
            f"logical axes tree has {len(names)} leaves but the array tree has {len(leaves)}: "
            f"{names_def} vs {treedef}"
        )
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return jax.tree.unflatten(treedef, [named_sharding(n, mesh, leaf.shape, rules, what=f"cache{p}")
                                        for n, leaf, p in zip(names, leaves, paths, strict=True)])


def opt_state_shardings(tx: optax.GradientTransformation, params: Any, mesh: Mesh) -> Any:
    """Shardings for `tx.init(params)`: every params-shaped part of the optimizer state (Adam's moments) laid
    out like `params` (each leaf takes its param's sharding), everything else (step counts) replicated."""
    abstract = jax.eval_shape(tx.init, params)
    return optax.tree_map_params(
        tx, lambda _, s: s, abstract, jax.tree.map(lambda x: x.sharding, params),
        transform_non_params=lambda _: NamedSharding(mesh, PartitionSpec()),
    )


def stacked_sharding(*shardings: NamedSharding, axis: int = 1) -> NamedSharding:
    """The sharding of `jnp.stack(..., axis)` of arrays laid out as `shardings` (all alike): the new axis
    replicated, the others as before (`models.cache.stack_cache` maps a cache's shardings with it, on axis 1;
    layer params stack on axis 0)."""
    spec = tuple(shardings[0].spec)
    if len(spec) >= axis:
        spec = (*spec[:axis], None, *spec[axis:])
    return NamedSharding(shardings[0].mesh, PartitionSpec(*spec))


def canonical_spec(spec: PartitionSpec) -> PartitionSpec:
    """`spec` without trailing unsharded dims (`P(None,)` -> `P()`, `P("fsdp", None)` -> `P("fsdp")`): the
    same layout, written as a jitted program writes its outputs' specs. jit keys programs on their inputs'
    specs as written, so state fed back into the program that made it (a trainer's params) must start out
    this way."""
    dims = tuple(spec)
    while dims and dims[-1] is None:
        dims = dims[:-1]
    return PartitionSpec(*dims)


def constrain(tree: Any, shardings: Sequence[NamedSharding] | None) -> Any:
    """`with_sharding_constraint` on each leaf of `tree` (inside jit), given one sharding per leaf in
    `jax.tree.leaves` order; `tree` unchanged when `shardings` is None."""
    if shardings is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [jax.lax.with_sharding_constraint(x, s)
                                        for x, s in zip(leaves, shardings, strict=True)])


def is_abstract(tree: Any) -> bool:
    """Whether `tree`'s array leaves are shapes without data (`jax.ShapeDtypeStruct`, e.g. a model made by
    `nnx.eval_shape`): a plan for a topology builds engines and trainers from such trees, with no device
    memory (planning/plan.py)."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def place(tree: Any, shardings: Any) -> Any:
    """`tree` on `shardings` (a tree of the same structure): `jax.device_put` for arrays, and for an abstract
    tree (`is_abstract`) the same shapes and dtypes as `jax.ShapeDtypeStruct`s carrying those shardings, so
    an abstract engine or trainer lays its state out exactly as a real one does."""
    if not is_abstract(tree):
        return jax.device_put(tree, shardings)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of `tree` (arrays or `ShapeDtypeStruct`s with shardings): each leaf's shard
    shape times its item size, summed (a leaf without a sharding counts whole)."""
    total = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(tuple(x.shape)) if sharding is not None else tuple(x.shape)
        total += int(np.prod(shape, dtype=np.int64)) * int(x.dtype.itemsize)
    return total
