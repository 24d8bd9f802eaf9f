"""The paged-KV ops (``paged_attention``, ``paged_tree_attention``, ``paged_cache_write`` of both backend
namespaces): the Pallas kernels (interpret mode) against the references on ragged page tables with NaN in
every slot no query may see, the references against contiguous caches built by hand from the page table,
the paged writer against a NumPy scatter, and the kernels' CUDA lowering without a GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import triton, xla
from pallas_kernels.attention import attention_reference, paged_decode_attention, paged_prefill_attention
from pallas_kernels.cache_write import paged_cache_write, paged_cache_write_reference
from pallas_kernels.launch import KernelConfig
from pallas_kernels.paged import paged_attention_reference, paged_tree_attention_reference
from pallas_kernels.tree_attention import paged_tree_attention, tree_attention_reference
from tests.helpers import abstract_gpu_mesh, rel_err

SMALL = KernelConfig(block_q=16, block_k=16, num_warps=4, num_stages=2)
LAYERS, LAYER, KVH, H, D, P = 2, 1, 2, 4, 16, 5  # P = 5 pages per row: not a power of 2


def _page_table(rng, lengths, page_size, num_pages, share_rows=(0, 1)):
    """``int32[B, P]``: each row's pages drawn from a random permutation of the pool, 0 past its last page;
    row ``share_rows[1]`` starts with all of row ``share_rows[0]``'s pages (a shared prefix whose last page
    the first row only partly fills)."""
    free = iter(rng.permutation(num_pages))
    table = np.zeros((len(lengths), P), np.int32)
    a, b = share_rows
    for r, n in enumerate(lengths):
        for i in range(-(-n // page_size)):
            shared = r == b and i < -(-lengths[a] // page_size)
            table[r, i] = table[a, i] if shared else next(free)
    return table


def _pools(rng, num_slots, seen, dtype=np.float32):
    """(k, v) pools ``[L, KVH, N, D]`` twice: random everywhere (clean), and the same with NaN in every slot
    of every layer except the ``seen`` slots of ``LAYER`` (garbage no query may read)."""
    clean = [rng.standard_normal((LAYERS, KVH, num_slots, D)).astype(np.float32) for _ in range(2)]
    dirty = []
    for x in clean:
        y = np.full_like(x, np.nan)
        idx = np.asarray(sorted(seen), np.int64)
        y[LAYER, :, idx] = x[LAYER, :, idx]
        dirty.append(y)
    return [jnp.asarray(x, dtype) for x in clean], [jnp.asarray(x, dtype) for x in dirty]


def _slot(table, page_size, b, s):
    return int(table[b, s // page_size]) * page_size + s % page_size


def _contiguous(pool, table, page_size, length):
    """NumPy: ``[B, KVH, length, D]`` with row b's key s copied from the pool slot its page table names."""
    pool = np.asarray(pool, np.float32)[LAYER]
    out = np.zeros((table.shape[0], KVH, length, D), np.float32)
    for b in range(table.shape[0]):
        for s in range(length):
            out[b, :, s] = pool[:, _slot(table, page_size, b, s)]
    return out


def _attention_case(seed, page_size, t, valid):
    """Four rows: lengths 37, 70 (sharing row 0's pages), 0 and 3 short of capacity; each row's queries are
    the last ``t`` positions of its keys, except that row 1's end 9 keys before its length and the last
    row's chunk has ``t - valid`` padded tokens past its length. Returns (q, clean pools, dirty pools, page
    table, positions, lengths)."""
    rng = np.random.default_rng(seed)
    cap = P * page_size
    lengths = np.array([37, 70, 0, cap - 3], np.int32)
    num_pages = 4 * P
    table = _page_table(rng, lengths, page_size, num_pages)
    positions = lengths[:, None] - t + np.arange(t, dtype=np.int32)[None]
    positions[1] -= 9  # keys 61..69 of row 1 are stored but no query sees them (NaN in the dirty pool)
    positions[3] += t - valid
    positions[2] = np.arange(t)  # an empty row: every query sees nothing
    seen = {_slot(table, page_size, b, s) for b in range(4) for s in range(min(lengths[b], positions[b].max() + 1))}
    clean, dirty = _pools(rng, num_pages * page_size, seen)
    q = jnp.asarray(rng.standard_normal((4, t, H, D)), jnp.float32)
    return q, clean, dirty, jnp.asarray(table), jnp.asarray(positions), jnp.asarray(lengths)


# (page_size, query tokens, valid tokens of the last row, dtype, launch config, splits)
ATTENTION_CASES = [
    (16, 1, 1, jnp.float32, None, None),    # decode through the op (tuned config, block_k = page)
    (32, 4, 2, jnp.float32, SMALL, 3),       # several queries, block_k 16 < page 32, 3 splits (XLA's merge)
    (16, 16, 11, jnp.bfloat16, None, None),  # 16 queries: the decode kernel's largest chunk, bf16
    (16, 24, 24, jnp.float32, None, None),   # prefill through the op
    (32, 40, 33, jnp.bfloat16, SMALL, None),  # prefill, three query blocks, two key blocks per page, bf16
]


@pytest.mark.parametrize("case", range(len(ATTENTION_CASES)))
def test_paged_attention_kernels_match_the_reference(case):
    """Kernel on the pool with NaN in every unseen slot = reference on the clean pool (= reference on the
    NaN pool): ragged permuted pages, shared pages, a partly filled shared page, an empty row."""
    page_size, t, valid, dtype, config, splits = ATTENTION_CASES[case]
    q, clean, dirty, table, pos, lengths = _attention_case(case, page_size, t, valid)
    q, clean, dirty = q.astype(dtype), [x.astype(dtype) for x in clean], [x.astype(dtype) for x in dirty]
    kw = dict(scale=D**-0.5, page_size=page_size, layer=LAYER)
    if config is None:
        fn = triton.paged_attention
    else:
        kernel = paged_decode_attention if t <= 16 else paged_prefill_attention
        fn = functools.partial(kernel, config=config, **({"num_splits": splits} if splits else {}))
    out = jax.jit(functools.partial(fn, **kw))(q, *dirty, table, pos, lengths)
    up = lambda x: x.astype(jnp.float32)
    ref = xla.paged_attention(up(q), *map(up, clean), table, pos, lengths, **kw)
    ref_dirty = xla.paged_attention(up(q), *map(up, dirty), table, pos, lengths, **kw)
    assert out.shape == q.shape and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(ref_dirty), np.asarray(ref), atol=1e-6)
    assert rel_err(np.asarray(out, np.float32), ref) < (1e-5 if dtype == jnp.float32 else 1.5e-2)
    assert np.all(np.asarray(out, np.float32)[2] == 0.0)  # the empty row


def test_paged_attention_reference_equals_attention_on_a_hand_built_cache():
    """The paged reference against attention_reference on contiguous caches copied slot by slot from the
    page table (NumPy), for decode and prefill queries."""
    for t, valid in ((1, 1), (24, 20)):
        q, (k, v), _, table, pos, lengths = _attention_case(7 + t, 16, t, valid)
        kw = dict(scale=0.3, page_size=16, layer=LAYER)
        got = paged_attention_reference(q, k, v, table, pos, lengths, **kw)
        kc, vc = (jnp.asarray(_contiguous(x, np.asarray(table), 16, P * 16)) for x in (k, v))
        want = attention_reference(q, kc, vc, pos, lengths, scale=0.3)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def _tree_case(seed, n, m, window):
    """Three rows with prefixes 37, 70 (sharing row 0's pages) and 0, page 16; each row's tree scratch at
    its own 64 slots past the prefix pages; NaN in every slot no query may see: prefix keys outside the
    window, scratch slots past M and tree keys no query sees (a draft step: n < m)."""
    rng = np.random.default_rng(seed)
    page_size, b = 16, 3
    prefix = np.array([37, 70, 0], np.int32)
    num_pages = 3 * P + 3 * 4
    table = _page_table(rng, prefix, page_size, 3 * P)
    tree_slots = np.array([(3 * P + 4 * r) * page_size for r in range(b)], np.int32)
    mask = (rng.random((b, n, m)) < 0.4) | np.eye(n, m, dtype=bool)[None]
    mask[:, :, m - 1] = False  # a tree key no query sees
    seen = {_slot(table, page_size, r, s) for r in range(b) for s in range(prefix[r])
            if window is None or s >= prefix[r] - window}
    seen |= {int(tree_slots[r]) + j for r in range(b) for j in range(m) if mask[r, :, j].any()}
    clean, dirty = _pools(rng, num_pages * page_size, seen)
    q = jnp.asarray(rng.standard_normal((b, n, H, D)), jnp.float32)
    return q, clean, dirty, *(jnp.asarray(x) for x in (table, prefix, mask, tree_slots))


@pytest.mark.parametrize("n,m,window,splits", [(7, 7, None, None), (20, 20, None, 2), (5, 33, 6, 3)],
                         ids=["verify7", "verify20", "draft-step-window"])
def test_paged_tree_attention_kernel_matches_the_reference(n, m, window, splits):
    """Kernel on the NaN pool = reference on the clean pool (= on the NaN pool); prefix splits merged by the
    Pallas merge (the default count) or XLA's (2 + 1, 3 + 1)."""
    q, clean, dirty, table, prefix, mask, tree_slots = _tree_case(n + m, n, m, window)
    kw = dict(scale=0.25, page_size=16, layer=LAYER, window=window)
    fn = triton.paged_tree_attention if splits is None else functools.partial(paged_tree_attention, num_splits=splits)
    out = jax.jit(functools.partial(fn, **kw))(q, *dirty, table, prefix, mask, tree_slots)
    ref = xla.paged_tree_attention(q, *clean, table, prefix, mask, tree_slots, **kw)
    ref_dirty = xla.paged_tree_attention(q, *dirty, table, prefix, mask, tree_slots, **kw)
    np.testing.assert_allclose(np.asarray(ref_dirty), np.asarray(ref), atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)


def test_paged_tree_reference_equals_tree_attention_on_a_hand_built_cache():
    """The paged tree reference against tree_attention_reference on contiguous caches built by hand: the
    prefix copied through the page table, tree key j at slot prefix + j."""
    for n, m, window in ((7, 7, None), (5, 33, 6)):
        q, (k, v), _, table, prefix, mask, tree_slots = _tree_case(3 + m, n, m, window)
        kw = dict(scale=0.25, page_size=16, layer=LAYER, window=window)
        got = paged_tree_attention_reference(q, k, v, table, prefix, mask, tree_slots, **kw)
        length = P * 16 + m
        caches = []
        for x in (k, v):
            c = np.zeros((3, KVH, length, D), np.float32)
            pool = np.asarray(x)[LAYER]
            for r in range(3):
                p = int(prefix[r])
                c[r, :, :p] = _contiguous(x, np.asarray(table), 16, p)[r] if p else 0
                c[r, :, p:p + m] = pool[:, int(tree_slots[r]):int(tree_slots[r]) + m]
            caches.append(jnp.asarray(c))
        want = tree_attention_reference(q, *caches, prefix, mask, scale=0.25, window=window)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


@pytest.mark.parametrize("t", [1, 5, 80])
def test_paged_cache_write_matches_a_numpy_scatter(t):
    """The one-launch paged writer (interpret mode; 80 tokens per row take the reference) stores exactly the
    valid tokens at their flat slots of the named layer, cast to the pool dtype; slots -1, N and N + 2 are
    dropped and nothing else changes."""
    rng = np.random.default_rng(t)
    b, n = 3, 256
    kp, vp = (jnp.asarray(rng.standard_normal((LAYERS, KVH, n, D)), jnp.bfloat16) for _ in range(2))
    kn, vn = (jnp.asarray(rng.standard_normal((b, t, KVH, D)), jnp.float32) for _ in range(2))
    slots = rng.permutation(n)[: b * t].reshape(b, t).astype(np.int32)  # distinct: one write per slot
    slots[-1, 0] = n
    if t > 1:
        slots[0, -1], slots[-1, -1] = -1, n + 2
    out = jax.jit(functools.partial(paged_cache_write, layer=LAYER, interpret=True))(kp, vp, kn, vn, jnp.asarray(slots))
    ref = paged_cache_write_reference(kp, vp, kn, vn, jnp.asarray(slots), layer=LAYER)
    for o, r, pool, new in zip(out, ref, (kp, vp), (kn, vn)):
        expect = np.asarray(pool, np.float32).copy()
        for bi in range(b):
            for ti in range(t):
                if 0 <= slots[bi, ti] < n:
                    expect[LAYER, :, slots[bi, ti]] = np.asarray(new[bi, ti].astype(jnp.bfloat16), np.float32)
        assert o.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(r, np.float32), expect)
        np.testing.assert_array_equal(np.asarray(o, np.float32), expect)


def test_paged_kernels_reject_bad_pools():
    q = jnp.zeros((2, 1, H, D))
    pool = jnp.zeros((LAYERS, KVH, 96, D))
    pos, lengths, table = jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="page_size must be a power of 2 >= 16"):
        paged_decode_attention(q, pool, pool, table, pos, lengths, scale=1.0, page_size=24, layer=0)
    with pytest.raises(ValueError, match="page_table must be"):
        paged_prefill_attention(q, pool, pool, table[:1], pos, lengths, scale=1.0, page_size=16, layer=0)
    with pytest.raises(ValueError, match="paged k/v"):
        paged_decode_attention(q, pool[:, None], pool[:, None], table, pos, lengths, scale=1.0, page_size=16, layer=0)
    with pytest.raises(ValueError, match="do not fit the paged pool"):
        paged_cache_write(pool, pool, jnp.zeros((2, 1, KVH, 8)), jnp.zeros((2, 1, KVH, 8)), pos, layer=0)


# MiniCPM4-8B attention (32 q heads, 2 KV heads, head_dim 128), page 64, 50 pages per row (not a power of
# 2); the pool 1024 pages, or 400000 slots x 32 layers (3.3e9 elements: past int32 offsets).
_SPEC = jax.ShapeDtypeStruct


def _lower(fn, *args):
    with jax.sharding.use_abstract_mesh(abstract_gpu_mesh()):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("t,slots", [(1, 1024 * 64), (16, 1024 * 64), (512, 1024 * 64), (1, 400000)],
                         ids=["decode1", "decode16", "prefill512", "decode1-huge-pool"])
def test_paged_attention_kernels_lower_for_cuda_without_a_gpu(t, slots):
    """Triton lowering (power-of-2 loads, supported primitives) of the paged decode / prefill kernels."""
    layers = 32 if slots == 400000 else 4
    pool = _SPEC((layers, 2, slots, 128), jnp.bfloat16)
    args = (_SPEC((2, t, 32, 128), jnp.bfloat16), pool, pool, _SPEC((2, 50), jnp.int32), _SPEC((2, t), jnp.int32),
            _SPEC((2,), jnp.int32))
    kernel = paged_decode_attention if t <= 16 else paged_prefill_attention
    text = _lower(functools.partial(kernel, scale=0.1, page_size=64, layer=layers - 1, interpret=False), *args)
    assert "__gpu$xla.gpu.triton" in text
    assert ("minicpm_paged_decode_attention" if t <= 16 else "minicpm_paged_prefill_attention") in text


@pytest.mark.parametrize("n,m,window", [(32, 32, None), (10, 40, 1024)], ids=["verify32", "draft-step-window"])
def test_paged_tree_and_writer_lower_for_cuda_without_a_gpu(n, m, window):
    pool = _SPEC((4, 2, 1024 * 64, 128), jnp.bfloat16)
    args = (_SPEC((1, n, 32, 128), jnp.bfloat16), pool, pool, _SPEC((1, 50), jnp.int32), _SPEC((1,), jnp.int32),
            _SPEC((1, n, m), jnp.bool_), _SPEC((1,), jnp.int32))
    fn = functools.partial(paged_tree_attention, scale=0.1, page_size=64, layer=3, window=window, interpret=False)
    text = _lower(fn, *args)
    assert "__gpu$xla.gpu.triton" in text and "minicpm_paged_tree_attention" in text
    new = _SPEC((1, n, 2, 128), jnp.float32)
    text = _lower(functools.partial(paged_cache_write, layer=3, interpret=False), pool, pool, new, new,
                  _SPEC((1, n), jnp.int32))
    assert "minicpm_paged_cache_write" in text
