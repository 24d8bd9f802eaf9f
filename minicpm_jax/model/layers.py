"""Building blocks of the MiniCPM network: embedding, RMSNorm, bias-free linear (dense or int4), SwiGLU MLP.

Parameter names mirror the checkpoint names (``embed_tokens``, ``mlp.gate_up_proj`` ...) so the weight
loaders are maps. Linear kernels are stored ``[in, out]``; q/k/v and gate/up are fused along ``out``.
Every parameter carries its logical axes (``axes`` metadata, :mod:`minicpm_jax.model.parallel`); under
tensor parallelism a layer sees its shard's blocks. A row-parallel linear's :meth:`~Linear.partial` is this
shard's partial sum of its output; the decoder layer reduces it at the block boundary (the MLP and the
attention return partial sums), while ``__call__`` returns the reduced output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from minicpm_jax.model.parallel import EMBED, GATE_UP, MLP as MLP_AXIS, SHARDED, VOCAB, TensorParallel
from minicpm_jax.quant import QuantSpec, scale_dtype
from pallas_kernels import backend
from pallas_kernels.matmul import SplitSum, summed
from pallas_kernels.peer_all_reduce import MAX_PARTS
from pallas_kernels.residual import rms_norm

Axes = tuple  # logical axis names of a parameter (``minicpm_jax.model.parallel``), None = replicated
SINGLE = None  # a layer outside tensor parallelism (``tp=None``): size 1

INIT_STD = 0.02  # random-weight initialisation (tests, benchmarks); real weights come from a checkpoint


def _normal(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype, axes: Axes) -> nnx.Param:
    """N(0, INIT_STD²) weights, or zeros when ``rngs`` is None (a model about to be loaded)."""
    if rngs is None:
        return nnx.Param(jnp.zeros(shape, dtype), axes=axes)
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * INIT_STD).astype(dtype), axes=axes)


def _row_parallel(axes: Axes, tp: TensorParallel | None) -> bool:
    """Whether a linear's input axis is split over several devices (its outputs are partial sums)."""
    return tp is not None and tp.size > 1 and axes[0] in SHARDED


class Linear(nnx.Module):
    """``y = x @ kernel`` with ``kernel [in_features, out_features]``, no bias; output in x.dtype.

    impl: the kernel backend whose ``matmul`` runs it (a GEMM in every backend; see
    ``pallas_kernels.matmul``); axes: the kernel's logical axes; tp: the model's :class:`TensorParallel`
    (None: not split). A row-parallel linear's :meth:`partial` is this shard's fp32 partial product (as the
    backend's ``matmul_parts``: K-split parts the all-reduce kernel adds); calling it all-reduces that.
    """

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs | None, dtype=jnp.float32,
                 axes: Axes = (EMBED, EMBED), tp: TensorParallel | None = SINGLE, impl: str = "xla"):
        self.kernel = _normal(rngs, (in_features, out_features), dtype, axes)
        self.tp = tp
        self.impl = impl
        self.reduce = _row_parallel(axes, tp)

    def __call__(self, x: jax.Array) -> jax.Array:
        return _reduced(self, self.partial(x), x.dtype)

    def partial(self, x: jax.Array) -> jax.Array | SplitSum:
        """This shard's share of ``x @ kernel``: when row-parallel, its fp32 partial products as a
        :class:`~pallas_kernels.matmul.SplitSum` (their sum over the devices is the output), else the output
        itself in x.dtype."""
        ops = backend.get(self.impl)
        if not self.reduce:
            return ops.matmul(x, self.kernel[...].astype(x.dtype))
        return ops.matmul_parts(x, self.kernel[...].astype(x.dtype))

    def parts(self, x: jax.Array) -> SplitSum:
        """``x @ kernel`` in fp32 as the backend's K-split parts (``matmul_parts``; one part where it splits
        nothing), for a consumer that adds them as it reads them (the RoPE kernel). Not for a row-parallel
        linear, whose parts are partial sums over the devices (:meth:`partial`)."""
        _check_column_parallel(self)
        return backend.get(self.impl).matmul_parts(x, self.kernel[...].astype(x.dtype))


def _check_column_parallel(linear) -> None:
    if linear.reduce:
        raise ValueError("a row-parallel linear's parts are partial sums over the devices: use partial()")


def _reduced(linear, y: jax.Array | SplitSum, dtype) -> jax.Array:
    """A linear's :meth:`~Linear.partial` result summed over the devices (row-parallel), in ``dtype``."""
    if not linear.reduce:
        return y
    return linear.tp.all_reduce(summed(y)).astype(dtype)


class Int4Linear(nnx.Module):
    """``y = x @ dequant(W)`` for W4A16 weights (see ``pallas_kernels.int4_matmul``).

    Parameters: ``qweight int32 [K/8, N]``, ``scales [G, N]`` (:func:`~minicpm_jax.quant.scale_dtype`),
    ``zeros [G, N]`` when asymmetric, ``perm int32 [K]`` with act-order.
    impl: the kernel backend (``pallas_kernels.backend``) whose ``int4_matmul`` runs it. axes, tp: as
    :class:`Linear`. Row-parallel shards hold whole scale groups of K (per-channel scales are
    replicated); with act-order they gather the whole input first, since their rows read it anywhere.
    """

    def __init__(self, in_features: int, out_features: int, spec: QuantSpec, *, impl: str,
                 rngs: nnx.Rngs | None, dtype=jnp.float32, axes: Axes = (EMBED, EMBED),
                 tp: TensorParallel | None = SINGLE):
        self.in_features, self.out_features = in_features, out_features
        self.group_size = spec.rows_per_group(in_features)
        self.impl = impl
        self.tp = tp
        self.reduce = _row_parallel(axes, tp)
        groups = in_features // self.group_size
        shape = (in_features // 8, out_features)
        group_axes = (axes[0] if groups > 1 else None, axes[1])  # one group: every shard needs its scales
        sdt = scale_dtype(dtype)
        if rngs is None:
            self.qweight = nnx.Param(jnp.zeros(shape, jnp.int32), axes=axes)
            self.scales = nnx.Param(jnp.zeros((groups, out_features), sdt), axes=group_axes)
        else:  # uniform random codes; std(q − 8) ≈ 4.6, so the weights have std ≈ INIT_STD
            self.qweight = nnx.Param(jax.random.bits(rngs.params(), shape, jnp.uint32).view(jnp.int32), axes=axes)
            self.scales = nnx.Param(jnp.full((groups, out_features), INIT_STD / 4.6, sdt), axes=group_axes)
        if not spec.sym:
            self.zeros = nnx.Param(jnp.full((groups, out_features), 8, sdt), axes=group_axes)
        if spec.act_order:
            self.perm = nnx.Param(jnp.arange(in_features, dtype=jnp.int32), axes=axes[:1])

    def __call__(self, x: jax.Array) -> jax.Array:
        return _reduced(self, self.partial(x), x.dtype)

    def partial(self, x: jax.Array) -> jax.Array | SplitSum:
        """As :meth:`Linear.partial`: fp32 partial products when row-parallel (the kernel's K-split parts,
        ``int4_matmul_parts``), else the output."""
        zeros, perm = self._zeros_perm()
        group_size = min(self.group_size, x.shape[-1])  # per-channel scales over a shard's rows
        if not self.reduce:
            return backend.get(self.impl).int4_matmul(x, self.qweight[...], self.scales[...], zeros, perm,
                                                      group_size=group_size)
        if perm is not None:  # this shard's rows (in stored order) read input channels perm[rows]
            x = jnp.take(self.tp.all_gather(x, -1), perm, axis=-1)
        return backend.get(self.impl).int4_matmul_parts(x, self.qweight[...], self.scales[...], zeros, None,
                                                        group_size=group_size, max_parts=MAX_PARTS)

    def parts(self, x: jax.Array) -> SplitSum:
        """As :meth:`Linear.parts`: the kernel's own K-split parts (``int4_matmul_parts``, no cap)."""
        _check_column_parallel(self)
        zeros, perm = self._zeros_perm()
        return backend.get(self.impl).int4_matmul_parts(x, self.qweight[...], self.scales[...], zeros, perm,
                                                        group_size=min(self.group_size, x.shape[-1]))

    def _zeros_perm(self) -> tuple[jax.Array | None, jax.Array | None]:
        """The zero points and the act-order permutation, each None where the weights have none."""
        return (self.zeros[...] if hasattr(self, "zeros") else None,
                self.perm[...] if hasattr(self, "perm") else None)


def make_linear(in_features: int, out_features: int, quant: QuantSpec | None, *, impl: str,
                rngs: nnx.Rngs | None, dtype, axes: Axes = (EMBED, EMBED),
                tp: TensorParallel | None = SINGLE) -> Linear | Int4Linear:
    """A dense :class:`Linear`, or an :class:`Int4Linear` when the model is quantized (``impl``: the kernel
    backend of its matmul; ``axes``, ``tp``: its logical axes and the model's tensor-parallel layout)."""
    if quant is None:
        return Linear(in_features, out_features, rngs=rngs, dtype=dtype, axes=axes, tp=tp, impl=impl)
    return Int4Linear(in_features, out_features, quant, impl=impl, rngs=rngs, dtype=dtype, axes=axes, tp=tp)


class Embed(nnx.Module):
    """Token embedding table ``embedding [vocab, hidden]`` (vocab-parallel: each shard holds
    ``vocab_padded / size`` rows, see :meth:`TensorParallel.lookup`)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 tp: TensorParallel | None = SINGLE):
        self.embedding = _normal(rngs, (vocab_size, hidden_size), dtype, (VOCAB, EMBED))
        self.tp = tp

    def __call__(self, ids: jax.Array) -> jax.Array:
        """``ids int32[...]`` → ``[..., hidden]`` in the table's dtype."""
        if self.tp is None:
            return jnp.take(self.embedding[...], ids, axis=0)
        return self.tp.lookup(self.embedding[...], ids)


class RMSNorm(nnx.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` with fp32 statistics (as the HF code: normalise in fp32,
    cast to the input dtype, then multiply by the weight)."""

    def __init__(self, hidden_size: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((hidden_size,), dtype), axes=(EMBED,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused into ``gate_up_proj`` (under tensor
    parallelism each shard's block is ``[gate | up]`` of its channels, and ``down_proj`` is row-parallel:
    the result is this shard's partial sum, see :meth:`Linear.partial`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 quant: QuantSpec | None = None, impl: str = "xla", tp: TensorParallel | None = SINGLE):
        self.intermediate_size = intermediate_size
        linear = dict(impl=impl, rngs=rngs, dtype=dtype, tp=tp)
        self.gate_up_proj = make_linear(hidden_size, 2 * intermediate_size, quant, axes=(EMBED, GATE_UP), **linear)
        self.down_proj = make_linear(intermediate_size, hidden_size, quant, axes=(MLP_AXIS, EMBED), **linear)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj.partial(jax.nn.silu(gate) * up)
