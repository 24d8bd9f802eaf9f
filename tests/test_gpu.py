"""GPU checks (run on the device with ``pytest -m gpu``): the GPU model against the same model on the CPU."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from minicpm_jax.cache import KVCache
from minicpm_jax.engine import Engine
from minicpm_jax.weights import load_model
from tests import helpers

pytestmark = pytest.mark.gpu


def _cpu():
    return jax.devices("cpu")[0]


def _logits(path, ids, dtype, device):
    with jax.default_device(device):
        model = load_model(path, dtype=dtype, max_length=128)
        cache = KVCache.create(model.config, 1, 128, dtype)
        logits, _, _ = jax.jit(lambda m, c, x: m(x, c))(model, cache, jnp.asarray([ids], jnp.int32))
        return np.asarray(logits[0])


def test_gpu_bf16_and_fp32_match_cpu_fp32(tiny_ckpt):
    path = tiny_ckpt[0]
    ids = np.random.default_rng(0).integers(0, 97, 57)
    ref = _logits(path, ids, jnp.float32, _cpu())
    gpu = jax.devices("gpu")[0]
    assert helpers.rel_err(_logits(path, ids, jnp.float32, gpu), ref) < 1e-5
    assert helpers.rel_err(_logits(path, ids, jnp.bfloat16, gpu), ref) < 3e-2


def test_gpu_greedy_generation_matches_cpu(tiny_ckpt):
    prompts = [list(np.random.default_rng(i).integers(0, 97, n)) for i, n in enumerate((9, 33, 20))]
    out = {}
    for name, device in (("cpu", _cpu()), ("gpu", jax.devices("gpu")[0])):
        with jax.default_device(device):
            engine = Engine(load_model(tiny_ckpt[0], dtype=jnp.float32, max_length=128), batch_size=3, chunk_length=16)
            out[name] = [r.token_ids for r in engine.generate(prompts, max_new_tokens=24)[0]]
    assert out["gpu"] == out["cpu"]
