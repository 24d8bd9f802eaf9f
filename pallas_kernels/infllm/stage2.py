"""InfLLM-v2 stage 2: attention over the selected blocks, jnp references and Pallas kernels.

* :func:`block_sparse_attention_reference` / :func:`block_sparse_attention` — causal attention of each
  query over the keys of its selected ``block_size``-token blocks, the selection shared by the query heads
  of a KV group.
* :func:`local_window_attention_reference` / :func:`local_window_attention` — causal attention over each
  query's forced local window (its block and the ``local_blocks`` before it), tiled over tokens like dense
  flash attention; with :func:`~pallas_kernels.flash.merge_attention` and the block-sparse kernel over the
  blocks below the window it gives a prefill chunk's stage 2.

Shapes: q ``[B, T, H, D]``; k, v ``[B, KVH, S, D]`` or the stacked cache ``[L, B, KVH, S, D]`` with
``layer`` naming the slice (kernels read it in place). Softmax in fp32.
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
    attend_values,
    block_loop,
    cache_spec,
    empty_carry,
    group_tiles,
    key_block,
    layer_view,
    merge_splits,
    pad_query_blocks,
    page_row,
    page_table_spec,
    paged_length,
    paged_refs,
    prefill_tiles,
    store_split,
)
from pallas_kernels.infllm.common import SPARSE_CONFIG, sparse_splits, split_grid_io
from pallas_kernels.launch import KernelConfig, launch_options, next_power_of_2, tuned_config


def block_sparse_attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array,
    block_indices: jax.Array, *, scale: float, block_size: int, layer: int | None = None, return_lse: bool = False,
    whole_blocks: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Block-sparse causal attention in plain jnp (a dense masked softmax).

    block_indices: ``int32[B, KVH, T, K]``, the blocks query ``t`` of group ``g`` attends (``-1`` = none).
    Key ``s`` is visible iff its block is selected, ``s <= q_positions[b, t]`` and ``s < kv_lengths[b]``;
    a query that sees nothing gets zeros. Returns ``[B, T, H, D]`` in q.dtype, and with ``return_lse``
    also the log-sum-exp of each query head's visible scores, fp32 ``[B, T, H]`` (-inf: none), for
    merging with attention over other keys. ``whole_blocks``: the caller's promise that every listed block
    lies wholly at or before each query's position and below ``kv_lengths`` (e.g. the blocks below the
    local window); the kernel then masks nothing (here it changes nothing).
    """
    del whole_blocks
    if layer is not None:
        k, v = k[layer], v[layer]
    b, t, h, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    key_pos = jnp.arange(s, dtype=jnp.int32)
    n_blocks = pl.cdiv(s, block_size)
    chosen = jnp.zeros((b, kvh, t, n_blocks + 1), bool)
    idx = jnp.where(block_indices < 0, n_blocks, block_indices)
    bi, gi, ti, _ = jnp.meshgrid(jnp.arange(b), jnp.arange(kvh), jnp.arange(t), jnp.arange(idx.shape[-1]), indexing="ij")
    chosen = chosen.at[bi, gi, ti, idx].set(True)[..., :n_blocks]
    in_block = jnp.take(chosen, key_pos // block_size, axis=-1)  # [B, KVH, T, S]
    causal = (key_pos[None, None, :] <= q_positions[:, :, None]) & (key_pos[None, None, :] < kv_lengths[:, None, None])
    visible = in_block & causal[:, None]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, :, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, :, None], probs, 0.0)
    out = attend_values(probs, v)
    out = out.reshape(b, t, h, d).astype(q.dtype)
    if not return_lse:
        return out
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B, KVH, G, T]; -inf where nothing is visible
    return out, lse.transpose(0, 3, 1, 2).reshape(b, t, h)


def _sparse_kernel(*refs, qk_scale, block_size, seq_len, per_split, whole_blocks, page_size=None):
    pages_ref, (len_ref, q_ref, pos_ref, idx_ref, k_ref, v_ref, o_ref, lse_ref) = paged_refs(refs, 1, page_size)
    kv_len = len_ref[pl.program_id(0)]
    q = q_ref[...]
    pos = pos_ref[...]
    idx = idx_ref[...]
    count = jnp.sum(jnp.where(idx >= 0, 1, 0))
    first = pl.program_id(3) * per_split
    last = jnp.minimum(first + per_split, count)
    rows = q.shape[0]

    def step(i, carry):
        block_start = idx_ref[i] * block_size
        if pages_ref is None:  # the slice is clamped into the buffer (keys before the block are masked by `lo`)
            start, row = jnp.minimum(block_start, seq_len - block_size), None
        else:  # a block is one page
            start, row = block_start, page_row(pages_ref, block_start, page_size)
        if whole_blocks:  # every key of the block is visible to every row: no masks (the clamp only keeps a
            # broken promise inside the buffer)
            return attend_block(q, k_ref, v_ref, start, carry, qk_scale=qk_scale, block_k=block_size, row=row)
        limit = jnp.minimum(kv_len, block_start + block_size)
        return attend_block(q, k_ref, v_ref, start, carry, qk_scale=qk_scale, block_k=block_size, pos=pos,
                             kv_len=limit, lo=block_start, row=row)

    store_split(o_ref, lse_ref, lax.fori_loop(first, last, step, empty_carry(rows, q.shape[1])))


def block_sparse_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array,
    block_indices: jax.Array, *, scale: float, block_size: int, layer: int | None = None, return_lse: bool = False,
    whole_blocks: bool = False, num_splits: int | None = None, config: KernelConfig | None = None,
    interpret: bool | None = None, page_table: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Block-sparse causal attention (Pallas). Signature of :func:`block_sparse_attention_reference`;
    ``block_indices`` must list each row's valid blocks first (the ``-1`` entries last). With ``page_table
    int32[B, P]``, k / v are a paged pool ``[L, KVH, N, D]`` whose pages are blocks (``block_size`` tokens;
    the reference is :func:`pallas_kernels.infllm.paged.paged_block_sparse_attention_reference`).

    Grid (batch, KV group, token, split of the selected blocks): the tile is the group's query heads for
    one token (they share the selection), each step one ``block_size``-key block; splits are merged by
    log-sum-exp as in flash-decoding.
    """
    paged = page_table is not None
    if not paged:
        (k, _), (v, layer) = layer_view(k, layer), layer_view(v, layer)
    b, t, h, d = q.shape
    kvh, s = k.shape[-3], k.shape[-2]
    if s < block_size:
        raise ValueError(f"block_sparse_attention needs a cache of at least one block ({block_size}), got {s}")
    group = h // kvh
    rows = max(MIN_ROWS, next_power_of_2(group))
    n_sel = block_indices.shape[-1]
    k_pad = next_power_of_2(n_sel)
    idx = jnp.pad(block_indices.astype(jnp.int32), ((0, 0), (0, 0), (0, 0), (0, k_pad - n_sel)), constant_values=-1)
    row_pos = jnp.broadcast_to(q_positions.astype(jnp.int32)[:, :, None], (b, t, rows))
    splits = num_splits or sparse_splits(b, kvh, t, n_sel)
    per_split = pl.cdiv(k_pad, splits)
    cfg = config or SPARSE_CONFIG
    kernel = functools.partial(_sparse_kernel, qk_scale=scale * LOG2E, block_size=block_size, seq_len=s,
                               per_split=per_split, whole_blocks=whole_blocks, page_size=block_size if paged else None)
    kv_specs, out_specs, out_shape = split_grid_io(b, kvh, t, splits, rows, s, d, layer, paged=paged)
    pages = [page_table_spec(page_table, lambda i, j, n, sp: i)] if paged else []
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, kvh, t, splits),
        in_specs=[
            *pages,
            pl.BlockSpec((b,), lambda i, j, n, sp: (0,)),
            pl.BlockSpec((None, None, rows, d), lambda i, j, n, sp: (i, n, j, 0)),
            pl.BlockSpec((None, None, rows), lambda i, j, n, sp: (i, n, 0)),
            pl.BlockSpec((None, None, None, k_pad), lambda i, j, n, sp: (i, j, n, 0)),
            *kv_specs,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        name="minicpm_infllm_sparse_attention",
        **launch_options(cfg, interpret),
    )(*([page_table.astype(jnp.int32)] if paged else []), kv_lengths.astype(jnp.int32), group_tiles(q, kvh, rows),
      row_pos, idx, k, v)
    out = o[:, :, :, 0] if splits == 1 else merge_splits(o, lse)  # [B, KVH, T, rows, D]
    out = out[:, :, :, :group].transpose(0, 2, 1, 3, 4).reshape(b, t, h, d).astype(q.dtype)
    if not return_lse:
        return out
    top = jnp.max(lse, axis=3)  # [B, KVH, T, rows], log2 units
    safe = jnp.where(jnp.isneginf(top), 0.0, top)
    total = jnp.log2(jnp.sum(jnp.exp2(lse - safe[:, :, :, None]), axis=3)) + safe  # -inf when every split is empty
    total = total[..., :group].transpose(0, 2, 1, 3).reshape(b, t, h) / LOG2E
    return out, total


def local_window_attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *, scale: float,
    block_size: int, local_blocks: int, layer: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of each query over its forced local window (plain jnp, dense masked softmax).

    Key ``s`` is visible to a query at position ``p`` iff ``block_size·max(0, p // block_size − local_blocks)
    <= s <= p`` and ``s < kv_lengths[b]``: the ``local_blocks`` blocks before the query's own block and that
    block, the blocks InfLLM-v2 always selects. Returns (``[B, T, H, D]`` in q.dtype, fp32 log-sum-exp
    ``[B, T, H]``, -inf for a query that sees nothing) — the other half of a prefill chunk's sparse attention
    is :func:`block_sparse_attention` over the selected blocks below the window, merged by log-sum-exp."""
    if layer is not None:
        k, v = k[layer], v[layer]
    b, t, h, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    key_pos = jnp.arange(s, dtype=jnp.int32)
    lo = block_size * jnp.maximum(q_positions // block_size - local_blocks, 0)
    visible = ((key_pos >= lo[..., None]) & (key_pos <= q_positions[..., None])
               & (key_pos < kv_lengths[:, None, None]))  # [B, T, S]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jnp.where(visible[:, None, None], jax.nn.softmax(scores, axis=-1), 0.0)
    out = attend_values(probs, v)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B, KVH, G, T]
    return out.reshape(b, t, h, d).astype(q.dtype), lse.transpose(0, 3, 1, 2).reshape(b, t, h)


def _window_kernel(*refs, qk_scale, block_k, block_size, local_blocks, page_size=None):
    """One query block of one head: keys from the lowest row's window start to the highest row's position,
    masked only over the blocks where some row's window starts or the causal diagonal runs."""
    pages_ref, (len_ref, q_ref, pos_ref, k_ref, v_ref, o_ref, lse_ref) = paged_refs(refs, 1, page_size)
    kv_len = paged_length(len_ref[pl.program_id(0)], pages_ref, page_size)
    q = q_ref[...]
    pos = pos_ref[...]
    lo = block_size * jnp.maximum(pos // block_size - local_blocks, 0)  # [M] each row's first key
    n_all = pl.cdiv(jnp.clip(jnp.max(pos) + 1, 0, kv_len), block_k)
    n_lo = jnp.minimum(pl.cdiv(jnp.max(lo), block_k), n_all)  # blocks [min lo, max lo) need the lower mask
    n_full = jnp.clip(jnp.clip(jnp.min(pos) + 1, 0, kv_len) // block_k, n_lo, n_all)  # [n_lo, n_full): all see
    carry = empty_carry(q.shape[0], q.shape[1])
    step = functools.partial(attend_block, q, k_ref, v_ref, qk_scale=qk_scale, block_k=block_k)

    def masked(j, row, c):
        key = j * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        return step(j * block_k, c, pos=pos, kv_len=kv_len, mask=key >= lo[:, None], row=row)

    loop = functools.partial(block_loop, block_k=block_k, pages_ref=pages_ref, page_size=page_size)
    carry = loop(jnp.min(lo) // block_k, n_lo, masked, carry)
    carry = loop(n_lo, n_full, lambda j, row, c: step(j * block_k, c, row=row), carry)
    store_split(o_ref, lse_ref, loop(n_full, n_all, masked, carry))


def local_window_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *, scale: float,
    block_size: int, local_blocks: int, layer: int | None = None, config: KernelConfig | None = None,
    interpret: bool | None = None, page_table: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pallas version of :func:`local_window_attention_reference` (same signature): flash attention with
    the grid of the dense prefill kernel (batch, query head, query block), so a K/V block is read once per
    head and query block rather than once per token as in :func:`block_sparse_attention`. The keys a block
    streams are its rows' windows, ``(local_blocks + 1)·block_size`` of them for block-aligned rows. With
    ``page_table int32[B, P]``, k / v are a paged pool ``[L, KVH, N, D]`` of ``block_size``-token pages."""
    b, t, h, d = q.shape
    paged = page_table is not None
    if paged:
        cfg = config or tuned_config("prefill", d)
        q, q_positions, block_q = pad_query_blocks(q, q_positions, cfg.block_q)
        block_k = min(cfg.block_k, block_size)
    else:
        k, v, layer, cfg, q, q_positions, block_q = prefill_tiles(q, k, v, q_positions, kv_lengths, layer=layer,
                                                                  config=config)
        block_k = key_block(cfg.block_k, k.shape[3])
    kvh = k.shape[-3]
    group = h // kvh
    t_pad = q.shape[1]
    n_q = t_pad // block_q
    kernel = functools.partial(_window_kernel, qk_scale=scale * LOG2E, block_k=block_k, block_size=block_size,
                               local_blocks=local_blocks, page_size=block_size if paged else None)
    kv_spec = cache_spec(k.shape, layer, lambda i, j, n: (i, j // group), paged)
    pages = [page_table_spec(page_table, lambda i, j, n: i)] if paged else []
    out, lse = pl.pallas_call(
        kernel,
        grid=(b, h, n_q),
        in_specs=[
            *pages,
            pl.BlockSpec((b,), lambda i, j, n: (0,)),
            pl.BlockSpec((None, block_q, None, d), lambda i, j, n: (i, n, j, 0)),
            pl.BlockSpec((None, block_q), lambda i, j, n: (i, n)),
            kv_spec, kv_spec,
        ],
        out_specs=[pl.BlockSpec((None, block_q, None, d), lambda i, j, n: (i, n, j, 0)),
                   pl.BlockSpec((None, None, block_q), lambda i, j, n: (i, j, n))],
        out_shape=[jax.ShapeDtypeStruct((b, t_pad, h, d), q.dtype), jax.ShapeDtypeStruct((b, h, t_pad), jnp.float32)],
        name="minicpm_infllm_window_attention",
        **launch_options(cfg, interpret),
    )(*([page_table.astype(jnp.int32)] if paged else []), kv_lengths.astype(jnp.int32), q,
      q_positions.astype(jnp.int32), k, v)
    return out[:, :t], lse[:, :, :t].transpose(0, 2, 1) / LOG2E
