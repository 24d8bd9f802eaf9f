"""The fused RoPE + cache write (``pallas_kernels.rope_write``): the kernel (interpret mode; ``-m gpu`` on the
device) and its reference against a NumPy re-derivation (the rotation as a complex product, the write as a
scatter), for the stacked cache and the paged pool, dropped slots, the prefill fallback, bad shapes, and the
Triton lowering."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cache_write import MAX_KERNEL_TOKENS
from pallas_kernels.rope_write import (paged_rope_write, paged_rope_write_reference, rope_write,
                                       rope_write_reference)

HQ, KVH, D, LAYERS, S, LAYER = 4, 2, 16, 3, 12, 1


def _inputs(seed: int, b: int, t: int, qkv_dtype=jnp.bfloat16, d: int = D, hq: int = HQ, kvh: int = KVH):
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.standard_normal((b, t, hq + 2 * kvh, d)), qkv_dtype)
    angles = rng.uniform(0, 50, (b, t, d // 2))
    scale = 1.3  # an attention scaling (LongRoPE / YaRN) rides on the tables
    return qkv, jnp.asarray(np.cos(angles) * scale, jnp.float32), jnp.asarray(np.sin(angles) * scale, jnp.float32)


def _numpy_rotation(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE as a complex product: (x1 + i·x2)·(cos + i·sin), halves back in place."""
    half = x.shape[-1] // 2
    z = (x[..., :half] + 1j * x[..., half:]) * (cos + 1j * sin)[:, :, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


def _check_q(q, qkv, cos, sin):
    want = _numpy_rotation(np.asarray(qkv[:, :, :HQ], np.float64), np.asarray(cos), np.asarray(sin))
    np.testing.assert_allclose(np.asarray(q, np.float32), want, rtol=1e-2, atol=2e-2)  # bf16 output


@pytest.mark.parametrize("t,cache_dtype", [(1, jnp.bfloat16), (3, jnp.bfloat16), (3, jnp.float32)])
def test_kernel_equals_reference_and_a_numpy_rotation_and_scatter(t, cache_dtype):
    """bf16 heads into a bf16 cache, and into a float32 one (keys rounded to bf16 first, as the reference's)."""
    b = 2
    qkv, cos, sin = _inputs(t, b, t)
    keys = jax.random.split(jax.random.PRNGKey(t), 2)
    k_cache = jax.random.normal(keys[0], (LAYERS, b, KVH, S, D), cache_dtype)
    v_cache = jax.random.normal(keys[1], (LAYERS, b, KVH, S, D), cache_dtype)
    # row 0 writes its tokens at 5.., row 1's last token is dropped (past the cache) and t > 1 drops a -1
    slots = np.stack([5 + np.arange(t), np.where(np.arange(t) == t - 1, S, 2 + np.arange(t))]).astype(np.int32)
    if t > 1:
        slots[0, 1] = -1
    run = lambda f: jax.jit(functools.partial(f, layer=LAYER, q_heads=HQ))(  # noqa: E731
        k_cache, v_cache, qkv, cos, sin, jnp.asarray(slots))
    q, k, v = run(functools.partial(rope_write, interpret=True))
    q_ref, k_ref, v_ref = run(rope_write_reference)
    for got, want in ((q, q_ref), (k, k_ref), (v, v_ref)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    _check_q(q, qkv, cos, sin)
    # the cache: a NumPy scatter of the rotated keys and the values, nothing else touched
    k_new = _numpy_rotation(np.asarray(qkv[:, :, HQ : HQ + KVH], np.float64), np.asarray(cos), np.asarray(sin))
    k_want, v_want = np.asarray(k_cache, np.float32).copy(), np.asarray(v_cache, np.float32).copy()
    for row in range(b):
        for tok in range(t):
            s = slots[row, tok]
            if 0 <= s < S:
                k_want[LAYER, row, :, s] = k_new[row, tok]
                v_want[LAYER, row, :, s] = np.asarray(qkv[row, tok, HQ + KVH :], np.float32)
    np.testing.assert_allclose(np.asarray(k, np.float32), k_want, rtol=1e-2, atol=2e-2)
    np.testing.assert_array_equal(np.asarray(v, np.float32), v_want)


def test_paged_kernel_equals_reference_and_a_numpy_scatter():
    b, t, n = 2, 2, 24
    qkv, cos, sin = _inputs(7, b, t)
    pool = jax.random.normal(jax.random.PRNGKey(7), (2, LAYERS, KVH, n, D), jnp.bfloat16)
    slots = np.array([[17, 3], [n, 9]], np.int32)  # row 1's first token is dropped (past the pool)
    run = lambda f: jax.jit(functools.partial(f, layer=LAYER, q_heads=HQ))(  # noqa: E731
        pool[0], pool[1], qkv, cos, sin, jnp.asarray(slots))
    q, k, v = run(functools.partial(paged_rope_write, interpret=True))
    for got, want in zip((q, k, v), run(paged_rope_write_reference)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    _check_q(q, qkv, cos, sin)
    k_new = _numpy_rotation(np.asarray(qkv[:, :, HQ : HQ + KVH], np.float64), np.asarray(cos), np.asarray(sin))
    k_want, v_want = np.asarray(pool[0], np.float32).copy(), np.asarray(pool[1], np.float32).copy()
    for row, tok in ((0, 0), (0, 1), (1, 1)):
        k_want[LAYER, :, slots[row, tok]] = k_new[row, tok]
        v_want[LAYER, :, slots[row, tok]] = np.asarray(qkv[row, tok, HQ + KVH :], np.float32)
    np.testing.assert_allclose(np.asarray(k, np.float32), k_want, rtol=1e-2, atol=2e-2)
    np.testing.assert_array_equal(np.asarray(v, np.float32), v_want)


@pytest.mark.parametrize("splits,paged", [(4, False), (3, False), (2, True)], ids=["4-parts", "3-parts", "paged"])
def test_kernel_adds_the_projections_parts_as_it_reads_them(splits, paged):
    """A SplitSum of fp32 K-split parts (with a padding row, as a duplicated one-row GEMM leaves): summed and
    rounded to ``dtype`` before the rotation, in the kernel (a power-of-2 count) or before it (3 parts), equal
    to the reference and to the heads themselves handed in already summed."""
    from pallas_kernels.matmul import SplitSum

    b, t = 2, 1
    rng = np.random.default_rng(splits)
    n = (HQ + 2 * KVH) * D
    parts = jnp.asarray(rng.standard_normal((splits, b * t + 1, n)), jnp.float32)
    qkv = SplitSum(parts, (b, t, n))
    heads = qkv.total().astype(jnp.bfloat16).reshape(b, t, HQ + 2 * KVH, D)
    _, cos, sin = _inputs(1, b, t)
    if paged:
        kernel, reference = paged_rope_write, paged_rope_write_reference
        k_cache = jax.random.normal(jax.random.PRNGKey(2), (LAYERS, KVH, 20, D), jnp.bfloat16)
        slots = jnp.asarray([[13], [4]], jnp.int32)
    else:
        kernel, reference = rope_write, rope_write_reference
        k_cache = jax.random.normal(jax.random.PRNGKey(2), (LAYERS, b, KVH, S, D), jnp.bfloat16)
        slots = jnp.asarray([[5], [S]], jnp.int32)  # row 1's token dropped
    v_cache = -k_cache
    run = lambda f, x, **kw: jax.jit(functools.partial(f, layer=LAYER, q_heads=HQ, **kw))(  # noqa: E731
        k_cache, v_cache, x, cos, sin, slots)
    got = run(functools.partial(kernel, interpret=True), qkv, dtype=jnp.bfloat16)
    for want in (run(reference, qkv, dtype=jnp.bfloat16), run(reference, heads)):
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    _check_q(got[0], heads, cos, sin)
    for f in (functools.partial(kernel, interpret=True), reference):  # heads keep their dtype, whatever dtype says
        assert run(f, heads, dtype=jnp.float32)[0].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        kernel(k_cache, v_cache, qkv, cos, sin, slots, layer=LAYER, q_heads=HQ)


def test_prefill_chunks_take_the_reference():
    """More than MAX_KERNEL_TOKENS tokens a row: the reference (no kernel in the program)."""
    t = MAX_KERNEL_TOKENS + 1
    qkv, cos, sin = _inputs(3, 1, t, jnp.float32)
    cache = jnp.zeros((LAYERS, 1, KVH, 2 * t, D), jnp.float32)
    slots = jnp.arange(t, dtype=jnp.int32)[None]
    fn = functools.partial(rope_write, layer=0, q_heads=HQ, interpret=True)
    assert "pallas_call" not in str(jax.make_jaxpr(fn)(cache, cache, qkv, cos, sin, slots))
    q, k, _ = jax.jit(fn)(cache, cache, qkv, cos, sin, slots)
    np.testing.assert_allclose(np.asarray(q), _numpy_rotation(np.asarray(qkv[:, :, :HQ], np.float64),
                                                              np.asarray(cos), np.asarray(sin)), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(k[0, 0, :, t:]) == 0) and np.any(np.asarray(k[0, 0, :, :t]) != 0)


def test_bad_shapes_are_refused():
    qkv, cos, sin = _inputs(0, 1, 1)
    cache = jnp.zeros((LAYERS, 1, KVH, S, D), jnp.bfloat16)
    slots = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="query heads"):
        rope_write(cache, cache, qkv, cos, sin, slots, layer=0, q_heads=HQ + 1)
    with pytest.raises(ValueError, match="RoPE tables"):
        rope_write(cache, cache, qkv, cos[..., :-1], sin[..., :-1], slots, layer=0, q_heads=HQ)
    with pytest.raises(ValueError, match="do not fit"):
        rope_write(cache[:, :, :1], cache[:, :, :1], qkv, cos, sin, slots, layer=0, q_heads=HQ)
    with pytest.raises(ValueError, match="paged pool"):
        paged_rope_write(cache, cache, qkv, cos, sin, slots, layer=0, q_heads=HQ)


@pytest.mark.parametrize("paged,parts", [(False, False), (True, False), (False, True)],
                         ids=["stacked", "paged", "stacked-16-parts"])
def test_kernel_lowers_for_cuda_without_a_gpu(paged, parts):
    """MiniCPM4-8B's heads (32 query, 2 KV, head_dim 128) through the Triton lowering, one launch (with the
    projection's 16 parts, as the int4 one-row kernel leaves them at TP 2: still one launch, no sum before)."""
    from pallas_kernels.matmul import SplitSum

    spec = jax.ShapeDtypeStruct
    cache = spec((4, 2, 1000, 128) if paged else (4, 2, 2, 1000, 128), jnp.bfloat16)
    qkv = SplitSum(spec((16, 2, 36 * 128), jnp.float32), (2, 1, 36 * 128)) if parts else spec((2, 1, 36, 128),
                                                                                           jnp.bfloat16)
    args = (cache, cache, qkv, spec((2, 1, 64), jnp.float32), spec((2, 1, 64), jnp.float32), spec((2, 1), jnp.int32))
    fn = functools.partial(paged_rope_write if paged else rope_write, layer=3, q_heads=32, interpret=False,
                           dtype=jnp.bfloat16)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "reduce" not in text.split("__gpu$xla.gpu.triton")[0]  # nothing summed before the kernel
    assert ("minicpm_paged_rope_write" if paged else "minicpm_rope_write") in text


@pytest.mark.gpu
@pytest.mark.parametrize("t,splits", [(1, 0), (12, 0), (1, 16)], ids=["t1", "t12", "t1-16-parts"])
def test_gpu_kernel_matches_the_reference_at_minicpm4_shapes(t, splits):
    """On the GPU the kernel's float32 rotation is not contracted into FMAs, XLA's may be: equal within a
    bf16 rounding step of the outputs (the values bit for bit, but from parts: summed in another order)."""
    from pallas_kernels.matmul import SplitSum

    b = 2
    qkv, cos, sin = _inputs(11, b, t, d=128, hq=32, kvh=2)
    kw = {}
    if splits:
        parts = np.random.default_rng(12).standard_normal((splits, b * t, 36 * 128)) / 4
        qkv, kw = SplitSum(jnp.asarray(parts, jnp.float32), (b, t, 36 * 128)), dict(dtype=jnp.bfloat16)
    keys = jax.random.split(jax.random.PRNGKey(11), 2)
    k_cache = jax.random.normal(keys[0], (4, b, 2, 2048, 128), jnp.bfloat16)
    v_cache = jax.random.normal(keys[1], (4, b, 2, 2048, 128), jnp.bfloat16)
    slots = jnp.asarray(np.stack([1000 + np.arange(t), 7 + np.arange(t)]), jnp.int32)
    run = lambda f: jax.jit(functools.partial(f, layer=2, q_heads=32, **kw))(  # noqa: E731
        k_cache, v_cache, qkv, cos, sin, slots)
    got, want = run(rope_write), run(rope_write_reference)
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=1e-6)
    if not splits:
        np.testing.assert_array_equal(np.asarray(got[2], np.float32), np.asarray(want[2], np.float32))
