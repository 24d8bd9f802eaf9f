"""InfLLM-v2 block selection: stage-1 scores → the blocks each query attends, a jnp reference and the
Pallas kernels.

Block ``b`` (tokens ``[block*b, block*b + block)``) scores the max over the fine entries overlapping it
(HF's max-pool: window ``ratio + 1``, stride ``ratio``, padding 1); the init blocks and the query's own
block with the ``local_blocks`` before it score +inf, later blocks -inf; the ``k`` best are attended,
ascending, padded with -1. The kernels pick without a sort: a radix search for the k-th largest score
over order-preserving integer keys, then a stable partition (bit for bit the reference's picks, ties to
the lower block).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.infllm.common import compressed_count, compressed_visible
from pallas_kernels.launch import KernelConfig, launch_options, next_power_of_2


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


def pick_mask(score: jax.Array, lim: jax.Array, *, k: int, bits: int, key_bits: int = 32) -> jax.Array:
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


def search_key_bits(scores_dtype) -> int:
    """Leading bits of the search keys that can differ for block scores pooled from ``scores_dtype``
    scores (bf16 scores widen to floats whose low 16 bits are 0)."""
    return 16 if jnp.dtype(scores_dtype) == jnp.bfloat16 else 32


def pick_row(score: jax.Array, lim: jax.Array, o_ref, *, k: int, key_bits: int = 32):
    """One row's selection from ``score fp32[nbp]`` (:func:`pick_mask`), the picks written at their
    ranks: a stable partition of the row's indices, picked ones first, of which the first
    ``o_ref.shape[0]`` slots are stored."""
    nbp = score.shape[0]
    width = o_ref.shape[0]
    take = pick_mask(score, lim, k=k, bits=SELECT_SEARCH_BITS, key_bits=key_bits)
    idx = lax.broadcasted_iota(jnp.int32, (nbp,), 0)
    rank = jnp.cumsum(take.astype(jnp.int32))  # inclusive
    total = jnp.sum(take.astype(jnp.int32))
    pos = jnp.where(take, rank - 1, total + idx - rank)  # a permutation of 0..nbp-1
    plt.store(o_ref.at[pos], jnp.where(take, idx, -1), mask=pos < width)


def _select_kernel(lim_ref, s_ref, o_ref, *, k: int):
    """One row of :func:`select_top_blocks` (bf16 rows widened exactly, searched over 16-bit keys)."""
    pick_row(s_ref[...].astype(jnp.float32), lim_ref[0], o_ref, k=k, key_bits=search_key_bits(s_ref.dtype))


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


def pooled_block_scores(s_ref, pos, kv_len, *, kernel1, stride1, ratio, n1, num_blocks, init_blocks,
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
    """One (batch, KV head, token) row: :func:`pooled_block_scores`, then :func:`pick_row`."""
    score, lim = pooled_block_scores(s_ref, pos_ref[0], len_ref[pl.program_id(0)], **pool)
    pick_row(score, lim, o_ref, k=k, key_bits=search_key_bits(s_ref.dtype))


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
