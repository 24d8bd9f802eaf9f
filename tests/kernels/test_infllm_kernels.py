"""InfLLM-v2 kernels (pallas_kernels/infllm/) and the backends' sparse ops: stage-1 scores and block
selection against a NumPy re-derivation of the published formulas, the Pallas kernels against their jnp
references (interpret mode), the decode path and the prefill split of the Pallas backend against the
general composition, a planted-block retrieval test of the selector, and the CUDA lowering of the decode
path. The model over them: ``tests/model/test_sparse_model.py``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minicpm_jax.config import SparseConfig
from minicpm_jax.infllm.attention import sparse_attention, tree_sparse_attention
from minicpm_jax.infllm.compressed import extend_compressed
from minicpm_jax.infllm.policy import geometry
from minicpm_jax.model.cache import KVCache, compressed_sizes
from pallas_kernels import backend, triton
from pallas_kernels.attention import attention_reference
from pallas_kernels.flash import merge_attention
from pallas_kernels.infllm import select as select_module
from pallas_kernels.infllm.common import compressed_visible, scores_config
from pallas_kernels.infllm.compress import compress_new_windows, compress_windows_reference
from pallas_kernels.infllm.decode import pool_select_attention, pool_select_attention_reference
from pallas_kernels.infllm.select import (
    pool_select_blocks,
    pool_select_blocks_reference,
    pool_select_blocks_tiled,
    select_top_blocks,
    select_top_blocks_reference,
)
from pallas_kernels.infllm.stage1 import (
    compressed_scores,
    compressed_scores_reference,
    compressed_scores_tiled,
    score_tile_rows,
)
from pallas_kernels.infllm.stage2 import (
    block_sparse_attention,
    block_sparse_attention_reference,
    local_window_attention,
    local_window_attention_reference,
)
from pallas_kernels.infllm.tree_merge import tree_merge_attention, tree_merge_attention_reference
from pallas_kernels.launch import KernelConfig
from pallas_kernels.topk import top_k
from tests.helpers import SMALL, abstract_gpu_mesh, random_tree
from tests.oracles import np_compress, np_compress_step

MAX_LEN = 128
XLA, PALLAS = backend.get("xla"), backend.get("pallas")


# ------------------------------------------------------------------------- NumPy re-derivation (oracle)


def np_scores(q: np.ndarray, k: np.ndarray, pos: int, sp: SparseConfig, scale: float) -> np.ndarray:
    """One query token ``q [G, D]`` (the heads of a group) at ``pos`` over keys ``k [L, D]`` (L > pos):
    ``score[j] = sum_h exp(q_h.K1[j]*scale - log sum_j' exp(q_h.K2[j']*scale))`` over whole windows at or
    before ``pos``; entries beyond stay 0."""
    k1 = np_compress(k, sp.kernel_size, sp.kernel_stride)
    k2 = np_compress(k, sp.kernel_size2, sp.kernel_stride2)
    out = np.zeros(len(k1))
    vis2 = [j for j in range(len(k2)) if j * sp.kernel_stride2 + sp.kernel_size2 - 1 <= pos]
    if not vis2:
        return out
    for h in range(q.shape[0]):
        s2 = np.array([q[h] @ k2[j] for j in vis2]) * scale
        lse = s2.max() + np.log(np.exp(s2 - s2.max()).sum())
        for j in range(len(k1)):
            if j * sp.kernel_stride + sp.kernel_size - 1 <= pos:
                out[j] += np.exp(q[h] @ k1[j] * scale - lse)
    return out


def np_selection(score: np.ndarray, pos: int, length: int, sp: SparseConfig) -> set[int]:
    """Blocks attended by a query at ``pos`` with ``length`` keys in the cache: a block scores the max
    over the compressed windows overlapping it; init and local blocks are forced; top
    ``topk + window/block`` among blocks up to the query's own."""
    q_blk = pos // sp.block_size
    n_blocks = -(-length // sp.block_size)
    scores = {}
    for b in range(n_blocks):
        if b < sp.init_blocks or q_blk - sp.window_size // sp.block_size <= b <= q_blk:
            scores[b] = np.inf
        elif b < q_blk:
            lo, hi = b * sp.block_size, (b + 1) * sp.block_size
            overl = [score[j] for j in range(len(score))
                     if j * sp.kernel_stride < hi and j * sp.kernel_stride + sp.kernel_size > lo]
            scores[b] = max(overl) if overl else -np.inf
    ranked = sorted(scores, key=lambda b: -scores[b])
    return set(ranked[: sp.topk + sp.window_size // sp.block_size])


def _random_caches(seed, b, kvh, s, d, sp: SparseConfig, planted=None):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((b, kvh, s, d)).astype(np.float32)
    if planted is not None:
        planted(k, rng)
    k1 = np.zeros((b, kvh, -(-s // sp.kernel_stride), d), np.float32)
    k2 = np.zeros((b, kvh, max(16, -(-s // sp.kernel_stride2)), d), np.float32)
    for i in range(b):
        for g in range(kvh):
            c1, c2 = np_compress(k[i, g], sp.kernel_size, sp.kernel_stride), np_compress(k[i, g], sp.kernel_size2,
                                                                                        sp.kernel_stride2)
            k1[i, g, : len(c1)], k2[i, g, : len(c2)] = c1, c2
    return k, k1, k2


def _score_kw(sp):
    return dict(kernel1=sp.kernel_size, stride1=sp.kernel_stride, kernel2=sp.kernel_size2, stride2=sp.kernel_stride2)


def select_blocks(scores, positions, lengths, sp: SparseConfig, num_blocks: int):
    """Stage-1 scores → the blocks attended under ``sp``, as the reference backend selects them (jnp pooling
    and forced blocks, the exact two-stage top-k)."""
    return pool_select_blocks_reference(scores, positions, lengths, top_k=top_k, **geometry(sp).select(num_blocks))


# ------------------------------------------------------------------------------------ stage 1 + selection


def test_stage1_scores_and_selection_match_numpy_formulas():
    sp = SMALL
    b, kvh, group, d, s = 2, 2, 4, 16, 96
    k, k1, k2 = _random_caches(0, b, kvh, s, d, sp)
    rng = np.random.default_rng(1)
    positions = np.array([[3, 15, 16, 40, 63, 95], [0, 30, 47, 48, 70, 94]], np.int32)
    lengths = np.array([96, 95], np.int32)
    q = (rng.standard_normal((b, positions.shape[1], kvh * group, d)) * 0.5).astype(np.float32)
    scale = d**-0.5
    ref = np.asarray(compressed_scores_reference(jnp.asarray(q), jnp.asarray(k1), jnp.asarray(k2),
                                                 jnp.asarray(positions), scale=scale, **_score_kw(sp)))
    pallas = np.asarray(compressed_scores(jnp.asarray(q), jnp.asarray(k1), jnp.asarray(k2), jnp.asarray(positions),
                                          scale=scale, interpret=True, **_score_kw(sp)))
    blocks = np.asarray(select_blocks(jnp.asarray(ref), jnp.asarray(positions), jnp.asarray(lengths), sp,
                                      -(-s // sp.block_size)))
    blocks_kernel = np.asarray(pool_select_blocks(jnp.asarray(ref), jnp.asarray(positions), jnp.asarray(lengths),
                                                  **geometry(sp).select(-(-s // sp.block_size))))
    np.testing.assert_array_equal(blocks_kernel, blocks)
    for i in range(b):
        for g in range(kvh):
            for t, pos in enumerate(positions[i]):
                want = np_scores(q[i, t, g * group:(g + 1) * group], k[i, g, : lengths[i]], pos, sp, scale)
                n = len(want)
                np.testing.assert_allclose(ref[i, g, t, :n], want, rtol=2e-5, atol=1e-7)
                visible = (np.arange(n) * sp.kernel_stride + sp.kernel_size - 1) <= pos
                np.testing.assert_allclose(pallas[i, g, t, :n][visible], want[visible], rtol=2e-5, atol=1e-7)
                got = set(int(x) for x in blocks[i, g, t] if x >= 0)
                assert got == np_selection(want, pos, lengths[i], sp), (i, g, t, pos)
                # ascending, valid entries first
                row = list(blocks[i, g, t])
                assert row == sorted(x for x in row if x >= 0) + [-1] * row.count(-1)


def np_pick(row: np.ndarray, limit: int, k: int) -> list[int]:
    """NumPy re-derivation of the pick: the k best entries by (score descending, +0.0 before -0.0, index
    ascending), those past ``limit`` dropped, ascending, padded with -1."""
    order = sorted(range(len(row)), key=lambda i: (-row[i], bool(np.signbit(row[i])), i))[:k]
    kept = sorted(i for i in order if i <= limit)
    return kept + [-1] * (k - len(kept))


def np_pool_select(s: np.ndarray, pos: int, length: int, *, k, kernel1, stride1, ratio, num_blocks, init_blocks,
                   local_blocks) -> list[int]:
    """NumPy re-derivation of one row's pooled selection from fine scores ``s [N1]``: entry ``j`` is worth
    ``s[j]`` if its window ends at or before ``pos``, 0 if it exists but is not visible, nothing if it does
    not exist; block ``b`` takes the best of entries ``ratio*b - 1 .. ratio*b + ratio - 1``; forced blocks
    first, then :func:`np_pick` with the query's block as the limit."""
    n_exist = min(len(s), (length - kernel1) // stride1 + 1 if length >= kernel1 else 0)
    q_blk = pos // (stride1 * ratio)
    row = np.full(num_blocks, -np.inf, np.float32)
    for b in range(num_blocks):
        vals = [s[j] if j * stride1 + kernel1 - 1 <= pos else 0.0
                for j in range(ratio * b - 1, ratio * b + ratio) if 0 <= j < n_exist]
        row[b] = max(vals) if vals else -np.inf
        if b < init_blocks or q_blk - local_blocks <= b <= q_blk:
            row[b] = np.inf
        if b > q_blk:
            row[b] = -np.inf
    return np_pick(row, q_blk, k)


@pytest.mark.parametrize("ratio,num_blocks,k,init_blocks,local_blocks", [
    (4, 16, 6, 1, 2), (3, 40, 12, 1, 2), (2, 20, 20, 2, 3), (4, 33, 7, 0, 0)])
def test_pool_select_kernel_matches_reference_and_numpy(ratio, num_blocks, k, init_blocks, local_blocks):
    """The pooling + selection kernel reads fine scores that hold NaN garbage wherever a query cannot see
    (the stage-1 kernel leaves those unwritten) and picks exactly what the reference (XLA pooling, forced
    blocks, top-k + sort) and a NumPy re-derivation pick: pool ratios 4, 3 (not a power of two) and 2, a
    row shorter than ``ratio * num_blocks``, block counts that are not powers of two, k = all blocks, no
    init or local blocks, batch rows with different lengths, and positions past the cached length (as the
    speculative tree path asks)."""
    stride1, kernel1 = 2, 4
    rng = np.random.default_rng(ratio * 100 + num_blocks)
    n1 = ratio * num_blocks - 3
    positions = np.array([np.arange(60, 69), np.arange(3, 12)], np.int32)
    positions = np.minimum(positions, stride1 * ratio * num_blocks - 1)
    lengths = np.array([66, 12], np.int32)  # row 0: queries 66.. sit past the cached length
    scores = np.round(rng.random((2, 2, positions.shape[1], n1)) * 8).astype(np.float32) / 8  # ties
    visible = np.asarray(compressed_visible(jnp.asarray(positions), n1, kernel=kernel1, stride=stride1))[:, None]
    scores = np.where(visible, scores, np.nan).astype(np.float32)
    kw = dict(k=k, kernel1=kernel1, stride1=stride1, ratio=ratio, num_blocks=num_blocks, init_blocks=init_blocks,
              local_blocks=local_blocks)
    args = (jnp.asarray(scores), jnp.asarray(positions), jnp.asarray(lengths))
    got = np.asarray(pool_select_blocks(*args, interpret=True, **kw))
    ref = np.asarray(pool_select_blocks_reference(*args, **kw))
    assert got.shape == (2, 2, positions.shape[1], k) and got.dtype == np.int32
    np.testing.assert_array_equal(got, ref)
    for i in range(2):
        for g in range(2):
            for t, pos in enumerate(positions[i]):
                assert got[i, g, t].tolist() == np_pool_select(scores[i, g, t], int(pos), int(lengths[i]), **kw), (
                    i, g, t)
    with pytest.raises(ValueError, match="k=0"):
        pool_select_blocks(*args, interpret=True, **{**kw, "k": 0})


@pytest.mark.parametrize("t", [1, 5, 20])
def test_pool_select_reads_the_stage1_kernel_tiles_in_place(t):
    """The selection kernel reads the stage-1 kernel's tiled output (16 tokens per tile; fewer than 16 tokens,
    a tree's verify, in 4-token tiles in 16-row tiles, the last tile partly past the tokens; one token per tile
    for decode; rows past the chunk) in place and picks what it picks from the plain layout."""
    sp = SMALL
    b, kvh, group, d, s = 2, 2, 4, 16, 96
    _, k1, k2 = _random_caches(5, b, kvh, s, d, sp)
    rng = np.random.default_rng(6)
    positions = np.stack([np.arange(70, 70 + t), np.arange(40, 40 + t)]).astype(np.int32)
    lengths = positions[:, -1] + 1
    q = jnp.asarray(rng.standard_normal((b, t, kvh * group, d)).astype(np.float32))
    kw = dict(scale=d**-0.5, **_score_kw(sp))
    args = (q, jnp.asarray(k1), jnp.asarray(k2), jnp.asarray(positions))
    tiled, tokens = compressed_scores_tiled(*args, interpret=True, **kw)
    assert tokens == min(scores_config(t).block_q, 1 << (t - 1).bit_length())
    assert tokens == {1: 1, 5: 4, 20: 16}[t]
    assert tiled.shape[2] == -(-t // tokens) * score_tile_rows(tokens)
    plain = compressed_scores(*args, interpret=True, **kw)
    sel = dict(k=sp.num_selected, kernel1=sp.kernel_size, stride1=sp.kernel_stride, ratio=sp.pool_ratio,
               num_blocks=s // sp.block_size, init_blocks=sp.init_blocks, local_blocks=sp.local_blocks)
    got = pool_select_blocks_tiled(tiled, jnp.asarray(positions), jnp.asarray(lengths), tokens=tokens,
                                   tile_rows=score_tile_rows(tokens), interpret=True, **sel)
    want = pool_select_blocks_reference(plain, jnp.asarray(positions), jnp.asarray(lengths), **sel)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("t", [1, 40])
def test_bf16_stage1_scores_are_stored_in_bf16(t):
    """bf16 queries: prefill tiles and one-token decode tiles (one row, the heads summed across the tile)
    store the stage-1 scores in bf16 (as InfLLM-v2's kernel; HF ranks bf16 scores), within bf16 rounding of
    the fp32 NumPy-checked reference, and the pooled selection from the stored scores (its search over 16-bit
    keys) equals the jnp reference's on the same scores. The chunk sits late in the cache, so the kernels
    run both their unmasked (wholly visible) and their causal-edge loops."""
    sp = SMALL
    b, kvh, group, d, s = 1, 2, 4, 16, 1024  # 64-key steps: K1 and K2 both have wholly visible ones
    _, k1, k2 = _random_caches(7, b, kvh, s, d, sp)
    rng = np.random.default_rng(8)
    positions = np.arange(s - t, s, dtype=np.int32)[None]
    q = rng.standard_normal((b, t, kvh * group, d)).astype(np.float32)
    kw = dict(scale=d**-0.5, **_score_kw(sp))
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    tiled, tokens = compressed_scores_tiled(bf(q), bf(k1), bf(k2), jnp.asarray(positions), interpret=True, **kw)
    assert tiled.dtype == jnp.bfloat16 and tiled.shape[2] == -(-t // tokens) * (1 if t == 1 else 16)
    got = compressed_scores(bf(q), bf(k1), bf(k2), jnp.asarray(positions), interpret=True, **kw)
    ref = compressed_scores_reference(jnp.asarray(bf(q), jnp.float32), jnp.asarray(bf(k1), jnp.float32),
                                      jnp.asarray(bf(k2), jnp.float32), jnp.asarray(positions), **kw)
    visible = compressed_visible(jnp.asarray(positions), ref.shape[-1], kernel=sp.kernel_size,
                                 stride=sp.kernel_stride)[:, None]
    err = jnp.max(jnp.abs(jnp.where(visible, got.astype(jnp.float32) - ref, 0.0))) / jnp.max(ref)
    assert 0 < float(jnp.max(ref)) and float(err) < 2e-2
    sel = dict(k=sp.num_selected, kernel1=sp.kernel_size, stride1=sp.kernel_stride, ratio=sp.pool_ratio,
               num_blocks=s // sp.block_size, init_blocks=sp.init_blocks, local_blocks=sp.local_blocks)
    lengths = jnp.asarray([s], jnp.int32)
    picked = pool_select_blocks_tiled(tiled, jnp.asarray(positions), lengths, tokens=tokens,
                                      tile_rows=score_tile_rows(tokens), interpret=True, **sel)
    want = pool_select_blocks_reference(got, jnp.asarray(positions), lengths, **sel)
    np.testing.assert_array_equal(np.asarray(picked), np.asarray(want))


# Every shape in both dtypes, and every search width in both dtypes (not the whole cross product: each case
# takes seconds in interpret mode).
_SELECT_SHAPES = [(128, 96), (130, 96), (64, 64), (300, 7), (16, 16)]
_SELECT_CASES = [(*_SELECT_SHAPES[i % 5], (1, 2, 4, 8)[i % 4], (np.float32, jnp.bfloat16)[i // 5]) for i in range(10)]


@pytest.mark.parametrize("nb,k,bits,dtype", _SELECT_CASES)
def test_select_top_blocks_kernel_matches_numpy_and_reference(nb, k, bits, dtype, monkeypatch):
    """Heavy ties, ±inf rows and entries, -0.0 vs +0.0, limits below / inside / past the row, a block
    count that is not a power of two (padded in the kernel) and k equal to the padded output width; for
    every width of the radix search's steps, over 32-bit keys (fp32 scores) and 16-bit ones (bf16)."""
    monkeypatch.setattr(select_module, "SELECT_SEARCH_BITS", bits)
    rng = np.random.default_rng(nb + k)
    x = rng.integers(-4, 4, (3, 4, nb)).astype(np.float32)  # [B, KVH, NB]-shaped leading dims
    x[0, 0] = -np.inf
    x[0, 1, 5:] = -np.inf
    x[0, 2, ::3] = np.inf
    x[0, 3] = 0.0
    x[0, 3, : nb // 2] = -0.0  # k of the zeros: -0.0 ranks below +0.0 (as in lax.top_k)
    x[1] = rng.standard_normal((4, nb)).astype(np.float32)
    x[2, :, : nb // 2] = 0.0
    limit = rng.integers(0, nb + 3, (3, 4)).astype(np.int32)
    limit[0, :2] = nb - 1
    limit[2, 0] = 0
    x = x.astype(dtype)
    got = np.asarray(select_top_blocks(jnp.asarray(x), jnp.asarray(limit), k=k, interpret=True))
    ref = np.asarray(select_top_blocks_reference(jnp.asarray(x), jnp.asarray(limit), k=k))
    x = x.astype(np.float32)  # (exact) for the NumPy pick
    assert got.shape == (3, 4, k) and got.dtype == np.int32
    np.testing.assert_array_equal(got, ref)
    for i in range(3):
        for j in range(4):
            assert got[i, j].tolist() == np_pick(x[i, j], int(limit[i, j]), k), (i, j)
    with pytest.raises(ValueError, match="k=0"):
        select_top_blocks(jnp.asarray(x), jnp.asarray(limit), k=0, interpret=True)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_select_top_blocks_search_edge_cases(bits, dtype, monkeypatch):
    """The radix search on rows that end it in each way: +inf entries alone reach k, fewer than k entries
    are finite or +inf (the k-th is -inf), one finite value only (fewer than k, and enough), scores of one
    magnitude with +inf forced entries, a tie straddling the k-th place, neighbours one ulp apart (the
    search runs to the last bit: bit 32 for fp32 scores, bit 16 for bf16 ones), negative neighbours."""
    monkeypatch.setattr(select_module, "SELECT_SEARCH_BITS", bits)
    nb, k = 256, 40
    rng = np.random.default_rng(7)
    base = (1e-3 * (1 + rng.random(nb))).astype(np.float32)  # one exponent range: 9+ shared leading bits
    rows = np.stack([base] * 8)
    rows[0, :50] = np.inf  # +inf alone reaches k
    rows[1, 30:] = -np.inf  # 30 finite < k: the k-th largest is -inf
    rows[2, 3:] = -np.inf
    rows[2, :3] = np.float32(0.5)  # one finite value, fewer than k
    rows[3, :] = np.float32(0.25)
    rows[3, 10:20] = np.inf  # one finite value, enough
    rows[4, ::9] = np.inf  # forced entries and one magnitude
    rows[5, 100:140] = rows[5, 100]  # a tie straddling the k-th place
    rows[5, :20] = np.inf
    rows[6] = np.float32(1.5e-3)  # (the odd entries one ulp above, below: the k-th differs in the last bit)
    rows[7, 200:] = -np.inf
    rows[7, :5] = np.inf
    rows = np.concatenate([rows, -rows[6:7]])  # row 8: negative scores (their keys' low bits flipped)
    rows = rows.astype(dtype)
    bits_view = rows[[6, 8]].view(np.uint32 if dtype == np.float32 else np.uint16)
    bits_view[:, 1::2] += 1  # neighbours one ulp apart (larger in magnitude)
    rows[[6, 8]] = bits_view.view(rows.dtype)
    limit = np.array([nb - 1, nb - 1, nb - 1, 15, nb - 1, 120, nb - 1, nb - 1, nb - 1], np.int32)
    got = np.asarray(select_top_blocks(jnp.asarray(rows), jnp.asarray(limit), k=k, interpret=True))
    for i in range(len(rows)):
        assert got[i].tolist() == np_pick(rows[i].astype(np.float32), int(limit[i]), k), i
    ref = select_top_blocks_reference(jnp.asarray(rows), jnp.asarray(limit), k=k)
    np.testing.assert_array_equal(got, np.asarray(ref))


def test_stage1_extra_coarse_key_joins_the_lse():
    """``extra_logits`` (a tree node's own coarse window) is one more coarse key: equal to putting that key
    into K2 for the reference, and the Pallas kernel agrees; -inf leaves the scores unchanged."""
    sp = SMALL
    b, kvh, group, d, s = 2, 2, 4, 16, 96
    k, k1, k2 = _random_caches(3, b, kvh, s, d, sp)
    rng = np.random.default_rng(4)
    positions = np.array([[40, 63, 70], [48, 90, 94]], np.int32)
    t, h = positions.shape[1], kvh * group
    q = (rng.standard_normal((b, t, h, d)) * 0.5).astype(np.float32)
    extra_key = rng.standard_normal((b, t, kvh, d)).astype(np.float32)
    scale = d**-0.5
    extra = np.einsum("btkgd,btkd->btkg", q.reshape(b, t, kvh, group, d), extra_key).reshape(b, t, h) * scale
    extra[1, 0] = -np.inf  # row without an extra key
    args = (jnp.asarray(q), jnp.asarray(k1), jnp.asarray(k2), jnp.asarray(positions))
    ref = np.asarray(compressed_scores_reference(*args, scale=scale, extra_logits=jnp.asarray(extra), **_score_kw(sp)))
    pallas = np.asarray(compressed_scores(*args, scale=scale, extra_logits=jnp.asarray(extra), interpret=True,
                                          **_score_kw(sp)))
    plain = np.asarray(compressed_scores_reference(*args, scale=scale, **_score_kw(sp)))
    for i in range(b):
        for j in range(t):
            # oracle: the key appended to K2 at a slot every query sees (position 0 window), one query at a time
            k2_plus = np.concatenate([k2[i:i + 1], extra_key[i:i + 1, j][:, :, None]], axis=2)
            pos = positions[i:i + 1, j:j + 1]
            n2 = k2.shape[2]
            vis_pos = pos if np.isfinite(extra[i, j]).all() else None
            want = np.asarray(compressed_scores_reference(
                jnp.asarray(q[i:i + 1, j:j + 1]), jnp.asarray(k1[i:i + 1]), jnp.asarray(k2_plus),
                jnp.asarray(pos), scale=scale, extra_logits=None, **_score_kw(sp)) if vis_pos is None else
                _with_visible_last(q[i:i + 1, j:j + 1], k1[i:i + 1], k2_plus, pos, scale, sp, n2))
            n = (pos[0, 0] - sp.kernel_size + 1) // sp.kernel_stride + 1
            np.testing.assert_allclose(ref[i, :, j, :n], want[0, :, 0, :n], rtol=2e-5, atol=1e-7)
            np.testing.assert_allclose(pallas[i, :, j, :n], want[0, :, 0, :n], rtol=2e-5, atol=1e-7)
    n = (positions[1, 0] - sp.kernel_size + 1) // sp.kernel_stride + 1
    np.testing.assert_allclose(ref[1, :, 0, :n], plain[1, :, 0, :n], rtol=1e-6)
    assert not np.allclose(ref[0, :, 0], plain[0, :, 0])


def _with_visible_last(q, k1, k2_plus, pos, scale, sp, n2):
    """Stage-1 scores in NumPy with every coarse key up to the query visible by the causal rule plus the
    appended last one (index n2) always visible."""
    b, t, h, d = q.shape
    kvh = k1.shape[1]
    qg = q.reshape(b, t, kvh, h // kvh, d).astype(np.float64)
    s1 = np.einsum("btkgd,bknd->bkgtn", qg, k1) * scale
    s2 = np.einsum("btkgd,bknd->bkgtn", qg, k2_plus) * scale
    ends2 = np.arange(k2_plus.shape[2]) * sp.kernel_stride2 + sp.kernel_size2 - 1
    vis2 = (ends2 <= pos[0, 0]) | (np.arange(k2_plus.shape[2]) == n2)
    lse = np.log(np.sum(np.exp(np.where(vis2, s2, -np.inf)), axis=-1, keepdims=True))
    ends1 = np.arange(k1.shape[2]) * sp.kernel_stride + sp.kernel_size - 1
    p = np.where(ends1 <= pos[0, 0], np.exp(s1 - lse), 0.0)
    return p.sum(axis=2)

def test_selector_always_finds_a_planted_block():
    """Synthetic needle: one old block's keys align with the query; it must be selected at every later
    position, for every seed, although it is neither an init nor a local block."""
    sp = SMALL
    d, s = 16, 128
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        direction = rng.standard_normal(d).astype(np.float32)
        direction /= np.linalg.norm(direction)
        needle = int(rng.integers(sp.init_blocks + 1, 8))

        def plant(k, rng):
            k *= 0.3
            k[0, :, needle * sp.block_size:(needle + 1) * sp.block_size] += 4.0 * direction

        k, k1, k2 = _random_caches(seed, 1, 1, s, d, sp, plant)
        positions = np.arange(96, 128, dtype=np.int32)[None]
        q = np.broadcast_to(3.0 * direction, (1, positions.shape[1], 4, d)) + 0.3 * rng.standard_normal(
            (1, positions.shape[1], 4, d))
        scores = compressed_scores_reference(jnp.asarray(q, jnp.float32), jnp.asarray(k1), jnp.asarray(k2),
                                             jnp.asarray(positions), scale=d**-0.5, **_score_kw(sp))
        blocks = np.asarray(select_blocks(scores, jnp.asarray(positions), jnp.asarray([s]), sp, s // sp.block_size))
        assert all(needle in row for row in blocks[0, 0]), (seed, needle)


# --------------------------------------------------------------------------------------------- stage 2


@pytest.mark.parametrize("splits", [None, 1, 3])
def test_block_sparse_kernel_matches_reference(splits):
    rng = np.random.default_rng(2)
    b, t, h, kvh, d, s, bs = 2, 5, 8, 2, 16, 100, 8  # s not a multiple of the block: clamped last block
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((3, b, kvh, s, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, b, kvh, s, d)), jnp.float32)
    positions = jnp.asarray([[3, 10, 30, 60, 99], [0, 1, 2, 50, 97]], jnp.int32)
    lengths = jnp.asarray([100, 98], jnp.int32)
    blocks = np.full((b, kvh, t, 6), -1, np.int32)
    for idx in np.ndindex(b, kvh, t):
        q_blk = int(positions[idx[0], idx[2]]) // bs
        chosen = sorted(rng.choice(q_blk + 1, size=min(q_blk + 1, int(rng.integers(1, 7))), replace=False))
        blocks[idx][: len(chosen)] = chosen
    blocks = jnp.asarray(blocks)
    ref = block_sparse_attention_reference(q, k, v, positions, lengths, blocks, scale=0.3, block_size=bs, layer=2)
    got = block_sparse_attention(q, k, v, positions, lengths, blocks, scale=0.3, block_size=bs, layer=2,
                                 num_splits=splits, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6)
    # return_lse: the log-sum-exp of each head's visible scores, from NumPy (-inf where nothing is visible)
    _, ref_lse = block_sparse_attention_reference(q, k, v, positions, lengths, blocks, scale=0.3, block_size=bs,
                                                  layer=2, return_lse=True)
    got_o, got_lse = block_sparse_attention(q, k, v, positions, lengths, blocks, scale=0.3, block_size=bs, layer=2,
                                            num_splits=splits, interpret=True, return_lse=True)
    np.testing.assert_allclose(np.asarray(got_o), np.asarray(ref), atol=2e-6)
    qn, kn, bn = np.asarray(q, np.float64), np.asarray(k[2], np.float64), np.asarray(blocks)
    for i, j, hh in np.ndindex(b, t, h):
        g = hh // (h // kvh)
        keys = [x for blk in bn[i, g, j] if blk >= 0 for x in range(blk * bs, min(blk * bs + bs, s))
                if x <= positions[i, j] and x < lengths[i]]
        want = np.log(np.sum(np.exp(0.3 * kn[i, g, keys] @ qn[i, j, hh]))) if keys else -np.inf
        np.testing.assert_allclose(np.asarray(ref_lse)[i, j, hh], want, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(got_lse)[i, j, hh], want, rtol=1e-5)
    # all blocks selected = dense causal attention
    every = jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), (b, kvh, t, 13))
    every = jnp.where(every <= positions[:, None, :, None] // bs, every, -1)
    every = jnp.sort(jnp.where(every < 0, 99, every), axis=-1)
    every = jnp.where(every == 99, -1, every)
    dense = attention_reference(q, k, v, positions, lengths, scale=0.3, layer=2)
    np.testing.assert_allclose(np.asarray(block_sparse_attention(q, k, v, positions, lengths, every, scale=0.3,
                                                                 block_size=bs, layer=2, interpret=True)),
                               np.asarray(dense), atol=2e-6)


@pytest.mark.parametrize("splits,k_blocks", [(None, 6), (1, 6), (3, 6), (2, 40)])
def test_pool_select_attention_kernel_matches_reference(splits, k_blocks):
    """Selection and stage 2 in one kernel (interpret mode) = the reference: XLA pooling, forced blocks,
    top-k + sort, then the block-sparse reference over the picks. Fine scores with heavy ties and NaN
    garbage wherever a query cannot see; batch rows of different lengths, a query past its row's cached
    length, a group of 4 heads padded to 16 rows, three tokens per row, a cache that is not a whole number
    of blocks; split counts whose programs unroll their picks (<= 4 each; 3 is rounded up to 4) or loop
    over them (1 split: all 6), and k larger than the block count (all 13 kept)."""
    rng = np.random.default_rng(21)
    b, t, h, kvh, d, s, bs, stride1, kernel1 = 2, 3, 8, 2, 16, 100, 8, 2, 4
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((3, b, kvh, s, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, b, kvh, s, d)), jnp.float32)
    positions = np.array([[60, 80, 99], [10, 40, 98]], np.int32)  # row 1 holds 98 keys: 98 is past them
    lengths = np.array([100, 98], np.int32)
    n1 = s // stride1
    scores = np.round(rng.random((b, kvh, t, n1)) * 6).astype(np.float32) / 6  # ties
    visible = np.asarray(compressed_visible(jnp.asarray(positions), n1, kernel=kernel1, stride=stride1))[:, None]
    scores = jnp.asarray(np.where(visible, scores, np.nan).astype(np.float32))
    kw = dict(scale=0.3, block_size=bs, k_blocks=k_blocks, kernel1=kernel1, stride1=stride1, init_blocks=1,
              local_blocks=2, layer=2)
    args = (q, k, v, scores, jnp.asarray(positions), jnp.asarray(lengths))
    want = pool_select_attention_reference(*args, **kw)
    got = pool_select_attention(*args, num_splits=splits, interpret=True, **kw)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)
    if splits is None:  # bf16 inputs (scores too: a 16-bit search): splits stored in bf16, merged in fp32
        q16, k16, v16, s16 = (a.astype(jnp.bfloat16) for a in (q, k, v, scores))
        got16 = pool_select_attention(q16, k16, v16, s16, *args[4:], interpret=True, **kw)
        want16 = pool_select_attention_reference(*(a.astype(jnp.float32) for a in (q16, k16, v16, s16)), *args[4:],
                                                 **kw)
        assert got16.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got16, np.float32), np.asarray(want16), atol=2e-2)
    # the reference is the composition it names: picks of pool_select_blocks_reference, attended
    picks = pool_select_blocks_reference(scores, jnp.asarray(positions), jnp.asarray(lengths), k=min(k_blocks, 13),
                                         kernel1=kernel1, stride1=stride1, ratio=bs // stride1, num_blocks=13,
                                         init_blocks=1, local_blocks=2)
    again = block_sparse_attention_reference(q, k, v, jnp.asarray(positions), jnp.asarray(lengths), picks, scale=0.3,
                                             block_size=bs, layer=2)
    np.testing.assert_array_equal(np.asarray(want), np.asarray(again))
    assert int(jnp.sum(picks[0, 0, 2] >= 0)) == min(k_blocks, 13)
    with pytest.raises(ValueError, match="at least one block"):
        pool_select_attention(q, k[:, :, :, :bs - 1], v[:, :, :, :bs - 1], scores, jnp.asarray(positions),
                              jnp.asarray(lengths), interpret=True, **kw)


@pytest.mark.parametrize("use_nope", [False, True])
def test_fused_decode_attention_equals_the_general_path(use_nope):
    """A Pallas decode step (one token per row) takes the four-launch decode path; it equals the general
    path (stage 1, selection kernel, block-sparse kernel), the jnp references of both, and HF-semantics
    sparse attention, for a batch of three rows at different lengths (one below the local window)."""
    cfg = dataclasses.replace(SMALL, use_nope=use_nope)
    rng = np.random.default_rng(31)
    b, h, kvh, d, s = 3, 8, 2, 16, MAX_LEN
    k, k1, k2 = _random_caches(32, b, kvh, s, d, cfg)
    v = rng.standard_normal((b, kvh, s, d)).astype(np.float32)
    lengths = jnp.asarray([128, 77, 20], jnp.int32)
    cache = KVCache(k=jnp.asarray(k)[None], v=jnp.asarray(v)[None], lengths=lengths, k1=jnp.asarray(k1)[None],
                    k2=jnp.asarray(k2)[None])
    q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.float32)
    q_select = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.float32) if use_nope else q
    pos = (lengths - 1)[:, None]
    kw = dict(scale=d**-0.5)
    want = sparse_attention(q, q_select, cache, 0, pos, lengths, cfg, kernels=XLA, **kw)
    got = sparse_attention(q, q_select, cache, 0, pos, lengths, cfg, kernels=PALLAS, **kw)
    # the general path for a decode token: the selection kernels, then the block-sparse kernel
    geo = geometry(cfg)
    blocks = triton.select_blocks(q_select, cache.k1, cache.k2, pos, lengths, geometry=geo,
                                  num_blocks=-(-s // cfg.block_size), layer=0, **kw)
    general = block_sparse_attention(q, cache.k, cache.v, pos, lengths, blocks, block_size=cfg.block_size, layer=0,
                                     **kw)
    # the decode path's reference: stage-1 scores, then selection + stage 2 in jnp
    scores = compressed_scores_reference(q_select, cache.k1, cache.k2, pos, layer=0, **geo.stage1(), **kw)
    reference = pool_select_attention_reference(q, cache.k, cache.v, scores, pos, lengths, layer=0,
                                                **geo.pool_select(), **kw)
    for other in (general, reference, got):
        np.testing.assert_allclose(np.asarray(other), np.asarray(want), atol=3e-6)
    # not a dense softmax in disguise: the long rows attend 5 of 16 (and 10) blocks
    dense = attention_reference(q, cache.k, cache.v, pos, lengths, scale=d**-0.5, layer=0)
    assert float(jnp.max(jnp.abs(got[:2] - dense[:2]))) > 1e-2


def test_decode_and_tree_paths_lower_for_cuda_without_a_gpu(monkeypatch):
    """Triton lowering of the decode path's four kernels (MiniCPM4-8B dims, a 128K cache) under an abstract
    H100: power-of-2 loads and supported primitives; and of a 12-node tree verify's (stage 1, the selection,
    stage 2, the tree merge reading the 12 unpadded tree keys as 16 rows)."""
    monkeypatch.setattr("pallas_kernels.launch.default_interpret", lambda: False)  # Triton, not interpret
    mesh = abstract_gpu_mesh()
    sp = SparseConfig()
    length = 131208
    n1, n2 = compressed_sizes(sp, length)
    spec = jax.ShapeDtypeStruct
    kv = spec((2, 1, 2, length, 128), jnp.bfloat16)
    cache = KVCache(k=kv, v=kv, lengths=spec((1,), jnp.int32), k1=spec((2, 1, 2, n1, 128), jnp.bfloat16),
                    k2=spec((2, 1, 2, n2, 128), jnp.bfloat16))

    def fn(q, cache, pos):
        with jax.sharding.use_abstract_mesh(mesh):
            return sparse_attention(q, q, cache, 1, pos, cache.lengths, sp, scale=128**-0.5, kernels=PALLAS)

    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(spec((1, 1, 32, 128), jnp.bfloat16), cache, spec((1, 1), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
    for name in ("minicpm_infllm_lse", "minicpm_infllm_scores", "minicpm_infllm_pool_select_attention",
                 "minicpm_merge_splits"):
        assert name in text, name

    def tree(q, tree_kv, mask, cache, prefix, depths):  # a 12-node verify's sparse attention
        with jax.sharding.use_abstract_mesh(mesh):
            return tree_sparse_attention(q, q, tree_kv, tree_kv, mask, cache, 1, prefix, depths, sp,
                                         scale=128**-0.5, kernels=PALLAS)

    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(tree).trace(spec((1, 12, 32, 128), jnp.bfloat16), spec((1, 12, 2, 128), jnp.bfloat16),
                                   spec((1, 12, 12), bool), cache, spec((1,), jnp.int32),
                                   spec((1, 12), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("minicpm_infllm_scores", "minicpm_pool_select_blocks", "minicpm_infllm_sparse_attention",
                 "minicpm_tree_merge_attention"):
        assert name in text, name


@pytest.mark.parametrize("bs,local,t,start", [(8, 2, 37, 50), (8, 3, 64, 0), (16, 1, 40, 77)])
def test_local_window_kernel_matches_reference_and_block_selection(bs, local, t, start):
    """The window kernel (query blocks of 16 straddling window starts, the causal diagonal and the valid
    end) against its reference, and the reference against block-sparse attention over exactly the
    window's blocks; merging it with the blocks below gives attention over the union (log-sum-exp)."""
    rng = np.random.default_rng(bs + local + t)
    b, h, kvh, d, s = 2, 4, 2, 16, 130
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, b, kvh, s, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, b, kvh, s, d)), jnp.float32)
    positions = jnp.asarray(np.stack([start + np.arange(t), min(start, 60) + 3 * np.arange(t) // 2]), jnp.int32)
    lengths = jnp.asarray([start + t, 110], jnp.int32)  # row 1: some queries past the valid end
    kw = dict(scale=0.25, block_size=bs, local_blocks=local, layer=1)
    ref, ref_lse = local_window_attention_reference(q, k, v, positions, lengths, **kw)
    got, got_lse = local_window_attention(q, k, v, positions, lengths, config=KernelConfig(16, 16, 4, 1),
                                          interpret=True, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-5)
    q_blk = np.asarray(positions) // bs
    n_sel = local + 1
    window = np.stack([q_blk - local + i for i in range(n_sel)], -1)  # [B, T, local + 1]
    window = np.sort(np.where(window < 0, 10**6, window), -1)
    window = np.where(window == 10**6, -1, window)
    blocks = jnp.asarray(np.broadcast_to(window[:, None], (b, kvh, t, n_sel)).astype(np.int32))
    want, want_lse = block_sparse_attention_reference(q, k, v, positions, lengths, blocks, return_lse=True, **{
        x: kw[x] for x in ("scale", "block_size", "layer")})
    np.testing.assert_allclose(np.asarray(ref), np.asarray(want), atol=2e-6)
    np.testing.assert_allclose(np.asarray(ref_lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
    # window + every block below it = dense causal attention
    nb = -(-s // bs)
    below = np.where(np.arange(nb)[None, None] < np.maximum(q_blk - local, 0)[..., None], np.arange(nb), -1)
    below = np.sort(np.where(below < 0, 10**6, below), -1)
    below = jnp.asarray(np.broadcast_to(np.where(below == 10**6, -1, below)[:, None], (b, kvh, t, nb)).astype(np.int32))
    far = block_sparse_attention(q, k, v, positions, lengths, below, return_lse=True, interpret=True,
                                 **{x: kw[x] for x in ("scale", "block_size", "layer")})
    dense = attention_reference(q, k, v, positions, lengths, scale=0.25, layer=1)
    np.testing.assert_allclose(np.asarray(merge_attention([far, (got, got_lse)])), np.asarray(dense), atol=2e-6)


def test_sparse_prefill_splits_the_local_window_and_matches_the_reference():
    """A Pallas prefill chunk attends its local windows with the window kernel and the selected blocks below
    them with the block-sparse kernel; the result equals the reference's single block-sparse pass, and the
    kernels' single pass (selection kernels, then the block-sparse kernel over every selected block)."""
    cfg = SMALL
    assert triton.splits_local_window(geometry(cfg), 40)
    assert not triton.splits_local_window(geometry(cfg), 1)
    assert not triton.splits_local_window(geometry(dataclasses.replace(cfg, topk=1)), 40)
    rng = np.random.default_rng(11)
    b, t, h, kvh, d, s = 1, 40, 4, 2, 16, MAX_LEN
    k, k1, k2 = _random_caches(12, b, kvh, s, d, cfg)
    v = rng.standard_normal((b, kvh, s, d)).astype(np.float32)
    cache = KVCache(k=jnp.asarray(k)[None], v=jnp.asarray(v)[None], lengths=jnp.asarray([s], jnp.int32),
                    k1=jnp.asarray(k1)[None], k2=jnp.asarray(k2)[None])
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    pos = jnp.asarray(s - t + np.arange(t), jnp.int32)[None]
    kw = dict(scale=d**-0.5)
    want = sparse_attention(q, q, cache, 0, pos, cache.lengths, cfg, kernels=XLA, **kw)
    got = sparse_attention(q, q, cache, 0, pos, cache.lengths, cfg, kernels=PALLAS, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-6)
    blocks = triton.select_blocks(q, cache.k1, cache.k2, pos, cache.lengths, geometry=geometry(cfg),
                                  num_blocks=-(-s // cfg.block_size), layer=0, **kw)
    whole = block_sparse_attention(q, cache.k, cache.v, pos, cache.lengths, blocks, block_size=cfg.block_size,
                                   layer=0, **kw)
    np.testing.assert_allclose(np.asarray(whole), np.asarray(want), atol=3e-6)


def test_compress_step_kernel_matches_reference_and_the_general_update():
    """The one-token compressed-cache update: Pallas kernel (interpret mode) = NumPy's window means = the
    general chunk update, for rows that complete a fine window, a coarse one, both, none, or did not grow."""
    rng = np.random.default_rng(9)
    k = jnp.asarray(rng.standard_normal((3, 5, 2, 64, 16)), jnp.float32)
    k1 = jnp.asarray(rng.standard_normal((3, 5, 2, 32, 16)), jnp.float32)
    k2 = jnp.asarray(rng.standard_normal((3, 5, 2, 16, 16)), jnp.float32)
    old, new = jnp.array([3, 15, 20, 40, 2]), jnp.array([4, 16, 20, 41, 3])
    kw = dict(layer=1, kernel1=4, stride1=2, kernel2=16, stride2=8)
    ref = np_compress_step(k, k1, k2, old, new, **kw)
    got = compress_new_windows(k, k1, k2, old, new, max_tokens=1, interpret=True, **kw)
    cache = extend_compressed(KVCache(k=k, v=k, lengths=old, k1=k1, k2=k2), 1, old, new, SMALL, max_tokens=1,
                              kernels=XLA)
    for r, g, general in zip(ref, got, (cache.k1, cache.k2)):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(general), r, rtol=1e-6, atol=1e-6)
    changed = [int(np.sum(np.any(r != np.asarray(b), axis=-1))) for r, b in zip(ref, (k1, k2))]
    assert changed == [2 * 2, 1 * 2]  # rows 0 (j=0) and 1 (j=6) in K1; row 1 (j=0) in K2; 2 KV heads each


@pytest.mark.parametrize("layer", [None, 1])
def test_compress_kernel_extends_a_speculative_path_in_every_layer_at_once(layer):
    """A few tokens at once (a speculative round's accepted path, max_tokens 8 = four fine windows of stride
    2): the kernel (interpret mode) writes exactly the windows each row completed, as NumPy's means of the
    keys, in one layer or every layer in one launch, and leaves every other entry as it was; the backend op
    takes the kernel and equals the jnp reference."""
    rng = np.random.default_rng(10)
    k = rng.standard_normal((3, 5, 2, 64, 16)).astype(np.float32)
    k1 = rng.standard_normal((3, 5, 2, 32, 16)).astype(np.float32)
    k2 = rng.standard_normal((3, 5, 2, 16, 16)).astype(np.float32)
    old, new = np.array([3, 15, 20, 40, 2]), np.array([4, 18, 20, 48, 10])  # 1, 2, 0, 4, 4 fine windows
    kw = dict(kernel1=4, stride1=2, kernel2=16, stride2=8)
    args = [jnp.asarray(x) for x in (k, k1, k2, old, new)]
    got = compress_new_windows(*args, layer=layer, max_tokens=8, interpret=True, **kw)
    want = [k1.copy(), k2.copy()]
    written = 0
    for w, kernel, stride in zip(want, (4, 16), (2, 8)):
        for lay in range(3) if layer is None else [layer]:
            for r in range(5):
                counts = [max(0, (n - kernel) // stride + 1) if n >= kernel else 0 for n in (old[r], new[r])]
                for j in range(*counts):
                    w[lay, r, :, j] = np_compress(k[lay, r, :, j * stride: j * stride + kernel], kernel, stride)[:, 0]
                    written += 1
    assert written == (1 + 2 + 4 + 4 + 1 + 1) * (3 if layer is None else 1)  # K2: rows 1 (j=0), 3 (j=4)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-6)
    ref = compress_windows_reference(*args, layer=layer, max_tokens=8, **kw)
    op = PALLAS.compress_windows(*args, geometry=geometry(SMALL), layer=layer, max_tokens=8)
    for o, r in zip(op, ref):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-6, atol=1e-6)


def _np_tree_merge(q, tree_k, tree_v, mask, out_p, lse_p, scale):
    """NumPy (float64): softmax over the union of the other keys (summarised by out_p, lse_p) and the tree keys
    each node sees: (e^lse_p·out_p + Σ_j e^s_j·v_j) / (e^lse_p + Σ_j e^s_j)."""
    b, t, h, d = q.shape
    kvh = tree_k.shape[2]
    out = np.zeros((b, t, h, d))
    for i in range(b):
        for n in range(t):
            for hh in range(h):
                g = hh // (h // kvh)
                s = tree_k[i, :, g].astype(np.float64) @ q[i, n, hh].astype(np.float64) * scale  # [T]
                w = np.where(mask[i, n], np.exp(s), 0.0)
                wp = np.exp(np.float64(lse_p[i, n, hh]))  # 0 for -inf
                num = wp * out_p[i, n, hh].astype(np.float64) + w @ tree_v[i, :, g].astype(np.float64)
                out[i, n, hh] = num / (wp + w.sum())
    return out


@pytest.mark.parametrize("t,dtype,tol", [(12, np.float32, 2e-5), (20, np.float32, 2e-5), (12, jnp.bfloat16, 3e-2)])
def test_tree_merge_kernel_matches_numpy(t, dtype, tol):
    """A tree verify's tail (each node's attention over its ancestors and itself, merged with the prefix's
    block attention by log-sum-exp): the Pallas kernel and the jnp reference against NumPy's softmax over the
    union of the keys; 12 and 20 nodes (keys padded to 16 and 32 in the kernel), rows whose prefix attention
    saw nothing."""
    b, kvh, group, d = 2, 2, 16, 16
    rng = np.random.default_rng(11)
    mask = np.stack([random_tree(rng, t, 3)[1], np.tril(np.ones((t, t), bool))])  # a tree and a chain
    q = rng.standard_normal((b, t, kvh * group, d)).astype(np.float32)
    tree_k = rng.standard_normal((b, t, kvh, d)).astype(np.float32)
    tree_v = rng.standard_normal((b, t, kvh, d)).astype(np.float32)
    out_p = rng.standard_normal((b, t, kvh * group, d)).astype(np.float32)
    lse_p = (rng.standard_normal((b, t, kvh * group)) * 2).astype(np.float32)
    lse_p[1, :4] = -np.inf  # no prefix key for these nodes: the tree part alone
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    args = (cast(q), cast(tree_k), cast(tree_v), jnp.asarray(mask), cast(out_p), jnp.asarray(lse_p))
    rounded = [np.asarray(a.astype(jnp.float32)) for a in args]
    want = _np_tree_merge(*rounded[:3], mask, rounded[4], lse_p, d**-0.5)
    for fn in (tree_merge_attention_reference, lambda *a, **k: tree_merge_attention(*a, interpret=True, **k)):
        got = fn(*args, scale=d**-0.5)
        assert got.shape == q.shape and got.dtype == args[0].dtype
        np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, atol=tol, rtol=tol)
    # Groups the kernel cannot tile go to the reference.
    small = (cast(q[:, :, :8]), cast(tree_k), cast(tree_v), jnp.asarray(mask), cast(out_p[:, :, :8]),
             jnp.asarray(lse_p[:, :, :8]))
    np.testing.assert_array_equal(np.asarray(triton.tree_merge_attention(*small, scale=0.25).astype(jnp.float32)),
                                  np.asarray(tree_merge_attention_reference(*small, scale=0.25).astype(jnp.float32)))
    with pytest.raises(ValueError, match="group"):
        tree_merge_attention(*small, scale=0.25, interpret=True)
