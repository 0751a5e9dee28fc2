"""Start-of-run validation of the GRPO config (`configs/grpo.py`): every error names the bad key.

`validate(config, num_devices=None)` raises `ConfigError("config.train.num_steps: must be >= 0, got -1")`
style errors, before anything heavy starts; `main` turns them into a one-line message and exit code 2.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

MODEL_INITS = ("random", "hf", "orbax")
DATA_SOURCES = ("synthetic", "file")
SECTIONS = ("model", "data", "rollout", "train", "eval", "mesh", "checkpoint")
# rollout keys main consumes itself (engine sizes); the rest go to rollout.RolloutConfig.from_dict
ROLLOUT_ENGINE_KEYS = ("group_size", "policy_slots", "frozen_slots", "max_seq_len", "round_steps")


class ConfigError(ValueError):
    """A bad config value; the message starts with the key path (`config.section.key`)."""


def _err(key: str, msg: str) -> ConfigError:
    return ConfigError(f"config.{key}: {msg}")


def _get(config: Any, key: str) -> Any:
    node = config
    for part in key.split("."):
        try:
            node = node[part]
        except (KeyError, AttributeError, TypeError):
            raise _err(key, "missing") from None
    return node


def _int(config: Any, key: str, lo: int | None = None) -> int:
    v = _get(config, key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _err(key, f"must be an integer, got {v!r}")
    if lo is not None and v < lo:
        raise _err(key, f"must be >= {lo}, got {v}")
    return v


def _float(config: Any, key: str, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False) -> float:
    v = _get(config, key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _err(key, f"must be a number, got {v!r}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise _err(key, f"must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise _err(key, f"must be <= {hi}, got {v}")
    return float(v)


def _choice(config: Any, key: str, choices: Any) -> str:
    v = _get(config, key)
    if v not in tuple(choices):
        raise _err(key, f"must be one of {sorted(choices)}, got {v!r}")
    return v


def validate_mesh(shape: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """The resolved mesh shape for `num_devices` devices (a shape without -1 may use fewer devices)."""
    from librarian_jax.engine.mesh import MESH_AXES, resolve_mesh_shape

    shape = dict(shape)
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise _err("mesh.shape", f"unknown axis names {unknown}; allowed: {list(MESH_AXES)}")
    for k, v in shape.items():
        if isinstance(v, bool) or not isinstance(v, int) or (v < 1 and v != -1):
            raise _err(f"mesh.shape.{k}", f"must be a positive integer or -1, got {v!r}")
    if -1 not in shape.values():
        used = 1
        for v in shape.values():
            used *= v
        if used > num_devices:
            raise _err("mesh.shape", f"{shape} needs {used} devices, only {num_devices} present")
        num_devices = used
    try:
        return resolve_mesh_shape(shape, num_devices)
    except ValueError as e:
        raise _err("mesh.shape", str(e)) from None


def validate(config: Any, num_devices: int | None = None) -> None:
    """Checks every key main reads. Raises ConfigError naming the first bad key."""
    for s in SECTIONS:
        _get(config, s)
    _int(config, "seed", 0)
    if not isinstance(_get(config, "workdir"), str) or not config.workdir:
        raise _err("workdir", f"must be a non-empty path, got {config.workdir!r}")

    # model
    from librarian_jax.models import PRESETS as MODEL_PRESETS

    _choice(config, "model.preset", MODEL_PRESETS)
    init = _choice(config, "model.init", MODEL_INITS)
    path = _get(config, "model.path")
    if init in ("hf", "orbax"):
        if not path:
            raise _err("model.path", f"required when model.init={init!r} (a "
                       f"{'Hugging Face safetensors folder' if init == 'hf' else 'Orbax checkpoint'})")
        if not os.path.exists(path):
            raise _err("model.path", f"{path!r} does not exist")
    for key in ("model.tokenizer", "model.frozen_path"):
        p = _get(config, key)
        if p and not os.path.exists(p):
            raise _err(key, f"{p!r} does not exist")
    _int(config, "model.tokenizer_vocab_size", 64)
    dtype = _get(config, "model.dtype")
    if dtype not in ("", "float32", "bfloat16", "float16"):
        raise _err("model.dtype", f"must be '', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    rank = _int(config, "model.lora_rank", 0)
    if rank:
        _float(config, "model.lora_alpha", 0.0, lo_open=True)
        if not _get(config, "model.lora_module_path"):
            raise _err("model.lora_module_path", "must be a non-empty regex when model.lora_rank > 0")

    # data
    source = _choice(config, "data.source", DATA_SOURCES)
    if source == "file":
        p = _get(config, "data.path")
        if not p:
            raise _err("data.path", "required when data.source='file' (a tasks file or folder)")
        if not os.path.exists(p):
            raise _err("data.path", f"{p!r} does not exist")
    else:
        _int(config, "data.num_tasks", 1)
        _int(config, "data.docs_per_task", 1)
        lo = _int(config, "data.min_words", 1)
        hi = _int(config, "data.max_words", 1)
        if hi < lo:
            raise _err("data.max_words", f"must be >= data.min_words ({lo}), got {hi}")
        _int(config, "data.questions_per_task", 1)
        _int(config, "data.reuse_questions_per_task", 0)
    _float(config, "data.heldout_fraction", 0.0, 0.9)
    _int(config, "data.tasks_per_batch", 1)
    _int(config, "data.shuffle_seed", 0)

    # rollout
    _int(config, "rollout.group_size", 1)
    _int(config, "rollout.policy_slots", 1)
    _int(config, "rollout.frozen_slots", 1)
    _int(config, "rollout.max_seq_len", 16)
    _int(config, "rollout.round_steps", 1)
    rollout_config(config)

    # train
    from librarian_jax.rl.advantages import ADVANTAGES
    from librarian_jax.rl.losses import AGGREGATIONS, LOSSES
    from librarian_jax.rl.train_step import REMAT_MODES

    _int(config, "train.num_steps", 0)
    _float(config, "train.learning_rate", 0.0, lo_open=True)
    _int(config, "train.warmup_steps", 0)
    _choice(config, "train.decay", ("cosine", "linear", "constant"))
    _float(config, "train.end_lr_ratio", 0.0, 1.0)
    _float(config, "train.weight_decay", 0.0)
    _float(config, "train.grad_clip", 0.0)
    _int(config, "train.micro_batches", 1)
    remat = _get(config, "train.remat")
    if not isinstance(remat, bool) and remat not in REMAT_MODES:
        raise _err("train.remat", f"must be one of {sorted(REMAT_MODES)} (or a bool), got {remat!r}")
    _int(config, "train.logits_chunk", 0)
    _choice(config, "train.loss", LOSSES)
    _float(config, "train.eps_low", 0.0, 1.0, lo_open=True)
    _float(config, "train.eps_high", 0.0, lo_open=True)
    _float(config, "train.dual_clip", 0.0)
    if 0 < config.train.dual_clip <= 1:
        raise _err("train.dual_clip", f"must be 0 (off) or > 1, got {config.train.dual_clip}")
    _float(config, "train.tis_cap", 0.0)
    _float(config, "train.kl_beta", 0.0)
    _choice(config, "train.aggregation", AGGREGATIONS)
    _choice(config, "train.old_logprobs", ("trainer", "sampler"))
    _choice(config, "train.advantage", ADVANTAGES)
    _float(config, "train.step_weight", 0.0)
    _float(config, "train.step_gamma", 0.0, 1.0)
    _int(config, "train.max_seq_len", 16)

    # eval, checkpoint
    _int(config, "eval.every", 0)
    _int(config, "eval.num_tasks", 1)
    _int(config, "eval.repeats", 1)
    _int(config, "checkpoint.every", 1)
    _int(config, "checkpoint.keep", 1)

    # mesh
    if num_devices is None:
        import jax

        num_devices = jax.device_count()
    shape = _get(config, "mesh.shape")
    validate_mesh(shape.to_dict() if hasattr(shape, "to_dict") else dict(shape), num_devices)


def rollout_config(config: Any) -> Any:
    """`rollout.RolloutConfig` from `config.rollout` minus the engine keys; errors name the key."""
    from librarian_jax.rollout import RolloutConfig

    section = _get(config, "rollout")
    d = section.to_dict() if hasattr(section, "to_dict") else dict(section)
    for k in ROLLOUT_ENGINE_KEYS:
        d.pop(k, None)
    try:
        return RolloutConfig.from_dict(d)
    except KeyError as e:
        raise _err("rollout", str(e.args[0]) if e.args else str(e)) from None
    except (TypeError, ValueError) as e:
        raise _err("rollout", str(e)) from None
