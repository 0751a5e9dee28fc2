"""Sparse mixture-of-experts feed-forward of Qwen3.5-MoE, in Flax NNX, routed by grouping tokens per expert.

A port of transformers' `Qwen3_5MoeSparseMoeBlock` (models/qwen3_5_moe/modeling_qwen3_5_moe.py):

    x [tokens, hidden]
      -> router `gate`: logits [tokens, experts]; probs = softmax(logits) in float32 over ALL experts
      -> top-k of probs, renormalised to sum 1 (HF always renormalises in this family), cast to x's dtype
      -> each token's k experts: down(silu(x W_gate) * (x W_up)) weighted by its routing weight, summed
      -> + sigmoid(x w_shared_gate) * shared_expert(x)        (when shared_expert_intermediate_size > 0)

Routing is capacity-free (no token is ever dropped) and never loops over experts: the tokens * k assignments
are sorted by expert and each expert's rows go through one grouped matmul (`grouped_matmul`):
`jax.lax.ragged_dot` on GPU/TPU (grouped-GEMM kernels); on CPU, where XLA lowers ragged_dot densely (every
row against every expert), a megablox-style tiling: each expert's rows are padded to tiles of `TILE` rows and
a `lax.scan` over the tiles multiplies each by its expert's weight, read in place (2.5x faster on CPU than
gathering every tile's weight for one batched matmul). Calls with few assignments (decode: tokens * k <=
experts) gather each assignment's expert weight directly (tile of 1, no sort, one batched matmul).

Expert parallelism: expert weights carry the logical axis `expert` (mesh axes `expert` and `fsdp`, see
`partitioning.DEFAULT_RULES`) on their leading dim, and `mlp` (mesh axis `tensor`) on their hidden dim. Once
`bind_mesh(model, mesh)` has told the MoE layers the mesh (`load_hf(mesh=)`, `init_model(mesh=)`,
`shard_model`, the engine and the trainer do it), the expert computation runs under `shard_map`: each device
holds experts [e0, e0 + E / n_expert) (and a slice of their hidden dim), computes those experts' contribution
for the tokens of its data shard, and one `psum` over (`expert`, `tensor`) combines them. Router, shared
expert and everything else stay plain GSPMD.

Router statistics for a load-balancing loss: after `collect_router_stats(model)`, every MoE layer sows into
`nnx.Intermediate` "router_stats" the per-expert assignment counts and summed router probabilities over real
(mask True) tokens; `pop_router_stats(model)` sums them over layers and `load_balancing_loss` turns them into
transformers' `load_balancing_loss_func` value (experts * sum_e f_e * P_e).

Parameters (ours -> HF, see `hf_io`):
  gate.kernel                  [hidden, experts]          <- mlp.gate.weight [experts, hidden]
  experts.gate_up_proj         [experts, hidden, 2, moe]  <- mlp.experts.gate_up_proj [experts, 2*moe, hidden]
                                                             (gate rows first) or experts.{j}.{gate,up}_proj
  experts.down_proj            [experts, moe, hidden]     <- mlp.experts.down_proj [experts, hidden, moe]
                                                             or experts.{j}.down_proj.weight
  shared_expert.{gate,up,down}_proj, shared_expert_gate.kernel [hidden, 1]
Optional LoRA on the experts (`add_expert_lora`): `nnx.LoRAParam`s `{gate_up,down}_lora_{a,b}` per expert.
"""

from __future__ import annotations

import math
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from librarian_jax.models.config import ModelConfig
from librarian_jax.models.layers import INIT_STD, MLP, dense
from librarian_jax.models.partitioning import logical_to_spec, normalize_rules

GROUPED_MATMUL = "auto"
"""`grouped_matmul` implementation: "auto" (ragged_dot on GPU/TPU, tiles on CPU), "ragged" or "tiled"."""

TILE = 64
"""Rows per tile of the CPU grouped matmul."""

GATE_UP_AXES = ("expert", None, None, "mlp")
DOWN_AXES = ("expert", "mlp", None)


def _param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


# ----------------------------------------------------------------------------------------------- routing


def route(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Router logits `[tokens, experts]` -> (probs float32 `[tokens, experts]`, weights float32 `[tokens, k]`
    renormalised to sum 1, expert ids int32 `[tokens, k]`), as HF's `Qwen3_5MoeTopKRouter`."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_w, top_i = jax.lax.top_k(probs, k)
    top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return probs, top_w, top_i.astype(jnp.int32)


def _implementation() -> str:
    if GROUPED_MATMUL != "auto":
        return GROUPED_MATMUL
    return "tiled" if jax.default_backend() == "cpu" else "ragged"


class Plan:
    """How the `[assignments]` rows of one call are grouped by expert (built once, used by every matmul).

    expert `[a]` int32 local expert id of each assignment (num_local for assignments of other devices'
    experts); the grouped layout holds `rows` rows; `dest` `[a]` is each assignment's row there (`rows` when
    it is not local: dropped); per group either `group_sizes` `[num_local]` (ragged) or `tile_expert`
    `[rows / tile]` (tiled, tile rows each).
    """

    def __init__(self, expert: jax.Array, num_local: int, impl: str, tile: int = TILE):
        a = expert.shape[0]
        self.num_local = num_local
        local = expert < num_local
        self.local = local
        if impl == "gather" or (impl == "tiled" and a <= num_local):
            # one row per assignment, its own expert's weights gathered: no sort, no padding
            self.impl, self.tile, self.rows = "tiled", 1, a
            self.dest = jnp.where(local, jnp.arange(a, dtype=jnp.int32), a)
            self.tile_expert = jnp.minimum(expert, num_local - 1)
            return
        order = jnp.argsort(expert, stable=True)
        counts = jnp.zeros((num_local + 1,), jnp.int32).at[expert].add(1)[:num_local]
        self.impl = impl
        if impl == "ragged":
            rank = jnp.empty((a,), jnp.int32).at[order].set(jnp.arange(a, dtype=jnp.int32))
            self.rows, self.tile = a, 1
            self.dest = jnp.where(local, rank, a)
            self.group_sizes = counts
            return
        # tiled: expert e's rows start at tile boundary tile_start[e] * tile
        tiles = (counts + tile - 1) // tile
        ends = jnp.cumsum(tiles)
        tile_start = ends - tiles
        group_start = jnp.cumsum(counts) - counts
        n_tiles = a // tile + min(num_local, a)  # sum_e ceil(c_e / tile) <= a / tile + #non-empty groups
        self.impl, self.tile, self.rows = "tiled", tile, n_tiles * tile
        pos = jnp.empty((a,), jnp.int32).at[order].set(jnp.arange(a, dtype=jnp.int32))  # rank in the sort
        e = jnp.minimum(expert, num_local - 1)
        self.dest = jnp.where(local, tile_start[e] * tile + pos - group_start[e], self.rows)
        self.tile_expert = jnp.minimum(
            jnp.searchsorted(ends, jnp.arange(n_tiles, dtype=jnp.int32), side="right"), num_local - 1
        ).astype(jnp.int32)

    def scatter(self, x: jax.Array) -> jax.Array:
        """Assignment rows `[a, d]` -> grouped rows `[rows, d]` (empty rows zero)."""
        return jnp.zeros((self.rows, x.shape[-1]), x.dtype).at[self.dest].set(x, mode="drop")

    def gather(self, y: jax.Array) -> jax.Array:
        """Grouped rows `[rows, d]` -> assignment rows `[a, d]` (0 for other devices' assignments)."""
        out = y.at[jnp.minimum(self.dest, self.rows - 1)].get()
        return jnp.where(self.local[:, None], out, jnp.zeros((), y.dtype))

    def matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """Grouped rows x `[rows, d_in]` times each group's w `[num_local, d_in, d_out]` -> `[rows, d_out]`.
        """
        return grouped_matmul(x, w, self)


def grouped_matmul(x: jax.Array, w: jax.Array, plan: Plan) -> jax.Array:
    """x `[rows, d_in]` grouped by expert as `plan` says, w `[experts, d_in, d_out]` -> `[rows, d_out]`."""
    if plan.impl == "ragged":
        return jax.lax.ragged_dot(x, w, plan.group_sizes, preferred_element_type=x.dtype)
    t = plan.tile
    xt = x.reshape(plan.rows // t, t, x.shape[-1])
    if t == 1:  # one row per assignment: its expert's weight gathered, one batched matmul
        return jnp.einsum("ntd,nde->nte", xt, w[plan.tile_expert]).reshape(plan.rows, w.shape[-1])

    def tile_matmul(carry: None, args: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        xi, e = args  # [t, d_in], its expert
        return carry, xi @ jax.lax.dynamic_index_in_dim(w, e, keepdims=False)

    _, y = jax.lax.scan(tile_matmul, None, (xt, plan.tile_expert))
    return y.reshape(plan.rows, w.shape[-1])


def expert_ffn(
    x: jax.Array,
    top_w: jax.Array,
    top_i: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    *,
    first_expert: jax.Array | int = 0,
    lora: dict[str, jax.Array] | None = None,
    lora_scale: float = 1.0,
    impl: str | None = None,
) -> jax.Array:
    """The routed experts' output for the experts held here.

    x `[tokens, hidden]`; top_w float32 / top_i int32 `[tokens, k]` (global expert ids); gate_up
    `[local_experts, hidden, 2, moe]`, down `[local_experts, moe, hidden]` for experts first_expert ..
    first_expert + local_experts - 1. lora: optional {"gate_up_a" `[le, hidden, r]`, "gate_up_b"
    `[le, r, 2 * moe]`, "down_a" `[le, moe, r]`, "down_b" `[le, r, hidden]`} scaled by lora_scale.
    Returns `[tokens, hidden]` in x's dtype: sum over this device's experts of weight * expert(x).
    """
    t, k = top_i.shape
    h = x.shape[-1]
    ne, _, _, moe = gate_up.shape
    expert = top_i.reshape(-1) - first_expert
    expert = jnp.where((expert >= 0) & (expert < ne), expert, ne).astype(jnp.int32)
    plan = Plan(expert, ne, impl or _implementation())
    xs = plan.scatter(jnp.repeat(x, k, axis=0))  # [rows, hidden]; assignment j is token j // k
    w1 = gate_up.reshape(ne, h, 2 * moe).astype(x.dtype)
    hid = plan.matmul(xs, w1)
    if lora is not None:
        hid = hid + lora_scale * plan.matmul(plan.matmul(xs, lora["gate_up_a"]), lora["gate_up_b"])
    g, u = hid[:, :moe], hid[:, moe:]
    act = jax.nn.silu(g) * u
    y = plan.matmul(act, down.astype(x.dtype))
    if lora is not None:
        y = y + lora_scale * plan.matmul(plan.matmul(act, lora["down_a"]), lora["down_b"])
    y = plan.gather(y).astype(jnp.float32) * top_w.reshape(-1, 1)
    return jnp.sum(y.reshape(t, k, h), axis=1).astype(x.dtype)


# ----------------------------------------------------------------------------------------------- modules


class Experts(nnx.Module):
    """The routed experts' weights `gate_up_proj` `[experts, hidden, 2, moe]` (gate, up) and `down_proj`
    `[experts, moe, hidden]`, with the logical axes `GATE_UP_AXES` / `DOWN_AXES`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        e, h, m = config.num_experts, config.hidden_size, config.moe_intermediate_size
        dt = config.jnp_param_dtype
        init = nnx.initializers.normal(INIT_STD)
        self.gate_up_proj = _param(init(rngs.params(), (e, h, 2, m), dt), GATE_UP_AXES)
        self.down_proj = _param(init(rngs.params(), (e, m, h), dt), DOWN_AXES)


class SparseMoE(nnx.Module):
    """Qwen3.5-MoE feed-forward: top-k routed experts plus an optional sigmoid-gated shared expert."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.gate = dense(config, config.hidden_size, config.num_experts, ("embed", None), rngs)
        self.experts = Experts(config, rngs=rngs)
        self.has_shared = config.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(config.replace(intermediate_size=config.shared_expert_intermediate_size),
                                     rngs=rngs)
            self.shared_expert_gate = dense(config, config.hidden_size, 1, ("embed", None), rngs)
        # static: set by bind_mesh / collect_router_stats / add_expert_lora
        self.mesh: Mesh | None = None
        self.rules: tuple[tuple[str, Any], ...] | None = None
        self.collect_stats = False
        self.lora_scale = 0.0

    def _lora(self) -> dict[str, jax.Array] | None:
        if not self.lora_scale:
            return None
        return {n: getattr(self.experts, n)[...] for n in ("gate_up_a", "gate_up_b", "down_a", "down_b")}

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """x `[batch, seq, hidden]` (mask bool `[batch, seq]`, only for router statistics) -> same shape."""
        b, s, h = x.shape
        xf = x.reshape(b * s, h)
        logits = self.gate(xf)
        probs, top_w, top_i = route(logits, self.top_k)
        if self.collect_stats:
            valid = jnp.ones((b * s,), jnp.float32) if mask is None else mask.reshape(-1).astype(jnp.float32)
            counts = jnp.zeros((self.num_experts,), jnp.float32).at[top_i].add(
                jnp.broadcast_to(valid[:, None], top_i.shape))
            self.sow(nnx.Intermediate, "router_stats", {
                "counts": counts, "prob_sum": jnp.sum(probs * valid[:, None], axis=0),
                "tokens": jnp.sum(valid), "layers": jnp.ones((), jnp.float32),
            })
        gate_up, down = self.experts.gate_up_proj[...], self.experts.down_proj[...]
        lora = self._lora()
        if self.mesh is None:
            out = expert_ffn(xf, top_w, top_i, gate_up, down, lora=lora, lora_scale=self.lora_scale)
        else:
            out = self._expert_parallel(xf, top_w, top_i, gate_up, down, lora)
        if self.has_shared:
            shared = self.shared_expert(xf[None])[0]
            out = out + jax.nn.sigmoid(self.shared_expert_gate(xf)) * shared
        return out.reshape(b, s, h)

    def _expert_parallel(self, x, top_w, top_i, gate_up, down, lora):
        """`expert_ffn` under shard_map: experts split over `expert`, their hidden dim over `tensor`, tokens
        over the data axes; one psum combines the partial outputs."""
        mesh, rules = self.mesh, normalize_rules(self.rules or None)
        spec_gu = logical_to_spec(GATE_UP_AXES, mesh, rules, gate_up.shape)
        spec_dn = logical_to_spec(DOWN_AXES, mesh, rules, down.shape)
        if spec_gu[3] != spec_dn[1] or spec_gu[0] != spec_dn[0]:  # both need the same split to pair up
            spec_gu = PartitionSpec(spec_dn[0] if spec_gu[0] == spec_dn[0] else None, None, None, None)
            spec_dn = PartitionSpec(spec_gu[0], None, None)
        t = x.shape[0]
        expert_axes = _names(spec_gu[0])
        # tokens split over the data axes the experts are not split over (a device needs every token that
        # may reach its experts)
        dp = tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1 and a not in expert_axes)
        if dp and t % math.prod(mesh.shape[a] for a in dp):
            dp = ()
        tok = PartitionSpec(dp or None, None)
        reduce_axes = tuple(a for a in (*expert_axes, *_names(spec_gu[3])) if a)
        n_local = gate_up.shape[0] // math.prod(mesh.shape[a] for a in expert_axes) if expert_axes else \
            gate_up.shape[0]
        lora_specs = None
        if lora is not None:
            e = spec_gu[0]
            # split over experts like the experts; each device slices its tensor share inside the body
            lora_specs = {n: PartitionSpec(e, None, None)
                          for n in ("gate_up_a", "gate_up_b", "down_a", "down_b")}
        scale = self.lora_scale

        def body(x, top_w, top_i, gate_up, down, lora):
            first = 0
            if expert_axes:
                idx = 0
                for a in expert_axes:
                    idx = idx * mesh.shape[a] + jax.lax.axis_index(a)
                first = idx * n_local
            if lora is not None and spec_gu[3] is not None:
                # LoRA's gate_up B is replicated over tensor: take this device's slice of (gate, up) columns
                moe_l, r = gate_up.shape[3], lora["gate_up_b"].shape[1]
                ti = jax.lax.axis_index(spec_gu[3])
                bb = lora["gate_up_b"].reshape(n_local, r, 2, -1)
                bb = jax.lax.dynamic_slice_in_dim(bb, ti * moe_l, moe_l, axis=3)
                bb = bb.reshape(n_local, r, 2 * moe_l)
                da = jax.lax.dynamic_slice_in_dim(lora["down_a"], ti * moe_l, moe_l, axis=1)
                # down's LoRA A rows over moe are split too, so the psum adds each slice once
                lora = dict(lora, gate_up_b=bb, down_a=da)
            y = expert_ffn(x, top_w, top_i, gate_up, down, first_expert=first, lora=lora, lora_scale=scale)
            return jax.lax.psum(y, reduce_axes) if reduce_axes else y

        fn = jax.shard_map(
            body, mesh=mesh,
            in_specs=(tok, tok, tok, spec_gu, spec_dn, lora_specs),
            out_specs=tok, check_vma=False,
        )
        return fn(x, top_w, top_i, gate_up, down, lora)


def _names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


# ----------------------------------------------------------------------------------------------- helpers


def moe_layers(model: nnx.Module) -> list[SparseMoE]:
    return [m for _, m in nnx.iter_graph(model) if isinstance(m, SparseMoE)]


def bind_mesh(model: nnx.Module, mesh: Mesh | None, rules: Any = None) -> bool:
    """Tells every MoE layer of `model` the mesh its expert weights live on (None: run unsharded). Returns
    True when some layer changed (the model's graphdef changed: split it again)."""
    if mesh is not None and mesh.size == 1:
        mesh = None
    frozen = None if rules is None else tuple(sorted(
        (k, tuple(v) if isinstance(v, list) else v) for k, v in normalize_rules(rules).items()))
    changed = False
    for m in moe_layers(model):
        if m.mesh is not mesh or m.rules != frozen:
            m.mesh, m.rules = mesh, (frozen if mesh is not None else None)
            changed = True
    return changed


def collect_router_stats(model: nnx.Module, on: bool = True) -> bool:
    """Makes every MoE layer sow its router statistics (see module doc); False when the model has none."""
    layers = moe_layers(model)
    for m in layers:
        m.collect_stats = on
    return bool(layers)


def pop_router_stats(model: nnx.Module) -> dict[str, jax.Array] | None:
    """Removes the sown router statistics and returns their sum over layers ({"counts" `[experts]`,
    "prob_sum" `[experts]`, "tokens", "layers"}), or None when nothing was sown."""
    total = None
    for m in moe_layers(model):
        stats = getattr(m, "router_stats", None)
        if stats is None:
            continue
        delattr(m, "router_stats")
        for one in stats.get_value():
            total = one if total is None else jax.tree.map(jnp.add, total, one)
    return total


def load_balancing_loss(stats: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(aux loss, expert load `[experts]`) from summed router statistics.

    aux = experts * sum_e f_e * P_e with f_e = assignments to e / routed tokens and P_e = mean router
    probability of e, over every layer's tokens pooled (transformers' `load_balancing_loss_func`, which
    sums f over the k slots). load_e = experts * share of all assignments that went to e: 1.0 everywhere
    when perfectly balanced."""
    n = jnp.maximum(stats["tokens"], 1.0)
    counts = stats["counts"]
    e = counts.shape[-1]
    aux = e * jnp.sum(counts / n * stats["prob_sum"] / n)
    return aux, counts * e / jnp.maximum(jnp.sum(counts), 1.0)


def add_expert_lora(model: nnx.Module, rank: int, alpha: float, *, seed: int = 0) -> int:
    """Adds LoRA adapters (`nnx.LoRAParam`: A he-uniform, B zero, scale alpha / rank, as qwix) to the
    routed experts' gate_up and down projections of every MoE layer (qwix does not intercept grouped
    matmuls). Returns the number of layers adapted."""
    key = jax.random.key(seed)
    layers = moe_layers(model)
    for i, m in enumerate(layers):
        ex = m.experts
        e, h, _, moe = ex.gate_up_proj.get_value().shape
        dt = ex.gate_up_proj.get_value().dtype
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        he = nnx.initializers.he_uniform()
        ex.gate_up_a = nnx.LoRAParam(he(k1, (e, h, rank), dt), out_sharding=("expert", None, None),
                                     eager_sharding=False)
        ex.gate_up_b = nnx.LoRAParam(jnp.zeros((e, rank, 2 * moe), dt), out_sharding=("expert", None, None),
                                     eager_sharding=False)
        ex.down_a = nnx.LoRAParam(he(k2, (e, moe, rank), dt), out_sharding=("expert", None, None),
                                  eager_sharding=False)
        ex.down_b = nnx.LoRAParam(jnp.zeros((e, rank, h), dt), out_sharding=("expert", None, None),
                                  eager_sharding=False)
        m.lora_scale = alpha / rank
    return len(layers)
