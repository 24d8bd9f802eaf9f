"""The two-stage top-k equals ``lax.top_k`` bit for bit: values, indices and the order of ties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels.topk import top_k


def _check(x, k, **kw):
    v, i = jax.jit(lambda x: top_k(x, k, **kw))(x)
    rv, ri = lax.top_k(x, k)
    assert v.dtype == rv.dtype and i.dtype == jnp.int32 and v.shape == rv.shape
    np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
    np.testing.assert_array_equal(np.asarray(v.astype(jnp.float32)), np.asarray(rv.astype(jnp.float32)))


@pytest.mark.parametrize("shape,k", [((32768,), 10), ((10, 32768), 10), ((2, 3, 5000), 16), ((1, 73448), 1),
                                     ((4, 1025), 7), ((3, 2048), 64)])
def test_two_stage_top_k_equals_lax_top_k_with_ties(shape, k):
    rng = np.random.default_rng(sum(shape) + k)
    ints = rng.integers(-20, 20, shape).astype(np.int32)  # heavy ties, across chunk borders too
    lowest = rng.integers(0, shape[-1], 50)
    x = ints.astype(np.float32)
    x[..., lowest] = -np.inf
    ints[..., lowest] = np.iinfo(np.int32).min
    _check(jnp.asarray(x), k)
    _check(jnp.asarray(x, jnp.bfloat16), k)
    _check(jnp.asarray(rng.standard_normal(shape), jnp.float32), k)
    _check(jnp.asarray(ints), k)


def test_padding_never_beats_a_real_element():
    """Rows mostly -inf: the k best include real -inf entries, which must win over the padding."""
    x = np.full((2, 3000), -np.inf, np.float32)
    x[0, [5, 2999]] = 1.0
    for k in (3, 20):
        _check(jnp.asarray(x), k, chunk=128)
        v, i = top_k(jnp.asarray(x), k, chunk=128)
        assert np.all(np.asarray(i) < 3000)


def test_small_chunks_and_bad_k():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 999)), jnp.float32)
    _check(x, 4, chunk=16)  # 63 chunks, the last one padded
    _check(x, 8, chunk=16)  # k > chunk // 4: plain lax.top_k
    with pytest.raises(ValueError, match="0 < k <= 999"):
        top_k(x, 1000)
