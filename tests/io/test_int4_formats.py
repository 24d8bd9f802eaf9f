"""int4 weight formats (minicpm_jax/io/int4_formats.py): Marlin checkpoint packing, fusion, GPTQ packing,
round-to-nearest quantization. The W4A16 kernel: ``tests/kernels/test_int4_kernels.py``.

Every check is against an oracle written independently of the code under test:

* the Marlin weight permutation, per element, from the closed-form formula of
  ``/work/shared/reference/int4_gptq_marlin.md`` §2.1, and the scale permutations from §2.2 (here);
* GPTQ packing / dequantization from the format definition (8 K rows per ``qweight`` word, lowest nibble
  first; 8 columns per ``qzeros`` word; v1 stores ``z − 1``), with bit loops (``tests/oracles.py``);
* round-to-nearest quantization from GPTQ's parameter rule (here).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from minicpm_jax.errors import MiniCPMError
from minicpm_jax.io import int4_formats as int4
from pallas_kernels import int4_matmul as kern
from tests.helpers import act_order_g_idx, random_gptq_tensors, random_weight
from tests.oracles import gptq_dequant_oracle, pack_cols_oracle, pack_rows_oracle


# ------------------------------------------------------------------------------------------ oracles
def marlin_pack_oracle(q: np.ndarray) -> np.ndarray:
    """Reference doc §2.1, one element at a time (Python ints, no reshape tricks)."""
    k_dim, n_dim = q.shape
    out = [[0] * (2 * n_dim) for _ in range(k_dim // 16)]
    for k in range(k_dim):
        kt, kk = k // 16, k % 16
        for n in range(n_dim):
            n64, j, blk, col = n // 64, (n % 64) // 16, (n % 16) // 8, n % 8
            t = (kk % 8) // 2
            lane = 4 * col + t
            e = 4 * blk + 2 * (kk // 8) + (kk % 2)
            p = 4 * (e % 2) + e // 2
            word = 128 * n64 + 4 * lane + j
            assert (out[kt][word] >> (4 * p)) & 0xF == 0, "two codes mapped to the same nibble"
            out[kt][word] |= int(q[k, n]) << (4 * p)
    return np.array(out, dtype=np.uint32).view(np.int32)


def marlin_scale_perm_grouped() -> list[int]:
    """§2.2 grouped: in each 64-column chunk old column c moves to position 8·(c%8) + c//8."""
    perm = [None] * 64
    for c in range(64):
        perm[8 * (c % 8) + c // 8] = c  # new[pos] = old[perm[pos]]
    return perm


# §2.2 per-channel: new[i] = old[sps[i]] inside each 32-column chunk (copied from the doc's list).
MARLIN_SCALE_PERM_SINGLE = [0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27,
                            4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15, 22, 23, 30, 31]


def permute_chunks_oracle(s: np.ndarray, perm: list[int]) -> np.ndarray:
    out = np.empty_like(s)
    c = len(perm)
    for g in range(s.shape[0]):
        for base in range(0, s.shape[1], c):
            for pos in range(c):
                out[g, base + pos] = s[g, base + perm[pos]]
    return out



# ------------------------------------------------------------------------------------- 1. Marlin
@pytest.mark.parametrize("shape", [(16, 64), (32, 128), (64, 192), (48, 256)])
def test_marlin_pack_matches_reference_formula(shape):
    q = np.random.default_rng(sum(shape)).integers(0, 16, shape).astype(np.uint8)
    packed = int4.marlin_pack(q)
    assert packed.dtype == np.int32 and packed.shape == (shape[0] // 16, 2 * shape[1])
    np.testing.assert_array_equal(packed, marlin_pack_oracle(q))
    np.testing.assert_array_equal(int4.marlin_unpack(packed), q)
    # and the other way: any int32 words round-trip through unpack → pack
    words = np.random.default_rng(1).integers(-2**31, 2**31, packed.shape, dtype=np.int64).astype(np.int32)
    np.testing.assert_array_equal(int4.marlin_pack(int4.marlin_unpack(words)), words)


def test_marlin_pack_each_code_lands_in_one_place():
    """A single non-zero code: exactly one nibble of the output is set, at the place §2.1 names."""
    q = np.zeros((32, 128), np.uint8)
    for k, n in [(0, 0), (1, 0), (8, 0), (2, 0), (0, 8), (0, 16), (0, 64), (17, 77), (31, 127)]:
        q[:] = 0
        q[k, n] = 0xA
        packed = int4.marlin_pack(q).view(np.uint32)
        oracle = marlin_pack_oracle(q).view(np.uint32)
        assert np.count_nonzero(packed) == 1
        np.testing.assert_array_equal(packed, oracle)


@pytest.mark.parametrize("bad", [(24, 64), (32, 96), (8, 128), (32, 32)])
def test_marlin_pack_bad_shapes(bad):
    with pytest.raises(MiniCPMError, match="K % 16 == 0 and N % 64 == 0"):
        int4.marlin_pack(np.zeros(bad, np.uint8))


def test_marlin_scale_permutations():
    rng = np.random.default_rng(4)
    grouped = rng.standard_normal((3, 192)).astype(np.float32)
    got = int4.marlin_permute_scales(grouped, per_channel=False)
    np.testing.assert_array_equal(got, permute_chunks_oracle(grouped, marlin_scale_perm_grouped()))
    np.testing.assert_array_equal(int4.marlin_unpermute_scales(got, per_channel=False), grouped)
    # the 8×8 transpose, spelled out for one chunk
    chunk = np.arange(64, dtype=np.float32)[None]
    np.testing.assert_array_equal(int4.marlin_permute_scales(chunk, False), chunk.reshape(8, 8).T.reshape(1, 64))

    single = rng.standard_normal((1, 128)).astype(np.float32)
    got = int4.marlin_permute_scales(single, per_channel=True)
    np.testing.assert_array_equal(got, permute_chunks_oracle(single, MARLIN_SCALE_PERM_SINGLE))
    np.testing.assert_array_equal(int4.marlin_unpermute_scales(got, per_channel=True), single)
    assert not np.array_equal(got, single)


# ------------------------------------------------------------------------------------- 2. fusion
@pytest.mark.parametrize("act_order", [False, True])
def test_fused_projections_equal_concatenated_parts(act_order):
    rng = np.random.default_rng(5)
    k, gs = 128, 32
    g_idx = act_order_g_idx(rng, k, gs) if act_order else None
    # q (asym) / k (sym) / v (sym): mixing sym and asym parts fills the sym zeros with 8
    parts = [random_weight(rng, k, n, gs, sym=sym) for n, sym in ((128, False), (64, True), (64, True))]
    if g_idx is not None:
        for p in parts:
            p.g_idx = g_idx
    fused = int4.concat_columns(parts)
    assert fused.shape == (k, 256)
    np.testing.assert_array_equal(fused.dequantize(), np.concatenate([p.dequantize() for p in parts], axis=1))

    fused_e = int4.to_engine(fused)
    part_e = [int4.to_engine(p) for p in parts]
    # a word packs 8 rows of one column: the parts' words concatenate to the fused words
    np.testing.assert_array_equal(fused_e["qweight"], np.concatenate([e["qweight"] for e in part_e], axis=1))
    np.testing.assert_array_equal(fused_e["scales"], np.concatenate([e["scales"] for e in part_e], axis=1))
    zeros = [e.get("zeros", np.full(e["scales"].shape, 8, np.float32)) for e in part_e]
    np.testing.assert_array_equal(fused_e["zeros"], np.concatenate(zeros, axis=1))
    if act_order:
        for e in part_e:
            np.testing.assert_array_equal(fused_e["perm"], e["perm"])
    else:
        assert "perm" not in fused_e

    # the fused matmul is the parts' matmuls side by side (jnp reference)
    x = jnp.asarray(rng.standard_normal((2, k)).astype(np.float32))
    fused_y = kern.int4_matmul_reference(x, **fused_e, group_size=gs)
    part_y = [kern.int4_matmul_reference(x, **e, group_size=gs) for e in part_e]
    np.testing.assert_allclose(fused_y, np.concatenate(part_y, axis=1), rtol=1e-6, atol=1e-6)

    # split_columns inverts concat_columns (sym parts come back with explicit zeros of 8)
    for p, s in zip(parts, int4.split_columns(fused, [128, 64, 64])):
        np.testing.assert_array_equal(s.q, p.q)
        np.testing.assert_array_equal(s.scales, p.scales)
        np.testing.assert_array_equal(s.g_idx, p.g_idx)
        np.testing.assert_array_equal(s.dequantize(), p.dequantize())


def test_fused_all_sym_and_split_round_trip():
    rng = np.random.default_rng(6)
    gate, up = random_weight(rng, 64, 128, 32), random_weight(rng, 64, 64, 32)
    fused = int4.concat_columns([gate, up])
    assert fused.zeros is None
    f = int4.to_engine(fused)
    e = [int4.to_engine(p) for p in (gate, up)]
    assert set(f) == {"qweight", "scales"}
    np.testing.assert_array_equal(f["qweight"], np.concatenate([x["qweight"] for x in e], axis=1))
    g2, u2 = int4.split_columns(fused, [128, 64])
    for a, b in ((g2, gate), (u2, up)):
        assert a.zeros is None and a.group_size == b.group_size
        np.testing.assert_array_equal(a.q, b.q)
        np.testing.assert_array_equal(a.scales, b.scales)


def test_concat_columns_rejects_mismatched_parts():
    rng = np.random.default_rng(7)
    a = random_weight(rng, 64, 64, 32)
    with pytest.raises(MiniCPMError, match="group_size and g_idx"):
        int4.concat_columns([a, random_weight(rng, 64, 64, 16)])
    with pytest.raises(MiniCPMError, match="group_size and g_idx"):
        int4.concat_columns([a, random_weight(rng, 64, 64, 32, act_order=True)])


def test_to_engine_from_engine_round_trip():
    rng = np.random.default_rng(8)
    w = random_weight(rng, 128, 128, 32, sym=False, act_order=True)
    e = int4.to_engine(w)
    back = int4.from_engine(e, 32)
    np.testing.assert_array_equal(back.q, w.q)
    np.testing.assert_array_equal(back.g_idx, w.g_idx)
    np.testing.assert_array_equal(back.dequantize(), w.dequantize())


# ----------------------------------------------------------------------------------- 3. GPTQ
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("gs,act_order", [(32, True), (64, False), (128, True), (-1, False)])
def test_gptq_unpack_matches_format_definition(fmt, sym, gs, act_order):
    rng = np.random.default_rng([len(fmt), sym, gs % 1000, act_order])
    k, n = 256, 64
    q, qweight, qzeros, scales, g_idx = random_gptq_tensors(rng, k, n, gs, sym=sym, fmt=fmt, act_order=act_order)
    assert qweight.dtype == np.int32 and qweight.shape == (k // 8, n) and qzeros.shape == (scales.shape[0], n // 8)
    if sym:
        assert np.all(qzeros.view(np.uint32) == (0x77777777 if fmt == "gptq" else 0x88888888))
    w = int4.gptq_unpack(qweight, qzeros, scales, g_idx, group_size=gs, sym=sym, checkpoint_format=fmt)
    assert w.group_size == (k if gs == -1 else gs)
    assert (w.zeros is None) == sym
    np.testing.assert_array_equal(w.q, q)
    np.testing.assert_array_equal(w.g_idx, g_idx)
    np.testing.assert_allclose(w.dequantize(), gptq_dequant_oracle(qweight, qzeros, scales, g_idx, fmt), rtol=1e-6)
    if sym:  # sym checkpoints may also come without qzeros at all
        w2 = int4.gptq_unpack(qweight, None, scales, g_idx, group_size=gs, sym=True, checkpoint_format=fmt)
        np.testing.assert_array_equal(w2.dequantize(), w.dequantize())


def test_gptq_unpack_v1_zero_quirk_and_default_g_idx():
    """v1: a stored nibble z' means z = z' + 1 (so 15 → 16); v2 reads it as is. g_idx=None → k // gs."""
    qweight = pack_rows_oracle(np.full((8, 8), 3))
    qzeros = pack_cols_oracle(np.array([[0, 1, 7, 8, 14, 15, 15, 0]]))
    scales = np.ones((1, 8), np.float16)
    v1 = int4.gptq_unpack(qweight, qzeros, scales, None, group_size=8, sym=False, checkpoint_format="gptq")
    v2 = int4.gptq_unpack(qweight, qzeros, scales, None, group_size=8, sym=False, checkpoint_format="gptq_v2")
    np.testing.assert_array_equal(v1.zeros[0], [1, 2, 8, 9, 15, 16, 16, 1])
    np.testing.assert_array_equal(v2.zeros[0], [0, 1, 7, 8, 14, 15, 15, 0])
    np.testing.assert_array_equal(v1.dequantize()[0], [2, 1, -5, -6, -12, -13, -13, 2])
    np.testing.assert_array_equal(v1.g_idx, np.zeros(8))


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_pack_round_trip(fmt, sym):
    rng = np.random.default_rng(9)
    k, n, gs = 128, 64, 32
    w = random_weight(rng, k, n, gs, sym=sym, act_order=True)
    if not sym:  # v1 stores z − 1 in a nibble: true zeros 1..16 (v2: 0..15) are representable
        w.zeros = rng.integers(1, 16, w.scales.shape).astype(np.float32) if fmt == "gptq" else w.zeros
    t = int4.gptq_pack(w, fmt)
    assert t["qweight"].dtype == np.int32 and t["qzeros"].dtype == np.int32 and t["scales"].dtype == np.float16
    np.testing.assert_array_equal(t["qweight"], pack_rows_oracle(w.q))
    z = np.full(w.scales.shape, 8) if sym else w.zeros.astype(np.int64)
    np.testing.assert_array_equal(t["qzeros"], pack_cols_oracle(z - (1 if fmt == "gptq" else 0)))
    back = int4.gptq_unpack(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group_size=gs, sym=sym,
                            checkpoint_format=fmt)
    np.testing.assert_array_equal(back.q, w.q)
    np.testing.assert_array_equal(back.g_idx, w.g_idx)
    np.testing.assert_array_equal(back.scales, w.scales.astype(np.float16).astype(np.float32))
    if sym:
        assert back.zeros is None
    else:
        np.testing.assert_array_equal(back.zeros, w.zeros)


def test_int4_pack_helpers_match_oracles():
    rng = np.random.default_rng(10)
    q = rng.integers(0, 16, (64, 40)).astype(np.uint8)
    np.testing.assert_array_equal(int4.pack_rows(q), pack_rows_oracle(q))
    np.testing.assert_array_equal(int4.unpack_rows(pack_rows_oracle(q)), q)
    np.testing.assert_array_equal(int4.pack_cols(q), pack_cols_oracle(q))
    np.testing.assert_array_equal(int4.unpack_cols(pack_cols_oracle(q)), q)
    with pytest.raises(MiniCPMError, match="multiple of 8"):
        int4.pack_rows(q[:60])


def test_sort_by_group():
    rng = np.random.default_rng(11)
    w = random_weight(rng, 256, 64, 64, sym=False, act_order=True)
    s, perm = int4.sort_by_group(w)
    assert perm is not None and perm.dtype == np.int32 and s.trivial_g_idx and not w.trivial_g_idx
    np.testing.assert_array_equal(np.sort(perm), np.arange(256))
    np.testing.assert_array_equal(w.g_idx[perm], np.arange(256) // 64)  # groups are contiguous blocks
    x = rng.standard_normal((3, 256))
    np.testing.assert_allclose(x[:, perm] @ s.dequantize(), x @ w.dequantize(), rtol=1e-10, atol=1e-10)
    # already sorted: returned unchanged without a perm
    plain = random_weight(rng, 128, 64, 32)
    same, none = int4.sort_by_group(plain)
    assert same is plain and none is None
    # uneven groups (31 and 33 rows) cannot be folded into contiguous blocks of group_size
    bad = random_weight(rng, 128, 64, 32)
    bad.g_idx[0] = 1
    with pytest.raises(MiniCPMError, match="cannot be folded"):
        int4.sort_by_group(bad)


# ------------------------------------------------------------------------------------- 4. errors
def _good_tensors():
    rng = np.random.default_rng(12)
    _, qweight, qzeros, scales, g_idx = random_gptq_tensors(rng, 64, 16, 32, sym=False, fmt="gptq", act_order=False)
    return dict(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx)


@pytest.mark.parametrize("change,kwargs,match", [
    (dict(scales=np.ones((3, 16), np.float16)), {},
     r"scales \(layers.0.q_proj\) has shape \[3, 16\], expected \[2, 16\]"),
    (dict(scales=np.ones((2, 8), np.float16)), {}, r"scales .*expected \[2, 16\]"),
    (dict(qweight=np.zeros((8, 16), np.uint32)), {}, r"qweight \(layers.0.q_proj\) must be int32"),
    (dict(qweight=np.zeros((8, 16), np.int64)), {}, r"qweight .* must be int32"),
    (dict(qweight=np.zeros(128, np.int32)), {}, r"qweight .* must be int32 \[K/8, N\]"),
    ({}, dict(group_size=48), r"group_size 48 does not divide in_features 64"),
    ({}, dict(group_size=0), r"group_size 0 does not divide"),
    (dict(g_idx=np.full(64, 2, np.int32)), {}, r"g_idx \(layers.0.q_proj\) must be \[64\] group indices below 2"),
    (dict(g_idx=np.full(64, -1, np.int32)), {}, r"g_idx .* below 2"),
    (dict(g_idx=np.zeros(32, np.int32)), {}, r"g_idx .* must be \[64\]"),
    (dict(qzeros=np.zeros((2, 4), np.int32)), {}, r"qzeros .* has shape \[2, 4\], expected \[2, 2\]"),
    ({}, dict(sym=True), r"qzeros \(layers.0.q_proj\) are not all 8 although the config says sym=true"),
    (dict(qzeros=None), {}, r"missing qzeros \(layers.0.q_proj\).*sym=false"),
    ({}, dict(checkpoint_format="awq"), r"unsupported checkpoint_format 'awq'"),
])
def test_gptq_unpack_errors(change, kwargs, match):
    args = {**_good_tensors(), **change}
    kw = {**dict(group_size=32, sym=False, checkpoint_format="gptq", name="layers.0.q_proj"), **kwargs}
    with pytest.raises(MiniCPMError, match=match):
        int4.gptq_unpack(args["qweight"], args["qzeros"], args["scales"], args["g_idx"], **kw)


def test_gptq_unpack_sym_rejects_v2_sevens():
    """sym=true with v2 zeros of 7 (i.e. a v1 checkpoint mislabelled v2) is caught."""
    rng = np.random.default_rng(13)
    _, qweight, qzeros, scales, g_idx = random_gptq_tensors(rng, 64, 16, 32, sym=True, fmt="gptq", act_order=False)
    with pytest.raises(MiniCPMError, match="not all 8"):
        int4.gptq_unpack(qweight, qzeros, scales, g_idx, group_size=32, sym=True, checkpoint_format="gptq_v2")


# -------------------------------------------------------------------------------------- RTN
def rtn_oracle(w: np.ndarray, gs: int, sym: bool):
    """GPTQ's Quantizer rule per (group, column), written as plain loops over the groups and columns."""
    k, n = w.shape
    g_count = k // gs
    q = np.zeros((k, n), np.uint8)
    s = np.zeros((g_count, n), np.float32)
    z = np.zeros((g_count, n), np.float32)
    for g in range(g_count):
        for c in range(n):
            v = w[g * gs:(g + 1) * gs, c].astype(np.float32)
            lo, hi = min(float(v.min()), 0.0), max(float(v.max()), 0.0)
            if sym:
                amax = max(abs(lo), hi)
                lo, hi = (-amax if lo < 0 else lo), amax
            if lo == 0 and hi == 0:
                lo, hi = -1.0, 1.0
            scale = np.float32((np.float32(hi) - np.float32(lo)) / np.float32(15))
            zero = np.float32(8) if sym else np.float32(np.rint(np.float32(-lo) / scale))
            s[g, c], z[g, c] = scale, zero
            q[g * gs:(g + 1) * gs, c] = np.clip(np.rint(v / scale) + zero, 0, 15)
    return q, s, z


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("gs", [32, -1])
def test_rtn_quantize(sym, gs):
    rng = np.random.default_rng(14)
    k, n = 128, 48
    w = (rng.standard_normal((k, n)) * rng.uniform(0.01, 0.1, n)).astype(np.float32)
    w[:32, 0] = 0.0  # an all-zero group (or part of the per-channel column)
    if not sym:
        w[32:64, 1] = np.abs(w[32:64, 1])  # a group with no negative weight: lo widened to 0, z = 0
    r = int4.rtn_quantize(w, group_size=gs, sym=sym)
    real_gs = k if gs == -1 else gs
    q, s, z = rtn_oracle(w, real_gs, sym)
    assert r.group_size == real_gs and r.trivial_g_idx
    assert (r.zeros is None) == sym
    np.testing.assert_allclose(r.scales, s, rtol=1e-6)
    if not sym:
        np.testing.assert_array_equal(r.zeros, z)
    np.testing.assert_array_equal(r.q, q)
    if sym and gs == 32:
        np.testing.assert_allclose(r.scales[1:, 0], 2 * np.abs(w[32:, 0]).reshape(3, 32).max(1) / 15, rtol=1e-6)
        np.testing.assert_array_equal(r.scales[0, 0], np.float32(2 / 15))  # all-zero group: lo, hi = -1, 1
    err = np.abs(r.dequantize() - w)
    assert np.all(err <= r.scales[r.g_idx] * (0.5 + 1e-5))
    assert 0 <= r.q.min() and r.q.max() <= 15
    with pytest.raises(MiniCPMError, match="does not divide"):
        int4.rtn_quantize(w, group_size=48)


# -------------------------------------------------------------------------------------- 5. kernel
