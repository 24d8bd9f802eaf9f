"""The Pallas backend (Triton lowering on NVIDIA GPUs; interpret mode elsewhere, for tests): every op of
:mod:`pallas_kernels.xla` under the same name and signature, run by the kernels of this package.

Where one op is served by several kernels, the choice is made here: flash-decoding or flash attention by
the number of query tokens (for the contiguous cache and the paged pool alike); the one-launch compressed-key update for a decode step; InfLLM-v2's decode
path (selection and attention in one kernel) for one query token, and for prefill chunks the block-sparse
kernel below each query's local window merged with the window kernel; a tree verify's ancestor attention and
its merge with the selected blocks' in one kernel where the GQA group fills a tile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention import MAX_DECODE_QUERIES, attention, paged_decode_attention, paged_prefill_attention
from pallas_kernels.cache_write import cache_write, paged_cache_write
from pallas_kernels.collectives import all_reduce, gather_last
from pallas_kernels.flash import merge_attention
from pallas_kernels.infllm.common import Geometry
from pallas_kernels.infllm.compress import (NEW_WINDOWS_MAX, compress_new_windows, compress_windows_reference,
                                            paged_compress_new_windows)
from pallas_kernels.infllm.paged import check_paged_geometry, paged_compress_windows_reference
from pallas_kernels.infllm.decode import pool_select_attention_tiled
from pallas_kernels.infllm.select import pool_select_blocks_tiled
from pallas_kernels.infllm.stage1 import compressed_scores_tiled, score_tile_rows
from pallas_kernels.infllm.stage2 import block_sparse_attention, local_window_attention
from pallas_kernels.infllm.tree_merge import tree_merge_attention as tree_merge_kernel
from pallas_kernels.infllm.tree_merge import tree_merge_attention_reference, tree_merge_supported
from pallas_kernels.int4_matmul import int4_matmul, int4_matmul_parts
from pallas_kernels.launch import is_power_of_2
from pallas_kernels.matmul import matmul, matmul_parts
# Through the peer-memory kernels when the mesh axis has a workspace, else XLA's all-reduce.
from pallas_kernels.residual import residual_add, residual_add_norm
from pallas_kernels.rope_write import paged_rope_write, rope_write
from pallas_kernels.tree_attention import paged_tree_attention, tree_attention

__all__ = ["all_reduce", "attention", "block_sparse_attention", "cache_write", "compress_windows", "gather_last",
           "int4_matmul", "int4_matmul_parts",
           "matmul", "matmul_parts", "paged_attention", "paged_block_sparse_attention", "paged_cache_write",
           "paged_compress_windows",
           "paged_rope_write", "paged_select_blocks", "paged_sparse_attention", "paged_tree_attention", "residual_add",
           "residual_add_norm", "rope_write", "select_blocks", "sparse_attention", "tree_attention",
           "tree_merge_attention"]

# Query tokens per row up to which sparse_attention takes the decode path (selection + attention in one
# kernel, after the two stage-1 passes: four launches in all).
DECODE_PATH_MAX_TOKENS = 1
# Query tokens above which a prefill chunk attends its local windows with the window kernel.
LOCAL_WINDOW_MIN_TOKENS = 16


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                    q_positions: jax.Array, kv_lengths: jax.Array, *, scale: float, page_size: int,
                    layer: int) -> jax.Array:
    """:func:`pallas_kernels.xla.paged_attention` by the kernels: flash-decoding split over each row's pages
    for up to ``MAX_DECODE_QUERIES`` query tokens (decode, tree-sized chunks), flash prefill of the chunk
    over its paged history above."""
    kernel = paged_decode_attention if q.shape[1] <= MAX_DECODE_QUERIES else paged_prefill_attention
    return kernel(q, k_pages, v_pages, page_table, q_positions, kv_lengths, scale=scale, page_size=page_size,
                  layer=layer)


def _new_windows_fit(geometry: Geometry, max_tokens: int, unrotate) -> bool:
    """Whether :func:`compress_new_windows` (or its paged twin) takes an update of ``max_tokens`` new keys:
    keys without ``use_nope``, power-of-2 windows and strides, and at most ``NEW_WINDOWS_MAX`` windows per
    row and window size (decode steps and speculative paths; prompt chunks take the reference)."""
    sizes = (geometry.kernel1, geometry.stride1, geometry.kernel2, geometry.stride2)
    return (unrotate is None and all(map(is_power_of_2, sizes))
            and -(-max_tokens // min(geometry.stride1, geometry.stride2)) <= NEW_WINDOWS_MAX)


def compress_windows(k: jax.Array, k1: jax.Array, k2: jax.Array, old_lengths: jax.Array, new_lengths: jax.Array, *,
                     geometry: Geometry, layer: int | None, max_tokens: int,
                     unrotate=None) -> tuple[jax.Array, jax.Array]:
    """:func:`pallas_kernels.xla.compress_windows`; a few new keys (a decode step, a speculative round's
    accepted path) run as one kernel writing in place, over one layer or all of them
    (:func:`compress_new_windows`)."""
    if _new_windows_fit(geometry, max_tokens, unrotate):
        return compress_new_windows(k, k1, k2, old_lengths, new_lengths, layer=layer, max_tokens=max_tokens,
                                    **geometry.stage1())
    return compress_windows_reference(k, k1, k2, old_lengths, new_lengths, layer=layer, max_tokens=max_tokens,
                                      unrotate=unrotate, **geometry.stage1())


def select_blocks(q: jax.Array, k1: jax.Array, k2: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *,
                  scale: float, geometry: Geometry, num_blocks: int, layer: int | None = None,
                  score_positions: jax.Array | None = None, extra_logits: jax.Array | None = None) -> jax.Array:
    """:func:`pallas_kernels.xla.select_blocks`: the two stage-1 kernels, whose tiles the pooling +
    selection kernel reads in place."""
    pos = q_positions if score_positions is None else score_positions
    scores, tokens = compressed_scores_tiled(q, k1, k2, pos, scale=scale, layer=layer, extra_logits=extra_logits,
                                             **geometry.stage1())
    return pool_select_blocks_tiled(scores, q_positions, kv_lengths, tokens=tokens, tile_rows=score_tile_rows(tokens),
                                    **geometry.select(num_blocks))


def splits_local_window(geometry: Geometry, tokens: int) -> bool:
    """Whether :func:`sparse_attention` splits a chunk's stage 2 into the local window and the blocks below
    it: chunks longer than ``LOCAL_WINDOW_MIN_TOKENS``, when every query's window is inside its selection
    (``topk > init_blocks``: the init blocks and the window's ``local_blocks + 1`` blocks all score +inf
    and ``topk + local_blocks`` are kept)."""
    return tokens > LOCAL_WINDOW_MIN_TOKENS and geometry.topk > geometry.init_blocks


def tree_merge_attention(q: jax.Array, tree_k: jax.Array, tree_v: jax.Array, tree_mask: jax.Array, out_p: jax.Array,
                         lse_p: jax.Array, *, scale: float) -> jax.Array:
    """:func:`pallas_kernels.xla.tree_merge_attention` in one launch (:func:`~pallas_kernels.infllm.tree_merge.
    tree_merge_attention`) for groups of >= 16 query heads per KV head (a tile's rows); XLA's fusions otherwise."""
    if tree_merge_supported(q.shape[2], tree_k.shape[2], q.shape[3]):
        return tree_merge_kernel(q, tree_k, tree_v, tree_mask, out_p, lse_p, scale=scale)
    return tree_merge_attention_reference(q, tree_k, tree_v, tree_mask, out_p, lse_p, scale=scale)


def sparse_attention(q: jax.Array, q_select: jax.Array, k: jax.Array, v: jax.Array, k1: jax.Array, k2: jax.Array,
                     q_positions: jax.Array, kv_lengths: jax.Array, *, scale: float, geometry: Geometry,
                     layer: int | None = None) -> jax.Array:
    """:func:`pallas_kernels.xla.sparse_attention` by the kernels: a decode step in four launches (the two
    stage-1 passes, then the pooling, the pick and stage 2 in one kernel, then the split merge); a prefill
    chunk as the selection kernels, then flash attention over each query's local window merged by
    log-sum-exp with the block-sparse kernel over the selected blocks below it."""
    b, t = q.shape[:2]
    if t <= DECODE_PATH_MAX_TOKENS:
        scores, tokens = compressed_scores_tiled(q_select, k1, k2, q_positions, scale=scale, layer=layer,
                                                 **geometry.stage1())
        return pool_select_attention_tiled(q, k, v, scores, q_positions, kv_lengths, tokens=tokens,
                                           tile_rows=score_tile_rows(tokens), scale=scale, layer=layer,
                                           **geometry.pool_select())
    num_blocks = -(-k.shape[-2] // geometry.block_size)
    blocks = select_blocks(q_select, k1, k2, q_positions, kv_lengths, scale=scale, geometry=geometry,
                           num_blocks=num_blocks, layer=layer)
    if not splits_local_window(geometry, t):
        return block_sparse_attention(q, k, v, q_positions, kv_lengths, blocks, scale=scale,
                                      block_size=geometry.block_size, layer=layer)
    # The forced local window (the last local_blocks + 1 of each query's ascending selection) runs as flash
    # attention tiled over tokens; the per-token kernel only reads the blocks below it.
    lo_blk = jnp.maximum(q_positions // geometry.block_size - geometry.local_blocks, 0)[:, None, :, None]
    far = jnp.where(blocks < lo_blk, blocks, -1)  # still valid entries first
    parts = [
        block_sparse_attention(q, k, v, q_positions, kv_lengths, far, scale=scale, block_size=geometry.block_size,
                               layer=layer, return_lse=True, whole_blocks=True),
        local_window_attention(q, k, v, q_positions, kv_lengths, scale=scale, block_size=geometry.block_size,
                               local_blocks=geometry.local_blocks, layer=layer),
    ]
    return merge_attention(parts).astype(q.dtype)


# ---------------------------------------------------------------------------- InfLLM-v2 over a paged pool
# The same kernels with a page table (pallas_kernels.infllm.paged: blocks are pages, compressed keys in the
# page of their window's last key), chosen as for the contiguous cache.

def paged_compress_windows(k_pages: jax.Array, k1_pages: jax.Array, k2_pages: jax.Array, page_table: jax.Array,
                           old_lengths: jax.Array, new_lengths: jax.Array, *, geometry: Geometry, layer: int | None,
                           max_tokens: int, page_size: int, unrotate=None) -> tuple[jax.Array, jax.Array]:
    """:func:`pallas_kernels.xla.paged_compress_windows`; a few new keys run as one kernel writing in place,
    as for the contiguous cache (:func:`paged_compress_new_windows`)."""
    if _new_windows_fit(geometry, max_tokens, unrotate):
        return paged_compress_new_windows(k_pages, k1_pages, k2_pages, page_table, old_lengths, new_lengths,
                                          layer=layer, page_size=page_size, max_tokens=max_tokens, **geometry.stage1())
    return paged_compress_windows_reference(k_pages, k1_pages, k2_pages, page_table, old_lengths, new_lengths,
                                            layer=layer, page_size=page_size, max_tokens=max_tokens, unrotate=unrotate,
                                            **geometry.stage1())


def paged_select_blocks(q: jax.Array, k1_pages: jax.Array, k2_pages: jax.Array, page_table: jax.Array,
                        q_positions: jax.Array, kv_lengths: jax.Array, *, scale: float, geometry: Geometry, layer: int,
                        page_size: int, score_positions: jax.Array | None = None,
                        extra_logits: jax.Array | None = None) -> jax.Array:
    """:func:`pallas_kernels.xla.paged_select_blocks`: the two stage-1 kernels gathering the compressed keys
    through the page table, then the pooling + selection kernel."""
    check_paged_geometry(page_size, block_size=geometry.block_size, stride1=geometry.stride1,
                         stride2=geometry.stride2)
    pos = q_positions if score_positions is None else score_positions
    scores, tokens = compressed_scores_tiled(q, k1_pages, k2_pages, pos, scale=scale, layer=layer,
                                             extra_logits=extra_logits, page_table=page_table, page_size=page_size,
                                             **geometry.stage1())
    return pool_select_blocks_tiled(scores, q_positions, kv_lengths, tokens=tokens, tile_rows=score_tile_rows(tokens),
                                    **geometry.select(page_table.shape[1]))


def paged_block_sparse_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                                 q_positions: jax.Array, kv_lengths: jax.Array, block_indices: jax.Array, *,
                                 scale: float, block_size: int, layer: int,
                                 return_lse: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`pallas_kernels.xla.paged_block_sparse_attention` by the block-sparse kernel over pages."""
    return block_sparse_attention(q, k_pages, v_pages, q_positions, kv_lengths, block_indices, scale=scale,
                                  block_size=block_size, layer=layer, return_lse=return_lse, page_table=page_table)


def paged_sparse_attention(q: jax.Array, q_select: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           k1_pages: jax.Array, k2_pages: jax.Array, page_table: jax.Array, q_positions: jax.Array,
                           kv_lengths: jax.Array, *, scale: float, geometry: Geometry, layer: int,
                           page_size: int) -> jax.Array:
    """:func:`pallas_kernels.xla.paged_sparse_attention` by the kernels, with :func:`sparse_attention`'s
    choices: a decode step in four launches, a prefill chunk as the selection, the local window and the
    blocks below it."""
    check_paged_geometry(page_size, block_size=geometry.block_size, stride1=geometry.stride1,
                         stride2=geometry.stride2)
    t = q.shape[1]
    paged = dict(page_table=page_table)
    if t <= DECODE_PATH_MAX_TOKENS:
        scores, tokens = compressed_scores_tiled(q_select, k1_pages, k2_pages, q_positions, scale=scale, layer=layer,
                                                 page_size=page_size, **paged, **geometry.stage1())
        return pool_select_attention_tiled(q, k_pages, v_pages, scores, q_positions, kv_lengths, tokens=tokens,
                                           tile_rows=score_tile_rows(tokens), scale=scale, layer=layer, **paged,
                                           **geometry.pool_select())
    blocks = paged_select_blocks(q_select, k1_pages, k2_pages, page_table, q_positions, kv_lengths, scale=scale,
                                 geometry=geometry, layer=layer, page_size=page_size)
    if not splits_local_window(geometry, t):
        return block_sparse_attention(q, k_pages, v_pages, q_positions, kv_lengths, blocks, scale=scale,
                                      block_size=geometry.block_size, layer=layer, **paged)
    lo_blk = jnp.maximum(q_positions // geometry.block_size - geometry.local_blocks, 0)[:, None, :, None]
    far = jnp.where(blocks < lo_blk, blocks, -1)  # still valid entries first
    parts = [
        block_sparse_attention(q, k_pages, v_pages, q_positions, kv_lengths, far, scale=scale,
                               block_size=geometry.block_size, layer=layer, return_lse=True, whole_blocks=True,
                               **paged),
        local_window_attention(q, k_pages, v_pages, q_positions, kv_lengths, scale=scale,
                               block_size=geometry.block_size, local_blocks=geometry.local_blocks, layer=layer,
                               **paged),
    ]
    return merge_attention(parts).astype(q.dtype)
