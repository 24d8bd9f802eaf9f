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


def _run(asm: bool, a, b, c, w):
    def kernel(a_ref, b_ref, c_ref, w_ref, f_ref, o_ref):
        f_ref[...] = inline_ptx.fma(a_ref[...], b_ref[...][:, None], c_ref[...], asm=asm)
        o_ref[...] = inline_ptx.and_or(w_ref[...], MASK, BITS, asm=asm)

    return pl.pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct(a.shape, jnp.float32),
                                             jax.ShapeDtypeStruct(w.shape, jnp.int32)),
                          interpret=not asm)(a, b, c, w)


def _inputs():
    rng = np.random.default_rng(3)
    a, c = (jnp.asarray(rng.standard_normal((16, 128)), jnp.float32) for _ in range(2))
    b = jnp.asarray(rng.standard_normal(16), jnp.float32)
    w = jnp.asarray(rng.integers(-2**31, 2**31, (16, 128), dtype=np.int64).astype(np.int32))
    return a, b, c, w


def _check(f, o, a, b, c, w, *, rounded_once: bool):
    a, b, c, w = (np.asarray(v) for v in (a, b, c, w))
    # a·b + c rounded once (a float32 product is exact in float64); jnp rounds the product first
    want = (a.astype(np.float64) * b[:, None].astype(np.float64) + c).astype(np.float32)
    if rounded_once:
        np.testing.assert_array_equal(np.asarray(f), want)
    else:
        np.testing.assert_allclose(np.asarray(f), want, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(o), w & MASK | BITS)


def test_jnp_forms_in_interpret_mode():
    a, b, c, w = _inputs()
    _check(*_run(False, a, b, c, w), a, b, c, w, rounded_once=False)
    with pytest.raises(ValueError, match="constants"):
        inline_ptx.and_or(w, 0xFFFF0000, 0, asm=False)


@pytest.mark.gpu
def test_gpu_one_instruction_forms_equal_jnp():
    a, b, c, w = _inputs()
    _check(*_run(True, a, b, c, w), a, b, c, w, rounded_once=True)
