"""The speculative tree-attention kernel (pallas_kernels/tree_attention.py): against its jnp reference and a
NumPy re-derivation (interpret mode on the CPU), compiled on a GPU, and its CUDA lowering without one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_attention import tree_attention, tree_attention_reference
from tests.helpers import abstract_gpu_mesh


def numpy_tree_attention(q, k, v, prefix, mask, scale, window=None):
    """Loops written from the definition: query i of row b sees prefix keys and its tree keys."""
    q, k, v, mask = (np.asarray(x, np.float64) for x in (q, k, v, mask))
    b, n, h, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    out = np.zeros((b, n, h, d))
    for r in range(b):
        p = int(prefix[r])
        for i in range(n):
            keys = [j for j in range(p) if window is None or j >= p - window]
            keys += [p + j for j in range(mask.shape[2]) if mask[r, i, j] and p + j < s]
            for hh in range(h):
                g = hh // (h // kvh)
                sc = np.array([q[r, i, hh] @ k[r, g, j] * scale for j in keys])
                w = np.exp(sc - sc.max())
                w /= w.sum()
                out[r, i, hh] = w @ v[r, g, keys]
    return out


@pytest.mark.parametrize("splits", [3, 2, None])
@pytest.mark.parametrize("n,m,window", [(7, 7, None), (20, 20, None), (5, 33, 6), (64, 64, None)])
def test_tree_attention_kernel_matches_reference_and_numpy(n, m, window, splits):
    """Prefix splits + the tree split merged by the Pallas merge (3 + 1, and the default count, a power of
    2) or by XLA's (2 + 1)."""
    rng = np.random.default_rng(n + m)
    b, h, kvh, d, s = 2, 4, 2, 16, 112
    q = jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, b, kvh, s, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, b, kvh, s, d)), jnp.float32)
    prefix = jnp.asarray([s - m + 3, 3], jnp.int32)  # row 0: the last tree keys fall past the buffer
    mask = jnp.asarray(rng.random((b, n, m)) < 0.4) | jnp.eye(n, m, dtype=bool)[None]
    want = numpy_tree_attention(q, k[1], v[1], np.asarray(prefix), mask, 0.25, window)
    ref = tree_attention_reference(q, k, v, prefix, mask, scale=0.25, layer=1, window=window)
    out = tree_attention(q, k, v, prefix, mask, scale=0.25, layer=1, window=window, num_splits=splits)
    np.testing.assert_allclose(np.asarray(ref), want, atol=2e-5)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [16, 32, 64])
def test_tree_attention_kernel_on_gpu_matches_reference(n):
    """MiniCPM4-8B attention dims, bf16, a 2K prefix: the Triton kernel against the jnp reference."""
    rng = np.random.default_rng(n)
    b, h, kvh, d, s = 1, 32, 2, 128, 4096
    q = jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, b, kvh, s, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, b, kvh, s, d)), jnp.bfloat16)
    prefix = jnp.asarray([2000], jnp.int32)
    _, mask = np.zeros(n), np.tril(rng.random((n, n)) < 0.3) | np.eye(n, dtype=bool)
    mask = jnp.asarray(mask[None])
    ref = tree_attention_reference(q, k, v, prefix, mask, scale=d**-0.5, layer=1)
    out = tree_attention(q, k, v, prefix, mask, scale=d**-0.5, layer=1)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2)


@pytest.mark.parametrize("n,m,window", [(32, 32, None), (10, 40, 1024)], ids=["verify32", "draft-step-window"])
def test_tree_kernel_lowers_for_cuda_without_a_gpu(n, m, window):
    """Triton lowering of the tree kernel (MiniCPM4-8B dims) under an abstract H100."""
    mesh = abstract_gpu_mesh()
    spec = jax.ShapeDtypeStruct
    args = (spec((1, n, 32, 128), jnp.bfloat16), spec((4, 1, 2, 2048, 128), jnp.bfloat16),
            spec((4, 1, 2, 2048, 128), jnp.bfloat16), spec((1,), jnp.int32), spec((1, n, m), jnp.bool_))
    fn = functools.partial(tree_attention, scale=0.1, layer=3, window=window, interpret=False)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "minicpm_tree_attention" in text
