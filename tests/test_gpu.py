"""GPU checks (run on the device with ``pytest -m gpu``): the GPU model (Pallas attention and int4
dequant-GEMM, the defaults there) against the same model on the CPU (the references), and the kernels at
MiniCPM4-8B attention shapes and long contexts against the reference on the GPU."""

import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from minicpm_jax.engine import Engine
from minicpm_jax.weights import load_model
from pallas_kernels.attention import attention_reference, decode_attention, prefill_attention
from pallas_kernels.cache_write import cache_write, cache_write_reference
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
    CPU: a 57-row forward (the tensor-core path) and greedy decoding (the GEMV path)."""
    path = tiny_ckpt[0]
    ids = np.random.default_rng(1).integers(0, 97, 57)
    kw = dict(quant="int4", group_size=32)
    ref = _logits(path, ids, jnp.float32, _cpu(), **kw)
    gpu = jax.devices("gpu")[0]
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


def _long_context_check(kernel, t, offsets, valid, s, seed):
    """MiniCPM4-8B attention shape (32 q heads, 2 kv heads, head_dim 128), bf16, stacked 2-layer cache."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (len(offsets), t, 32, 128), jnp.bfloat16)
    k = jax.random.normal(keys[1], (2, len(offsets), 2, s, 128), jnp.bfloat16)
    v = jax.random.normal(keys[2], (2, len(offsets), 2, s, 128), jnp.bfloat16)
    offsets = jnp.asarray(offsets, jnp.int32)
    positions = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    lengths = offsets + jnp.asarray(valid, jnp.int32)
    out = jax.jit(functools.partial(kernel, scale=128**-0.5, layer=1))(q, k, v, positions, lengths)
    f32 = lambda x: x.astype(jnp.float32)
    ref = jax.jit(functools.partial(attention_reference, scale=128**-0.5, layer=1))(f32(q), f32(k), f32(v), positions, lengths)
    assert helpers.rel_err(np.asarray(out, np.float32), np.asarray(ref)) < 1e-2


def test_gpu_prefill_kernel_at_8k():
    _long_context_check(prefill_attention, 2048, [6144, 1000], [2048, 1500], 8192, 0)


def test_gpu_decode_kernel_at_32k_and_tree_queries():
    _long_context_check(decode_attention, 1, [32767, 12], [1, 1], 32768, 1)
    _long_context_check(decode_attention, 16, [30000, 4000], [16, 11], 32768, 2)


def test_gpu_cache_write_kernel_matches_scatter():
    """The Pallas cache writer on the GPU (MiniCPM4-8B's 2 KV heads × 128, a 3-row batch) against the
    reference scatters: decode (1 token), a few tokens, a 16-node tree; distinct slots per row (one write
    per slot, as in decoding), some out of range (dropped)."""
    for t in (1, 5, 16):
        kc, vc, kn, vn, slots = (jnp.asarray(a) for a in helpers.cache_write_inputs(t, 4, 3, 2, 1000, 128, t))
        kc, vc = kc.astype(jnp.bfloat16), vc.astype(jnp.bfloat16)
        out = jax.jit(functools.partial(cache_write, layer=2))(kc, vc, kn, vn, slots)
        ref = cache_write_reference(kc, vc, kn, vn, slots, layer=2)
        for o, r in zip(out, ref):
            np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(r, np.float32))
