"""``pallas_kernels.matmul``: the dense linear that stays a matrix product on GPUs at batch 1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import matmul as matmul_mod
from pallas_kernels.matmul import STRENGTH_REDUCED_BELOW, keeps_one_row, matmul


@pytest.fixture
def on_gpu(monkeypatch):
    """The GPU decision, taken here (the rewrite it avoids exists only in XLA's GPU compiler)."""
    monkeypatch.setattr(matmul_mod.jax, "default_backend", lambda: "gpu")


def test_one_row_under_the_limit_is_a_two_row_product_with_the_same_result(on_gpu):
    """A single row against a small weight is computed as two rows (the StableHLO dot's left operand is
    2 x K) and gives NumPy's product; a batch of rows or a large weight stays one plain dot."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    x = rng.standard_normal((1, 1, 64)).astype(np.float32)
    y = matmul(jnp.asarray(x), jnp.asarray(w), preferred_element_type=jnp.float32)
    assert y.shape == (1, 1, 48)
    np.testing.assert_allclose(np.asarray(y), x @ w, rtol=1e-5, atol=1e-5)
    text = jax.jit(lambda a, b: matmul(a, b)).lower(jnp.asarray(x), jnp.asarray(w)).as_text()
    assert "tensor<2x64xf32>" in text and "tensor<1x64xf32>, tensor<64x48xf32>" not in text
    xb = rng.standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(matmul(jnp.asarray(xb), jnp.asarray(w))), xb @ w, rtol=1e-5, atol=1e-5)
    assert "tensor<2x64xf32>" not in jax.jit(lambda a, b: matmul(a, b)).lower(jnp.asarray(xb), jnp.asarray(w)).as_text()


def test_the_limit_is_xlas(on_gpu):
    """Only one-row dots under 10M operand elements are changed, and only on a GPU."""
    assert keeps_one_row(1, 4096, 2304)  # an 8B model's q/k/v per device at tensor parallelism 2
    assert not keeps_one_row(1, 4096, 4608)  # the same on one device: 18.9M elements
    assert not keeps_one_row(2, 4096, 2304)
    assert keeps_one_row(1, 1000, STRENGTH_REDUCED_BELOW // 1000 - 2)
    assert not keeps_one_row(1, 1000, STRENGTH_REDUCED_BELOW // 1000)


def test_cpu_runs_the_plain_dot():
    assert not keeps_one_row(1, 64, 48)  # no GPU here
