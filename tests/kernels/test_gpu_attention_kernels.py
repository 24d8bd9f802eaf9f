"""GPU checks of the attention kernels (run on the device with ``pytest -m gpu``): compiled at MiniCPM4-8B
attention shapes and long contexts against the reference on the GPU, and the cache writer against the
reference scatters. The GPU model against the CPU model: ``tests/model/test_gpu_model.py``."""

import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.attention import attention_reference, decode_attention, prefill_attention
from pallas_kernels.cache_write import cache_write, cache_write_reference
from tests import helpers

pytestmark = pytest.mark.gpu


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
