"""Two launches of the same run are the same run, bit for bit (issue 39, "bit-identical launches").

The same 2-step update of the default config's model and trainer runs in fresh processes: one compiling
fresh and writing the persistent compilation cache, one reading its programs back from that cache, one
"killed" after step 1 (checkpointed) and resumed by another process. Their params after step 2 are compared
bit for bit. What is and is not the same run (the learning-rate schedule's length, the CPU count XLA:CPU
compiles for) is measured in BENCHMARKS.md, "Bit-identical launches".
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
import jax
from configs import grpo
from librarian_jax import cluster, training
from librarian_jax.config_schema import GRPOConfig
from librarian_jax.rl import train_step as ts

cfg = grpo.get_config()
cfg.train.num_steps = 2
cfg = GRPOConfig.parse(cfg)
class Tok:
    vocab_size = 512
trainer = ts.Trainer(cluster.initial_model(cfg, None, Tok()), training.train_config(cfg))
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

mode, out, ck_dir = sys.argv[1], sys.argv[2], sys.argv[3]
ck = checkpoint.Checkpointer(ck_dir, async_save=False)
if mode == "resume":
    restored = ck.restore(params=trainer.params, opt_state=trainer.opt_state)
    trainer.set_state(restored.params, restored.opt_state, restored.step)
    assert not checkpoint.check_schedule(restored, trainer.schedule_info())
for step in range(trainer.step + 1, 3 if mode != "kill" else 2):
    trainer.update(batch(step))
    ck.save(step, params=trainer.params, opt_state=trainer.opt_state, force=True,
            extra={"schedule": trainer.schedule_info()})
ck.close()
np.savez(out, *[np.asarray(x) for x in jax.tree.leaves(trainer.params)])
'''


def _launch(tmp_path, mode: str, name: str, cache: str, ck: str) -> dict[str, np.ndarray]:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, DET_CACHE=cache, PYTHONPATH=REPO)
    out = str(tmp_path / f"{name}.npz")
    proc = subprocess.run([sys.executable, str(script), mode, out, ck], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.slow
def test_the_same_two_step_run_in_two_processes_and_resumed_is_bit_identical(tmp_path):
    cache = str(tmp_path / "cache")
    # compiles fresh and writes the persistent cache; then a process that reads its programs back
    first = _launch(tmp_path, "straight", "first", cache, str(tmp_path / "ck_first"))
    assert os.listdir(cache)
    second = _launch(tmp_path, "straight", "second", cache, str(tmp_path / "ck_second"))
    killed = str(tmp_path / "ck_killed")
    _launch(tmp_path, "kill", "killed", cache, killed)  # step 1, checkpointed, then the process ends
    resumed = _launch(tmp_path, "resume", "resumed", cache, killed)  # another process: step 2
    assert len(first) == 46
    for other in (second, resumed):
        for k in first:
            np.testing.assert_array_equal(first[k], other[k], err_msg=k)
