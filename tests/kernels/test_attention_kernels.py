"""Pallas attention kernels against the jnp reference (interpret mode on CPU, Triton on a GPU), their CUDA
lowering without a GPU, the split merge and the cache writer (the model with ``attention_impl="pallas"``
against ``"xla"``: ``tests/model/test_pallas_backend.py``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import attention_reference, decode_attention, decode_splits, prefill_attention
from pallas_kernels.cache_write import cache_write, cache_write_reference
from pallas_kernels.flash import merge_splits, merge_splits_rows
from pallas_kernels.infllm.stage2 import block_sparse_attention_reference, local_window_attention_reference
from pallas_kernels.launch import TUNED, KernelConfig
from pallas_kernels.tree_attention import tree_attention_reference
from tests.helpers import abstract_gpu_mesh, cache_write_inputs

SMALL = KernelConfig(block_q=16, block_k=16, num_warps=4, num_stages=2)


def _inputs(seed, b, t, h, kvh, s, d, dtype, layers=None):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    cache_shape = (b, kvh, s, d) if layers is None else (layers, b, kvh, s, d)
    return (jax.random.normal(kq, (b, t, h, d), jnp.float32).astype(dtype),
            jax.random.normal(kk, cache_shape, jnp.float32).astype(dtype),
            jax.random.normal(kv, cache_shape, jnp.float32).astype(dtype))


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _check(kernel, dtype, seed, b, t, h, kvh, s, d, offsets, valid, layer=None, **kw):
    """Kernel vs the fp32 reference on upcast inputs; rows whose queries see no key must be exact zeros."""
    layers = None if layer is None else layer + 2
    q, k, v = _inputs(seed, b, t, h, kvh, s, d, dtype, layers)
    offsets, valid = jnp.asarray(offsets, jnp.int32), jnp.asarray(valid, jnp.int32)
    positions = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    kv_lengths = offsets + valid
    scale = d**-0.5
    out = jax.jit(functools.partial(kernel, scale=scale, layer=layer, **kw))(q, k, v, positions, kv_lengths)
    up = lambda x: x.astype(jnp.float32)
    ref = attention_reference(up(q), up(k), up(v), positions, kv_lengths, scale=scale, layer=layer)
    assert out.shape == q.shape and out.dtype == q.dtype
    tol = 1e-5 if dtype == jnp.float32 else 1.5e-2
    assert _rel_err(out, ref) < tol
    sees_nothing = np.asarray((kv_lengths[:, None] == 0) | (positions < 0))
    assert np.all(np.asarray(out, np.float32)[sees_nothing] == 0.0)


# (b, t, h, kvh, s, d, offsets, valid tokens of the chunk)
PREFILL_CASES = [
    (1, 48, 4, 4, 96, 16, [0], [48]),                  # GQA 1, chunk of the prompt from 0, T not a block multiple
    (2, 32, 8, 2, 160, 32, [37, 100], [32, 19]),       # GQA 4, chunk offsets, padded last chunk in row 1
    (1, 40, 16, 1, 128, 16, [53], [33]),               # GQA 16, odd offset and valid length
    (3, 16, 4, 1, 64, 64, [0, 31, 48], [16, 5, 16]),   # head_dim 64, three rows at different offsets
    (1, 32, 2, 1, 80, 128, [17], [32]),                # head_dim 128
    (2, 24, 4, 2, 64, 16, [0, 0], [0, 24]),            # row 0: empty cache (queries see nothing)
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_prefill_kernel_matches_reference(case, dtype):
    _check(prefill_attention, dtype, case, *PREFILL_CASES[case], config=SMALL)


# (b, t, h, kvh, s, d, offsets, valid, num_splits)
DECODE_CASES = [
    (1, 1, 4, 4, 200, 16, [120], [1], 3),              # GQA 1, plain decode
    (2, 1, 16, 4, 256, 32, [77, 200], [1, 1], 5),      # GQA 4, rows at different lengths, more splits than blocks
    (1, 4, 16, 1, 300, 16, [251], [4], 4),             # GQA 16, 4 query tokens (tree verification), 64 rows
    (2, 16, 4, 1, 128, 64, [3, 90], [16, 9], 2),       # 16 query tokens, head_dim 64, padded tokens in row 1
    (1, 3, 6, 2, 96, 128, [40], [3], 1),               # head_dim 128, group of 3 (rows padded to 16), one split
    (2, 1, 8, 2, 64, 16, [0, 10], [0, 1], 4),          # row 0: empty cache
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_decode_kernel_matches_reference(case, dtype):
    *shape, splits = DECODE_CASES[case]
    _check(decode_attention, dtype, 100 + case, *shape, config=SMALL, num_splits=splits)


def test_decode_splits_are_powers_of_two_near_two_programs_per_core(monkeypatch):
    """The default split count is a power of 2 (so the decode merge is one Pallas launch): a program per key block
    of a short buffer (rounded up), else the power of 2 nearest to two programs per core; decode_attention with
    it (4 splits here, through merge_splits_rows) and with a count that is not a power of 2 (XLA's merge)
    equals the reference."""
    import pallas_kernels.attention as attention_module

    monkeypatch.setattr(attention_module, "num_cores", lambda: 132)
    assert decode_splits(1, 2, 1, 131072, 64) == 128  # 132 wanted
    assert decode_splits(3, 3, 1, 131072, 64) == 32  # 30 wanted: 32 is nearer than 16
    assert decode_splits(2, 3, 1, 131072, 64) == 32  # 44 wanted: 32 is nearer than 64
    assert decode_splits(1, 2, 1, 900, 64) == 16  # 15 blocks of 64 keys, rounded up
    assert decode_splits(1, 2, 1, 1096, 32) == 64  # 35 blocks of 32 keys (the e2e 1K row's cache)
    assert decode_splits(1, 2, 1, 48, 64) == 1
    for args in [(b, kvh, m, s, bk) for b in (1, 2, 3, 5) for kvh in (1, 2, 3, 8) for m in (1, 2)
                 for s in (64, 700, 8192) for bk in (32, 64, 128)]:
        n, blocks = decode_splits(*args), -(-args[3] // args[4])
        by_occupancy = -(-264 // (args[0] * args[1] * args[2]))
        assert n & (n - 1) == 0, (args, n)
        if blocks <= by_occupancy:  # a program per block, fewer than half of them without a key
            assert blocks <= n < 2 * blocks, (args, n)
        else:  # the power of 2 nearest to two programs per core
            assert 2 * by_occupancy / 3 <= n <= 4 * by_occupancy / 3, (args, n)
    monkeypatch.setattr(attention_module, "num_cores", lambda: 2)  # 4 splits by occupancy for one KV head
    for splits in (None, 3):
        _check(decode_attention, jnp.float32, 5, 1, 1, 4, 1, 300, 16, [250], [1], config=SMALL, num_splits=splits)


@pytest.mark.parametrize("kernel", [prefill_attention, decode_attention], ids=["prefill", "decode"])
def test_kernels_read_one_layer_of_the_stacked_cache(kernel):
    t = 20 if kernel is prefill_attention else 2
    _check(kernel, jnp.float32, 7, 2, t, 8, 2, 96, 32, [11, 60], [t, t - 1], layer=1, config=SMALL)


@pytest.mark.parametrize("kernel,d", [(prefill_attention, 64), (decode_attention, 128)], ids=["prefill", "decode"])
def test_kernels_with_the_tuned_launch_table(kernel, d):
    """The measured configs (larger blocks than the grid above) on a cache that is not a block multiple."""
    t = 40 if kernel is prefill_attention else 1
    _check(kernel, jnp.bfloat16, 9, 1, t, 8, 2, 300, d, [231], [t])


def test_decode_kernel_ignores_cache_past_the_valid_length():
    """NaN garbage past kv_lengths (stale slots) must not leak into the output: those keys are never read."""
    q, k, v = _inputs(3, 1, 1, 8, 2, 128, 32, jnp.float32)
    k = k.at[:, :, 50:].set(jnp.nan)
    v = v.at[:, :, 50:].set(jnp.nan)
    positions, lengths = jnp.array([[49]], jnp.int32), jnp.array([50], jnp.int32)
    for kernel in (decode_attention, prefill_attention):
        out = kernel(q, k, v, positions, lengths, scale=0.2, config=SMALL)
        ref = attention_reference(q, k[:, :, :50], v[:, :, :50], positions, lengths, scale=0.2)
        assert _rel_err(out, ref) < 1e-5


def test_merge_splits_kernel_matches_merge_splits():
    """The one-launch split merge (interpret mode) = the jnp merge: empty splits (-inf) and a row whose
    splits are all empty (zeros), fp32 and bf16 partial outputs, an output dtype; NumPy for one row."""
    rng = np.random.default_rng(5)
    o = jnp.asarray(rng.standard_normal((2, 3, 8, 5, 32)), jnp.float32)
    lse = rng.standard_normal((2, 3, 8, 5)).astype(np.float32) * 4
    lse[0, 1, 2] = -np.inf
    lse[1, 2, :, 3] = -np.inf
    lse = jnp.asarray(lse)
    for parts, out_dtype in ((o, jnp.float32), (o.astype(jnp.bfloat16), jnp.bfloat16)):
        got = merge_splits_rows(parts, lse, out_dtype=out_dtype, interpret=True)
        want = merge_splits(parts, lse)
        assert got.shape == want.shape and got.dtype == out_dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want.astype(out_dtype), np.float32),
                                   rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(merge_splits_rows(o, lse, interpret=True))[1, 2, 3], 0.0)
    w = np.exp2(np.asarray(lse)[0, 0, :, 1] - np.max(np.asarray(lse)[0, 0, :, 1]))
    want_row = (w / w.sum()) @ np.asarray(o)[0, 0, :, 1]
    np.testing.assert_allclose(np.asarray(merge_splits_rows(o, lse, interpret=True))[0, 0, 1], want_row, rtol=1e-5)
    with pytest.raises(ValueError, match="power-of-2 split count"):
        merge_splits_rows(o[:, :, :6], lse[:, :, :6], interpret=True)


def test_kernels_reject_unsupported_shapes():
    q, k, v = _inputs(0, 1, 17, 4, 2, 64, 24, jnp.float32)
    pos, lengths = jnp.zeros((1, 17), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="power-of-2 head_dim"):
        prefill_attention(q, k, v, pos, lengths, scale=1.0)
    q, k, v = _inputs(0, 1, 17, 4, 2, 64, 32, jnp.float32)
    with pytest.raises(ValueError, match="at most 16 query tokens"):
        decode_attention(q, k, v, pos, lengths, scale=1.0)
    with pytest.raises(ValueError, match="stacked"):
        decode_attention(q[:, :1], k, v, pos[:, :1], lengths, scale=1.0, layer=0)


@pytest.mark.parametrize("kernel,t", [(prefill_attention, 512), (prefill_attention, 40), (decode_attention, 1),
                                      (decode_attention, 16)], ids=["prefill512", "prefill40", "decode1", "decode16"])
@pytest.mark.parametrize("d", [64, 128])
def test_kernels_lower_for_cuda_without_a_gpu(kernel, t, d):
    """Triton lowering (power-of-2 loads, supported primitives) checked under an abstract H100."""
    mesh = abstract_gpu_mesh()
    spec = jax.ShapeDtypeStruct
    args = (spec((2, t, 32, d), jnp.bfloat16), spec((4, 2, 2, 1000, d), jnp.bfloat16),
            spec((4, 2, 2, 1000, d), jnp.bfloat16), spec((2, t), jnp.int32), spec((2,), jnp.int32))
    fn = functools.partial(kernel, scale=0.1, layer=3, interpret=False)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert ("minicpm_prefill_attention" if kernel is prefill_attention else "minicpm_decode_attention") in text


def test_tuned_table_covers_both_kernels():
    assert {k for k, _ in TUNED} == {"prefill", "decode"}
    for cfg in TUNED.values():
        assert cfg.block_k & (cfg.block_k - 1) == 0 and cfg.block_q & (cfg.block_q - 1) == 0


# ------------------------------------------------------------------------------------------- cache write


def _cache_write_inputs(seed, layers, b, h, s, d, t):
    """:func:`tests.helpers.cache_write_inputs` as arrays: bf16 caches, fp32 new tokens."""
    kc, vc, kn, vn, slots = cache_write_inputs(seed, layers, b, h, s, d, t)
    return (jnp.asarray(kc, jnp.bfloat16), jnp.asarray(vc, jnp.bfloat16), jnp.asarray(kn, jnp.float32),
            jnp.asarray(vn, jnp.float32), jnp.asarray(slots))


@pytest.mark.parametrize("t", [1, 5, 16, 80])
def test_cache_write_kernel_matches_scatter(t):
    """The one-launch cache writer (interpret mode) stores exactly what the two dropping scatters store: the
    valid tokens at their slots of the named layer (cast to the cache dtype), nothing else touched; 80
    tokens per row take the scatter itself."""
    kc, vc, kn, vn, slots = _cache_write_inputs(t, 3, 2, 3, 96, 16, t)
    out = jax.jit(functools.partial(cache_write, layer=1, interpret=True))(kc, vc, kn, vn, slots)
    ref = cache_write_reference(kc, vc, kn, vn, slots, layer=1)
    for o, r, c, new in zip(out, ref, (kc, vc), (kn, vn)):
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(r, np.float32))
        # An independent check of the reference itself: a NumPy loop over the tokens.
        expect = np.asarray(c, np.float32).copy()
        for bi in range(slots.shape[0]):
            for ti in range(t):
                sl = int(slots[bi, ti])
                if 0 <= sl < c.shape[3]:
                    expect[1, bi, :, sl] = np.asarray(new[bi, ti].astype(jnp.bfloat16), np.float32)
        np.testing.assert_array_equal(np.asarray(o, np.float32), expect)


def test_cache_write_kernel_rejects_mismatched_shapes():
    kc, vc, kn, vn, slots = _cache_write_inputs(0, 2, 1, 2, 32, 16, 4)
    with pytest.raises(ValueError, match="do not fit the cache"):
        cache_write(kc, vc, kn[..., :8], vn[..., :8], slots, layer=0, interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        cache_write(kc, vc, kn, vn, slots[:, :2], layer=0, interpret=True)


def test_references_take_bf16_batches_on_cpu():
    """The jnp references (the xla backend) run bf16 batches of 2 (XLA's CPU runtime once refused their
    batched bf16 x bf16 = f32 dot) and agree with their fp32 runs within bf16 rounding."""
    rng = np.random.default_rng(5)
    b, t, h, kvh, s, d = 2, 3, 8, 2, 32, 16
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((b, t, h, d), (b, kvh, s, d), (b, kvh, s, d)))
    pos = np.array([[20, 21, 22], [9, 10, 11]], np.int32)
    lengths = pos[:, -1] + 1
    blocks = np.broadcast_to(np.array([0, 2, -1], np.int32), (b, kvh, t, 3))
    mask = np.tril(np.ones((b, t, t), bool))
    calls = {
        "attention": lambda q, k, v: attention_reference(q, k, v, pos, lengths, scale=0.25),
        "tree": lambda q, k, v: tree_attention_reference(q, k, v, pos[:, 0], mask, scale=0.25),
        "block_sparse": lambda q, k, v: block_sparse_attention_reference(q, k, v, pos, lengths, blocks, scale=0.25,
                                                                         block_size=8),
        "window": lambda q, k, v: local_window_attention_reference(q, k, v, pos, lengths, scale=0.25, block_size=8,
                                                                   local_blocks=1)[0],
    }
    for name, call in calls.items():
        ref = np.asarray(call(*(jnp.asarray(x) for x in (q, k, v))))
        got = np.asarray(call(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))), np.float32)
        assert np.abs(got - ref).max() < 5e-2, name
