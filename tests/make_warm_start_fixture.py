"""Makes tests/fixtures/warm_start/: the embedded default's warm-start checkpoint (the tiny preset after the
SFT of configs/sft.py on the scripted demonstrations) and its tokenizer, for tests/test_learning_embedded.py.

    python tests/make_warm_start_fixture.py [--workdir /tmp/ws_fixture]

It runs the real SFT command (`python -m librarian_jax.main --config=configs/sft.py`, the embedded preset,
about 6 minutes on 2 cores) unless the workdir already holds its final step, then copies the newest step's
params (Orbax, float32, ~4.5 MB) and the tokenizer file here. Run by hand; the tests only read the result.

The committed fixture predates the warm start's tokenizer moving to the demonstrations' worlds only
(2026-12-01, fourth session): it is the same SFT with the tokenizer of the 48-task default. Remade from the
new default's warm start (run 15 in BENCHMARKS.md), `test_learning_embedded`'s sampled builder made 16 valid
calls of 23 (0.70 required), so it was kept.
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
                        f"--config.workdir={args.workdir}"], check=True, cwd=ROOT)
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
