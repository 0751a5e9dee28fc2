"""librarian_jax.models: model configs and presets, the Flax NNX transformer, its cache, HF checkpoint I/O."""

from librarian_jax.models.cache import Cache, cache_logical_axes, init_cache
from librarian_jax.models.config import PRESETS, ModelConfig, get_preset
from librarian_jax.models.hf_io import config_from_hf, config_to_hf, load_hf, save_hf
from librarian_jax.models.partitioning import DEFAULT_RULES, logical_to_spec
from librarian_jax.models.placement import shard_model
from librarian_jax.models.transformer import Transformer, init_model

__all__ = [
    "DEFAULT_RULES",
    "PRESETS",
    "Cache",
    "ModelConfig",
    "Transformer",
    "cache_logical_axes",
    "config_from_hf",
    "config_to_hf",
    "get_preset",
    "init_cache",
    "init_model",
    "load_hf",
    "logical_to_spec",
    "save_hf",
    "shard_model",
]
