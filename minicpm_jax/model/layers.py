"""Building blocks of the MiniCPM network: embedding, RMSNorm, bias-free linear (dense or int4), SwiGLU MLP.

Parameter names mirror the checkpoint names (``embed_tokens``, ``mlp.gate_up_proj`` ...) so the weight
loaders are maps. Linear kernels are stored ``[in, out]``; q/k/v and gate/up are fused along ``out``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from minicpm_jax.quant import QuantSpec, scale_dtype
from pallas_kernels import backend

INIT_STD = 0.02  # random-weight initialisation (tests, benchmarks); real weights come from a checkpoint


def _normal(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype) -> nnx.Param:
    """N(0, INIT_STD²) weights, or zeros when ``rngs`` is None (a model about to be loaded)."""
    if rngs is None:
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * INIT_STD).astype(dtype))


class Linear(nnx.Module):
    """``y = x @ kernel`` with ``kernel [in_features, out_features]``, no bias; output in x.dtype."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs | None, dtype=jnp.float32):
        self.kernel = _normal(rngs, (in_features, out_features), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.dot(x, self.kernel[...].astype(x.dtype))


class Int4Linear(nnx.Module):
    """``y = x @ dequant(W)`` for W4A16 weights (see ``pallas_kernels.int4_matmul``).

    Parameters: ``qweight int32 [K/8, N]``, ``scales [G, N]`` (:func:`~minicpm_jax.quant.scale_dtype`),
    ``zeros [G, N]`` when asymmetric, ``perm int32 [K]`` with act-order.
    impl: the kernel backend (``pallas_kernels.backend``) whose ``int4_matmul`` runs it.
    """

    def __init__(self, in_features: int, out_features: int, spec: QuantSpec, *, impl: str,
                 rngs: nnx.Rngs | None, dtype=jnp.float32):
        self.in_features, self.out_features = in_features, out_features
        self.group_size = spec.rows_per_group(in_features)
        self.impl = impl
        groups = in_features // self.group_size
        shape = (in_features // 8, out_features)
        sdt = scale_dtype(dtype)
        if rngs is None:
            self.qweight = nnx.Param(jnp.zeros(shape, jnp.int32))
            self.scales = nnx.Param(jnp.zeros((groups, out_features), sdt))
        else:  # uniform random codes; std(q − 8) ≈ 4.6, so the weights have std ≈ INIT_STD
            self.qweight = nnx.Param(jax.random.bits(rngs.params(), shape, jnp.uint32).view(jnp.int32))
            self.scales = nnx.Param(jnp.full((groups, out_features), INIT_STD / 4.6, sdt))
        if not spec.sym:
            self.zeros = nnx.Param(jnp.full((groups, out_features), 8, sdt))
        if spec.act_order:
            self.perm = nnx.Param(jnp.arange(in_features, dtype=jnp.int32))

    def __call__(self, x: jax.Array) -> jax.Array:
        zeros = self.zeros[...] if hasattr(self, "zeros") else None
        perm = self.perm[...] if hasattr(self, "perm") else None
        return backend.get(self.impl).int4_matmul(x, self.qweight[...], self.scales[...], zeros, perm,
                                                  group_size=self.group_size)


def make_linear(in_features: int, out_features: int, quant: QuantSpec | None, *, impl: str,
                rngs: nnx.Rngs | None, dtype) -> Linear | Int4Linear:
    """A dense :class:`Linear`, or an :class:`Int4Linear` when the model is quantized (``impl``: the kernel
    backend of its matmul)."""
    if quant is None:
        return Linear(in_features, out_features, rngs=rngs, dtype=dtype)
    return Int4Linear(in_features, out_features, quant, impl=impl, rngs=rngs, dtype=dtype)


class Embed(nnx.Module):
    """Token embedding table ``embedding [vocab, hidden]``."""

    def __init__(self, vocab_size: int, hidden_size: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.embedding = _normal(rngs, (vocab_size, hidden_size), dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """``ids int32[...]`` → ``[..., hidden]`` in the table's dtype."""
        return jnp.take(self.embedding[...], ids, axis=0)


class RMSNorm(nnx.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` with fp32 statistics (as the HF code: normalise in fp32,
    cast to the input dtype, then multiply by the weight)."""

    def __init__(self, hidden_size: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((hidden_size,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return normed.astype(x.dtype) * self.weight[...].astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused into ``gate_up_proj``."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 quant: QuantSpec | None = None, impl: str = "xla"):
        self.intermediate_size = intermediate_size
        self.gate_up_proj = make_linear(hidden_size, 2 * intermediate_size, quant, impl=impl, rngs=rngs, dtype=dtype)
        self.down_proj = make_linear(intermediate_size, hidden_size, quant, impl=impl, rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(jax.nn.silu(gate) * up)
