"""InfLLM-v2 for a decode step: the block selection and the attention over the picks in one kernel, beside
its jnp reference (the pooling + pick of :mod:`pallas_kernels.infllm.select`, then the block-sparse
attention of :mod:`pallas_kernels.infllm.stage2`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.flash import (
    LOG2E,
    MIN_ROWS,
    attend_block,
    empty_carry,
    group_tiles,
    layer_view,
    load_block,
    merge_splits_rows,
    page_row,
    page_table_spec,
    paged_refs,
    store_split,
)
from pallas_kernels.infllm.common import sparse_splits, split_grid_io
from pallas_kernels.infllm.select import (
    DECODE_SEARCH_BITS,
    pick_mask,
    pool_select_blocks_reference,
    pooled_block_scores,
    search_key_bits,
)
from pallas_kernels.infllm.stage2 import block_sparse_attention_reference
from pallas_kernels.launch import KernelConfig, launch_options, next_power_of_2

# A decode step's sparse attention is latency-bound: its data is a few MB (K1/K2 and 96 blocks), but the
# general path is a chain of ~10 launches (two stage-1 passes and their merge, the selection, index and
# query padding, the block-sparse kernel, the split merge). For decode the chain is four launches: the two
# stage-1 passes (the LSE merged inside the second), one kernel in which every program of a token repeats
# the pooling and the pick and then attends its share of the picks, and the split merge as one kernel.


def pool_select_attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, scores: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *,
    scale: float, block_size: int, k_blocks: int, kernel1: int, stride1: int, init_blocks: int, local_blocks: int,
    layer: int | None = None,
) -> jax.Array:
    """Block selection from stage-1 scores ``fp32[B, KVH, T, N1]`` and the block-sparse attention of q
    ``[B, T, H, D]`` over the picks, in plain jnp: :func:`pool_select_blocks_reference` (``k_blocks`` picks
    of ``block_size``-token blocks, ``block_size / stride1`` fine entries per block, blocks counted over
    the whole cache) then :func:`block_sparse_attention_reference`. Returns ``[B, T, H, D]``."""
    num_blocks = -(-k.shape[-2] // block_size)
    blocks = pool_select_blocks_reference(scores, q_positions, kv_lengths, k=min(k_blocks, num_blocks),
                                          kernel1=kernel1, stride1=stride1, ratio=block_size // stride1,
                                          num_blocks=num_blocks, init_blocks=init_blocks, local_blocks=local_blocks)
    return block_sparse_attention_reference(q, k, v, q_positions, kv_lengths, blocks, scale=scale,
                                            block_size=block_size, layer=layer)


# Picks per program up to which pool_select_attention unrolls its loop and loads all picked blocks first.
_UNROLLED_PICKS = 4


def _pool_select_attend_kernel(*refs, qk_scale, k, block_size, seq_len, per_split, tokens, pool, page_size=None):
    """One (batch, KV head, token, split): the token's pooled block scores and picks (the same in every
    split of the token), then online softmax over the picks ranked ``[split * per_split, ...)``."""
    pages_ref, (len_ref, pos_ref, s_ref, q_ref, k_ref, v_ref, o_ref, lse_ref) = paged_refs(refs, 1, page_size)
    kv_len = len_ref[pl.program_id(0)]
    pos = pos_ref[pl.program_id(0) * tokens + pl.program_id(2)]
    score, lim = pooled_block_scores(s_ref, pos, kv_len, **pool)
    take = pick_mask(score, lim, k=k, bits=DECODE_SEARCH_BITS, key_bits=search_key_bits(s_ref.dtype))
    blk = lax.broadcasted_iota(jnp.int32, score.shape, 0)
    rank = jnp.where(take, jnp.cumsum(take.astype(jnp.int32)), 0)  # 1.. for picks in ascending block order
    q = q_ref[...]
    rows = q.shape[0]
    row_pos = jnp.full((rows,), pos, jnp.int32)
    first = pl.program_id(3) * per_split
    step = functools.partial(attend_block, q, k_ref, v_ref, qk_scale=qk_scale, block_k=block_size, pos=row_pos)

    def block(r):  # the pick of rank r (0-based): where its slice starts, its first key, its key limit, and
        # the buffer row of its first key (None: the slice's start; paged: a block is one page)
        found = jnp.sum(jnp.where(rank == r + 1, blk + 1, 0))  # 0: a rank past the picks
        block_start = jnp.maximum(found - 1, 0) * block_size
        # The slice is clamped into the buffer; keys before the block's start are masked out by `lo`; a
        # rank past the picks gets an empty range (nothing read, nothing attended).
        limit = jnp.where(found > 0, jnp.minimum(kv_len, block_start + block_size), block_start)
        if pages_ref is not None:
            return block_start, block_start, limit, page_row(pages_ref, block_start, page_size)
        return jnp.minimum(block_start, seq_len - block_size), block_start, limit, None

    carry = empty_carry(rows, q.shape[1])
    if per_split <= _UNROLLED_PICKS:  # every pick's loads are issued before the first one is used
        picks = [block(first + i) for i in range(per_split)]
        kvs = [load_block(k_ref, v_ref, start, block_k=block_size, kv_len=limit, lo=lo, row=row)
               for start, lo, limit, row in picks]
        for (start, lo, limit, row), kv in zip(picks, kvs):
            carry = step(start, carry, kv_len=limit, lo=lo, kv=kv, row=row)
    else:
        def body(r, c):
            start, lo, limit, row = block(r)
            return step(start, c, kv_len=limit, lo=lo, row=row)

        total = jnp.sum(take.astype(jnp.int32))
        carry = lax.fori_loop(first, jnp.minimum(first + per_split, total), body, carry)
    store_split(o_ref, lse_ref, carry)


def pool_select_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, scores: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *,
    scale: float, block_size: int, k_blocks: int, kernel1: int, stride1: int, init_blocks: int, local_blocks: int,
    layer: int | None = None, num_splits: int | None = None, config: KernelConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Pallas version of :func:`pool_select_attention_reference` (same signature): the selection and stage
    2 in one launch, then the split merge in another (:func:`merge_splits_rows`). Grid (batch, KV head,
    token, split): every program of a token pools and picks (:func:`pooled_block_scores`,
    :func:`pick_mask`: bit for bit the reference's picks), then attends the picks of its rank range in
    ascending block order, as :func:`block_sparse_attention` attends a split of the sorted list. Meant for
    a few tokens (decode), where repeating the selection in every split costs less than a launch.
    ``num_splits`` is rounded up to a power of 2."""
    return pool_select_attention_tiled(q, k, v, scores, q_positions, kv_lengths, tokens=1, tile_rows=1, scale=scale,
                                       block_size=block_size, k_blocks=k_blocks, kernel1=kernel1, stride1=stride1,
                                       init_blocks=init_blocks, local_blocks=local_blocks, layer=layer,
                                       num_splits=num_splits, config=config, interpret=interpret)


def pool_select_attention_tiled(
    q: jax.Array, k: jax.Array, v: jax.Array, scores: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *,
    tokens: int, tile_rows: int, scale: float, block_size: int, k_blocks: int, kernel1: int, stride1: int,
    init_blocks: int, local_blocks: int, layer: int | None = None, num_splits: int | None = None,
    config: KernelConfig | None = None, interpret: bool | None = None, page_table: jax.Array | None = None,
) -> jax.Array:
    """:func:`pool_select_attention` on scores in :func:`compressed_scores_tiled`'s layout (``[B, KVH,
    n_tiles * tile_rows, N1]``, fp32 or bf16, token ``t`` in row ``(t // tokens) * tile_rows + t % tokens``), read in
    place. With ``page_table int32[B, P]``, k / v are a paged pool ``[L, KVH, N, D]`` of ``block_size``-token
    pages, and the blocks are each row's ``P`` pages."""
    paged = page_table is not None
    if not paged:
        (k, _), (v, layer) = layer_view(k, layer), layer_view(v, layer)
    b, t, h, d = q.shape
    kvh, s = k.shape[-3], k.shape[-2]
    if s < block_size:
        raise ValueError(f"pool_select_attention needs a cache of at least one block ({block_size}), got {s}")
    n1 = scores.shape[-1]
    num_blocks = page_table.shape[1] if paged else pl.cdiv(s, block_size)
    k_sel = min(k_blocks, num_blocks)
    group = h // kvh
    rows = max(MIN_ROWS, next_power_of_2(group))
    splits = next_power_of_2(num_splits or sparse_splits(b, kvh, t, k_sel))
    per_split = pl.cdiv(k_sel, splits)
    nbp = next_power_of_2(num_blocks)
    # 8 warps from 2048 blocks (128K tokens) on: the search's compares then dominate (H100, 128K: 11.1 vs
    # 11.5 us; at 8K, 128 blocks, 4 warps: 8.0 vs 8.5).
    cfg = config or KernelConfig(block_q=1, block_k=block_size, num_warps=4 if nbp < 2048 else 8, num_stages=1)
    pool = dict(kernel1=kernel1, stride1=stride1, ratio=block_size // stride1, n1=n1, num_blocks=num_blocks,
                init_blocks=init_blocks, local_blocks=local_blocks)
    kernel = functools.partial(_pool_select_attend_kernel, qk_scale=scale * LOG2E, k=k_sel, block_size=block_size,
                               seq_len=s, per_split=per_split, tokens=t, pool=pool,
                               page_size=block_size if paged else None)
    tiled = scores.reshape(b, kvh, -1, tile_rows, n1)
    # bf16 per-split outputs for bf16 queries, as flash-decoding's: the merged output is rounded to bf16
    # anyway, and the merge reads half the bytes.
    split_dtype = jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32
    kv_specs, out_specs, out_shape = split_grid_io(b, kvh, t, splits, rows, s, d, layer, o_dtype=split_dtype,
                                                   paged=paged)
    pages = [page_table_spec(page_table, lambda i, j, n, sp: i)] if paged else []
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, kvh, t, splits),
        in_specs=[
            *pages,
            pl.BlockSpec((b,), lambda i, j, n, sp: (0,)),
            pl.BlockSpec((b * t,), lambda i, j, n, sp: (0,)),
            pl.BlockSpec((None, None, None, None, n1), lambda i, j, n, sp: (i, j, n // tokens, n % tokens, 0)),
            pl.BlockSpec((None, None, rows, d), lambda i, j, n, sp: (i, n, j, 0)),
            *kv_specs,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        name="minicpm_infllm_pool_select_attention",
        **launch_options(cfg, interpret),
    )(*([page_table.astype(jnp.int32)] if paged else []), kv_lengths.astype(jnp.int32),
      q_positions.astype(jnp.int32).reshape(-1), tiled, group_tiles(q, kvh, rows), k, v)
    out = merge_splits_rows(o, lse, out_dtype=q.dtype, interpret=interpret)  # [B, KVH, T, rows, D]
    return out[:, :, :, :group].transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
