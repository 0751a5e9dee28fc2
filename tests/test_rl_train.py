"""rl: the train step on the real tiny Transformer — exact micro-batching, LoRA, non-finite skip, and a GRPO
learning test with real engine sampling."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from librarian_jax import models, testing
from librarian_jax.agents.runtime import Segment
from librarian_jax.engine import Engine, SamplingParams
from librarian_jax.rl import losses
from librarian_jax.rl import rows as rows_lib
from librarian_jax.rl import train_step as ts
from librarian_jax.rollout.records import EpisodeRecord

VOCAB = 16


def small_config(layers: int = 2) -> models.ModelConfig:
    return models.get_preset("tiny", vocab_size=VOCAB, num_layers=layers, hidden_size=64,
                             intermediate_size=128, num_heads=2, num_kv_heads=1,
                             layer_types=("full_attention",) * layers)


# One train config and batch shape for the learning test and the non-finite test: one compiled update.
TRAIN = ts.TrainConfig(loss=losses.LossConfig(eps_low=0.2, eps_high=0.28, tis_cap=2.0),
                       optim=ts.OptimConfig(learning_rate=3e-3, decay="constant", grad_clip=1.0),
                       micro_batches=2)


def random_batch(rows: int = 4, seq: int = 12, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq // 2, seq + 1, rows)
    valid = np.arange(seq)[None] < lengths[:, None]
    mask = (valid & (np.arange(seq)[None] >= 3)).astype(np.float32)
    return {"tokens": (rng.integers(0, VOCAB, (rows, seq)) * valid).astype(np.int32), "valid": valid,
            "loss_mask": mask,
            "sampler_logprobs": (rng.normal(-2.5, 0.3, (rows, seq)) * mask).astype(np.float32),
            "advantages": (rng.normal(size=(rows, 1)) * mask).astype(np.float32),
            "row_weights": np.resize(np.array([0.5, 0.5, 1.0, 1.0], np.float32), rows)}


@pytest.fixture(scope="module")
def model() -> models.Transformer:
    return testing.tiny_model(small_config())


@pytest.fixture(scope="module")
def one_layer() -> models.Transformer:
    return testing.tiny_model(small_config(layers=1))


def test_micro_batched_gradients_equal_full_batch(one_layer):
    """sequence_mean with unequal row weights (the other modes' additivity: test_rl_losses). The
    micro-batched trainer also rematerialises each layer and computes log-probs in chunks of 5 positions
    (the full one: all logits at once), and with 8 devices it is sharded (data 2 x fsdp 2 x tensor 2) and
    keeps the engine's layout."""
    from librarian_jax.engine import make_mesh

    model = one_layer
    loss_cfg = losses.LossConfig(aggregation="sequence_mean", tis_cap=2.0)
    batch = random_batch(rows=8)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2}) if jax.device_count() >= 8 else None
    full = ts.Trainer(model, ts.TrainConfig(loss=loss_cfg, micro_batches=1, logits_chunk=0))
    micro = ts.Trainer(model, ts.TrainConfig(loss=loss_cfg, micro_batches=2, remat="layer", logits_chunk=5),
                       mesh=mesh)
    l1, g1 = full.loss_and_grads(batch)
    l4, g4 = micro.loss_and_grads(batch)
    np.testing.assert_allclose(l4, l1, rtol=2e-5)
    norm = float(jax.tree.reduce(lambda a, x: a + float(np.sum(np.square(x))), g1, 0.0))
    assert norm > 0
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=1e-6)
    if mesh is None:  # the unsharded part above ran; say that the sharded part did not
        pytest.skip("sharded half needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    assert micro.row_multiple() == 2 * 4
    with pytest.raises(ValueError, match="must be a multiple of 8"):
        micro.update(random_batch(rows=4))
    micro.update(batch)
    # the updated arrays keep exactly the policy engine's shardings: update_params moves nothing
    engine = Engine(model, num_slots=2, max_seq_len=16, mesh=mesh)
    state = micro.policy_state()
    for new, old in zip(jax.tree.leaves(state), jax.tree.leaves(engine.params), strict=True):
        assert new.sharding.is_equivalent_to(old.sharding, new.ndim)
    assert any(len(set(x.sharding.spec) - {None}) for x in jax.tree.leaves(state))
    engine.update_params(state)


def test_fixed_micro_batch_rows_compile_once_for_any_row_count_and_equal_one_program(one_layer):
    """`micro_batch_rows > 0`: steps of 2, 6 and 4 rows (seq 12) run 1, 3 and 2 micro-batches through one
    compiled micro-batch program and one optimizer program (the one-program update compiles once per row
    count), and every step's params and metrics equal the one-program update's (KL reference, TIS and
    chunked log-probs at the loss positions on); on 8 devices, sharded (data 2 x fsdp 2 x tensor 2: 4 rows
    a micro-batch), the same loss and gradients, one program for 4, 8 and 12 rows, the engine's layout kept;
    and the one-program update, sharded, compiles a shape once, not again at its second step."""
    from librarian_jax.engine import make_mesh

    cfg = dict(loss=losses.LossConfig(tis_cap=2.0, kl_beta=0.1),
               optim=ts.OptimConfig(learning_rate=3e-3, decay="constant"), logits_chunk=4)
    one = ts.Trainer(one_layer, ts.TrainConfig(**cfg))
    micro = ts.Trainer(one_layer, ts.TrainConfig(**cfg, micro_batch_rows=2))
    assert micro.row_multiple() == 2
    with pytest.raises(ValueError, match=r"multiple of 2 \(micro_batch_rows=2"):
        micro.update(random_batch(rows=3))
    programs = (ts._micro_step._cache_size(), ts._apply_step._cache_size(), ts._update_step._cache_size())
    steps = [random_batch(rows=r, seed=10 + r) for r in (2, 6, 4)]
    for batch in steps:
        want, got = one.update(batch), micro.update(batch)
        for k in ("loss", "grad_norm", "kl", "tis", "ratio", "loss_tokens"):
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-7, err_msg=k)
        for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(micro.params), strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=2e-6)
    new = [n - o for n, o in zip((ts._micro_step._cache_size(), ts._apply_step._cache_size(),
                                  ts._update_step._cache_size()), programs, strict=True)]
    assert new == [1, 1, 3], new  # micro-batch, optimizer; the one-program update once per row count
    if jax.device_count() < 8:
        pytest.skip("sharded half needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded = ts.Trainer(one_layer, ts.TrainConfig(**cfg, micro_batch_rows=1), mesh=mesh)
    assert sharded.row_multiple() == 4
    ref = ts.Trainer(one_layer, ts.TrainConfig(**cfg))
    batch = random_batch(rows=8, seed=1)
    (l1, g1), (l2, g2) = ref.loss_and_grads(batch), sharded.loss_and_grads(batch)  # 2 micro-batches
    np.testing.assert_allclose(l2, l1, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=1e-6)
    before = ts._micro_step._cache_size()
    for rows in (8, 4, 12):
        sharded.update(random_batch(rows=rows, seed=rows))
    assert ts._micro_step._cache_size() == before  # compiled by loss_and_grads: the same program
    # the one-program update on the mesh: its second step of a shape compiles nothing either (the params it
    # returned are laid out as the first step's inputs were)
    fused = ts.Trainer(one_layer, ts.TrainConfig(**cfg), mesh=mesh)
    before = ts._update_step._cache_size()
    fused.update(batch)
    fused.update(random_batch(rows=8, seed=3))
    assert ts._update_step._cache_size() == before + 1
    engine = Engine(one_layer, num_slots=2, max_seq_len=16, mesh=mesh)
    for x, y in zip(jax.tree.leaves(sharded.policy_state()), jax.tree.leaves(engine.params), strict=True):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim)


def _rows_with_loss(rows: int, seq: int, loss_tokens: int, seed: int) -> dict[str, np.ndarray]:
    """`random_batch`'s rows, every one with its loss mask on `loss_tokens` positions from position 3."""
    batch = random_batch(rows=rows, seq=seq, seed=seed)
    batch["valid"][:] = True
    mask = ((np.arange(seq) >= 3) & (np.arange(seq) < 3 + loss_tokens))[None].repeat(rows, 0)
    batch["loss_mask"] = mask.astype(np.float32)
    batch["sampler_logprobs"] *= batch["loss_mask"]
    batch["advantages"] = (np.abs(batch["advantages"]).max(axis=1, keepdims=True) + 0.1) * batch["loss_mask"]
    return batch


@pytest.mark.parametrize("sharded", [False, True])
def test_update_programs_ahead_leave_the_update_nothing_to_compile(one_layer, sharded):
    """`Trainer.programs_ahead(shapes)` compiles, from abstract arguments, the update programs of batches of
    those `update_shape`s (the micro-batch program per shape, the optimizer's and the zero accumulator's):
    updates of such batches afterwards compile nothing, one process, and on 8 devices (red if a job leaves
    out the loss positions, the accumulator's layout, or the optimizer). A config no other test compiles, so
    each program is new to the process here."""
    from librarian_jax.compile_cache import Ahead, CompileClock
    from librarian_jax.engine import make_mesh

    if sharded and jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2}) if sharded else None
    cfg = ts.TrainConfig(loss=losses.LossConfig(tis_cap=1.7, kl_beta=0.07),
                         optim=ts.OptimConfig(learning_rate=1e-3, decay="constant"), logits_chunk=8,
                         micro_batch_rows=1)
    trainer = ts.Trainer(one_layer, cfg, mesh=mesh)
    rm = trainer.row_multiple()
    batches = [_rows_with_loss(2 * rm, 96, 40, seed=1), _rows_with_loss(rm, 40, 20, seed=2)]
    shapes = [trainer.update_shape(b["tokens"].shape[1], ts.most_loss_tokens(b["loss_mask"]))
              for b in batches]
    assert shapes == [(96, 64), (40, 0)]  # 40 loss tokens: 64 positions; 64 >= 40 tokens: every position
    jobs = trainer.programs_ahead(shapes)
    assert [n for n, _ in jobs] == [f"update[{rm}x96, positions 64]", f"update[{rm}x40, positions all]",
                                    "optimizer", "zero accumulator"]
    report = Ahead(jobs, threads=2).run()
    assert report.programs == len(jobs) and not report.failed, report
    clock = CompileClock.get()
    before = clock.totals()
    for b in [*batches, batches[0]]:
        out = trainer.update(b)
        assert np.isfinite(out["loss"]) and not out["skipped"]
    assert clock.since(before).programs == 0, clock.since(before)
    # what a run compiles at start (`training.run`): the programs no batch shape changes
    assert [n for n, _ in trainer.programs_ahead([])] == ["optimizer", "zero accumulator"]
    assert ts.Trainer(one_layer, ts.TrainConfig(micro_batch_rows=0)).programs_ahead(shapes) == []


def test_lora_trains_only_lora_params_and_serves_from_engine(model):
    lora = ts.apply_lora(model, rank=4, alpha=8.0, module_path=".*(q_proj|v_proj|gate_proj|up_proj).*")
    base_before = jax.tree.map(np.asarray, nnx.state(lora, nnx.Not(nnx.LoRAParam)))
    # remat too: qwix writes to its modules when called, which must stay inside one trace
    trainer = ts.Trainer(lora, ts.TrainConfig(optim=ts.OptimConfig(learning_rate=1e-2), remat=True))
    assert trainer.lora
    n_lora = sum(x.size for x in jax.tree.leaves(nnx.state(lora, nnx.LoRAParam)))
    assert trainer.num_trainable == n_lora > 0
    lora_before = jax.tree.map(np.asarray, trainer.params)
    out = trainer.update(random_batch())
    assert out["skipped"] == 0.0
    after = trainer.model()
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(nnx.state(after, nnx.Not(nnx.LoRAParam))),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(b), a)
    # B starts at zero, so the first step moves every B (A's gradient is zero until B is not).
    before_flat = dict(nnx.to_flat_state(lora_before))
    moved = {path: not np.array_equal(np.asarray(before_flat[path][...]), np.asarray(v[...]))
             for path, v in nnx.to_flat_state(trainer.params)}
    b_moved = [m for path, m in moved.items() if "lora_b" in str(path[-1])]
    assert b_moved and all(b_moved), moved
    # The LoRA policy serves from the engine and takes the trained adapters without a rebuild.
    engine = Engine(lora, num_slots=2, max_seq_len=16, round_steps=4)
    engine.update_params(trainer.policy_state())
    s = engine.new_session([1, 2, 3])
    engine.submit(s, 4)
    (res,) = engine.run_until_done()
    expected = ts.sequence_logprobs(trainer.model(), np.array([[1, 2, 3, *res.tokens]]),
                                    np.ones((1, 3 + len(res.tokens)), bool))[0, 3:]
    np.testing.assert_allclose(res.logprobs, expected, atol=2e-4)


def test_non_finite_loss_skips_update_and_run_goes_on(model, caplog):
    trainer = ts.Trainer(model, TRAIN)
    before = jax.tree.map(np.asarray, trainer.params)
    bad = random_batch(rows=32, seq=32)
    bad["advantages"] = np.where(bad["loss_mask"] > 0, np.nan, 0.0).astype(np.float32)
    with caplog.at_level("WARNING"):
        out = trainer.update(bad)
    assert out["skipped"] == 1.0
    assert "non-finite" in caplog.text and "update skipped" in caplog.text
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.params), strict=True):
        np.testing.assert_array_equal(np.asarray(b), a)
    out = trainer.update(random_batch(rows=32, seq=32, seed=1))
    assert out["skipped"] == 0.0 and np.isfinite(out["loss"])
    assert any(not np.array_equal(a, np.asarray(b))
               for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.params), strict=True))


TARGET = 7


def test_grpo_learns_target_token_with_engine_sampling():
    """Bandit: reward = share of sampled tokens equal to 7. GRPO with the real engine and train step."""
    model = testing.tiny_model(small_config())
    groups, group_size, new_tokens = 4, 8, 12
    engine = Engine(model, num_slots=groups * group_size, max_seq_len=32, round_steps=new_tokens)
    trainer = ts.Trainer(model, TRAIN)
    rows_cfg = rows_lib.RowsConfig(advantage="grpo", seq_buckets=(32,), max_row_len=32,
                                   row_multiple=trainer.row_multiple())
    prompt = [1, 2, 3, 4]
    mean_rewards, tis = [], []
    for step in range(14):
        sessions = []
        for i in range(groups * group_size):
            s = engine.new_session(prompt)
            engine.submit(s, new_tokens, SamplingParams(temperature=1.0, seed=1000 + step, stream=i))
            sessions.append(s)
        engine.run_until_done()
        records = []
        for i, s in enumerate(sessions):
            rec = s.record()
            s.close()
            reward = float(np.mean(rec.tokens[len(prompt):] == TARGET))
            turn = np.where(rec.loss_mask > 0, 0, -1).astype(np.int32)
            seg = Segment(rec.tokens.astype(np.int32), rec.logprobs, rec.loss_mask, turn)
            records.append(EpisodeRecord(task_id=f"bandit{i // group_size}", group_id=i // group_size,
                                         episode_index=i % group_size, segments=[seg], turn_rewards=[0.0],
                                         terminal_reward=reward, total_reward=reward, num_turns=1))
        batch, _ = rows_lib.build_rows(records, rows_cfg)
        out = trainer.update(batch)
        engine.update_params(trainer.policy_state())
        mean_rewards.append(np.mean([r.total_reward for r in records]))
        tis.append(out["tis"])
    # the sampler's log-probs are the trainer's: the TIS weight stays ~1
    np.testing.assert_allclose(tis, 1.0, atol=1e-3)
    assert mean_rewards[0] < 0.15
    assert np.mean(mean_rewards[-3:]) > 0.5, mean_rewards


def test_kl_reference_is_the_starting_policy_through_updates_and_a_restore(model):
    """`kl_beta > 0` (the embedded default's): the reference is the params the trainer started from. The KL
    is 0 at the first update (policy = reference), positive after the policy moved, and a restored state
    (`set_state`, as main's resume does on the warm-started trainer) keeps that reference."""
    cfg = ts.TrainConfig(loss=losses.LossConfig(kl_beta=0.1, tis_cap=2.0),
                         optim=ts.OptimConfig(learning_rate=3e-2, decay="constant", grad_clip=1.0))
    trainer = ts.Trainer(model, cfg)
    start = jax.tree.map(np.asarray, trainer.params)
    batch = random_batch()
    assert trainer.update(batch)["kl"] == pytest.approx(0.0, abs=1e-7)
    for _ in range(2):
        trainer.update(batch)
    kl = trainer.update(batch)["kl"]
    assert kl > 1e-5
    for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(trainer.ref_params), strict=True):
        np.testing.assert_array_equal(np.asarray(b), a)
    state = jax.tree.map(np.asarray, trainer.get_state())
    resumed = ts.Trainer(model, cfg)  # built from the same starting policy, as a resumed run is
    resumed.set_state(state["params"], state["opt_state"], state["step"])
    again = resumed.update(batch)["kl"]
    assert again > 1e-5 and again == pytest.approx(trainer.update(batch)["kl"], rel=1e-5)
