"""models.Transformer(scan_layers=True) / train.scan_layers: the decoder layers that repeat a pattern run
under one `lax.scan` (`transformer.scan_plan`, `run_layer_scan`). The scanned forward and the train step's
loss, metrics and gradients equal the layer-by-layer loop for Qwen3-like, Gemma-3-like (sliding + global
attention, a period plus a remainder), Qwen3.5-like (Gated DeltaNet + attention) and Qwen3.5-MoE-like
(router statistics sown inside the scan) tiny models, with and without LoRA, for remat none and layer; the
lowered train step no longer grows with depth; a model the plan cannot scan runs the loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import logging
from flax import nnx

from librarian_jax import models
from librarian_jax.models import transformer as transformer_lib
from librarian_jax.models.config import _pattern
from librarian_jax.rl import losses
from librarian_jax.rl import train_step as ts

VOCAB = 48
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_heads=2, num_kv_heads=1, head_dim=16,
             dtype="float32", param_dtype="float32")
LINEAR = dict(linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
              linear_value_head_dim=8)


def config(kind: str, layers: int, period: int = 2) -> models.ModelConfig:
    """A tiny `kind` model of `layers` layers; gemma3 / qwen3_5 / moe alternate their layer types with
    `period` (see each branch; the real models use 6 and 4)."""
    if kind == "qwen3":
        return models.get_preset("tiny", num_layers=layers, **SMALL)
    if kind == "gemma3":  # (period - 1) sliding + 1 global (the real model: period 6)
        return models.get_preset("gemma3_1b", num_layers=layers, sliding_window=4, query_pre_attn_scalar=16.0,
                                 layer_types=_pattern(layers, period, "sliding_attention", "full_attention"),
                                 **SMALL)
    if kind == "qwen3_5":  # (period - 1) Gated DeltaNet + 1 gated attention (the real model: period 4)
        return models.get_preset("qwen3_5_4b", num_layers=layers,
                                 layer_types=_pattern(layers, period, "linear_attention", "full_attention"),
                                 **SMALL, **LINEAR)
    if kind == "moe":  # qwen3_5 layers with a sparse MoE each (8 experts, top 2, shared expert)
        return models.get_preset("tiny_moe", num_layers=layers,
                                 layer_types=_pattern(layers, period, "linear_attention", "full_attention"),
                                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=16, **SMALL, **LINEAR)
    raise ValueError(kind)


# (kind, layers, expected (period, periods), LoRA): every case really scans; gemma3 and qwen3_5 leave a
# remainder (5 = 2 periods of 2 + 1 layer unrolled). Small periods and depths keep the file within the
# suite's budget (each case compiles 2 forwards and 4 train steps); LoRA on a period-1 and a period-2 model.
# (The MoE case's layers are Qwen3.5's, Gated DeltaNet and attention, so it covers that model too.)
CASES = [("qwen3", 3, (1, 3), True), ("gemma3", 5, (2, 2), True), ("moe", 4, (2, 2), False)]


def model_for(kind: str, layers: int, lora: bool) -> nnx.Module:
    model = models.Transformer(config(kind, layers), rngs=nnx.Rngs(0))
    if lora:
        model = ts.apply_lora(model, rank=2, alpha=4.0)  # every linear projection (and the MoE experts)
        rng = np.random.default_rng(1)
        for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):  # B != 0: adapters change outputs
            v.set_value(jnp.asarray(rng.normal(size=v.get_value().shape) * 0.2, jnp.float32))
    return model


def batch(rows: int = 2, seq: int = 11, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    valid = np.arange(seq)[None] < np.array([seq, seq - 3])[:rows, None]
    mask = (valid & (np.arange(seq)[None] >= 2)).astype(np.float32)
    return {"tokens": (rng.integers(0, VOCAB, (rows, seq)) * valid).astype(np.int32), "valid": valid,
            "loss_mask": mask,
            "sampler_logprobs": (rng.normal(-np.log(VOCAB), 0.3, (rows, seq)) * mask).astype(np.float32),
            "advantages": (rng.normal(size=(rows, 1)) * mask).astype(np.float32),
            "row_weights": np.ones((rows,), np.float32)}


def train_config(scan: bool, remat: str) -> ts.TrainConfig:
    return ts.TrainConfig(loss=losses.LossConfig(kl_beta=0.0, temperature=0.8), remat=remat, logits_chunk=4,
                          logits_at="all", scan_layers=scan, moe_aux_loss_coef=0.01)


@pytest.mark.parametrize("kind,layers,plan,lora", CASES,
                         ids=[f"{c[0]}-{'lora' if c[3] else 'full'}" for c in CASES])
def test_scanned_forward_and_train_step_equal_the_loop(kind, layers, plan, lora):
    # remat "layer" (a checkpoint per layer inside the scan body) on the attention-only models; the DeltaNet
    # and MoE models' programs are the slowest to compile, and their scan bodies are checked without it
    remats = ("none", "layer") if kind in ("qwen3", "gemma3") else ("none",)
    model = model_for(kind, layers, lora)
    got = transformer_lib.scan_plan(list(model.layers), model)
    assert (got.period, got.periods) == plan, got
    data = batch()
    base = ts.Trainer(model, train_config(False, "none"))
    device_batch = base._device_batch(data)
    graphdef = base.graphdef
    tokens, valid = jnp.asarray(data["tokens"]), jnp.asarray(data["valid"])

    @jax.jit
    def everything(params, rest, device_batch):  # one compilation for every variant
        m = nnx.merge(graphdef, params, rest)
        logits = [m(tokens, mask=valid, scan_layers=s)[0] for s in (False, True)]
        steps = {(s, r): ts._accumulate(graphdef, train_config(s, r), params, rest, None, device_batch)
                 for s in (False, True) for r in remats}
        return logits, steps

    logits, steps = jax.device_get(everything(base.params, base.rest, device_batch))
    assert np.all(np.isfinite(logits[0])) and np.std(logits[0]) > 0
    real = np.asarray(data["valid"])  # padded positions' logits are never read
    np.testing.assert_allclose(logits[1][real], logits[0][real], rtol=1e-5, atol=2e-5)
    for remat in remats:
        (l0, g0, s0), (l1, g1, s1) = steps[False, remat], steps[True, remat]
        assert np.isfinite(float(l0)) and float(l0) != 0.0
        np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5, atol=1e-7, err_msg=remat)
        assert set(s1) == set(s0)
        if kind == "moe":
            assert "moe_aux" in s0  # router statistics came out of the scan body
        for k in s0:
            np.testing.assert_allclose(float(s1[k]), float(s0[k]), rtol=1e-5, atol=1e-6,
                                       err_msg=f"{remat} {k}")
        flat0, flat1 = nnx.to_flat_state(g0), nnx.to_flat_state(g1)
        assert sum(float(np.sum(np.square(v.get_value()))) for _, v in flat0) > 0
        # every layer's own gradient (the stack's gradient reaches each layer), not just their sum
        layers_with_grad = {p[1] for p, v in flat1 if p[0] == "layers" and np.any(v.get_value() != 0)}
        assert layers_with_grad == set(range(layers)), (remat, layers_with_grad)
        for (p0, a), (p1, b) in zip(flat0, flat1, strict=True):
            assert p0 == p1
            # float32 rounding: XLA fuses a while-loop body differently from unrolled layers, and deep stacks
            # of LoRA'd Gemma amplify it to ~1e-4 of a leaf's largest entry (a 1e-7 relative nudge of the
            # params moves the loop's own gradient by a fifth of that); a wrong layer slice moves it by ~1
            a, b = a.get_value(), b.get_value()
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=2e-4 * float(np.max(np.abs(a))) + 1e-7,
                                       err_msg=f"{remat} {p0}")


def lowered_ops(layers: int, scan: bool) -> tuple[int, int]:
    """(matmuls, characters) of the lowered (StableHLO) train-step gradient program of a Qwen3-like model."""
    model = models.Transformer(config("qwen3", layers), rngs=nnx.Rngs(0))
    trainer = ts.Trainer(model, train_config(scan, "layer"))
    lowered = ts._accumulate_jit.lower(trainer.graphdef, ts._static_config(trainer.config), trainer.params,
                                       trainer.rest, None, trainer._device_batch(batch()))
    text = lowered.as_text()
    return text.count("stablehlo.dot_general"), len(text)


def test_lowered_train_step_stops_growing_with_depth():
    """Deterministic stand-in for compile time: the program XLA compiles holds every layer's matmuls (forward,
    remat recomputation, backward) once per layer with the loop (8 layers: ~4x the matmuls of 2), once with
    the scan (the same count at any depth). The text still grows a little with the scan (stacking each
    layer's params and unstacking their gradients are per-layer ops), far less than with the loop."""
    (loop2, loop2_chars), (loop8, loop8_chars) = lowered_ops(2, False), lowered_ops(8, False)
    (scan2, scan2_chars), (scan8, scan8_chars) = lowered_ops(2, True), lowered_ops(8, True)
    assert loop8 / loop2 > 3.0, (loop2, loop8)
    assert scan8 == scan2, (scan2, scan8)
    assert scan8 < loop8 / 3, (scan8, loop8)
    assert scan8_chars / scan2_chars < 1.6 < 2.5 < loop8_chars / loop2_chars, (scan2_chars, scan8_chars,
                                                                                loop2_chars, loop8_chars)


def test_unscannable_models_run_the_loop(monkeypatch):
    """No pattern repeats (or qwix rules tell layers apart): the plan says why, `hidden` logs it at INFO
    and runs the layers one by one, with the same values."""
    infos = []
    monkeypatch.setattr(logging, "info", lambda msg, *args: infos.append(msg % args))
    # 1 layer: nothing to scan
    plan = transformer_lib.scan_plan(list(models.Transformer(config("qwen3", 1), rngs=nnx.Rngs(0)).layers))
    assert plan.period == 0 and "1 layer" in plan.reason
    # qwen3_5 with 6 layers: (3 DeltaNet + 1 attention) once, then 2 DeltaNet; p = 1 repeats 3 times
    hybrid = models.Transformer(config("qwen3_5", 6, period=4), rngs=nnx.Rngs(0))
    plan = transformer_lib.scan_plan(list(hybrid.layers))
    assert (plan.period, plan.periods) == (1, 3)
    # two qwix rules with the same rank and different alpha: every layer has the same adapters, but layer 0
    # scales them differently, so one body cannot serve every layer
    import qwix

    model = models.Transformer(config("qwen3", 3), rngs=nnx.Rngs(0))
    provider = qwix.LoraProvider([qwix.LoraRule(module_path="layers/0/.*q_proj", rank=2, alpha=8.0),
                                  qwix.LoraRule(module_path=".*q_proj", rank=2, alpha=2.0)])
    lora = qwix.apply_lora_to_model(model, provider, jnp.zeros((1, 4), jnp.int32), rngs=nnx.Rngs(0),
                                    methods=("hidden",))
    rng = np.random.default_rng(2)
    for _, v in nnx.to_flat_state(nnx.state(lora, nnx.LoRAParam)):
        v.set_value(jnp.asarray(rng.normal(size=v.get_value().shape) * 0.5, jnp.float32))
    plan = transformer_lib.scan_plan(list(lora.layers), lora)
    assert plan.period == 0 and "qwix rules match layer 1 and layer 0 differently" in plan.reason, plan
    tokens = jnp.asarray(batch()["tokens"])
    graphdef, state = nnx.split(lora)
    logits = jax.jit(lambda state, scan: nnx.merge(graphdef, state)(tokens, scan_layers=scan)[0],
                     static_argnums=1)  # compiled: eager, each op of the model is a program of its own
    infos.clear()
    scanned = logits(state, True)  # `hidden` logs while it is traced
    assert any("one by one" in m and "qwix rules" in m for m in infos), infos
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(logits(state, False)), rtol=1e-6, atol=1e-6)
    # the plan found the rules: with one rule (the usual rl.apply_lora) the same model scans
    one_rule = ts.apply_lora(model, rank=2, alpha=4.0, module_path=".*q_proj")
    plan = transformer_lib.scan_plan(list(one_rule.layers), one_rule)
    assert (plan.period, plan.periods) == (1, 3), plan


def test_scan_layers_key():
    model = models.Transformer(config("qwen3", 2), rngs=nnx.Rngs(0))
    assert ts.TrainConfig().scan_layers is False  # off by default: see TrainConfig
    with pytest.raises(ValueError, match="train.scan_layers: must be a bool"):
        ts.Trainer(model, ts.TrainConfig(scan_layers="yes"))
    from configs import grpo, sft
    from librarian_jax import config_schema

    for get in (grpo.get_config, sft.get_config):
        c = get()
        assert c.train.scan_layers is False
        c.train.scan_layers = True
        assert config_schema.schema_for(c).parse(c).train.trainer_config(*([1.0] if get is grpo.get_config
                                                                         else [])).scan_layers is True
    msg = "config.train.scan_layers: must be True or False"
    with pytest.raises(config_schema.ConfigError, match=msg):
        config_schema.TrainSection.parse({"scan_layers": "no"}, "config.train")


def test_scan_by_depth():
    """`train.scan_min_layers`: a model with at least that many layers trains scanned though `scan_layers` is
    False, a shallower one runs the loop, 0 (the default: `bench.compile` measured the scanned CPU step
    slower at every depth) never scans by depth, and `scan_layers=True` scans any depth (red when the
    Trainer ignores the threshold)."""
    assert ts.TrainConfig().scan_min_layers == 0
    shallow = models.Transformer(config("qwen3", 2), rngs=nnx.Rngs(0))
    assert ts.Trainer(shallow, ts.TrainConfig(scan_min_layers=2)).config.scan_layers is True
    assert ts.Trainer(shallow, ts.TrainConfig(scan_min_layers=3)).config.scan_layers is False
    assert ts.Trainer(shallow, ts.TrainConfig(scan_min_layers=0)).config.scan_layers is False
    assert ts.Trainer(shallow, ts.TrainConfig(scan_layers=True, scan_min_layers=0)).config.scan_layers is True
    with pytest.raises(ValueError, match="train.scan_min_layers: must be an integer >= 0"):
        ts.Trainer(shallow, ts.TrainConfig(scan_min_layers=-1))
    from configs import grpo
    from librarian_jax import config_schema

    c = grpo.get_config("embedded")
    c.train.scan_min_layers = 2
    assert config_schema.schema_for(c).parse(c).train.trainer_config(1.0).scan_min_layers == 2
