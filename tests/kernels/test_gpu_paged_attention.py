"""GPU checks of the paged-KV kernels (run on the device with ``pytest -m gpu``): compiled at the MiniCPM4-8B
attention shape (32 q heads, 2 KV heads, head_dim 128, bf16, page 64) at long contexts against the jnp
references, the paged writer against the reference scatter, and a pool past 2**31 elements (int32 offsets
would wrap)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import triton, xla
from tests import helpers

pytestmark = pytest.mark.gpu

PAGE = 64


def _pool(key, layers, num_pages):
    return jax.random.normal(key, (layers, 2, num_pages * PAGE, 128), jnp.bfloat16)


def _tables(rng, capacity_pages, rows, num_pages):
    """Each row's pages a random draw from the pool; row 1 shares row 0's first half (a common prefix)."""
    perm = rng.permutation(num_pages)[: rows * capacity_pages].reshape(rows, capacity_pages)
    if rows > 1:
        perm[1, : capacity_pages // 2] = perm[0, : capacity_pages // 2]
    return jnp.asarray(perm, jnp.int32)


def _attention_check(t, offsets, valid, capacity, seed):
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    b, p = len(offsets), capacity // PAGE
    num_pages = b * p + 7
    k, v = _pool(keys[0], 2, num_pages), _pool(keys[1], 2, num_pages)
    q = jax.random.normal(keys[2], (b, t, 32, 128), jnp.bfloat16)
    table = _tables(rng, p, b, num_pages)
    offsets = jnp.asarray(offsets, jnp.int32)
    positions = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    lengths = offsets + jnp.asarray(valid, jnp.int32)
    kw = dict(scale=128**-0.5, page_size=PAGE, layer=1)
    out = jax.jit(functools.partial(triton.paged_attention, **kw))(q, k, v, table, positions, lengths)
    f32 = lambda x: x.astype(jnp.float32)
    ref = jax.jit(functools.partial(xla.paged_attention, **kw))(f32(q), f32(k), f32(v), table, positions, lengths)
    assert helpers.rel_err(np.asarray(out, np.float32), np.asarray(ref)) < 1e-2


def test_gpu_paged_decode_at_32k_and_tree_queries():
    _attention_check(1, [32767, 12], [1, 1], 32768, 1)
    _attention_check(16, [30000, 4000], [16, 11], 32768, 2)


def test_gpu_paged_prefill_at_8k():
    _attention_check(2048, [6144, 1000], [2048, 1500], 8192, 0)


@pytest.mark.parametrize("n,window", [(16, None), (32, 1024), (64, None)])
def test_gpu_paged_tree_attention_matches_reference(n, window):
    """A 2K prefix through the page table, the tree keys in a scratch region at the pool's end."""
    rng = np.random.default_rng(n)
    keys = jax.random.split(jax.random.PRNGKey(n), 3)
    p, num_pages = 40, 48
    k, v = _pool(keys[0], 2, num_pages), _pool(keys[1], 2, num_pages)
    q = jax.random.normal(keys[2], (1, n, 32, 128), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(num_pages - 1)[None, :p], jnp.int32)
    mask = jnp.asarray((np.tril(rng.random((n, n)) < 0.3) | np.eye(n, dtype=bool))[None])
    args = (q, k, v, table, jnp.asarray([2000], jnp.int32), mask, jnp.asarray([(num_pages - 1) * PAGE], jnp.int32))
    kw = dict(scale=128**-0.5, page_size=PAGE, layer=1, window=window)
    out = jax.jit(functools.partial(triton.paged_tree_attention, **kw))(*args)
    ref = jax.jit(functools.partial(xla.paged_tree_attention, **kw))(*args)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2)


def test_gpu_paged_cache_write_matches_scatter():
    """Decode (1 token), a few tokens, a 16-node tree; distinct slots, some out of range (dropped)."""
    rng = np.random.default_rng(0)
    n = 1000 * PAGE
    for t in (1, 5, 16):
        kp, vp = (jnp.asarray(rng.standard_normal((4, 2, n, 128)), jnp.bfloat16) for _ in range(2))
        kn, vn = (jnp.asarray(rng.standard_normal((3, t, 2, 128)), jnp.float32) for _ in range(2))
        slots = rng.permutation(n)[: 3 * t].reshape(3, t).astype(np.int32)
        slots[-1, 0] = n
        if t > 1:
            slots[0, -1] = -1
        ref = xla.paged_cache_write(kp, vp, kn, vn, jnp.asarray(slots), layer=2)
        out = jax.jit(functools.partial(triton.paged_cache_write, layer=2))(kp, vp, kn, vn, jnp.asarray(slots))
        for o, r in zip(out, ref):
            np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(r, np.float32))


def test_gpu_paged_kernels_on_a_pool_past_int32_offsets():
    """A [32, 2, 400000, 128] bf16 pool (3.3e9 elements): the last layer's second KV head read from pages
    at the pool's end, whose element offsets are past 2**31, by decode, prefill and tree kernels and
    written by the paged writer."""
    shape, layer, p = (32, 2, 400000, 128), 31, 32
    num_pages = shape[2] // PAGE
    rng = np.random.default_rng(3)
    table = jnp.asarray(num_pages - 1 - rng.permutation(p + 8)[None, :p], jnp.int32)  # the last 40 pages
    slots = (table[0, :, None] * PAGE + jnp.arange(PAGE)[None]).reshape(-1)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    fill = lambda key: jnp.zeros(shape, jnp.bfloat16).at[layer, :, slots].set(
        jax.random.normal(key, (len(slots), 2, 128), jnp.bfloat16))
    k, v = fill(keys[0]), fill(keys[1])
    kw = dict(scale=128**-0.5, page_size=PAGE, layer=layer)
    for t in (1, 64):
        q = jax.random.normal(keys[2], (1, t, 32, 128), jnp.bfloat16)
        pos = jnp.arange(2000 - t, 2000, dtype=jnp.int32)[None]
        args = (q, k, v, table, pos, jnp.asarray([2000], jnp.int32))
        out = jax.jit(functools.partial(triton.paged_attention, **kw))(*args)
        ref = jax.jit(functools.partial(xla.paged_attention, **kw))(*args)
        assert helpers.rel_err(np.asarray(out, np.float32), np.asarray(ref, np.float32)) < 1e-2
    mask = jnp.ones((1, 8, 8), bool)
    tree_args = (jax.random.normal(keys[3], (1, 8, 32, 128), jnp.bfloat16), k, v, table, jnp.asarray([1900], jnp.int32),
                 mask, jnp.asarray([(num_pages - 1) * PAGE], jnp.int32))
    out = jax.jit(functools.partial(triton.paged_tree_attention, **kw))(*tree_args)
    ref = jax.jit(functools.partial(xla.paged_tree_attention, **kw))(*tree_args)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2)
    new = jnp.ones((1, 2, 2, 128), jnp.float32)
    at = jnp.asarray([[shape[2] - 1, shape[2] - PAGE]], jnp.int32)
    k2, _ = jax.jit(functools.partial(triton.paged_cache_write, layer=layer), donate_argnums=(0, 1))(k, v, new, new, at)
    np.testing.assert_array_equal(np.asarray(k2[layer, :, at[0]], np.float32), 1.0)
