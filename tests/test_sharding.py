"""models.partitioning is the one sharding owner: model loading, the engine (params and slot cache) and the
trainer (params and optimizer state) get their specs from it, and they agree.

The mesh tests need 8 devices (tests/run.sh simulates 8 CPU devices).
"""

from __future__ import annotations

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from librarian_jax import models, testing
from librarian_jax.engine import Engine, make_mesh
from librarian_jax.models import partitioning
from librarian_jax.rl import train_step as ts

needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")

# 8 heads / 4 kv heads / 64 mlp divide 2-way tensor; hidden 44 divides fsdp=4 but not fsdp*tensor=8
CONFIG = models.get_preset(
    "tiny", vocab_size=96, hidden_size=44, intermediate_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
    head_dim=8, layer_types=("full_attention",) * 2, dtype="float32", param_dtype="float32",
)


class FakeMesh:
    """Only `.shape` is read by logical_to_spec; lets the 1x4x2 case run without 8 devices."""

    shape = {"data": 1, "fsdp": 4, "tensor": 2}


def test_multi_axis_rule_keeps_the_axes_that_divide():
    """The case the two former copies disagreed on (P('tensor') vs P(None)): 6 is not divisible by fsdp=4,
    nor by fsdp*tensor=8, but by tensor=2, so the dimension splits over tensor alone."""
    rules = {"embed": ("fsdp", "tensor"), "heads": "tensor"}
    mesh = FakeMesh()
    assert partitioning.logical_to_spec(("embed",), mesh, rules, (6,)) == P("tensor")
    assert partitioning.logical_to_spec(("embed",), mesh, rules, (8,)) == P(("fsdp", "tensor"))
    assert partitioning.logical_to_spec(("embed",), mesh, rules, (4,)) == P("fsdp")
    # tensor is taken by the first dimension, so heads replicate; size-1 mesh axes are never named
    assert partitioning.logical_to_spec(("embed", "heads"), mesh, rules, (6, 8)) == P("tensor", None)
    # an engine's slots split over fsdp too (data is size 1 here); 6 slots do not divide by 4: replicated
    assert partitioning.logical_to_spec(("cache_batch",), mesh, None, (4,)) == P("fsdp")
    assert partitioning.logical_to_spec(("cache_batch",), mesh, None, (6,)) == P(None)
    # rules as (logical, mesh axes) pairs: first match wins
    assert partitioning.normalize_rules([("embed", "fsdp"), ("embed", "tensor")]) == {"embed": "fsdp"}


@needs8
def test_params_cache_and_trainer_state_share_one_set_of_specs():
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    rules = {**partitioning.DEFAULT_RULES, "embed": ("fsdp", "tensor")}
    model = testing.tiny_model(CONFIG)
    want = partitioning.state_shardings(nnx.state(model, nnx.Param), mesh, rules)
    want_specs = [s.spec for s in jax.tree.leaves(want)]
    # embed (44) keeps fsdp (4 | 44) and drops tensor (8 does not divide 44), which the heads then use
    assert want["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value().spec == P("fsdp", "tensor")
    assert want["embed_tokens"]["embedding"].get_value().spec == P("tensor", "fsdp")

    loaded = models.shard_model(testing.tiny_model(CONFIG), mesh, rules)
    engine = Engine(testing.tiny_model(CONFIG), mesh=mesh, rules=rules, num_slots=4,
                    max_seq_len=16, round_steps=2, prefill_buckets=(16,))
    trainer = ts.Trainer(testing.tiny_model(CONFIG), ts.TrainConfig(), mesh=mesh,
                         rules=rules)

    def specs(state):
        return [x.sharding.spec for x in jax.tree.leaves(state)]

    assert specs(nnx.state(loaded, nnx.Param)) == want_specs
    assert specs(nnx.state(nnx.merge(engine.graphdef, engine.params), nnx.Param)) == want_specs
    # the trainer holds the same layouts written as its update returns them, trailing Nones dropped
    # (`P(None,)` is `P()`): jit keys programs on the specs as written, so the second step compiles nothing
    canonical = [partitioning.canonical_spec(s) for s in want_specs]
    assert canonical != want_specs  # some spec here has a trailing None, so the line below checks the drop
    assert specs(trainer.params) == canonical
    # Adam's moments are laid out like the params they follow
    count, *moments = specs(trainer.opt_state)
    assert count == P() and moments == canonical * 2
    # the slot cache: slots over data (size 1 here: not named) and fsdp, kv heads over tensor
    cache = models.init_cache(CONFIG, 4, 16)
    cache_want = partitioning.tree_shardings(cache, models.cache_logical_axes(CONFIG), mesh, rules)
    assert specs(engine.cache) == [s.spec for s in jax.tree.leaves(cache_want)]
    assert engine.cache.layers[0]["k"].sharding.spec == P("fsdp", "tensor", None, None)
