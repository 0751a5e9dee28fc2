"""What the decode loop's K/V layout costs on a TPU, from the TPU compiler on this host (no TPU needed).

    JAX_PLATFORMS=cpu python -m librarian_jax.bench.cache_layout --topology=v5p-8 --slots=64 --max_len=16384

Compiles one decode round (a `fori_loop` of `--steps` tokens: each attention layer writes the new token's K/V
into its slot cache by scatter and attends over the whole cache, the slot cache donated and sharded over the
slice's chips on its batch axis, as `engine.slots.decode` runs it) for two layouts of the cache, and prints
each one's per-chip cache and the temporaries `memory_analysis()` reports:

- `heads` (the engine's today): K `[batch, kv_heads, head_dim, keys]`, V `[batch, kv_heads, keys, head_dim]`,
  the layouts in which XLA:CPU reads both decode matmuls in place;
- `keys`: K and V `[batch, keys, kv_heads, head_dim]`.

Where the TPU compiler prefers another physical layout inside the loop than the arguments' default one, it
copies every layer's K and V into it before the loop and back after: the temporaries then approach the cache.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from librarian_jax.bench.common import compile_seconds, load_average  # noqa: E402
from librarian_jax.planning import topology  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("topology", "v5p-8", "accelerator type (chips as Cloud TPU counts them) or topology")
flags.DEFINE_integer("slots", 64, "slot cache batch (sharded over the slice's chips)")
flags.DEFINE_integer("max_len", 16384, "cache positions a slot holds")
flags.DEFINE_integer("heads", 8, "query heads")
flags.DEFINE_integer("kv_heads", 4, "K/V heads")
flags.DEFINE_integer("head_dim", 256, "head dimension")
flags.DEFINE_integer("layers", 2, "attention layers")
flags.DEFINE_integer("steps", 8, "tokens a decode round samples")
flags.DEFINE_string("layouts", "heads,keys", "layouts to compile")


def _shapes(layout: str, b: int, t: int, kvh: int, d: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if layout == "heads":
        return (b, kvh, d, t), (b, kvh, t, d)
    if layout == "keys":
        return (b, t, kvh, d), (b, t, kvh, d)
    raise ValueError(f"--layouts: unknown layout {layout!r} (heads, keys)")


def decode_round(layout: str, heads: int, steps: int):
    """The round as a pure function of (caches [(K, V)] per layer, queries `[batch, 1, heads, head_dim]`,
    positions int32 `[batch]`) -> caches."""

    def run(caches: list[tuple[jax.Array, jax.Array]], q: jax.Array, pos: jax.Array) -> list:
        b, _, _, d = q.shape

        def body(i: jax.Array, layers: list) -> list:
            rows, at = jnp.arange(b)[:, None], (pos + i)[:, None]
            out = []
            for k, v in layers:
                kvh = v.shape[1] if layout == "heads" else v.shape[2]
                new = jnp.ones((b, 1, kvh, d), k.dtype)
                qg = q.reshape(b, kvh, heads // kvh, d)
                if layout == "heads":
                    k = k.at[rows, :, :, at].set(new, mode="drop")
                    v = v.at[rows, :, at].set(new, mode="drop")
                    s = jnp.einsum("bkgd,bkdt->bkgt", qg, k, preferred_element_type=jnp.float32)
                    o = jnp.einsum("bkgt,bktd->bkgd", jax.nn.softmax(s, -1).astype(v.dtype), v)
                else:
                    k = k.at[rows, at].set(new, mode="drop")
                    v = v.at[rows, at].set(new, mode="drop")
                    s = jnp.einsum("bkgd,btkd->bkgt", qg, k, preferred_element_type=jnp.float32)
                    o = jnp.einsum("bkgt,btkd->bkgd", jax.nn.softmax(s, -1).astype(v.dtype), v)
                out.append((k + o.sum().astype(k.dtype) * 0, v))  # the output is read: nothing is dropped
            return out

        return jax.lax.fori_loop(0, steps, body, caches)

    return run


def measure(layout: str, mesh: Mesh) -> dict[str, float]:
    """Per-chip GiB of the cache and of the compiled round's temporaries for `layout`."""
    chips = mesh.devices.size
    sharded = NamedSharding(mesh, PartitionSpec("fsdp"))
    kshape, vshape = _shapes(layout, FLAGS.slots, FLAGS.max_len, FLAGS.kv_heads, FLAGS.head_dim)
    caches = [(jax.ShapeDtypeStruct(kshape, jnp.bfloat16, sharding=sharded),
               jax.ShapeDtypeStruct(vshape, jnp.bfloat16, sharding=sharded)) for _ in range(FLAGS.layers)]
    q = jax.ShapeDtypeStruct((FLAGS.slots, 1, FLAGS.heads, FLAGS.head_dim), jnp.bfloat16, sharding=sharded)
    pos = jax.ShapeDtypeStruct((FLAGS.slots,), jnp.int32, sharding=sharded)
    fn = jax.jit(decode_round(layout, FLAGS.heads, FLAGS.steps), donate_argnums=0)
    compiled, compile_s = compile_seconds(fn, caches, q, pos)
    mem = compiled.memory_analysis()
    cache = FLAGS.layers * (np.prod(kshape) + np.prod(vshape)) * 2 / chips
    return {"cache": cache / 2**30, "args": mem.argument_size_in_bytes / 2**30,
            "temp": mem.temp_size_in_bytes / 2**30, "compile_s": compile_s}


def main(argv: list[str]) -> None:
    del argv
    accel = topology.parse(FLAGS.topology)
    mesh = Mesh(np.array(accel.devices()), ("fsdp",))
    print(f"decode round on {accel.name} ({mesh.devices.size} devices): {FLAGS.slots} slots x "
          f"{FLAGS.max_len} positions, {FLAGS.layers} layers of {FLAGS.kv_heads} K/V heads x "
          f"{FLAGS.head_dim}, bf16, {FLAGS.steps} steps; load {load_average()}")
    print("| layout | cache GiB a chip | arguments GiB | temporaries GiB | temporaries / cache | compile s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for layout in FLAGS.layouts.split(","):
        m = measure(layout, mesh)
        ratio = m["temp"] / m["cache"]
        print(f"| {layout} | {m['cache']:.3f} | {m['args']:.3f} | {m['temp']:.3f} | {ratio:.2f} | "
              f"{m['compile_s']:.1f} |")


if __name__ == "__main__":
    app.run(main)
