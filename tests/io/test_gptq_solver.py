"""checkpoints_convert.gptq_solver against a plain, unblocked NumPy GPTQ written here from the paper."""

from __future__ import annotations

import numpy as np
import pytest

from checkpoints_convert.gptq_solver import HessianAccumulator, QuantizedWeight, gptq_quantize, rtn_quantize
from minicpm_jax.errors import MiniCPMError

MAXQ = 15


# --------------------------------------------------------------------------------------------------
# NumPy reference
# --------------------------------------------------------------------------------------------------


def ref_params(v: np.ndarray, sym: bool) -> tuple[np.ndarray, np.ndarray]:
    """(scale, zero) [N] of the rows v [R, N]."""
    xmin = np.minimum(v.min(axis=0), 0.0)
    xmax = np.maximum(v.max(axis=0), 0.0)
    if sym:
        xmax = np.maximum(np.abs(xmin), xmax)
        xmin = np.where(xmin < 0, -xmax, xmin)
    both_zero = (xmin == 0) & (xmax == 0)
    xmin = np.where(both_zero, -1.0, xmin)
    xmax = np.where(both_zero, 1.0, xmax)
    scale = (xmax - xmin) / MAXQ
    zero = np.full_like(scale, 8.0) if sym else np.round(-xmin / scale)
    return scale, zero


def ref_quant(v, scale, zero):
    return np.clip(np.round(v / scale) + zero, 0, MAXQ)


def ref_gptq(w, h, *, group_size, sym, desc_act=False, static_groups=False, damp=0.01):
    """Unblocked GPTQ in float64: returns (q [K, N], dequantized [K, N]) in the original row order."""
    w = np.array(w, np.float64)
    h = np.array(h, np.float64)
    k = w.shape[0]
    g = k if group_size == -1 else group_size
    for i in range(k):
        if h[i, i] == 0:
            h[i, i] = 1.0
            w[i] = 0.0
    static = [ref_params(w[j:j + g], sym) for j in range(0, k, g)]
    perm = np.argsort(-np.diag(h), kind="stable") if desc_act else np.arange(k)
    w = w[perm]
    h = h[perm][:, perm]
    h += damp * np.mean(np.diag(h)) * np.eye(k)
    hinv = np.linalg.inv(h)
    u = np.linalg.cholesky(hinv).T  # upper: hinv = u^T u
    q = np.zeros_like(w)
    deq = np.zeros_like(w)
    for i in range(k):
        if static_groups or g == k:
            scale, zero = static[perm[i] // g]
        elif i % g == 0:
            scale, zero = ref_params(w[i:i + g], sym)
        q[i] = ref_quant(w[i], scale, zero)
        deq[i] = scale * (q[i] - zero)
        err = (w[i] - deq[i]) / u[i, i]
        w[i + 1:] -= np.outer(u[i, i + 1:], err)
    inv = np.argsort(perm)
    return q[inv], deq[inv]


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def correlated_inputs(rng, n, k):
    """Activations with strongly correlated features and uneven feature scales."""
    z = rng.standard_normal((n, k))
    a = rng.standard_normal((k, k)) / np.sqrt(k) + np.eye(k)
    return (z @ a * rng.uniform(0.2, 3.0, size=k)).astype(np.float32)


def problem(seed=0, k=64, n=48, samples=256, spikes=False):
    rng = np.random.default_rng(seed)
    x = correlated_inputs(rng, samples, k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    if spikes:
        # Symmetric grids put a group's most negative value exactly on a rounding tie (-7.5 steps)
        # when it is quantized before any error feedback reaches it (e.g. it is the group's first
        # processed row): float32 vs float64 then picks code 0 or 1 and the rest of that column's
        # error feedback diverges. Large positive outliers (+7.5 steps clips to 15 either way) keep
        # every group's extreme positive, so the comparison is not decided by such ties.
        w[3::8] += 8.0
    acc = HessianAccumulator(k)
    acc.add(x)
    return w, acc.hessian, x


# --------------------------------------------------------------------------------------------------
# GPTQ vs the reference
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "group_size,sym,desc_act,static_groups",
    [
        (32, True, False, False),
        (32, False, False, False),
        (-1, True, False, False),
        (-1, False, True, False),
        (32, True, True, False),
        (32, False, True, False),
        (16, True, True, True),
        (32, False, True, True),
    ],
)
def test_gptq_matches_reference(group_size, sym, desc_act, static_groups):
    w, h, _ = problem(seed=group_size + 2 * sym + 4 * desc_act + 8 * static_groups, spikes=True)
    w[5] = 0.0
    h[7, :] = 0.0  # a dead input
    h[:, 7] = 0.0
    opts = dict(group_size=group_size, sym=sym, desc_act=desc_act, static_groups=static_groups)
    got = gptq_quantize(w, h, block_size=16, **opts)
    q_ref, deq_ref = ref_gptq(w, h, **opts)

    assert got.q.dtype == np.uint8 and got.q.shape == w.shape
    assert got.scale.dtype == np.float32 and got.zero.dtype == np.uint8 and got.g_idx.dtype == np.int32
    ng = 1 if group_size == -1 else w.shape[0] // group_size
    assert got.scale.shape == got.zero.shape == (ng, w.shape[1])
    assert np.mean(got.q == q_ref) >= 0.995
    deq = got.dequantize()
    assert np.mean(np.isclose(deq, deq_ref, rtol=1e-4, atol=1e-5)) >= 0.995
    assert np.all(deq[7] == 0.0)  # the dead input's weights are zero, whatever the grid
    if sym:
        assert np.all(got.zero == 8)


@pytest.mark.parametrize("group_size,static_groups", [(32, False), (32, True), (-1, False)])
def test_block_size_does_not_change_the_result(group_size, static_groups):
    w, h, _ = problem(seed=3, k=96, spikes=True)
    opts = dict(group_size=group_size, static_groups=static_groups, desc_act=True, sym=True)
    # 50 does not divide K = 96: the last block is padded.
    results = [gptq_quantize(w, h, block_size=bs, **opts) for bs in (8, 32, 50, 128)]
    for r in results[1:]:
        assert np.mean(r.q == results[0].q) >= 0.995
        np.testing.assert_allclose(r.scale, results[0].scale, rtol=1e-5)
    q_ref, _ = ref_gptq(w, h, **opts)
    assert np.mean(results[2].q == q_ref) >= 0.995


def test_gptq_beats_rtn_on_output_error():
    rng = np.random.default_rng(7)
    k, n = 128, 64
    x = correlated_inputs(rng, 512, k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    acc = HessianAccumulator(k)
    acc.add(x)
    for group_size in (32, -1):
        for sym in (True, False):
            err_rtn = np.sum((x @ (w - rtn_quantize(w, group_size=group_size, sym=sym).dequantize())) ** 2)
            gq = gptq_quantize(w, acc.hessian, group_size=group_size, sym=sym, desc_act=True)
            err_gptq = np.sum((x @ (w - gq.dequantize())) ** 2)
            assert err_gptq < 0.8 * err_rtn, (group_size, sym, err_gptq, err_rtn)


def test_desc_act_g_idx_semantics():
    w, h, _ = problem(seed=11, k=64, n=16)
    g = 16
    got = gptq_quantize(w, h, group_size=g, desc_act=True)
    perm = np.argsort(-np.diag(h), kind="stable")
    invperm = np.argsort(perm)
    np.testing.assert_array_equal(got.g_idx, invperm // g)
    assert np.all(np.bincount(got.g_idx, minlength=4) == g)
    assert not np.array_equal(got.g_idx, np.arange(64) // g)  # the test is meaningful
    expected = got.scale[got.g_idx] * (got.q.astype(np.float32) - got.zero[got.g_idx].astype(np.float32))
    np.testing.assert_array_equal(got.dequantize(), expected)

    static = gptq_quantize(w, h, group_size=g, desc_act=True, static_groups=True)
    np.testing.assert_array_equal(static.g_idx, np.arange(64) // g)
    rtn = rtn_quantize(w, group_size=g)  # static grids come from the original weights
    np.testing.assert_array_equal(static.scale, rtn.scale)
    np.testing.assert_array_equal(static.zero, rtn.zero)


# --------------------------------------------------------------------------------------------------
# RTN, the Hessian, QuantizedWeight, argument checks
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [8, -1])
@pytest.mark.parametrize("sym", [True, False])
def test_rtn_matches_the_parameter_rule(group_size, sym):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((32, 12)).astype(np.float32)
    w[:, 0] = np.abs(w[:, 0])  # all >= 0: xmin stays 0
    w[:, 1] = 0.0  # all zero: the [-1, 1] fallback
    w[:, 2] = -np.abs(w[:, 2])
    got = rtn_quantize(w, group_size=group_size, sym=sym)
    g = 32 if group_size == -1 else group_size
    for j in range(32 // g):
        scale, zero = ref_params(w[j * g:(j + 1) * g], sym)  # in float32, like the solver
        np.testing.assert_allclose(got.scale[j], scale, rtol=1e-6)
        np.testing.assert_array_equal(got.zero[j], zero)
        q = ref_quant(w[j * g:(j + 1) * g], got.scale[j], got.zero[j].astype(np.float32))
        np.testing.assert_array_equal(got.q[j * g:(j + 1) * g], q)
    np.testing.assert_array_equal(got.g_idx, np.arange(32) // g)
    assert got.q.dtype == np.uint8 and got.q.max() <= 15
    assert got.zero.dtype == np.uint8 and got.zero.max() <= 15
    np.testing.assert_allclose(got.scale[:, 1], 2.0 / 15)
    if sym:
        assert np.all(got.zero == 8)
    # RTN error is at most half a step inside the grid's range.
    deq = got.dequantize()
    inside = (np.abs(w) <= 7 * got.scale[got.g_idx]) if sym else np.ones_like(w, bool)
    assert np.all(np.abs(deq - w)[inside] <= 0.5 * got.scale[got.g_idx][inside] * (1 + 1e-5))


def test_hessian_accumulator_in_chunks():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((100, 24)).astype(np.float32)
    acc = HessianAccumulator(24)
    acc.add(x[:10])
    acc.add(x[10:40].reshape(3, 10, 24))
    x[40:] = x[40:].astype(np.float16)
    acc.add(x[40:].astype(np.float16))
    acc.add(np.zeros((0, 24), np.float32))
    assert acc.count == 100
    expected = 2.0 / 100 * x.astype(np.float64).T @ x.astype(np.float64)
    assert acc.hessian.dtype == np.float32 and acc.hessian.shape == (24, 24)
    np.testing.assert_allclose(acc.hessian, expected, rtol=1e-5, atol=1e-5)

    import jax.numpy as jnp

    bf = HessianAccumulator(24)
    bf.add(jnp.asarray(x, jnp.bfloat16))
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    np.testing.assert_allclose(bf.hessian, 2.0 / 100 * xb.T @ xb, rtol=1e-5, atol=1e-5)


def test_quantized_weight_dequantize():
    qw = QuantizedWeight(
        q=np.array([[0, 15], [8, 3]], np.uint8),
        scale=np.array([[0.5, 2.0], [1.0, 0.25]], np.float32),
        zero=np.array([[8, 0], [3, 15]], np.uint8),
        g_idx=np.array([1, 0], np.int32),
    )
    np.testing.assert_array_equal(qw.dequantize(), np.array([[-3.0, 0.0], [0.0, 6.0]], np.float32))


def test_bad_arguments():
    w, h, _ = problem(k=64, n=8)
    with pytest.raises(MiniCPMError, match="group_size"):
        rtn_quantize(w, group_size=48)
    with pytest.raises(MiniCPMError, match="group_size"):
        gptq_quantize(w, h, group_size=0)
    with pytest.raises(MiniCPMError, match="group_size"):
        gptq_quantize(w, h, group_size=-2)
    with pytest.raises(MiniCPMError, match="Hessian"):
        gptq_quantize(w, h[:32, :32], group_size=32)
    with pytest.raises(MiniCPMError, match="block_size"):
        gptq_quantize(w, h, group_size=32, block_size=0)
    with pytest.raises(MiniCPMError, match="damp_percent"):
        gptq_quantize(w, h, group_size=32, damp_percent=-0.1)
    with pytest.raises(MiniCPMError, match="2-D"):
        rtn_quantize(w[0], group_size=-1)
    with pytest.raises(MiniCPMError, match="shape"):
        HessianAccumulator(64).add(np.zeros((3, 32), np.float32))
    not_pd = -np.eye(64, dtype=np.float32)
    with pytest.raises(MiniCPMError, match="damp_percent"):
        gptq_quantize(w, not_pd, group_size=32)


# --------------------------------------------------------------------------------------------------
# Asymmetric calibration (GPTAQ)
# --------------------------------------------------------------------------------------------------


def test_cross_accumulator_matches_numpy_and_refuses_mixing():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((90, 16)).astype(np.float32)
    x_ref = x + 0.1 * rng.standard_normal((90, 16)).astype(np.float32)
    acc = HessianAccumulator(16)
    acc.add(x[:30], x_ref[:30])
    acc.add(x[30:].reshape(2, 30, 16), x_ref[30:].reshape(2, 30, 16))
    xd, rd = x.astype(np.float64), x_ref.astype(np.float64)
    np.testing.assert_allclose(acc.cross, 2.0 / 90 * xd.T @ (rd - xd), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(acc.hessian, 2.0 / 90 * xd.T @ xd, rtol=1e-5, atol=1e-5)
    assert HessianAccumulator(16).cross is None
    with pytest.raises(MiniCPMError, match="every batch or with none"):
        acc.add(x[:5])
    with pytest.raises(MiniCPMError, match="shape of x"):
        acc.add(x[:5], x_ref[:4])


def test_gptq_with_cross_term_quantizes_the_least_squares_target():
    """cross=C quantizes w + (H + damp)^-1 C w (NumPy) with plain GPTQ; C = 0 is plain GPTQ; and on a
    drifted input the result fits the full-precision output X_ref w better than plain GPTQ does."""
    rng = np.random.default_rng(12)
    k, n, g = 64, 24, 16
    x_ref = rng.standard_normal((400, k)).astype(np.float32) * rng.uniform(0.2, 3.0, k).astype(np.float32)
    # drift of the quantized model's inputs: systematic per channel (which the correction can undo) plus noise
    x = x_ref * rng.uniform(0.8, 1.2, k).astype(np.float32) + 0.05 * rng.standard_normal((400, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    acc = HessianAccumulator(k)
    acc.add(x, x_ref)
    h, c = acc.hessian, acc.cross
    opts = dict(group_size=g, desc_act=True, damp_percent=0.01)
    hd = h.astype(np.float64) + 0.01 * np.mean(np.diag(h)) * np.eye(k)
    target = (w + np.linalg.solve(hd, c.astype(np.float64) @ w)).astype(np.float32)
    got = gptq_quantize(w, h, cross=c, **opts)
    want = gptq_quantize(target, h, **opts)
    np.testing.assert_array_equal(got.q, want.q)
    np.testing.assert_allclose(got.scale, want.scale, rtol=1e-5)
    plain = gptq_quantize(w, h, **opts)
    zero = gptq_quantize(w, h, cross=np.zeros_like(h), **opts)
    np.testing.assert_array_equal(zero.q, plain.q)
    fp = x_ref @ w
    err_cross = np.linalg.norm(x @ got.dequantize() - fp)
    err_plain = np.linalg.norm(x @ plain.dequantize() - fp)
    assert err_cross < 0.7 * err_plain, (err_cross, err_plain)  # measured 0.57
    with pytest.raises(MiniCPMError, match="cross must be"):
        gptq_quantize(w, h, cross=c[:8], **opts)


def test_gptq_calibrate_modes_on_a_tiny_model(tiny_ckpt):
    """gptq_calibrate, asymmetric (default) and classic: layer 0's qkv sees the same inputs in both models,
    so C = 0 and both modes quantize it identically, equal to gptq_quantize on the Hessian of those inputs;
    later linears differ (the asymmetric mode fits the full-precision outputs)."""
    import jax.numpy as jnp

    from checkpoints_convert.quantize import GPTQSettings, gptq_calibrate
    from minicpm_jax.quant import QuantSpec
    from minicpm_jax.model.loading import load_model

    path, cfg, _ = tiny_ckpt
    tokens = np.random.default_rng(13).integers(0, cfg["vocab_size"], (3, 24)).astype(np.int32)
    spec = QuantSpec(group_size=-1, sym=True, act_order=True)
    runs = {}
    for mode in (True, False):
        model = load_model(path, dtype=jnp.float32, attention_impl="xla", max_length=32, sparse="off")
        if mode:
            w_qkv = np.asarray(model.model.layers[0].self_attn.qkv_proj.kernel[...], np.float32)
            x0 = model.model.embed_tokens(jnp.asarray(tokens)).astype(jnp.float32) * model.config.scale_emb
            h0 = model.model.layers[0].input_layernorm(x0)
        runs[mode] = gptq_calibrate(model, tokens, spec, GPTQSettings(asym_calibration=mode), progress=False)
    qkv = ("model", "layers", 0, "self_attn", "qkv_proj")
    acc = HessianAccumulator(w_qkv.shape[0])
    acc.add(h0)
    want = gptq_quantize(w_qkv, acc.hessian, group_size=-1, sym=True, desc_act=True)
    for mode in (True, False):
        np.testing.assert_array_equal(runs[mode][qkv].q, want.q)
    o_proj = ("model", "layers", 0, "self_attn", "o_proj")
    assert not np.array_equal(runs[True][o_proj].q, runs[False][o_proj].q)
    assert set(runs[True]) == set(runs[False]) and len(runs[True]) == 4 * cfg["num_hidden_layers"]


def test_gptq_cross_term_needs_a_positive_definite_hessian():
    w = np.ones((4, 3), np.float32)
    x = np.ones((1, 4), np.float32)  # rank 1: without damping H is singular
    acc = HessianAccumulator(4)
    acc.add(x, 2 * x)
    with pytest.raises(MiniCPMError, match="not positive definite"):
        gptq_quantize(w, acc.hessian, group_size=-1, damp_percent=0.0, cross=acc.cross)
