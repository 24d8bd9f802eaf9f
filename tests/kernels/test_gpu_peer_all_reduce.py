"""The peer-memory all-reduce on GPUs (``pytest -m gpu`` on a machine with 2+ GPUs; skipped elsewhere):
bit for bit ``lax.psum``'s result for 2 ranks (rank-ordered sums equal to a 1e-6 relative tolerance for
more), over repeated calls of changing sizes (the counters and the two slots of the protocol), a partial
last tile, and a device-side loop (XLA's while command buffer); the fused all-reduce + add + norm kernel
wherever its rows fit (where the backend picks it), with its partial sums whole or as K-split parts,
else the pallas backend's residual add + norm
through the plain kernel, over calls of changing rows and widths interleaved (each kernel's counters and
slots), against the reference ops; the collective ops of ``pallas_kernels.collectives`` against XLA's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from minicpm_jax.model.parallel import AXIS, make_mesh, use_peer_all_reduce
from pallas_kernels import backend
from pallas_kernels.matmul import SplitSum
from pallas_kernels.peer_all_reduce import (MAX_ELEMENTS, MAX_ROWS, ROW_WORDS, fits_rows, peer_all_reduce,
                                            peer_all_reduce_add_norm)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(len(jax.devices()) < 2 or jax.default_backend() != "gpu", reason="needs 2+ GPUs")]


def _sizes():
    n = len(jax.devices())
    return [s for s in (2, 4, 8) if s <= n]


def _pair(n, body):
    mesh = make_mesh(n)
    workspace = use_peer_all_reduce(mesh)
    use_peer_all_reduce(mesh, enable=False)  # models built later in this process keep XLA's all-reduce
    split = lambda f: jax.jit(jax.shard_map(lambda a: f(a[0])[None], mesh=mesh, in_specs=P(AXIS),  # noqa: E731
                                            out_specs=P(AXIS), check_vma=False))
    return split(body(lambda v: peer_all_reduce(v, workspace, AXIS))), split(body(lambda v: lax.psum(v, AXIS)))


def _check(n, got, want):
    if n == 2:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for rank in range(1, n):  # every rank holds the same sum
        np.testing.assert_array_equal(got[rank], got[0])


@pytest.mark.parametrize("n", _sizes())
def test_kernel_equals_psum_over_repeated_calls_of_changing_size(n):
    kernel, psum = _pair(n, lambda reduce: reduce)
    rng = np.random.default_rng(n)
    for shape in [(1, 4096), (16, 4096), (3, 1000), (1, 4096), (MAX_ELEMENTS // 4096, 4096), (7,), (1, 4096)] * 2:
        x = jnp.asarray(rng.standard_normal((n, *shape), np.float32))
        _check(n, np.asarray(kernel(x)), np.asarray(psum(x)))


@pytest.mark.parametrize("n", _sizes())
def test_chained_calls_in_a_device_loop_equal_psum(n):
    def body(reduce):
        def f(x):
            def step(i, x):
                for _ in range(5):
                    x = reduce(x * 0.5)
                    x = x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
                return x
            return lax.fori_loop(0, 6, step, x)
        return f

    kernel, psum = _pair(n, body)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((n, 2, 4096), np.float32))
    _check(n, np.asarray(kernel(x)), np.asarray(psum(x)))


@pytest.mark.parametrize("n", _sizes())
def test_collective_ops_through_peers_equal_the_references(n):
    """The pallas backend's ``all_reduce`` (bf16 summed in fp32 and rounded once: at 2 ranks psum's bf16 sum) and
    ``gather_last`` (a sum of placed blocks: the gather's values) against XLA's, with messages the kernel takes
    and ones past its limit (which go to XLA: then both sides are XLA's, checked only not to fail)."""
    mesh = make_mesh(n)
    workspace = use_peer_all_reduce(mesh)
    use_peer_all_reduce(mesh, enable=False)
    split = lambda f: jax.jit(jax.shard_map(lambda a: f(a[0])[None], mesh=mesh, in_specs=P(AXIS),  # noqa: E731
                                            out_specs=P(AXIS), check_vma=False))
    pallas, xla = backend.get("pallas"), backend.get("xla")
    rng = np.random.default_rng(n)
    for op in ("all_reduce", "gather_last"):
        kernel = split(lambda v, op=op: getattr(pallas, op)(v, axis_name=AXIS, peers=workspace))
        reference = split(lambda v, op=op: getattr(xla, op)(v, axis_name=AXIS))
        for dtype, shape in [(jnp.bfloat16, (1, 4096)), (jnp.float32, (1, 73448 // n)), (jnp.bfloat16, (3, 1000)),
                             (jnp.float32, (MAX_ELEMENTS // n + 8,))]:
            x = jnp.asarray(rng.standard_normal((n, *shape), np.float32), dtype)
            got, want = (np.asarray(f(x).astype(jnp.float32)) for f in (kernel, reference))
            if op == "gather_last" or n == 2 or dtype == jnp.float32:
                _check(n, got, want)
            else:  # NCCL's ring rounds each partial sum to bf16; the kernel rounds the fp32 sum once
                np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


# (rows, width): the fused kernel's rows of changing count and width, and ones it does not take (not a power
# of 2; too many rows), whose plain reductions move the other counters in between.
SHAPES = [(1, 4096), (16, 4096), (3, 1024), (1, 4096), (MAX_ROWS, ROW_WORDS), (1, 16), (5, 1000), (1, 4096),
          (MAX_ROWS + 1, 4096), (2, 4096)] * 2


@pytest.mark.parametrize("dtype,splits", [(jnp.bfloat16, 0), (jnp.float32, 0), (jnp.bfloat16, 4)],
                         ids=["bf16", "fp32", "bf16-split"])
def test_residual_add_norm_through_peers_equals_the_reference(dtype, splits):
    """``splits``: the partial sums as a row-parallel linear's K-split parts (``SplitSum [S, rows + 1, H]``, a
    padding row as ``matmul_parts`` leaves for one row), which the fused kernel adds as it reads them."""
    n = len(jax.devices())
    mesh = make_mesh(n)
    workspace = use_peer_all_reduce(mesh)
    use_peer_all_reduce(mesh, enable=False)
    rng = np.random.default_rng(n)

    def run(ns, peers, parts, residual, weight):
        def f(p, r):
            p, r = p[0], r[0]
            if splits:
                p = SplitSum(p, r.shape)
            if peers is not None and fits_rows(p, peers):  # the fused kernel at every row count it takes
                h, normed = peer_all_reduce_add_norm(p, r, 0.25, weight, eps=1e-6, workspace=peers, axis_name=AXIS)
            else:
                h, normed = ns.residual_add_norm(p, r, 0.25, weight, eps=1e-6, axis_name=AXIS, peers=peers)
            return jnp.stack([h, normed, ns.residual_add(p, normed, 0.5, axis_name=AXIS, peers=peers)])[None]
        return np.asarray(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS),
                                                check_vma=False))(parts, residual).astype(jnp.float32))

    for rows, width in SHAPES[:10] if splits else SHAPES:
        shape = (n, splits, rows + 1, width) if splits else (n, rows, width)
        parts = jnp.asarray(rng.standard_normal(shape, np.float32))
        # The residual stream is replicated: every rank holds the same
        residual = jnp.asarray(np.broadcast_to(rng.standard_normal((rows, width), np.float32) * 4, (n, rows, width)),
                               dtype)
        weight = jnp.asarray(rng.standard_normal(width), dtype)
        got = run(backend.get("pallas"), workspace, parts, residual, weight)
        want = run(backend.get("xla"), None, parts, residual, weight)
        tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5  # XLA rounds its own fusion of the add + norm
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{rows} rows of {width}")
        for rank in range(1, n):
            np.testing.assert_array_equal(got[rank], got[0])
