"""Engine on meshes: shape resolution, logical-axis rules with replication fallback, sharded == unsharded.

The sharded tests need 8 devices (tests/run.sh simulates 8 CPU devices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from librarian_jax import models, testing
from librarian_jax.engine import Engine, SamplingParams, make_mesh, resolve_mesh_shape
from librarian_jax.models.partitioning import logical_to_spec, normalize_rules, state_shardings

CONFIG = models.get_preset(
    "tiny", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
    head_dim=8, layer_types=("full_attention",) * 2, dtype="float32", param_dtype="float32",
)
needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")


def test_resolve_mesh_shape():
    assert resolve_mesh_shape({"data": -1, "fsdp": 1, "tensor": 1}, 8) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert resolve_mesh_shape({"data": 2, "tensor": -1}, 8) == {"data": 2, "fsdp": 1, "tensor": 4}
    assert resolve_mesh_shape(None, 1) == {"data": 1, "fsdp": 1, "tensor": 1}
    with pytest.raises(ValueError, match="unknown axis names"):
        resolve_mesh_shape({"model": 2}, 2)
    with pytest.raises(ValueError, match="at most one axis"):
        resolve_mesh_shape({"data": -1, "tensor": -1}, 8)
    with pytest.raises(ValueError, match="covers 4 devices"):
        resolve_mesh_shape({"data": 2, "tensor": 2}, 8)
    with pytest.raises(ValueError, match="not divisible"):
        resolve_mesh_shape({"data": -1, "tensor": 3}, 8)


@needs8
def test_logical_to_spec_fallback_to_replication():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = normalize_rules(None)
    assert rules["heads"] == "tensor"  # models.DEFAULT_RULES uses the engine's mesh axis names
    assert logical_to_spec(("embed", "heads"), mesh, rules, (32, 64)) == PartitionSpec("fsdp", "tensor")
    # 3 heads do not divide over 2 devices: replicated
    assert logical_to_spec(("embed", "heads"), mesh, rules, (32, 3)) == PartitionSpec("fsdp", None)
    # one mesh axis is used at most once per array
    assert logical_to_spec(("heads", "mlp"), mesh, rules, (4, 4)) == PartitionSpec("tensor", None)
    assert logical_to_spec(None, mesh, rules, (4,)) == PartitionSpec()
    with pytest.raises(ValueError, match="do not match shape"):
        logical_to_spec(("embed",), mesh, rules, (4, 4))



KW = dict(num_slots=8, max_seq_len=64, round_steps=8, prefill_buckets=(16, 64))
PROMPTS = [list(range(1 + i, 4 + 5 * i)) for i in range(8)]  # 3..38 tokens


def _run(engine: Engine, temperature: float = 0.0) -> list[tuple[list[int], np.ndarray]]:
    sessions = [engine.new_session(p) for p in PROMPTS]
    reqs = [engine.submit(s, 6, SamplingParams(temperature=temperature, seed=3, stream=i))
            for i, s in enumerate(sessions)]
    engine.run_until_done()
    for s in sessions:  # second turn: cache continuation on the mesh
        s.append([5, 6, 7])
    reqs = [engine.submit(s, 4) for s in sessions]
    engine.run_until_done()
    out = [(s.record().tokens.tolist(), s.record().logprobs) for s in sessions]
    del reqs
    for s in sessions:
        s.close()
    return out


@pytest.fixture(scope="module")
def reference():
    return _run(Engine(testing.tiny_model(CONFIG, scale=4.0), **KW))


@needs8
@pytest.mark.parametrize("shape", [{"data": 8}, {"data": 2, "fsdp": 2, "tensor": 2}, {"tensor": 8}])
def test_sharded_equals_unsharded(reference, shape):
    mesh = make_mesh(shape)
    engine = Engine(testing.tiny_model(CONFIG, scale=4.0), mesh=mesh, **KW)
    k_spec = engine.cache.layers[0]["k"].sharding.spec
    # slots spread over the data and fsdp axes (an FSDP engine splits its slots too)
    want = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1)
    if want:
        assert k_spec[0] == (want[0] if len(want) == 1 else want)
    if mesh.shape["tensor"] > 1:
        q = engine.params["layers"][0]["self_attn"]["q_proj"]["kernel"]
        assert "tensor" in tuple(q.sharding.spec)  # 8 heads divide 2 and 8
    got = _run(engine)
    for (toks, lps), (ref_toks, ref_lps) in zip(got, reference, strict=True):
        assert toks == ref_toks
        np.testing.assert_allclose(lps, ref_lps, atol=1e-4)


@needs8
def test_scanned_sharded_equals_unsharded(reference):
    # Engine(scan_layers=True) on a mesh: the stacked K/V keep the slot on "data" and "fsdp" (the layer axis,
    # 1, is replicated), the stacked weights keep their "tensor" split; same tokens as the unsharded loop
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    engine = Engine(testing.tiny_model(CONFIG, scale=4.0), mesh=mesh, scan_layers=True, **KW)
    assert engine.scan_layers
    k_spec = tuple(engine.cache.groups[0]["k"].sharding.spec)
    assert k_spec[:2] == (("data", "fsdp"), None), k_spec
    q = engine._stacked[0]["self_attn"]["q_proj"]["kernel"]
    assert q.shape[0] == CONFIG.num_layers and tuple(q.sharding.spec)[0] is None
    assert "tensor" in tuple(q.sharding.spec)
    got = _run(engine)
    for (toks, lps), (ref_toks, ref_lps) in zip(got, reference, strict=True):
        assert toks == ref_toks
        np.testing.assert_allclose(lps, ref_lps, atol=1e-4)


@needs8
def test_two_engines_share_a_mesh():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    policy = Engine(testing.tiny_model(CONFIG, scale=4.0), mesh=mesh, **KW)
    frozen = Engine(testing.tiny_model(CONFIG, seed=1, scale=4.0), mesh=mesh, **KW)
    a = policy.new_session([1, 2, 3])
    b = frozen.new_session([1, 2, 3])
    ra, rb = policy.submit(a, 6), frozen.submit(b, 6)
    policy.step()
    frozen.step()
    assert ra.done and rb.done and ra.result.tokens != rb.result.tokens
    # the policy takes the frozen engine's weights, device to device
    policy.update_params(frozen.params)
    a2 = policy.new_session([1, 2, 3])
    r = policy.submit(a2, 6)
    policy.run_until_done()
    assert r.result.tokens == rb.result.tokens
    # A model whose params already live on a mesh: the engine adopts that mesh by default.
    model = testing.tiny_model(CONFIG, seed=1, scale=4.0)
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, state_shardings(state, mesh)))
    inferred = Engine(model, **KW)
    assert inferred.mesh == mesh
    c = inferred.new_session([1, 2, 3])
    r = inferred.submit(c, 6)
    inferred.run_until_done()
    assert r.result.tokens == rb.result.tokens


@needs8
def test_copying_slots_split_over_devices_is_exact():
    """`copy_slots` on a cache whose slot axis is split over devices (slots over data and fsdp) takes the
    one-hot path (no device gathers the whole cache): every leaf's rows equal a host-side copy exactly,
    float32, bfloat16 and int32 alike, padding rows dropped, and the layout kept."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from librarian_jax.engine import slots

    mesh = make_mesh({"data": 2, "fsdp": 4})
    rng = np.random.default_rng(0)
    cache = {"k": rng.standard_normal((16, 3, 5)).astype(np.float32),
             "b": rng.standard_normal((16, 7)).astype(jnp.bfloat16),
             "n": rng.integers(0, 100, (16,)).astype(np.int32)}
    shardings = {k: NamedSharding(mesh, P(("data", "fsdp"))) for k in cache}
    src = np.array([0, 3, 3, 9, 2], np.int32)
    dst = np.array([5, 6, 16, 1, 15], np.int32)  # 16: a padding row
    want = {k: np.asarray(v).copy() for k, v in cache.items()}
    for s, d in zip(src, dst, strict=True):
        if d < 16:
            for k in want:
                want[k][d] = np.asarray(cache[k])[s]
    got = slots.copy_program(tuple(jax.tree.leaves(shardings)))(jax.device_put(cache, shardings), src, dst)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k])
        assert got[k].sharding.spec == P(("data", "fsdp"))
