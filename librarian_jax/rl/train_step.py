"""The GRPO update: one jit-compiled, sharded optimizer step over a batch of training rows.

`Trainer(model, TrainConfig, mesh=None, rules=None)` splits an `nnx.Module` into its trainable parameters
(`nnx.Param`, or only `nnx.LoRAParam` when the model was wrapped by `apply_lora`) and everything else
(frozen), builds an optax AdamW with warmup + cosine/linear decay and global-norm clipping, and compiles
`update(batch)`:

  rows `[rows, seq]` -> `[micro_batches, rows / micro_batches, seq]` -> `lax.scan` over micro-batches
  accumulating loss sums, counts and gradients of the sums -> divide by the total count once (so the
  gradient equals the full-batch gradient exactly) -> clip -> AdamW -> a non-finite loss or gradient keeps
  the old params and optimizer state (the step is logged as skipped; the run goes on).

With `micro_batch_rows > 0` a micro-batch has a fixed size instead (that many rows per data-parallel shard)
and a step runs as many as its rows need: one compiled program adds a micro-batch's sums and gradient sums
to a device-side accumulator, called once per micro-batch from the host, and a second divides, clips and
applies AdamW. The row count is then in no program's shape: a run compiles its update once per sequence
bucket (and loss-position bucket), not once per distinct row count, and pads rows only to one micro-batch.

Memory: log-probs come from the final hidden states `logits_chunk` positions at a time
(`losses.chunked_token_logprobs`, each chunk rematerialised), so no `[rows, seq, vocab]` logits array
exists in the forward or backward pass; `remat` = "full" checkpoints the whole model call, "layer" each
decoder layer. Compile time: with `scan_layers` a `models.Transformer`'s repeating layers run under one
`lax.scan` (`Transformer.hidden`): the step compiles each distinct layer once, not once per layer.
`memory_analysis(batch)` reports what the compiled step needs; `programs_ahead(shapes)` lowers and compiles
the update for batch shapes a caller expects (`update_shape`) before any such batch exists.

One optimizer update per rollout batch. The PPO ratio's old log-probs are either the trainer's own
(`old_logprobs="trainer"`: `stop_gradient(logp)`, exact for one update per batch; TIS then corrects the
sampler/trainer mismatch) or the sampler's (`"sampler"`: the ratio itself measures the mismatch).
With `kl_beta > 0` a frozen reference is kept: the initial params (full fine-tuning) or the base model
(LoRA: the same graph with every LoRA param zeroed, i.e. no adapter).

New weights reach a generation engine with `engine.update_params(trainer.policy_state())`: the state is
made of the device arrays the step produced (no host round trip).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from librarian_jax import compile_cache
from librarian_jax.models import moe as moe_lib
from librarian_jax.models import partitioning
from librarian_jax.models import transformer as transformer_lib
from librarian_jax.rl import losses as losses_lib
from librarian_jax.rl.rows import TrainBatch


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 1e-5
    warmup_steps: int = 0
    decay: str = "cosine"  # "cosine" | "linear" | "constant"
    total_steps: int = 1000
    end_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    loss: losses_lib.LossConfig = dataclasses.field(default_factory=losses_lib.LossConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    micro_batches: int = 1
    old_logprobs: str = "trainer"  # "trainer" | "sampler"
    # "none" | "full" (the whole forward pass, matmul outputs kept) | "layer" (each decoder layer: only its
    # input is kept, everything inside is recomputed). The bools False / True mean "none" / "full".
    remat: bool | str = "none"
    # Log-probs and entropies are computed from the final hidden states `logits_chunk` positions at a time
    # (each chunk rematerialised: at most one chunk's `[rows, chunk, vocab]` logits exist, forward or
    # backward). 0 = one `[rows, seq, vocab]` logits array.
    logits_chunk: int = 1024
    # With `logits_chunk > 0`: "loss" runs the LM head only at the loss-masked positions (gathered per row,
    # `losses.positioned_token_logprobs`; the prompt and observations of a row need no logits), "all" at
    # every position. The loss, its gradient and every metric are the same either way.
    logits_at: str = "loss"
    # Mixture-of-experts models (models/moe.py): weight of transformers' load-balancing loss (experts *
    # sum_e f_e P_e over every MoE layer's real tokens) added to the loss; 0 = only logged. Models without
    # MoE layers ignore it. Metrics `moe_aux_loss`, `expert_load_max` / `expert_load_min` (1.0 = balanced).
    moe_aux_loss_coef: float = 0.0
    # `models.Transformer` policies: run the decoder layers that repeat a pattern under one `lax.scan`
    # (`Transformer.hidden(scan_layers=True)`: params stacked inside the trace, layout unchanged), so the step
    # compiles each distinct layer once instead of once per layer; same loss and gradients as the loop.
    # True: always; False: only from `scan_min_layers` layers on.
    scan_layers: bool = False
    # > 0: a model with at least this many decoder layers scans them even with `scan_layers` False (e.g. 16
    # for deep presets on an accelerator, where the scan is the usual choice); 0: by `scan_layers` alone. 0 by
    # default: on XLA:CPU the scanned step ran 0.89-0.95x the loop's speed at every depth from 4 to 32 (each
    # layer's weights are copied out of the stack), though it compiles 1.6x faster at 32 layers (32.2 -> 20.5
    # s at 8 x 512) and 2.3x at 36 (8 x 1152: 118 -> 52 s); `python -m librarian_jax.bench.compile`.
    scan_min_layers: int = 0
    # > 0: every micro-batch holds this many rows per data-parallel shard and a step runs as many
    # micro-batches as its rows need (a host loop over one compiled program; `micro_batches` is then unused),
    # so a new row count compiles nothing; 0: the step's rows split into `micro_batches` equal micro-batches
    # inside one program, compiled once per row count. Same loss, gradients and update either way.
    micro_batch_rows: int = 0
    # this many updates in a row skipped for a non-finite loss or gradient stop the run (`NonFiniteUpdates`,
    # naming the steps); 0 = never stop. A skipped update leaves params and optimizer state as they were, so
    # no checkpoint ever holds a non-finite update. Host-side only (not part of the compiled step).
    max_skipped_in_a_row: int = 3


REMAT_MODES = ("none", "full", "layer")
LOGITS_AT = ("loss", "all")  # TrainConfig.logits_at
MIN_POSITIONS = 64  # the smallest per-row loss-position bucket (see `loss_positions`)
DECAYS = ("cosine", "linear", "constant")  # OptimConfig.decay
OLD_LOGPROBS = ("trainer", "sampler")  # TrainConfig.old_logprobs


def remat_mode(value: bool | str) -> str:
    """`train.remat` as one of REMAT_MODES (False -> "none", True -> "full"); anything else is an error."""
    if value is True or value is False:
        return "full" if value else "none"
    if isinstance(value, str) and value in REMAT_MODES:
        return value
    raise ValueError(f"train.remat: {value!r} is not one of {list(REMAT_MODES)} (or a bool: False = 'none', "
                     f"True = 'full')")


# ----------------------------------------------------------------------------------------------- optimizer


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Linear warmup from 0 to `learning_rate`, then cosine / linear decay to `end_lr_ratio * lr`."""
    lr, end = cfg.learning_rate, cfg.learning_rate * cfg.end_lr_ratio
    decay_steps = max(cfg.total_steps - cfg.warmup_steps, 1)
    if cfg.decay == "cosine":
        decay = optax.cosine_decay_schedule(lr, decay_steps, alpha=cfg.end_lr_ratio)
    elif cfg.decay == "linear":
        decay = optax.linear_schedule(lr, end, decay_steps)
    elif cfg.decay == "constant":
        decay = optax.constant_schedule(lr)
    else:
        raise ValueError(f"train.optim.decay: unknown schedule {cfg.decay!r}; known: {list(DECAYS)}")
    if cfg.warmup_steps <= 0:
        return decay
    warmup = optax.linear_schedule(0.0, lr, cfg.warmup_steps)
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW's direction (Adam moments + decoupled weight decay), without the
    learning rate: the step applies `-lr(step) * direction` with `lr` from `make_schedule`, computed on the
    host and passed in. This is `optax.adamw(schedule)` exactly, but a schedule change (e.g. a resumed run
    with more steps) does not recompile the step."""
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
    if cfg.weight_decay:
        parts.append(optax.add_decayed_weights(cfg.weight_decay))
    return optax.chain(*parts)


def _static_config(config: TrainConfig) -> TrainConfig:
    """The part of the config the compiled step depends on (the schedule is a runtime input)."""
    o = config.optim
    optim = OptimConfig(learning_rate=0.0, warmup_steps=0, decay="constant", total_steps=0, end_lr_ratio=0.0,
                        b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, grad_clip=o.grad_clip)
    return dataclasses.replace(config, optim=optim, max_skipped_in_a_row=0)


# ----------------------------------------------------------------------------------------------- LoRA


# Every linear projection of every layer type (qwix module paths, matched in full): attention q/k/v/o, Gated
# DeltaNet in_proj_qkv/in_proj_z/in_proj_a/in_proj_b/out_proj, the MLP's and the MoE shared expert's
# gate/up/down, and the routed experts (`models.moe.add_expert_lora`). Not the routers (`mlp/gate`,
# `shared_expert_gate`), not the embedding or lm_head. The old default (attention + MLP names only) missed the
# DeltaNet projections: 24 of Qwen3.5-4B's 32 layers adapted only their MLP.
LORA_ALL_LINEAR = (r".*/(self_attn/[qkvo]_proj"
                   r"|linear_attn/(in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj)"
                   r"|mlp/(shared_expert/)?(gate|up|down)_proj|mlp/experts)")


def apply_lora(model: nnx.Module, rank: int, alpha: float, module_path: str = LORA_ALL_LINEAR, *,
               seed: int = 0,
               example_len: int = 8) -> nnx.Module:
    """Wraps `model` with qwix LoRA adapters (`nnx.LoRAParam`, A he-uniform, B zero) on every matmul whose
    module path matches the regex `module_path`. Returns a new module; the input model is not changed.

    qwix 0.1.8 creates the adapters by running the model once on `example_len` dummy tokens, and applies them
    only inside ONE intercepted method of the top module. For a model with `hidden` (our Transformer, whose
    `__call__` is `project(hidden(...))`) that method is `hidden`, so `model(...)`, `model.hidden(...)` and
    hence the chunked log-probs all see the adapters (intercepting `__call__` would leave `hidden` without
    them). `project` (the lm_head / tied embedding) has no adapter either way.
    """
    import qwix  # local import: only LoRA runs need it

    provider = qwix.LoraProvider(module_path=module_path, rank=rank, alpha=alpha)
    tokens = jnp.zeros((1, example_len), jnp.int32)
    method = "hidden" if callable(getattr(model, "hidden", None)) else "__call__"
    lora_model = qwix.apply_lora_to_model(model, provider, tokens, rngs=nnx.Rngs(seed), methods=(method,))
    # qwix does not intercept the grouped matmuls of MoE experts: their adapters come from models.moe
    if moe_lib.moe_layers(lora_model) and re.fullmatch(module_path, "layers/0/mlp/experts"):
        moe_lib.add_expert_lora(lora_model, rank, alpha, seed=seed)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(lora_model, nnx.LoRAParam)))
    if n == 0:
        raise ValueError(f"apply_lora: module_path {module_path!r} matched no matmul of the model")
    return lora_model


def has_lora(model: nnx.Module) -> bool:
    return bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))


def _lora_applies_in_hidden(model: nnx.Module) -> bool:
    """False for a qwix model whose adapters live only in an intercepted `__call__` (so `hidden` and the
    chunked log-probs would silently run the base model)."""
    cls = type(model)
    return not hasattr(cls, "_unquantized_type") or "hidden" in cls.__dict__


# ----------------------------------------------------------------------------------------------- sharding


def batch_axes(mesh: Mesh | None) -> tuple[str, ...]:
    """Mesh axes the rows of a batch are split over (data and fsdp, where present)."""
    if mesh is None:
        return ()
    return tuple(a for a in ("data", "fsdp") if a in mesh.axis_names and mesh.shape[a] > 1)


def data_parallel_size(mesh: Mesh | None) -> int:
    return int(np.prod([mesh.shape[a] for a in batch_axes(mesh)])) if mesh is not None else 1


def shard_state(state: Any, mesh: Mesh | None, rules: Any = None) -> Any:
    """Places an nnx.State on `mesh` with the logical-axis rules of `models.partitioning` (the one sharding
    owner): the same shardings the policy engine gives these params, so new weights reach it without
    resharding. An abstract state (`partitioning.is_abstract`) gets those shardings as shapes."""
    rules = partitioning.normalize_rules(rules)
    if mesh is not None and partitioning.is_abstract(state):
        return partitioning.place(state, partitioning.state_shardings(state, mesh, rules))
    return partitioning.shard_state(state, mesh, rules)


# ----------------------------------------------------------------------------------------------- trainer


def pad_rows(arrays: Mapping[str, np.ndarray], rows: int, seq: int) -> dict[str, np.ndarray]:
    """Zero-pads every `[R, S...]` / `[R]` array to `rows` rows and `seq` tokens (padding rows weigh 0)."""
    out = {}
    for k, v in arrays.items():
        v = np.asarray(v)
        pad = [(0, rows - v.shape[0])] + ([(0, seq - v.shape[1])] if v.ndim > 1 else [])
        out[k] = np.pad(v, pad + [(0, 0)] * (v.ndim - len(pad)))
    return out


def _blank_rows(rows: int, seq: int, capacity: int) -> dict[str, np.ndarray]:
    """Host rows `[rows, seq]` of zeros with `TrainBatch.arrays()`' keys and dtypes (plus `positions`
    `[rows, capacity]` when `capacity`): the shapes of a batch, for lowering its update ahead of time."""
    out = {"tokens": np.zeros((rows, seq), np.int32), "valid": np.zeros((rows, seq), bool),
           **{k: np.zeros((rows, seq), np.float32) for k in ("loss_mask", "sampler_logprobs", "advantages")},
           "row_weights": np.zeros((rows,), np.float32)}
    if capacity:
        out["positions"] = np.zeros((rows, capacity), np.int32)
    return out


def positions_bucket(count: int, seq: int) -> int:
    """Per-row loss-position capacity for rows holding at most `count` loss tokens out of `seq`: the next
    power of two >= count (at least MIN_POSITIONS), so a run compiles a few step variants, not one per batch;
    0 when that is not below `seq` (every position is then computed, `chunked_token_logprobs`)."""
    k = MIN_POSITIONS
    while k < count:
        k *= 2
    return k if k < seq else 0


def most_loss_tokens(loss_mask: np.ndarray) -> int:
    """The most loss tokens in one row of `loss_mask` `[R, S]` (position 0 never counts: nothing predicts it);
    it sizes the per-row positions the LM head runs at (`positions_bucket`)."""
    mask = np.asarray(loss_mask) > 0
    return int(mask[:, 1:].sum(axis=1).max()) if mask.size else 0


def loss_positions(loss_mask: np.ndarray, capacity: int) -> np.ndarray:
    """`[R, capacity]` int32: each row's loss-masked token positions in order, padded with 0 (position 0 is
    never a loss token: nothing predicts it). loss_mask `[R, S]`; every row must fit in `capacity`."""
    mask = np.asarray(loss_mask) > 0
    mask[:, 0] = False
    counts = mask.sum(axis=1)
    if counts.size and counts.max() > capacity:
        raise ValueError(f"loss_positions: a row has {counts.max()} loss tokens, more than {capacity}")
    out = np.zeros((mask.shape[0], capacity), np.int32)
    rows, cols = np.nonzero(mask)
    slot = np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts)
    out[rows, slot] = cols
    return out


def _tree_where(cond: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(cond, n, o), new, old)


_constrain = partitioning.constrain


class NonFiniteUpdates(RuntimeError):
    """`TrainConfig.max_skipped_in_a_row` updates in a row had a non-finite loss or gradient."""


class Trainer:
    """Owns the trainable state and the compiled update of one policy model (full or LoRA)."""

    def __init__(self, model: nnx.Module, config: TrainConfig, *, mesh: Mesh | None = None,
                 rules: Any = None, min_loss_positions: int = 0):
        """`min_loss_positions`: with `logits_at="loss"`, every batch's per-row loss-position capacity is at
        least `positions_bucket` of this many. A loop that knows its data's most loss tokens in one row (the
        SFT loop does) passes it, so every batch runs one compiled update instead of one per bucket."""
        floor = min_loss_positions
        if isinstance(floor, bool) or not isinstance(floor, int) or floor < 0:
            raise ValueError(f"Trainer: min_loss_positions must be an integer >= 0, got {floor!r}")
        self.min_loss_positions = min_loss_positions
        self.mesh = mesh
        self.lora = has_lora(model)
        self.wrt = nnx.LoRAParam if self.lora else nnx.Param
        if config.loss.aggregation not in losses_lib.AGGREGATIONS:
            raise ValueError(f"train.loss.aggregation: unknown {config.loss.aggregation!r}; "
                             f"known: {losses_lib.AGGREGATIONS}")
        if config.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"train.old_logprobs: {config.old_logprobs!r} is not 'trainer' or 'sampler'")
        losses_lib.get_loss_fn(config.loss.name)  # fail early on an unknown name
        config = dataclasses.replace(config, remat=remat_mode(config.remat))
        chunk = config.logits_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"train.logits_chunk: must be an integer >= 0 (0 = off), got {chunk!r}")
        if config.logits_at not in LOGITS_AT:
            raise ValueError(f"train.logits_at: {config.logits_at!r} is not one of {list(LOGITS_AT)}")
        rows = config.micro_batch_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"train.micro_batch_rows: must be an integer >= 0 (0 = off), got {rows!r}")
        if not isinstance(config.scan_layers, bool):
            raise ValueError(f"train.scan_layers: must be a bool, got {config.scan_layers!r}")
        depth = config.scan_min_layers
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"train.scan_min_layers: must be an integer >= 0 (0 = never), got {depth!r}")
        layers = getattr(model, "layers", None)
        if not config.scan_layers and depth and layers is not None and len(layers) >= depth:
            config = dataclasses.replace(config, scan_layers=True)  # deep: the scan compiles once per layer
        if chunk and not callable(getattr(model, "hidden", None)):
            raise ValueError(f"train.logits_chunk={chunk} needs a model with hidden()/project() "
                             f"({type(model).__name__} has none); set it to 0")
        if self.lora and (chunk or config.remat == "layer") and not _lora_applies_in_hidden(model):
            raise ValueError("this LoRA model applies its adapters only in __call__, not in hidden(): "
                             "wrap the base model with rl.apply_lora (or set train.logits_chunk=0, "
                             "train.remat != 'layer')")
        self.config = config
        if mesh is not None:  # MoE layers: experts run expert-parallel on this mesh (a graph-only change)
            moe_lib.bind_mesh(model, mesh, rules)
        self.graphdef, params, rest = nnx.split(model, self.wrt, ...)
        # An abstract model (`nnx.eval_shape`: a plan for a topology) gives an abstract trainer: its params,
        # optimizer state and reference are shapes laid out as a real trainer's (`partitioning.place`),
        # nothing is allocated, and only `programs_ahead` / `resident_bytes` may be called.
        self.abstract = partitioning.is_abstract(params)
        if self.abstract and mesh is None:
            raise ValueError("Trainer: an abstract model needs a mesh (the topology's)")
        # The trainer owns a copy of the trainable arrays (its update donates them); the caller's model and
        # any engine built from it stay valid until they receive `policy_state()`.
        self.params = shard_state(params, mesh, rules)
        self.params = self.params if self.abstract else jax.tree.map(jnp.copy, self.params)
        self.rest = shard_state(rest, mesh, rules)
        self.tx = make_optimizer(config.optim)
        self._schedule = make_schedule(config.optim)
        # Adam's moments laid out like the params (XLA alone would replicate them on every device)
        init_shardings = partitioning.opt_state_shardings(self.tx, self.params, mesh) if mesh else None
        self.opt_state = partitioning.place(jax.eval_shape(self.tx.init, self.params), init_shardings) \
            if self.abstract else jax.jit(self.tx.init, out_shardings=init_shardings)(self.params)
        # The step's outputs are pinned to these shardings (XLA would otherwise pick its own), so params keep
        # the policy engine's layout step after step and `update_params` moves nothing.
        self._out_shardings = None
        if mesh is not None:
            def on_mesh(x: jax.Array) -> NamedSharding:
                ok = isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
                # written as the step returns them (`partitioning.canonical_spec`), or its second call would
                # compile the update again; not on the mesh (e.g. Adam's step count): replicated
                return NamedSharding(mesh, partitioning.canonical_spec(x.sharding.spec) if ok else P())

            self.params = partitioning.place(self.params, jax.tree.map(on_mesh, self.params))
            self.opt_state = partitioning.place(self.opt_state, jax.tree.map(on_mesh, self.opt_state))
            self._out_shardings = (tuple(on_mesh(x) for x in jax.tree.leaves(self.params)),
                                   tuple(on_mesh(x) for x in jax.tree.leaves(self.opt_state)),
                                   NamedSharding(mesh, P()))  # the accumulator's scalars
        self._zero_acc_fn: Any = None  # makes the micro-batch accumulator at zero (`micro_batch_rows > 0`)
        self.step = 0
        self.skipped_total = 0  # updates skipped for a non-finite loss or gradient, this process's run
        self.skipped_in_a_row = 0
        self.ref_params = None
        if config.loss.kl_beta:
            if self.abstract:  # the same shapes and layout either way
                self.ref_params = self.params
            elif self.lora:  # the base model: every adapter zeroed
                self.ref_params = jax.tree.map(jnp.zeros_like, self.params)
            else:
                self.ref_params = jax.tree.map(jnp.copy, self.params)

    # -- public ---------------------------------------------------------------------------------------

    @property
    def num_trainable(self) -> int:
        return sum(int(x.size) for x in jax.tree.leaves(self.params))

    def model(self) -> nnx.Module:
        """The current policy as an nnx.Module (shares the trainer's arrays)."""
        return nnx.merge(self.graphdef, self.params, self.rest)

    def policy_state(self) -> nnx.State:
        """Every variable of the current policy (trainable and frozen), as device arrays."""
        return nnx.state(self.model())

    def row_multiple(self) -> int:
        """This process's row count must be a multiple of this: its rows of one micro-batch
        (`micro_batch_rows` x its data-parallel shards), or `micro_batches` x its data-parallel shards."""
        shards = max(data_parallel_size(self.mesh) // jax.process_count(), 1)
        return (self.config.micro_batch_rows or self.config.micro_batches) * shards

    def update(self, batch: TrainBatch | Mapping[str, np.ndarray]) -> dict[str, float]:
        """One optimizer step on `batch` (rows `[R, S]` with R a multiple of `row_multiple()`).

        Returns host-side float metrics: loss, grad_norm, lr, clip_frac, dual_clip_frac, kl, tis, ratio,
        entropy, loss_tokens, skipped (1.0 when a non-finite loss/gradient skipped the update), time_s.
        """
        t0 = time.perf_counter()
        arrays = batch.arrays() if isinstance(batch, TrainBatch) else dict(batch)
        lr = jnp.asarray(self._schedule(self.step), jnp.float32)
        if self.config.micro_batch_rows:
            acc = self._micro_sums(self._device_micro_batches(arrays))
            self.params, self.opt_state, metrics = _apply_step(
                _static_config(self.config), self._out_shardings, self.params, self.opt_state, acc, lr)
        else:
            self.params, self.opt_state, metrics = _update_step(
                self.graphdef, _static_config(self.config), self._out_shardings, self.params, self.opt_state,
                self.rest, self.ref_params, self._device_batch(arrays), lr)
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        self.step += 1
        out["time_s"] = time.perf_counter() - t0
        self._count_skipped(out)
        return out

    def _count_skipped(self, out: dict[str, float]) -> None:
        """Counts a skipped update (metrics `skipped_total`, `skipped_in_a_row`), logs it, and raises
        `NonFiniteUpdates` when `max_skipped_in_a_row` were skipped in a row."""
        if out["skipped"]:
            self.skipped_total += 1
            self.skipped_in_a_row += 1
            logging.warning("train step %d: non-finite loss (%s) or gradient norm (%s); update skipped, "
                            "params kept (%d in a row, %d in all)", self.step - 1, out["loss"],
                            out["grad_norm"], self.skipped_in_a_row, self.skipped_total)
        else:
            self.skipped_in_a_row = 0
        out["skipped_total"] = float(self.skipped_total)
        out["skipped_in_a_row"] = float(self.skipped_in_a_row)
        limit = self.config.max_skipped_in_a_row
        if limit and self.skipped_in_a_row >= limit:
            first = self.step - self.skipped_in_a_row
            raise NonFiniteUpdates(
                f"train step {self.step - 1}: {self.skipped_in_a_row} updates in a row (steps {first}.."
                f"{self.step - 1}) had a non-finite loss or gradient and were skipped; stopping "
                f"(train.max_skipped_in_a_row={limit}). The params are those before step {first}, as is "
                "every checkpoint; look at the loss inputs of those steps (rewards, advantages, log-probs)")

    def schedule_info(self) -> dict[str, Any]:
        """The optimizer settings a step's update depends on besides the batch (the learning-rate schedule's
        length and shape, AdamW's constants): a checkpoint records them, so a resume with other ones (e.g.
        another `train.num_steps`, which sets the cosine schedule's length) is reported as another run."""
        return dataclasses.asdict(self.config.optim)

    def get_state(self) -> dict[str, Any]:
        """What a checkpoint holds of the trainer: trainable params, optimizer state, step."""
        return {"params": self.params, "opt_state": self.opt_state, "step": self.step}

    def set_state(self, params: Any, opt_state: Any, step: int) -> None:
        self.params = jax.tree.map(lambda new, old: jax.device_put(jnp.asarray(new, old.dtype), old.sharding),
                                   params, self.params)
        self.opt_state = jax.tree.map(
            lambda new, old: jax.device_put(jnp.asarray(new, old.dtype), old.sharding)
            if isinstance(old, jax.Array) else new, opt_state, self.opt_state)
        self.step = int(step)

    # -- internals ------------------------------------------------------------------------------------

    def _host_batch(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Host rows `[R, S]` as the update consumes them: with several processes each holds its own rows,
        and they agree on one `[R, S]` (the largest, zero-padded) to form one global batch without gathering
        rows anywhere; with `logits_at="loss"` the rows' loss positions (`loss_positions`) are added."""
        arrays = {k: np.asarray(v) for k, v in arrays.items()}
        arrays.pop("positions", None)
        most = most_loss_tokens(arrays["loss_mask"])
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            local = np.asarray([*arrays["tokens"].shape, most], np.int64)
            agreed = np.max(np.reshape(multihost_utils.process_allgather(local), (-1, 3)), axis=0)
            arrays = pad_rows(arrays, int(agreed[0]), int(agreed[1]))
            most = int(agreed[2])
        capacity = self.update_shape(arrays["tokens"].shape[1], most)[1]
        if capacity:
            arrays["positions"] = loss_positions(arrays["loss_mask"], capacity)
        rows = arrays["tokens"].shape[0]
        if rows % self.row_multiple():
            what = (f"micro_batch_rows={self.config.micro_batch_rows}" if self.config.micro_batch_rows
                    else f"micro_batches={self.config.micro_batches}")
            raise ValueError(f"batch has {rows} rows; it must be a multiple of {self.row_multiple()} "
                             f"({what} x data-parallel shards={data_parallel_size(self.mesh)})")
        return arrays

    def _on_device(self, arrays: Mapping[str, np.ndarray], m: int) -> dict[str, jax.Array]:
        """Host rows `[R, ...]` -> device arrays `[m, R / m, ...]`, rows split over the mesh's data axes (with
        several processes: one global array of every process's rows)."""
        out = {}
        sharding = NamedSharding(self.mesh, P(None, batch_axes(self.mesh) or None)) if self.mesh else None
        for k, v in arrays.items():
            v = v.reshape(m, v.shape[0] // m, *v.shape[1:])
            if jax.process_count() > 1 and sharding is not None:
                global_shape = (m, v.shape[1] * jax.process_count(), *v.shape[2:])
                out[k] = jax.make_array_from_process_local_data(sharding, v, global_shape)
            else:
                out[k] = jax.device_put(v, sharding) if sharding is not None else jnp.asarray(v)
        return out

    def _abstract_batch(self, rows: int, seq: int, capacity: int,
                        m: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
        """The shapes and layout `_on_device` gives `rows` host rows `[m, rows / m, seq]` (with `positions`
        `[m, rows / m, capacity]` when `capacity`), over the whole mesh (every process's rows), for lowering
        the update ahead of time without a batch."""
        blank = _blank_rows(rows, seq, capacity)
        if not self.abstract:  # placed once as an update places its rows (which warms that placement too)
            return jax.tree.map(compile_cache.abstract, self._on_device(blank, m))
        sharding = NamedSharding(self.mesh, P(None, batch_axes(self.mesh) or None)) if self.mesh else None
        procs = jax.process_count() if sharding is not None else 1
        return {k: jax.ShapeDtypeStruct((m, v.shape[0] // m * procs, *v.shape[1:]), v.dtype,
                                        sharding=sharding) for k, v in blank.items()}

    def resident_bytes(self) -> dict[str, int]:
        """Bytes one device of the trainer's mesh holds between updates, from the arrays' shardings (exact,
        no compile): `trainable` (the params it updates: LoRA's adapters or every param), `frozen` (the rest
        of the model: the base weights under LoRA), `optimizer` (Adam's moments and counts), `reference`
        (the KL reference's copy; 0 without KL)."""
        ref = 0
        if self.ref_params is not None and self.ref_params is not self.params:
            ref = partitioning.bytes_per_device(self.ref_params)
        elif self.ref_params is not None:  # an abstract trainer: the copy a real one keeps
            ref = partitioning.bytes_per_device(self.params)
        return {"trainable": partitioning.bytes_per_device(self.params),
                "frozen": partitioning.bytes_per_device(self.rest),
                "optimizer": partitioning.bytes_per_device(self.opt_state), "reference": ref}

    def _device_batch(self, arrays: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host rows `[R, S]` -> device arrays `[micro_batches, R / micro_batches, S]` (see `_host_batch`)."""
        return self._on_device(self._host_batch(arrays), self.config.micro_batches)

    def _device_micro_batches(self, arrays: Mapping[str, np.ndarray]) -> Iterator[dict[str, jax.Array]]:
        """Host rows `[R, S]` -> one device batch `[1, row_multiple(), S]` per micro-batch, each moved to the
        device when asked for (`micro_batch_rows > 0`; every process runs the same number: they agreed on
        R)."""
        arrays = self._host_batch(arrays)
        r = self.row_multiple()
        for i in range(0, arrays["tokens"].shape[0], r):
            yield self._on_device({k: v[i:i + r] for k, v in arrays.items()}, 1)

    def _zero_acc_program(self, first: Any) -> Any:
        """The jitted program that makes the micro-batch accumulator at zero: (gradient sums like the params
        in float32, loss sum, count, metric sums), laid out as `_micro_step` returns it (so its program
        compiles once). `first`: a micro-batch, or its abstract shapes (the accumulator's do not depend on
        them)."""
        if self._zero_acc_fn is None:
            config = _static_config(self.config)
            # one per model, config and layout in a process (a trace of the whole step: ~1 s for a tiny
            # model), shared by its trainers (a resumed run, an evaluation, tests) like the compiled programs
            key = (self.graphdef, config, self._out_shardings, self.ref_params is None,
                   tuple((x.shape, x.dtype) for x in jax.tree.leaves(self.params)))
            if key not in _ZERO_ACC:
                struct = jax.eval_shape(functools.partial(_sums, self.graphdef, config), self.params,
                                        self.rest, self.ref_params, first)
                shardings = None if self._out_shardings is None else _acc_shardings(struct,
                                                                                     self._out_shardings)
                _ZERO_ACC[key] = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), struct),
                                         out_shardings=shardings)
            self._zero_acc_fn = _ZERO_ACC[key]
        return self._zero_acc_fn

    def _zero_acc(self, first: dict[str, jax.Array]) -> Any:
        """The micro-batch accumulator at zero (`_zero_acc_program`)."""
        return self._zero_acc_program(first)()

    def _micro_sums(self, micro: Iterator[dict[str, jax.Array]]) -> Any:
        """The accumulated sums of every micro-batch, one `_micro_step` call each."""
        acc = None
        for mb in micro:
            acc = _micro_step(self.graphdef, _static_config(self.config), self._out_shardings, self.params,
                              self.rest, self.ref_params, mb, self._zero_acc(mb) if acc is None else acc)
        return acc

    def update_shape(self, seq: int, most: int) -> tuple[int, int]:
        """The shape that picks the update program for rows `[R, seq]` whose fullest row holds `most` loss
        tokens: (seq, per-row loss-position capacity), the capacity 0 where every position's log-prob is
        computed (`logits_at="all"`, `logits_chunk=0`, or `positions_bucket` reaching `seq`). With
        `micro_batch_rows > 0` it is the whole of what a step's batch adds to the program's key."""
        if self.config.logits_chunk and self.config.logits_at == "loss":
            return seq, positions_bucket(max(most, self.min_loss_positions), seq)
        return seq, 0

    def programs_ahead(self, shapes: Iterable[tuple[int, int]], *, optimizer: bool = True,
                       rows: int = 0) -> list[tuple[str, Callable[[], Any]]]:
        """The update's programs for batches of these `update_shape`s, as `(name, lower)` pairs (like
        `Engine.programs_ahead`, for `compile_cache.Ahead`, which compiles what they return): `lower()`
        lowers a program from abstract arguments (`jax.ShapeDtypeStruct`s with the arrays' shardings), so
        nothing runs and no buffer is touched (the trainer may update meanwhile, on another thread), and an
        `update` of such a batch later compiles nothing (JAX's in-memory caches; the persistent cache keeps
        it for later processes). The set: the micro-batch program per shape, then (with `optimizer`) the
        optimizer's program and the zero accumulator's, which no batch shape changes.

        With `micro_batch_rows` 0 a step's one program depends on its row count too, which only its
        rollout knows: the list is then empty, unless `rows` names it (a multiple of `row_multiple()`: the
        SFT loop's fixed batch, a plan), and then holds `update[rows x seq, ...]` per shape."""
        config = _static_config(self.config)
        if not self.config.micro_batch_rows:
            if not rows:
                return []
            m = self.config.micro_batches
            lr = jax.ShapeDtypeStruct((), jnp.float32)
            opt = jax.tree.map(compile_cache.abstract, self.opt_state)
            p, r, ref = (jax.tree.map(compile_cache.abstract, t) for t in (self.params, self.rest,
                                                                             self.ref_params))

            def whole(batch: Any) -> Callable[[], Any]:
                return lambda: _update_step.lower(self.graphdef, config, self._out_shardings, p, opt, r, ref,
                                                  batch, lr)

            return [(f"update[{rows}x{seq}, positions {cap or 'all'}]",
                     whole(self._abstract_batch(rows, seq, cap, m)))
                    for seq, cap in dict.fromkeys((int(s), int(c)) for s, c in shapes)]
        # here, on the caller's thread: the arrays' shapes and layouts as they are now (an update donates
        # them); a job traces and compiles on its worker thread
        def shapes_of(tree: Any) -> Any:
            return jax.tree.map(compile_cache.abstract, tree)

        params, rest, ref = shapes_of(self.params), shapes_of(self.rest), shapes_of(self.ref_params)
        opt_state = shapes_of(self.opt_state)
        rows = self.row_multiple()
        batches = {(seq, cap): self._abstract_batch(rows, seq, cap)
                   for seq, cap in dict.fromkeys((int(s), int(c)) for s, c in shapes)}
        first = next(iter(batches.values()), None) or self._abstract_batch(rows, MIN_POSITIONS, 0)
        made: dict[str, Any] = {}
        lock = threading.Lock()

        def accumulator() -> tuple[Any, Any]:
            """(the zero accumulator's program, the accumulator's abstract shapes and layout), made once."""
            with lock:
                if not made:
                    zero = self._zero_acc_program(first)
                    struct = jax.eval_shape(zero)
                    made["zero"], made["acc"] = zero, struct if self._out_shardings is None else jax.tree.map(
                        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), struct,
                        _acc_shardings(struct, self._out_shardings))
            return made["zero"], made["acc"]

        def micro(batch: Any) -> Callable[[], Any]:
            return lambda: _micro_step.lower(self.graphdef, config, self._out_shardings, params, rest, ref,
                                             batch, accumulator()[1])

        def apply() -> Any:
            lr = jax.ShapeDtypeStruct((), jnp.float32)
            return _apply_step.lower(config, self._out_shardings, params, opt_state, accumulator()[1], lr)

        jobs = [(f"update[{rows}x{seq}, positions {cap or 'all'}]", micro(b))
                for (seq, cap), b in batches.items()]
        if optimizer:
            jobs += [("optimizer", apply), ("zero accumulator", lambda: accumulator()[0].lower())]
        return jobs

    def memory_analysis(self, batch: TrainBatch | Mapping[str, np.ndarray]) -> dict[str, int] | None:
        """What the compiled `update` program for this batch shape needs on one device, in bytes (XLA's
        `compile().memory_analysis()`): `temp_bytes` (activations, logits, gradients in flight),
        `argument_bytes`, `output_bytes`, `alias_bytes` (donated), `peak_bytes` (temp + arguments + outputs -
        aliased) — or None where the backend does not report it. With `micro_batch_rows > 0`: the
        micro-batch program's (the accumulator among its arguments; the optimizer's program, compiled here
        too, holds less). Compiles; runs nothing."""
        arrays = batch.arrays() if isinstance(batch, TrainBatch) else dict(batch)
        lr = jnp.zeros((), jnp.float32)
        config = _static_config(self.config)
        if config.micro_batch_rows:
            first = next(self._device_micro_batches(arrays))  # the others are moved to no device
            acc = self._zero_acc(first)
            compiled = _micro_step.lower(self.graphdef, config, self._out_shardings, self.params, self.rest,
                                         self.ref_params, first, acc).compile()
            _apply_step.lower(config, self._out_shardings, self.params, self.opt_state, acc, lr).compile()
        else:
            compiled = _update_step.lower(self.graphdef, config, self._out_shardings, self.params,
                                          self.opt_state, self.rest, self.ref_params,
                                          self._device_batch(arrays), lr).compile()
        stats = compiled.memory_analysis()
        if stats is None:
            return None
        out = {"temp_bytes": int(stats.temp_size_in_bytes),
               "argument_bytes": int(stats.argument_size_in_bytes),
               "output_bytes": int(stats.output_size_in_bytes), "alias_bytes": int(stats.alias_size_in_bytes)}
        out["peak_bytes"] = (out["temp_bytes"] + out["argument_bytes"] + out["output_bytes"]
                             - out["alias_bytes"])
        return out

    def loss_and_grads(self, batch: TrainBatch | Mapping[str, np.ndarray]) -> tuple[float, Any]:
        """The batch loss and its gradient w.r.t. the trainable params, without updating (for tests and
        diagnostics; micro-batched exactly like `update`)."""
        arrays = batch.arrays() if isinstance(batch, TrainBatch) else dict(batch)
        if self.config.micro_batch_rows:
            g_sum, total, count, _ = self._micro_sums(self._device_micro_batches(arrays))
            loss, grads = _divide_jit(self.params, g_sum, total, count)
            return float(loss), grads
        loss, grads, _ = _accumulate_jit(self.graphdef, _static_config(self.config), self.params, self.rest,
                                         self.ref_params, self._device_batch(arrays))
        return float(loss), grads


# ----------------------------------------------------------------------------------------------- pure step
# Module-level functions with (graphdef, config) static: every Trainer of the same model and config shares
# one compiled program (a resumed run, tests, an eval trainer).


class _RematLayer(nnx.Module):
    """Stands in for one decoder layer inside a traced forward pass of a model that is not a
    `models.Transformer` (which checkpoints its own layers: `hidden(remat_layers=True)`): calls it under
    `jax.checkpoint` with nothing saved but its inputs (`transformer.remat_call`: the layer split and merged
    inside the checkpoint, what it sows put back); other attributes (e.g. `layer_type`) read through to the
    layer."""

    def __init__(self, layer: nnx.Module):
        self.layer = layer

    def __getattr__(self, name: str) -> Any:
        if name == "layer":  # not set yet (e.g. during copy): no recursion
            raise AttributeError(name)
        return getattr(self.layer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return transformer_lib.remat_call(self.layer, *args, **kwargs)


def _remat_layers(model: nnx.Module) -> None:
    """Swaps every decoder layer of a model merged inside the trace for a `_RematLayer` (the caller's model
    is never touched: this runs on the trace's own copy), for models other than `models.Transformer` (whose
    `hidden(remat_layers=True)` does it, in its layer scan too). Relies on the model calling
    `self.layers[i](x, ...)` one by one."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nnx.List) or not all(isinstance(x, nnx.Module) for x in layers):
        raise ValueError(f"train.remat='layer': {type(model).__name__} has no `layers` list of modules to "
                         f"rematerialise one by one; use 'full' or 'none'")
    for i in range(len(layers)):
        layers[i] = _RematLayer(layers[i])


def _forward_logprobs(graphdef: nnx.GraphDef, config: TrainConfig, params: Any, rest: Any, tokens: jax.Array,
                      valid: jax.Array, router_stats: bool = False, positions: jax.Array | None = None
                      ) -> tuple[jax.Array, ...]:
    """Trainer log-probs and entropies `[B, T]` of `tokens` `[B, T]` under temperature-scaled logits (with
    `router_stats`, a third value: the MoE layers' summed router statistics, None for a model without MoE).

    `logits_chunk > 0`: hidden states `[B, T, H]` then `chunked_token_logprobs` (never a `[B, T, V]` array),
    or with `positions` `[B, K]` (`loss_positions`) `positioned_token_logprobs`: logits only there, 0
    elsewhere; else the model's own logits `[B, T, V]`. `remat` "full" checkpoints the whole model call,
    "layer" each decoder layer; `scan_layers` scans a Transformer's repeating layers (see TrainConfig)."""
    mode = remat_mode(config.remat)
    chunk = config.logits_chunk

    def run(params: Any, rest: Any, tokens: jax.Array, valid: jax.Array) -> jax.Array:
        # merged inside the (possibly rematerialised) trace: modules that write to themselves when called
        # (qwix's LoRA interception does) stay at one trace level
        model = nnx.merge(graphdef, params, rest)
        moe = router_stats and moe_lib.collect_router_stats(model)
        kwargs = {}
        if isinstance(model, transformer_lib.Transformer):  # qwix LoRA models are subclasses
            kwargs = {"scan_layers": config.scan_layers, "remat_layers": mode == "layer"}
        elif mode == "layer":
            _remat_layers(model)
        call = model.hidden if chunk else model
        out = call(tokens, mask=valid, **kwargs)[0]
        return out, (moe_lib.pop_router_stats(model) if moe else None)

    if mode == "full":
        # Keeps matmul outputs without batch dims (projections, MLP) and recomputes attention scores and
        # elementwise ops in the backward pass.
        run = jax.checkpoint(run, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    out, stats = run(params, rest, tokens, valid)
    extra = (stats,) if router_stats else ()
    if not chunk:
        return (*losses_lib.token_logprobs(out, tokens, config.loss.temperature), *extra)

    def project(hidden: jax.Array) -> jax.Array:
        # only the projection's params are read here; merged inside the chunk's trace like `run`
        return nnx.merge(graphdef, params, rest).project(hidden)

    if positions is not None:
        temperature = config.loss.temperature
        return (*losses_lib.positioned_token_logprobs(project, out, tokens, positions, temperature, chunk),
                *extra)
    return (*losses_lib.chunked_token_logprobs(project, out, tokens, config.loss.temperature, chunk), *extra)


def _sums(graphdef: nnx.GraphDef, config: TrainConfig, params: Any, rest: Any, ref_params: Any,
          batch: dict[str, jax.Array]) -> tuple[Any, jax.Array, jax.Array, dict[str, jax.Array]]:
    """Sums over every micro-batch (`batch` leaves `[micro, rows, ...]`): (gradient of the loss sum, float32
    like the params; loss sum; count; metric sums). They add over micro-batches and programs alike: the
    loss and its gradient are these divided by the count once (`_divide`)."""
    loss_fn = losses_lib.get_loss_fn(config.loss.name)

    def micro_loss(p: Any, mb: dict[str, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, dict]]:
        pos = mb.get("positions")
        lp, ent, router = _forward_logprobs(graphdef, config, p, rest, mb["tokens"], mb["valid"], True, pos)
        old = jax.lax.stop_gradient(lp) if config.old_logprobs == "trainer" else mb["sampler_logprobs"]
        ref = None
        if ref_params is not None:
            ref_lp = _forward_logprobs(graphdef, config, ref_params, rest, mb["tokens"], mb["valid"],
                                       positions=pos)[0]
            ref = jax.lax.stop_gradient(ref_lp)
        total, count, sums = loss_fn(lp, old, mb["sampler_logprobs"], mb["advantages"], mb["loss_mask"],
                                     mb["row_weights"], ref, ent, config=config.loss)
        if router is not None:  # MoE: load-balancing loss (weighted like the loss), logged expert load
            aux, load = moe_lib.load_balancing_loss(router)
            total = total + config.moe_aux_loss_coef * aux * count
            w = sums["tokens"]
            sums = dict(sums, moe_aux=aux * w, expert_load_max=jnp.max(load) * w,
                        expert_load_min=jnp.min(load) * w)
        return total, (count, sums)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def body(carry: Any, mb: dict[str, jax.Array]) -> tuple[Any, None]:
        g_acc, tot_acc, cnt_acc, sums_acc = carry
        (total, (count, sums)), g = grad_fn(params, mb)
        g_acc = jax.tree.map(jnp.add, g_acc, g)
        sums_acc = jax.tree.map(jnp.add, sums_acc, sums)
        return (g_acc, tot_acc + total, cnt_acc + count, sums_acc), None

    zero_g = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
    first = jax.tree.map(lambda x: x[0], batch)
    zero_sums = jax.tree.map(lambda x: jnp.zeros((), jnp.float32),
                             jax.eval_shape(micro_loss, params, first)[1][1])
    init = (zero_g, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zero_sums)
    return jax.lax.scan(body, init, batch)[0]


def _divide(params: Any, g_sum: Any, total: jax.Array, count: jax.Array) -> tuple[jax.Array, Any]:
    """(loss, gradient in the params' dtypes) from the sums."""
    denom = jnp.maximum(count, 1e-9)
    return total / denom, jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), g_sum, params)


def _accumulate(graphdef: nnx.GraphDef, config: TrainConfig, params: Any, rest: Any, ref_params: Any,
                batch: dict[str, jax.Array]) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """Loss and gradient over every micro-batch (`batch` leaves `[micro, rows, ...]`): (loss, grads, metric
    sums) — exactly the full-batch values, since sums and counts add before the one division."""
    g_sum, total, count, sums = _sums(graphdef, config, params, rest, ref_params, batch)
    loss, grads = _divide(params, g_sum, total, count)
    return loss, grads, sums


_accumulate_jit = jax.jit(_accumulate, static_argnums=(0, 1))
_divide_jit = jax.jit(_divide)


_ZERO_ACC: dict[Any, Any] = {}  # `Trainer._zero_acc`'s jitted zero accumulators, by model and config


def _acc_shardings(acc: Any, out_shardings: tuple) -> Any:
    """The accumulator's layout: gradient sums like the params (`out_shardings[0]`), scalars replicated."""
    g_sum, _, _, sums = acc
    grads = jax.tree.unflatten(jax.tree.structure(g_sum), out_shardings[0])
    return grads, out_shardings[2], out_shardings[2], jax.tree.map(lambda _: out_shardings[2], sums)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(7,))
def _micro_step(graphdef: nnx.GraphDef, config: TrainConfig, out_shardings: tuple | None, params: Any,
                rest: Any, ref_params: Any, batch: dict[str, jax.Array], acc: Any) -> Any:
    """`acc` (as `_sums` returns it, donated) plus the sums of one micro-batch (`batch` leaves `[1, rows,
    ...]`), in the accumulator's fixed layout."""
    new = _sums(graphdef, config, params, rest, ref_params, batch)
    acc = jax.tree.map(jnp.add, acc, new)
    if out_shardings is not None:
        acc = _constrain(acc, jax.tree.leaves(_acc_shardings(acc, out_shardings)))
    return acc


def _apply(config: TrainConfig, out_shardings: tuple | None, params: Any, opt_state: Any, loss: jax.Array,
           grads: Any, sums: dict[str, jax.Array], lr: jax.Array) -> tuple[Any, Any, dict[str, jax.Array]]:
    """Clip, AdamW and the step's metrics; a non-finite loss or gradient norm leaves params and optimizer
    state unchanged."""
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
    direction, new_opt = make_optimizer(config.optim).update(safe_grads, opt_state, params)
    updates = jax.tree.map(lambda d, p: (-lr * d).astype(p.dtype), direction, params)
    new_params = optax.apply_updates(params, updates)
    params = _tree_where(finite, new_params, params)
    opt_state = _tree_where(finite, new_opt, opt_state)
    if out_shardings is not None:
        params, opt_state = _constrain(params, out_shardings[0]), _constrain(opt_state, out_shardings[1])
    tokens = jnp.maximum(sums["tokens"], 1.0)
    metrics = {
        "loss": loss, "grad_norm": grad_norm, "lr": lr,
        "skipped": 1.0 - finite.astype(jnp.float32), "loss_tokens": sums["tokens"],
        "clip_frac": sums["clip"] / tokens, "dual_clip_frac": sums["dual_clip"] / tokens,
        "kl": sums["kl"] / tokens, "tis": sums["tis"] / tokens, "ratio": sums["ratio"] / tokens,
        "entropy": sums.get("entropy", jnp.zeros(())) / tokens,
    }
    metrics |= {k: sums[k] / tokens for k in ("moe_aux", "expert_load_max", "expert_load_min") if k in sums}
    if "moe_aux" in metrics:
        metrics["moe_aux_loss"] = metrics.pop("moe_aux")
    return params, opt_state, metrics


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 4))
def _update_step(graphdef: nnx.GraphDef, config: TrainConfig, out_shardings: tuple | None, params: Any,
                 opt_state: Any, rest: Any, ref_params: Any, batch: dict[str, jax.Array], lr: jax.Array
                 ) -> tuple[Any, Any, dict[str, jax.Array]]:
    """One optimizer step over every micro-batch of `batch` in one program (`micro_batch_rows == 0`).
    `out_shardings`: (param leaf shardings, optimizer-state leaf shardings, a replicated scalar's) or None."""
    loss, grads, sums = _accumulate(graphdef, config, params, rest, ref_params, batch)
    return _apply(config, out_shardings, params, opt_state, loss, grads, sums, lr)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
def _apply_step(config: TrainConfig, out_shardings: tuple | None, params: Any, opt_state: Any, acc: Any,
                lr: jax.Array) -> tuple[Any, Any, dict[str, jax.Array]]:
    """One optimizer step from the accumulated sums of `_micro_step` (`micro_batch_rows > 0`)."""
    g_sum, total, count, sums = acc
    loss, grads = _divide(params, g_sum, total, count)
    return _apply(config, out_shardings, params, opt_state, loss, grads, sums, lr)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _logprobs_jit(graphdef: Any, params: Any, tokens: jax.Array, valid: jax.Array,
                  temperature: float) -> jax.Array:
    model = nnx.merge(graphdef, params)
    return losses_lib.token_logprobs(model(tokens, mask=valid)[0], tokens, temperature)[0]


def sequence_logprobs(model: nnx.Module, tokens: np.ndarray, valid: np.ndarray, temperature: float = 1.0
                      ) -> np.ndarray:
    """Log-probs `[B, T]` of `tokens` under `model` (position 0 gets 0) — for tests and diagnostics."""
    graphdef, state = nnx.split(model)
    return np.asarray(_logprobs_jit(graphdef, state, jnp.asarray(tokens), jnp.asarray(valid), temperature))
