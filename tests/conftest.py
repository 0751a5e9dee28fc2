"""Suite-wide: the longest test files start first.

`tests/run.sh` splits the suite over 2 worker processes a file at a time (`--dist loadfile`) in collection
order (`--no-loadscope-reorder`; xdist's default order, most tests first, starts the two longest files last
and one worker then runs alone for minutes). Files listed here are collected first, longest first; the rest
keep pytest's order. A name here that no longer exists stops the run.
"""

from __future__ import annotations

import os

import pytest

from librarian_jax import compile_cache

# tests/run.sh gives the suite one persistent compilation cache (a new directory each run): the workers use
# it too, so a program one test compiled is read back by another test, in this worker, the other one or a
# process a test starts (which finds it through the same variable)
if os.environ.get(compile_cache.ENV):
    compile_cache.enable()

LONGEST_FIRST = (  # seconds of its tests in a full run on 2 cores (tests/run.sh --durations=0, 2026-12-06)
    "test_learning_embedded.py",  # 164: a GRPO run's rollouts and updates, optimised programs
    "test_multihost.py",  # 125: 3 launches of main, 2 processes each
    "test_qwen3_5_moe.py",  # 56
    "test_bench_smoke.py",  # 56: one subprocess runs every bench
    "test_compile_cache.py",  # 52: the embedded default's programs compiled ahead, twice
    "test_scan_layers.py",  # 51
    "test_eval_multiprocess.py",  # 40
    "test_baselines.py",  # 37: an embedder, a reranker and every baseline end to end
    "test_engine.py",  # 35
    "test_engine_scan.py",  # 32
    "test_rl_train.py",  # 29
    "test_cluster.py",  # 22
    "test_rl_chunked.py",  # 21
    "test_engine_mesh.py",  # 18
    "test_determinism.py",  # 16: 2-step runs in fresh processes, compared bit for bit
    "test_rollout_e2e.py",  # 16
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    missing = [f for f in LONGEST_FIRST if not os.path.exists(os.path.join(here, f))]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that do not exist: {missing}")
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(rank)))


@pytest.fixture(scope="session")
def qwen_tok(tmp_path_factory):
    """A small `tokenizer.json` with Qwen3.5's special and added tokens (a byte-level BPE trained here)."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tk_models

    from librarian_jax.tokenizers import load_tokenizer

    d = tmp_path_factory.mktemp("q35")
    raw = Tokenizer(tk_models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["Paris is the capital of France. read the file raw_docs/a.txt answer"] * 20,
                            trainer)
    extra = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
    raw.add_tokens([AddedToken(t, special=False) for t in extra])
    raw.save(str(d / "tokenizer.json"))
    cfg = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
           "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return load_tokenizer(str(d))
