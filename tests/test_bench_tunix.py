"""bench.decode's Tunix column compares like with like: Tunix's Sampler on Tunix's Qwen3 holding our weights
(``bench.decode.tunix_generate``) produces, greedy, the same tokens as ``engine.generate``. Skipped where
google-tunix does not import (the project's venv); run it from a venv that has it, e.g.
``/work/tunixvenv/bin/python -m pytest tests/test_bench_tunix.py``."""
from __future__ import annotations

import numpy as np
import pytest

from librarian_jax import models, testing
from librarian_jax.bench.decode import tunix_generate
from librarian_jax.engine import generate


def test_tunix_column_is_skipped_cleanly_without_tunix():
    """Without tunix the bench gets (None, a reason) and prints it; with tunix, a runner."""
    model = testing.tiny_model(models.get_preset("tiny"))
    run, note = tunix_generate(model, 4, 2)
    try:
        import tunix  # noqa: F401
    except ImportError:
        assert run is None and "not importable" in note
    else:
        assert run is not None and note.startswith("tunix")


def test_tunix_sampler_equals_generate_on_the_same_weights():
    pytest.importorskip("tunix")
    config = models.get_preset("decode_bench")
    model = testing.tiny_model(config, seed=3)
    prompts = np.random.default_rng(1).integers(0, config.vocab_size, size=(3, 8))
    run, _ = tunix_generate(model, 8, 12)
    assert run is not None
    assert run(prompts) == generate(model, prompts.tolist(), 12)
