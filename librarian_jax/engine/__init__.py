"""librarian_jax.engine: meshes, slot caches, prefill, on-device decode, sampling, sessions.

Sharding rules, specs and constraints for params and caches live in one place, `models.partitioning`.

Entry points: ``generate`` (the contract one-shot API), ``Engine`` (continuous batching over cache slots with
multi-turn ``Session``s), ``SamplingParams``, ``make_mesh``.
"""

from librarian_jax.engine.engine import DEFAULT_PREFILL_BUCKETS, Engine, StepStats, generate
from librarian_jax.engine.mesh import MESH_AXES, make_mesh, resolve_mesh_shape
from librarian_jax.engine.sampling import GREEDY, SamplingParams, sample
from librarian_jax.engine.session import Request, Session, TurnResult

__all__ = [
    "DEFAULT_PREFILL_BUCKETS",
    "GREEDY",
    "MESH_AXES",
    "Engine",
    "Request",
    "SamplingParams",
    "Session",
    "StepStats",
    "TurnResult",
    "generate",
    "make_mesh",
    "resolve_mesh_shape",
    "sample",
]
