"""librarian_jax.engine: mesh and sharding, slot caches, prefill, on-device decode, sampling, sessions.

Entry points: ``generate`` (the contract one-shot API), ``Engine`` (continuous batching over cache slots with
multi-turn ``Session``s), ``SamplingParams``, ``make_mesh``.
"""

from librarian_jax.engine.engine import DEFAULT_PREFILL_BUCKETS, Engine, StepStats, generate
from librarian_jax.engine.mesh import MESH_AXES, make_mesh, resolve_mesh_shape
from librarian_jax.engine.sampling import GREEDY, SamplingParams, sample
from librarian_jax.engine.session import Request, Session, SessionRecord, TurnResult
from librarian_jax.engine.sharding import logical_to_spec, param_shardings, tree_shardings

__all__ = [
    "DEFAULT_PREFILL_BUCKETS",
    "GREEDY",
    "MESH_AXES",
    "Engine",
    "Request",
    "SamplingParams",
    "Session",
    "SessionRecord",
    "StepStats",
    "TurnResult",
    "generate",
    "logical_to_spec",
    "make_mesh",
    "param_shardings",
    "resolve_mesh_shape",
    "sample",
    "tree_shardings",
]
