"""rl: advantages, training rows and policy losses against hand-computed values."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from librarian_jax.rl import advantages as adv
from librarian_jax.rl import losses
from librarian_jax.rl import rows as rows_lib


def test_advantage_registry_hand_values():
    r = np.array([1.0, 0.0, 0.0, 1.0])
    np.testing.assert_allclose(adv.get_advantage_fn("paper")(r), [0.5, -0.5, -0.5, 0.5])
    np.testing.assert_allclose(adv.get_advantage_fn("drgrpo")(r), [0.5, -0.5, -0.5, 0.5])
    np.testing.assert_allclose(adv.get_advantage_fn("grpo")(r), [1, -1, -1, 1], atol=1e-5)  # std = 0.5
    # rloo: 1 - mean(0, 0, 1) = 2/3
    np.testing.assert_allclose(adv.get_advantage_fn("rloo")(r), [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    np.testing.assert_allclose(adv.get_advantage_fn("grpo")(np.ones(4)), 0.0)
    with pytest.raises(KeyError, match="unknown advantage estimator 'nope'"):
        adv.get_advantage_fn("nope")


def test_reward_to_go_and_step_advantages():
    np.testing.assert_allclose(adv.reward_to_go([1.0, 0.0, 2.0], gamma=0.5), [1.5, 1.0, 2.0])
    # episode a: rewards [0, 1] -> rtg [1, 1]; episode b: [0, 0, 3] -> rtg [3, 3, 3]
    a, b = adv.step_advantages([[0.0, 1.0], [0.0, 0.0, 3.0]])
    np.testing.assert_allclose(a, [-1.0, -1.0])
    np.testing.assert_allclose(b, [1.0, 1.0, 0.0])  # turn 2 reached by b only -> 0


@dataclasses.dataclass
class _Seg:
    tokens: np.ndarray
    logprobs: np.ndarray
    loss_mask: np.ndarray
    turn_index: np.ndarray


@dataclasses.dataclass
class _Rec:
    task_id: str
    group_id: int
    segments: list
    turn_rewards: list
    total_reward: float


def _seg(prompt: int, turns: list[int]) -> _Seg:
    """`prompt` observation tokens then, for each turn t, turns[t] sampled tokens (logprob -0.5)."""
    toks, lps, mask, ti = [5] * prompt, [0.0] * prompt, [0.0] * prompt, [-1] * prompt
    for t, n in enumerate(turns):
        toks += [9] * n
        lps += [-0.5] * n
        mask += [1.0] * n
        ti += [t] * n
    return _Seg(np.array(toks, np.int32), np.array(lps, np.float32), np.array(mask, np.float32),
                np.array(ti, np.int32))


def test_build_rows_weights_advantages_padding():
    recs = [
        # group 0: episode 0 split by compaction into two segments; episode 1 one segment
        _Rec("t0", 0, [_seg(3, [2]), _seg(4, [0, 3])], [0.0, 1.0], 1.0),
        _Rec("t0", 0, [_seg(2, [1, 1])], [0.0, 0.0], 0.0),
        # group 1: all rewards equal
        _Rec("t1", 1, [_seg(2, [2])], [0.5], 0.5),
        _Rec("t1", 1, [_seg(2, [2])], [0.5], 0.5),
    ]
    cfg = rows_lib.RowsConfig(advantage="paper", seq_buckets=(8, 16), max_row_len=16, row_multiple=4,
                              step_weight=0.5)
    batch, m = rows_lib.build_rows(recs, cfg)
    assert batch.shape == (8, 8)  # 5 rows -> padded to 8; longest row 7 -> bucket 8
    np.testing.assert_allclose(batch.row_weights, [0.5, 0.5, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(batch.episode_ids, [0, 0, 1, 2, 3, -1, -1, -1])
    assert m["adv/equal_reward_groups_frac"] == 0.5
    # episode 0: A_ep = 0.5; step rtg [1, 1] vs episode 1's [0, 0] -> A_step = [0.5, 0.5] for ep 0
    np.testing.assert_allclose(batch.advantages[0, 3:5], 0.5 + 0.5 * 0.5)
    np.testing.assert_allclose(batch.advantages[1, 4:7], 0.75)
    np.testing.assert_allclose(batch.advantages[2, 2:4], -0.5 - 0.25)
    assert np.all(batch.advantages[batch.loss_mask == 0] == 0)
    np.testing.assert_array_equal(batch.tokens[0], [5, 5, 5, 9, 9, 0, 0, 0])
    np.testing.assert_array_equal(batch.valid[0], [1, 1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_allclose(batch.sampler_logprobs[0], [0, 0, 0, -0.5, -0.5, 0, 0, 0])
    assert m["rows/loss_tokens"] == 2 + 3 + 2 + 2 + 2


def test_build_rows_rejects_mismatched_segment():
    bad = _seg(2, [1])
    bad.logprobs = bad.logprobs[:-1]
    with pytest.raises(ValueError, match="segment 0: segment field 'logprobs' has shape \\(2,\\)"):
        rows_lib.build_rows([_Rec("t", 0, [bad], [0.0], 0.0)], rows_lib.RowsConfig())


def _ppo(lp, old, sampler, a, **kw):
    cfg = losses.LossConfig(**{"aggregation": "token_mean", **kw})
    m = jnp.ones_like(jnp.asarray(lp))
    w = jnp.ones((m.shape[0],))
    return losses.ppo_loss(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(a), m, w,
                           config=cfg)


@pytest.mark.parametrize("ratio,a,expected,clipped", [
    (1.1, 1.0, -1.1, False),        # inside the band
    (1.5, 1.0, -1.28, True),        # A > 0, r > 1 + eps_high: clipped at 1.28
    (0.5, 1.0, -0.5, False),        # A > 0, r small: the unclipped (larger) loss
    (0.5, -1.0, 0.8, True),         # A < 0, r < 1 - eps_low: clipped at 0.8
    (2.0, -1.0, 2.0, False),        # A < 0, r large: unclipped, below dual bound 3
    (5.0, -1.0, 3.0, False),        # dual clip: min(5, 3 * 1)
])
def test_ppo_clip_cases(ratio, a, expected, clipped):
    lp = np.array([[math.log(ratio)]], np.float32)
    total, count, sums = _ppo(lp, np.zeros_like(lp), np.zeros_like(lp), np.array([[a]], np.float32),
                              eps_low=0.2, eps_high=0.28, dual_clip=3.0, tis_cap=2.0)
    np.testing.assert_allclose(float(total / count), expected, rtol=1e-5)
    assert float(sums["clip"]) == float(clipped)
    assert float(sums["dual_clip"]) == float(ratio == 5.0)


def test_dual_clip_off_and_tis_cap():
    lp = np.array([[math.log(5.0)]], np.float32)
    total, count, _ = _ppo(lp, np.zeros_like(lp), np.zeros_like(lp), -np.ones_like(lp), dual_clip=0.0)
    np.testing.assert_allclose(float(total / count), 5.0, rtol=1e-5)
    # TIS: weight = min(exp(old - sampler), 2) -> 2 for exp(log 3), 0.5 for exp(log .5)
    old = np.zeros((1, 2), np.float32)
    sampler = np.array([[-math.log(3.0), math.log(2.0)]], np.float32)
    total, count, sums = _ppo(old, old, sampler, np.ones_like(old), tis_cap=2.0)
    np.testing.assert_allclose(float(total), -(2.0 + 0.5), rtol=1e-5)
    np.testing.assert_allclose(float(sums["tis"]), 2.5, rtol=1e-5)


def test_tis_is_stop_gradient_and_kl_k3():
    sampler = jnp.array([[-1.0]])
    ref = jnp.array([[-0.3]])
    cfg = losses.LossConfig(kl_beta=0.1, tis_cap=2.0, dual_clip=0.0)

    def f(lp):
        ones = jnp.ones_like(lp)
        t, c, _ = losses.ppo_loss(lp, jax.lax.stop_gradient(lp), sampler, ones, ones, jnp.ones((1,)), ref,
                                  config=cfg)
        return t / c

    lp = jnp.array([[-0.5]])
    # value: -A * r * tis + beta * k3 with r = 1, tis = min(exp(-0.5 + 1), 2), k3 = e^d - d - 1, d = ref - lp
    d = -0.3 + 0.5
    tis = min(math.exp(0.5), 2.0)
    np.testing.assert_allclose(float(f(lp)), -tis + 0.1 * (math.exp(d) - d - 1), rtol=1e-5)
    # gradient: -A * tis * dr/dlp (r = exp(lp - sg(lp)) -> 1) + beta * (1 - e^d)
    np.testing.assert_allclose(float(jax.grad(f)(lp)[0, 0]), -tis + 0.1 * (1 - math.exp(d)), rtol=1e-5)


def test_aggregations_hand_values():
    per_tok = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    w = jnp.array([0.5, 1.0])
    s, c = losses.aggregate(per_tok, mask, w, "token_mean", 0)
    assert (float(s), float(c)) == (0.5 * 3 + 4.0, 0.5 * 2 + 1.0)
    s, c = losses.aggregate(per_tok, mask, w, "sequence_mean", 0)
    assert (float(s), float(c)) == (0.5 * 1.5 + 4.0, 1.5)
    s, c = losses.aggregate(per_tok, mask, w, "drgrpo", 0)
    assert (float(s), float(c)) == (5.5, 1.5 * 3)  # L_max = padded length 3
    s, c = losses.aggregate(per_tok, mask, w, "drgrpo", 10)
    assert float(c) == 15.0
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        losses.aggregate(per_tok, mask, w, "mean", 0)


def test_token_logprobs_alignment_and_temperature():
    logits = jnp.log(jnp.array([[[0.25, 0.75], [0.5, 0.5], [0.9, 0.1]]]))
    tokens = jnp.array([[0, 1, 0]])
    lp, ent = losses.token_logprobs(logits, tokens, 1.0)
    np.testing.assert_allclose(np.asarray(lp), [[0.0, math.log(0.75), math.log(0.5)]], rtol=1e-6)
    np.testing.assert_allclose(float(ent[0, 2]), math.log(2.0), rtol=1e-6)
    lp2, _ = losses.token_logprobs(logits, tokens, 2.0)
    p = np.sqrt([0.25, 0.75])
    np.testing.assert_allclose(float(lp2[0, 1]), math.log(p[1] / p.sum()), rtol=1e-6)


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_aggregation_sums_and_counts_add_over_micro_batches(mode):
    rng = np.random.default_rng(0)
    per_tok = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)
    mask = jnp.asarray(rng.random((6, 5)) < 0.6, jnp.float32)
    w = jnp.asarray([0.5, 0.5, 1.0, 1 / 3, 1 / 3, 1 / 3], jnp.float32)
    full_s, full_c = losses.aggregate(per_tok, mask, w, mode, 0)
    parts = [losses.aggregate(per_tok[i:i + 2], mask[i:i + 2], w[i:i + 2], mode, 5) for i in (0, 2, 4)]
    np.testing.assert_allclose(sum(float(p[0]) for p in parts) / sum(float(p[1]) for p in parts),
                               float(full_s / full_c), rtol=1e-6)


def test_optimizer_direction_times_host_lr_equals_optax_adamw_schedule():
    import optax

    from librarian_jax.rl import train_step as ts

    cfg = ts.OptimConfig(learning_rate=1e-2, warmup_steps=2, total_steps=10, weight_decay=0.1, grad_clip=0.5)
    ref = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(ts.make_schedule(cfg), weight_decay=0.1))
    mine, sched = ts.make_optimizer(cfg), ts.make_schedule(cfg)
    p1 = p2 = {"a": jnp.ones(3)}
    s1, s2 = ref.init(p1), mine.init(p2)
    for step in range(5):
        g = {"a": jnp.array([0.3, -2.0, 0.01]) * (step + 1)}
        u, s1 = ref.update(g, s1, p1)
        p1 = optax.apply_updates(p1, u)
        d, s2 = mine.update(g, s2, p2)
        p2 = jax.tree.map(lambda x, y, lr=sched(step): x - lr * y, p2, d)
    np.testing.assert_allclose(np.asarray(p2["a"]), np.asarray(p1["a"]), rtol=1e-6)
    assert float(sched(0)) == 0.0 and float(sched(2)) == pytest.approx(1e-2)


def test_a_sessions_record_is_a_segment_and_trains_only_as_a_builders():
    """One session-array type: any session's record is a `Segment`; `for_training` passes a builder's (every
    sampled id tagged with its turn) as it is and refuses an answerer's (sampled ids tagged -1, as the engine
    records any role's turn), naming the invariant, as do the episode records and the rows that rl reads."""
    from librarian_jax.engine.session import TokenRecord
    from librarian_jax.rollout import EpisodeRecord
    from librarian_jax.segment import Segment

    builder = TokenRecord([5, 6])
    builder.extend([7, 8], [-0.5, -0.25], tag=0)
    builder.extend([9], tag=3)  # an observation: never tagged
    builder.extend([10], [-1.0], tag=1)
    seg = builder.record()
    assert isinstance(seg, Segment) and seg.for_training() is seg
    np.testing.assert_array_equal(seg.tokens, [5, 6, 7, 8, 9, 10])
    np.testing.assert_array_equal(seg.logprobs, [0, 0, -0.5, -0.25, 0, -1.0])
    np.testing.assert_array_equal(seg.loss_mask, [0, 0, 1, 1, 0, 1])
    np.testing.assert_array_equal(seg.turn_index, [-1, -1, 0, 0, -1, 1])
    np.testing.assert_array_equal(builder.record(2).tokens, [7, 8, 9, 10])  # a turn's slice, same type
    answerer = TokenRecord([5, 6])
    answerer.extend([7], [-0.5])  # untagged: -1
    rec = answerer.record()  # a valid record of any role
    invariant = "turn_index must be >= 0 exactly where loss_mask is 1"
    with pytest.raises(ValueError, match=invariant):
        rec.for_training()
    ep = EpisodeRecord("t", 0, 0, [rec], turn_rewards=[1.0], terminal_reward=0.0, total_reward=1.0,
                       num_turns=1, tool_calls=[[]], tool_errors=[[]], replies=[""])
    with pytest.raises(ValueError, match=invariant):
        EpisodeRecord.from_dict(ep.to_dict())
    with pytest.raises(ValueError, match=rf"episode 0 \(task t\) segment 0: .*{invariant}"):
        rows_lib.build_rows([ep, dataclasses.replace(ep, episode_index=1)], rows_lib.RowsConfig())
    with pytest.raises(ValueError, match="turn_index must be -1 on tokens that were not sampled"):
        Segment(seg.tokens, seg.logprobs, seg.loss_mask, np.zeros(6, np.int32))
