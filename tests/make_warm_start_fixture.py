"""Makes tests/fixtures/warm_start/: the embedded default's warm-start checkpoint (the tiny preset after the
SFT of configs/sft.py on the scripted demonstrations of the default, noisy world, seed 1) and its tokenizer,
for tests/test_learning_embedded.py.

    python tests/make_warm_start_fixture.py [--workdir /tmp/ws_fixture]

It runs the real SFT command (`python -m librarian_jax.main --config=configs/sft.py --config.seed=1`, about
6-8 minutes on 2 cores) unless the workdir already holds its final step, then copies the newest step's
params (Orbax, float32, ~4.5 MB) and the tokenizer file here. Run by hand; the tests only read the result.
Seed 1: its warm start's sampled builds often stop at once, so a few GRPO steps raise its reward clearly
(the test's comment has the figures); seed 0's already builds well.

tests/fixtures/warm_start_classic/ is what this script made before the default moved to the noisy world
(2026-12-07): the classic world's warm start (`configs/sft.py:embedded`, seed 0), for the tests that run the
classic world (`tests/test_multihost.py`, `tests/test_eval_multiprocess.py`).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "warm_start")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/librarian_jax/warm_start_fixture")
    args = ap.parse_args()
    ckpts = os.path.join(args.workdir, "checkpoints")
    if not glob.glob(os.path.join(ckpts, "*", "commit_success.txt")):
        subprocess.run([sys.executable, "-m", "librarian_jax.main", "--config=configs/sft.py",
                        "--config.seed=1", f"--config.workdir={args.workdir}"], check=True, cwd=ROOT)
    step = max(int(os.path.basename(os.path.dirname(p)))
               for p in glob.glob(os.path.join(ckpts, "*", "commit_success.txt")))
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    shutil.copytree(os.path.join(ckpts, str(step), "params"), os.path.join(OUT, "params"))
    (tok,) = glob.glob(os.path.join(args.workdir, "tokenizer", "*.model"))
    shutil.copy(tok, os.path.join(OUT, "tokenizer.model"))
    print(f"wrote {OUT} from step {step} of {args.workdir}")  # noqa: T201


if __name__ == "__main__":
    main()
