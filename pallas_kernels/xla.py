"""The reference backend: every op in plain jnp, lowered by XLA.

It is the oracle the Pallas kernels are tested against and the path on hardware they do not support (and
on CPUs, where Pallas would run in interpret mode). Its names and signatures are those of every backend
namespace (:mod:`pallas_kernels.backend` chooses one); see :mod:`pallas_kernels.triton` for the kernels.
"""

from __future__ import annotations

import jax

from pallas_kernels.attention import attention_reference as attention
from pallas_kernels.cache_write import cache_write_reference as cache_write
from pallas_kernels.cache_write import paged_cache_write_reference as paged_cache_write
from pallas_kernels.collectives import all_reduce_reference as all_reduce
from pallas_kernels.collectives import gather_last_reference as gather_last
from pallas_kernels.infllm.common import Geometry
from pallas_kernels.infllm.compress import compress_windows_reference
from pallas_kernels.infllm.paged import (
    check_paged_geometry,
    paged_block_sparse_attention_reference,
    paged_compress_windows_reference,
    paged_compressed_scores_reference,
)
from pallas_kernels.infllm.select import pool_select_blocks_reference
from pallas_kernels.infllm.stage1 import compressed_scores_reference
from pallas_kernels.infllm.stage2 import block_sparse_attention_reference as block_sparse_attention
from pallas_kernels.infllm.tree_merge import tree_merge_attention_reference as tree_merge_attention
from pallas_kernels.int4_matmul import int4_matmul_reference as int4_matmul
from pallas_kernels.int4_matmul import int4_matmul_parts_reference as int4_matmul_parts
from pallas_kernels.matmul import matmul
from pallas_kernels.matmul import matmul_parts_reference as matmul_parts
from pallas_kernels.paged import paged_attention_reference as paged_attention
from pallas_kernels.paged import paged_tree_attention_reference as paged_tree_attention
from pallas_kernels.residual import residual_add_norm_reference as residual_add_norm
from pallas_kernels.residual import residual_add_reference as residual_add
from pallas_kernels.rope_write import paged_rope_write_reference as paged_rope_write
from pallas_kernels.rope_write import rope_write_reference as rope_write
from pallas_kernels.topk import top_k
from pallas_kernels.tree_attention import tree_attention_reference as tree_attention

__all__ = ["all_reduce", "attention", "block_sparse_attention", "cache_write", "compress_windows", "gather_last",
           "int4_matmul", "int4_matmul_parts",
           "matmul", "matmul_parts", "paged_attention", "paged_block_sparse_attention", "paged_cache_write",
           "paged_compress_windows",
           "paged_rope_write", "paged_select_blocks", "paged_sparse_attention", "paged_tree_attention", "residual_add",
           "residual_add_norm", "rope_write", "select_blocks", "sparse_attention", "tree_attention",
           "tree_merge_attention"]


def compress_windows(k: jax.Array, k1: jax.Array, k2: jax.Array, old_lengths: jax.Array, new_lengths: jax.Array, *,
                     geometry: Geometry, layer: int | None, max_tokens: int,
                     unrotate=None) -> tuple[jax.Array, jax.Array]:
    """InfLLM-v2's compressed keys (k1, k2) of ``layer`` (None: every layer) extended over the windows
    completed between ``old_lengths`` and ``new_lengths``
    (:func:`~pallas_kernels.infllm.compress.compress_windows_reference`)."""
    return compress_windows_reference(k, k1, k2, old_lengths, new_lengths, layer=layer, max_tokens=max_tokens,
                                      unrotate=unrotate, **geometry.stage1())


def select_blocks(q: jax.Array, k1: jax.Array, k2: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *,
                  scale: float, geometry: Geometry, num_blocks: int, layer: int | None = None,
                  score_positions: jax.Array | None = None, extra_logits: jax.Array | None = None) -> jax.Array:
    """InfLLM-v2 stage 1 and block selection: ``q [B, T, H, D]`` against the compressed keys → the blocks
    each query attends ``int32[B, KVH, T, K]``, ascending, -1 padded (``K = min(num_selected, num_blocks)``).
    ``score_positions`` (default ``q_positions``) and ``extra_logits``: stage 1's query positions and one
    more coarse logit per query head (a speculative tree node's, see ``compressed_scores_reference``)."""
    pos = q_positions if score_positions is None else score_positions
    scores = compressed_scores_reference(q, k1, k2, pos, scale=scale, layer=layer, extra_logits=extra_logits,
                                         **geometry.stage1())
    return pool_select_blocks_reference(scores, q_positions, kv_lengths, top_k=top_k, **geometry.select(num_blocks))


def sparse_attention(q: jax.Array, q_select: jax.Array, k: jax.Array, v: jax.Array, k1: jax.Array, k2: jax.Array,
                     q_positions: jax.Array, kv_lengths: jax.Array, *, scale: float, geometry: Geometry,
                     layer: int | None = None) -> jax.Array:
    """InfLLM-v2 attention of ``q [B, T, H, D]`` (post-RoPE) over the cache: stage-1 scores of ``q_select``
    (``q``, or pre-RoPE q with ``use_nope``), block selection, block-sparse attention. ``[B, T, H, D]``."""
    num_blocks = -(-k.shape[-2] // geometry.block_size)
    blocks = select_blocks(q_select, k1, k2, q_positions, kv_lengths, scale=scale, geometry=geometry,
                           num_blocks=num_blocks, layer=layer)
    return block_sparse_attention(q, k, v, q_positions, kv_lengths, blocks, scale=scale,
                                  block_size=geometry.block_size, layer=layer)


# ---------------------------------------------------------------------------- InfLLM-v2 over a paged pool
# The pool's layout (compressed keys in the page of their window's last key, blocks = pages) is that of
# pallas_kernels.infllm.paged; k_pages / v_pages [L, KVH, N, D], k1_pages / k2_pages [L, KVH, R1 | R2, D],
# page_table int32[B, P].

def paged_compress_windows(k_pages: jax.Array, k1_pages: jax.Array, k2_pages: jax.Array, page_table: jax.Array,
                           old_lengths: jax.Array, new_lengths: jax.Array, *, geometry: Geometry, layer: int | None,
                           max_tokens: int, page_size: int, unrotate=None) -> tuple[jax.Array, jax.Array]:
    """:func:`compress_windows` over the pool: the new entries written into the pages their windows end in."""
    return paged_compress_windows_reference(k_pages, k1_pages, k2_pages, page_table, old_lengths, new_lengths,
                                            layer=layer, page_size=page_size, max_tokens=max_tokens, unrotate=unrotate,
                                            **geometry.stage1())


def paged_select_blocks(q: jax.Array, k1_pages: jax.Array, k2_pages: jax.Array, page_table: jax.Array,
                        q_positions: jax.Array, kv_lengths: jax.Array, *, scale: float, geometry: Geometry, layer: int,
                        page_size: int, score_positions: jax.Array | None = None,
                        extra_logits: jax.Array | None = None) -> jax.Array:
    """:func:`select_blocks` over the pool: the blocks (= pages, logical indices below ``P``) each query
    attends ``int32[B, KVH, T, K]``."""
    check_paged_geometry(page_size, block_size=geometry.block_size, stride1=geometry.stride1,
                         stride2=geometry.stride2)
    pos = q_positions if score_positions is None else score_positions
    scores = paged_compressed_scores_reference(q, k1_pages, k2_pages, page_table, pos, scale=scale, layer=layer,
                                               page_size=page_size, extra_logits=extra_logits, **geometry.stage1())
    return pool_select_blocks_reference(scores, q_positions, kv_lengths, top_k=top_k,
                                        **geometry.select(page_table.shape[1]))


def paged_block_sparse_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                                 q_positions: jax.Array, kv_lengths: jax.Array, block_indices: jax.Array, *,
                                 scale: float, block_size: int, layer: int,
                                 return_lse: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`block_sparse_attention` over the pool (a block is a page of ``block_size`` tokens)."""
    return paged_block_sparse_attention_reference(q, k_pages, v_pages, page_table, q_positions, kv_lengths,
                                                  block_indices, scale=scale, block_size=block_size, layer=layer,
                                                  return_lse=return_lse)


def paged_sparse_attention(q: jax.Array, q_select: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           k1_pages: jax.Array, k2_pages: jax.Array, page_table: jax.Array, q_positions: jax.Array,
                           kv_lengths: jax.Array, *, scale: float, geometry: Geometry, layer: int,
                           page_size: int) -> jax.Array:
    """:func:`sparse_attention` over the pool: selection, then block-sparse attention over the picked pages."""
    blocks = paged_select_blocks(q_select, k1_pages, k2_pages, page_table, q_positions, kv_lengths, scale=scale,
                                 geometry=geometry, layer=layer, page_size=page_size)
    return paged_block_sparse_attention(q, k_pages, v_pages, page_table, q_positions, kv_lengths, blocks, scale=scale,
                                        block_size=geometry.block_size, layer=layer)
