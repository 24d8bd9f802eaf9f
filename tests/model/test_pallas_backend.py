"""The model and the engine with the Pallas backend (``attention_impl="pallas"``: interpret mode on the CPU)
against the same weights on the XLA references: logits over chunked prefill and decode steps, greedy
generation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm_jax.config import ModelConfig
from minicpm_jax.engine.engine import Engine
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from tests.helpers import tiny_minicpm_config


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _tiny_models(dtype):
    """(xla model in fp32, pallas model in ``dtype``) with the same ``dtype``-rounded weights.

    The oracle runs in fp32 because XLA:CPU has no bf16 x bf16 -> fp32 batched dot."""
    config = ModelConfig.from_dict(tiny_minicpm_config())
    pallas = MiniCPMForCausalLM(config, max_length=96, attention_impl="pallas", dtype=dtype, rngs=nnx.Rngs(3))
    xla = MiniCPMForCausalLM(config, max_length=96, attention_impl="xla", dtype=jnp.float32)
    nnx.update(xla, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(pallas)))
    return [xla, pallas]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_model_logits_pallas_equal_xla(dtype):
    """Chunked prefill (prefill kernel, 2 rows at different lengths) then decode steps (decode kernel)."""
    models = _tiny_models(dtype)
    assert [m.attention_impl for m in models] == ["xla", "pallas"]
    rng = np.random.default_rng(0)
    chunks = [jnp.asarray(rng.integers(0, models[0].config.vocab_size, (2, 32)), jnp.int32) for _ in range(2)]
    steps = [jnp.asarray(rng.integers(0, models[0].config.vocab_size, (2, 1)), jnp.int32) for _ in range(3)]
    logits = []
    for model in models:
        cache = model.new_cache(2, 96)
        fwd = jax.jit(lambda m, tok, c, n: m(tok, c, n)[::2])
        outs = []
        for i, chunk in enumerate(chunks):
            lg, cache = fwd(model, chunk, cache, jnp.array([32, 32 if i == 0 else 21], jnp.int32))
            outs.append(lg)
        for tok in steps:
            lg, cache = fwd(model, tok, cache, jnp.ones((2,), jnp.int32))
            outs.append(lg)
        logits.append(outs)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for ref, out in zip(*logits):
        assert _rel_err(out, ref) < tol


def test_engine_greedy_generation_pallas_equals_xla():
    models = _tiny_models(jnp.float32)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, models[0].config.vocab_size, n)) for n in (45, 7, 20)]
    outputs = []
    for model in models:
        engine = Engine(model, batch_size=3, chunk_length=32, decode_block=4)
        results, _ = engine.generate(prompts, max_new_tokens=12)
        outputs.append([r.token_ids for r in results])
    assert outputs[0] == outputs[1]
