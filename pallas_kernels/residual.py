"""The residual stream at the end of a sublayer: the sublayer's partial sums reduced over the
tensor-parallel devices, scaled, added to the residual, and the next RMSNorm of the sum.

A row-parallel linear (``o_proj``, ``down_proj``) leaves each device a partial sum of the sublayer's
output. The reduction sits here, at the block boundary, not inside the linear (as gpt-fast's ``tp.py``
places it): a collective that also adds the residual and normalises (the fused all-reduce + add + RMSNorm
of SGLang's and vLLM's custom all-reduce) is then one op with one signature. Only the references exist:
XLA's all-reduce (``lax.psum``, which XLA lowers to NCCL or its one-shot kernel), then the add and the norm
as XLA fuses them. A Pallas collective kernel would be the ``pallas`` namespace's op beside them. A Pallas
add + norm without the collective was measured slower on one GPU (docs/lab_notes, twenty-seventh
session): XLA fuses the preceding GEMM's split-K reduction into the add, which a custom call cannot absorb.

Shapes: ``partial [..., H]`` (fp32 when it is a partial sum over devices, else the residual's dtype),
``residual [..., H]`` (the activation dtype), ``weight [H]``; results in the residual's dtype.
"""

from __future__ import annotations

from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps) * weight`` with fp32 statistics, as the HF code: normalised in fp32,
    cast to x's dtype, then multiplied by the weight (in x's dtype)."""
    xf = x.astype(jnp.float32)
    normed = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight.astype(x.dtype)


def residual_add_reference(partial: jax.Array, residual: jax.Array, scale: float, *,
                           axis_name: Hashable | None = None) -> jax.Array:
    """``residual + sum(partial) * scale``: ``partial`` summed over the devices of mesh axis ``axis_name``
    (None: it is the whole output already), rounded to the residual's dtype, then scaled and added."""
    total = partial if axis_name is None else lax.psum(partial, axis_name)
    return residual + total.astype(residual.dtype) * jnp.asarray(scale, residual.dtype)


def residual_add_norm_reference(partial: jax.Array, residual: jax.Array, scale: float, weight: jax.Array, *,
                                eps: float, axis_name: Hashable | None = None) -> tuple[jax.Array, jax.Array]:
    """:func:`residual_add_reference`, and the RMSNorm (``weight``, ``eps``) of its result: ``(residual',
    rms_norm(residual'))`` — the input of the next sublayer."""
    h = residual_add_reference(partial, residual, scale, axis_name=axis_name)
    return h, rms_norm(h, weight, eps)
