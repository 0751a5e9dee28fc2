"""librarian_jax.rl: training rows, advantages, losses and the GRPO train step.

    rows_config = RowsConfig(advantage="paper", row_multiple=trainer.row_multiple())
    batch, row_metrics = build_rows(records, rows_config)
    trainer = Trainer(model_or_lora_model, TrainConfig(logits_chunk=1024, remat="layer"), mesh=mesh)
    trainer.memory_analysis(batch)  # optional: bytes the compiled step needs per device
    metrics = trainer.update(batch)
    policy_engine.update_params(trainer.policy_state())
"""

from librarian_jax.rl.advantages import ADVANTAGES, get_advantage_fn, register_advantage, step_advantages
from librarian_jax.rl.losses import (
    AGGREGATIONS,
    LOSSES,
    LossConfig,
    chunked_token_logprobs,
    get_loss_fn,
    register_loss,
    token_logprobs,
)
from librarian_jax.rl.rows import NoTrainableTokens, RowsConfig, TrainBatch, build_rows
from librarian_jax.rl.train_step import (
    REMAT_MODES,
    OptimConfig,
    TrainConfig,
    Trainer,
    apply_lora,
    make_optimizer,
    make_schedule,
    remat_mode,
)

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "LOSSES",
    "LossConfig",
    "NoTrainableTokens",
    "OptimConfig",
    "REMAT_MODES",
    "RowsConfig",
    "TrainBatch",
    "TrainConfig",
    "Trainer",
    "apply_lora",
    "build_rows",
    "chunked_token_logprobs",
    "get_advantage_fn",
    "get_loss_fn",
    "make_optimizer",
    "make_schedule",
    "register_advantage",
    "register_loss",
    "remat_mode",
    "step_advantages",
    "token_logprobs",
]
