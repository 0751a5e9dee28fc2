"""Advantage estimators for grouped multi-turn episodes (a registry).

Every estimator maps the total rewards of one group (the G episodes of one task) to one scalar per episode:

- `paper`:  `A_i = R_i - mean(R)` — what the paper's code does (no std division).
- `grpo`:   `A_i = (R_i - mean(R)) / (std(R) + eps)`.
- `drgrpo`: `A_i = R_i - mean(R)` — Dr.GRPO; the same scalar as `paper`, the difference lies in the loss
  aggregation (`sum / (B * L_max)`, see `rl.losses`), registered separately so a config names its intent.
- `rloo`:   `A_i = R_i - mean_{j != i} R_j = G / (G - 1) * (R_i - mean(R))` (leave-one-out baseline).

Per-step credit (`step_advantages`): per-turn rewards `r_k` (probe deltas, penalties) become
reward-to-go `G_t = sum_{k >= t} gamma^(k - t) r_k`; at each turn index t, the `G_t` of the episodes of the
group that reached turn t are normalised across the group (minus the mean, optionally over the std). A token
produced at builder turn t then gets `A_episode + step_weight * A_step[t]` (GiGPO-style
weight; `step_weight = 0` turns it off).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

AdvantageFn = Callable[[np.ndarray], np.ndarray]

ADVANTAGES: dict[str, AdvantageFn] = {}

EPS = 1e-6


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Registers `fn(rewards [G]) -> advantages [G]` under `name`."""

    def wrap(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGES[name] = fn
        return fn

    return wrap


def get_advantage_fn(name: str) -> AdvantageFn:
    if name not in ADVANTAGES:
        raise KeyError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGES)}")
    return ADVANTAGES[name]


@register_advantage("paper")
def paper_advantages(rewards: np.ndarray) -> np.ndarray:
    """`R - mean(R)` over the group. rewards `[G]` -> `[G]` float32."""
    r = np.asarray(rewards, np.float64)
    return (r - r.mean()).astype(np.float32)


@register_advantage("grpo")
def grpo_advantages(rewards: np.ndarray) -> np.ndarray:
    """`(R - mean(R)) / (std(R) + eps)` (population std). `[G]` -> `[G]`."""
    r = np.asarray(rewards, np.float64)
    return ((r - r.mean()) / (r.std() + EPS)).astype(np.float32)


@register_advantage("drgrpo")
def drgrpo_advantages(rewards: np.ndarray) -> np.ndarray:
    """Dr.GRPO: `R - mean(R)`, no std division. `[G]` -> `[G]`."""
    return paper_advantages(rewards)


@register_advantage("rloo")
def rloo_advantages(rewards: np.ndarray) -> np.ndarray:
    """Leave-one-out baseline: `R_i - mean_{j != i} R_j`. A group of one gets 0. `[G]` -> `[G]`."""
    r = np.asarray(rewards, np.float64)
    g = r.shape[0]
    if g < 2:
        return np.zeros_like(r, np.float32)
    return (g / (g - 1) * (r - r.mean())).astype(np.float32)


def reward_to_go(turn_rewards: Sequence[float], gamma: float = 1.0) -> np.ndarray:
    """`G_t = sum_{k >= t} gamma^(k - t) r_k`. `[T]` -> `[T]` float64."""
    r = np.asarray(turn_rewards, np.float64)
    out = np.zeros_like(r)
    acc = 0.0
    for t in range(r.shape[0] - 1, -1, -1):
        acc = r[t] + gamma * acc
        out[t] = acc
    return out


def step_advantages(group_turn_rewards: Sequence[Sequence[float]], gamma: float = 1.0,
                    normalize_std: bool = False) -> list[np.ndarray]:
    """Per-turn advantages for one group.

    Args:
      group_turn_rewards: per episode, its per-turn rewards `[T_i]` (episodes may have different lengths).
      gamma: discount of the reward-to-go.
      normalize_std: also divide by the std across the group at each turn index.

    Returns: per episode a float32 array `[T_i]`: reward-to-go at turn t minus the mean (over the episodes
    that reached turn t) of their reward-to-go at turn t. A turn index reached by one episode only gets 0.
    """
    rtg = [reward_to_go(r, gamma) for r in group_turn_rewards]
    out = [np.zeros(len(r), np.float32) for r in rtg]
    max_t = max((len(r) for r in rtg), default=0)
    for t in range(max_t):
        members = [i for i, r in enumerate(rtg) if len(r) > t]
        if len(members) < 2:
            continue
        vals = np.array([rtg[i][t] for i in members])
        centred = vals - vals.mean()
        if normalize_std:
            centred = centred / (vals.std() + EPS)
        for i, v in zip(members, centred, strict=True):
            out[i][t] = v
    return out


def all_equal(rewards: np.ndarray, tol: float = 1e-9) -> bool:
    """True when every reward of a group is the same (the group then has zero episode advantage)."""
    r = np.asarray(rewards, np.float64)
    return bool(r.size == 0 or np.ptp(r) <= tol)
