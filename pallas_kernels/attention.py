"""Causal GQA attention of a chunk of queries against a static KV cache: a jnp reference and two Pallas
kernels with its signature.

* :func:`attention_reference` — dense masked softmax in plain jnp (the oracle; the model's ``xla`` path).
* :func:`prefill_attention` — flash attention for a chunk of queries at an offset into the cache
  (chunked prefill). Grid (batch, q head, query block); each program streams the keys its rows can see,
  unmasked up to the block's first position and masked only over the causal diagonal and the valid end.
* :func:`decode_attention` — flash-decoding for 1..16 query tokens per sequence. All query heads of a KV
  group (times the query tokens) form the rows of one tile, so each K/V block is read once per group; the
  valid length is split across programs and the partial results are merged by log-sum-exp. Only keys
  below the valid length are read: the cost follows the actual context, not the buffer size.
* :func:`paged_prefill_attention` / :func:`paged_decode_attention` — the same two kernels reading a paged
  KV pool through a page table (signature below; the references are in :mod:`pallas_kernels.paged`).
* :func:`merge_splits` / :func:`merge_splits_rows` — the log-sum-exp merge of per-split results, in jnp
  and as one Pallas launch (:func:`merge_any_splits` picks the launch for power-of-2 split counts).

Shared signature::

    f(q, k, v, q_positions, kv_lengths, *, scale, layer=None) -> out

q ``[B, T, H, D]``; k, v ``[B, KVH, S, D]``, or the stacked cache ``[L, B, KVH, S, D]`` with ``layer``
naming the slice to read (kernels then read it in place; slicing outside would copy the layer).
Query head ``h`` reads KV head ``h // (H / KVH)``. Key ``s`` is visible to query ``t`` of row ``b`` iff
``s <= q_positions[b, t]`` and ``s < kv_lengths[b]``; a query that sees no key gets zeros. Output in
q.dtype; scores, softmax and accumulation in fp32.

Paged signature (same semantics over each row's logical keys)::

    f(q, k_pages, v_pages, page_table, q_positions, kv_lengths, *, scale, page_size, layer) -> out

k_pages, v_pages ``[L, KVH, N, D]`` (N = num_pages * page_size); page_table ``int32[B, P]``: key ``s`` of row
``b`` is at slot ``page_table[b, s // page_size] * page_size + s % page_size``; at most ``P * page_size``
keys per row. page_size a power of 2 >= 16; key blocks are at most a page.

The kernels read only keys some query of the tile sees (loads masked below ``min(max position + 1,
length)``), so garbage, NaN included, in any other slot never reaches the output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.flash import (
    LOG2E,
    attend_block,
    attend_values,
    block_loop,
    cache_spec,
    check_pool,
    check_shapes,
    empty_carry,
    group_rows,
    key_block,
    layer_view,
    merge_any_splits,
    pad_query_blocks,
    page_table_spec,
    paged_length,
    paged_refs,
    prefill_tiles,
    split_outputs,
    store_split,
    ungroup_rows,
)
from pallas_kernels.launch import KernelConfig, launch_options, next_power_of_2, num_cores, tuned_config

# The decode kernel takes up to this many query tokens per sequence (tree verification sizes above it
# belong to the prefill kernel).
MAX_DECODE_QUERIES = 16


def attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *,
    scale: float, layer: int | None = None,
) -> jax.Array:
    """Dense masked attention in plain jnp (reads all S cache slots). Signature: see the module doc."""
    if layer is not None:
        k, v = k[layer], v[layer]
    b, t, h, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    key_pos = jnp.arange(s, dtype=jnp.int32)
    visible = (key_pos[None, None, :] <= q_positions[:, :, None]) & (key_pos[None, None, :] < kv_lengths[:, None, None])
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, None, None], probs, 0.0)  # rows with nothing visible give 0, not NaN
    out = attend_values(probs, v)
    return out.reshape(b, t, h, d).astype(q.dtype)


def _prefill_kernel(*refs, qk_scale, block_k, page_size=None):
    pages_ref, (len_ref, q_ref, pos_ref, k_ref, v_ref, o_ref) = paged_refs(refs, 1, page_size)
    kv_len = paged_length(len_ref[pl.program_id(0)], pages_ref, page_size)
    q = q_ref[...]
    pos = pos_ref[...]
    # Keys [0, lo) are visible to every row of the block; keys [lo, hi) to some rows, and no key at or past
    # hi to any: the masked blocks load below hi only.
    lo = jnp.clip(jnp.min(pos) + 1, 0, kv_len)
    hi = jnp.clip(jnp.max(pos) + 1, 0, kv_len)
    n_full = lo // block_k
    n_all = pl.cdiv(hi, block_k)
    carry = empty_carry(q.shape[0], q.shape[1])

    def step(j, row, c, **mask):
        return attend_block(q, k_ref, v_ref, j * block_k, c, qk_scale=qk_scale, block_k=block_k, row=row, **mask)

    loop = functools.partial(block_loop, block_k=block_k, pages_ref=pages_ref, page_size=page_size)
    carry = loop(0, n_full, step, carry)
    carry = loop(n_full, n_all, functools.partial(step, pos=pos, kv_len=hi), carry)
    acc, _, l = carry
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


def _prefill_call(q, k, v, page_table, q_positions, kv_lengths, *, scale, layer, page_size, cfg, block_q, t,
                  interpret):
    """The prefill launch on q / positions already padded to whole query blocks of ``block_q`` (``t`` real
    tokens), for the stacked cache (``page_table`` None) or the paged pool."""
    b, t_pad, h, d = q.shape
    paged = page_table is not None
    kvh, s = k.shape[-3], k.shape[-2]
    group = h // kvh
    n_q = t_pad // block_q
    block_k = min(cfg.block_k, page_size) if paged else key_block(cfg.block_k, s)
    kernel = functools.partial(_prefill_kernel, qk_scale=scale * LOG2E, block_k=block_k, page_size=page_size)
    kv_spec = cache_spec(k.shape, layer, lambda i, j, n: (i, j // group), paged)
    # Query blocks run last-first: the longest causal rows start first and the tail balances the grid.
    in_specs = [
        pl.BlockSpec((b,), lambda i, j, n: (0,)),
        pl.BlockSpec((None, block_q, None, d), lambda i, j, n: (i, n_q - 1 - n, j, 0)),
        pl.BlockSpec((None, block_q), lambda i, j, n: (i, n_q - 1 - n)),
        kv_spec,
        kv_spec,
    ]
    args = (kv_lengths.astype(jnp.int32), q, q_positions.astype(jnp.int32), k, v)
    if paged:
        in_specs, args = [page_table_spec(page_table, lambda i, j, n: i), *in_specs], (page_table.astype(jnp.int32), *args)
    out = pl.pallas_call(
        kernel,
        grid=(b, h, n_q),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_q, None, d), lambda i, j, n: (i, n_q - 1 - n, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, t_pad, h, d), q.dtype),
        name="minicpm_paged_prefill_attention" if paged else "minicpm_prefill_attention",
        **launch_options(cfg, interpret),
    )(*args)
    return out[:, :t] if t_pad != t else out


def prefill_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *,
    scale: float, layer: int | None = None, config: KernelConfig | None = None, interpret: bool | None = None,
) -> jax.Array:
    """Causal flash attention of a query chunk against the cache (Pallas). Signature: see the module doc.

    ``config`` overrides the measured launch table; ``interpret`` forces interpret mode (default: on
    unless running on a GPU).
    """
    t = q.shape[1]
    k, v, layer, cfg, q, q_positions, block_q = prefill_tiles(q, k, v, q_positions, kv_lengths, layer=layer,
                                                              config=config)
    return _prefill_call(q, k, v, None, q_positions, kv_lengths, scale=scale, layer=layer, page_size=None, cfg=cfg,
                         block_q=block_q, t=t, interpret=interpret)


def paged_prefill_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, q_positions: jax.Array,
    kv_lengths: jax.Array, *, scale: float, page_size: int, layer: int, config: KernelConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """:func:`prefill_attention` over the paged pool (the paged signature of the module doc): a chunk of
    queries against its rows' paged history, which already holds the chunk's own keys."""
    check_pool(q, k_pages, v_pages, page_table, page_size, q_positions, kv_lengths)
    t = q.shape[1]
    cfg = config or tuned_config("prefill", q.shape[3])
    q, q_positions, block_q = pad_query_blocks(q, q_positions, cfg.block_q)
    return _prefill_call(q, k_pages, v_pages, page_table, q_positions, kv_lengths, scale=scale, layer=layer,
                         page_size=page_size, cfg=cfg, block_q=block_q, t=t, interpret=interpret)


def _decode_kernel(*refs, qk_scale, block_k, num_splits, page_size=None):
    pages_ref, (len_ref, q_ref, pos_ref, k_ref, v_ref, o_ref, lse_ref) = paged_refs(refs, 1, page_size)
    kv_len = paged_length(len_ref[pl.program_id(0)], pages_ref, page_size)
    split = pl.program_id(2)
    q = q_ref[...]
    pos = pos_ref[...]
    # No row sees a key at or past hi, so the blocks load below hi only (same visibility as kv_len).
    hi = jnp.clip(jnp.max(pos) + 1, 0, kv_len)
    n_blocks = pl.cdiv(hi, block_k)
    per_split = pl.cdiv(n_blocks, num_splits)
    first = split * per_split
    last = jnp.minimum(first + per_split, n_blocks)
    carry = empty_carry(q.shape[0], q.shape[1])

    def step(j, row, c):
        return attend_block(q, k_ref, v_ref, j * block_k, c, qk_scale=qk_scale, block_k=block_k, pos=pos, kv_len=hi,
                            row=row)

    store_split(o_ref, lse_ref, block_loop(first, last, step, carry, block_k=block_k, pages_ref=pages_ref,
                                           page_size=page_size))


def decode_splits(batch: int, kv_heads: int, row_blocks: int, max_length: int, block_k: int) -> int:
    """How many programs share one sequence's keys, a power of 2: a program per key block of the buffer
    (``max_length``: a row's capacity, ``P * page_size`` for a paged pool), rounded up, where that is at most about
    two programs per SM; else the power of 2 nearest to two programs per SM.

    Rounding up leaves a few programs without a key (they exit at once): at a 1K context in a 1,096-slot cache
    (H200, MiniCPM4-8B's heads, kernel + merge, 4 warps) 64 splits of one 32-key block took 4.96 µs a layer against
    5.32 for 32 splits of two blocks and 5.62 for 16 splits of 64 keys, what the rule gave before
    (docs/lab_notes/2026-12-01-fifty-sixth-session.md)."""
    by_length = pl.cdiv(max_length, block_k)
    by_occupancy = pl.cdiv(2 * num_cores(), batch * kv_heads * row_blocks)
    if by_length <= by_occupancy:
        return next_power_of_2(by_length)
    # The power of 2 nearest to by_occupancy, so the splits merge in one Pallas launch (merge_splits_rows)
    # instead of XLA's passes: 128 rather than 132 programs per KV head on an H100.
    p = next_power_of_2(by_occupancy)
    return p // 2 if p - by_occupancy > by_occupancy - p // 2 else p


def decode_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *,
    scale: float, layer: int | None = None, config: KernelConfig | None = None, num_splits: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Flash-decoding for up to 16 query tokens per sequence (Pallas). Signature: see the module doc.

    ``num_splits`` overrides how many programs split each sequence's keys (default :func:`decode_splits`).
    """
    o, lse = decode_attention_splits(q, k, v, q_positions, kv_lengths, scale=scale, layer=layer, config=config,
                                     num_splits=num_splits, interpret=interpret)
    merged = merge_any_splits(o, lse, out_dtype=q.dtype, interpret=interpret)
    return ungroup_rows(merged, q.shape[1], q.shape[2]).astype(q.dtype)


def paged_decode_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, q_positions: jax.Array,
    kv_lengths: jax.Array, *, scale: float, page_size: int, layer: int, config: KernelConfig | None = None,
    num_splits: int | None = None, interpret: bool | None = None,
) -> jax.Array:
    """:func:`decode_attention` over the paged pool (the paged signature of the module doc); the splits share
    each row's ``P * page_size`` capacity."""
    check_pool(q, k_pages, v_pages, page_table, page_size, q_positions, kv_lengths)
    o, lse = _decode_call(q, k_pages, v_pages, page_table, q_positions, kv_lengths, scale=scale, layer=layer,
                          page_size=page_size, config=config, num_splits=num_splits, interpret=interpret)
    merged = merge_any_splits(o, lse, out_dtype=q.dtype, interpret=interpret)
    return ungroup_rows(merged, q.shape[1], q.shape[2]).astype(q.dtype)


def decode_attention_splits(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *,
    scale: float, layer: int | None = None, config: KernelConfig | None = None, num_splits: int | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The decode kernel alone: per-split results before :func:`merge_splits`.

    Returns o ``[B, KVH, NS, R, D]`` (normalised within its split; bf16 for bf16 inputs — the merged
    output is rounded to bf16 anyway, and the merge reads half the bytes — else fp32) and lse fp32
    ``[B, KVH, NS, R]``
    (log2-sum-exp of the split's scores; -inf for a split with no visible key), where row ``r`` of a KV
    group is query token ``r // G``, head ``r % G`` (G = H / KVH), padded to a power of 2 ≥ 16.
    """
    (k, _), (v, layer) = layer_view(k, layer), layer_view(v, layer)
    check_shapes(q, k, v, q_positions, kv_lengths)
    return _decode_call(q, k, v, None, q_positions, kv_lengths, scale=scale, layer=layer, page_size=None,
                        config=config, num_splits=num_splits, interpret=interpret)


def _decode_call(q, k, v, page_table, q_positions, kv_lengths, *, scale, layer, page_size, config, num_splits,
                 interpret):
    """The decode launch for the stacked cache (``page_table`` None) or the paged pool: (o, lse) per split."""
    b, t, h, d = q.shape
    if t > MAX_DECODE_QUERIES:
        raise ValueError(f"decode_attention takes at most {MAX_DECODE_QUERIES} query tokens, got {t}")
    paged = page_table is not None
    kvh = k.shape[-3]
    capacity = page_table.shape[1] * page_size if paged else k.shape[-2]
    cfg = config or tuned_config("decode", d)
    qr, _ = group_rows(q, kvh)
    row_pos, _ = group_rows(jnp.broadcast_to(q_positions.astype(jnp.int32)[:, :, None], (b, t, h)), kvh)
    rows_pad = qr.shape[2]
    block_m = min(cfg.block_q, rows_pad)
    n_m = rows_pad // block_m
    block_k = min(cfg.block_k, page_size) if paged else key_block(cfg.block_k, capacity)
    n_split = num_splits or decode_splits(b, kvh, n_m, capacity, block_k)
    kernel = functools.partial(_decode_kernel, qk_scale=scale * LOG2E, block_k=block_k, num_splits=n_split,
                               page_size=page_size)
    out_specs, out_shape = split_outputs(b, kvh, n_split, rows_pad, block_m, d, q.dtype)
    kv_spec = cache_spec(k.shape, layer, lambda i, j, sp, m: (i, j), paged)
    in_specs = [
        pl.BlockSpec((b,), lambda i, j, sp, m: (0,)),
        pl.BlockSpec((None, None, block_m, d), lambda i, j, sp, m: (i, j, m, 0)),
        pl.BlockSpec((None, None, block_m), lambda i, j, sp, m: (i, j, m)),
        kv_spec,
        kv_spec,
    ]
    args = (kv_lengths.astype(jnp.int32), qr, row_pos, k, v)
    if paged:
        in_specs = [page_table_spec(page_table, lambda i, j, sp, m: i), *in_specs]
        args = (page_table.astype(jnp.int32), *args)
    return pl.pallas_call(
        kernel,
        grid=(b, kvh, n_split, n_m),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        name="minicpm_paged_decode_attention" if paged else "minicpm_decode_attention",
        **launch_options(cfg, interpret),
    )(*args)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *,
    scale: float, layer: int | None = None,
) -> jax.Array:
    """The Pallas kernels behind one signature: flash-decoding for up to ``MAX_DECODE_QUERIES`` query
    tokens per sequence (decode, tree verification), flash attention for longer chunks (prefill)."""
    kernel = decode_attention if q.shape[1] <= MAX_DECODE_QUERIES else prefill_attention
    return kernel(q, k, v, q_positions, kv_lengths, scale=scale, layer=layer)
