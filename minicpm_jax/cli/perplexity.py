"""Perplexity of a model on a text file: ``python -m minicpm_jax.perplexity --model_path DIR --text_file F``.

The text is tokenized (no special tokens), cut into windows of ``--context`` tokens (the last one
shorter), and each window runs through the model from an empty cache in chunks of ``--chunk_length``.
Every token after the first of its window is scored: ``ppl = exp(mean NLL)``. The usual check of a
quantized checkpoint against its source (llama.cpp's ``llama-perplexity`` reports the same quantity).
Accepts the model flags of ``minicpm_jax.run`` (``--dtype``, ``--quant``, ``--attention_impl`` ...).
"""

from __future__ import annotations

import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from minicpm_jax.model.cache import KVCache
from minicpm_jax.model.parallel import REPLICATED, spmd
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.cli.flags import apply_system_flags, fail, load_from_flags, validate_model_flags, weights_description


def _chunk_nll(graphdef, state, cache: KVCache, tokens, targets, num_valid):
    """Summed NLL of ``targets [1, T]`` (−1 = not scored) after ``tokens [1, T]``, and the cache."""
    model = nnx.merge(graphdef, state)
    logits, _, cache = model(tokens, cache, num_valid)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(targets >= 0, picked, 0.0)), cache


_chunk_nll_jit = jax.jit(_chunk_nll)  # one device: the graphdef (a static pytree) keys the compiled program


def negative_log_likelihood(model, ids: list[int] | np.ndarray, *, context: int, chunk_length: int = 512) -> tuple[float, int]:
    """(summed NLL in nats, scored tokens) of ``ids`` in independent windows of ``context`` tokens."""
    ids = np.asarray(ids, np.int32)
    if context < 2 or context > model.max_length:
        raise MiniCPMError(f"context must be in [2, max_length={model.max_length}], got {context}")
    if len(ids) < 2:
        raise MiniCPMError("the text has fewer than 2 tokens")
    graphdef, state = nnx.split(model)
    chunk_nll = functools.partial(_chunk_nll_jit, graphdef)
    if model.mesh is not None:  # split over a mesh: each chunk one SPMD program
        r, c = REPLICATED, model.cache_specs()
        chunk_nll = jax.jit(spmd(model.mesh, functools.partial(_chunk_nll, graphdef), (model.param_specs(state), c, r, r, r),
                                 (r, c)))
    chunk = min(chunk_length, context)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, context):
        window = ids[start : start + context]
        if len(window) < 2:
            break
        cache = model.new_cache(1)
        for c0 in range(0, len(window), chunk):
            part = window[c0 : c0 + chunk]
            nxt = window[c0 + 1 : c0 + chunk + 1]
            tokens = np.zeros((1, chunk), np.int32)
            targets = np.full((1, chunk), -1, np.int32)
            tokens[0, : len(part)] = part
            targets[0, : len(nxt)] = nxt
            nll, cache = chunk_nll(state, cache, jnp.asarray(tokens), jnp.asarray(targets),
                                    jnp.asarray([len(part)], jnp.int32))
            total += float(nll)
            count += len(nxt)
    return total, count


def perplexity(model, ids, *, context: int, chunk_length: int = 512) -> float:
    """``exp(mean NLL)`` of ``ids`` (see :func:`negative_log_likelihood`)."""
    total, count = negative_log_likelihood(model, ids, context=context, chunk_length=chunk_length)
    return math.exp(total / count)


FLAGS = flags.FLAGS
flags.DEFINE_string("text_file", None, "UTF-8 text to score.")
flags.DEFINE_integer("context", 0, "Tokens per scored window; 0 = --max_length.")


def main(argv):
    del argv
    try:
        validate_model_flags()
        if not FLAGS.text_file:
            raise MiniCPMError("--text_file is required")
        try:
            with open(FLAGS.text_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise MiniCPMError(f"cannot read --text_file {FLAGS.text_file}: {e}") from None
        apply_system_flags()
        _, model, tokenizer, load_s = load_from_flags()
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        context = FLAGS.context or model.max_length
        total, count = negative_log_likelihood(model, ids, context=context, chunk_length=FLAGS.chunk_length)
    except MiniCPMError as e:
        fail(str(e))
    weights = weights_description(model)
    print(f"perplexity {math.exp(total / count):.4f} over {count} tokens (context {context}, {weights}, "
          f"loaded in {load_s:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
