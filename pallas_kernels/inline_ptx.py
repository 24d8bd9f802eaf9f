"""Single PTX instructions for Pallas Triton kernels where XLA's Triton pipeline emits more instructions, each
beside the plain jnp it replaces, which interpret mode (the CPU) runs instead (``asm=False``): ``and_or`` equal to
it bit for bit, ``fma`` up to the product's rounding (one rounding on the GPU, two in jnp).

* :func:`fma`: ``a·b + c`` as one ``fma.rn.f32``. XLA compiles Pallas Triton kernels without floating-point
  contraction, so ``a * b + c`` stays a multiply and an add (ncu, H200, 2026-11-29: the one-row int4 kernel ran
  0 fused and 10.7M unfused FP32 instructions, FMUL and FADD in its SASS).
* :func:`and_or`: ``(a & mask) | bits`` as one ``lop3.b32``. Written as jnp, ptxas emits two LOP3 instructions,
  one per constant (a SASS instruction takes one immediate); given one PTX instruction it keeps a constant in a
  register instead.
* :func:`sub_halves`: a constant subtracted from both 16-bit floats of a word as one ``sub.bf16x2`` (sm_90 on,
  measured on H100/H200) / ``sub.f16x2``; below sm_90 bfloat16 takes ``fma.rn.bf16x2`` by 1 (sm_80; not yet run
  on such a GPU). The jnp form unpacks, subtracts in the 16-bit dtype and repacks (Triton would widen each half
  to float32 and back).

All are pure and elementwise (Pallas' ``elementwise_inline_asm``; operands broadcast to one shape first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as plt

from pallas_kernels.launch import compute_capability


def _elementwise(asm: str, constraints: str, dtype, *args: jax.Array) -> jax.Array:
    shape = jnp.broadcast_shapes(*(a.shape for a in args))
    args = [jnp.broadcast_to(a, shape) for a in args]
    return plt.elementwise_inline_asm(asm, args=args, constraints=constraints, pack=1,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, dtype)])[0]


def fma(a: jax.Array, b: jax.Array, c: jax.Array, *, asm: bool) -> jax.Array:
    """``a·b + c`` for float32 arrays (broadcast to one shape), rounded once on the GPU (``asm``), twice by jnp."""
    if not asm:
        return a * b + c
    a, b, c = (jnp.asarray(v, jnp.float32) for v in (a, b, c))
    return _elementwise("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", jnp.float32, a, b, c)


def and_or(a: jax.Array, mask: int, bits: int, *, asm: bool) -> jax.Array:
    """``(a & mask) | bits`` for an int32 array and two constants in [0, 2³¹), bit for bit the same either way."""
    if not 0 <= mask < 1 << 31 or not 0 <= bits < 1 << 31:
        raise ValueError(f"and_or takes constants in [0, 2**31); got {mask:#x}, {bits:#x}")
    if not asm:
        return a & mask | bits
    # lop3's look-up table for (a & b) | c: with a = 0xF0, b = 0xCC, c = 0xAA, (0xF0 & 0xCC) | 0xAA = 0xEA.
    return _elementwise(f"lop3.b32 $0, $1, {mask}, {bits}, 0xEA;", "=r,r", jnp.int32, a)


def sub_halves(a: jax.Array, value: float, dtype, *, asm: bool) -> jax.Array:
    """Each int32 word of ``a`` read as two ``dtype`` floats (bfloat16 or float16, low half first), ``value``
    subtracted from both, repacked into an int32. Rounded once on the GPU (``asm``), through float32 by jnp: the
    same bits wherever the difference is exact in ``dtype`` (the int4 kernels' small integers)."""
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"sub_halves takes bfloat16 or float16 halves; got {dtype}")
    if float(np.asarray(value, dtype)) != value:
        raise ValueError(f"sub_halves subtracts a value exact in {dtype}; got {value}")
    if not asm:
        lo = lax.bitcast_convert_type(a.astype(jnp.int16), dtype) - jnp.asarray(value, dtype)
        hi = lax.bitcast_convert_type((a >> 16).astype(jnp.int16), dtype) - jnp.asarray(value, dtype)
        return (lax.bitcast_convert_type(hi, jnp.int16).astype(jnp.int32) << 16
                | lax.bitcast_convert_type(lo, jnp.uint16).astype(jnp.int32))
    return _elementwise(sub_halves_ptx(value, dtype, compute_capability()), "=r,r", jnp.int32, a)


def sub_halves_ptx(value: float, dtype, capability: tuple[int, int]) -> str:
    """The PTX of :func:`sub_halves` for a GPU of ``capability``. Packed operands take no immediates: constants go
    through scoped registers (folded by ptxas), as signed 32-bit literals (a negative half sets the sign bit)."""
    def both(v):
        return int(np.array([v, v], dtype).view(np.int32)[0])
    if dtype == jnp.dtype(jnp.float16) or capability >= (9, 0):
        op = "sub.f16x2" if dtype == jnp.dtype(jnp.float16) else "sub.bf16x2"
        return f"{{ .reg .b32 c; mov.b32 c, {both(value)}; {op} $0, $1, c; }}"
    return f"{{ .reg .b32 one, c; mov.b32 one, {both(1.0)}; mov.b32 c, {both(-value)}; fma.rn.bf16x2 $0, $1, one, c; }}"
