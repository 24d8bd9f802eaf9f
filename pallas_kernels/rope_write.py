"""RoPE of a decode step's query and key heads and the write of its keys and values, in one launch.

XLA runs this glue of a decode layer as three fusions after the qkv projection (the v heads sliced out, the
k heads and the q heads rotated; each sums the GEMM's split-K partials again) and then the cache-write
kernel: four launches a layer for a few KB of data (the optimized HLO of a 1K decode step, lab note of the
forty-fifth session). Here the projection's output goes in whole (``[B, T, Hq + 2·KVH, D]``, a free reshape);
program ``(b, t, h)`` rotates query head ``h`` (``h < Hq``) into the output, or rotates key head ``h − Hq``
and stores it with value head ``h − Hq`` at the token's slot of the cache (aliased in place). XLA then runs
one launch before it (the split-K sum), so two launches replace four; given the GEMM's parts, one.

Shared signature (contiguous cache, the layout of :mod:`pallas_kernels.cache_write`)::

    f(k_cache, v_cache, qkv, cos, sin, slots, *, layer, q_heads, dtype=None) -> (q, k_cache, v_cache)

qkv ``[B, T, Hq + 2·KVH, D]`` (heads in the order q, k, v), or the projection's fp32 K-split parts as a
:class:`~pallas_kernels.matmul.SplitSum` of shape ``[B, T, (Hq + 2·KVH)·D]``, which are summed and rounded to
``dtype`` (required then; heads keep their own) before anything else: the kernel adds them as it reads a head, so the
split-K GEMM's own sum is not a launch of its own (1.2 µs a layer on an H200); cos / sin float32 ``[B, T, D/2]``
(the RoPE tables of :func:`rotate`, attention scaling included); slots ``int32 [B, T]`` as :func:`cache_write`'s
(outside the cache: dropped). q: ``[B, T, Hq, D]`` rotated, in ``dtype``. Paged (``k_pages`` ``[L, KVH,
N, D]``, flat pool slots): ``paged_rope_write`` with the same arguments.

The rotation is the rotate-half convention in float32 (``x·cos + rotate_half(x)·sin``), rounded once to the
output dtype. The kernel runs the reference's float32 operations; XLA may contract them into fused
multiply-adds on a GPU (Triton does not), so the two agree within float32 rounding before the cast (bit for
bit in interpret mode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.cache_write import (MAX_KERNEL_TOKENS, cache_write_reference, check_new,
                                        paged_cache_write_reference)
from pallas_kernels.launch import KernelConfig, is_power_of_2, launch_options
from pallas_kernels.matmul import SplitSum


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x [B, T, H, D]`` rotated by the tables ``cos, sin [B, T, D/2]`` (float32): ``[x1·cos − x2·sin,
    x2·cos + x1·sin]`` over the halves ``x1, x2`` of the last axis, in float32, cast back to x's dtype."""
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _split(qkv: jax.Array, q_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    kv_heads = (qkv.shape[2] - q_heads) // 2
    if q_heads <= 0 or kv_heads <= 0 or q_heads + 2 * kv_heads != qkv.shape[2]:
        raise ValueError(f"{qkv.shape[2]} heads are not {q_heads} query heads and as many key as value heads")
    return qkv[:, :, :q_heads], qkv[:, :, q_heads : q_heads + kv_heads], qkv[:, :, q_heads + kv_heads :]


def heads_of(qkv: jax.Array | SplitSum, dtype, head_dim: int) -> jax.Array:
    """``qkv`` as heads ``[B, T, H, D]`` in ``dtype``: an array as it is, parts summed (:meth:`SplitSum.total`)
    and rounded to ``dtype``."""
    if not isinstance(qkv, SplitSum):
        return qkv
    if dtype is None:
        raise ValueError("rope_write needs the dtype to round the projection's parts to")
    b, t, n = qkv.shape
    if n % head_dim:
        raise ValueError(f"a projection of {n} features is not heads of {head_dim}")
    return qkv.total().astype(dtype).reshape(b, t, n // head_dim, head_dim)


def rotate_then_write(write, k_cache, v_cache, qkv, cos, sin, slots, *, layer: int, q_heads: int, dtype=None):
    """q and k rotated by :func:`rotate`, then ``write`` (an op of :mod:`pallas_kernels.cache_write`'s
    signature: its reference's scatters; its kernel gives the launches a step ran before this module, which
    the forty-fifth session's A/B measured against)."""
    q, k, v = _split(heads_of(qkv, dtype, k_cache.shape[-1]), q_heads)
    k_cache, v_cache = write(k_cache, v_cache, rotate(k, cos, sin), v, slots, layer=layer)
    return rotate(q, cos, sin), k_cache, v_cache


def rope_write_reference(k_cache, v_cache, qkv, cos, sin, slots, *, layer: int, q_heads: int, dtype=None):
    """The oracle: :func:`rotate`, then :func:`cache_write_reference`."""
    return rotate_then_write(cache_write_reference, k_cache, v_cache, qkv, cos, sin, slots, layer=layer,
                             q_heads=q_heads, dtype=dtype)


def paged_rope_write_reference(k_pages, v_pages, qkv, cos, sin, slots, *, layer: int, q_heads: int, dtype=None):
    """The paged oracle: :func:`rotate`, then :func:`paged_cache_write_reference`."""
    return rotate_then_write(paged_cache_write_reference, k_pages, v_pages, qkv, cos, sin, slots, layer=layer,
                             q_heads=q_heads, dtype=dtype)


def _rope_write_kernel(slot_ref, cos_ref, sin_ref, x_ref, vn_ref, _k_in, _v_in, q_ref, k_ref, v_ref, *,
                       q_heads: int, tokens: int, max_length: int, parts: bool):
    """Program (b, t, h): ``x_ref`` is head h of token t of row b (a query head below ``q_heads``, else key
    head ``h − q_heads``); ``vn_ref`` the matching value head (a key program's); ``k_ref``/``v_ref`` the
    ``[max_length, D]`` slice the key head is stored into. With ``parts`` the two heads are ``[S, D]`` fp32
    K-split parts, summed and rounded to q's dtype first (as :func:`heads_of`).

    Query programs are handed KV head 0's cache slice and key programs the last query head's output block,
    which they never store to: Triton writes only what a program stores (interpret mode copies each block
    out and back unchanged, in grid order). A backend that writes output blocks back by itself needs a grid
    split by role instead."""
    h = pl.program_id(2)
    half = cos_ref.shape[-1]
    c, s = cos_ref[...], sin_ref[...]
    dtype = q_ref.dtype

    def head(ref, start, size):  # a head's columns in the projection's dtype
        if not parts:
            return ref[pl.ds(start, size)]
        return jnp.sum(ref[:, pl.ds(start, size)], axis=0).astype(dtype)

    x1 = head(x_ref, 0, half).astype(jnp.float32)
    x2 = head(x_ref, half, half).astype(jnp.float32)
    lo, hi = x1 * c - x2 * s, x2 * c + x1 * s

    @pl.when(h < q_heads)
    def _():
        q_ref[pl.ds(0, half)] = lo.astype(q_ref.dtype)
        q_ref[pl.ds(half, half)] = hi.astype(q_ref.dtype)

    slot = slot_ref[pl.program_id(0) * tokens + pl.program_id(1)]

    @pl.when((h >= q_heads) & (slot >= 0) & (slot < max_length))
    def _():  # the key rounded to qkv's dtype first, as the reference's rotation returns it
        k_ref[pl.ds(slot, 1), pl.ds(0, half)] = lo.astype(dtype).astype(k_ref.dtype)[None, :]
        k_ref[pl.ds(slot, 1), pl.ds(half, half)] = hi.astype(dtype).astype(k_ref.dtype)[None, :]
        v_ref[pl.ds(slot, 1), :] = head(vn_ref, 0, vn_ref.shape[-1]).astype(v_ref.dtype)[None, :]


def _rope_write_call(k_cache, v_cache, qkv, cos, sin, slots, q_heads, dtype, cache_spec, name, interpret):
    """One launch over (row, token, query head or KV head); ``cache_spec(row, kv_head)`` the BlockSpec index
    of the ``[rows, D]`` slice a key program writes into. ``qkv``: heads ``[B, T, H, D]``, or a SplitSum whose
    parts ``[S, M, H·D]`` (S a power of 2: a Triton block) each program reads whole for its head."""
    d = k_cache.shape[-1]
    b, t = qkv.shape[:2]
    heads = qkv.shape[-1] // d if isinstance(qkv, SplitSum) else qkv.shape[2]
    kv_heads = (heads - q_heads) // 2

    def kv_head(h):
        return jnp.maximum(h - q_heads, 0)

    def head_spec(head):  # the BlockSpec of one head of token (i, j), ``head(h)`` its index
        if isinstance(qkv, SplitSum):  # parts [S, M, H, D]: row i·T + j of M (padding rows are never read)
            return pl.BlockSpec((qkv.parts.shape[0], None, None, d), lambda i, j, h: (0, i * t + j, head(h), 0))
        return pl.BlockSpec((None, None, None, d), lambda i, j, h: (i, j, head(h), 0))

    x = qkv.parts.reshape(*qkv.parts.shape[:2], heads, d) if isinstance(qkv, SplitSum) else qkv
    table_spec = pl.BlockSpec((None, None, d // 2), lambda i, j, h: (i, j, 0))
    cache_block = (None, None, None, k_cache.shape[-2], d) if k_cache.ndim == 5 else (None, None, k_cache.shape[-2], d)
    cache = pl.BlockSpec(cache_block, lambda i, j, h: cache_spec(i, kv_head(h)))
    return pl.pallas_call(
        functools.partial(_rope_write_kernel, q_heads=q_heads, tokens=t, max_length=k_cache.shape[-2],
                          parts=isinstance(qkv, SplitSum)),
        grid=(b, t, q_heads + kv_heads),
        in_specs=[pl.BlockSpec((b * t,), lambda i, j, h: (0,)), table_spec, table_spec,
                  head_spec(lambda h: h), head_spec(lambda h: q_heads + kv_heads + kv_head(h)), cache, cache],
        out_specs=[pl.BlockSpec((None, None, None, d), lambda i, j, h: (i, j, jnp.minimum(h, q_heads - 1), 0)),
                   cache, cache],
        out_shape=[jax.ShapeDtypeStruct((b, t, q_heads, d), dtype),
                   jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={5: 1, 6: 2},
        name=name,
        **launch_options(KernelConfig(block_q=1, block_k=1, num_warps=1, num_stages=1), interpret),
    )(slots.reshape(b * t).astype(jnp.int32), cos.astype(jnp.float32), sin.astype(jnp.float32), x, x,
      k_cache, v_cache)


def _kernel_input(qkv, dtype, head_dim: int):
    """(what the kernel reads, q's dtype): heads, or parts whose count is a power of 2 (others summed first)."""
    if not isinstance(qkv, SplitSum):
        return qkv, qkv.dtype  # heads keep their dtype, as in the reference
    return (qkv if is_power_of_2(qkv.parts.shape[0]) else heads_of(qkv, dtype, head_dim)), dtype


def _check(qkv, cos, sin, slots, q_heads: int, head_dim: int, dtype):
    """ValueError unless the heads (shapes only), tables, slots and cache's head_dim agree; the KV head count."""
    q, k, v = jax.eval_shape(lambda a: _split(heads_of(a, dtype, head_dim), q_heads), qkv)
    check_new(k, v, slots)
    b, t, kv_heads, d = k.shape
    if d != head_dim or d % 2 or cos.shape != (b, t, d // 2) or sin.shape != cos.shape:
        heads = (b, t, q.shape[2] + 2 * kv_heads, d)
        raise ValueError(f"RoPE tables {cos.shape} / {sin.shape} do not match heads {heads} and a cache of "
                         f"head_dim {head_dim}")
    return kv_heads


def rope_write(k_cache, v_cache, qkv, cos, sin, slots, *, layer: int, q_heads: int, dtype=None,
               interpret: bool | None = None):
    """Pallas version of :func:`rope_write_reference` (one launch; the caches in place). More than
    ``MAX_KERNEL_TOKENS`` tokens a row (prefill chunks) take the reference."""
    kv_heads = _check(qkv, cos, sin, slots, q_heads, k_cache.shape[-1], dtype)
    b, t = qkv.shape[:2]
    if k_cache.ndim != 5 or k_cache.shape[1:3] != (b, kv_heads) or v_cache.shape != k_cache.shape:
        raise ValueError(f"heads {qkv.shape} ({q_heads} query heads) do not fit the cache {k_cache.shape}")
    if t > MAX_KERNEL_TOKENS:
        return rope_write_reference(k_cache, v_cache, qkv, cos, sin, slots, layer=layer, q_heads=q_heads,
                                    dtype=dtype)
    x, dtype = _kernel_input(qkv, dtype, k_cache.shape[-1])
    return _rope_write_call(k_cache, v_cache, x, cos, sin, slots, q_heads, dtype,
                            lambda i, n: (layer, i, n, 0, 0), "minicpm_rope_write", interpret)


def paged_rope_write(k_pages, v_pages, qkv, cos, sin, slots, *, layer: int, q_heads: int, dtype=None,
                     interpret: bool | None = None):
    """Pallas version of :func:`paged_rope_write_reference` (one launch; the pool in place)."""
    kv_heads = _check(qkv, cos, sin, slots, q_heads, k_pages.shape[-1], dtype)
    if k_pages.ndim != 4 or k_pages.shape[1] != kv_heads or v_pages.shape != k_pages.shape:
        raise ValueError(f"heads {qkv.shape} ({q_heads} query heads) do not fit the paged pool {k_pages.shape}")
    if qkv.shape[1] > MAX_KERNEL_TOKENS:
        return paged_rope_write_reference(k_pages, v_pages, qkv, cos, sin, slots, layer=layer, q_heads=q_heads,
                                          dtype=dtype)
    x, dtype = _kernel_input(qkv, dtype, k_pages.shape[-1])
    return _rope_write_call(k_pages, v_pages, x, cos, sin, slots, q_heads, dtype, lambda i, n: (layer, n, 0, 0),
                            "minicpm_paged_rope_write", interpret)
