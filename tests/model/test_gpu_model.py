"""GPU checks (run on the device with ``pytest -m gpu``): the GPU model (Pallas attention and int4
dequant-GEMM, the defaults there) against the same model on the CPU (the references). The kernels at
MiniCPM4-8B shapes: ``tests/kernels/test_gpu_attention_kernels.py``."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from minicpm_jax.engine.engine import Engine
from minicpm_jax.model.loading import load_model
from tests import helpers

pytestmark = pytest.mark.gpu


def _cpu():
    return jax.devices("cpu")[0]


def _impl(device) -> str:
    return "xla" if device.platform == "cpu" else "pallas"


def _logits(path, ids, dtype, device, **load_kw):
    with jax.default_device(device):
        model = load_model(path, dtype=dtype, max_length=128, attention_impl=_impl(device), **load_kw)
        assert model.attention_impl == _impl(device)
        cache = model.new_cache(1, 128)
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
            model = load_model(tiny_ckpt[0], dtype=jnp.float32, max_length=128, attention_impl=_impl(device))
            engine = Engine(model, batch_size=3, chunk_length=16)
            out[name] = [r.token_ids for r in engine.generate(prompts, max_new_tokens=24)[0]]
    assert out["gpu"] == out["cpu"]


def test_gpu_int4_model_matches_cpu_reference(tiny_ckpt):
    """int4 (RTN at load, group 32): the Pallas dequant-GEMM on the GPU against the jnp reference on the
    CPU: a 57-row forward (the tensor-core tile kernel), a 100-row one (more than MAX_KERNEL_ROWS: the
    dequantization kernel and XLA's GEMM) and greedy decoding (the GEMV path)."""
    path = tiny_ckpt[0]
    kw = dict(quant="int4", group_size=32)
    gpu = jax.devices("gpu")[0]
    for rows in (57, 100):
        ids = np.random.default_rng(rows).integers(0, 97, rows)
        ref = _logits(path, ids, jnp.float32, _cpu(), **kw)
        assert helpers.rel_err(_logits(path, ids, jnp.float32, gpu, **kw), ref) < 1e-5
        assert helpers.rel_err(_logits(path, ids, jnp.bfloat16, gpu, **kw), ref) < 3e-2
    prompts = [list(np.random.default_rng(i).integers(0, 97, n)) for i, n in enumerate((9, 20))]
    out = {}
    for name, device in (("cpu", _cpu()), ("gpu", gpu)):
        with jax.default_device(device):
            model = load_model(path, dtype=jnp.float32, max_length=128, attention_impl=_impl(device), **kw)
            out[name] = [r.token_ids for r in Engine(model, batch_size=2, chunk_length=16).generate(
                prompts, max_new_tokens=16)[0]]
    assert out["gpu"] == out["cpu"]


def test_gpu_auto_attention_is_pallas(tiny_ckpt):
    assert load_model(tiny_ckpt[0], dtype=jnp.bfloat16, max_length=128).attention_impl == "pallas"
