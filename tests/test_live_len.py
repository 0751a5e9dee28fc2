"""Attention reads only the live part of the cache (issue 15): prefill and decode programs that attend to
`models.cache.live_len` positions give the same tokens and log-probs as reading the whole cache, unsharded
and sharded.

`MIN_LIVE_LEN` is lowered so a 64-position cache has live lengths 16 and 32 (the default keeps
programs at >= 512 positions).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from librarian_jax import models, testing
from librarian_jax.engine import Engine, make_mesh
from librarian_jax.engine import engine as engine_mod
from librarian_jax.models import cache as cache_lib

CONFIG = models.get_preset(
    "tiny", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=8, num_kv_heads=4,
    head_dim=8, layer_types=("full_attention",), dtype="float32", param_dtype="float32",
)
KW = dict(num_slots=8, max_seq_len=64, round_steps=8, prefill_buckets=(16,))
PROMPTS = [list(range(1 + i, 4 + 5 * i)) for i in range(8)]  # 3..38 tokens



def _run(engine: Engine) -> list[tuple[list[int], np.ndarray]]:
    sessions = [engine.new_session(p) for p in PROMPTS]
    for s in sessions:  # prefill of all slots at once
        engine.submit(s, 6)
    engine.run_until_done()
    for s in sessions[:2]:  # prefill gathering two slots, then a decode round past two live lengths
        s.append([5, 6, 7])
        engine.submit(s, 12)
    engine.run_until_done()
    out = [(s.record().tokens.tolist(), s.record().logprobs) for s in sessions]
    for s in sessions:
        s.close()
    return out


@pytest.fixture(scope="module")
def whole_cache():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cache_lib, "MIN_LIVE_LEN", 10**9)
        return _run(Engine(testing.tiny_model(CONFIG, scale=4.0), **KW))


@pytest.fixture
def live(monkeypatch):
    """Lowers MIN_LIVE_LEN and records every attended length the engine asks for."""
    monkeypatch.setattr(cache_lib, "MIN_LIVE_LEN", 16)
    used = []

    def spy(needed: int, capacity: int) -> int | None:
        used.append(cache_lib.live_len(needed, capacity))
        return used[-1]

    monkeypatch.setattr(engine_mod, "live_len", spy)
    return used


def _same(got, want):
    for (toks, lps), (ref_toks, ref_lps) in zip(got, want, strict=True):
        assert toks == ref_toks
        np.testing.assert_allclose(lps, ref_lps, atol=1e-5)


def test_live_lengths():
    assert cache_lib.live_lens(4096) == [None, 2048, 1024, 512]
    assert [cache_lib.live_len(n, 4096) for n in (1, 512, 513, 1500, 2048, 2049)] == [
        512, 512, 1024, 2048, 2048, None]
    assert cache_lib.live_lens(144) == [None] and cache_lib.live_len(10, 144) is None


@pytest.mark.parametrize("layout", ["heads", "keys"])
def test_live_attention_equals_whole_cache(whole_cache, live, layout):
    """In either K/V layout (`models.cache.LAYOUTS`): the whole-cache run is the "heads" layout's."""
    _same(_run(Engine(testing.tiny_model(CONFIG, scale=4.0), cache_layout=layout, **KW)), whole_cache)
    assert {16, 32, None} <= set(live)  # every length was used


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
def test_live_attention_sharded_equals_unsharded(whole_cache, live):
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    _same(_run(Engine(testing.tiny_model(CONFIG, scale=4.0), mesh=mesh, **KW)), whole_cache)
    assert {16, 32} <= set(live)
