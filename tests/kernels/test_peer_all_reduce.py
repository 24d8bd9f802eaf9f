"""The peer-memory all-reduce (``pallas_kernels.peer_all_reduce``) where no GPU is: it and the fused
all-reduce + residual add + RMSNorm each lower to one Triton kernel for CUDA, the pallas backend chooses them
only when a workspace is given and the message fits, the address table round-trips, and a mesh of CPU
devices is refused with a clear error. Their results against ``lax.psum`` and the reference ops are checked
on GPUs: ``tests/kernels/test_gpu_peer_all_reduce.py``."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.parallel import AXIS, make_mesh, peer_workspace, use_peer_all_reduce
from pallas_kernels import backend
from pallas_kernels.matmul import SplitSum
from pallas_kernels.peer_all_reduce import (MAX_ELEMENTS, MAX_PARTS, MAX_ROWS, ONE_ROW_TILE, ROW_TILE, TILE,
                                            PeerWorkspace, peer_all_reduce, peer_all_reduce_add_norm)

WORKSPACE = PeerWorkspace((0x7F12_3456_7000, 0x7F98_7654_3000, 0x1_0000_0000))  # 3 ranks: a padded table
PALLAS = backend.get("pallas")


def _triton_calls(f, *args) -> list[str]:
    """The Triton custom calls of ``f`` lowered for CUDA (the lowering runs here; no GPU needed), each as
    ``"name XxY"`` (its grid)."""
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = []
    for line in text.splitlines():
        if "custom_call @__gpu$xla.gpu.triton(" in line:
            x, y = (re.search(rf"grid_{a} = (\d+)", line).group(1) for a in "xy")
            name = re.search(r'name = "(\w+)"', line).group(1)
            calls.append(f"{name} {x}x{y}")
    return calls


def _split(fn, n):
    mesh = make_mesh(n)
    return jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False)


def test_table_holds_each_address_as_high_and_low_words():
    table = WORKSPACE.table()
    assert table.shape == (4, 2) and table.dtype == np.uint32
    assert [(int(h) << 32) | int(lo) for h, lo in table[:3]] == list(WORKSPACE.addresses)
    assert not table[3].any()


@pytest.mark.parametrize("rows,width", [(1, 4096), (3, 1000)])
def test_kernel_lowers_to_one_triton_launch_per_call(rows, width):
    ws = PeerWorkspace(WORKSPACE.addresses[:2])
    f = _split(lambda a: peer_all_reduce(a[0], ws, AXIS)[None], 2)
    calls = _triton_calls(f, jnp.zeros((2, rows, width), jnp.float32))
    assert calls == [f"peer_all_reduce {-(-rows * width // TILE)}x1"]


@pytest.mark.parametrize("rows,width,tile", [(1, 4096, ONE_ROW_TILE), (1, 256, 256), (3, 512, ROW_TILE),
                                             (MAX_ROWS, 8192, ROW_TILE)])
def test_fused_kernel_lowers_to_one_launch_of_a_program_per_tile_of_each_row(rows, width, tile):
    """A lone row is cut in tiles of ONE_ROW_TILE, several rows in ROW_TILE's (at most the row)."""
    ws = PeerWorkspace(WORKSPACE.addresses)

    def f(a):
        return jnp.stack(peer_all_reduce_add_norm(a[0], a[0].astype(jnp.bfloat16), 0.5, jnp.ones(width), eps=1e-6,
                                                  workspace=ws, axis_name=AXIS))[None]
    calls = _triton_calls(_split(f, 3), jnp.zeros((3, rows, width), jnp.float32))
    assert calls == [f"peer_all_reduce_add_norm {rows}x{-(-width // tile)}"]


def test_pallas_residual_ops_choose_the_kernel_only_when_it_applies():
    ws = PeerWorkspace(WORKSPACE.addresses[:2])

    def layer(peers, rows, width=256):
        w = jnp.ones((width,), jnp.float32)

        def f(a):
            x, h = PALLAS.residual_add_norm(a[0], a[0], 0.5, w, eps=1e-6, axis_name=AXIS, peers=peers)
            return (PALLAS.residual_add(h, x, 0.5, axis_name=AXIS, peers=peers))[None]
        return _triton_calls(_split(f, 2), jnp.zeros((2, rows, width), jnp.float32))

    # one row: the reduction + add + norm in one kernel (a program a row: the width is one tile), then the
    # last layer's plain reduction (one program a TILE of the message) and XLA's add
    assert layer(ws, 1) == ["peer_all_reduce_add_norm 1x1", "peer_all_reduce 1x1"]
    assert layer(ws, 1, width=4096) == [f"peer_all_reduce_add_norm 1x{4096 // ONE_ROW_TILE}",
                                        f"peer_all_reduce {4096 // TILE}x1"]
    # 16 rows: the fused kernel; more rows than it fits: the plain kernel, then XLA's add + norm
    assert layer(ws, 16) == ["peer_all_reduce_add_norm 16x1", "peer_all_reduce 8x1"]
    assert layer(ws, MAX_ROWS + 3) == [f"peer_all_reduce {-(-(MAX_ROWS + 3) * 256 // TILE)}x1"] * 2
    assert layer(ws, 1, width=96) == ["peer_all_reduce 1x1"] * 2  # not a power-of-2 row
    assert layer(None, 4) == []  # no workspace: lax.psum
    assert layer(ws, MAX_ELEMENTS // 256 + 1) == []  # a prefill-sized message: lax.psum


def test_split_parts_reach_the_fused_kernel_unreduced():
    """A row-parallel linear's K-split parts (``SplitSum [S, 2, H]`` for one row) go to the fused kernel as they
    are — one launch, no reduction of XLA's before it; rows the fused kernel does not take are added first."""
    ws = PeerWorkspace(WORKSPACE.addresses[:2])
    w = jnp.ones((4096,), jnp.float32)

    def layer(rows, splits=8):
        def f(a):
            x, h = PALLAS.residual_add_norm(SplitSum(a[0], (rows, 4096)), jnp.zeros((rows, 4096)), 0.5, w, eps=1e-6,
                                            axis_name=AXIS, peers=ws)
            return h[None]
        parts = jnp.zeros((2, splits, max(rows, 2), 4096), jnp.float32)
        text = jax.jit(_split(f, 2)).trace(parts).lower(lowering_platforms=("cuda",)).as_text()
        return _triton_calls(_split(f, 2), parts), "stablehlo.reduce" in text

    assert layer(1) == ([f"peer_all_reduce_add_norm 1x{4096 // ONE_ROW_TILE}"], False)
    # more than MAX_PARTS parts (int4 down_proj's 32), or a count not a power of 2: XLA adds them, then the kernel
    assert layer(1, splits=4 * MAX_PARTS) == ([f"peer_all_reduce_add_norm 1x{4096 // ONE_ROW_TILE}"], True)
    assert layer(1, splits=3) == ([f"peer_all_reduce_add_norm 1x{4096 // ONE_ROW_TILE}"], True)
    assert layer(3) == ([f"peer_all_reduce_add_norm 3x{4096 // ROW_TILE}"], False)
    assert layer(MAX_ROWS + 1) == ([f"peer_all_reduce {(MAX_ROWS + 1) * 4096 // TILE}x1"], True)


def test_pallas_collective_ops_choose_the_kernel_only_when_it_applies():
    """``all_reduce`` and ``gather_last`` (``pallas_kernels.collectives``) go through the plain peer kernel for a
    float message within its limit (the gather's message is the whole result: size times the block), else XLA."""
    ws = PeerWorkspace(WORKSPACE.addresses[:2])

    def ops(name, x, peers=ws):
        return _triton_calls(_split(lambda a: getattr(PALLAS, name)(a[0], axis_name=AXIS, peers=peers)[None], 2), x)

    assert ops("all_reduce", jnp.zeros((2, 1, 4096), jnp.bfloat16)) == [f"peer_all_reduce {4096 // TILE}x1"]
    assert ops("all_reduce", jnp.zeros((2, 1, 4096), jnp.int32)) == []  # not a float: lax.psum
    assert ops("all_reduce", jnp.zeros((2, MAX_ELEMENTS + 1), jnp.float32)) == []
    assert ops("all_reduce", jnp.zeros((2, 1, 4096), jnp.float32), peers=None) == []
    half = MAX_ELEMENTS // 2
    assert ops("gather_last", jnp.zeros((2, 1, half), jnp.float32)) == [f"peer_all_reduce {MAX_ELEMENTS // TILE}x1"]
    assert ops("gather_last", jnp.zeros((2, 1, half + 1), jnp.float32)) == []  # 2 blocks past the limit


def test_pallas_collective_ops_without_a_workspace_equal_the_reference():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 10), np.float32))
    for name in ("all_reduce", "gather_last"):
        got, want = (np.asarray(_split(lambda a, ns=ns: getattr(ns, name)(a[0], axis_name=AXIS)[None], 2)(x))
                     for ns in (PALLAS, backend.get("xla")))
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got[0], np.concatenate([x[0], x[1]], axis=-1))  # the gather: rank 0's block first


def test_pallas_residual_ops_without_a_workspace_equal_the_reference():
    rng = np.random.default_rng(0)
    parts = jnp.asarray(rng.standard_normal((2, 3, 64), np.float32))
    residual = jnp.asarray(rng.standard_normal((2, 3, 64), np.float32))
    w = jnp.asarray(rng.standard_normal(64), jnp.float32)
    mesh = make_mesh(2)
    run = lambda ns: jax.shard_map(  # noqa: E731
        lambda p, r: jnp.stack(ns.residual_add_norm(p[0], r[0], 0.25, w, eps=1e-6, axis_name=AXIS))[None],
        mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS), check_vma=False)(parts, residual)
    got, want = np.asarray(run(PALLAS)), np.asarray(run(backend.get("xla")))
    np.testing.assert_array_equal(got, want)
    total = np.asarray(parts).sum(0)
    np.testing.assert_allclose(got[0, 0], np.asarray(residual[0]) + 0.25 * total, rtol=1e-6, atol=1e-6)


def test_kernel_refuses_what_it_cannot_sum():
    ws = PeerWorkspace(WORKSPACE.addresses[:2])
    with pytest.raises(TypeError, match="fp32"):
        _split(lambda a: peer_all_reduce(a[0], ws, AXIS)[None], 2)(jnp.zeros((2, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match="at most"):
        jax.jit(_split(lambda a: peer_all_reduce(a[0], ws, AXIS)[None], 2)).trace(
            jnp.zeros((2, MAX_ELEMENTS + 1), jnp.float32))
    with pytest.raises(ValueError, match="power-of-2 width"):
        jax.jit(_split(lambda a: peer_all_reduce_add_norm(a[0], a[0], 1.0, jnp.ones(96), eps=1e-6, workspace=ws,
                                                          axis_name=AXIS)[0][None], 2)).trace(
            jnp.zeros((2, 1, 96), jnp.float32))


def test_a_mesh_of_cpus_gets_no_workspace():
    mesh = make_mesh(2)
    with pytest.raises(MiniCPMError, match="--tp_all_reduce peer: .*GPU"):
        use_peer_all_reduce(mesh)
    assert peer_workspace(mesh) is None
