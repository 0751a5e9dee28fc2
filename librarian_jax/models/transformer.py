"""The decoder-only transformer shared by Qwen3, Gemma 3 text, Llama 3, the Qwen3.5 hybrid and Qwen3.5-MoE.

    logits, cache = model(tokens, positions=None, cache=None, mask=None)

One call serves training/scoring (no cache), chunked prefill and single-token decode (with a cache whose rows
may hold different lengths); see `Transformer.__call__`. `scan_layers=True` runs the decoder layers under one
`lax.scan` per repeating layer pattern, with or without a cache, so a compiled program holds each distinct
layer once instead of once per layer (see `Transformer.hidden`, `scan_plan`, `run_layer_scan` and
`models.cache.ScanCache`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import struct
from flax.nnx import graphlib
from jax.sharding import Mesh

from librarian_jax.models.cache import Cache, ScanCache, layout_of, stack_cache, unstack_cache
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


# ----------------------------------------------------------------------------------------------- layer scan


def remat_call(layer: nnx.Module, *args: Any, **kwargs: Any) -> Any:
    """`layer(*args, **kwargs)` under `jax.checkpoint` with nothing saved but its inputs (the backward pass
    recomputes the layer). The layer is split and merged inside the checkpoint, so modules that write to
    themselves when called (qwix's LoRA interception) stay in one trace; what the layer sows
    (`nnx.Intermediate`: MoE router statistics) is put back into `layer`. Array leaves of the arguments go
    through the checkpoint; anything else (python scalars, strings, None) is closed over as static."""
    graphdef, state = nnx.split(layer)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    is_array = [isinstance(x, jax.Array | np.ndarray) for x in leaves]

    @jax.checkpoint
    def call(state: Any, arrays: list) -> Any:
        it = iter(arrays)
        a, kw = jax.tree.unflatten(treedef, [next(it) if arr else x for x, arr in zip(leaves, is_array,
                                                                                     strict=True)])
        m = nnx.merge(graphdef, state)
        return m(*a, **kw), nnx.pop(m, nnx.Intermediate)

    out, sown = call(state, [x for x, arr in zip(leaves, is_array, strict=True) if arr])
    nnx.update(layer, sown)
    return out


@dataclasses.dataclass(frozen=True)
class ScanPlan:
    """How `Transformer.hidden` runs its layers without a cache: layers [0, period * periods) as `periods`
    iterations of one `lax.scan` whose body calls `period` layers (layer k + j * period at iteration j), the
    rest one by one. `period == 0`: every layer one by one, `reason` says why."""

    period: int
    periods: int
    reason: str = ""

    @property
    def scanned(self) -> int:
        return self.period * self.periods


def _qwix_rules(model: nnx.Module) -> list[Any] | None:
    """The LoRA / quantization rules of a qwix-wrapped model (found in the closure of its intercepted
    methods), or None where they cannot be found."""
    stack: list[Any] = [getattr(type(model), n, None) for n in ("hidden", "__call__")]
    seen: set[int] = set()
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen or len(seen) > 1000:
            continue
        seen.add(id(obj))
        rules = getattr(obj, "_rules", None)
        if isinstance(rules, list | tuple) and all(hasattr(r, "module_path") for r in rules):
            return list(rules)
        if isinstance(obj, functools.partial):
            stack += [obj.func, *obj.args, *obj.keywords.values()]
        elif callable(obj):
            stack += [c.cell_contents for c in (getattr(obj, "__closure__", None) or ())
                      if c is not None and _cell_filled(c)]
            stack.append(getattr(obj, "__wrapped__", None))
    return None


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell
        return False
    return True


def _layer_signature(layer: nnx.Module) -> tuple[Any, ...]:
    """What two layers must share to run as the same scan body: layer type, graph (static attributes: norms,
    windows, MoE mesh, ...; qwix's per-module `qwix_path` with its layer index dropped) and every variable's
    path, type, shape and dtype."""
    graphdef, state = nnx.split(layer)
    attributes = []
    for name, attr in graphdef.attributes:
        if name == "qwix_path" and isinstance(attr, graphlib.Static) and isinstance(attr.value, tuple):
            attr = graphlib.Static(tuple(None if i == 1 else x for i, x in enumerate(attr.value)))
        attributes.append((name, attr))
    graphdef = dataclasses.replace(graphdef, attributes=attributes)
    leaves = tuple((x.shape, x.dtype) for x in jax.tree.leaves(state))
    return (getattr(layer, "layer_type", None), graphdef, jax.tree.structure(state), leaves)


def _rule_matches(layer: nnx.Module, rules: list[Any]) -> list[tuple[int, ...]]:
    """For each module of `layer` (graph order): the indices of the qwix rules whose module_path matches its
    `qwix_path` (what qwix looks up when the module runs)."""
    out = []
    for _, m in nnx.iter_graph(layer):
        if isinstance(m, nnx.Module):
            path = "/".join(map(str, getattr(m, "qwix_path", ())))
            out.append(tuple(i for i, r in enumerate(rules) if re.fullmatch(r.module_path, path)))
    return out


def scan_plan(layers: list[nnx.Module], model: nnx.Module | None = None) -> ScanPlan:
    """The scan of `layers` that leaves the fewest layers for XLA to compile.

    Each layer gets a signature (`_layer_signature`). For each period p, periods(p) is the number of whole
    periods from layer 0 over which signature[i] == signature[i % p]; among the p with periods(p) >= 2 the
    plan takes the one minimising p + (layers - p * periods(p)) (body plus unrolled remainder), the smallest
    p on ties: Qwen3 / Llama 3 p = 1 over every layer; Gemma 3 (5 sliding, 1 global) p = 6 with the
    remainder (26 layers: 4 periods + 2) unrolled; Qwen3.5 (3 DeltaNet, 1 attention) p = 4.

    Not scanned (period 0, `reason` set): fewer than 2 periods of any pattern; a layer that already holds
    `nnx.Intermediate` values (a scan could not append to them as `sow` does); a qwix model whose rules
    cannot be found or match the modules of two layers of the same period position differently (the body
    runs layer k's modules, whose `qwix_path` selects the rule, for every layer k + j * p). `model` is the
    top module, for its qwix rules.
    """
    n = len(layers)
    if n < 2:
        return ScanPlan(0, 0, f"{n} layer(s)")
    for i, layer in enumerate(layers):
        if jax.tree.leaves(nnx.state(layer, nnx.Intermediate)):
            return ScanPlan(0, 0, f"layer {i} holds nnx.Intermediate values")
    sigs = [_layer_signature(x) for x in layers]
    best: tuple[int, int, int] | None = None  # (compiled layers, period, periods)
    for p in range(1, n // 2 + 1):
        periods = 0
        while (periods + 1) * p <= n and all(sigs[periods * p + k] == sigs[k] for k in range(p)):
            periods += 1
        if periods >= 2:
            cost = p + n - p * periods
            if best is None or cost < best[0]:
                best = (cost, p, periods)
    if best is None:
        return ScanPlan(0, 0, "no layer pattern repeats twice from layer 0")
    _, p, periods = best
    if model is not None and hasattr(type(model), "_unquantized_type"):  # qwix-wrapped
        rules = _qwix_rules(model)
        if rules is None:
            return ScanPlan(0, 0, "a qwix model whose rules were not found")
        for i in range(p, p * periods):
            if _rule_matches(layers[i], rules) != _rule_matches(layers[i % p], rules):
                return ScanPlan(0, 0, f"qwix rules match layer {i} and layer {i % p} differently")
    return ScanPlan(p, periods)


class _StructureChanged(Exception):
    """A layer's graph changed while it ran inside the scan body (e.g. it created a variable)."""


@struct.dataclass
class LayerStack:
    """The layers a `ScanPlan` scans, with their variables stacked: `states[k]` holds layers k, k + period,
    k + 2 * period, ... along a new leading axis `[periods, ...]`, `graphdefs[k]` is layer k's graph.

    `Transformer.layer_stack()` builds one. A program that calls the model many times (the engine's decode
    loop) builds it once, outside its loop, and passes it to every call (`hidden(layer_stack=...)`), so the
    variables are stacked once per program run instead of once per call.
    """

    states: tuple[Any, ...]
    graphdefs: tuple[Any, ...] = struct.field(pytree_node=False)
    plan: ScanPlan = struct.field(pytree_node=False)


def stack_layers(layers: list[nnx.Module], plan: ScanPlan,
                 states: tuple[Any, ...] | None = None) -> LayerStack:
    """`layers`' variables stacked for `plan` (see `LayerStack`; a copy of the scanned layers' variables),
    or, given `states` (the `states` of a `LayerStack` of the same layers, stacked before), those with the
    layers' graphdefs."""
    p, n = plan.period, plan.periods
    graphdefs = tuple(nnx.graphdef(layers[k]) for k in range(p))
    if states is None:
        states = tuple(jax.tree.map(lambda *a: jnp.stack(a), *[nnx.state(layers[k + j * p])
                                                               for j in range(n)])
                       for k in range(p))
    elif len(states) != p:
        raise ValueError(f"stack_layers: {len(states)} stacked states for a period of {p}")
    return LayerStack(states=tuple(states), graphdefs=graphdefs, plan=plan)


def _layer_slot(group: dict[str, jax.Array], j: jax.Array) -> dict[str, jax.Array]:
    """What a scanned layer gets as its cache from the stacked `group` at iteration `j`: attention layers the
    whole stacked K/V and the index (`Attention` writes its new tokens in place and reads its own slice);
    other layers (Gated DeltaNet, whose state is rewritten whole each call) their slice."""
    if layout_of(group) is not None:
        return {**group, "layer": j}
    return {name: jax.lax.dynamic_index_in_dim(a, j, 1, keepdims=False) for name, a in group.items()}


def _put_layer_slot(group: dict[str, jax.Array], new: dict[str, jax.Array],
                    j: jax.Array) -> dict[str, jax.Array]:
    """The stacked `group` after the layer at iteration `j` returned `new` (from a `_layer_slot` cache)."""
    if layout_of(group) is not None:
        return {name: new[name] for name in group}
    return {name: jax.lax.dynamic_update_index_in_dim(a, new[name].astype(a.dtype), j, 1)
            for name, a in group.items()}


def run_layer_scan(layers: list[nnx.Module], stack: LayerStack, x: jax.Array, ropes: dict[str, Any],
                   mask: jax.Array, *, remat: bool = False,
                   cache_groups: tuple[dict[str, Any], ...] | None = None,
                   lengths: jax.Array | None = None) -> tuple[jax.Array, tuple[dict[str, Any], ...] | None]:
    """Runs layers [0, plan.scanned) over x `[batch, seq, hidden]` under one `lax.scan`; returns (`[batch,
    seq, hidden]`, the new cache groups or None). Raises `_StructureChanged` (caught by the caller, which
    then runs the loop) when a layer changes its graph while called.

    `stack` holds the layers' variables stacked (`stack_layers`: the states of layers k, k + p, ..., same
    signature, see `scan_plan`, along a new leading axis `[periods, ...]`); the scan body merges iteration
    j's slice of each of the p states with layer k's graphdef and calls it. Stacking costs one copy of the
    layers' variables (cheap next to a train step's activations and optimizer; the gradient flows back
    through the stack to each layer's own params). Whatever a layer sows while called (`nnx.Intermediate`:
    MoE router statistics) leaves the body as a scan output `[periods, ...]` and is put back into its layer,
    as if called one by one. `remat`: each layer call inside the body is checkpointed with nothing saved but
    its inputs (train.remat="layer").

    With `cache_groups` (the `groups` of a `models.cache.ScanCache`: group k's leaves `[batch, periods,
    ...]` hold the caches of layers k, k + p, ...) and `lengths` int32 `[batch]`, the layers read and write
    their caches as in the loop; the groups are carried through the scan and updated in place (attention
    writes only its new tokens' K/V, at `[row, j, ..., position]`; each layer reads its own K/V slice).
    """
    p, n = stack.plan.period, stack.plan.periods

    def one_layer(k: int, state: Any, x: jax.Array, ropes: dict[str, Any], mask: jax.Array,
                  cache: dict[str, Any] | None, lengths: jax.Array | None) -> Any:
        m = nnx.merge(stack.graphdefs[k], state)
        y, new_cache = m(x, ropes.get(m.layer_type), mask=mask, cache=cache, lengths=lengths)
        sown = nnx.pop(m, nnx.Intermediate)
        if nnx.graphdef(m) != stack.graphdefs[k]:
            raise _StructureChanged(f"layer {k} changed its graph when called")
        return y, new_cache, sown

    calls = [functools.partial(one_layer, k) for k in range(p)]
    if remat:
        calls = [jax.checkpoint(c) for c in calls]

    def body(carry: tuple[jax.Array, Any], xs: tuple[tuple[Any, ...], jax.Array]) -> tuple[Any, Any]:
        x, groups = carry
        states, j = xs
        sown, new_groups = [], []
        for k in range(p):
            if groups is None:
                x, _, s = calls[k](states[k], x, ropes, mask, None, None)
            else:
                x, new, s = calls[k](states[k], x, ropes, mask, _layer_slot(groups[k], j), lengths)
                new_groups.append(_put_layer_slot(groups[k], new, j))
            sown.append(s)
        return (x, None if groups is None else tuple(new_groups)), tuple(sown)

    (x, groups), sown = jax.lax.scan(body, (x, cache_groups), (stack.states, jnp.arange(n, dtype=jnp.int32)))
    for k in range(p):
        if jax.tree.leaves(sown[k]):
            for j in range(n):
                nnx.update(layers[k + j * p], jax.tree.map(lambda a, j=j: a[j], sown[k]))
    return x, groups


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
        scan_layers: bool = False,
        remat_layers: bool = False,
        layer_stack: LayerStack | None = None,
    ) -> tuple[jax.Array, Cache | ScanCache | None]:
        """tokens int32 `[batch, seq]` -> (logits float32 `[batch, seq, vocab]`, cache).

        Without `cache`: positions default to arange(seq), causal attention, `mask` (bool `[batch, seq]`,
        True = real token, padding a suffix) defaults to all True; returns (logits, None).
        With `cache`: token t of row b sits at position cache.lengths[b] + t and sees every cached position
        < lengths[b] plus the new tokens up to t; padded tokens (mask False) are never written to the cache,
        so they never change what later tokens see; returns the cache with lengths + mask.sum(1).
        The caller keeps lengths[b] + mask[b].sum() <= max_len (writes past the end are dropped).
        `positions` (int32 `[batch, seq]`) only overrides the RoPE positions.
        `scan_layers` / `remat_layers` / `layer_stack`, and a `ScanCache` for `cache`: see `hidden` (the
        values are the same either way).
        """
        hidden, cache = self.hidden(tokens, positions=positions, cache=cache, mask=mask,
                                    scan_layers=scan_layers, remat_layers=remat_layers,
                                    layer_stack=layer_stack)
        return self.project(hidden), cache

    def hidden(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        cache: Cache | ScanCache | None = None,
        mask: jax.Array | None = None,
        scan_layers: bool = False,
        remat_layers: bool = False,
        layer_stack: LayerStack | None = None,
    ) -> tuple[jax.Array, Cache | ScanCache | None]:
        """As `__call__` but returns the final-norm hidden states `[batch, seq, hidden]` (activation dtype)
        instead of logits, so callers can project only the positions they need (see `project`).

        `scan_layers` (the trainer's `train.scan_layers`, the engine's `scan_layers`): layers that repeat a
        pattern run under one `lax.scan` (`scan_plan`, `run_layer_scan`), so the compiled program holds each
        distinct layer once, not once per layer: compile time stops growing with depth. Same values as the
        loop; the parameter layout (`self.layers[i]`) is unchanged, the stacking happens inside the trace
        (`layer_stack`: the stack a caller built once with `self.layer_stack()`, implies `scan_layers`).
        A model the plan cannot scan runs the loop (logged at INFO with the reason).
        With a cache: a `Cache` is stacked for the scan and unstacked after it (one copy of the cache each
        way); a `ScanCache` (what the engine keeps when it scans) is carried through as it is, and returned
        as a `ScanCache`. Without the scan a `ScanCache`'s layers run one by one, each writing its slice in
        place.
        `remat_layers`: each layer call is checkpointed with only its input kept (train.remat="layer"), in
        the scan body as in the loop (`remat_call`).
        """
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
        stacked_in = isinstance(cache, ScanCache)
        if layer_stack is None and scan_layers:
            layer_stack = self.layer_stack()
        layers: list[Any] = [] if cache is None or stacked_in else list(cache.layers)
        groups: list[Any] = list(cache.groups) if stacked_in else []
        rest: list[Any] = list(cache.rest) if stacked_in else []
        grouped = cache.period * cache.periods if stacked_in else 0  # layers held in `groups`
        start = 0
        if layer_stack is not None:
            plan = layer_stack.plan
            if stacked_in and (cache.period, cache.periods) != (plan.period, plan.periods):
                raise ValueError(f"ScanCache of period {cache.period} x {cache.periods} != the layer "
                                 f"scan's {plan.period} x {plan.periods}")
            scan_groups = None
            if stacked_in:
                scan_groups = tuple(groups)
            elif cache is not None:  # one copy of the cache each way
                scan_groups = stack_cache(cache, plan.period, plan.periods).groups
            try:
                x, new_groups = run_layer_scan(list(self.layers), layer_stack, x, ropes, mask,
                                               remat=remat_layers, cache_groups=scan_groups, lengths=lengths)
                start = plan.scanned
                if stacked_in:
                    groups = list(new_groups)
                elif cache is not None:
                    scanned = unstack_cache(ScanCache(lengths=cache.lengths, groups=new_groups, rest=()))
                    layers[:start] = scanned.layers
            except _StructureChanged as e:
                logging.info("scan_layers: running the %d layers one by one: %s", len(self.layers), e)
        # The rest one by one; a ScanCache's stacked layers by their static index into their group.
        for i in range(start, len(self.layers)):
            layer = self.layers[i]
            k, j = (i % cache.period, i // cache.period) if i < grouped else (0, 0)
            if cache is None:
                layer_cache = None
            elif i < grouped:
                layer_cache = _layer_slot(groups[k], j)
            else:
                layer_cache = rest[i - grouped] if stacked_in else layers[i]
            call = functools.partial(remat_call, layer) if remat_layers else layer
            x, new_layer_cache = call(x, ropes.get(layer.layer_type), mask=mask, cache=layer_cache,
                                      lengths=lengths)
            if cache is None:
                continue
            if i < grouped:
                groups[k] = _put_layer_slot(groups[k], new_layer_cache, j)
            elif stacked_in:
                rest[i - grouped] = new_layer_cache
            else:
                layers[i] = new_layer_cache
        x = self.norm(x)
        if cache is None:
            return x, None
        new_lengths = lengths + mask.sum(axis=1, dtype=jnp.int32)
        if stacked_in:
            return x, ScanCache(lengths=new_lengths, groups=tuple(groups), rest=tuple(rest))
        return x, Cache(lengths=new_lengths, layers=tuple(layers))

    def layer_stack(self, states: tuple[Any, ...] | None = None) -> LayerStack | None:
        """This model's layers stacked for a layer scan (`scan_plan`, `stack_layers`; `states`: already
        stacked, e.g. by the engine once per weight update), or None (logged at INFO with the reason) where
        no pattern repeats or the plan cannot scan it."""
        plan = scan_plan(list(self.layers), self)
        if not plan.period:
            logging.info("scan_layers: running the %d layers one by one: %s", len(self.layers), plan.reason)
            return None
        return stack_layers(list(self.layers), plan, states)

    def project(self, hidden: jax.Array) -> jax.Array:
        """hidden `[..., hidden]` -> logits float32 `[..., vocab]` (tied embedding or lm_head, softcapped)."""
        config = self.config
        lead = hidden.shape[:-1]
        flat = hidden.reshape(-1, hidden.shape[-1])  # one 2-D product: its weight gradient copies nothing
        if config.tie_embeddings:                    # (see `layers.Dense`)
            w = self.embed_tokens.embedding[...].astype(hidden.dtype)
            logits = jnp.einsum("te,ve->tv", flat, w, preferred_element_type=jnp.float32)
        else:
            w = self.lm_head.kernel[...].astype(hidden.dtype)
            logits = jnp.einsum("te,ev->tv", flat, w, preferred_element_type=jnp.float32)
        logits = logits.reshape(*lead, logits.shape[-1])
        if config.final_logit_softcapping:
            cap = config.final_logit_softcapping
            logits = jnp.tanh(logits / cap) * cap
        return logits


def init_model(config: ModelConfig, *, seed: int = 0, mesh: Mesh | None = None,
               rules: Rules | None = None) -> Transformer:
    """A randomly initialised Transformer, built in one compiled program.

    With `mesh`, every parameter is created directly in its NamedSharding (logical axes through `rules`),
    so a large model never exists unsharded on one device. The same random draws as
    `Transformer(config, rngs=nnx.Rngs(seed))` (built eagerly, one small program per initialiser), equal up
    to floating-point rounding of the compiled scaling (seen: at most 7.5e-9 on the `tiny` preset).
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
