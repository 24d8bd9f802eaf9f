"""A dense linear, ``x @ w``, kept a matrix product on GPUs at every batch size.

Not a Pallas kernel: the op is XLA's GEMM (cuBLAS or its Triton GEMM) in every backend. It exists because
XLA's GPU algebraic simplifier rewrites a dot whose left operand is a single row — a decode step at
batch 1 — into an elementwise multiply and a reduction when both operands together hold fewer than 10M
elements (``GpuAlgebraicSimplifierVisitor::ShouldStrengthReduceDotToReduce``), and that reduction reads
the weight at a third of a GEMM's bandwidth or less. Under tensor parallelism an 8B model's per-device
q/k/v and o projections fall under the limit (BENCHMARKS.md, tensor parallelism: 981 µs a step where
GEMMs would take ~400), as do every linear of a sub-1B model. A dot of two rows is a matrix product
whatever its size, so a single row is duplicated and one result row kept.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Operand elements (left + right) below which XLA's GPU simplifier turns a one-row dot into a reduction.
STRENGTH_REDUCED_BELOW = 10_000_000


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
