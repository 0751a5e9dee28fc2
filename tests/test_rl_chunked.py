"""rl: chunked log-probs (`train.logits_chunk`) and per-layer remat (`train.remat="layer"`) give the unchunked
loss and gradients, with and without LoRA, for every aggregation; chunking bounds the step's memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from librarian_jax import models
from librarian_jax.rl import losses
from librarian_jax.rl import train_step as ts

VOCAB = 48


def tiny(vocab: int = VOCAB, layers: int = 2) -> models.Transformer:
    config = models.get_preset("tiny", vocab_size=vocab, num_layers=layers, hidden_size=32,
                               intermediate_size=64, num_heads=2, num_kv_heads=1,
                               layer_types=("full_attention",) * layers)
    return models.Transformer(config, rngs=nnx.Rngs(0))


def batch(rows: int = 4, seq: int = 13, vocab: int = VOCAB, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    valid = np.arange(seq)[None] < rng.integers(seq // 2, seq + 1, rows)[:, None]
    valid[0] = True  # one full row: the last chunk holds real positions
    mask = (valid & (np.arange(seq)[None] >= 3)).astype(np.float32)
    return {"tokens": (rng.integers(0, vocab, (rows, seq)) * valid).astype(np.int32), "valid": valid,
            "loss_mask": mask,
            "sampler_logprobs": (rng.normal(-np.log(vocab), 0.3, (rows, seq)) * mask).astype(np.float32),
            "advantages": (rng.normal(size=(rows, 1)) * mask).astype(np.float32),
            "row_weights": np.resize(np.array([0.5, 0.5, 1.0, 1.0], np.float32), rows)}


# (aggregation, chunk, remat, old_logprobs, kl): each chunked variant against the same config unchunked.
# Chunks of 4 and 5 over 13 positions: 4 chunks of 4 (3 padded positions) and 3 chunks of 5 (2 padded).
VARIANTS = [("token_mean", 4, "none", "sampler", 0.1), ("sequence_mean", 5, "layer", "sampler", 0.0),
            ("drgrpo", 4, "full", "trainer", 0.0)]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_chunked_logprobs_and_layer_remat_match_unchunked(lora):
    model = tiny(layers=1)
    rng = np.random.default_rng(1)
    if lora:
        model = ts.apply_lora(model, rank=4, alpha=8.0, module_path=".*(q_proj|v_proj|up_proj).*")
        for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):  # B != 0: adapters change outputs
            v.set_value(jnp.asarray(rng.normal(size=v.get_value().shape) * 0.2, jnp.float32))
    data = batch()
    base = ts.Trainer(model, ts.TrainConfig(logits_chunk=0))
    device_batch = base._device_batch(data)

    def config(agg: str, chunk: int, remat: str, old: str, kl: float) -> ts.TrainConfig:
        loss = losses.LossConfig(aggregation=agg, kl_beta=kl, temperature=0.7, norm_length=16)
        return ts.TrainConfig(loss=loss, old_logprobs=old, remat=remat, logits_chunk=chunk)

    @jax.jit
    def all_variants(params, rest, device_batch):  # one compilation for every variant
        ref = jax.tree.map(lambda x: x + 0.05 * jnp.sign(x), params)  # a reference policy that differs
        out = []
        for agg, chunk, remat, old, kl in VARIANTS:
            r = ref if kl else None
            plain = ts._accumulate(base.graphdef, config(agg, 0, "none", old, kl), params, rest, r,
                                   device_batch)
            chunked = ts._accumulate(base.graphdef, config(agg, chunk, remat, old, kl), params, rest, r,
                                     device_batch)
            out.append((plain, chunked))
        return out

    results = jax.device_get(all_variants(base.params, base.rest, device_batch))
    for (agg, *_), (plain, chunked) in zip(VARIANTS, results, strict=True):
        (l0, g0, s0), (l1, g1, s1) = plain, chunked
        assert np.isfinite(float(l0)) and float(l0) != 0.0, agg
        np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5, atol=1e-7, err_msg=agg)
        for k in s0:  # metric sums, entropy included
            np.testing.assert_allclose(float(s1[k]), float(s0[k]), rtol=1e-5, atol=1e-6, err_msg=f"{agg} {k}")
        assert float(s0["entropy"]) > 0 and float(s0["kl"] if agg == "token_mean" else 1.0) > 0
        leaves0, leaves1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
        assert sum(float(np.sum(np.square(x))) for x in leaves0) > 0, agg
        for a, b in zip(leaves0, leaves1, strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6, err_msg=agg)


def test_chunked_token_logprobs_values():
    """The chunk function alone against `token_logprobs` (uneven chunks, temperature), and its errors."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(8, 40)), jnp.float32)
    hidden = jnp.asarray(rng.normal(size=(3, 11, 8)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 40, (3, 11)), jnp.int32)
    project = lambda h: h @ w
    want = losses.token_logprobs(project(hidden), tokens, 0.5)
    for chunk in (3, 4, 64):
        got = losses.chunked_token_logprobs(project, hidden, tokens, 0.5, chunk)
        for g, x in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="chunk must be > 0"):
        losses.chunked_token_logprobs(project, hidden, tokens, 1.0, 0)
    with pytest.raises(ValueError, match=r"tokens \(3, 10\) do not match hidden \(3, 11, 8\)"):
        losses.chunked_token_logprobs(project, hidden, tokens[:, :10], 1.0, 4)


def test_chunking_bounds_compiled_memory():
    """The compiled step's temporaries: unchunked they hold several `[rows, seq, vocab]` float32 arrays
    (logits, log-softmax, their gradients); chunked and rematerialised, all of them together take less than
    ONE such array (without the per-chunk checkpoint the scan would stack every chunk's logits for the
    backward pass: about twice that)."""
    vocab, rows, seq = 4096, 2, 256
    model = tiny(vocab=vocab, layers=1)
    data = batch(rows=rows, seq=seq, vocab=vocab)
    temp = {}
    for chunk in (0, 16):
        stats = ts.Trainer(model, ts.TrainConfig(logits_chunk=chunk)).memory_analysis(data)
        if stats is None:
            pytest.skip("this backend gives no memory_analysis")
        temp[chunk] = stats["temp_bytes"]
    logits_bytes = rows * seq * vocab * 4
    assert temp[0] >= 2 * logits_bytes, temp
    assert temp[16] < logits_bytes, (temp, logits_bytes)


def test_train_config_validation_names_the_key():
    model = tiny(layers=1)
    assert (ts.remat_mode(True), ts.remat_mode(False), ts.remat_mode("layer")) == ("full", "none", "layer")
    with pytest.raises(ValueError, match="train.remat: 'some' is not one of"):
        ts.Trainer(model, ts.TrainConfig(remat="some"))
    with pytest.raises(ValueError, match="train.logits_chunk: must be an integer >= 0"):
        ts.Trainer(model, ts.TrainConfig(logits_chunk=-1))
    assert ts.Trainer(model, ts.TrainConfig(remat=True)).config.remat == "full"
    # a qwix model whose adapters live only in __call__ would run hidden() without them: refused
    import qwix

    provider = qwix.LoraProvider(module_path=".*q_proj.*", rank=2, alpha=4.0)
    call_only = qwix.apply_lora_to_model(model, provider, jnp.zeros((1, 4), jnp.int32), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="only in __call__"):
        ts.Trainer(call_only, ts.TrainConfig(logits_chunk=8))
    ts.Trainer(call_only, ts.TrainConfig(logits_chunk=0))  # the plain path is fine


def test_grpo_config_validation_of_train_keys():
    from configs import grpo
    from librarian_jax import config_validation as cv

    for preset in grpo.PRESETS:
        c = grpo.get_config(preset)
        # no preset holds [rows, seq, vocab] logits; a real model's run also rematerialises its activations
        assert c.train.logits_chunk > 0, preset
        assert preset == "embedded" or ts.remat_mode(c.train.remat) != "none", preset
    c = grpo.get_config()
    for key, bad, msg in [("logits_chunk", -4, "must be >= 0"), ("remat", "layers", "must be one of")]:
        c2 = grpo.get_config()
        c2.train[key] = bad
        with pytest.raises(cv.ConfigError, match=rf"config.train.{key}: {msg}"):
            cv.validate(c2, num_devices=1)
    c.train.remat = "layer"
    cv.validate(c, num_devices=1)
