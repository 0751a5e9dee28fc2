"""Decode throughput: ``engine.generate`` vs Hugging Face ``generate`` vs the matmul-only limit.

    python -m librarian_jax.bench.decode [--batches=32,1] [--new_tokens=128] [--prompt_len=16] [--repeats=3]
        [--preset=decode_bench] [--num_layers=0] [--scan_layers=false] [--transformers=true]
        [--memory_gbps=0] [--compilation_cache_dir=none]

Model: the ``decode_bench`` preset (Qwen3-style, ~12M params: hidden 384, 6 layers, 6 heads / 2 KV heads,
head_dim 64, intermediate 1024, vocab 8000, tied embeddings), random weights, fp32, greedy, KV cache on.
The HF side (``AutoModelForCausalLM`` from the config.json ``save_hf`` writes for the preset, so the same
architecture and dtype; PyTorch on the CPU with ``torch.set_num_threads(2)``, or on CUDA when JAX runs on a
GPU) runs only when torch and transformers import (e.g. ``/work/tvenv/bin/python -m
librarian_jax.bench.decode``); otherwise only our figures are printed. The limit is the time of the same
decode steps' matrix products alone: a jitted loop of ``new_tokens`` steps of the projections, MLP and LM head
at the same batch, without attention, norms, sampling or cache updates, with weights and activations in the
preset's dtypes; the second limit adds each attention layer's two products over a K/V cache of its own at the
decode's mean length (below), read from memory every step as the engine's is. The roofline is the decode rate
if every step only read the weights and each row's live cache (K/V of the positions attended, at the decode's
mean length ``prompt_len + new_tokens / 2``; Gated DeltaNet state read and written) once at the device's
memory bandwidth: ``--memory_gbps`` when given (e.g. 4800 for an H200's HBM), else, on an accelerator,
measured by a jitted copy of 512 MiB; on the CPU only when given (a small preset's weights sit in the CPU's
caches, so no one bandwidth bounds its step; the matmul-only limit is the CPU's reference).
``--transformers=false`` leaves the HF side out.

Each line gives the first call's wall time (compilation, or reading the persistent compilation cache that
`--compilation_cache_dir` points at, plus one run) apart from the steady state (best of `--repeats`), and the
steady state's ratio to the limit and to transformers. `--scan_layers=false,true` times the engine with its
layers run one by one and under one `lax.scan` (`Engine(scan_layers=...)`), alternately, one line each, and
adds each setting's decode-round and prefill programs' own compile time (lowered and compiled ahead of time).

When ``google-tunix`` imports (e.g. a venv with ``pip install google-tunix`` and this package), a Tunix column
runs Tunix's ``Sampler`` (``tunix.generate``) on Tunix's Qwen3 holding the same weights (mapped from ours),
greedy, on the same prompts; its calls alternate with ours, and the line says in how many rows the two
produced the same tokens. Without tunix the line says it was not measured.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx

from librarian_jax import compile_cache, models
from librarian_jax.bench.common import (
    alternate_best,
    best_time,
    engine_program_seconds,
    hf_causal_lm,
    load_average,
)
from librarian_jax.engine import generate
from librarian_jax.engine.engine import generate_engine

FLAGS = flags.FLAGS
flags.DEFINE_string("batches", "32,1", "comma-separated batch sizes")
flags.DEFINE_integer("new_tokens", 128, "new tokens per row")
flags.DEFINE_integer("prompt_len", 16, "prompt tokens per row")
flags.DEFINE_integer("repeats", 3, "timed repeats (best is reported)")
flags.DEFINE_string("preset", "decode_bench", "model preset")
flags.DEFINE_integer("num_layers", 0, "decoder layers override (0 = the preset's; a uniform layer type): how "
                     "compile time grows with depth")
flags.DEFINE_list("scan_layers", ["false"], "Engine scan_layers values to time, each its own line: true "
                  "(the layers under one lax.scan) and/or false (one by one)")
flags.DEFINE_bool("transformers", True, "time transformers' generate (PyTorch, same architecture, on CUDA "
                  "when JAX runs on a GPU, else the CPU's 2 threads) beside ours when torch and transformers "
                  "import")
flags.DEFINE_float("memory_gbps", 0.0, "memory bandwidth for the roofline, GB/s (0: measure a copy on an "
                   "accelerator, no roofline on the CPU)")
compile_cache.define_flag()


def matmul_limit_seconds(config: models.ModelConfig, batch: int, steps: int, repeats: int,
                         context: int = 0) -> float:
    """Time of ``steps`` decode steps' matrix products alone (one jitted ``fori_loop``): the projections, MLP
    and LM head; with ``context`` > 0 also each attention layer's two products over a K/V cache of its own
    holding ``context`` positions (a sliding layer at most its window), laid out as the engine's
    (`[batch, kv_heads, head_dim, len]` / `[batch, kv_heads, len, head_dim]`), so the cache is read from
    memory each step as the engine must."""
    rng = np.random.default_rng(0)
    h, q, kv, f, v = (
        config.hidden_size,
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
        config.intermediate_size,
        config.vocab_size,
    )
    kvh, d = config.num_kv_heads, config.head_dim
    g = config.num_heads // kvh

    def w(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, config.jnp_param_dtype)

    layers = []
    for kind in config.layer_types:
        p = dict(q=w(h, q), k=w(h, kv), v=w(h, kv), o=w(q, h), gate=w(h, f), up=w(h, f), down=w(f, h))
        if context > 0 and kind in ("full_attention", "sliding_attention"):
            n = min(context, config.sliding_window) if kind == "sliding_attention" else context
            p.update(kt=w(batch, kvh, d, n).astype(config.jnp_dtype), vc=w(batch, kvh, n, d).astype(
                config.jnp_dtype))
        layers.append(p)
    head = w(h, v)

    @jax.jit
    def run(x: jax.Array) -> jax.Array:
        def step(_, x):
            for p in layers:
                a = x @ p["q"]
                kk = x @ p["k"]
                vv = x @ p["v"]
                if "kt" in p:
                    scores = jnp.einsum("bkgd,bkdt->bkgt", a.reshape(batch, kvh, g, d), p["kt"])
                    a = jnp.einsum("bkgt,bktd->bkgd", scores, p["vc"]).reshape(batch, q)
                x = x + a @ p["o"] + (kk.sum() + vv.sum()) * 1e-9
                x = x + (x @ p["gate"] * (x @ p["up"])) @ p["down"]
            logits = x @ head
            return x + logits[:, :1] * 1e-9

        return jax.lax.fori_loop(0, steps, step, x)

    x0 = jnp.ones((batch, h), config.jnp_dtype)
    return best_time(lambda: run(x0).block_until_ready(), repeats)[0]


def measured_memory_bytes_per_s(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second the default device reads + writes in a jitted copy of a `mib` MiB array (best of
    `repeats`)."""
    x = jnp.zeros((mib * 2**20 // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    t = best_time(lambda: copy(x).block_until_ready(), repeats)[0]
    return 2 * x.nbytes / t


def decode_step_bytes(config: models.ModelConfig, param_bytes: int, batch: int, context: float) -> float:
    """Bytes a decode step must move at least: every parameter once, plus per row the K/V of the `context`
    positions its attention layers read (a sliding layer at most its window) and each Gated DeltaNet layer's
    state, read and written. From `models.cache.init_cache`'s own shapes and dtypes."""
    one = jax.eval_shape(lambda: models.init_cache(config, 1, 1))
    per_row = 0.0
    for kind, layer in zip(config.layer_types, one.layers, strict=True):
        nbytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(layer))
        if kind == "linear_attention":
            per_row += 2 * nbytes
        elif kind == "sliding_attention":  # ModelConfig requires a sliding_window for these
            per_row += nbytes * min(context, config.sliding_window)
        else:
            per_row += nbytes * context
    return param_bytes + batch * per_row


def hf_seconds(
    config: models.ModelConfig, prompts: np.ndarray, new_tokens: int, repeats: int
) -> tuple[float | None, str]:
    """(Time of HF transformers' greedy ``generate`` on the same model, a note): (None, why) without
    torch/transformers or when transformers' own model raises (e.g. its CPU grouped matmul on some MoE
    shapes).

    The HF model is ``bench.common.hf_causal_lm(config)`` (so Gemma 3, Llama and Qwen3.5 presets run their
    own architecture, in the preset's parameter dtype), on CUDA when JAX runs on a GPU and torch sees one,
    else on the CPU with 2 threads."""
    try:
        import torch
        import transformers  # noqa: F401 - hf_causal_lm's; here only whether it imports
    except ImportError:
        return None, "torch/transformers not importable in this python"
    cuda = jax.default_backend() == "gpu" and torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = hf_causal_lm(config, device=device.type).eval()
    ids = torch.as_tensor(prompts, dtype=torch.long, device=device)
    attention = torch.ones_like(ids)

    def run() -> None:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=attention,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
        if cuda:
            torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + new_tokens

    try:
        return best_time(run, repeats)[0], f"{type(model).__name__} on {device.type}"
    except RuntimeError as e:
        return None, f"transformers' {type(model).__name__} raised: {str(e).splitlines()[0]}"


class _IdTokenizer:
    """The tokenizer Tunix's ``Sampler`` asks for, over token ids written as decimal text: ``encode("5 17")
    == [5, 17]``. No BOS (``bos_id`` None); ``pad_id`` is ``vocab_size``, an id no prompt or model output
    holds (Tunix masks every buffer position equal to it, generated tokens included)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, **_: Any) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int], **_: Any) -> str:
        return " ".join(str(i) for i in ids)

    def bos_id(self) -> None:
        return None

    def eos_id(self) -> int:
        return -1

    def pad_id(self) -> int:
        return self.vocab_size


def tunix_generate(
    model: models.Transformer, max_prompt_len: int, new_tokens: int
) -> tuple[Callable[[np.ndarray], list[list[int]]] | None, str]:
    """Tunix's ``Sampler`` (``tunix.generate``) over Tunix's Qwen3 holding ``model``'s weights.

    Args:
      model: our Qwen3-style ``Transformer`` (qk-norm, untied or tied embeddings, no sliding window).
      max_prompt_len: the longest prompt (shorter ones are left-padded to it, one compiled program).
      new_tokens: new tokens per row.
    Returns:
      ``(run, version)``: ``run(prompts int [batch, prompt_len]) -> new tokens per row`` (greedy, no stop
      id), or ``(None, why)`` when tunix does not import or the model is not a plain Qwen3.
    """
    try:
        import tunix
        from tunix.generate import sampler as tunix_sampler
        from tunix.models.qwen3 import model as tunix_qwen3
    except ImportError as e:
        return None, f"not importable in this python ({e.name})"
    c = model.config
    if c.model_type != "qwen3" or c.num_experts or not c.qk_norm or c.attn_output_gate:
        return None, f"no Tunix Qwen3 for model_type {c.model_type}"
    tcfg = tunix_qwen3.ModelConfig(
        num_layers=c.num_layers, vocab_size=c.vocab_size, embed_dim=c.hidden_size,
        hidden_dim=c.intermediate_size, num_heads=c.num_heads, head_dim=c.head_dim,
        num_kv_heads=c.num_kv_heads, rope_theta=int(c.rope_theta), norm_eps=c.rms_norm_eps,
        use_tied_embedding=c.tie_embeddings, dtype=c.jnp_dtype, param_dtype=c.jnp_param_dtype,
    )
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    with mesh:
        tm = tunix_qwen3.Qwen3(tcfg, rngs=nnx.Rngs(0))
    e, h, kvh, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    tm.embedder.input_embedding.value = model.embed_tokens.embedding[...]
    if not c.tie_embeddings:
        tm.lm_head.w.value = model.lm_head.kernel[...]
    tm.final_norm.w.value = model.norm.weight[...]
    for ours, theirs in zip(model.layers, tm.layers, strict=True):
        a, ta = ours.self_attn, theirs.attn
        ta.q_proj.w.value = a.q_proj.kernel[...].reshape(e, h, d)
        ta.k_proj.w.value = a.k_proj.kernel[...].reshape(e, kvh, d)
        ta.v_proj.w.value = a.v_proj.kernel[...].reshape(e, kvh, d)
        ta.o_proj.w.value = a.o_proj.kernel[...].reshape(h, d, e)
        ta.q_norm.w.value = a.q_norm.weight[...]
        ta.k_norm.w.value = a.k_norm.weight[...]
        theirs.input_layernorm.w.value = ours.input_layernorm.weight[...]
        theirs.post_attention_layernorm.w.value = ours.post_attention_layernorm.weight[...]
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(theirs.mlp, name).kernel.value = getattr(ours.mlp, name).kernel[...]
    sampler = tunix_sampler.Sampler(
        tm, _IdTokenizer(c.vocab_size),
        tunix_sampler.CacheConfig(cache_size=max_prompt_len + new_tokens, num_layers=c.num_layers,
                                  num_kv_heads=kvh, head_dim=d),
    )

    def run(prompts: np.ndarray) -> list[list[int]]:
        out = sampler(
            [" ".join(str(int(t)) for t in row) for row in prompts],
            max_generation_steps=new_tokens, max_prompt_length=max_prompt_len, temperature=0.0,
            eos_tokens=[-1],
        )
        return [np.asarray(t).tolist() for t in out.tokens]

    return run, f"tunix {getattr(tunix, '__version__', '?')}"


def program_compile_seconds(model: nnx.Module, batch: int, scan: bool) -> tuple[float, float]:
    """Seconds to lower + compile (ahead of time) the decode round and the all-slot prefill of the engine
    ``generate`` builds for this bench's shapes, with the layers scanned or not: (decode, prefill)."""
    s = engine_program_seconds(generate_engine(model, batch, FLAGS.prompt_len, FLAGS.new_tokens,
                                               scan_layers=scan))
    return s["decode_lower_s"] + s["decode_compile_s"], s["prefill_lower_s"] + s["prefill_compile_s"]


def main(argv: list[str]) -> None:
    del argv
    cache_dir = compile_cache.enable(FLAGS.compilation_cache_dir)
    config = models.get_preset(FLAGS.preset, **({"num_layers": FLAGS.num_layers} if FLAGS.num_layers else {}))
    model = models.Transformer(config, rngs=nnx.Rngs(0))
    param_leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    params = sum(x.size for x in param_leaves)
    param_bytes = sum(x.size * x.dtype.itemsize for x in param_leaves)
    if FLAGS.memory_gbps > 0:
        bandwidth, how = FLAGS.memory_gbps * 1e9, "given"
    elif jax.default_backend() != "cpu":
        bandwidth, how = measured_memory_bytes_per_s(), "measured copy"
    else:
        bandwidth, how = None, ""
    lines = [
        f"decode bench: preset {FLAGS.preset} ({config.num_layers} layers, {params / 1e6:.1f}M params), "
        f"prompt {FLAGS.prompt_len}, "
        f"{FLAGS.new_tokens} new tokens, greedy, {jax.devices()[0].platform} x{jax.device_count()}, "
        f"load average before {load_average()}; compilation cache {cache_dir or 'off'}; "
        + (f"memory {bandwidth / 1e9:.1f} GB/s ({how}) for the roofline" if bandwidth else
           "no roofline on the CPU without --memory_gbps")
    ]
    tunix_run, tunix_note = tunix_generate(model, FLAGS.prompt_len, FLAGS.new_tokens)
    lines.append(f"Tunix sampler: {'' if tunix_run else 'not measured, '}{tunix_note}")
    scans = [x.strip().lower() in ("true", "1") for x in FLAGS.scan_layers]
    rng = np.random.default_rng(0)
    for batch in [int(b) for b in FLAGS.batches.split(",")]:
        prompts = rng.integers(0, config.vocab_size, size=(batch, FLAGS.prompt_len))
        tokens = batch * FLAGS.new_tokens

        def ours(scan: bool, prompts: np.ndarray = prompts) -> list[list[int]]:
            out = generate(model, prompts.tolist(), FLAGS.new_tokens, scan_layers=scan)
            assert all(len(o) == FLAGS.new_tokens for o in out)
            return out

        fns: dict[str, Callable[[], Any]] = {f"ours {s}": functools.partial(ours, s) for s in scans}
        if tunix_run is not None:
            fns["tunix"] = functools.partial(tunix_run, prompts)
        times = alternate_best(fns, FLAGS.repeats)
        t_limit = matmul_limit_seconds(config, batch, FLAGS.new_tokens, FLAGS.repeats)
        context = FLAGS.prompt_len + FLAGS.new_tokens / 2  # the decode's mean length
        t_attn_limit = matmul_limit_seconds(config, batch, FLAGS.new_tokens, FLAGS.repeats, round(context))
        t_hf, hf_note = (hf_seconds(config, prompts, FLAGS.new_tokens, FLAGS.repeats) if FLAGS.transformers
                         else (None, "--transformers=false"))
        roofline = 0.0
        if bandwidth:  # the live cache at the decode's mean length
            roofline = batch * bandwidth / decode_step_bytes(config, param_bytes, batch, context)
        for scan in scans:
            t_first, t_ours, ours_out = times[f"ours {scan}"]
            line = (
                f"batch {batch:3d}{' scanned' if scan else ''}: first call {t_first:6.2f} s "
                f"(compile {max(t_first - t_ours, 0.0):6.2f} s) | "
                f"generate {tokens / t_ours:9.1f} tok/s | "
                f"matmul limit {tokens / t_limit:9.1f} tok/s "
                f"(ours = {t_limit / t_ours:.2f} of limit) | with attention over the cache "
                f"{tokens / t_attn_limit:9.1f} tok/s (ours = {t_attn_limit / t_ours:.2f})"
            )
            if roofline:
                share = tokens / t_ours / roofline
                line += f" | roofline {roofline:9.1f} tok/s (ours = {share:.2f} of roofline)"
            if t_hf is None:
                line += f" | transformers: not measured ({hf_note})"
            else:
                line += f" | transformers {tokens / t_hf:9.1f} tok/s (ours = {t_hf / t_ours:.2f}x; {hf_note})"
            if tunix_run is not None:
                tunix_first, t_tunix, tunix_out = times["tunix"]
                same = sum(a == b for a, b in zip(ours_out, tunix_out, strict=True))
                line += (
                    f" | Tunix {tokens / t_tunix:9.1f} tok/s (ours = {t_tunix / t_ours:.2f}x; "
                    f"first call {tunix_first:.2f} s; greedy tokens equal in {same}/{batch} rows)"
                )
            if len(scans) > 1 and scan:
                same = sum(a == b for a, b in zip(ours_out, times["ours False"][2], strict=True))
                line += f" | tokens equal to the loop's in {same}/{batch} rows"
            if len(scans) > 1:
                decode_s, prefill_s = program_compile_seconds(model, batch, scan)
                line += f" | programs compile: decode {decode_s:.2f} s, prefill {prefill_s:.2f} s"
            lines.append(line)
            logging.info(line)
    lines.append(f"load average after {load_average()}")
    print("\n".join(lines))  # noqa: T201 - a CLI report


if __name__ == "__main__":
    app.run(main)
