"""The whole-model benchmarks' shared parts (`bench.prefill` for Qwen3.5, `bench.moe` for Qwen3.5-MoE): our
prefill and greedy cached decode, jitted and timed; transformers' same model with our weights (`TorchLM`);
and the prefill and decode tables both print."""

from __future__ import annotations

import copy
import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from librarian_jax import models
from librarian_jax.bench.common import best_time, compile_seconds


@jax.jit
def _prefill(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, cache: models.Cache):
    """tokens `[batch, seq]` -> (last-position logits `[batch, vocab]`, max |logit|, filled cache)."""
    logits, cache = nnx.merge(graphdef, state)(tokens, cache=cache)
    return logits[:, -1], jnp.max(jnp.abs(logits)), cache


@functools.partial(jax.jit, static_argnames=("steps",))
def _decode(graphdef: nnx.GraphDef, state: nnx.State, token: jax.Array, cache: models.Cache, steps: int):
    """Greedy decode of `steps` tokens from `token` `[batch, 1]`, on device: -> tokens `[batch, steps]`."""
    model = nnx.merge(graphdef, state)

    def step(carry, _):
        tok, cache = carry
        logits, cache = model(tok, cache=cache)
        nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        return (nxt, cache), nxt[:, 0]

    (_, cache), toks = jax.lax.scan(step, (token, cache), None, length=steps)
    return toks.T, cache


def ours_prefill(
    model: models.Transformer, tokens: np.ndarray, repeats: int
) -> tuple[float, float, np.ndarray]:
    """(compile seconds, best run seconds, last-position logits `[batch, vocab]`) of one cached prefill."""
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(tokens, jnp.int32)
    cache = models.init_cache(model.config, ids.shape[0], ids.shape[1])
    prefill, compile_s = compile_seconds(_prefill, graphdef, state, ids, cache)

    def run():
        last, top, _ = prefill(graphdef, state, ids, cache)
        return np.asarray(jax.block_until_ready(last)), float(top)

    seconds, (last, _) = best_time(run, repeats)
    return compile_s, seconds, last


def ours_decode(
    model: models.Transformer, prompts: np.ndarray, steps: int, repeats: int
) -> tuple[float, float, np.ndarray]:
    """(compile seconds of the decode loop, best run seconds, tokens `[batch, steps]`) of `steps` greedy
    tokens after a prefill of `prompts` `[batch, prompt]` (the prefill is neither compiled nor timed here)."""
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(prompts, jnp.int32)
    cache = models.init_cache(model.config, ids.shape[0], ids.shape[1] + steps)
    last, _, cache = _prefill(graphdef, state, ids, cache)
    first = jnp.argmax(last, axis=-1).astype(jnp.int32)[:, None]
    decode, compile_s = compile_seconds(_decode, graphdef, state, first, cache, steps=steps)

    def run():
        toks, _ = decode(graphdef, state, first, cache)
        return np.asarray(jax.block_until_ready(toks))

    seconds, toks = best_time(run, repeats)
    return compile_s, seconds, toks


class TorchLM:
    """transformers' `hf_class` (a `...ForCausalLM` name) loaded from our `save_hf` export of `model`, so the
    weights are identical, in fp32 on the CPU with `threads` threads; `available = False` when torch or
    transformers does not import."""

    def __init__(self, model: models.Transformer, threads: int, hf_class: str) -> None:
        self.available = False
        try:
            import torch
            import transformers
        except ImportError:
            return
        self.torch = torch
        torch.set_num_threads(threads)
        with tempfile.TemporaryDirectory() as directory:
            models.save_hf(model, directory)
            hf_model = getattr(transformers, hf_class).from_pretrained(directory, dtype=torch.float32)
        self.model = hf_model.eval()
        self.available = True
        self.version = (f"torch {torch.__version__}, transformers {transformers.__version__}, "
                        f"{threads} threads")

    def prefill(self, tokens: np.ndarray, repeats: int) -> tuple[float, np.ndarray]:
        """(best seconds, last-position logits `[batch, vocab]`) of one forward over `tokens` with a cache."""
        torch = self.torch
        ids = torch.as_tensor(tokens, dtype=torch.long)

        def run():
            with torch.inference_mode():
                out = self.model(input_ids=ids, use_cache=True)
            return out.logits[:, -1].float().numpy()

        return best_time(run, repeats)

    def decode(self, prompts: np.ndarray, steps: int, repeats: int) -> tuple[float, np.ndarray]:
        """(best seconds, tokens `[batch, steps]`) of `steps` greedy tokens, a Python loop over
        `model(input_ids=tok, cache=cache)`, after an untimed prefill of `prompts`."""
        torch = self.torch
        ids = torch.as_tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True)
        prefilled = out.cache
        first = out.logits[:, -1].argmax(-1, keepdim=True)

        def run():
            cache, tok, toks = copy.deepcopy(prefilled), first, []
            with torch.inference_mode():
                for _ in range(steps):
                    step = self.model(input_ids=tok, cache=cache, use_cache=True)
                    cache = step.cache
                    tok = step.logits[:, -1].argmax(-1, keepdim=True)
                    toks.append(tok)
            return torch.cat(toks, dim=1).numpy()

        return best_time(run, repeats)


def prefill_rows(model: models.Transformer, hf: TorchLM, seqs: list[int], repeats: int,
                 rng: np.random.Generator) -> list[str]:
    """The prefill table (header and a row a length, batch 1): our compile and run time against transformers',
    and the largest difference of their last-position logits."""
    lines = [f"{'prefill seq':>11} | {'compile s':>9} | {'ours ms':>9} | {'ours tok/s':>10} | {'HF ms':>9} | "
             f"{'HF tok/s':>10} | {'HF/ours':>7} | {'max|dlogit|':>11}"]
    for seq in seqs:
        tokens = rng.integers(0, model.config.vocab_size, size=(1, seq))
        c_ours, t_ours, last_ours = ours_prefill(model, tokens, repeats)
        row = f"{seq:>11} | {c_ours:9.2f} | {t_ours * 1e3:9.1f} | {seq / t_ours:10.0f} | "
        if hf.available:
            t_hf, last_hf = hf.prefill(tokens, repeats)
            diff = float(np.abs(last_ours - last_hf).max())
            row += f"{t_hf * 1e3:9.1f} | {seq / t_hf:10.0f} | {t_hf / t_ours:7.2f} | {diff:11.1e}"
        else:
            row += f"{'-':>9} | {'-':>10} | {'-':>7} | {'-':>11}"
        lines.append(row)
        logging.info(row)
    return lines


def decode_rows(model: models.Transformer, hf: TorchLM, batches: list[int], steps: int, prompt: int,
                repeats: int, rng: np.random.Generator) -> list[str]:
    """The decode table (title, header and a row a batch size): `steps` greedy tokens after a `prompt`-token
    prefill, our compile and tokens/s against transformers', and the share of equal tokens."""
    lines = [f"decode: {steps} greedy steps after a {prompt}-token prefill",
             f"{'batch':>11} | {'compile s':>9} | {'ours tok/s':>10} | {'HF tok/s':>10} | {'ours/HF':>7} | "
             "same tokens"]
    for batch in batches:
        prompts = rng.integers(0, model.config.vocab_size, size=(batch, prompt))
        n = batch * steps
        c_ours, t_ours, toks_ours = ours_decode(model, prompts, steps, repeats)
        row = f"{batch:>11} | {c_ours:9.2f} | {n / t_ours:10.1f} | "
        if hf.available:
            t_hf, toks_hf = hf.decode(prompts, steps, repeats)
            same = float(np.mean(toks_ours == toks_hf))
            row += f"{n / t_hf:10.1f} | {t_hf / t_ours:7.2f} | {same:.0%}"
        else:
            row += f"{'-':>10} | {'-':>7} | -"
        lines.append(row)
        logging.info(row)
    return lines
