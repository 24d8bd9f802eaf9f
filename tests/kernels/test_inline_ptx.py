"""pallas_kernels/inline_ptx.py: the one-instruction forms (GPU) against the jnp they replace, inside a Pallas
kernel, and the jnp forms interpret mode runs (CPU). The int4 kernel's use of them: test_int4_kernels.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import inline_ptx

MASK, BITS = 0x000F000F, 0x43004300


CENTRE = {jnp.bfloat16: 136.0, jnp.float16: 1032.0}  # what the int4 kernels subtract from their code pairs


def _run(asm: bool, a, b, c, w):
    def kernel(a_ref, b_ref, c_ref, w_ref, f_ref, o_ref, *h_refs):
        f_ref[...] = inline_ptx.fma(a_ref[...], b_ref[...][:, None], c_ref[...], asm=asm)
        o_ref[...] = inline_ptx.and_or(w_ref[...], MASK, BITS, asm=asm)
        for h_ref, (dtype, value) in zip(h_refs, CENTRE.items()):
            h_ref[...] = inline_ptx.sub_halves(w_ref[...], value, dtype, asm=asm)

    return pl.pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct(a.shape, jnp.float32),
                                             *[jax.ShapeDtypeStruct(w.shape, jnp.int32)] * 3),
                          interpret=not asm)(a, b, c, w)


def _inputs():
    rng = np.random.default_rng(3)
    a, c = (jnp.asarray(rng.standard_normal((16, 128)), jnp.float32) for _ in range(2))
    b = jnp.asarray(rng.standard_normal(16), jnp.float32)
    w = jnp.asarray(rng.integers(-2**31, 2**31, (16, 128), dtype=np.int64).astype(np.int32))
    return a, b, c, w


def _halves_minus(w, dtype, value):
    """NumPy: both 16-bit floats of each word minus ``value``, rounded once (float64 holds the difference
    exactly), repacked."""
    halves = w.astype(np.uint32).view(np.uint16).reshape(*w.shape, 2).view(jnp.dtype(dtype))
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and infinite halves among the random words
        diff = (halves.astype(np.float64) - value).astype(jnp.dtype(dtype))
    return diff.view(np.uint16).reshape(*w.shape, 2).view(np.uint32).reshape(w.shape).view(np.int32)


def _check(f, o, h_bf16, h_f16, a, b, c, w, *, rounded_once: bool):
    a, b, c, w = (np.asarray(v) for v in (a, b, c, w))
    # a·b + c rounded once (a float32 product is exact in float64); jnp rounds the product first
    want = (a.astype(np.float64) * b[:, None].astype(np.float64) + c).astype(np.float32)
    if rounded_once:
        np.testing.assert_array_equal(np.asarray(f), want)
    else:
        np.testing.assert_allclose(np.asarray(f), want, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(o), w & MASK | BITS)
    # random halves (NaNs aside) and the int4 kernels' pairs (offset + code: integers, exact either way)
    for got, (dtype, value) in zip((h_bf16, h_f16), CENTRE.items()):
        got, want = np.asarray(got), _halves_minus(w, dtype, value)
        pairs = w & MASK | BITS if dtype == jnp.bfloat16 else w & MASK | 0x64006400
        np.testing.assert_array_equal(_halves_minus(pairs, dtype, value),
                                      np.asarray(inline_ptx.sub_halves(jnp.asarray(pairs), value, dtype, asm=False)))
        finite = np.isfinite(want.view(np.uint16).view(jnp.dtype(dtype))).reshape(*w.shape, 2).all(-1)
        np.testing.assert_array_equal(got[finite], want[finite])


def test_jnp_forms_in_interpret_mode():
    a, b, c, w = _inputs()
    _check(*_run(False, a, b, c, w), a, b, c, w, rounded_once=False)
    with pytest.raises(ValueError, match="constants"):
        inline_ptx.and_or(w, 0xFFFF0000, 0, asm=False)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        inline_ptx.sub_halves(w, 1.0, jnp.float32, asm=False)


@pytest.mark.parametrize("dtype,capability,op", [(jnp.bfloat16, (9, 0), "sub.bf16x2"),
                                                 (jnp.bfloat16, (8, 0), "fma.rn.bf16x2"),
                                                 (jnp.float16, (8, 0), "sub.f16x2")])
def test_sub_halves_ptx_per_gpu(dtype, capability, op):
    """The packed subtraction's PTX: ``sub`` (bfloat16 from sm_90), else an fma by 1; its 32-bit literals hold
    the constants in both halves (read back by NumPy)."""
    value = CENTRE[dtype]
    ptx = inline_ptx.sub_halves_ptx(value, jnp.dtype(dtype), capability)
    assert f" {op} $0, $1, " in ptx and ptx.count(";") == ptx.count("mov.b32") + 2  # the .reg line, then op
    literals = [int(t.split(",")[1].strip(" ;")) for t in ptx.split(";") if "mov.b32" in t]
    halves = [np.array([v], np.int32).view(jnp.dtype(dtype)).astype(np.float64).tolist() for v in literals]
    assert halves == ([[1.0, 1.0], [-value, -value]] if op.startswith("fma") else [[value, value]])


@pytest.mark.gpu
def test_gpu_one_instruction_forms_equal_jnp():
    a, b, c, w = _inputs()
    _check(*_run(True, a, b, c, w), a, b, c, w, rounded_once=True)
