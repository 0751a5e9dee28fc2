"""Benchmark of what checkpoint digests cost a training step: the step (update + `Checkpointer.save`) with
and without them, and their throughput.

    python -m librarian_jax.bench.checkpoint [--preset=decode_bench --rows=8 --seq=512 --steps=4 --repeats=2]

A trainer of `--preset` (random weights, float32 on the CPU, full fine-tuning) runs `--steps` updates on one
batch, each followed by an asynchronous save of params and Adam state (`save_every=1`: the most a run saves),
under each mode, the modes alternating `--repeats` times so they share the machine's load:

- `no save`: the update alone;
- `save, no digests`: `Checkpointer(digests=False)`;
- `digests on the writer`: the shard digests as runs compute them, from the host copies Orbax makes for its
  asynchronous write, on its writer thread, overlapping the next update (`checkpoint._serialize_and_digest`);
- `digests on the step`: as before they were hooked into Orbax (and as `checkpoint` falls back to when the
  hook is missing): every shard copied to the host again and digested inside `save()`.

A step's time is the update's plus `save()`'s (which also waits for the previous save when it is not done:
`wait`); the median over the steps after the first of each mode (the first compiles and allocates). The
digests' throughput is what `SaveDigests` measured on the writer threads (seconds per GiB of shards), and
crc32c alone on one thread. `--project` presets: their params + Adam state (in the preset's dtype, from shapes
alone), what the digests take per save at the measured rate for 1 and for `--hosts` hosts (each digests its
own share, on its writer thread)."""

from __future__ import annotations

import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from librarian_jax import checkpoint, models
from librarian_jax.bench.common import load_average, make_batch
from librarian_jax.rl import train_step as ts

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "decode_bench", "model preset of the trainer")
flags.DEFINE_integer("num_layers", 0, "decoder layers override (0 = the preset's)")
flags.DEFINE_integer("rows", 8, "rows per batch")
flags.DEFINE_integer("seq", 512, "tokens per row")
flags.DEFINE_integer("steps", 4, "steps per mode and repeat (the first is not timed)")
flags.DEFINE_integer("repeats", 2, "times the modes alternate")
flags.DEFINE_list("project", ["qwen3_5_4b"], "presets whose digest time per save is projected")
flags.DEFINE_list("hosts", ["8"], "host counts of the projection (a v5p-64: 8 hosts of 4 chips)")
flags.DEFINE_integer("project_lora_rank", 32, "LoRA rank of the projection's adapter run (configs/grpo.py's "
                     "4B presets train rank 32 on every linear layer)")

MODES = ("no save", "save, no digests", "digests on the writer", "digests on the step")
GIB = float(1 << 30)


@contextlib.contextmanager
def digests_on_the_step() -> Iterator[None]:
    """`checkpoint` as it runs where Orbax's writer cannot be hooked: shards digested inside `save()`."""
    handlers, hooked = checkpoint.jax_array_handlers, checkpoint.HOOKED
    ours = handlers._async_serialize_replica_slices
    handlers._async_serialize_replica_slices, checkpoint.HOOKED = checkpoint._orbax_serialize, False
    try:
        yield
    finally:
        handlers._async_serialize_replica_slices, checkpoint.HOOKED = ours, hooked


def state_bytes(tree: object) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def run_mode(mode: str, trainer: ts.Trainer, batch: dict[str, np.ndarray], steps: int,
             first_step: int) -> dict[str, list[float]]:
    """`steps` updates, each saved as `mode` says; per step (the first left out): update, save() and step
    seconds, and the digests' seconds per GiB."""
    out: dict[str, list[float]] = {"update": [], "save": [], "step": [], "s_per_gib": []}
    directory = tempfile.mkdtemp(prefix="bench_checkpoint_")
    ck = None if mode == "no save" else checkpoint.Checkpointer(directory, keep=2,
                                                                 digests=mode != "save, no digests")
    on_step = digests_on_the_step() if mode == "digests on the step" else contextlib.nullcontext()
    try:
        with on_step:
            for i in range(steps):
                t0 = time.perf_counter()
                trainer.update(batch)
                jax.block_until_ready(trainer.params)
                t1 = time.perf_counter()
                if ck is not None:
                    ck.save(first_step + i, params=trainer.params, opt_state=trainer.opt_state, force=True)
                t2 = time.perf_counter()
                d = ck.last_digests if ck is not None else None
                if i and d is not None and d.seconds and d.nbytes:
                    out["s_per_gib"].append(d.seconds / (d.nbytes / GIB))
                if i:
                    out["update"].append(t1 - t0)
                    out["save"].append(t2 - t1)
                    out["step"].append(t2 - t0)
            if ck is not None:
                ck.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return out


def crc_seconds_per_gib(nbytes: int) -> float:
    """crc32c alone (`checkpoint.crc32c`), one thread, over `nbytes` of host data: the best of 3."""
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        checkpoint.crc32c(data)
        best = min(best, time.perf_counter() - t)
    return best / (nbytes / GIB)


def projected_bytes(preset: str, lora_rank: int = 0) -> int:
    """The bytes a trainer of `preset` saves (its trainable params + Adam state, in the preset's dtype): full
    fine-tuning, or with `lora_rank` the adapters on every linear layer. From shapes alone."""
    def build() -> nnx.Module:
        model = models.Transformer(models.get_preset(preset), rngs=nnx.Rngs(0))
        return ts.apply_lora(model, lora_rank, 2.0 * lora_rank) if lora_rank else model

    trainable = nnx.state(nnx.eval_shape(build), nnx.LoRAParam if lora_rank else nnx.Param)
    return state_bytes(trainable) + state_bytes(jax.eval_shape(ts.make_optimizer(ts.OptimConfig()).init,
                                                               trainable))


def main(argv: list[str]) -> None:
    del argv
    overrides = {"dtype": "float32", "param_dtype": "float32"} if jax.default_backend() == "cpu" else {}
    if FLAGS.num_layers:
        overrides["num_layers"] = FLAGS.num_layers
    config = models.get_preset(FLAGS.preset, **overrides)
    trainer = ts.Trainer(models.Transformer(config, rngs=nnx.Rngs(0)), ts.TrainConfig())
    batch = make_batch(config.vocab_size, FLAGS.rows, FLAGS.seq)
    saved = state_bytes(trainer.params) + state_bytes(trainer.opt_state)
    print(f"checkpoint digests: {FLAGS.preset} trainer {FLAGS.rows} x {FLAGS.seq}, params + Adam "  # noqa: T201
          f"{saved / (1 << 20):.0f} MiB saved every step, {jax.default_backend()}, load {load_average()}")
    t = time.perf_counter()
    trainer.update(batch)
    jax.block_until_ready(trainer.params)
    print(f"the update's compile and first step: {time.perf_counter() - t:.1f} s (not in the table)")  # noqa: T201
    figures: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    step = 1
    for _ in range(FLAGS.repeats):
        for mode in MODES:
            for k, v in run_mode(mode, trainer, batch, FLAGS.steps, step).items():
                figures[mode].setdefault(k, []).extend(v)
            step += FLAGS.steps
    base = statistics.median(figures["no save"]["step"])
    print("| mode | step (s) | update (s) | save() (s) | vs no save | digests (s/GiB, writer) |")  # noqa: T201
    print("| --- | --- | --- | --- | --- | --- |")  # noqa: T201
    for mode in MODES:
        f = figures[mode]
        rate = f"{statistics.median(f['s_per_gib']):.3f}" if f["s_per_gib"] else "-"
        print(f"| {mode} | {statistics.median(f['step']):.3f} | {statistics.median(f['update']):.3f} | "  # noqa: T201
              f"{statistics.median(f['save']):.4f} | {statistics.median(f['step']) / base:.3f}x | {rate} |")
    alone = crc_seconds_per_gib(min(saved, 256 << 20))
    rates = figures["digests on the writer"]["s_per_gib"]
    writer = statistics.median(rates) if rates else alone
    print(f"crc32c alone, one thread: {alone:.3f} s/GiB; on the writer (host copies in hand): "  # noqa: T201
          f"{writer:.3f} s/GiB")
    for preset in FLAGS.project:
        for rank in (0, FLAGS.project_lora_rank):
            total = projected_bytes(preset, rank)
            per_host = ", ".join(f"{h} hosts {total / int(h) / GIB * writer:.3f} s each" for h in FLAGS.hosts)
            dtype = models.get_preset(preset).param_dtype
            print(f"projected, {preset} {f'LoRA {rank}' if rank else 'full'}: params + Adam "  # noqa: T201
                  f"{total / GIB:.2f} GiB ({dtype}); digests per save: 1 host {total / GIB * writer:.3f} s, "
                  f"{per_host} (on the writer thread, beside the next step)")


if __name__ == "__main__":
    app.run(main)
