"""InfLLM-v2 kernels: stage-1 relevance scores against compressed keys, and block-sparse attention.
Each Pallas kernel sits beside a plain-jnp reference with the same signature.

* :func:`compressed_scores_reference` / :func:`compressed_scores` — for every query token and KV group,
  ``score[j] = sum_{h in group} exp(q_h . K1[j] * scale - LSE_h)`` where ``LSE_h`` is the log-sum-exp of
  ``q_h . K2 * scale`` over the coarse keys. Compressed key ``j`` (window ``[stride*j, stride*j + kernel)``)
  is visible to a query at position ``p`` iff its whole window lies at or before ``p``; invisible entries
  score 0, and so does a row that sees no coarse key (HF turns those NaN rows into 0).
* :func:`select_top_blocks_reference` / :func:`select_top_blocks` — the ``k`` best-scoring blocks of each
  row, ascending (the kernel: a bitwise threshold search and a stable partition instead of top-k + sort).
* :func:`block_sparse_attention_reference` / :func:`block_sparse_attention` — causal attention of each
  query over the keys of its selected ``block_size``-token blocks, the selection shared by the query heads
  of a KV group.
* :func:`local_window_attention_reference` / :func:`local_window_attention` — causal attention over each
  query's forced local window (its block and the ``local_blocks`` before it), tiled over tokens like dense
  flash attention; with :func:`merge_attention` and the block-sparse kernel over the blocks below the
  window it gives a prefill chunk's stage 2 (``minicpm_jax.sparse.sparse_attention``).
* :func:`pool_select_attention_reference` / :func:`pool_select_attention` — the selection and the
  block-sparse attention from stage-1 scores in one kernel, for decode (every program of a token repeats
  the token's selection, then attends its share of the picks).

Shapes: q ``[B, T, H, D]``; k, v ``[B, KVH, S, D]`` and compressed keys ``[B, KVH, N, D]``, or the stacked
caches ``[L, B, KVH, ., D]`` with ``layer`` naming the slice (kernels read it in place). Query head ``h``
belongs to KV group ``h // (H / KVH)``. Scores and softmax in fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.attention import (
    _LOG2E,
    _MASKED,
    _attend_block,
    _check_shapes,
    _empty_carry,
    _key_block,
    _layer_view,
    _load_block,
    merge_splits,
    merge_splits_rows,
    _store_split,
    pad_query_blocks,
)
from pallas_kernels.backend import KernelConfig, launch_options, next_power_of_2, num_cores, tuned_config

# Stage 2: rows of a tile (the query heads of one KV group for one token, padded).
_MIN_ROWS = 16

# Stage 1: block_q = query tokens per tile (times the padded group = rows; the group reduction is a dot
# with a [max(16, tokens), rows] indicator), block_k = compressed keys per step. Measured on an H100, jax
# 0.11.2, a 2048-query chunk at 64K / 128K (BENCHMARKS.md, 2026-11-24 eighth session), once the masks were
# confined to the causal edge: 16 tokens x 64 keys, 4 warps, 1 stage: 0.30 / 0.56 ms; 8 tokens (the
# earlier choice, whose 16-row output tiles are half padding): 0.38 / 0.71; 8 x 128 keys 0.33 / 0.60;
# 8 warps, 2 stages, 32 keys or 32 tokens slower (an fp32 instead of bf16 group reduction: 7x slower).
SCORES_CONFIG = KernelConfig(block_q=16, block_k=64, num_warps=4, num_stages=1)
SPARSE_CONFIG = KernelConfig(block_q=_MIN_ROWS, block_k=64, num_warps=4, num_stages=2)


def compressed_visible(positions: jax.Array, n: int, *, kernel: int, stride: int) -> jax.Array:
    """``bool[..., n]``: compressed key ``j`` (window ``[stride*j, stride*j + kernel)``) is visible to a
    query at ``positions[...]`` iff ``stride*j + kernel - 1 <= position``."""
    ends = jnp.arange(n, dtype=jnp.int32) * stride + (kernel - 1)
    return ends <= positions[..., None]


def compressed_count(length: jax.Array, *, kernel: int, stride: int) -> jax.Array:
    """Complete compressed windows among the first ``length`` keys: ``max(0, (length - kernel)//stride + 1)``."""
    return jnp.where(length >= kernel, (length - kernel) // stride + 1, 0)


# ------------------------------------------------------------------------------------------------ stage 1


def compressed_scores_reference(
    q: jax.Array, k1: jax.Array, k2: jax.Array, q_positions: jax.Array, *, scale: float,
    kernel1: int, stride1: int, kernel2: int, stride2: int, layer: int | None = None,
    extra_logits: jax.Array | None = None,
) -> jax.Array:
    """Stage-1 scores in plain jnp: fp32 ``[B, KVH, T, N1]`` (N1 = k1's entry axis). See the module doc.

    extra_logits: None, or fp32 ``[B, T, H]``: the (scaled) logit of one more coarse key per query and
    head that joins the LSE (-inf: none); a speculative tree node's coarse window that closes inside its
    own ancestor path (``minicpm_jax.sparse.tree_sparse_attention``)."""
    if layer is not None:
        k1, k2 = k1[layer], k2[layer]
    b, t, h, d = q.shape
    kvh = k1.shape[1]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    s1 = jnp.einsum("btkgd,bknd->bkgtn", qg, k1, preferred_element_type=jnp.float32) * scale
    s2 = jnp.einsum("btkgd,bknd->bkgtn", qg, k2, preferred_element_type=jnp.float32) * scale
    vis1 = compressed_visible(q_positions, k1.shape[2], kernel=kernel1, stride=stride1)[:, None, None]
    vis2 = compressed_visible(q_positions, k2.shape[2], kernel=kernel2, stride=stride2)[:, None, None]
    s2 = jnp.where(vis2, s2, -jnp.inf)
    if extra_logits is not None:  # [B, T, H] -> [B, KVH, G, T, 1], one more key
        extra = extra_logits.astype(jnp.float32).reshape(b, t, kvh, h // kvh).transpose(0, 2, 3, 1)[..., None]
        s2 = jnp.concatenate([s2, extra], axis=-1)
    top = jnp.max(s2, axis=-1, keepdims=True)
    seen = jnp.isfinite(top)
    top = jnp.where(seen, top, 0.0)
    lse = top + jnp.log(jnp.sum(jnp.exp(s2 - top), axis=-1, keepdims=True))
    p = jnp.where(vis1 & seen, jnp.exp(s1 - jnp.where(seen, lse, 0.0)), 0.0)
    return jnp.sum(p, axis=2)


def _row_positions(pos_ref, rows: int, tokens: int, group_pad: int) -> jax.Array:
    """int32 ``[rows]``: the position of each row of a stage-1 tile (row ``r`` = the tile's token ``r //
    group_pad``), gathered from the batch row's padded positions ``pos_ref [T_pad]``."""
    return plt.load(pos_ref.at[pl.program_id(2) * tokens + lax.broadcasted_iota(jnp.int32, (rows,), 0) // group_pad])


def _lse_kernel(q_ref, pos_ref, k2_ref, m_ref, l_ref, *, qk_scale, kernel2, stride2, block_n, n2, blocks_per_split,
                tokens, group_pad):
    """Pass 1, one split of the coarse keys: running max and sum (log2 units) of each row's scores."""
    q = q_ref[...]
    rows = q.shape[0]
    pos = _row_positions(pos_ref, rows, tokens, group_pad)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def step(j, carry, masked: bool):
        m, l = carry
        start = jnp.minimum(j * block_n, n2 - block_n)  # clamped so the slice stays in the buffer
        k = k2_ref[pl.ds(start, block_n), :]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * qk_scale
        if masked:
            key = start + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
            visible = (key[None, :] * stride2 + (kernel2 - 1) <= pos[:, None]) & (key[None, :] >= j * block_n)
            s = jnp.where(visible, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp2(s - m_new[:, None])
        if masked:
            p = jnp.where(visible, p, 0.0)
        return m_new, l * jnp.exp2(m - m_new) + jnp.sum(p, axis=1)

    n_vis = jnp.maximum((jnp.max(pos) + 1 - kernel2) // stride2 + 1, 0)
    first = pl.program_id(3) * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, pl.cdiv(n_vis, block_n))
    # Blocks below `mid` are visible to every row (whole and unclamped): no per-element mask there.
    n_full = jnp.maximum((jnp.min(pos) + 1 - kernel2) // stride2 + 1, 0) // block_n
    mid = jnp.clip(n_full, first, last)
    carry = (jnp.full((rows,), _MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32))
    carry = lax.fori_loop(first, mid, functools.partial(step, masked=False), carry)
    m, l = lax.fori_loop(mid, last, functools.partial(step, masked=True), carry)
    m_ref[...] = m
    l_ref[...] = l


def _score_kernel(q_ref, pos_ref, m_ref, l_ref, k1_ref, o_ref, *, qk_scale, group, group_pad, kernel1, stride1,
                  block_n, n1, blocks_per_split, tokens):
    """Pass 2, one split of the fine keys: the LSE merged from pass 1's per-split max/sum (``[S, rows]``),
    then exp2(s - LSE) summed over each token's heads."""
    q = q_ref[...]
    rows = q.shape[0]
    pos = _row_positions(pos_ref, rows, tokens, group_pad)
    m_part, l_part = m_ref[...], l_ref[...]
    top = jnp.max(m_part, axis=0)
    total = jnp.sum(l_part * jnp.exp2(m_part - top[None, :]), axis=0)
    seen = total > 0.0
    lse = jnp.where(seen, top + jnp.log2(jnp.where(seen, total, 1.0)), _MASKED)
    out_rows = o_ref.shape[0]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    # The group reduction is a dot with the [out_rows, rows] indicator of "row r is a real head of token
    # t" (row r = token r // group_pad, head r % group_pad; out rows past the tile's tokens stay 0).
    r_idx = lax.broadcasted_iota(jnp.int32, (out_rows, rows), 1)
    t_idx = lax.broadcasted_iota(jnp.int32, (out_rows, rows), 0)
    owner = ((r_idx // group_pad) == t_idx) & ((r_idx % group_pad) < group)
    # bf16 inputs: the probabilities are summed on the tensor cores from bf16 (InfLLM-v2's kernels also
    # store the scores in 16 bits); fp32 inputs: an exact fp32 sum.
    reduce_dtype = jnp.float32 if q.dtype == jnp.float32 else jnp.bfloat16
    indicator = jnp.where(owner, 1.0, 0.0).astype(reduce_dtype)
    head_row = (lax.broadcasted_iota(jnp.int32, (rows, 1), 0) % group_pad) < group  # (decode tiles)

    lse_row = jnp.where(seen, lse, jnp.inf)[:, None]  # rows that see nothing get exp2(s - inf) = 0

    def step(j, carry, masked: bool):
        start = jnp.minimum(j * block_n, n1 - block_n)
        k = k1_ref[pl.ds(start, block_n), :]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * qk_scale - lse_row
        if masked:
            key = start + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
            s = jnp.where(key[None, :] * stride1 + (kernel1 - 1) <= pos[:, None], s, -jnp.inf)
        p = jnp.exp2(s).astype(reduce_dtype)
        if out_rows == 1:  # one token (decode): its heads summed across the tile's rows, one row stored
            o_ref[:, pl.ds(start, block_n)] = jnp.sum(jnp.where(head_row, p.astype(jnp.float32), 0.0), axis=0,
                                                      keepdims=True).astype(o_ref.dtype)
        else:
            o_ref[:, pl.ds(start, block_n)] = jnp.dot(indicator, p, precision=precision,
                                                      preferred_element_type=jnp.float32).astype(o_ref.dtype)
        return carry  # (the loop carries nothing; Triton's loop needs a value to yield)

    n_vis = jnp.maximum((jnp.max(pos) + 1 - kernel1) // stride1 + 1, 0)
    first = pl.program_id(3) * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, pl.cdiv(n_vis, block_n))
    # Blocks below `mid` are visible to every row of the tile (the causal rule only cuts the last ones):
    # they skip the per-element mask.
    n_full = jnp.maximum((jnp.min(pos) + 1 - kernel1) // stride1 + 1, 0) // block_n
    mid = jnp.clip(n_full, first, last)
    init = jnp.zeros((), jnp.int32) + first
    lax.fori_loop(first, mid, functools.partial(step, masked=False), init)
    lax.fori_loop(mid, last, functools.partial(step, masked=True), init)


def score_tile_rows(tokens: int) -> int:
    """Rows of each tile of :func:`compressed_scores_tiled`'s output for tiles of ``tokens`` query tokens:
    one for a one-token (decode) tile, whose heads are summed across the tile; else ``max(16, tokens)``
    (the output of the group-reduction dot)."""
    return 1 if tokens == 1 else max(_MIN_ROWS, tokens)


def scores_dtype(q_dtype) -> jnp.dtype:
    """The dtype the stage-1 kernel stores its scores in: bf16 for bf16 queries, as InfLLM-v2's kernel writes
    them (the HF code ranks bf16 scores with torch.topk; the [T, N1] score matrix is the largest tensor of
    a sparse prefill, and 16 bits halve its traffic; the selection's search then settles 16-bit keys, half
    the steps of fp32 ones: the decode path's selection + attention kernel at 128K, H100: 13.6 -> 12.2 us);
    float32 for float32 queries (exact tests)."""
    return jnp.bfloat16 if q_dtype == jnp.bfloat16 else jnp.float32


def _splits(blocks: int, programs: int) -> int:
    """Splits of ``blocks`` key blocks: two programs per SM at most, at least 2 blocks per split."""
    return max(1, min(max(1, blocks // 2), pl.cdiv(2 * num_cores(), programs)))


def compressed_scores_tiled(
    q: jax.Array, k1: jax.Array, k2: jax.Array, q_positions: jax.Array, *, scale: float,
    kernel1: int, stride1: int, kernel2: int, stride2: int, layer: int | None = None,
    extra_logits: jax.Array | None = None, num_splits: int | None = None, config: KernelConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, int]:
    """:func:`compressed_scores` as the kernel writes them: ``[B, KVH, n_tiles * R, N1]`` in
    :func:`scores_dtype` with ``R = score_tile_rows(tokens)`` (token ``t`` in row ``(t // tokens) * R + t %
    tokens``; the other rows are padding) and ``tokens``, the tokens per tile; :func:`pool_select_blocks_tiled`
    and :func:`pool_select_attention_tiled` read this without a copy."""
    (k1, _), (k2, layer) = _layer_view(k1, layer), _layer_view(k2, layer)
    b, t, h, d = q.shape
    kvh, n1, n2 = k1.shape[2], k1.shape[3], k2.shape[3]
    if min(n1, n2) < 16:
        raise ValueError(f"compressed_scores needs at least 16 compressed entries, got {n1} and {n2}")
    group = h // kvh
    cfg = config or SCORES_CONFIG
    tokens = min(cfg.block_q, next_power_of_2(t))
    group_pad = max(next_power_of_2(group), -(-_MIN_ROWS // tokens))  # rows = tokens x group_pad >= 16
    out_rows = score_tile_rows(tokens)
    block_n = min(cfg.block_k, 1 << (min(n1, n2).bit_length() - 1))
    t_pad = pl.cdiv(t, tokens) * tokens
    qg = q.reshape(b, t, kvh, group, d).transpose(0, 2, 1, 3, 4)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, t_pad - t), (0, group_pad - group), (0, 0)))
    qr = qg.reshape(b, kvh, t_pad * group_pad, d)
    pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, t_pad - t)), mode="edge")
    n_t = t_pad // tokens
    rows = tokens * group_pad
    opts = launch_options(cfg, interpret)
    q_spec = pl.BlockSpec((None, None, rows, d), lambda i, j, n, s: (i, j, n, 0))
    pos_spec = pl.BlockSpec((None, t_pad), lambda i, j, n, s: (i, 0))
    tile = dict(tokens=tokens, group_pad=group_pad)

    blocks2 = pl.cdiv(n2, block_n)
    splits2 = next_power_of_2(_splits(blocks2, b * kvh * n_t))  # a power of 2: pass 2 loads all partials
    per2 = pl.cdiv(blocks2, splits2)
    part_spec = pl.BlockSpec((None, None, None, rows), lambda i, j, n, s: (i, j, s, n))
    m, l = pl.pallas_call(
        functools.partial(_lse_kernel, qk_scale=scale * _LOG2E, kernel2=kernel2, stride2=stride2, block_n=block_n,
                          n2=n2, blocks_per_split=per2, **tile),
        grid=(b, kvh, n_t, splits2),
        in_specs=[q_spec, pos_spec, pl.BlockSpec((None, None, None, n2, d), lambda i, j, n, s: (layer, i, j, 0, 0))],
        out_specs=[part_spec, part_spec],
        out_shape=[jax.ShapeDtypeStruct((b, kvh, splits2, t_pad * group_pad), jnp.float32)] * 2,
        name="minicpm_infllm_lse", **opts,
    )(qr, pos, k2)
    if extra_logits is not None:  # one more coarse key per (token, head) joins the LSE: one more partial
        e = extra_logits.astype(jnp.float32).reshape(b, t, kvh, group).transpose(0, 2, 1, 3) * _LOG2E
        e = jnp.pad(e, ((0, 0), (0, 0), (0, t_pad - t), (0, group_pad - group)), constant_values=-jnp.inf)
        e = e.reshape(b, kvh, 1, t_pad * group_pad)
        pad = next_power_of_2(splits2 + 1) - splits2
        m = jnp.concatenate([m, jnp.where(jnp.isneginf(e), _MASKED, e),
                             jnp.full((b, kvh, pad - 1, t_pad * group_pad), _MASKED, jnp.float32)], axis=2)
        l = jnp.concatenate([l, jnp.where(jnp.isneginf(e), 0.0, 1.0),
                             jnp.zeros((b, kvh, pad - 1, t_pad * group_pad), jnp.float32)], axis=2)
    parts = m.shape[2]

    blocks1 = pl.cdiv(n1, block_n)
    splits1 = num_splits or _splits(blocks1, b * kvh * n_t)
    per1 = pl.cdiv(blocks1, splits1)
    parts_spec = pl.BlockSpec((None, None, parts, rows), lambda i, j, n, s: (i, j, 0, n))
    out = pl.pallas_call(
        functools.partial(_score_kernel, qk_scale=scale * _LOG2E, group=group, group_pad=group_pad, kernel1=kernel1,
                          stride1=stride1, block_n=block_n, n1=n1, blocks_per_split=per1, tokens=tokens),
        grid=(b, kvh, n_t, splits1),
        in_specs=[q_spec, pos_spec, parts_spec, parts_spec,
                  pl.BlockSpec((None, None, None, n1, d), lambda i, j, n, s: (layer, i, j, 0, 0))],
        out_specs=pl.BlockSpec((None, None, out_rows, n1), lambda i, j, n, s: (i, j, n, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kvh, n_t * out_rows, n1), scores_dtype(q.dtype)),
        name="minicpm_infllm_scores", **opts,
    )(qr, pos, m, l, k1)
    return out, tokens


def compressed_scores(
    q: jax.Array, k1: jax.Array, k2: jax.Array, q_positions: jax.Array, *, scale: float,
    kernel1: int, stride1: int, kernel2: int, stride2: int, layer: int | None = None,
    extra_logits: jax.Array | None = None, num_splits: int | None = None, config: KernelConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Stage-1 scores (Pallas). Signature of :func:`compressed_scores_reference`, except that entries no
    query of a tile can see are left unwritten (callers mask by :func:`compressed_visible`).

    Two kernels, each with grid (batch, KV head, token tile, split of the keys): pass 1 reduces each
    row's scores against the coarse keys to partial max/sum per split (merged here into the LSE); pass 2
    scores the fine keys; key steps that every row of a tile sees whole skip the causal mask. A tile holds
    up to ``SCORES_CONFIG.block_q`` tokens times the padded group (one token for decode). Scores come in
    :func:`scores_dtype`. ``num_splits`` fixes the pass-2 split count.
    """
    t = q.shape[1]
    raw, tokens = compressed_scores_tiled(q, k1, k2, q_positions, scale=scale, kernel1=kernel1, stride1=stride1,
                                          kernel2=kernel2, stride2=stride2, layer=layer, extra_logits=extra_logits,
                                          num_splits=num_splits, config=config, interpret=interpret)
    b, kvh, _, n1 = raw.shape
    out = raw.reshape(b, kvh, -1, score_tile_rows(tokens), n1)[:, :, :, :tokens].reshape(b, kvh, -1, n1)
    return out[:, :, :t] if out.shape[2] != t else out


# ------------------------------------------------------------------------------------------ block selection


def pool_block_scores(scores: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *, kernel1: int,
                      stride1: int, ratio: int, num_blocks: int) -> jax.Array:
    """Stage-1 scores ``fp32[B, KVH, T, N1]`` → block scores ``fp32[B, KVH, T, num_blocks]``: HF's max-pool
    (window ``ratio + 1``, stride ``ratio``, padding 1: block ``b`` takes entries ``ratio*b - 1 ..
    ratio*b + ratio - 1``). Entries a query cannot see score 0, entries that do not exist yet (past
    ``kv_lengths``' complete windows, or past N1) -inf; ``scores`` may hold anything there."""
    n1 = scores.shape[-1]
    r = ratio
    visible = compressed_visible(q_positions, n1, kernel=kernel1, stride=stride1)
    exists = jnp.arange(n1) < compressed_count(kv_lengths, kernel=kernel1, stride=stride1)[:, None]
    s = jnp.where(visible[:, None], scores.astype(jnp.float32), jnp.where(exists[:, None, None, :], 0.0, -jnp.inf))
    width = r * num_blocks + 1
    s = s[..., : width - 1] if n1 >= width - 1 else jnp.pad(s, ((0, 0),) * 3 + ((0, width - 1 - n1),),
                                                             constant_values=-jnp.inf)
    s = jnp.pad(s, ((0, 0),) * 3 + ((1, 0),), constant_values=-jnp.inf)  # index i+1 holds entry i
    inner = jnp.max(s[..., 1:].reshape(*s.shape[:-1], num_blocks, r), axis=-1)
    before = s[..., 0 : r * num_blocks : r]  # entry r*b - 1
    return jnp.maximum(inner, before)


def force_blocks(block_score: jax.Array, limit: jax.Array, force: tuple[int, int]) -> jax.Array:
    """InfLLM-v2's forced blocks: the first ``force[0]`` (init) blocks, and each row's ``limit`` (its own
    block) with the ``force[1]`` (local) blocks before it, score +inf; blocks past ``limit`` -inf."""
    init_blocks, local_blocks = force
    blk = jnp.arange(block_score.shape[-1], dtype=jnp.int32)
    lim = limit[..., None]
    forced = (blk < init_blocks) | ((blk >= lim - local_blocks) & (blk <= lim))
    return jnp.where(blk > lim, -jnp.inf, jnp.where(forced, jnp.inf, block_score))


def select_top_blocks_reference(block_score: jax.Array, limit: jax.Array, *, k: int, top_k=lax.top_k) -> jax.Array:
    """The ``k`` best blocks of every row: ``block_score fp32[..., NB]``, ``limit int32[...]`` → ``int32[..., k]``.

    Ties go to the lower block index (as ``lax.top_k``); picked blocks past ``limit`` are dropped; the rest
    come in ascending order, padded with -1 at the end. ``top_k``: a drop-in for ``lax.top_k``."""
    nb = block_score.shape[-1]
    _, idx = top_k(block_score, k)
    big = jnp.int32(nb)
    idx = jnp.sort(jnp.where(idx > limit[..., None], big, idx), axis=-1)
    return jnp.where(idx == big, -1, idx).astype(jnp.int32)


_INT32_MIN = -(2**31)


# Bits of the threshold each step of the selection's search settles. With 2, a step counts the keys reaching
# 3 candidates: half the (latency-bound) steps of 1 bit, for 3x the compares per key. Measured on an H100
# (BENCHMARKS.md, 2026-11-24 ninth and tenth sessions): the decode path's 128 programs wait on the steps (its
# kernel at 128K: 14.9 us with 1 bit, 13.8 with 2, ~30 with 4 as one [16, nbp] compare per step; with bf16
# scores, 16-bit keys: 2 bits as one [4, nbp] compare 12.2 us, as 1-D compares with two packed reductions
# 11.5); the prefill selection kernel's thousands of rows are bound by the compares (2 bits: 12% slower).
DECODE_SEARCH_BITS = 2
SELECT_SEARCH_BITS = 1


def _count_reaching(key: jax.Array, cands: list[jax.Array]) -> list[jax.Array]:
    """int32 counts of the entries of ``key int32[n]`` at or above each candidate (signed order), two
    candidates per block-wide reduction (16-bit fields; ``n < 2**15``, else one each)."""
    reach = [key >= c for c in cands]
    if key.shape[0] >= 1 << 15:
        return [jnp.sum(r.astype(jnp.int32)) for r in reach]
    counts = []
    for i in range(0, len(reach), 2):
        if i + 1 == len(reach):
            counts.append(jnp.sum(reach[i].astype(jnp.int32)))
            break
        both = jnp.sum(jnp.where(reach[i], 1, 0) + jnp.where(reach[i + 1], 1 << 16, 0))
        counts += [both & 0xFFFF, lax.shift_right_logical(both, 16)]
    return counts


def _pick_mask(score: jax.Array, lim: jax.Array, *, k: int, bits: int, key_bits: int = 32) -> jax.Array:
    """``bool[nbp]``: the k best entries of ``score fp32[nbp]`` (ties by lowest index), none past ``lim``.
    The k-th largest score comes from a radix search of ``bits`` (1, 2, 4 or 8) bits per step (at most
    ``key_bits / bits`` steps) over order-preserving int32 keys (no sort, no top-k). ``key_bits=16``: the
    scores are widened bf16 (only the top 16 bits of a key differ), so half the steps settle them."""
    if key_bits not in (16, 32) or key_bits % bits:
        raise ValueError(f"bits={bits} must divide key_bits={key_bits} (16 or 32)")
    nbp = score.shape[0]
    raw = lax.bitcast_convert_type(score, jnp.int32)
    key = jnp.where(raw < 0, raw ^ 0x7FFFFFFF, raw)  # the floats' order; -0.0 just below +0.0 (as lax.top_k)
    if key_bits < 32:  # (negative widened bf16 keys end in ones after the flip: clear them, order kept)
        key = key & ~((1 << (32 - key_bits)) - 1)

    def search(carry):  # t: the threshold's bits so far, in unsigned order (the int32 sign bit flipped)
        i, t, at_t = carry  # at_t: the keys reaching t (at least k)
        shift = 32 - bits * (i + 1)
        # Candidate digits 1 .. 2**bits - 1 below the settled bits (digit 0 is t itself); the counts are
        # non-increasing, and the step keeps the largest digit that k keys still reach.
        counts = _count_reaching(key, [(t | (d << shift)) ^ _INT32_MIN for d in range(1, 1 << bits)])
        best, reach = jnp.int32(0), at_t
        for d, count in enumerate(counts, 1):
            best = jnp.where(count >= k, d, best)
            reach = jnp.where(count >= k, count, reach)
        return i + 1, t | lax.shift_left(best, shift), reach

    # Each step's reductions are block-wide (latency-bound); the search stops early once exactly k keys reach
    # the candidate (then those k are the picks, and the threshold below selects them whatever its low bits).
    _, t, _ = lax.while_loop(lambda c: (c[0] < key_bits // bits) & (c[2] != k), search,
                             (jnp.int32(0), jnp.int32(0), jnp.int32(nbp)))
    kth = t ^ _INT32_MIN  # the k-th largest key, or (early stop) a key that exactly k keys reach
    above = key > kth
    tie = key == kth
    need = k - jnp.sum(above.astype(jnp.int32))
    idx = lax.broadcasted_iota(jnp.int32, (nbp,), 0)
    return (above | (tie & (jnp.cumsum(tie.astype(jnp.int32)) <= need))) & (idx <= lim)


def _key_bits(scores_dtype) -> int:
    """Leading bits of the search keys that can differ for block scores pooled from ``scores_dtype``
    scores (bf16 scores widen to floats whose low 16 bits are 0)."""
    return 16 if jnp.dtype(scores_dtype) == jnp.bfloat16 else 32


def _pick_row(score: jax.Array, lim: jax.Array, o_ref, *, k: int, key_bits: int = 32):
    """One row's selection from ``score fp32[nbp]`` (:func:`_pick_mask`), the picks written at their
    ranks: a stable partition of the row's indices, picked ones first, of which the first
    ``o_ref.shape[0]`` slots are stored."""
    nbp = score.shape[0]
    width = o_ref.shape[0]
    take = _pick_mask(score, lim, k=k, bits=SELECT_SEARCH_BITS, key_bits=key_bits)
    idx = lax.broadcasted_iota(jnp.int32, (nbp,), 0)
    rank = jnp.cumsum(take.astype(jnp.int32))  # inclusive
    total = jnp.sum(take.astype(jnp.int32))
    pos = jnp.where(take, rank - 1, total + idx - rank)  # a permutation of 0..nbp-1
    plt.store(o_ref.at[pos], jnp.where(take, idx, -1), mask=pos < width)


def _select_kernel(lim_ref, s_ref, o_ref, *, k: int):
    """One row of :func:`select_top_blocks` (bf16 rows widened exactly, searched over 16-bit keys)."""
    _pick_row(s_ref[...].astype(jnp.float32), lim_ref[0], o_ref, k=k, key_bits=_key_bits(s_ref.dtype))


def select_top_blocks(block_score: jax.Array, limit: jax.Array, *, k: int, interpret: bool | None = None) -> jax.Array:
    """Pallas version of :func:`select_top_blocks_reference` (same result, bit for bit): one program per row.

    XLA's top-k and sort cost 20+ µs for the 2 rows of a decode step (one thread block per row) and
    0.45 ms for a 2048-token prefill chunk's 4096 rows at 128K; this kernel reads each row once."""
    lead, nb = block_score.shape[:-1], block_score.shape[-1]
    if not 0 < k <= nb:
        raise ValueError(f"k={k} must be in 1..{nb} (the number of blocks)")
    nbp, width = next_power_of_2(nb), next_power_of_2(k)
    rows = block_score.reshape(-1, nb)
    if rows.dtype != jnp.bfloat16:
        rows = rows.astype(jnp.float32)
    if nbp != nb:  # pad blocks score -inf and lie past every limit (never kept)
        rows = jnp.pad(rows, ((0, 0), (0, nbp - nb)), constant_values=-jnp.inf)
    lim = jnp.broadcast_to(limit, lead).reshape(-1, 1).astype(jnp.int32)
    cfg = KernelConfig(block_q=1, block_k=nbp, num_warps=4 if nbp <= 2048 else 8, num_stages=1)
    out = pl.pallas_call(
        functools.partial(_select_kernel, k=k),
        grid=(rows.shape[0],),
        in_specs=[pl.BlockSpec((None, 1), lambda r: (r, 0)), pl.BlockSpec((None, nbp), lambda r: (r, 0))],
        out_specs=pl.BlockSpec((None, width), lambda r: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((rows.shape[0], width), jnp.int32),
        name="minicpm_select_blocks",
        **launch_options(cfg, interpret),
    )(lim, rows)
    return out[:, :k].reshape(*lead, k)


def pool_select_blocks_reference(
    scores: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *, k: int, kernel1: int, stride1: int,
    ratio: int, num_blocks: int, init_blocks: int, local_blocks: int, top_k=lax.top_k,
) -> jax.Array:
    """Stage-1 scores ``fp32[B, KVH, T, N1]`` → the attended blocks ``int32[B, KVH, T, k]`` in plain jnp:
    :func:`pool_block_scores`, then InfLLM-v2's forced blocks (the first ``init_blocks``, and the query's
    own block with the ``local_blocks`` before it, score +inf; later blocks -inf), then
    :func:`select_top_blocks_reference` (with ``top_k``) with the query's block as the limit."""
    block_score = pool_block_scores(scores, q_positions, kv_lengths, kernel1=kernel1, stride1=stride1, ratio=ratio,
                                    num_blocks=num_blocks)
    limit = jnp.broadcast_to((q_positions // (stride1 * ratio))[:, None, :], block_score.shape[:-1])
    block_score = force_blocks(block_score, limit, (init_blocks, local_blocks))
    return select_top_blocks_reference(block_score, limit, k=k, top_k=top_k)


def _pooled_block_scores(s_ref, pos, kv_len, *, kernel1, stride1, ratio, n1, num_blocks, init_blocks,
                         local_blocks) -> tuple[jax.Array, jax.Array]:
    """One row's block scores ``fp32[next_power_of_2(num_blocks)]`` and its limit (the query's block): the
    fine scores in ``s_ref [N1]`` max-pooled in registers (strided loads of the row: entries ``ratio*b - 1
    .. ratio*b + ratio - 1`` of block ``b``; visible entries count their score, existing invisible ones 0),
    the init and local blocks forced to +inf and blocks past the query's -inf."""
    nbp = next_power_of_2(num_blocks)
    n_exist = jnp.where(kv_len >= kernel1, (kv_len - kernel1) // stride1 + 1, 0)
    blk = lax.broadcasted_iota(jnp.int32, (nbp,), 0)
    score = jnp.full((nbp,), -jnp.inf, jnp.float32)
    for c in range(-1, ratio):
        entry = ratio * blk + c
        # (clamped: entries outside the row are masked below; bf16 prefill scores are widened exactly)
        s = plt.load(s_ref.at[jnp.clip(entry, 0, n1 - 1)]).astype(jnp.float32)
        real = (entry >= 0) & (entry < n1) & (entry < n_exist)
        visible = real & (entry * stride1 + (kernel1 - 1) <= pos)  # visible entries exist
        score = jnp.maximum(score, jnp.where(visible, s, jnp.where(real, 0.0, -jnp.inf)))
    lim = pos // (stride1 * ratio)
    forced = (blk < init_blocks) | (blk >= lim - local_blocks)
    return jnp.where(blk > lim, -jnp.inf, jnp.where(forced, jnp.inf, score)), lim


def _pool_select_kernel(len_ref, pos_ref, s_ref, o_ref, *, k, **pool):
    """One (batch, KV head, token) row: :func:`_pooled_block_scores`, then :func:`_pick_row`."""
    score, lim = _pooled_block_scores(s_ref, pos_ref[0], len_ref[pl.program_id(0)], **pool)
    _pick_row(score, lim, o_ref, k=k, key_bits=_key_bits(s_ref.dtype))


def pool_select_blocks_tiled(
    scores: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *, tokens: int, tile_rows: int, k: int,
    kernel1: int, stride1: int, ratio: int, num_blocks: int, init_blocks: int, local_blocks: int,
    interpret: bool | None = None,
) -> jax.Array:
    """:func:`pool_select_blocks` on scores ``[B, KVH, n_tiles * tile_rows, N1]`` (fp32 or bf16) holding
    token ``t`` in row ``(t // tokens) * tile_rows + t % tokens`` (:func:`compressed_scores_tiled`'s layout;
    ``tokens = tile_rows = 1`` is the plain one), read in place."""
    b, t = q_positions.shape
    kvh, n1 = scores.shape[1], scores.shape[-1]
    if not 0 < k <= num_blocks:
        raise ValueError(f"k={k} must be in 1..{num_blocks} (the number of blocks)")
    tiled = scores.reshape(b, kvh, -1, tile_rows, n1)
    nbp, width = next_power_of_2(num_blocks), next_power_of_2(k)
    cfg = KernelConfig(block_q=1, block_k=nbp, num_warps=4 if nbp <= 2048 else 8, num_stages=1)
    out = pl.pallas_call(
        functools.partial(_pool_select_kernel, k=k, kernel1=kernel1, stride1=stride1, ratio=ratio, n1=n1,
                          num_blocks=num_blocks, init_blocks=init_blocks, local_blocks=local_blocks),
        grid=(b, kvh, t),
        in_specs=[pl.BlockSpec((b,), lambda i, j, n: (0,)),
                  pl.BlockSpec((None, None, 1), lambda i, j, n: (i, n, 0)),
                  pl.BlockSpec((None, None, None, None, n1), lambda i, j, n: (i, j, n // tokens, n % tokens, 0))],
        out_specs=pl.BlockSpec((None, None, None, width), lambda i, j, n: (i, j, n, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kvh, t, width), jnp.int32),
        name="minicpm_pool_select_blocks",
        **launch_options(cfg, interpret),
    )(kv_lengths.astype(jnp.int32), q_positions.astype(jnp.int32)[..., None], tiled)
    return out[..., :k]


def pool_select_blocks(
    scores: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *, k: int, kernel1: int, stride1: int,
    ratio: int, num_blocks: int, init_blocks: int, local_blocks: int, interpret: bool | None = None,
) -> jax.Array:
    """Pallas version of :func:`pool_select_blocks_reference` (same result, bit for bit): one program per
    (batch, KV head, token) row, which max-pools the row's fine scores in registers, forces the init and
    local blocks and picks as :func:`select_top_blocks` does. The fine scores are read once and the block
    scores never reach memory (XLA's pooling pass cost 0.13 ms of a 2048-token chunk at 128K on an H100)."""
    return pool_select_blocks_tiled(scores, q_positions, kv_lengths, tokens=1, tile_rows=1, k=k, kernel1=kernel1,
                                    stride1=stride1, ratio=ratio, num_blocks=num_blocks, init_blocks=init_blocks,
                                    local_blocks=local_blocks, interpret=interpret)


# ------------------------------------------------------------------------------------------------ stage 2


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
    out = jnp.einsum("bkgts,bksd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.reshape(b, t, h, d).astype(q.dtype)
    if not return_lse:
        return out
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B, KVH, G, T]; -inf where nothing is visible
    return out, lse.transpose(0, 3, 1, 2).reshape(b, t, h)


def _sparse_kernel(len_ref, q_ref, pos_ref, idx_ref, k_ref, v_ref, o_ref, lse_ref, *, qk_scale, block_size,
                   seq_len, per_split, whole_blocks):
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
        if whole_blocks:  # every key of the block is visible to every row: no masks (the clamp only keeps a
            # broken promise inside the buffer)
            return _attend_block(q, k_ref, v_ref, jnp.minimum(block_start, seq_len - block_size), carry,
                                 qk_scale=qk_scale, block_k=block_size)
        # The slice is clamped into the buffer; keys before the block's start are masked out by `lo`.
        start = jnp.minimum(block_start, seq_len - block_size)
        limit = jnp.minimum(kv_len, block_start + block_size)
        return _attend_block(q, k_ref, v_ref, start, carry, qk_scale=qk_scale, block_k=block_size, pos=pos,
                             kv_len=limit, lo=block_start)

    _store_split(o_ref, lse_ref, lax.fori_loop(first, last, step, _empty_carry(rows, q.shape[1])))


def _group_tiles(q: jax.Array, kv_heads: int, rows: int) -> jax.Array:
    """``[B, T, H, D]`` → ``[B, T, KVH * rows, D]``: each KV group's query heads padded to ``rows`` (a view
    when the group already has ``rows`` heads)."""
    b, t, h, d = q.shape
    group = h // kv_heads
    if group == rows:
        return q
    qg = jnp.pad(q.reshape(b, t, kv_heads, group, d), ((0, 0), (0, 0), (0, 0), (0, rows - group), (0, 0)))
    return qg.reshape(b, t, kv_heads * rows, d)


def _split_grid_io(b: int, kvh: int, t: int, splits: int, rows: int, s: int, d: int, layer: int,
                   o_dtype=jnp.float32):
    """Specs of the stage-2 kernels on grid (batch, KV head, token, split): the K and V inputs (one layer
    of the stacked cache, read in place), and the per-split outputs o ``[B, KVH, T, splits, rows, D]`` (in
    ``o_dtype``, normalised within its split) and lse fp32 ``[B, KVH, T, splits, rows]`` (log2 units).
    Returns (kv_specs, out_specs, out_shape)."""
    kv = pl.BlockSpec((None, None, None, s, d), lambda i, j, n, sp: (layer, i, j, 0, 0))
    out_specs = [pl.BlockSpec((None, None, None, None, rows, d), lambda i, j, n, sp: (i, j, n, sp, 0, 0)),
                 pl.BlockSpec((None, None, None, None, rows), lambda i, j, n, sp: (i, j, n, sp, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, kvh, t, splits, rows, d), o_dtype),
                 jax.ShapeDtypeStruct((b, kvh, t, splits, rows), jnp.float32)]
    return [kv, kv], out_specs, out_shape


def sparse_splits(batch: int, kv_heads: int, tokens: int, max_blocks: int) -> int:
    """Programs sharing one (token, KV group)'s selected blocks: enough for two programs per SM, at least
    two blocks per program; 1 for prefill chunks (tokens x groups already fill the GPU)."""
    return max(1, min(max(1, max_blocks // 2), pl.cdiv(2 * num_cores(), batch * kv_heads * tokens)))


def block_sparse_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array,
    block_indices: jax.Array, *, scale: float, block_size: int, layer: int | None = None, return_lse: bool = False,
    whole_blocks: bool = False, num_splits: int | None = None, config: KernelConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Block-sparse causal attention (Pallas). Signature of :func:`block_sparse_attention_reference`;
    ``block_indices`` must list each row's valid blocks first (the ``-1`` entries last).

    Grid (batch, KV group, token, split of the selected blocks): the tile is the group's query heads for
    one token (they share the selection), each step one ``block_size``-key block; splits are merged by
    log-sum-exp as in flash-decoding.
    """
    (k, _), (v, layer) = _layer_view(k, layer), _layer_view(v, layer)
    b, t, h, d = q.shape
    kvh, s = k.shape[2], k.shape[3]
    if s < block_size:
        raise ValueError(f"block_sparse_attention needs a cache of at least one block ({block_size}), got {s}")
    group = h // kvh
    rows = max(_MIN_ROWS, next_power_of_2(group))
    n_sel = block_indices.shape[-1]
    k_pad = next_power_of_2(n_sel)
    idx = jnp.pad(block_indices.astype(jnp.int32), ((0, 0), (0, 0), (0, 0), (0, k_pad - n_sel)), constant_values=-1)
    row_pos = jnp.broadcast_to(q_positions.astype(jnp.int32)[:, :, None], (b, t, rows))
    splits = num_splits or sparse_splits(b, kvh, t, n_sel)
    per_split = pl.cdiv(k_pad, splits)
    cfg = config or SPARSE_CONFIG
    kernel = functools.partial(_sparse_kernel, qk_scale=scale * _LOG2E, block_size=block_size, seq_len=s,
                               per_split=per_split, whole_blocks=whole_blocks)
    kv_specs, out_specs, out_shape = _split_grid_io(b, kvh, t, splits, rows, s, d, layer)
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, kvh, t, splits),
        in_specs=[
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
    )(kv_lengths.astype(jnp.int32), _group_tiles(q, kvh, rows), row_pos, idx, k, v)
    out = o[:, :, :, 0] if splits == 1 else merge_splits(o, lse)  # [B, KVH, T, rows, D]
    out = out[:, :, :, :group].transpose(0, 2, 1, 3, 4).reshape(b, t, h, d).astype(q.dtype)
    if not return_lse:
        return out
    top = jnp.max(lse, axis=3)  # [B, KVH, T, rows], log2 units
    safe = jnp.where(jnp.isneginf(top), 0.0, top)
    total = jnp.log2(jnp.sum(jnp.exp2(lse - safe[:, :, :, None]), axis=3)) + safe  # -inf when every split is empty
    total = total[..., :group].transpose(0, 2, 1, 3).reshape(b, t, h) / _LOG2E
    return out, total


# ------------------------------------------------------------------------------ stage 2, local window


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
    out = jnp.einsum("bkgts,bksd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B, KVH, G, T]
    return out.reshape(b, t, h, d).astype(q.dtype), lse.transpose(0, 3, 1, 2).reshape(b, t, h)


def _window_kernel(len_ref, q_ref, pos_ref, k_ref, v_ref, o_ref, lse_ref, *, qk_scale, block_k, block_size,
                   local_blocks):
    """One query block of one head: keys from the lowest row's window start to the highest row's position,
    masked only over the blocks where some row's window starts or the causal diagonal runs."""
    kv_len = len_ref[pl.program_id(0)]
    q = q_ref[...]
    pos = pos_ref[...]
    lo = block_size * jnp.maximum(pos // block_size - local_blocks, 0)  # [M] each row's first key
    n_all = pl.cdiv(jnp.clip(jnp.max(pos) + 1, 0, kv_len), block_k)
    n_lo = jnp.minimum(pl.cdiv(jnp.max(lo), block_k), n_all)  # blocks [min lo, max lo) need the lower mask
    n_full = jnp.clip(jnp.clip(jnp.min(pos) + 1, 0, kv_len) // block_k, n_lo, n_all)  # [n_lo, n_full): all see
    carry = _empty_carry(q.shape[0], q.shape[1])
    step = functools.partial(_attend_block, q, k_ref, v_ref, qk_scale=qk_scale, block_k=block_k)

    def masked(j, c):
        key = j * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        return step(j * block_k, c, pos=pos, kv_len=kv_len, mask=key >= lo[:, None])

    carry = lax.fori_loop(jnp.min(lo) // block_k, n_lo, masked, carry)
    carry = lax.fori_loop(n_lo, n_full, lambda j, c: step(j * block_k, c), carry)
    _store_split(o_ref, lse_ref, lax.fori_loop(n_full, n_all, masked, carry))


def local_window_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *, scale: float,
    block_size: int, local_blocks: int, layer: int | None = None, config: KernelConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pallas version of :func:`local_window_attention_reference` (same signature): flash attention with
    the grid of the dense prefill kernel (batch, query head, query block), so a K/V block is read once per
    head and query block rather than once per token as in :func:`block_sparse_attention`. The keys a block
    streams are its rows' windows, ``(local_blocks + 1)·block_size`` of them for block-aligned rows."""
    (k, _), (v, layer) = _layer_view(k, layer), _layer_view(v, layer)
    _check_shapes(q, k, v, q_positions, kv_lengths)
    b, t, h, d = q.shape
    kvh, s = k.shape[2], k.shape[3]
    group = h // kvh
    cfg = config or tuned_config("prefill", d)
    q, q_positions, block_q = pad_query_blocks(q, q_positions, cfg.block_q)
    t_pad = q.shape[1]
    n_q = t_pad // block_q
    kernel = functools.partial(_window_kernel, qk_scale=scale * _LOG2E, block_k=_key_block(cfg.block_k, s),
                               block_size=block_size, local_blocks=local_blocks)
    out, lse = pl.pallas_call(
        kernel,
        grid=(b, h, n_q),
        in_specs=[
            pl.BlockSpec((b,), lambda i, j, n: (0,)),
            pl.BlockSpec((None, block_q, None, d), lambda i, j, n: (i, n, j, 0)),
            pl.BlockSpec((None, block_q), lambda i, j, n: (i, n)),
            pl.BlockSpec((None, None, None, s, d), lambda i, j, n: (layer, i, j // group, 0, 0)),
            pl.BlockSpec((None, None, None, s, d), lambda i, j, n: (layer, i, j // group, 0, 0)),
        ],
        out_specs=[pl.BlockSpec((None, block_q, None, d), lambda i, j, n: (i, n, j, 0)),
                   pl.BlockSpec((None, None, block_q), lambda i, j, n: (i, j, n))],
        out_shape=[jax.ShapeDtypeStruct((b, t_pad, h, d), q.dtype), jax.ShapeDtypeStruct((b, h, t_pad), jnp.float32)],
        name="minicpm_infllm_window_attention",
        **launch_options(cfg, interpret),
    )(kv_lengths.astype(jnp.int32), q, q_positions.astype(jnp.int32), k, v)
    return out[:, :t], lse[:, :, :t].transpose(0, 2, 1) / _LOG2E


def merge_attention(parts: list[tuple[jax.Array, jax.Array]]) -> jax.Array:
    """Attention over disjoint key sets, each ``(out [..., M, D], lse fp32 [..., M])`` (natural log; -inf =
    no key), combined into attention over their union (:func:`merge_splits` over the parts). fp32."""
    o = jnp.stack([o for o, _ in parts], axis=-3)
    lse = jnp.stack([lse for _, lse in parts], axis=-2) * _LOG2E
    return merge_splits(o, lse)


# ------------------------------------------------------------- decode: selection and stage 2 in one kernel
#
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


def _pool_select_attend_kernel(len_ref, pos_ref, s_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, qk_scale, k,
                               block_size, seq_len, per_split, tokens, pool):
    """One (batch, KV head, token, split): the token's pooled block scores and picks (the same in every
    split of the token), then online softmax over the picks ranked ``[split * per_split, ...)``."""
    kv_len = len_ref[pl.program_id(0)]
    pos = pos_ref[pl.program_id(0) * tokens + pl.program_id(2)]
    score, lim = _pooled_block_scores(s_ref, pos, kv_len, **pool)
    take = _pick_mask(score, lim, k=k, bits=DECODE_SEARCH_BITS, key_bits=_key_bits(s_ref.dtype))
    blk = lax.broadcasted_iota(jnp.int32, score.shape, 0)
    rank = jnp.where(take, jnp.cumsum(take.astype(jnp.int32)), 0)  # 1.. for picks in ascending block order
    q = q_ref[...]
    rows = q.shape[0]
    row_pos = jnp.full((rows,), pos, jnp.int32)
    first = pl.program_id(3) * per_split
    step = functools.partial(_attend_block, q, k_ref, v_ref, qk_scale=qk_scale, block_k=block_size, pos=row_pos)

    def block(r):  # the pick of rank r (0-based): where its slice starts, its first key, its key limit
        found = jnp.sum(jnp.where(rank == r + 1, blk + 1, 0))  # 0: a rank past the picks
        block_start = jnp.maximum(found - 1, 0) * block_size
        # The slice is clamped into the buffer; keys before the block's start are masked out by `lo`; a
        # rank past the picks gets an empty range (nothing read, nothing attended).
        limit = jnp.where(found > 0, jnp.minimum(kv_len, block_start + block_size), block_start)
        return jnp.minimum(block_start, seq_len - block_size), block_start, limit

    carry = _empty_carry(rows, q.shape[1])
    if per_split <= _UNROLLED_PICKS:  # every pick's loads are issued before the first one is used
        picks = [block(first + i) for i in range(per_split)]
        kvs = [_load_block(k_ref, v_ref, start, block_k=block_size, kv_len=limit, lo=lo) for start, lo, limit in picks]
        for (start, lo, limit), kv in zip(picks, kvs):
            carry = step(start, carry, kv_len=limit, lo=lo, kv=kv)
    else:
        def body(r, c):
            start, lo, limit = block(r)
            return step(start, c, kv_len=limit, lo=lo)

        total = jnp.sum(take.astype(jnp.int32))
        carry = lax.fori_loop(first, jnp.minimum(first + per_split, total), body, carry)
    _store_split(o_ref, lse_ref, carry)


def pool_select_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, scores: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *,
    scale: float, block_size: int, k_blocks: int, kernel1: int, stride1: int, init_blocks: int, local_blocks: int,
    layer: int | None = None, num_splits: int | None = None, config: KernelConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Pallas version of :func:`pool_select_attention_reference` (same signature): the selection and stage
    2 in one launch, then the split merge in another (:func:`merge_splits_rows`). Grid (batch, KV head,
    token, split): every program of a token pools and picks (:func:`_pooled_block_scores`,
    :func:`_pick_mask`: bit for bit the reference's picks), then attends the picks of its rank range in
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
    config: KernelConfig | None = None, interpret: bool | None = None,
) -> jax.Array:
    """:func:`pool_select_attention` on scores in :func:`compressed_scores_tiled`'s layout (``[B, KVH,
    n_tiles * tile_rows, N1]``, fp32 or bf16, token ``t`` in row ``(t // tokens) * tile_rows + t % tokens``), read in
    place."""
    (k, _), (v, layer) = _layer_view(k, layer), _layer_view(v, layer)
    b, t, h, d = q.shape
    kvh, s = k.shape[2], k.shape[3]
    if s < block_size:
        raise ValueError(f"pool_select_attention needs a cache of at least one block ({block_size}), got {s}")
    n1 = scores.shape[-1]
    num_blocks = pl.cdiv(s, block_size)
    k_sel = min(k_blocks, num_blocks)
    group = h // kvh
    rows = max(_MIN_ROWS, next_power_of_2(group))
    splits = next_power_of_2(num_splits or sparse_splits(b, kvh, t, k_sel))
    per_split = pl.cdiv(k_sel, splits)
    nbp = next_power_of_2(num_blocks)
    # 8 warps from 2048 blocks (128K tokens) on: the search's compares then dominate (H100, 128K: 11.1 vs
    # 11.5 us; at 8K, 128 blocks, 4 warps: 8.0 vs 8.5).
    cfg = config or KernelConfig(block_q=1, block_k=block_size, num_warps=4 if nbp < 2048 else 8, num_stages=1)
    pool = dict(kernel1=kernel1, stride1=stride1, ratio=block_size // stride1, n1=n1, num_blocks=num_blocks,
                init_blocks=init_blocks, local_blocks=local_blocks)
    kernel = functools.partial(_pool_select_attend_kernel, qk_scale=scale * _LOG2E, k=k_sel, block_size=block_size,
                               seq_len=s, per_split=per_split, tokens=t, pool=pool)
    tiled = scores.reshape(b, kvh, -1, tile_rows, n1)
    # bf16 per-split outputs for bf16 queries, as flash-decoding's: the merged output is rounded to bf16
    # anyway, and the merge reads half the bytes.
    split_dtype = jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32
    kv_specs, out_specs, out_shape = _split_grid_io(b, kvh, t, splits, rows, s, d, layer, o_dtype=split_dtype)
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, kvh, t, splits),
        in_specs=[
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
    )(kv_lengths.astype(jnp.int32), q_positions.astype(jnp.int32).reshape(-1), tiled, _group_tiles(q, kvh, rows), k, v)
    out = merge_splits_rows(o, lse, out_dtype=q.dtype, interpret=interpret)  # [B, KVH, T, rows, D]
    return out[:, :, :, :group].transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


# -------------------------------------------------------------------------- compressed-cache decode step


def compress_step_reference(
    k: jax.Array, k1: jax.Array, k2: jax.Array, old_lengths: jax.Array, new_lengths: jax.Array, *, layer: int,
    kernel1: int, stride1: int, kernel2: int, stride2: int,
) -> tuple[jax.Array, jax.Array]:
    """The compressed-key update of one decode step in plain jnp: for each row that grew
    (``new_lengths[b] > old_lengths[b]``, by one token) and each cache, if the step completed window
    ``j = (new - kernel) / stride``, ``comp[layer, b, :, j] = mean(k[layer, b, :, new-kernel:new])``
    (fp32 mean, stored in the cache dtype). k ``[L, B, KVH, S, D]``, k1/k2 ``[L, B, KVH, N, D]``; returns
    the updated (k1, k2)."""
    b, s = k.shape[1], k.shape[3]
    rows = jnp.arange(b)
    out = []
    for comp, kernel, stride in ((k1, kernel1, stride1), (k2, kernel2, stride2)):
        start = new_lengths - kernel
        ok = (new_lengths > old_lengths) & (start >= 0) & (start % stride == 0)
        pos = jnp.clip(start[:, None] + jnp.arange(kernel, dtype=jnp.int32), 0, s - 1)
        keys = k[layer, rows[:, None], :, pos]  # [B, kernel, KVH, D]
        mean = jnp.mean(keys.astype(jnp.float32), axis=1).astype(comp.dtype)
        slot = jnp.where(ok, start // stride, comp.shape[3])
        out.append(comp.at[layer, rows, :, slot].set(mean, mode="drop"))
    return out[0], out[1]


def _compress_kernel(old_ref, new_ref, k_ref, k1_in, k2_in, k1_ref, k2_ref, *, kernel1, stride1, kernel2,
                     stride2):
    del k1_in, k2_in  # aliased to the outputs: entries not written keep their values
    row = pl.program_id(0)
    old, new = old_ref[row], new_ref[row]
    for ref, kernel, stride in ((k1_ref, kernel1, stride1), (k2_ref, kernel2, stride2)):
        start = new - kernel

        @pl.when((new > old) & (start >= 0) & (start % stride == 0))
        def _(ref=ref, kernel=kernel, stride=stride, start=start):
            keys = k_ref[pl.ds(start, kernel), :].astype(jnp.float32)
            mean = jnp.sum(keys, axis=0) * (1.0 / kernel)
            ref[pl.ds(start // stride, 1), :] = mean[None, :].astype(ref.dtype)


def compress_step(
    k: jax.Array, k1: jax.Array, k2: jax.Array, old_lengths: jax.Array, new_lengths: jax.Array, *, layer: int,
    kernel1: int, stride1: int, kernel2: int, stride2: int, interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The compressed-key update of one decode step (Pallas): one program per (row, KV head) reads the
    last window of keys and writes the new K1/K2 entries in place (k1/k2 are aliased to the outputs), so a
    decode step costs one launch instead of gathers, means and scatters. Signature of
    :func:`compress_step_reference`; window sizes must be powers of 2."""
    b, kvh, s, d = k.shape[1], k.shape[2], k.shape[3], k.shape[4]
    n1, n2 = k1.shape[3], k2.shape[3]
    lengths = pl.BlockSpec((b,), lambda i, j: (0,))
    kernel = functools.partial(_compress_kernel, kernel1=kernel1, stride1=stride1, kernel2=kernel2, stride2=stride2)
    return pl.pallas_call(
        kernel,
        grid=(b, kvh),
        in_specs=[
            lengths, lengths,
            pl.BlockSpec((None, None, None, s, d), lambda i, j: (layer, i, j, 0, 0)),
            pl.BlockSpec((None, None, None, n1, d), lambda i, j: (layer, i, j, 0, 0)),
            pl.BlockSpec((None, None, None, n2, d), lambda i, j: (layer, i, j, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, n1, d), lambda i, j: (layer, i, j, 0, 0)),
            pl.BlockSpec((None, None, None, n2, d), lambda i, j: (layer, i, j, 0, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(k1.shape, k1.dtype), jax.ShapeDtypeStruct(k2.shape, k2.dtype)],
        input_output_aliases={3: 0, 4: 1},
        name="minicpm_infllm_compress",
        **launch_options(SPARSE_CONFIG, interpret),
    )(old_lengths.astype(jnp.int32), new_lengths.astype(jnp.int32), k, k1, k2)
