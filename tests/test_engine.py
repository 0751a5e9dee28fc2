"""Engine: cached greedy decode == full forward argmax for every family, sessions, sampling, scheduling.

Compile cost dominates, so every test shares a few module-level engines over tiny models.
"""

from __future__ import annotations

import dataclasses

import forward
import jax
import jax.numpy as jnp
import numpy as np
import production_codegen
import pytest
from flax import nnx

from librarian_jax import models, testing
from librarian_jax.engine import Engine, SamplingParams, generate, sample
from librarian_jax.models import cache as cache_lib

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
             dtype="float32", param_dtype="float32")

FAMILIES = {
    "qwen3": lambda: models.get_preset("tiny", num_layers=2, layer_types=("full_attention",) * 2, **SMALL),
    # window 8, prompts + generation run well past it
    "gemma3": lambda: models.get_preset(
        "gemma3_1b", num_layers=2, sliding_window=8, query_pre_attn_scalar=16.0,
        layer_types=("sliding_attention", "full_attention"), **SMALL),
    "llama3": lambda: models.get_preset("llama3_2_1b", num_layers=2, layer_types=("full_attention",) * 2,
                                        rope_original_max_position=16, **SMALL),
    "qwen3_5": lambda: models.get_preset(
        "qwen3_5_4b", num_layers=2, layer_types=("linear_attention", "full_attention"),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        **SMALL),
}


@jax.jit
def _scaled(state):
    # Random weights near init give near-uniform logits; scale them so argmax decisions are well separated.
    return jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, state)



def _full_logits(model: models.Transformer, tokens: np.ndarray) -> np.ndarray:
    """Logits `[len, vocab]` of one full (uncached) forward pass over `tokens`."""
    return np.asarray(forward.logits(model, jnp.asarray(tokens, jnp.int32)[None])[0])


def _assert_greedy_matches_forward(model, prompt, generated):
    seq = np.asarray(list(prompt) + list(generated))
    logits = _full_logits(model, seq)
    want = logits[len(prompt) - 1 : len(seq) - 1].argmax(-1)
    np.testing.assert_array_equal(np.asarray(generated), want)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_generate_equals_full_forward_argmax(family):
    model = testing.tiny_model(FAMILIES[family](), scale=4.0)
    rng = np.random.default_rng(1)
    # lengths straddle the prefill bucket (32) so one row needs two chunks; the gemma rows exceed its window 8
    prompts = [rng.integers(0, 128, size=n).tolist() for n in (1, 11, 37)]
    out = generate(model, prompts, 12)
    assert [len(o) for o in out] == [12, 12, 12]
    for p, o in zip(prompts, out, strict=True):
        _assert_greedy_matches_forward(model, p, o)


# ------------------------------------------------------------------------------------ shared engine


@pytest.fixture(scope="module")
def qwen():
    return testing.tiny_model(FAMILIES["qwen3"](), scale=4.0)


@pytest.fixture(scope="module")
def engine(qwen):
    # 3 slots, short rounds: exercises admission, waiting and eviction.
    return Engine(qwen, num_slots=3, max_seq_len=96, round_steps=8, prefill_buckets=(8, 32))


def _drain(engine: Engine) -> None:
    engine.run_until_done()
    for s in list(engine._owner):
        if s is not None:
            s.close()


def test_session_five_turns_equals_one_prefill_of_history(engine, qwen):
    rng = np.random.default_rng(2)
    s = engine.new_session(rng.integers(0, 128, size=9).tolist())
    expected = s.tokens
    mask = [0.0] * len(expected)
    temperature = 0.8
    for turn in range(5):
        req = engine.submit(s, 6, SamplingParams(temperature=temperature, seed=7, stream=turn), stop_ids=())
        engine.run_until_done()
        res = req.result
        assert res is not None and res.status == "length" and len(res.tokens) == 6
        expected += res.tokens
        mask += [1.0] * 6
        obs = rng.integers(0, 128, size=2 + 3 * turn).tolist()  # observations of varied length
        s.append(obs)
        expected += obs
        mask += [0.0] * len(obs)
    rec = s.record()
    np.testing.assert_array_equal(rec.tokens, expected)
    np.testing.assert_array_equal(rec.loss_mask, mask)
    # The sampler's log-probs == the trainer's recomputation from one forward pass over the whole history.
    logp = jax.nn.log_softmax(jnp.asarray(_full_logits(qwen, rec.tokens)) / temperature, axis=-1)
    idx = np.nonzero(rec.loss_mask)[0]
    want = np.asarray(logp)[idx - 1, rec.tokens[idx]]
    np.testing.assert_allclose(rec.logprobs[idx], want, atol=2e-4)
    assert np.all(rec.logprobs[rec.loss_mask == 0] == 0)
    # And the continued cache decodes exactly what a fresh prefill of the whole history decodes.
    req = engine.submit(s, 5)
    fresh = engine.new_session(rec.tokens)
    req2 = engine.submit(fresh, 5)
    engine.run_until_done()
    assert req.result.status == req2.result.status == "length"
    assert req.result.tokens == req2.result.tokens
    _assert_greedy_matches_forward(qwen, rec.tokens, req.result.tokens)
    s.close()
    fresh.close()


def test_stop_tokens_and_budgets(engine, qwen):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    s = engine.new_session(prompt)
    req = engine.submit(s, 10)
    engine.run_until_done()
    free_run = req.result.tokens
    assert req.result.status == "length" and len(free_run) == 10
    # Stop at the first occurrence of the 4th token; the stop token is included.
    stop = free_run[3]
    cut = free_run.index(stop) + 1
    s2 = engine.new_session(prompt)
    req = engine.submit(s2, 10, stop_ids=[stop, 127 if stop != 127 else 126])
    engine.run_until_done()
    assert req.result.status == "stop"
    assert req.result.tokens == free_run[:cut]
    assert s2.record().tokens.tolist() == prompt + free_run[:cut]
    # generate() returns the stop token too.
    assert generate(qwen, [prompt], 10, stop_ids=[stop])[0] == free_run[:cut]
    # A zero budget finishes at once with no tokens.
    req = engine.submit(s2, 0)
    assert [r.status for r in engine.step()] == ["length"] and req.result.tokens == []
    s.close()
    s2.close()


def test_cache_full_ends_turn_not_crash(engine, qwen):
    s = engine.new_session(list(range(1, 81)))  # 80 of max_seq_len 96 tokens
    req = engine.submit(s, 50)
    engine.run_until_done()
    assert req.result.status == "cache_full"
    assert len(req.result.tokens) == 16 and len(s) == 96
    _assert_greedy_matches_forward(qwen, list(range(1, 81)), req.result.tokens)
    req = engine.submit(s, 5)  # no room for even one token: immediate cache_full, no tokens
    res = engine.step()
    assert [r.status for r in res] == ["cache_full"] and req.result.tokens == []
    s.close()
    # Appending past the limit also ends the next turn with cache_full, never an exception.
    s = engine.new_session([1, 2, 3])
    s.append(list(range(100)))
    req = engine.submit(s, 5)
    engine.run_until_done()
    assert req.result.status == "cache_full"
    s.close()


def test_more_sessions_than_slots_and_lru_eviction(engine, qwen):
    rng = np.random.default_rng(3)
    sessions = [engine.new_session(rng.integers(0, 128, size=5 + 9 * i).tolist()) for i in range(5)]
    reqs = [engine.submit(s, 4 + 3 * i) for i, s in enumerate(sessions)]
    first = engine.step()
    assert sum(st is not None for st in engine._owner) == 3
    assert engine.stats[-1].active_slots == 3
    assert sum(s.status == "waiting" for s in sessions) == 2
    results = first + engine.run_until_done()
    assert sorted(id(r.session) for r in results) == sorted(id(s) for s in sessions)
    assert all(r.done and r.result.status == "length" for r in reqs)
    evictions = sum(st.evictions for st in engine.stats)
    assert evictions >= 2
    # Second turn for everyone, in reverse order: the least recently used idle sessions are evicted and
    # re-prefilled from their exact records; greedy tokens still equal the full forward argmax.
    for s in sessions:
        s.append([7, 8, 9])
    # LRU: a newcomer takes the slot of the resident idle session used least recently.
    resident = [s for s in engine._owner if s is not None]
    resident[0].append([1])  # now the most recently used
    lru = min(resident[1:], key=lambda s: engine._lanes[s.id].last_used)
    newcomer = engine.new_session([1, 2])
    engine.submit(newcomer, 1)
    engine.run_until_done()
    assert engine.slot_of(lru) is None and engine.slot_of(newcomer) is not None
    assert engine.slot_of(resident[0]) is not None
    newcomer.close()
    before = [s.record().tokens.copy() for s in sessions]
    reqs = [engine.submit(s, 5) for s in reversed(sessions)]
    engine.run_until_done()
    assert sum(st.evictions for st in engine.stats) > evictions
    for s, rec in zip(sessions, before, strict=True):
        toks = s.record().tokens
        np.testing.assert_array_equal(toks[: len(rec)], rec)  # the record is never re-encoded
        _assert_greedy_matches_forward(qwen, rec.tolist(), toks[len(rec) :].tolist())
    for s in sessions:
        s.close()
    assert all(o is None for o in engine._owner)


def test_sampling_reproducible_topk1_is_greedy_and_independent_of_batch(engine, qwen):
    prompts = [[5, 6, 7], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], [1]]
    greedy = generate(qwen, prompts, 10)
    assert generate(qwen, prompts, 10, temperature=1.0, top_k=1, seed=5) == greedy
    a = generate(qwen, prompts, 10, temperature=1.0, seed=5)
    assert a == generate(qwen, prompts, 10, temperature=1.0, seed=5)
    assert a != generate(qwen, prompts, 10, temperature=1.0, seed=6)
    # A session's samples depend on (seed, stream, position), not on its slot, batch or round split.
    sp = SamplingParams(temperature=1.0, seed=5, stream=1)
    s = engine.new_session(prompts[1])
    req = engine.submit(s, 10, sp)
    engine.run_until_done()  # alone in the engine, rounds of 8 steps
    assert req.result.tokens == a[1]
    s.close()


def test_update_params_swaps_weights(qwen):
    other = testing.tiny_model(FAMILIES["qwen3"](), seed=1, scale=4.0)
    eng = Engine(qwen, num_slots=3, max_seq_len=96, round_steps=8, prefill_buckets=(8, 32))
    prompt = [4, 5, 6, 7]

    def run():
        s = eng.new_session(prompt)
        req = eng.submit(s, 8)
        eng.run_until_done()
        s.close()
        return req.result.tokens

    mine = run()
    eng.update_params(nnx.state(other))
    theirs = run()
    assert theirs == generate(other, [prompt], 8)[0] and mine == generate(qwen, [prompt], 8)[0]
    assert mine != theirs
    with pytest.raises(ValueError, match="state tree"):
        eng.update_params(nnx.state(testing.tiny_model(FAMILIES["llama3"](), scale=4.0)))


# ------------------------------------------------------------------------------------ sampling alone


def test_sample_logprobs_topk_topp():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 50)).astype(np.float32) * 3)
    n = logits.shape[0]
    temperature = jnp.asarray([0.0, 1.0, 0.7, 1.3, 1.0, 1.0], jnp.float32)
    top_k = jnp.asarray([0, 0, 5, 0, 1, 3], jnp.int32)
    top_p = jnp.asarray([1.0, 1.0, 1.0, 0.5, 1.0, 0.9], jnp.float32)
    zeros = jnp.zeros((n,), jnp.int32)
    draws = []
    jsample = jax.jit(sample)
    for pos in range(200):
        tok, lp, plp = jsample(logits, temperature=temperature, top_p=top_p, top_k=top_k, seeds=zeros,
                              streams=jnp.arange(n, dtype=jnp.int32), positions=zeros + pos)
        draws.append(np.asarray(tok))
        t = np.where(np.asarray(temperature) > 0, np.asarray(temperature), 1.0)
        full = np.asarray(jax.nn.log_softmax(logits / t[:, None], axis=-1))
        np.testing.assert_allclose(np.asarray(lp), full[np.arange(n), np.asarray(tok)], rtol=1e-5, atol=1e-5)
        # processed log-prob of row 2 (temperature 0.7, top-5): renormalised over its top 5
        top5 = np.sort(np.asarray(logits[2]) / 0.7)[-5:]
        want = np.asarray(logits[2])[tok[2]] / 0.7 - np.log(np.exp(top5).sum())
        np.testing.assert_allclose(float(plp[2]), want, rtol=1e-4, atol=1e-4)
    draws = np.stack(draws)  # [200, rows]
    order = np.argsort(-np.asarray(logits), axis=-1)
    assert np.all(draws[:, 0] == order[0, 0]) and np.all(draws[:, 4] == order[4, 0])  # greedy, top-k 1
    assert set(draws[:, 2]) <= set(order[2, :5]) and len(set(draws[:, 2])) > 1
    assert set(draws[:, 5]) <= set(order[5, :3])
    # top-p 0.5 at T=1.3: only the smallest prefix of the sorted distribution reaching mass 0.5
    p = np.asarray(jax.nn.softmax(logits[3] / 1.3))[order[3]]
    nucleus = order[3, : int(np.searchsorted(np.cumsum(p), 0.5) + 1)]
    assert set(draws[:, 3]) <= set(nucleus)
    assert len(set(draws[:, 1])) > 5  # plain T=1 sampling spreads out


def test_sample_fast_paths_equal_general_path(request):
    # ``sample`` switches per batch to an argmax-only path (all greedy) or a no-sort path (temperature only);
    # both must return exactly what the general path returns for the same seeds, under the compiler users
    # get (the suite's older fusion code generator rounds the two paths' log-probs differently by an ulp)
    if production_codegen.rerun(request):
        return
    from librarian_jax.engine.sampling import _sample_general

    rng = np.random.default_rng(1)
    n, vocab = 8, 64
    fast, general = jax.jit(sample), jax.jit(_sample_general)
    greedy_row = rng.random(n) < 0.4
    cases = {
        "greedy": (np.zeros(n), np.zeros(n), np.ones(n)),
        "greedy_via_top_k_1": (rng.uniform(0.5, 2, n), np.ones(n), rng.uniform(0.2, 1, n)),
        "temperature": (rng.uniform(0.3, 2, n), np.zeros(n), np.ones(n)),
        "temperature_and_greedy": (
            np.where(greedy_row, 0.0, rng.uniform(0.3, 2, n)),
            np.zeros(n),
            np.ones(n),
        ),
        "top_k": (rng.uniform(0.3, 2, n), rng.integers(2, 10, n), np.ones(n)),
        "top_p": (rng.uniform(0.3, 2, n), np.zeros(n), rng.uniform(0.2, 0.95, n)),
        "mixed": (
            np.where(greedy_row, 0.0, rng.uniform(0.3, 2, n)),
            np.asarray([0, 1, 5, 0, 3, 0, 0, 2]),
            np.asarray([1.0, 1.0, 1.0, 0.5, 0.8, 1.0, 0.3, 1.0]),
        ),
    }
    for name, (t, k, p) in cases.items():
        logits = jnp.asarray(rng.normal(size=(n, vocab)) * rng.uniform(0.5, 6), jnp.float32)
        kw = dict(
            temperature=jnp.asarray(t, jnp.float32),
            top_k=jnp.asarray(k, jnp.int32),
            top_p=jnp.asarray(p, jnp.float32),
            seeds=jnp.asarray(rng.integers(0, 1000, n), jnp.int32),
            streams=jnp.arange(n, dtype=jnp.int32),
            positions=jnp.asarray(rng.integers(0, 300, n), jnp.int32),
        )
        got = [np.asarray(x) for x in fast(logits, **kw)]
        want = [np.asarray(x) for x in general(logits, **kw)]
        for g, w, what in zip(got, want, ("tokens", "logprobs", "processed_logprobs"), strict=True):
            np.testing.assert_array_equal(g, w, err_msg=f"{name}: {what}")
        tok, lp, plp = got
        is_greedy = (t <= 0) | (k == 1)
        scale = np.where(t > 0, t, 1.0)[:, None]
        full = np.asarray(jax.nn.log_softmax(logits / scale, axis=-1))
        np.testing.assert_allclose(lp, full[np.arange(n), tok], rtol=1e-6, atol=1e-6, err_msg=name)
        argmax = np.argmax(np.asarray(logits), -1)
        np.testing.assert_array_equal(tok[is_greedy], argmax[is_greedy], err_msg=name)
        assert np.all(plp[is_greedy] == 0.0), name
        if name.startswith("temperature"):
            np.testing.assert_array_equal(plp[~is_greedy], lp[~is_greedy], err_msg=name)
            assert len(set(tok[~is_greedy]) - set(argmax)) > 0, f"{name}: draws look greedy"


def test_sample_argmax_and_draw_match_jax():
    # The sampler's own argmax (max + min over an iota) and categorical draw must equal jnp.argmax /
    # jax.random.categorical exactly: ties -> first index, NaN -> first NaN, all -inf -> 0.
    from librarian_jax.engine.sampling import _argmax, _draw

    rng = np.random.default_rng(2)
    x = rng.integers(-3, 3, size=(12, 40)).astype(np.float32)  # many ties
    x[3, [5, 9]] = np.nan
    x[4] = -np.inf
    x[5, [0, 7]] = [np.inf, np.inf]
    x[6] = 0.0
    x[6, [2, 4]] = -0.0
    x = jnp.asarray(x)
    np.testing.assert_array_equal(np.asarray(jax.jit(_argmax)(x)), np.asarray(jnp.argmax(x, axis=-1)))
    assert int(_argmax(x)[3]) == 5 and int(_argmax(x)[4]) == 0

    n = 6
    logits = jnp.asarray(rng.normal(size=(n, 50)) * 2, jnp.float32)
    seeds = jnp.asarray(rng.integers(0, 1000, n), jnp.int32)
    streams = jnp.arange(n, dtype=jnp.int32)
    for pos in range(5):
        positions = jnp.full((n,), pos, jnp.int32)
        keys = [
            jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s), st), pos)
            for s, st in zip(seeds.tolist(), streams.tolist(), strict=True)
        ]
        want = [int(jax.random.categorical(k, r)) for k, r in zip(keys, logits, strict=True)]
        np.testing.assert_array_equal(np.asarray(_draw(logits, seeds, streams, positions)), want)


# ------------------------------------------------------------------------------------ one token record


def test_turn_results_and_training_rows_are_the_session_record(engine, qwen):
    # A session's record is the only copy of its tokens: each TurnResult is exactly the slice of it tagged
    # with its turn (across evictions and re-prefills), and the training row built from it (Segment -> rl
    # rows) holds exactly its tokens, log-probs and loss mask, with each turn's advantage on its own tokens.
    from librarian_jax.rl import rows as rows_lib
    from librarian_jax.rollout.records import EpisodeRecord
    from librarian_jax.segment import Segment

    rng = np.random.default_rng(5)
    s = engine.new_session(rng.integers(0, 128, size=7).tolist())
    others = [engine.new_session(rng.integers(0, 128, size=4).tolist()) for _ in range(3)]
    evictions = sum(st.evictions for st in engine.stats)
    results = []
    for turn in range(3):
        req = s.submit(4 + turn, SamplingParams(temperature=1.0, seed=3, stream=turn), tag=turn)
        for o in others:  # more sessions than slots: `s` is evicted and re-prefilled between its turns
            engine.submit(o, 2)
        engine.run_until_done()
        assert req.result.processed_logprobs is None  # not asked for
        results.append(req.result)
        s.append(rng.integers(0, 128, size=3).tolist())
    assert sum(st.evictions for st in engine.stats) > evictions
    rec = s.record()
    for t, res in enumerate(results):
        idx = np.nonzero(rec.turn_index == t)[0]
        assert res.status == "length" and len(res.tokens) == 4 + t
        assert rec.tokens[idx].tolist() == res.tokens
        np.testing.assert_array_equal(rec.logprobs[idx], res.logprobs)
    np.testing.assert_array_equal(rec.loss_mask, rec.turn_index >= 0)
    # the log-probs are the model's at exactly these ids (one forward pass over the whole record)
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(_full_logits(qwen, rec.tokens)), axis=-1))
    idx = np.nonzero(rec.loss_mask)[0]
    np.testing.assert_allclose(rec.logprobs[idx], logp[idx - 1, rec.tokens[idx]], atol=2e-4)

    seg = rec.for_training()  # the session's record is the training segment, as it stands
    assert isinstance(seg, Segment)
    ep = EpisodeRecord("t", 0, 0, [seg], turn_rewards=[0.0, 1.0, 0.0], terminal_reward=0.0, total_reward=1.0,
                       num_turns=3, tool_calls=[[]] * 3, tool_errors=[[]] * 3, replies=[""] * 3)
    other = dataclasses.replace(ep, episode_index=1, turn_rewards=[0.0] * 3, total_reward=0.0)
    cfg = rows_lib.RowsConfig(advantage="grpo", step_weight=1.0, seq_buckets=(64,), max_row_len=96)
    batch, _ = rows_lib.build_rows([ep, other], cfg)
    n = len(rec.tokens)
    np.testing.assert_array_equal(batch.tokens[0, :n], rec.tokens)
    np.testing.assert_array_equal(batch.loss_mask[0, :n], rec.loss_mask)
    np.testing.assert_array_equal(batch.sampler_logprobs[0, :n], rec.logprobs)
    assert not batch.valid[0, n:].any() and batch.valid[0, :n].all()
    # per-step credit: turns 0 and 1 (reward-to-go 1) get more than turn 2 (0), each on its own tokens only
    adv = batch.advantages[0, :n]
    ti = rec.turn_index
    assert len(set(adv[ti == 0])) == len(set(adv[ti == 1])) == 1
    assert adv[ti == 1][0] > adv[ti == 2][0] > 0 and np.all(adv[ti < 0] == 0)
    s.close()
    for o in others:
        o.close()
    assert s.status == "closed" and engine.slot_of(s) is None
    with pytest.raises(RuntimeError, match="closed"):
        s.append([1])


def test_processed_logprobs_only_when_asked(qwen):
    # the module engine's layout: only the decode round compiles again (prefill programs are shared)
    eng = Engine(qwen, num_slots=3, max_seq_len=96, round_steps=8, prefill_buckets=(8, 32),
                 processed_logprobs=True)
    prompt = [4, 5, 6, 7]
    s = eng.new_session(prompt)
    req = s.submit(6, SamplingParams(temperature=1.0, top_k=5, seed=1))
    eng.run_until_done()
    res = req.result
    assert res.processed_logprobs is not None and res.processed_logprobs.shape == (6,)
    # processed = the log-prob renormalised over the 5 most likely ids the draw was restricted to
    logits = _full_logits(qwen, prompt + res.tokens)[len(prompt) - 1 : -1]
    top5 = np.sort(logits, axis=-1)[:, -5:]
    want = logits[np.arange(6), res.tokens] - np.log(np.exp(top5).sum(-1))
    np.testing.assert_allclose(res.processed_logprobs, want, atol=2e-4)
    full = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))[np.arange(6), res.tokens]
    np.testing.assert_allclose(res.logprobs, full, atol=2e-4)


def test_prefix_shared_equals_unshared(engine, qwen):
    # Sessions admitted together with a common prompt prefix (a probe's answerer runs) prefill it once and
    # copy it into each other's slots; tokens and log-probs equal an engine that prefills every session alone.
    rng = np.random.default_rng(9)
    common = rng.integers(0, 128, size=40).tolist()
    prompts = [common + rng.integers(0, 128, size=n).tolist() for n in (3, 11)]
    prompts.append(list(prompts[0]))  # an identical prompt (R repeats of one question)
    plain = Engine(qwen, num_slots=3, max_seq_len=96, round_steps=8, prefill_buckets=(8, 32), share_prefix=0)

    def run(eng):
        sessions = [eng.new_session(p) for p in prompts]
        reqs = [s.submit(10, SamplingParams(temperature=1.0, seed=4, stream=i))
                for i, s in enumerate(sessions)]
        eng.step()  # all three are admitted and prefilled in this step
        st = eng.stats[-1]
        eng.run_until_done()
        for s in sessions:
            s.close()
        return [(r.result.tokens, r.result.logprobs) for r in reqs], st

    shared, st_shared = run(engine)
    unshared, st_plain = run(plain)
    assert st_shared.shared_prefix_tokens == 2 * 40 and st_plain.shared_prefix_tokens == 0
    assert st_shared.prefill_tokens == st_plain.prefill_tokens - 2 * 40
    for (tok_a, lp_a), (tok_b, lp_b), p in zip(shared, unshared, prompts, strict=True):
        assert tok_a == tok_b and len(tok_a) == 10
        np.testing.assert_allclose(lp_a, lp_b, atol=1e-5)
        logp = np.asarray(jax.nn.log_softmax(jnp.asarray(_full_logits(qwen, p + tok_a)), axis=-1))
        np.testing.assert_allclose(lp_a, logp[np.arange(len(p) - 1, len(p) + 9), tok_a], atol=2e-4)


def test_generate_prefill_chunk_fits_the_prompt():
    """generate() prefills short prompts in one power-of-two chunk that just holds them (16-token prompts: 15
    cached tokens in a 16-token chunk, not the engine's default 32), and long ones in the default chunks."""
    from librarian_jax.engine.engine import DEFAULT_PREFILL_BUCKETS, _generate_buckets

    assert _generate_buckets(0) == (8,) and _generate_buckets(8) == (8,)
    assert _generate_buckets(15) == (16,) and _generate_buckets(16) == (16,)
    assert _generate_buckets(17) == (32,)
    assert _generate_buckets(512) == (512,)
    assert _generate_buckets(513) == DEFAULT_PREFILL_BUCKETS


def test_compile_ahead_leaves_the_engine_nothing_to_compile(qwen):
    """`Engine.compile_ahead` (what a run does at start, `rollout.compile_ahead`) compiles every program the
    engine can run from abstract arguments: afterwards sessions of every length, slot count and prefix
    sharing compile nothing (red if `programs_ahead` leaves out a prefill slot bucket, an attended length,
    the decode round or the copy program)."""
    from librarian_jax.compile_cache import CompileClock

    # max_seq_len 1024: attended lengths all / 512; 4 slots: prefill rows 1, 2 and all; prefix sharing on
    engine = Engine(qwen, num_slots=4, max_seq_len=1024, round_steps=8, prefill_buckets=(8, 32),
                    share_prefix=8)
    jobs = engine.programs_ahead()
    names = [n for n, _ in jobs]
    assert len(names) == len(set(names)) == 2 * (2 * 3 + 1) + 3, names  # (chunks x rows + decode) x lens
    report = engine.compile_ahead(threads=2)
    assert report.programs == len(jobs) and not report.failed
    clock = CompileClock.get()
    before = clock.totals()
    rng = np.random.default_rng(0)
    prefix = rng.integers(1, 100, 20).tolist()
    # shared prefixes (copy), one and several rows, short and past-512 contexts, turns that continue
    sessions = [engine.new_session(prefix + rng.integers(1, 100, n).tolist()) for n in (3, 5, 40)]
    for s in sessions:
        engine.submit(s, 12)
    engine.run_until_done()
    long = engine.new_session(rng.integers(1, 100, 600).tolist())
    engine.submit(long, 20)
    engine.run_until_done()
    engine.append(sessions[0], [5, 6, 7])
    engine.submit(sessions[0], 4)
    engine.run_until_done()
    assert clock.since(before).programs == 0, clock.since(before)
    for s in [*sessions, long]:
        s.close()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_keys_cache_layout_samples_what_the_heads_layout_does(family):
    """The "keys" K/V layout (the TPU's, `[slot, position, kv_heads, head_dim]`) and the CPU's "heads" one
    give the same sampled tokens and log-probs over two turns of sessions of several lengths, looped and
    scanned; and the layout an engine keeps is the one asked for."""
    model = testing.tiny_model(FAMILIES[family](), scale=4.0)
    runs = {}
    for layout in ("heads", "keys"):
        for scan in (False, True):
            eng = Engine(model, 4, 64, cache_layout=layout, scan_layers=scan, round_steps=8,
                         prefill_buckets=(16,))
            sessions = [eng.new_session(list(range(1 + i, 6 + 7 * i))) for i in range(4)]  # 5..26 tokens
            reqs = [eng.submit(s, 10, SamplingParams(temperature=0.8, seed=1, stream=i))
                    for i, s in enumerate(sessions)]
            eng.run_until_done()
            for s in sessions[:2]:
                s.append([3, 4, 5])
            reqs += [eng.submit(s, 6) for s in sessions[:2]]
            eng.run_until_done()
            if not scan:
                assert {cache_lib.layout_of(x) for x in eng.cache.layers} - {None} == {layout}
            assert eng.cache_layout == layout
            runs[(layout, scan)] = ([list(r.result.tokens) for r in reqs],
                                    [np.asarray(r.result.logprobs) for r in reqs])
    want_tokens, want_lp = runs[("heads", False)]
    for key, (tokens, lps) in runs.items():
        assert tokens == want_tokens, key
        for a, b in zip(lps, want_lp, strict=True):
            np.testing.assert_allclose(a, b, atol=2e-5, err_msg=str(key))


def test_an_engine_keeps_the_heads_layout_on_cpu_and_refuses_an_unknown_one():
    model = testing.tiny_model(FAMILIES["qwen3"]())
    assert Engine(model, 2, 32).cache_layout == "heads"  # "auto" on CPU devices
    with pytest.raises(ValueError, match="cache_layout"):
        Engine(model, 2, 32, cache_layout="rows")
