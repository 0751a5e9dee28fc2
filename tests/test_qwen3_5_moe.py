"""Qwen3.5-MoE end to end: HF logit parity, greedy cached decode against transformers' generate, padded
prefill + decode against one forward, save_hf round trips in both expert layouts, the grouped matmuls against
a dense loop, expert-parallel (8 simulated devices) against unsharded, router statistics and expert LoRA.

Fixtures: tests/fixtures/golden/qwen3_5moe_*/, written by tests/make_golden_qwen3_5_moe.py (torch); no torch
here. `qwen3_5moe_c` is in the published layout (multimodal config, `model.language_model.`, fused experts).
"""

from __future__ import annotations

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from forward import cached, forward
from safetensors.numpy import load_file

from librarian_jax.models import init_cache, load_hf, save_hf
from librarian_jax.models import moe as moe_lib

GOLDEN = os.path.join(os.path.dirname(__file__), "fixtures", "golden")
FIXTURES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(GOLDEN, "qwen3_5moe_*")))
needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/run.sh simulates them)")


def params(model) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, path)): np.asarray(var.get_value()) for path, var in flat}


def test_fixtures_cover_the_issue():
    configs = [load_hf(os.path.join(GOLDEN, f)).config for f in FIXTURES]
    assert {c.num_experts_per_tok for c in configs} >= {1, 2, 3}
    assert {c.shared_expert_intermediate_size > 0 for c in configs} == {True, False}
    assert {c.tie_embeddings for c in configs} == {True, False}
    assert all(c.model_type == "qwen3_5_moe_text" and "linear_attention" in c.layer_types for c in configs)


@pytest.mark.parametrize("folder", FIXTURES)
def test_logits_match_hf(folder):
    """fp32 logits within 1e-4 of transformers' Qwen3_5MoeForCausalLM (eager experts)."""
    model = load_hf(os.path.join(GOLDEN, folder))
    ref = np.load(os.path.join(GOLDEN, folder, "reference.npz"))
    graphdef, state = nnx.split(model)
    logits = forward(graphdef, state, jnp.asarray(ref["input_ids"]), None)
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("folder", ["qwen3_5moe_a"])  # qwen3_5moe_c: test_engine_serves_moe_like_transformers
def test_greedy_cached_decode_matches_hf_generate(folder):
    """Prefill of the prompt then one-token decodes through the cache reproduce transformers' greedy tokens
    (that each step's logits equal one forward is test_padded_prefill_then_decode_equals_full_forward)."""
    model = load_hf(os.path.join(GOLDEN, folder))
    ref = np.load(os.path.join(GOLDEN, folder, "reference.npz"))
    graphdef, state = nnx.split(model)
    prompt, want = ref["input_ids"][:1, : int(ref["prompt"])], ref["greedy"]
    cache = init_cache(model.config, 1, prompt.shape[1] + len(want))
    logits, cache = cached(graphdef, state, jnp.asarray(prompt), cache, None)
    got = []
    for _ in range(len(want)):
        got.append(int(np.argmax(np.asarray(logits[0, -1]))))
        logits, cache = cached(graphdef, state, jnp.asarray([[got[-1]]], jnp.int32), cache, None)
    assert got == want.tolist()


def test_padded_prefill_then_decode_equals_full_forward():
    """Rows of different lengths: one padded prefill then decodes equal one forward over each row."""
    model = load_hf(os.path.join(GOLDEN, "qwen3_5moe_a"))
    graphdef, state = nnx.split(model)
    prompt, lengths, steps = 70, np.array([70, 41]), 3
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.config.vocab_size, (2, prompt + steps)).astype(np.int32)
    cache = init_cache(model.config, 2, prompt + steps)
    mask = np.arange(prompt)[None, :] < lengths[:, None]
    logits, cache = cached(graphdef, state, jnp.asarray(tokens[:, :prompt]), cache, jnp.asarray(mask))
    got = [np.asarray(logits)]
    for t in range(steps):
        step = tokens[np.arange(2), lengths + t][:, None]
        logits, cache = cached(graphdef, state, jnp.asarray(step), cache, None)
        got.append(np.asarray(logits))
    full_tokens = np.zeros((2, prompt + steps), np.int32)
    for b in range(2):
        full_tokens[b, : lengths[b] + steps] = np.concatenate(
            [tokens[b, : lengths[b]], tokens[b, lengths[b] + np.arange(steps)]])
    full_mask = np.arange(prompt + steps)[None, :] < (lengths + steps)[:, None]
    full = np.asarray(forward(graphdef, state, jnp.asarray(full_tokens), jnp.asarray(full_mask)))
    for b in range(2):
        n = lengths[b]
        np.testing.assert_allclose(got[0][b, :n], full[b, :n], atol=1e-4, rtol=0)
        for t in range(steps):
            np.testing.assert_allclose(got[1 + t][b, 0], full[b, n + t], atol=1e-4, rtol=0)


@pytest.mark.parametrize("folder", FIXTURES)
def test_save_hf_round_trip(folder, tmp_path):
    """load -> save_hf (per-expert and fused) -> load is exact, and the written tensors are the checkpoint's
    own (per-expert: transformers' save_pretrained names; fused: the published names, without the
    multimodal prefix)."""
    first = load_hf(os.path.join(GOLDEN, folder))
    original = {k.replace("model.language_model.", "model."): v
                for k, v in load_file(os.path.join(GOLDEN, folder, "model.safetensors")).items()}
    no_shared = not first.config.shared_expert_intermediate_size
    for layout in ("per_expert", "fused"):
        out = tmp_path / layout
        save_hf(first, str(out), expert_layout=layout)
        second = load_hf(str(out))
        assert second.config == first.config
        a, b = params(first), params(second)
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        saved = load_file(str(out / "model.safetensors"))
        fused = any(k.endswith("experts.gate_up_proj") for k in original)
        if (layout == "fused") == fused:  # same layout as the fixture: the very same tensors
            tied = first.config.tie_embeddings
            assert set(saved) == {k for k in original if not (tied and k == "lm_head.weight")}
            for key, tensor in saved.items():
                if no_shared and key.endswith("shared_expert_gate.weight"):
                    continue  # unused by transformers when the shared expert has width 0; we write zeros
                np.testing.assert_array_equal(tensor, original[key], err_msg=key)
        assert any(("experts.0.gate_proj" in k) == (layout == "per_expert") for k in saved)


def _dense_reference(x, top_w, top_i, gate_up, down):
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(top_w[t], top_i[t], strict=True):
            g, u = x[t] @ gate_up[e, :, 0], x[t] @ gate_up[e, :, 1]
            out[t] += w * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


@pytest.mark.parametrize("impl,tokens", [("tiled", 37), ("tiled", 3), ("ragged", 37), ("gather", 37)])
def test_grouped_matmul_equals_dense_loop(impl, tokens):
    """Every grouping implementation (tiles with padding, one row per assignment, ragged_dot) gives the
    per-token loop over its k experts; experts outside [first, first + local) contribute nothing."""
    rng = np.random.default_rng(1)
    e, h, m, k = 8, 16, 12, 3
    x = rng.standard_normal((tokens, h)).astype(np.float32)
    gate_up = rng.standard_normal((e, h, 2, m)).astype(np.float32) * 0.3
    down = rng.standard_normal((e, m, h)).astype(np.float32) * 0.3
    _, top_w, top_i = moe_lib.route(jnp.asarray(rng.standard_normal((tokens, e)) * 2), k)
    top_w, top_i = np.asarray(top_w), np.asarray(top_i)
    np.testing.assert_allclose(top_w.sum(1), 1.0, rtol=1e-6)
    want = _dense_reference(x, top_w, top_i, gate_up, down)
    # compiled, as in the model (eager, each op of each shape would be a program of its own)
    ffn = jax.jit(moe_lib.expert_ffn, static_argnames=("first_expert", "impl"))
    got = ffn(jnp.asarray(x), jnp.asarray(top_w), jnp.asarray(top_i), jnp.asarray(gate_up), jnp.asarray(down),
              impl=impl)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    # experts 4..7 held here only: the sum of the two halves is the whole
    halves = [ffn(jnp.asarray(x), jnp.asarray(top_w), jnp.asarray(top_i), jnp.asarray(gate_up[s:s + 4]),
                  jnp.asarray(down[s:s + 4]), first_expert=s, impl=impl) for s in (0, 4)]
    np.testing.assert_allclose(np.asarray(halves[0] + halves[1]), want, atol=1e-5, rtol=1e-5)


def test_router_stats_and_load_balancing_loss():
    """Sown router statistics count every real token's k assignments; the aux loss is HF's formula."""
    model = load_hf(os.path.join(GOLDEN, "qwen3_5moe_a"))
    cfg = model.config
    assert moe_lib.collect_router_stats(model)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 8)).astype(np.int32)
    mask = np.arange(8)[None, :] < np.array([[8], [5]])

    @jax.jit
    def run(graphdef, state, tokens, mask):
        m = nnx.merge(graphdef, state)
        m(tokens, mask=mask)
        stats = moe_lib.pop_router_stats(m)
        assert moe_lib.pop_router_stats(m) is None  # popped
        return stats

    stats = run(*nnx.split(model), jnp.asarray(tokens), jnp.asarray(mask))
    n_real = mask.sum() * cfg.num_layers
    assert float(stats["tokens"]) == n_real and float(stats["layers"]) == cfg.num_layers
    assert float(stats["counts"].sum()) == n_real * cfg.num_experts_per_tok
    np.testing.assert_allclose(float(stats["prob_sum"].sum()), n_real, rtol=1e-5)
    aux, load = moe_lib.load_balancing_loss(stats)
    f, p = np.asarray(stats["counts"]) / n_real, np.asarray(stats["prob_sum"]) / n_real
    np.testing.assert_allclose(float(aux), cfg.num_experts * np.sum(f * p), rtol=1e-5)
    np.testing.assert_allclose(float(np.asarray(load).mean()), 1.0, rtol=1e-5)


def test_lora_on_experts_starts_at_the_base_model_and_trains():
    """`rl.apply_lora` (qwix on attention, DeltaNet, router and shared expert; models.moe on the routed
    experts, whose grouped matmuls qwix does not see): B = 0 leaves the model as it was, and the loss has a
    gradient in every adapter of the experts."""
    from librarian_jax.rl import train_step as ts

    model = load_hf(os.path.join(GOLDEN, "qwen3_5moe_b"))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (1, 8)), jnp.int32)
    base = np.asarray(forward(*nnx.split(model), tokens, None))
    lora = ts.apply_lora(model, rank=2, alpha=4.0, module_path=".*")
    graphdef, lora_state, rest = nnx.split(lora, nnx.LoRAParam, ...)

    @jax.jit
    def loss(lora_state, rest):
        logits = nnx.merge(graphdef, lora_state, rest)(tokens)[0]
        return jnp.mean(logits ** 2), logits

    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(lora_state, rest)
    # every B = 0: the base model's logits up to float32 rounding (the differentiated program fuses its
    # attention differently from the plain forward: a few ulps at logits of ~4)
    np.testing.assert_allclose(np.asarray(logits), base, atol=1e-6, rtol=2e-6)
    g = {".".join(map(str, p)): float(np.abs(np.asarray(v.get_value())).sum())
         for p, v in nnx.to_flat_state(grads)}
    experts = {k: v for k, v in g.items() if ".mlp.experts." in k}
    assert len(experts) == 4 * model.config.num_layers
    assert all(v > 0 for k, v in experts.items() if k.endswith("_b"))
    assert any("linear_attn" in k for k in g) and any("self_attn" in k for k in g)


@needs8
def test_expert_parallel_equals_unsharded():
    """8 simulated devices as (fsdp 2, expert 2, tensor 2): experts split over `expert` x `fsdp`, their width
    over `tensor` (tokens over `data`: test_engine_serves_moe_like_transformers); logits of a cached prefill
    and a decode step equal the unsharded model's, with LoRA'd experts too."""
    from librarian_jax.engine import make_mesh

    folder = os.path.join(GOLDEN, "qwen3_5moe_b")
    single = load_hf(folder)
    mesh = make_mesh({"fsdp": 2, "expert": 2, "tensor": 2})
    sharded = load_hf(folder, mesh=mesh)
    layer = sharded.layers[0].mlp
    assert layer.mesh is mesh
    split = ("expert", "fsdp")  # 4 experts, one per (expert, fsdp) device pair
    assert tuple(layer.experts.gate_up_proj.get_value().sharding.spec) == (split, None, None, "tensor")
    assert tuple(layer.experts.down_proj.get_value().sharding.spec)[:2] == (split, "tensor")
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (2, 8)), jnp.int32)
    outs = []
    for model in (single, sharded):
        graphdef, state = nnx.split(model)
        cache = init_cache(model.config, 2, 12)
        a, cache = cached(graphdef, state, tokens, cache, None)
        b, _ = cached(graphdef, state, tokens[:, :1], cache, None)
        outs.append((np.asarray(a), np.asarray(b)))
    # equal up to fp32 summation order (the tensor split adds each expert's width in two partial sums)
    np.testing.assert_allclose(outs[1][0], outs[0][0], atol=5e-5, rtol=0)
    np.testing.assert_allclose(outs[1][1], outs[0][1], atol=5e-5, rtol=0)
    # expert LoRA with non-zero B: same under expert parallelism
    for m in (single, sharded):
        moe_lib.add_expert_lora(m, rank=2, alpha=4.0, seed=1)
        for lay in m.layers:
            ex = lay.mlp.experts
            ex.gate_up_b.set_value(jnp.full(ex.gate_up_b.get_value().shape, 0.05, jnp.float32))
            ex.down_b.set_value(jnp.full(ex.down_b.get_value().shape, -0.05, jnp.float32))
    lora = [np.asarray(forward(*nnx.split(m), tokens, None)) for m in (single, sharded)]
    assert np.abs(lora[0] - outs[0][0]).max() > 1e-3
    np.testing.assert_allclose(lora[1], lora[0], atol=5e-5, rtol=0)


def test_engine_serves_moe_like_transformers():
    """The engine (slot cache, prefill + on-device decode loop) generates transformers' greedy tokens; on 8
    devices through an expert-parallel (data 2, expert 2, tensor 2) mesh."""
    from librarian_jax.engine import generate, make_mesh

    folder = os.path.join(GOLDEN, "qwen3_5moe_c")
    ref = np.load(os.path.join(folder, "reference.npz"))
    mesh = make_mesh({"data": 2, "expert": 2, "tensor": 2}) if jax.device_count() >= 8 else None
    model = load_hf(folder, mesh=mesh)
    prompt = ref["input_ids"][0, : int(ref["prompt"])].tolist()
    got = generate(model, [prompt, prompt[:5]], len(ref["greedy"]), mesh=mesh)
    assert got[0] == ref["greedy"].tolist()
    assert model.layers[0].mlp.mesh is mesh


def test_trainer_moe_aux_loss_and_expert_load():
    """The trainer logs the load-balancing loss and expert load of a MoE policy (through per-layer remat,
    whose checkpointed layers hand their sown statistics back), and the aux term moves the loss by its
    coefficient."""
    from librarian_jax.rl import train_step as ts

    rng = np.random.default_rng(5)
    rows, seq = 2, 8
    mask = np.ones((rows, seq), np.float32)
    batch = {"tokens": rng.integers(0, 64, (rows, seq)).astype(np.int32), "valid": mask.astype(bool),
             "loss_mask": mask, "advantages": np.array([[1.0], [-1.0]], np.float32) * mask,
             "sampler_logprobs": np.full((rows, seq), -2.0, np.float32),
             "row_weights": np.ones(rows, np.float32)}
    folder = os.path.join(GOLDEN, "qwen3_5moe_b")
    metrics = {}
    for coef in (0.0, 10.0):
        config = ts.TrainConfig(moe_aux_loss_coef=coef, remat="layer", logits_chunk=4)
        metrics[coef] = ts.Trainer(load_hf(folder), config).update(batch)
    m = metrics[0.0]
    assert m["moe_aux_loss"] >= 1.0 - 1e-5  # experts * sum f P >= 1 (k = 1), equality when balanced
    assert m["expert_load_min"] <= 1.0 <= m["expert_load_max"]
    assert np.isfinite(m["loss"]) and not m["skipped"]
    np.testing.assert_allclose(metrics[10.0]["loss"] - m["loss"], 10.0 * m["moe_aux_loss"], rtol=1e-3)
