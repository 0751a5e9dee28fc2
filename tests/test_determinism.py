"""Two launches of the same run are the same run, bit for bit (issue 39, "bit-identical launches").

The same 2-step update of the default config's model and trainer runs in two fresh processes: the first
compiles fresh (writing the persistent compilation cache), initialises, updates twice and checkpoints after
each step; the second reads its programs back from that cache, initialises, and resumes from the first's
step-1 checkpoint ("killed" after step 1) to update once more. Their initial params (the init program from
the cache vs compiled fresh) and their params after step 2 (a straight run vs a resumed one, the update
program from the cache vs compiled fresh) are compared bit for bit. What is and is not the same run (the
learning-rate schedule's length, the CPU count XLA:CPU compiles for) is measured in BENCHMARKS.md,
"Bit-identical launches".
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import os, sys
import numpy as np
from librarian_jax import checkpoint, compile_cache
compile_cache.enable(os.environ["DET_CACHE"])
clock = compile_cache.CompileClock.get()
import jax
from configs import grpo
from librarian_jax import cluster, testing, training
from librarian_jax.config_schema import GRPOConfig
from librarian_jax.rl import train_step as ts

cfg = grpo.get_config("embedded")
cfg.train.num_steps = 2
cfg = GRPOConfig.parse(cfg)
trainer = ts.Trainer(cluster.initial_model(cfg, None, testing.ByteTokenizer()), training.train_config(cfg))
ROWS, SEQ = 4, 64
V = trainer.model().config.vocab_size

def batch(step):
    rng = np.random.default_rng(step)
    mask = np.zeros((ROWS, SEQ), np.float32)
    mask[:, SEQ // 4:] = 1
    return {"tokens": rng.integers(0, V, (ROWS, SEQ)).astype(np.int32), "valid": np.ones((ROWS, SEQ), bool),
            "loss_mask": mask, "sampler_logprobs": np.full((ROWS, SEQ), -2.7, np.float32) * mask,
            "advantages": (rng.normal(size=(ROWS, 1)) * mask).astype(np.float32),
            "row_weights": np.ones(ROWS, np.float32)}

def dump(path, params):
    np.savez(path, *[np.asarray(x) for x in jax.tree.leaves(params)])

mode, out, ck_dir = sys.argv[1], sys.argv[2], sys.argv[3]
dump(out + ".init.npz", trainer.params)
ck = checkpoint.Checkpointer(ck_dir, async_save=False)
if mode == "resume":  # from the straight run's step 1, as if that process had been killed after it
    restored = ck.restore(params=trainer.params, opt_state=trainer.opt_state, step=1)
    trainer.set_state(restored.params, restored.opt_state, restored.step)
    assert trainer.step == 1 and not checkpoint.check_schedule(restored, trainer.schedule_info())
for step in range(trainer.step + 1, 3):
    trainer.update(batch(step))
    if mode == "straight":
        ck.save(step, params=trainer.params, opt_state=trainer.opt_state, force=True,
                extra={"schedule": trainer.schedule_info()})
ck.close()
dump(out + ".npz", trainer.params)
print("CACHE_HITS", clock.totals().cache_hits)
'''


def _launch(tmp_path, mode: str, cache: str, ck: str) -> tuple[dict, dict, int]:
    """(initial params, params after step 2, programs read from the persistent cache) of one launch."""
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, DET_CACHE=cache, PYTHONPATH=REPO)
    out = str(tmp_path / mode)
    proc = subprocess.run([sys.executable, str(script), mode, out, ck], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hits = int(next(ln for ln in proc.stdout.splitlines() if ln.startswith("CACHE_HITS ")).split()[1])
    arrays = []
    for path in (out + ".init.npz", out + ".npz"):
        with np.load(path) as f:
            arrays.append({k: f[k] for k in f.files})
    return arrays[0], arrays[1], hits


@pytest.mark.slow
def test_the_same_two_step_run_compiled_fresh_and_resumed_from_the_cache_is_bit_identical(tmp_path):
    cache, ck = str(tmp_path / "cache"), str(tmp_path / "ck")
    # compiles fresh and writes the persistent cache; 2 steps, a checkpoint after each
    init, straight, hits = _launch(tmp_path, "straight", cache, ck)
    assert os.listdir(cache) and hits == 0
    # another process: its programs read back from that cache; resumes from step 1 of the run above
    init_again, resumed, hits_again = _launch(tmp_path, "resume", cache, ck)
    assert hits_again > 0
    assert len(straight) == 46
    for want, got, what in ((init, init_again, "init"), (straight, resumed, "step 2")):
        for k in want:
            np.testing.assert_array_equal(want[k], got[k], err_msg=f"{what} {k}")
