"""InfLLM-v2 kernels on the GPU (``pytest -m gpu``): the Triton-compiled kernels at MiniCPM4-8B attention
dims against their jnp references, and the Pallas backend's decode path and prefill split against the
general composition of the kernels. The sparse model on the GPU: ``tests/model/test_gpu_sparse_model.py``."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minicpm_jax.config import SparseConfig
from minicpm_jax.infllm.attention import sparse_attention
from minicpm_jax.infllm.compressed import extend_compressed
from minicpm_jax.infllm.policy import geometry
from minicpm_jax.model.cache import KVCache, compressed_sizes
from pallas_kernels import backend, triton
from pallas_kernels.flash import merge_splits, merge_splits_rows
from pallas_kernels.infllm.common import compressed_visible
from pallas_kernels.infllm.compress import compress_new_windows, compress_windows_reference
from pallas_kernels.infllm.decode import pool_select_attention_reference
from pallas_kernels.infllm.select import (
    force_blocks,
    pool_block_scores,
    pool_select_blocks,
    pool_select_blocks_reference,
    select_top_blocks,
    select_top_blocks_reference,
)
from pallas_kernels.infllm.stage1 import compressed_scores, compressed_scores_reference
from pallas_kernels.infllm.stage2 import (
    block_sparse_attention,
    block_sparse_attention_reference,
    local_window_attention,
    local_window_attention_reference,
)
from pallas_kernels.infllm.tree_merge import tree_merge_attention, tree_merge_attention_reference
from pallas_kernels.topk import top_k
from tests.helpers import random_tree
from tests.oracles import np_compress_step

pytestmark = pytest.mark.gpu

XLA, PALLAS = backend.get("xla"), backend.get("pallas")


def select_blocks(scores, positions, lengths, sparse: SparseConfig, num_blocks: int):
    """Stage-1 scores → the attended blocks as the reference backend selects them (XLA pooling, forced
    blocks, the exact two-stage top-k)."""
    return pool_select_blocks_reference(scores, positions, lengths, top_k=top_k, **geometry(sparse).select(num_blocks))


def _general_path(q, cache, pos, sparse, *, scale, layer):
    """The Pallas backend's single block-sparse pass: the selection kernels (stage-1 tiles pooled in place),
    then the block-sparse kernel over every selected block (neither the decode path nor the window split)."""
    blocks = triton.select_blocks(q, cache.k1, cache.k2, pos, cache.lengths, scale=scale, geometry=geometry(sparse),
                                  num_blocks=-(-cache.max_length // sparse.block_size), layer=layer)
    return block_sparse_attention(q, cache.k, cache.v, pos, cache.lengths, blocks, scale=scale,
                                  block_size=sparse.block_size, layer=layer)


def _caches(length: int, sparse: SparseConfig, seed: int = 0, batch: int = 1):
    """2 layers of MiniCPM4-8B-shaped (2 KV heads x 128) random bf16 K/V, layer 1's K1/K2 filled; row ``i`` of
    the batch holds ``length - 37 i`` tokens."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    shape = (2, batch, 2, length, 128)
    k = jax.random.normal(keys[0], shape, jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[1], shape, jnp.float32).astype(jnp.bfloat16)
    n1, n2 = compressed_sizes(sparse, length)
    cache = KVCache(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32),
                    k1=jnp.zeros((2, batch, 2, n1, 128), jnp.bfloat16), k2=jnp.zeros((2, batch, 2, n2, 128), jnp.bfloat16))
    full = length - 37 * jnp.arange(batch, dtype=jnp.int32)
    cache = extend_compressed(cache, 1, jnp.zeros((batch,), jnp.int32), full, sparse, max_tokens=length, kernels=XLA)
    return dataclasses.replace(cache, lengths=full)


@pytest.mark.parametrize("length,t", [(16384, 1), (20000, 64)])
def test_gpu_sparse_kernels_at_8b_dims(length, t):
    sparse = SparseConfig()
    cache = _caches(length, sparse)
    q = jax.random.normal(jax.random.PRNGKey(1), (1, t, 32, 128), jnp.float32).astype(jnp.bfloat16)
    pos = (length - t + jnp.arange(t, dtype=jnp.int32))[None]
    kw = dict(scale=128**-0.5, kernel1=32, stride1=16, kernel2=128, stride2=64, layer=1)
    ref = compressed_scores_reference(q, cache.k1, cache.k2, pos, **kw)
    got = jax.jit(lambda *a: compressed_scores(*a, **kw))(q, cache.k1, cache.k2, pos)
    visible = compressed_visible(pos, ref.shape[-1], kernel=32, stride=16)[:, None]
    err = jnp.max(jnp.abs(jnp.where(visible, got - ref, 0.0))) / jnp.max(ref)
    assert float(err) < 1e-2
    n_blocks = -(-length // 64)
    sel_ref = np.asarray(select_blocks(ref, pos, cache.lengths, sparse, n_blocks))
    sel_got = np.asarray(select_blocks(got, pos, cache.lengths, sparse, n_blocks))
    # The kernel's scores are bf16 (as InfLLM-v2's): a block may swap only for a near-tie at the k-th place.
    block_ref = pool_block_scores(ref, pos, cache.lengths, kernel1=32, stride1=16, ratio=4, num_blocks=n_blocks)
    limit = jnp.broadcast_to((pos // 64)[:, None, :], block_ref.shape[:-1])
    block_ref = np.asarray(force_blocks(block_ref, limit, (sparse.init_blocks, sparse.local_blocks)))
    block_ref = block_ref.reshape(-1, n_blocks)  # forced blocks +inf, later ones -inf
    swapped = 0
    for row, a, b in zip(block_ref, sel_ref.reshape(-1, sel_ref.shape[-1]), sel_got.reshape(-1, sel_got.shape[-1])):
        a, b = set(a[a >= 0]), set(b[b >= 0])
        kth = min(row[list(a)][np.isfinite(row[list(a)])])
        for blk in a ^ b:
            assert abs(row[blk] - kth) <= 1e-2 * kth, (blk, row[blk], kth)
        swapped += len(a - b)
    assert swapped <= 0.05 * sel_ref.size
    assert (sel_ref >= 0).sum(-1).min() == 96
    # The selection kernel picks exactly what XLA's top-k + sort pick from the same scores.
    sel_kernel = np.asarray(jax.jit(lambda s_, p_, l_: pool_select_blocks(s_, p_, l_, **geometry(sparse).select(
        n_blocks)))(got, pos, cache.lengths))
    np.testing.assert_array_equal(sel_kernel, sel_got)
    blocks = jnp.asarray(sel_ref)
    want = block_sparse_attention_reference(q, cache.k, cache.v, pos, cache.lengths, blocks, scale=128**-0.5,
                                            block_size=64, layer=1)
    out = jax.jit(lambda *a: block_sparse_attention(*a, scale=128**-0.5, block_size=64, layer=1))(
        q, cache.k, cache.v, pos, cache.lengths, blocks)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2e-2)


@pytest.mark.parametrize("length,t", [(131072, 2048), (131072, 1), (131072, 12), (20000, 300)])
def test_gpu_pool_select_reads_stage1_tiles_in_place(length, t):
    """On the GPU, the selection kernel that pools the stage-1 tiles in place picks exactly what the XLA
    pooling + forced blocks + selection kernel pick from the same scores: the last chunk of a 128K prompt,
    a 128K decode step, 12 tokens (a tree verify's 4-token tiles) and a 300-token chunk (a partial tile)."""
    sparse = SparseConfig()
    cache = _caches(length, sparse)
    q = jax.random.normal(jax.random.PRNGKey(3), (1, t, 32, 128), jnp.float32).astype(jnp.bfloat16)
    pos = (length - t + jnp.arange(t, dtype=jnp.int32))[None]
    scale, geo = 128**-0.5, geometry(sparse)
    num_blocks = -(-cache.max_length // sparse.block_size)

    def pooled_in_kernel(q_, p_, c):
        return triton.select_blocks(q_, c.k1, c.k2, p_, c.lengths, scale=scale, geometry=geo, num_blocks=num_blocks,
                                    layer=1)

    def pooled_in_xla(q_, p_, c):
        scores = compressed_scores(q_, c.k1, c.k2, p_, scale=scale, layer=1, **geo.stage1())
        block_score = pool_block_scores(scores, p_, c.lengths, kernel1=geo.kernel1, stride1=geo.stride1,
                                        ratio=geo.ratio, num_blocks=num_blocks)
        limit = jnp.broadcast_to((p_ // sparse.block_size)[:, None, :], block_score.shape[:-1])
        block_score = force_blocks(block_score, limit, (sparse.init_blocks, sparse.local_blocks))
        return select_top_blocks(block_score, limit, k=min(sparse.num_selected, num_blocks))

    got = np.asarray(jax.jit(pooled_in_kernel)(q, pos, cache))
    want = np.asarray(jax.jit(pooled_in_xla)(q, pos, cache))
    np.testing.assert_array_equal(got, want)
    assert (got >= 0).sum(-1).min() == 96


@pytest.mark.parametrize("rows,nb,k", [(2, 2051, 96), (4096, 2048, 96), (64, 4096, 128), (8, 300, 7)])
def test_gpu_select_top_blocks_kernel_matches_reference(rows, nb, k):
    """The Triton-compiled selection kernel against lax.top_k + sort on the GPU: decode (2 rows of a 128K
    cache's 2051 blocks, padded to 4096), a 2048-token prefill chunk, k equal to the output width, and
    scores with ties, +inf (forced) and -inf (future) blocks."""
    rng = np.random.default_rng(rows + nb)
    x = rng.random((rows, nb)).astype(np.float32)
    x[::2] = np.round(x[::2] * 8) / 8  # ties
    limit = rng.integers(k // 2, nb + 2, rows).astype(np.int32)
    x[:, :1] = np.inf
    x[np.arange(nb)[None, :] > limit[:, None]] = -np.inf
    xs, ls = jnp.asarray(x), jnp.asarray(limit)
    got = np.asarray(jax.jit(lambda a, b: select_top_blocks(a, b, k=k))(xs, ls))
    want = np.asarray(jax.jit(lambda a, b: select_top_blocks_reference(a, b, k=k))(xs, ls))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("length,batch", [(131072, 1), (20000, 3)])
def test_gpu_fused_decode_path_at_8b_dims(length, batch):
    """The decode path (two stage-1 passes, selection + stage 2 in one kernel, the merge kernel), Triton-
    compiled: equal to the general path (same stage-1 scores, so the same picks; the splits are summed in
    another grouping), to the jnp reference of selection + stage 2 from the same scores, and within bf16
    tolerance to the all-jnp path; a 128K decode step, and a batch of rows at different lengths."""
    sparse = SparseConfig()
    cache = _caches(length, sparse, batch=batch)
    q = jax.random.normal(jax.random.PRNGKey(4), (batch, 1, 32, 128), jnp.float32).astype(jnp.bfloat16)
    pos = (cache.lengths - 1)[:, None]
    scale = 128**-0.5
    got = np.asarray(jax.jit(lambda q_, c: sparse_attention(q_, q_, c, 1, pos, c.lengths, sparse, scale=scale,
                                                            kernels=PALLAS))(q, cache), np.float32)
    general = np.asarray(jax.jit(lambda q_, c: _general_path(q_, c, pos, sparse, scale=scale, layer=1))(q, cache),
                         np.float32)
    np.testing.assert_allclose(got, general, atol=2e-3)
    scores = jax.jit(lambda q_, c: compressed_scores(q_, c.k1, c.k2, pos, scale=scale, kernel1=32, stride1=16,
                                                     kernel2=128, stride2=64, layer=1))(q, cache)
    sel = dict(scale=scale, block_size=64, k_blocks=96, kernel1=32, stride1=16, init_blocks=1, local_blocks=32, layer=1)
    want = pool_select_attention_reference(q, cache.k, cache.v, scores.astype(jnp.float32), pos, cache.lengths, **sel)
    np.testing.assert_allclose(got, np.asarray(want, np.float32), atol=2e-3)
    every_jnp = sparse_attention(q, q, cache, 1, pos, cache.lengths, sparse, scale=scale, kernels=XLA)
    np.testing.assert_allclose(got, np.asarray(every_jnp, np.float32), atol=3e-2)


def test_gpu_merge_splits_kernel():
    rng = np.random.default_rng(0)
    o = jnp.asarray(rng.standard_normal((1, 2, 1, 64, 16, 128)), jnp.float32)
    lse = rng.standard_normal((1, 2, 1, 64, 16)).astype(np.float32) * 3
    lse[..., 40:, :] = -np.inf  # empty splits
    got = jax.jit(lambda a, b: merge_splits_rows(a, b, out_dtype=jnp.bfloat16))(o, jnp.asarray(lse))
    want = merge_splits(o, jnp.asarray(lse))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=1e-2)


def test_gpu_compress_step_at_8b_dims():
    sparse = SparseConfig()
    cache = _caches(4096, sparse)
    old = jnp.array([4064 - 1], jnp.int32)  # 4064 = 32 + 16*252: completes a K1 window
    kw = dict(layer=1, kernel1=32, stride1=16, kernel2=128, stride2=64)
    for new in (old + 1, old + 2, old):
        ref = np_compress_step(cache.k, cache.k1, cache.k2, new - 1, new, **kw)
        got = jax.jit(lambda *a: compress_new_windows(*a, max_tokens=1, **kw))(cache.k, cache.k1, cache.k2, new - 1,
                                                                               new)
        for r, g in zip(ref, got):
            np.testing.assert_allclose(np.asarray(g, np.float32), r, atol=1e-2)


def test_gpu_compress_of_a_speculative_path_in_every_layer_at_8b_dims():
    """A 3-token accepted path crossing a K1 and a K2 window end, every layer in one launch, against the jnp
    reference (bf16 means, both rounded once from fp32)."""
    cache = _caches(4096, SparseConfig())
    new = jnp.array([4032 + 1], jnp.int32)  # 4032 = 32 + 16*250 = 128 + 64*61: ends a K1 and a K2 window
    kw = dict(layer=None, kernel1=32, stride1=16, kernel2=128, stride2=64, max_tokens=3)
    ref = compress_windows_reference(cache.k, cache.k1, cache.k2, new - 3, new, **kw)
    got = jax.jit(lambda *a: compress_new_windows(*a, **kw))(cache.k, cache.k1, cache.k2, new - 3, new)
    for r, g, before in zip(ref, got, (cache.k1, cache.k2)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), atol=1e-2)
        assert int(jnp.sum(jnp.any(r != before, axis=-1))) > 0


@pytest.mark.parametrize("start,t", [(16384, 2048), (9000, 300)])
def test_gpu_local_window_split_at_8b_dims(start, t):
    """A prefill chunk at MiniCPM4-8B dims: the window kernel (Triton) against its reference, and the split
    stage 2 (window kernel + block-sparse kernel below the window, LSE-merged) against the reference's
    single block-sparse pass over the same selection."""
    sparse = SparseConfig()
    length = start + t
    cache = _caches(length, sparse)
    q = jax.random.normal(jax.random.PRNGKey(3), (1, t, 32, 128), jnp.float32).astype(jnp.bfloat16)
    pos = (start + jnp.arange(t, dtype=jnp.int32))[None]
    kw = dict(scale=128**-0.5, block_size=64, local_blocks=sparse.local_blocks, layer=1)
    ref, ref_lse = jax.jit(lambda *a: local_window_attention_reference(*a, **kw))(q, cache.k, cache.v, pos, cache.lengths)
    got, got_lse = jax.jit(lambda *a: local_window_attention(*a, **kw))(q, cache.k, cache.v, pos, cache.lengths)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=2e-2)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(ref_lse), atol=1e-3, rtol=1e-4)
    split = jax.jit(lambda q_, c, p_: sparse_attention(q_, q_, c, 1, p_, c.lengths, sparse, scale=128**-0.5,
                                                       kernels=PALLAS))(q, cache, pos)
    whole = jax.jit(lambda q_, c, p_: _general_path(q_, c, p_, sparse, scale=128**-0.5, layer=1))(q, cache, pos)
    np.testing.assert_allclose(np.asarray(split, np.float32), np.asarray(whole, np.float32), atol=2e-2)
    assert float(jnp.mean(jnp.abs(split.astype(jnp.float32) - whole.astype(jnp.float32)))) < 2e-3


def test_gpu_tree_merge_at_8b_dims():
    """A 12-node verify's tail at MiniCPM4-8B's heads (32 query heads, 2 KV heads, head_dim 128, bf16): the
    kernel against the jnp reference on the GPU, nodes with and without prefix keys."""
    t, h, kvh, d = 12, 32, 2, 128
    ks = jax.random.split(jax.random.PRNGKey(5), 5)
    q = jax.random.normal(ks[0], (1, t, h, d), jnp.bfloat16)
    tree_k = jax.random.normal(ks[1], (1, t, kvh, d), jnp.bfloat16)
    tree_v = jax.random.normal(ks[2], (1, t, kvh, d), jnp.bfloat16)
    out_p = jax.random.normal(ks[3], (1, t, h, d), jnp.bfloat16)
    lse_p = (jax.random.normal(ks[4], (1, t, h), jnp.float32) * 3).at[0, :2].set(-jnp.inf)
    mask = random_tree(np.random.default_rng(0), t, 3)[1]
    args = (q, tree_k, tree_v, jnp.asarray(mask[None]), out_p, lse_p)
    got = jax.jit(lambda *a: tree_merge_attention(*a, scale=d**-0.5))(*args)
    want = jax.jit(lambda *a: tree_merge_attention_reference(*a, scale=d**-0.5))(*args)
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)),
                               atol=2e-2, rtol=2e-2)
