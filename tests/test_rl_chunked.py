"""rl: chunked log-probs (`train.logits_chunk`) and per-layer remat (`train.remat="layer"`) give the unchunked
loss and gradients, with and without LoRA, for every aggregation; chunking bounds the step's memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from librarian_jax import models, testing
from librarian_jax.rl import losses
from librarian_jax.rl import train_step as ts

VOCAB = 48


def tiny(vocab: int = VOCAB, layers: int = 2) -> models.Transformer:
    config = models.get_preset("tiny", vocab_size=vocab, num_layers=layers, hidden_size=32,
                               intermediate_size=64, num_heads=2, num_kv_heads=1,
                               layer_types=("full_attention",) * layers)
    return testing.tiny_model(config)


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
        assert c.model.preset == "tiny" or ts.remat_mode(c.train.remat) != "none", preset
    c = grpo.get_config("embedded")
    for key, bad, msg in [("logits_chunk", -4, "must be >= 0"), ("remat", "layers", "must be one of")]:
        c2 = grpo.get_config("embedded")
        c2.train[key] = bad
        with pytest.raises(cv.ConfigError, match=rf"config.train.{key}: {msg}"):
            cv.validate(c2, num_devices=1)
    c.train.remat = "layer"
    cv.validate(c, num_devices=1)


def test_loss_positions_layout_and_bucket():
    """`loss_positions`: each row's loss positions in order, padded with 0, position 0 never counted; the
    per-row capacity is a power of two >= 64, or 0 (every position) when that would not be below seq."""
    mask = np.zeros((3, 10), np.float32)
    mask[0, [0, 2, 3, 9]] = 1  # position 0 is never a loss position
    mask[2, 5:] = 1
    got = ts.loss_positions(mask, 6)
    np.testing.assert_array_equal(got, [[2, 3, 9, 0, 0, 0], [0] * 6, [5, 6, 7, 8, 9, 0]])
    with pytest.raises(ValueError, match="a row has 5 loss tokens, more than 4"):
        ts.loss_positions(mask, 4)
    assert [ts.positions_bucket(n, 1024) for n in (0, 1, 64, 65, 300, 511, 512, 513)] == [
        64, 64, 64, 128, 512, 512, 512, 0]
    assert ts.positions_bucket(10, 64) == 0


def test_positioned_token_logprobs_values_and_grads():
    """Log-probs at the given positions equal `token_logprobs`'s there, 0 elsewhere; so do the gradients of a
    masked sum with respect to the hidden states and the head."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(8, 40)), jnp.float32)
    hidden = jnp.asarray(rng.normal(size=(3, 11, 8)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 40, (3, 11)), jnp.int32)
    mask = np.zeros((3, 11), np.float32)
    mask[0, [1, 4, 5, 10]] = 1
    mask[1, 7] = 1
    positions = jnp.asarray(ts.loss_positions(mask, 5))
    m = jnp.asarray(mask)

    def full(w, h):
        lp, ent = losses.token_logprobs(h @ w, tokens, 0.5)
        return jnp.sum(lp * m) + 0.3 * jnp.sum(ent * m), (lp * m, ent * m)

    def positioned(w, h, chunk):
        lp, ent = losses.positioned_token_logprobs(lambda x: x @ w, h, tokens, positions, 0.5, chunk)
        return jnp.sum(lp * m) + 0.3 * jnp.sum(ent * m), (lp, ent)

    # compiled (eager, each op of each shape compiled on its own: ~100 small programs)
    (v0, (lp0, ent0)), g0 = jax.jit(jax.value_and_grad(full, argnums=(0, 1), has_aux=True))(w, hidden)
    grad_positioned = jax.jit(jax.value_and_grad(positioned, argnums=(0, 1), has_aux=True), static_argnums=2)
    for chunk in (2, 64):
        (v1, (lp1, ent1)), g1 = grad_positioned(w, hidden, chunk)
        np.testing.assert_allclose(float(v1), float(v0), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(lp1), np.asarray(lp0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(ent1), np.asarray(ent0), rtol=1e-5, atol=1e-6)
        for a, b in zip(g0, g1, strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("agg,kl,old", [("token_mean", 0.1, "sampler"), ("drgrpo", 0.0, "trainer")])
def test_logits_at_loss_positions_match_all_positions(agg, kl, old):
    """`train.logits_at="loss"` (the LM head at the loss positions only) gives the loss, gradients and metric
    sums of `"all"`, and compiles to fewer flops: rows of 160 tokens whose loss masks hold <= 40 tokens, a
    2,048-token vocabulary, one logits chunk (XLA's cost analysis counts a loop body once)."""
    seq, rows, vocab = 160, 4, 2048
    data = batch(rows=rows, seq=seq, vocab=vocab, seed=4)
    keep = np.arange(seq)[None] >= seq - 40
    for k in ("loss_mask", "sampler_logprobs", "advantages"):
        data[k] = data[k] * keep
    data["valid"][:] = True
    model = tiny(vocab=vocab, layers=1)
    loss = losses.LossConfig(aggregation=agg, kl_beta=kl, temperature=0.7)
    out, flops = {}, {}
    for at in ("all", "loss"):
        trainer = ts.Trainer(model, ts.TrainConfig(loss=loss, old_logprobs=old, logits_chunk=1024,
                                                   logits_at=at))
        device_batch = trainer._device_batch(data)
        assert ("positions" in device_batch) == (at == "loss")
        if at == "loss":
            assert device_batch["positions"].shape == (1, rows, 64)
        ref = jax.tree.map(lambda x: x + 0.05 * jnp.sign(x), trainer.params) if kl else None
        args = (trainer.graphdef, ts._static_config(trainer.config), trainer.params, trainer.rest, ref,
                device_batch)
        out[at] = jax.device_get(ts._accumulate_jit(*args))
        cost = ts._accumulate_jit.lower(*args).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        flops[at] = float(cost["flops"]) if cost and "flops" in cost else None
    (l0, g0, s0), (l1, g1, s1) = out["all"], out["loss"]
    assert np.isfinite(float(l0)) and float(l0) != 0.0
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5, atol=1e-7)
    for k in s0:
        np.testing.assert_allclose(float(s1[k]), float(s0[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    if flops["all"] is not None:
        assert flops["loss"] < 0.7 * flops["all"], flops


def test_min_loss_positions_gives_every_batch_one_capacity_and_the_same_values():
    """`Trainer(min_loss_positions=n)` (the SFT loop passes its data's fullest row): batches whose rows hold
    <= 40 and ~100 loss tokens both get the 128-position capacity (without it: 64 and 128, two compiled
    updates), with the loss and gradients of the trainer without the floor; a bad value is refused."""
    seq, rows, vocab = 320, 4, 256
    model = tiny(vocab=vocab, layers=1)
    config = ts.TrainConfig(loss=losses.LossConfig(aggregation="token_mean"), logits_chunk=1024,
                            logits_at="loss")
    plain, floored = ts.Trainer(model, config), ts.Trainer(model, config, min_loss_positions=100)
    for n in (40, 100):
        data = batch(rows=rows, seq=seq, vocab=vocab, seed=n)
        keep = np.arange(seq)[None] >= seq - n
        for k in ("loss_mask", "sampler_logprobs", "advantages"):
            data[k] = data[k] * keep
        data["valid"][:] = True
        assert plain._device_batch(data)["positions"].shape == (1, rows, 64 if n == 40 else 128)
        assert floored._device_batch(data)["positions"].shape == (1, rows, 128)
        (l0, g0), (l1, g1) = plain.loss_and_grads(data), floored.loss_and_grads(data)
        np.testing.assert_allclose(l1, l0, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="min_loss_positions"):
            ts.Trainer(model, config, min_loss_positions=bad)
