"""The synthetic world's design check: which structure helps the run's answerer, against retrieval.

    python -m librarian_jax.bench.world --ks=2,3,5,8                     # the noisy preset's world
    python -m librarian_jax.bench.world --config=configs/grpo.py:embedded  # the classic world
    python -m librarian_jax.bench.world --config.data.docs_per_task=40 --corpora=16 --ks=1,2,3,5,8

Every warm-start demonstration style builds a workspace for each of `--corpora` held-out corpora of the
config's world, and the run's answerer answers their questions beside raw navigation, BM25 and agentic search
at each k of `--ks` (`eval.world_check`, model-free and deterministic). Prints accuracy per method and per
question type, files and tokens read per question and the tokens one construction cost: what a builder can
gain in this world by organising it, and what retrieval reaches without building anything. The world's
design (docs/world.md) is checked against this table.
"""

from __future__ import annotations

import json

from absl import app, flags, logging
from ml_collections import config_flags

from librarian_jax.eval.world_check import measure, render
from librarian_jax.warm_start.demos import STYLES

config_flags.DEFINE_config_file("config", "configs/grpo.py:noisy", "the run config whose world and answerer")
_STYLES = flags.DEFINE_list("styles", list(STYLES), "scripted builder styles (warm_start.demos.STYLES)")
_CORPORA = flags.DEFINE_integer("corpora", 31, "held-out corpora (0 = all)")
_KS = flags.DEFINE_list("ks", ["3"], "passages per retrieval (bm25 top-k, agentic search k)")
_CALLS = flags.DEFINE_integer("calls_per_turn", 0, "scripted builder calls per reply (0: as many as fit "
                              "rollout.builder.max_new_tokens)")
_OUT = flags.DEFINE_string("out", "", "write the results as JSON here")


def main(argv: list[str]) -> None:
    del argv
    ks = [int(k) for k in _KS.value]
    res = measure(flags.FLAGS.config, _STYLES.value, _CORPORA.value, ks, _CALLS.value)
    logging.info("bench.world: %s", json.dumps(res))
    print(render(res))  # noqa: T201 - the benchmark's answer
    print(f"wall {res['wall_s']:.1f} s")  # noqa: T201
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    app.run(main)
