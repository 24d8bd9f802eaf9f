"""A dense linear, ``x @ w``, kept a matrix product on GPUs at every batch size; and a decode step's product
left as K-split partial sums (:class:`SplitSum`) for the all-reduce or RoPE kernel to add.

Not a Pallas kernel: the op is XLA's GEMM (cuBLAS or its Triton GEMM) in every backend. It exists because
XLA's GPU algebraic simplifier rewrites a dot whose left operand is a single row — a decode step at
batch 1 — into an elementwise multiply and a reduction when both operands together hold fewer than 10M
elements (``GpuAlgebraicSimplifierVisitor::ShouldStrengthReduceDotToReduce``), and that reduction reads
the weight at a third of a GEMM's bandwidth or less. Under tensor parallelism an 8B model's per-device
q/k/v and o projections fall under the limit (BENCHMARKS.md, tensor parallelism: 981 µs a step where
GEMMs would take ~400), as do every linear of a sub-1B model. A dot of two rows is a matrix product
whatever its size, so a single row is duplicated and one result row kept.

**Split partial sums.** XLA runs a GEMM of few rows (a decode step's) over a long K as a split-K GEMM: ``S``
programs per output tile, each over ``K / S`` rows, and a separate kernel adding the ``S`` partial sums (~1.3 µs
a call; the decode of a model split over 2 GPUs has three a layer, before the RoPE kernel and the row-parallel
``o_proj``'s and ``down_proj``'s all-reduce, custom calls that cannot absorb them). :func:`matmul_parts` writes
that split itself for up to 32 rows, as a batched GEMM of the ``S`` blocks of K, and returns the partial sums
unreduced; the peer all-reduce kernel (:mod:`pallas_kernels.residual`) and the RoPE kernel
(:mod:`pallas_kernels.rope_write`) add them as they read them. The ``xla`` namespace's op is one part: the plain
GEMM.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

# Operand elements (left + right) below which XLA's GPU simplifier turns a one-row dot into a reduction.
STRENGTH_REDUCED_BELOW = 10_000_000
# matmul_parts' split of K: blocks of at least SPLIT_ROWS rows of the weight, at most MAX_SPLITS of them for one
# row (XLA's autotuner chose the same for MiniCPM4-8B's split linears at TP 2 on an H200: o_proj K=2048 in 4,
# down_proj K=8192 in 8; session 48's HLO dump), at most ROWS_MAX_SPLITS for 2 to SPLIT_MAX_ROWS rows (the fused
# all-reduce kernel's MAX_ROWS; the RoPE kernel takes any). At batch 16, TP 2, XLA split q/k/v in 8, o_proj in 4
# and down_proj in 8, each followed by a reduction kernel of its own (~1.6 µs a call); these splits, added by the
# consumer kernels, took the step 3.28 -> 3.14 ms (8/4/8) or 3.12 (4/4/4: 3.18 -> 3.11 ms in the next call; o in
# 8 3.20, q/k/v in 16 3.19; 2x H200, lab note of 2026-12-01, session 54).
SPLIT_ROWS = 512
MAX_SPLITS = 8
ROWS_MAX_SPLITS = 4
SPLIT_MAX_ROWS = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SplitSum:
    """A product left as partial sums: ``parts`` fp32 ``[S, M, N]``, whose sum over ``S``, first ``rows`` rows
    (``M`` may hold padding rows), reshaped to ``shape`` (``[..., N]``) is the product (:meth:`total`)."""

    parts: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    def total(self) -> jax.Array:
        """The product ``[..., N]`` fp32: the parts summed in order, padding rows dropped."""
        summed = self.parts[0] if self.parts.shape[0] == 1 else jnp.sum(self.parts, axis=0)
        return summed[: self.rows].reshape(self.shape)

    @classmethod
    def whole(cls, y: jax.Array) -> SplitSum:
        """A product ``y [..., N]`` as one part ``[1, rows, N]`` (a free reshape)."""
        return cls(y.reshape(1, y.size // y.shape[-1], y.shape[-1]), y.shape)


def as_split(x: jax.Array | SplitSum) -> SplitSum:
    """``x`` itself, or an array as one part (:meth:`SplitSum.whole`)."""
    return x if isinstance(x, SplitSum) else SplitSum.whole(x)


def summed(x: jax.Array | SplitSum) -> jax.Array:
    """A :class:`SplitSum`'s product (:meth:`SplitSum.total`), or ``x`` itself."""
    return x.total() if isinstance(x, SplitSum) else x


def keeps_one_row(rows: int, k: int, n: int) -> bool:
    """Whether a ``[rows, k] @ [k, n]`` dot would be strength-reduced on a GPU (and so is run as two rows)."""
    return rows == 1 and k + k * n < STRENGTH_REDUCED_BELOW and jax.default_backend() == "gpu"


def matmul(x: jax.Array, w: jax.Array, *, preferred_element_type=None) -> jax.Array:
    """``x [..., K] @ w [K, N] → [..., N]``, as ``jnp.dot`` (``preferred_element_type`` likewise)."""
    k, n = w.shape
    rows = math.prod(x.shape[:-1])
    if not keeps_one_row(rows, k, n):
        return jnp.dot(x, w, preferred_element_type=preferred_element_type)
    two = jnp.broadcast_to(x.reshape(1, k), (2, k))
    return jnp.dot(two, w, preferred_element_type=preferred_element_type)[:1].reshape(*x.shape[:-1], n)


def matmul_parts_reference(x: jax.Array, w: jax.Array) -> SplitSum:
    """``x [..., K] @ w [K, N]`` in fp32 as one part: ``SplitSum([1, rows, N])``."""
    return SplitSum.whole(matmul(x, w, preferred_element_type=jnp.float32))


def default_splits(rows: int, k: int) -> int:
    """How many blocks of K :func:`matmul_parts` splits a ``[rows, K]`` product into: on a GPU, for up to
    SPLIT_MAX_ROWS rows, the most (a power of 2, up to MAX_SPLITS for one row, ROWS_MAX_SPLITS for more) that
    leave SPLIT_ROWS rows a block; else 1 (the plain GEMM)."""
    if rows > SPLIT_MAX_ROWS or jax.default_backend() != "gpu":
        return 1
    most = MAX_SPLITS if rows == 1 else ROWS_MAX_SPLITS
    splits = 1
    while splits < most and k % (2 * splits) == 0 and k // (2 * splits) >= SPLIT_ROWS:
        splits *= 2
    return splits


def matmul_parts(x: jax.Array, w: jax.Array, *, splits: int | None = None) -> SplitSum:
    """:func:`matmul_parts_reference` as ``splits`` partial sums (default :func:`default_splits`; it must
    divide K): one batched GEMM ``[S, M, K/S] @ [S, K/S, N] → [S, M, N]`` of x's rows against the S blocks of
    w's rows (a free reshape). One row is duplicated (``M`` 2: a dot of one row would be strength-reduced, see
    the module docstring), the second row padding. One part (``splits`` 1) is the reference's GEMM."""
    k, n = w.shape
    rows = math.prod(x.shape[:-1])
    splits = default_splits(rows, k) if splits is None else splits
    if splits == 1:
        return matmul_parts_reference(x, w)
    if k % splits:
        raise ValueError(f"matmul_parts splits K into equal blocks: K={k} in {splits}")
    xs = x.reshape(rows, splits, k // splits).transpose(1, 0, 2)
    if rows == 1:
        xs = jnp.broadcast_to(xs, (splits, 2, k // splits))
    parts = jnp.einsum("smk,skn->smn", xs, w.reshape(splits, k // splits, n), preferred_element_type=jnp.float32)
    return SplitSum(parts, (*x.shape[:-1], n))
