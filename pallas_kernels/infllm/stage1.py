"""InfLLM-v2 stage 1: relevance scores of every query token against the compressed keys, a jnp reference
and the Pallas kernels.

For every query token and KV group, ``score[j] = sum_{h in group} exp(q_h . K1[j] * scale - LSE_h)`` where
``LSE_h`` is the log-sum-exp of ``q_h . K2 * scale`` over the coarse keys. Compressed key ``j`` (window
``[stride*j, stride*j + kernel)``) is visible to a query at position ``p`` iff its whole window lies at or
before ``p``; invisible entries score 0, and so does a row that sees no coarse key (HF turns those NaN
rows into 0).

Shapes: q ``[B, T, H, D]``; compressed keys ``[B, KVH, N, D]`` or the stacked caches ``[L, B, KVH, N, D]``
with ``layer`` naming the slice (kernels read it in place). Query head ``h`` belongs to KV group
``h // (H / KVH)``. Scores in fp32 (bf16 for bf16 queries from the kernels, see :func:`scores_dtype`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.flash import LOG2E, MASKED, MIN_ROWS, gather_rows, layer_view, page_table_spec, paged_refs
from pallas_kernels.infllm.common import compressed_entries, compressed_visible, scores_config
from pallas_kernels.launch import KernelConfig, launch_options, next_power_of_2, num_cores


def compressed_scores_reference(
    q: jax.Array, k1: jax.Array, k2: jax.Array, q_positions: jax.Array, *, scale: float,
    kernel1: int, stride1: int, kernel2: int, stride2: int, layer: int | None = None,
    extra_logits: jax.Array | None = None,
) -> jax.Array:
    """Stage-1 scores in plain jnp: fp32 ``[B, KVH, T, N1]`` (N1 = k1's entry axis). See the module doc.

    extra_logits: None, or fp32 ``[B, T, H]``: the (scaled) logit of one more coarse key per query and
    head that joins the LSE (-inf: none); a speculative tree node's coarse window that closes inside its
    own ancestor path (``minicpm_jax.infllm.attention.tree_sparse_attention``)."""
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


def _load_entries(k_ref, pages_ref, start, block_n: int, *, kernel: int, stride: int, page_size: int | None):
    """Compressed keys ``[start, start + block_n)`` ``[block_n, D]``: a slice of the row's buffer, or with a
    page table ``pages_ref [P]`` each entry gathered from the page of its window's last key
    (:mod:`pallas_kernels.infllm.paged`; shifts and masks: page size and stride are powers of 2)."""
    if pages_ref is None:
        return k_ref[pl.ds(start, block_n), :]
    end = (start + lax.broadcasted_iota(jnp.int32, (block_n,), 0)) * stride + (kernel - 1)
    page = jnp.minimum(lax.shift_right_logical(end, page_size.bit_length() - 1), pages_ref.shape[0] - 1)
    within = lax.shift_right_logical(jnp.bitwise_and(end, page_size - 1), stride.bit_length() - 1)
    rows = plt.load(pages_ref.at[page]) * (page_size // stride) + within
    return gather_rows(k_ref, rows)


def _lse_kernel(*refs, qk_scale, kernel2, stride2, block_n, n2, blocks_per_split, tokens, group_pad, page_size=None):
    """Pass 1, one split of the coarse keys: running max and sum (log2 units) of each row's scores."""
    pages_ref, (q_ref, pos_ref, k2_ref, m_ref, l_ref) = paged_refs(refs, 1, page_size)
    q = q_ref[...]
    rows = q.shape[0]
    pos = _row_positions(pos_ref, rows, tokens, group_pad)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def step(j, carry, masked: bool):
        m, l = carry
        start = jnp.minimum(j * block_n, n2 - block_n)  # clamped so the slice stays in the buffer
        k = _load_entries(k2_ref, pages_ref, start, block_n, kernel=kernel2, stride=stride2, page_size=page_size)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * qk_scale
        if masked:
            key = start + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
            visible = (key[None, :] * stride2 + (kernel2 - 1) <= pos[:, None]) & (key[None, :] >= j * block_n)
            s = jnp.where(visible, s, MASKED)
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
    carry = (jnp.full((rows,), MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32))
    carry = lax.fori_loop(first, mid, functools.partial(step, masked=False), carry)
    m, l = lax.fori_loop(mid, last, functools.partial(step, masked=True), carry)
    m_ref[...] = m
    l_ref[...] = l


def _score_kernel(*refs, qk_scale, group, group_pad, kernel1, stride1, block_n, n1, blocks_per_split, tokens,
                  page_size=None, has_extra=False):
    """Pass 2, one split of the fine keys: the LSE merged from pass 1's per-split max/sum (``[S, rows]``)
    and, with ``has_extra``, one more key's logit per row (``[1, rows]``, log2 units, -inf: none), then
    exp2(s - LSE) summed over each token's heads."""
    pages_ref, refs = paged_refs(refs, 1, page_size)
    q_ref, pos_ref, m_ref, l_ref = refs[:4]
    e_ref, k1_ref, o_ref = refs[4:] if has_extra else (None, *refs[4:])
    q = q_ref[...]
    rows = q.shape[0]
    pos = _row_positions(pos_ref, rows, tokens, group_pad)
    m_part, l_part = m_ref[...], l_ref[...]
    top = jnp.max(m_part, axis=0)
    if has_extra:
        e = e_ref[0, :]
        has_e = e > MASKED  # -inf: no extra key for this row
        top = jnp.maximum(top, jnp.where(has_e, e, MASKED))
    total = jnp.sum(l_part * jnp.exp2(m_part - top[None, :]), axis=0)
    if has_extra:
        total = total + jnp.where(has_e, jnp.exp2(jnp.where(has_e, e, top) - top), 0.0)
    seen = total > 0.0
    lse = jnp.where(seen, top + jnp.log2(jnp.where(seen, total, 1.0)), MASKED)
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
        k = _load_entries(k1_ref, pages_ref, start, block_n, kernel=kernel1, stride=stride1, page_size=page_size)
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
    return 1 if tokens == 1 else max(MIN_ROWS, tokens)


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
    interpret: bool | None = None, page_table: jax.Array | None = None, page_size: int | None = None,
) -> tuple[jax.Array, int]:
    """:func:`compressed_scores` as the kernel writes them: ``[B, KVH, n_tiles * R, N1]`` in
    :func:`scores_dtype` with ``R = score_tile_rows(tokens)`` (token ``t`` in row ``(t // tokens) * R + t %
    tokens``; the other rows are padding) and ``tokens``, the tokens per tile; :func:`pool_select_blocks_tiled`
    and :func:`pool_select_attention_tiled` read this without a copy.

    With ``page_table int32[B, P]``, k1 / k2 are a paged pool's compressed keys ``[L, KVH, R1 | R2, D]``
    (:mod:`pallas_kernels.infllm.paged`, pages of ``page_size`` tokens) and ``N1 = compressed_entries(P *
    page_size, stride1)``."""
    paged = page_table is not None
    if paged:
        capacity = page_table.shape[1] * page_size
        kvh, n1, n2 = k1.shape[1], compressed_entries(capacity, stride1), compressed_entries(capacity, stride2)
    else:
        (k1, _), (k2, layer) = layer_view(k1, layer), layer_view(k2, layer)
        kvh, n1, n2 = k1.shape[2], k1.shape[3], k2.shape[3]
    b, t, h, d = q.shape
    if min(n1, n2) < 16:
        raise ValueError(f"compressed_scores needs at least 16 compressed entries, got {n1} and {n2}")
    group = h // kvh
    cfg = config or scores_config(t)
    tokens = min(cfg.block_q, next_power_of_2(t))
    group_pad = max(next_power_of_2(group), -(-MIN_ROWS // tokens))  # rows = tokens x group_pad >= 16
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
    tile = dict(tokens=tokens, group_pad=group_pad, page_size=page_size)

    def comp_spec(n):  # one row's compressed keys of KV head j, or the head's whole pool
        if paged:
            return pl.BlockSpec((None, None, n, d), lambda i, j, nt, s: (layer, j, 0, 0))
        return pl.BlockSpec((None, None, None, n, d), lambda i, j, nt, s: (layer, i, j, 0, 0))
    pages = [page_table_spec(page_table, lambda i, j, nt, s: i)] if paged else []
    table = [page_table.astype(jnp.int32)] if paged else []

    blocks2 = pl.cdiv(n2, block_n)
    splits2 = next_power_of_2(_splits(blocks2, b * kvh * n_t))  # a power of 2: pass 2 loads all partials
    per2 = pl.cdiv(blocks2, splits2)
    part_spec = pl.BlockSpec((None, None, None, rows), lambda i, j, n, s: (i, j, s, n))
    m, l = pl.pallas_call(
        functools.partial(_lse_kernel, qk_scale=scale * LOG2E, kernel2=kernel2, stride2=stride2, block_n=block_n,
                          n2=n2, blocks_per_split=per2, **tile),
        grid=(b, kvh, n_t, splits2),
        in_specs=[*pages, q_spec, pos_spec, comp_spec(k2.shape[-2] if paged else n2)],
        out_specs=[part_spec, part_spec],
        out_shape=[jax.ShapeDtypeStruct((b, kvh, splits2, t_pad * group_pad), jnp.float32)] * 2,
        name="minicpm_infllm_lse", **opts,
    )(*table, qr, pos, k2)
    parts = m.shape[2]
    extra = []
    if extra_logits is not None:
        # One more coarse key per (token, head) joins the LSE: its logit (log2 units; -inf: none) is a third
        # input of pass 2, merged there with the partials. Appending it to m and l instead cost two
        # concatenations, each recomputing the logit (XLA duplicates the producer into both), ~10 us each
        # per layer in a 12-node verify at 128K (H200).
        e = extra_logits.astype(jnp.float32).reshape(b, t, kvh, group).transpose(0, 2, 1, 3) * LOG2E
        e = jnp.pad(e, ((0, 0), (0, 0), (0, t_pad - t), (0, group_pad - group)), constant_values=-jnp.inf)
        extra = [e.reshape(b, kvh, 1, t_pad * group_pad)]

    blocks1 = pl.cdiv(n1, block_n)
    splits1 = num_splits or _splits(blocks1, b * kvh * n_t)
    per1 = pl.cdiv(blocks1, splits1)
    parts_spec = pl.BlockSpec((None, None, parts, rows), lambda i, j, n, s: (i, j, 0, n))
    out = pl.pallas_call(
        functools.partial(_score_kernel, qk_scale=scale * LOG2E, group=group, group_pad=group_pad, kernel1=kernel1,
                          stride1=stride1, block_n=block_n, n1=n1, blocks_per_split=per1, tokens=tokens,
                          page_size=page_size, has_extra=bool(extra)),
        grid=(b, kvh, n_t, splits1),
        in_specs=[*pages, q_spec, pos_spec, parts_spec, parts_spec,
                  *[pl.BlockSpec((None, None, 1, rows), lambda i, j, n, s: (i, j, 0, n))] * len(extra),
                  comp_spec(k1.shape[-2] if paged else n1)],
        out_specs=pl.BlockSpec((None, None, out_rows, n1), lambda i, j, n, s: (i, j, n, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kvh, n_t * out_rows, n1), scores_dtype(q.dtype)),
        name="minicpm_infllm_scores", **opts,
    )(*table, qr, pos, m, l, *extra, k1)
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
    up to ``scores_config(T).block_q`` tokens times the padded group (one token for decode). Scores come in
    :func:`scores_dtype`. ``num_splits`` fixes the pass-2 split count.
    """
    t = q.shape[1]
    raw, tokens = compressed_scores_tiled(q, k1, k2, q_positions, scale=scale, kernel1=kernel1, stride1=stride1,
                                          kernel2=kernel2, stride2=stride2, layer=layer, extra_logits=extra_logits,
                                          num_splits=num_splits, config=config, interpret=interpret)
    b, kvh, _, n1 = raw.shape
    out = raw.reshape(b, kvh, -1, score_tile_rows(tokens), n1)[:, :, :, :tokens].reshape(b, kvh, -1, n1)
    return out[:, :, :t] if out.shape[2] != t else out
