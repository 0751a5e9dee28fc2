"""librarian_jax.rollout: builder episodes with probes and rewards, batched over the engines.

records = run_batch(tasks, group_size, {"policy": policy_engine, "frozen": frozen_engine}, tokenizer,
                    RolloutConfig(), rng=0)
"""

from librarian_jax.rollout.episode import evaluate, run_episode
from librarian_jax.rollout.records import EpisodeRecord, read_jsonl, write_jsonl
from librarian_jax.rollout.rewards import RolloutConfig, probe_reward, should_probe
from librarian_jax.rollout.scheduler import Scheduler, SchedulerStats, run_batch
from librarian_jax.segment import Segment

__all__ = [
    "EpisodeRecord",
    "RolloutConfig",
    "Scheduler",
    "SchedulerStats",
    "Segment",
    "evaluate",
    "probe_reward",
    "read_jsonl",
    "run_batch",
    "run_episode",
    "should_probe",
    "write_jsonl",
]
