"""InfLLM-v2 over a paged pool (``pallas_kernels/infllm/paged.py`` and the backends' ``paged_*`` sparse ops):
the references against the contiguous cache's ops on the same keys laid out through a ragged page table
(rows sharing prefix pages, pages in random order, NaN in every slot and compressed entry no query may
read), and the Pallas kernels (interpret mode) against the references."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from minicpm_jax.config import SparseConfig
from minicpm_jax.infllm.policy import geometry
from pallas_kernels import triton, xla
from pallas_kernels.infllm.common import compressed_count
from pallas_kernels.infllm.compress import compress_windows_reference, paged_compress_new_windows
from pallas_kernels.infllm.paged import (
    check_paged_geometry,
    compressed_view,
    paged_compress_windows_reference,
)
from tests.helpers import rel_err

# MiniCPM4's geometry scaled down 4x (windows 8/4 and 32/16, 16-token blocks = pages, 2 local blocks).
SP = SparseConfig(kernel_size=8, kernel_stride=4, init_blocks=1, block_size=16, window_size=32, topk=3,
                  use_nope=False, dense_len=64)
GEO = geometry(SP)
PAGE, P, LAYERS, LAYER, KVH, H, D = 16, 6, 2, 1, 2, 4, 16
CAP = P * PAGE
LENGTHS = np.array([90, 37, 64], np.int32)  # row 1 shares row 0's first two pages (its prompt's prefix)
SHARED = 2


def _layout(seed=0):
    """Random keys/values of every row (row 1's first ``SHARED`` pages equal to row 0's), their contiguous
    cache ``[L, B, KVH, CAP, D]`` and the paged pool ``[L, KVH, N, D]`` + page table holding them, NaN in
    every slot past a row's length and in the pages nobody holds."""
    rng = np.random.default_rng(seed)
    b = len(LENGTHS)
    k, v = (rng.standard_normal((LAYERS, b, KVH, CAP, D)).astype(np.float32) for _ in range(2))
    for x in (k, v):
        x[:, 1, :, : SHARED * PAGE] = x[:, 0, :, : SHARED * PAGE]
    num_pages = 24
    free = iter(rng.permutation(num_pages))
    table = np.zeros((b, P), np.int32)
    for r, n in enumerate(LENGTHS):
        for i in range(-(-n // PAGE)):
            table[r, i] = table[0, i] if (r == 1 and i < SHARED) else next(free)
    pools = [np.full((LAYERS, KVH, num_pages * PAGE, D), np.nan, np.float32) for _ in range(2)]
    for r, n in enumerate(LENGTHS):
        for s in range(n):
            slot = table[r, s // PAGE] * PAGE + s % PAGE
            for pool, x in zip(pools, (k, v)):
                pool[:, :, slot] = x[:, r, :, s]
    live = (np.arange(CAP)[None, :] < LENGTHS[:, None])[None, :, None, :, None]
    clean = [np.where(live, x, 0.0) for x in (k, v)]
    comp = [np.full((LAYERS, KVH, num_pages * PAGE // s, D), np.nan, np.float32) for s in (SP.kernel_stride,
                                                                                          SP.kernel_stride2)]
    return [jnp.asarray(x) for x in clean], [jnp.asarray(x) for x in pools], jnp.asarray(table), comp


def _compressed(kc, k_pool, table, comp):
    """Both layouts' compressed keys of every row's whole length (the contiguous reference from zeros)."""
    n1, n2 = CAP // SP.kernel_stride, CAP // SP.kernel_stride2
    shape = kc.shape[:3]
    k1c, k2c = compress_windows_reference(kc, jnp.zeros((*shape, n1, D)), jnp.zeros((*shape, n2, D)),
                                          jnp.zeros(3, jnp.int32), jnp.asarray(LENGTHS), layer=LAYER, max_tokens=CAP,
                                          **GEO.stage1())
    k1p, k2p = paged_compress_windows_reference(k_pool, *map(jnp.asarray, comp), table, jnp.zeros(3, jnp.int32),
                                                jnp.asarray(LENGTHS), layer=LAYER, page_size=PAGE, max_tokens=CAP,
                                                **GEO.stage1())
    return (k1c, k2c), (k1p, k2p)


@pytest.fixture(scope="module")
def layout():
    (kc, vc), (kp, vp), table, comp = _layout()
    (k1c, k2c), (k1p, k2p) = _compressed(kc, kp, table, comp)
    return dict(kc=kc, vc=vc, kp=kp, vp=vp, table=table, k1c=k1c, k2c=k2c, k1p=k1p, k2p=k2p)


def test_compressed_keys_live_in_the_page_of_their_last_key(layout):
    for comp_c, comp_p, kernel, stride in ((layout["k1c"], layout["k1p"], SP.kernel_size, SP.kernel_stride),
                                           (layout["k2c"], layout["k2p"], SP.kernel_size2, SP.kernel_stride2)):
        n = comp_c.shape[3]
        view = np.asarray(compressed_view(comp_p, LAYER, layout["table"], n, kernel=kernel, stride=stride,
                                          page_size=PAGE))
        for r, length in enumerate(LENGTHS):
            done = int(compressed_count(length, kernel=kernel, stride=stride))
            assert done > 0
            np.testing.assert_allclose(view[r, :, :done], np.asarray(comp_c)[LAYER, r, :, :done], rtol=1e-6)
    # A shared page's entries were written identically by both rows: its pool rows hold no NaN.
    shared = np.asarray(layout["table"])[0, :SHARED]
    per_page = PAGE // SP.kernel_stride
    rows = (shared[:, None] * per_page + np.arange(per_page)).ravel()[1:]  # entry 0 of page 0 completes nowhere
    assert np.isfinite(np.asarray(layout["k1p"])[LAYER][:, rows]).all()


def test_geometry_that_does_not_map_onto_pages_is_refused():
    with pytest.raises(ValueError, match="pages of one sparse block"):
        check_paged_geometry(32, block_size=16, stride1=4, stride2=16)
    with pytest.raises(ValueError, match="strides"):
        check_paged_geometry(16, block_size=16, stride1=4, stride2=32)


@pytest.mark.parametrize("max_tokens,grow,layer", [(1, (1, 0, 1), LAYER), (6, (6, 0, 5), None)])
def test_paged_compress_kernel_matches_the_reference(layout, max_tokens, grow, layer):
    """A decode step (one layer) and a speculative path of up to 6 tokens (every layer in one launch): rows
    0 and 2 complete windows (K1 for both, two for row 2 on the path, K2 for row 2), row 1 does not grow;
    the kernel (interpret mode) writes exactly the reference's entries in place."""
    old = jnp.asarray(LENGTHS - np.array(grow))
    new = jnp.asarray(LENGTHS)
    k1, k2 = (jnp.where(jnp.isnan(x), 7.0, x) for x in (layout["k1p"], layout["k2p"]))  # NaN != NaN
    kw = dict(layer=layer, page_size=PAGE, max_tokens=max_tokens, **GEO.stage1())
    want = paged_compress_windows_reference(layout["kp"], k1, k2, layout["table"], old, new, **kw)
    scrambled = [x + 1.0 if layer is None else x.at[LAYER].set(x[LAYER] + 1.0) for x in (k1, k2)]
    fresh = paged_compress_windows_reference(layout["kp"], *scrambled, layout["table"], old, new, **kw)
    got = paged_compress_new_windows(layout["kp"], *scrambled, layout["table"], old, new, interpret=True, **kw)
    for g, f, w, s in zip(got, fresh, want, scrambled):
        np.testing.assert_allclose(np.asarray(g), np.asarray(f), rtol=1e-5, atol=1e-6)
        changed = np.asarray(w != s).any(axis=-1)
        assert changed.sum() >= 2 * KVH * (LAYERS if layer is None else 1)  # rows 0 and 2, every head (layer)


def _queries(t, seed=1):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((len(LENGTHS), t, H, D)).astype(np.float32))
    pos = jnp.asarray(LENGTHS[:, None] - t + np.arange(t)[None, :])
    return q, pos


@pytest.mark.parametrize("t", [1, 20])
def test_paged_sparse_attention_equals_the_contiguous_cache(layout, t):
    """The references over the pool pick the contiguous cache's blocks and give its output; the Pallas
    backend (decode path for one token, local-window split for 20) gives the references' output."""
    q, pos = _queries(t)
    lengths = jnp.asarray(LENGTHS)
    cont = dict(scale=D**-0.5, geometry=GEO, layer=LAYER)
    paged = dict(cont, page_size=PAGE)
    blocks_c = xla.select_blocks(q, layout["k1c"], layout["k2c"], pos, lengths, num_blocks=P, **cont)
    blocks_p = xla.paged_select_blocks(q, layout["k1p"], layout["k2p"], layout["table"], pos, lengths, **paged)
    np.testing.assert_array_equal(np.asarray(blocks_p), np.asarray(blocks_c))
    np.testing.assert_array_equal(np.asarray(triton.paged_select_blocks(
        q, layout["k1p"], layout["k2p"], layout["table"], pos, lengths, **paged)), np.asarray(blocks_c))
    want = xla.sparse_attention(q, q, layout["kc"], layout["vc"], layout["k1c"], layout["k2c"], pos, lengths, **cont)
    args = (q, q, layout["kp"], layout["vp"], layout["k1p"], layout["k2p"], layout["table"], pos, lengths)
    ref = xla.paged_sparse_attention(*args, **paged)
    assert rel_err(ref, want) < 1e-5
    got = triton.paged_sparse_attention(*args, **paged)
    assert np.isfinite(np.asarray(got)).all()
    assert rel_err(got, want) < 1e-4


def test_paged_block_sparse_attention_returns_the_lse_of_the_reference(layout):
    """The tree path's call: the prefix's selected pages with their log-sum-exps."""
    q, pos = _queries(3, seed=2)
    lengths = jnp.asarray(LENGTHS)
    blocks = xla.paged_select_blocks(q, layout["k1p"], layout["k2p"], layout["table"], pos, lengths, scale=D**-0.5,
                                     geometry=GEO, layer=LAYER, page_size=PAGE)
    args = (q, layout["kp"], layout["vp"], layout["table"], pos, lengths, blocks)
    kw = dict(scale=D**-0.5, block_size=PAGE, layer=LAYER, return_lse=True)
    (out_r, lse_r), (out_k, lse_k) = xla.paged_block_sparse_attention(*args, **kw), \
        triton.paged_block_sparse_attention(*args, **kw)
    assert rel_err(out_k, out_r) < 1e-4
    np.testing.assert_allclose(np.asarray(lse_k), np.asarray(lse_r), rtol=1e-4, atol=1e-5)
