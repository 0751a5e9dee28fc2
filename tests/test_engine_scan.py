"""Layer scan with a cache: `Transformer.hidden` on a `ScanCache` / with a `LayerStack`, and
`Engine(scan_layers=True)` (rollout.scan_layers), whose prefill and decode programs compile each distinct
layer once. Everything equals the layer-by-layer loop: logits and caches of chunked prefill and decode for
Qwen3-, Gemma-3- (sliding + global, a remainder layer) and Qwen3.5-like (Gated DeltaNet + attention) tiny
models; the engine's tokens and log-probs over two-turn sessions with sampling, prefix sharing, live
cache views and a weight update. The scanned decode program does not grow with depth."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_scan_layers import VOCAB, config, model_for

from librarian_jax import config_schema, models, testing
from librarian_jax.engine import Engine, SamplingParams, generate
from librarian_jax.models import cache as cache_lib


# (MoE layers under a scan, with what they sow, are checked without a cache in test_scan_layers.py)
@pytest.mark.parametrize("kind,layers", [("qwen3", 3), ("gemma3", 5), ("qwen3_5", 5)])
def test_cached_scan_equals_the_loop(kind, layers):
    model = testing.tiny_model(config(kind, layers))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (2, 7)), jnp.int32)
    mask = jnp.asarray(np.arange(7)[None] < np.array([[7], [5]]))  # row 1 padded
    plan = model.layer_stack().plan
    assert plan.scanned >= layers - 1

    def run(model: models.Transformer, mode: str) -> tuple:
        cache = models.init_cache(model.config, 2, 16)
        if mode == "loop":
            prefill, cache = model(tokens, cache=cache, mask=mask)
            step1, cache = model(tokens[:, :1], cache=cache)
            step2, cache = model(tokens[:, 1:3], cache=cache)
            return prefill, step1, step2, cache
        # a Cache in: stacked and unstacked around the scan; a ScanCache in: carried as it is
        prefill, cache = model(tokens, cache=cache, mask=mask, scan_layers=True)
        assert isinstance(cache, cache_lib.Cache)
        scan_cache = cache_lib.stack_cache(cache, plan.period, plan.periods)
        step1, scan_cache = model(tokens[:, :1], cache=scan_cache, layer_stack=model.layer_stack())
        assert isinstance(scan_cache, cache_lib.ScanCache)
        step2, scan_cache = model(tokens[:, 1:3], cache=scan_cache)  # no scan: one by one, in place
        return prefill, step1, step2, cache_lib.unstack_cache(scan_cache)

    graphdef, state = nnx.split(model)

    @jax.jit
    def both(state):  # one compilation for both
        m = nnx.merge(graphdef, state)
        return run(m, "loop"), run(m, "scan")

    want, got = both(state)
    assert np.std(np.asarray(want[0])) > 0
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=2e-5)


def test_stack_cache_round_trip_and_errors():
    cfg = config("qwen3_5", 5)
    cache = models.init_cache(cfg, 3, 8)
    cache = jax.tree.map(lambda x: jnp.asarray(np.random.default_rng(0).normal(size=x.shape), x.dtype), cache)
    scan = cache_lib.stack_cache(cache, 2, 2)
    assert (scan.period, scan.periods, len(scan.rest), scan.max_len) == (2, 2, 1, 8)
    assert scan.groups[1]["v"].shape[:2] == (3, 2)  # [batch, periods, ...]: the slot stays on axis 0
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(cache_lib.unstack_cache(scan)), strict=True):
        np.testing.assert_array_equal(a, b)
    # live views cut the stacked K/V on their own axes
    view = cache_lib.live_view(scan, 4)
    assert view.groups[1]["k"].shape[-1] == 4 and view.groups[1]["v"].shape[-2] == 4
    with pytest.raises(ValueError, match="does not fit 5 layers"):
        cache_lib.stack_cache(cache, 2, 3)



SHARED = [7, 3, 9, 1, 4, 4, 2, 8]  # a common prefix: sessions admitted together share its prefill


def _run(engine: Engine) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    """(tokens, log-probs, processed log-probs) of every turn of 5 two-turn sessions."""
    prompts = [SHARED + [5 + i] * (1 + 3 * i) for i in range(4)] + [[1, 2, 3]]
    sessions = [engine.new_session(p) for p in prompts]
    reqs = [engine.submit(s, 6, SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=5, stream=i))
            for i, s in enumerate(sessions)]
    engine.run_until_done()
    for s in sessions:  # second turn: the cache continues
        s.append([11, 12])
    reqs += [engine.submit(s, 5, SamplingParams(temperature=0.7, seed=6)) for s in sessions]
    engine.run_until_done()
    for s in sessions:
        s.close()
    return [(list(r.result.tokens), r.result.logprobs, r.result.processed_logprobs) for r in reqs]


def _assert_same(got: list, want: list) -> None:
    assert any(len(toks) for toks, _, _ in want)
    for (toks, lps, plps), (ref_toks, ref_lps, ref_plps) in zip(got, want, strict=True):
        assert toks == ref_toks
        np.testing.assert_allclose(lps, ref_lps, atol=1e-4)
        np.testing.assert_allclose(plps, ref_plps, atol=1e-4)


# Gated DeltaNet + attention layers, a remainder layer, a cache with live views (1024 -> 512 positions);
# the sharded engine (test_engine_mesh.py) runs a Qwen3-like model.
def test_scanned_engine_equals_the_loop(kind="qwen3_5", layers=5, max_seq_len=1024):
    kw = dict(num_slots=4, max_seq_len=max_seq_len, round_steps=4, prefill_buckets=(32,), share_prefix=4,
              processed_logprobs=True)
    loop = Engine(testing.tiny_model(config(kind, layers), scale=3.0), **kw)
    scan = Engine(testing.tiny_model(config(kind, layers), scale=3.0), scan_layers=True, **kw)
    assert not loop.scan_layers and scan.scan_layers
    assert isinstance(scan.cache, cache_lib.ScanCache) and len(scan.cache.rest) == 1
    _assert_same(_run(scan), _run(loop))
    assert sum(st.shared_prefix_tokens for st in scan.stats) > 0  # slot copies ran on the stacked cache
    # new weights: the engine re-stacks them (a stale stack would keep the old model's tokens)
    other = nnx.state(testing.tiny_model(config(kind, layers), seed=1, scale=3.0))
    loop.update_params(other)
    scan.update_params(other)
    _assert_same(_run(scan), _run(loop))


def test_scanned_lora_engine_equals_the_loop():
    # the policy engine of a LoRA run: qwix's adapters run inside the scan body, layer by layer's rules
    model = model_for("qwen3", 3, lora=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    # (model_for's adapters change the outputs: test_scan_layers.py)
    assert generate(model, prompts, 8, scan_layers=True) == generate(model, prompts, 8)


def _ops(engine: Engine) -> int:
    """StableHLO operations in the engine's lowered decode program."""
    lowered = engine._programs.decode.lower(engine._program_params, engine.cache, *engine._idle_decode_args())
    return len(re.findall(r"\bstablehlo\.\w+", lowered.as_text()))


def test_scanned_decode_program_does_not_grow_with_depth():
    kw = dict(num_slots=2, max_seq_len=32, round_steps=2)
    # the same program at any depth: one layer body, no per-layer stacking of weights or cache inside it
    models_ = [testing.tiny_model(config("qwen3", n), scale=3.0) for n in (2, 6)]
    scanned = [_ops(Engine(m, scan_layers=True, **kw)) for m in models_]
    loop = [_ops(Engine(m, **kw)) for m in models_]
    assert scanned[0] == scanned[1] < loop[1]
    assert loop[1] > loop[0]


def test_unscannable_model_runs_the_loop_and_bad_values():
    model = testing.tiny_model(config("qwen3", 1), scale=3.0)  # one layer: nothing repeats
    engine = Engine(model, num_slots=2, max_seq_len=32, scan_layers=True)
    assert not engine.scan_layers and isinstance(engine.cache, cache_lib.Cache)
    s = engine.new_session([1, 2, 3])
    r = engine.submit(s, 3)
    engine.run_until_done()
    assert len(r.result.tokens) == 3
    with pytest.raises(ValueError, match="scan_layers must be a bool"):
        Engine(model, num_slots=2, max_seq_len=32, scan_layers="yes")
    assert config_schema.RolloutSection.parse({"scan_layers": True}).scan_layers is True
    with pytest.raises(ValueError, match="config.rollout.scan_layers"):
        config_schema.RolloutSection.parse({"scan_layers": "no"}, "config.rollout")
