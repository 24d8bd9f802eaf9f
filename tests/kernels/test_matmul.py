"""``pallas_kernels.matmul``: the dense linear that stays a matrix product on GPUs at batch 1, and the
row-parallel product left as K-split parts (``matmul_parts``) against the one-part reference and NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import matmul as matmul_mod
from pallas_kernels.matmul import (STRENGTH_REDUCED_BELOW, SplitSum, default_splits, keeps_one_row, matmul,
                                   matmul_parts, matmul_parts_reference)
from pallas_kernels.peer_all_reduce import MAX_ROWS


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


@pytest.mark.parametrize("splits", [2, 8])
def test_split_parts_add_up_to_the_product(splits):
    """A row's product as ``splits`` parts ``[S, 2, N]`` (a batched GEMM of two rows: no strength reduction)
    whose sum, padding row dropped, is the one-part reference's and NumPy's product."""
    rng = np.random.default_rng(splits)
    x = rng.standard_normal((1, 1, 64)).astype(np.float32)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    got = matmul_parts(jnp.asarray(x), jnp.asarray(w), splits=splits)
    assert isinstance(got, SplitSum) and got.parts.shape == (splits, 2, 48) and got.shape == (1, 1, 48)
    blocks = x.reshape(splits, 64 // splits) @ w.reshape(splits, 64 // splits, 48)  # [S, S, 48]: the diagonal
    np.testing.assert_allclose(np.asarray(got.parts[:, 0]), blocks[np.arange(splits), np.arange(splits)], rtol=1e-5,
                               atol=1e-5)
    want = matmul_parts_reference(jnp.asarray(x), jnp.asarray(w))
    assert want.parts.shape == (1, 1, 48)
    np.testing.assert_allclose(np.asarray(got.total()), np.asarray(want.total()), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got.total()), x @ w, rtol=1e-5, atol=1e-5)
    text = jax.jit(lambda a, b: matmul_parts(a, b, splits=splits).parts).lower(jnp.asarray(x), jnp.asarray(w)).as_text()
    assert f"tensor<{splits}x2x{64 // splits}xf32>" in text
    xb = rng.standard_normal((3, 64)).astype(np.float32)  # rows need no padding row
    several = matmul_parts(jnp.asarray(xb), jnp.asarray(w), splits=splits)
    assert several.parts.shape == (splits, 3, 48)
    np.testing.assert_allclose(np.asarray(several.total()), xb @ w, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="equal blocks"):
        matmul_parts(jnp.asarray(x), jnp.asarray(w), splits=3)


def test_default_splits_follow_xlas_choice_up_to_the_fused_kernels_rows(on_gpu):
    """K in blocks of >= 512 rows: up to 8 of them for one row, as XLA's autotuner split MiniCPM4-8B's linears at
    tensor parallelism 2; up to 4 for 2 to 32 rows (the fused all-reduce kernel's); more rows, or a K without
    such blocks: one part (the plain GEMM)."""
    assert default_splits(1, 2048) == 4  # o_proj at TP 2
    assert default_splits(1, 4096) == 8 and default_splits(1, 8192) == 8  # down_proj at TP 2
    assert default_splits(16, 2048) == 4 and default_splits(16, 8192) == 4 and default_splits(32, 1024) == 2
    assert default_splits(2, 4096) == 4 and default_splits(16, 512) == 1
    assert default_splits(1, 1000) == 1 and default_splits(33, 8192) == 1 and default_splits(2048, 4096) == 1
    assert default_splits(1, 3 * 512) == 2  # blocks of 768 (4 would leave 384)
    assert matmul_mod.SPLIT_MAX_ROWS == MAX_ROWS


def test_cpu_takes_one_part():
    assert default_splits(1, 8192) == 1
    assert matmul_parts(jnp.ones((1, 64)), jnp.ones((64, 8))).parts.shape == (1, 1, 8)
