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
* :func:`merge_splits` / :func:`merge_splits_rows` — the log-sum-exp merge of per-split results, in jnp
  and as one Pallas launch (:func:`merge_any_splits` picks the launch for power-of-2 split counts).

Shared signature::

    f(q, k, v, q_positions, kv_lengths, *, scale, layer=None) -> out

q ``[B, T, H, D]``; k, v ``[B, KVH, S, D]``, or the stacked cache ``[L, B, KVH, S, D]`` with ``layer``
naming the slice to read (kernels then read it in place; slicing outside would copy the layer).
Query head ``h`` reads KV head ``h // (H / KVH)``. Key ``s`` is visible to query ``t`` of row ``b`` iff
``s <= q_positions[b, t]`` and ``s < kv_lengths[b]``; a query that sees no key gets zeros. Output in
q.dtype; scores, softmax and accumulation in fp32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.backend import (
    KernelConfig,
    is_power_of_2,
    launch_options,
    next_power_of_2,
    num_cores,
    tuned_config,
)

_LOG2E = math.log2(math.e)
_MASKED = -1e30  # finite, so fully masked rows never produce inf - inf

# Row tiles of the decode kernel are at least this tall (Triton's dot needs M >= 16).
_MIN_DECODE_ROWS = 16
# The decode kernel takes up to this many query tokens per sequence (tree verification sizes above it
# belong to the prefill kernel).
MAX_DECODE_QUERIES = 16
# A decode split covers at least this many keys, so short contexts do not pay for many empty programs.
_MIN_SPLIT_KEYS = 64


def _layer_view(k: jax.Array, layer: int | None) -> tuple[jax.Array, int]:
    """(stacked ``[L, B, KVH, S, D]`` array, layer index) for a per-layer or stacked cache."""
    if layer is None:
        if k.ndim != 4:
            raise ValueError(f"k/v must be [B, KVH, S, D] without `layer`, got shape {k.shape}")
        return k[None], 0
    if k.ndim != 5:
        raise ValueError(f"k/v must be the stacked [L, B, KVH, S, D] cache with `layer`, got shape {k.shape}")
    return k, layer


def kernels_support(head_dim: int) -> bool:
    """Whether the kernels take this head_dim (a power of 2, at least 16: Triton's dot minimum)."""
    return is_power_of_2(head_dim) and head_dim >= 16


def _check_shapes(q, k, v, q_positions, kv_lengths):
    """Validates q against the stacked ``[L, B, KVH, S, D]`` k and v."""
    b, t, h, d = q.shape
    if k.shape != v.shape or k.shape[1] != b or k.shape[4] != d or h % k.shape[2]:
        raise ValueError(f"incompatible q {q.shape} and k/v {k.shape}/{v.shape}")
    if q_positions.shape != (b, t) or kv_lengths.shape != (b,):
        raise ValueError(f"q_positions must be [{b}, {t}] and kv_lengths [{b}], got {q_positions.shape}, {kv_lengths.shape}")
    if not kernels_support(d):
        raise ValueError(f"the Pallas attention kernels need a power-of-2 head_dim >= 16, got {d}")
    if k.shape[3] < 16:
        raise ValueError(f"the Pallas attention kernels need a cache of at least 16 slots, got {k.shape[3]}")


def _key_block(block_k: int, cache_length: int) -> int:
    """The configured key block, shrunk to a power of 2 that fits in the cache (blocks are sliced from it)."""
    return min(block_k, 1 << (cache_length.bit_length() - 1))


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
    out = jnp.einsum("bkgts,bksd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


def _load_block(k_ref, v_ref, start, *, block_k, kv_len=None, lo=None):
    """Keys and values ``[start, start + block_k)``: ``(k, v)``, unmasked if ``kv_len`` is None, else only
    the rows below ``kv_len`` (and at or above ``lo`` if given) read, the others 0."""
    rows = pl.ds(start, block_k)
    if kv_len is None:
        return k_ref[rows, :], v_ref[rows, :]
    key = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    in_range = key < kv_len
    if lo is not None:
        in_range = in_range & (key >= lo)
    return (plt.load(k_ref.at[rows, :], mask=in_range[:, None], other=0.0),
            plt.load(v_ref.at[rows, :], mask=in_range[:, None], other=0.0))


def _empty_carry(rows: int, d: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The online-softmax carry of :func:`_attend_block` before any key: (acc 0, max ``_MASKED``, sum 0)."""
    return jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32)


def _store_split(o_ref, lse_ref, carry):
    """Writes a finished carry: o = acc / sum (0 for a row that saw no key) and its log2-sum-exp (-inf then)."""
    acc, m, l = carry
    empty = l == 0.0
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


def _attend_block(q, k_ref, v_ref, start, carry, *, qk_scale, block_k, pos=None, kv_len=None, lo=None, mask=None,
                  kv=None):
    """One online-softmax step over keys ``[start, start + block_k)``; masked iff ``pos`` is given (keys
    past ``pos`` per row, at or past ``kv_len``, below ``lo`` if given, and where ``mask bool[M, block_k]``
    is False if given, are invisible). ``kv``: that block's ``(k, v)`` already loaded by
    :func:`_load_block` with the same ``kv_len`` and ``lo`` (to issue several blocks' loads first).

    q ``[M, D]``; carry = (acc fp32 ``[M, D]``, running max ``[M]`` (log2 units), running sum ``[M]``).
    """
    acc, m, l = carry
    if kv is None:
        kv = _load_block(k_ref, v_ref, start, block_k=block_k, kv_len=None if pos is None else kv_len, lo=lo)
    k, v = kv
    if pos is not None:
        key = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        in_range = key < kv_len
        if lo is not None:
            in_range = in_range & (key >= lo)
    # fp32 inputs get full-precision dots (Triton would use TF32); bf16 runs on the tensor cores as is.
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
    s = s * qk_scale
    if pos is not None:
        visible = (key[None, :] <= pos[:, None]) & in_range[None, :]
        if mask is not None:
            visible = visible & mask
        s = jnp.where(visible, s, _MASKED)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp2(s - m_new[:, None])
    if pos is not None:
        p = jnp.where(visible, p, 0.0)
    alpha = jnp.exp2(m - m_new)
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
    return acc, m_new, l


# ----------------------------------------------------------------------------------------------- prefill


def _prefill_kernel(len_ref, q_ref, pos_ref, k_ref, v_ref, o_ref, *, qk_scale, block_k):
    kv_len = len_ref[pl.program_id(0)]
    q = q_ref[...]
    pos = pos_ref[...]
    # Keys [0, lo) are visible to every row of the block; keys [lo, hi) to some rows.
    lo = jnp.clip(jnp.min(pos) + 1, 0, kv_len)
    hi = jnp.clip(jnp.max(pos) + 1, 0, kv_len)
    n_full = lo // block_k
    n_all = pl.cdiv(hi, block_k)
    carry = _empty_carry(q.shape[0], q.shape[1])
    step = functools.partial(_attend_block, q, k_ref, v_ref, qk_scale=qk_scale, block_k=block_k)
    carry = lax.fori_loop(0, n_full, lambda j, c: step(j * block_k, c), carry)
    carry = lax.fori_loop(n_full, n_all, lambda j, c: step(j * block_k, c, pos=pos, kv_len=kv_len), carry)
    acc, _, l = carry
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


def pad_query_blocks(q: jax.Array, q_positions: jax.Array, block_q: int) -> tuple[jax.Array, jax.Array, int]:
    """Pads the ``T`` query tokens of ``q [B, T, H, D]`` to a multiple of the query block (``block_q``,
    shrunk to a power of 2 >= 16 that covers short chunks). Pad rows repeat the last position (keeping a
    block's min/max) and are dropped by the caller. Returns (q, q_positions, query block)."""
    t = q.shape[1]
    block_q = min(block_q, max(16, next_power_of_2(t)))
    t_pad = pl.cdiv(t, block_q) * block_q
    if t_pad != t:
        q = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
        q_positions = jnp.pad(q_positions, ((0, 0), (0, t_pad - t)), mode="edge")
    return q, q_positions, block_q


def prefill_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *,
    scale: float, layer: int | None = None, config: KernelConfig | None = None, interpret: bool | None = None,
) -> jax.Array:
    """Causal flash attention of a query chunk against the cache (Pallas). Signature: see the module doc.

    ``config`` overrides the measured launch table; ``interpret`` forces interpret mode (default: on
    unless running on a GPU).
    """
    (k, _), (v, layer) = _layer_view(k, layer), _layer_view(v, layer)
    _check_shapes(q, k, v, q_positions, kv_lengths)
    b, t, h, d = q.shape
    kvh, s = k.shape[2], k.shape[3]
    group = h // kvh
    cfg = config or tuned_config("prefill", d)
    q, q_positions, block_q = pad_query_blocks(q, q_positions, cfg.block_q)
    t_pad = q.shape[1]
    n_q = t_pad // block_q
    kernel = functools.partial(_prefill_kernel, qk_scale=scale * _LOG2E, block_k=_key_block(cfg.block_k, s))
    # Query blocks run last-first: the longest causal rows start first and the tail balances the grid.
    out = pl.pallas_call(
        kernel,
        grid=(b, h, n_q),
        in_specs=[
            pl.BlockSpec((b,), lambda i, j, n: (0,)),
            pl.BlockSpec((None, block_q, None, d), lambda i, j, n: (i, n_q - 1 - n, j, 0)),
            pl.BlockSpec((None, block_q), lambda i, j, n: (i, n_q - 1 - n)),
            pl.BlockSpec((None, None, None, s, d), lambda i, j, n: (layer, i, j // group, 0, 0)),
            pl.BlockSpec((None, None, None, s, d), lambda i, j, n: (layer, i, j // group, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_q, None, d), lambda i, j, n: (i, n_q - 1 - n, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, t_pad, h, d), q.dtype),
        name="minicpm_prefill_attention",
        **launch_options(cfg, interpret),
    )(kv_lengths.astype(jnp.int32), q, q_positions.astype(jnp.int32), k, v)
    return out[:, :t] if t_pad != t else out


# ------------------------------------------------------------------------------------------------ decode


def _decode_kernel(len_ref, q_ref, pos_ref, k_ref, v_ref, o_ref, lse_ref, *, qk_scale, block_k, num_splits):
    kv_len = len_ref[pl.program_id(0)]
    split = pl.program_id(2)
    q = q_ref[...]
    pos = pos_ref[...]
    hi = jnp.clip(jnp.max(pos) + 1, 0, kv_len)
    n_blocks = pl.cdiv(hi, block_k)
    per_split = pl.cdiv(n_blocks, num_splits)
    first = split * per_split
    last = jnp.minimum(first + per_split, n_blocks)
    carry = _empty_carry(q.shape[0], q.shape[1])
    step = functools.partial(_attend_block, q, k_ref, v_ref, qk_scale=qk_scale, block_k=block_k, pos=pos, kv_len=kv_len)
    _store_split(o_ref, lse_ref, lax.fori_loop(first, last, lambda j, c: step(j * block_k, c), carry))


def group_rows(x: jax.Array, kv_heads: int) -> tuple[jax.Array, int]:
    """``[B, T, H, ...]`` → ``[B, KVH, R_pad, ...]``: the rows of each KV group, token major and query head
    minor (R = T·H/KVH), zero-padded to a power of 2 ≥ 16 (Triton's smallest dot). Returns (rows, R)."""
    b, t, h = x.shape[:3]
    group = h // kv_heads
    rows = t * group
    out = x.reshape(b, t, kv_heads, group, *x.shape[3:]).swapaxes(1, 2).reshape(b, kv_heads, rows, *x.shape[3:])
    pad = max(_MIN_DECODE_ROWS, next_power_of_2(rows)) - rows
    return (jnp.pad(out, ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 3)) if pad else out), rows


def ungroup_rows(out: jax.Array, t: int, h: int) -> jax.Array:
    """Inverse of :func:`group_rows` for ``[B, KVH, R_pad, D]`` → ``[B, T, H, D]``."""
    b, kvh, _, d = out.shape
    group = h // kvh
    return out[:, :, : t * group].reshape(b, kvh, t, group, d).swapaxes(1, 2).reshape(b, t, h, d)


def split_outputs(b: int, kv_heads: int, splits: int, rows_pad: int, block_m: int, d: int, dtype):
    """``pallas_call`` out_specs and out_shape of flash-decoding kernels on grid (batch, KV head, split,
    row block): per split o ``[B, KVH, NS, R, D]`` (bf16 for bf16 inputs, else fp32) and lse fp32
    ``[B, KVH, NS, R]``."""
    specs = [pl.BlockSpec((None, None, None, block_m, d), lambda i, j, sp, m: (i, j, sp, m, 0)),
             pl.BlockSpec((None, None, None, block_m), lambda i, j, sp, m: (i, j, sp, m))]
    shapes = [jax.ShapeDtypeStruct((b, kv_heads, splits, rows_pad, d), jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32),
              jax.ShapeDtypeStruct((b, kv_heads, splits, rows_pad), jnp.float32)]
    return specs, shapes


def decode_splits(batch: int, kv_heads: int, row_blocks: int, max_length: int, block_k: int) -> int:
    """How many programs share one sequence's keys: about enough to give every SM two programs, but no
    split shorter than ``max(_MIN_SPLIT_KEYS, block_k)`` keys of the buffer; a power of 2."""
    by_length = pl.cdiv(max_length, max(_MIN_SPLIT_KEYS, block_k))
    by_occupancy = pl.cdiv(2 * num_cores(), batch * kv_heads * row_blocks)
    n = max(1, min(by_length, by_occupancy))
    # The power of 2 nearest to n (not above by_length), so the splits merge in one Pallas launch
    # (merge_splits_rows) instead of XLA's passes: 128 rather than 132 programs per KV head on an H100.
    p = next_power_of_2(n)
    return p // 2 if p > by_length or p - n > n - p // 2 else p


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
    (k, _), (v, layer) = _layer_view(k, layer), _layer_view(v, layer)
    _check_shapes(q, k, v, q_positions, kv_lengths)
    b, t, h, d = q.shape
    if t > MAX_DECODE_QUERIES:
        raise ValueError(f"decode_attention takes at most {MAX_DECODE_QUERIES} query tokens, got {t}")
    kvh, s = k.shape[2], k.shape[3]
    cfg = config or tuned_config("decode", d)
    qr, _ = group_rows(q, kvh)
    row_pos, _ = group_rows(jnp.broadcast_to(q_positions.astype(jnp.int32)[:, :, None], (b, t, h)), kvh)
    rows_pad = qr.shape[2]
    block_m = min(cfg.block_q, rows_pad)
    n_m = rows_pad // block_m
    block_k = _key_block(cfg.block_k, s)
    n_split = num_splits or decode_splits(b, kvh, n_m, s, block_k)
    kernel = functools.partial(_decode_kernel, qk_scale=scale * _LOG2E, block_k=block_k, num_splits=n_split)
    out_specs, out_shape = split_outputs(b, kvh, n_split, rows_pad, block_m, d, q.dtype)
    return pl.pallas_call(
        kernel,
        grid=(b, kvh, n_split, n_m),
        in_specs=[
            pl.BlockSpec((b,), lambda i, j, sp, m: (0,)),
            pl.BlockSpec((None, None, block_m, d), lambda i, j, sp, m: (i, j, m, 0)),
            pl.BlockSpec((None, None, block_m), lambda i, j, sp, m: (i, j, m)),
            pl.BlockSpec((None, None, None, s, d), lambda i, j, sp, m: (layer, i, j, 0, 0)),
            pl.BlockSpec((None, None, None, s, d), lambda i, j, sp, m: (layer, i, j, 0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        name="minicpm_decode_attention",
        **launch_options(cfg, interpret),
    )(kv_lengths.astype(jnp.int32), qr, row_pos, k, v)


def merge_splits(o: jax.Array, lse: jax.Array) -> jax.Array:
    """Combines per-split results: o ``[..., NS, M, D]`` (each normalised over its split) and lse fp32
    ``[..., NS, M]`` (log2-sum-exp of its scores, -inf for an empty split) → ``[..., M, D]`` fp32.

    The split weights are a softmax of lse over the splits (computed on the small lse array), so the
    pass over o is a single weighted sum."""
    top = jnp.max(lse, axis=-2, keepdims=True)
    weight = jnp.exp2(lse - jnp.where(jnp.isneginf(top), 0.0, top))  # empty splits: exp2(-inf) = 0
    total = jnp.sum(weight, axis=-2, keepdims=True)
    weight = weight / jnp.where(total == 0.0, 1.0, total)
    return jnp.sum(weight[..., None] * o.astype(jnp.float32), axis=-3)


def _merge_rows_kernel(o_ref, lse_ref, out_ref):
    lse = lse_ref[...]  # [S]
    top = jnp.max(lse)
    weight = jnp.exp2(lse - jnp.where(top == -jnp.inf, 0.0, top))
    total = jnp.sum(weight)
    weight = weight / jnp.where(total == 0.0, 1.0, total)
    out_ref[...] = jnp.sum(weight[:, None] * o_ref[...].astype(jnp.float32), axis=0).astype(out_ref.dtype)


def merge_any_splits(o: jax.Array, lse: jax.Array, *, out_dtype, interpret: bool | None = None) -> jax.Array:
    """:func:`merge_splits` in ``out_dtype``: one Pallas launch (:func:`merge_splits_rows`) when the split
    count is a power of 2, as the default counts are; XLA's passes otherwise."""
    if is_power_of_2(o.shape[-3]):
        return merge_splits_rows(o, lse, out_dtype=out_dtype, interpret=interpret)
    return merge_splits(o, lse).astype(out_dtype)


def merge_splits_rows(o: jax.Array, lse: jax.Array, *, out_dtype=jnp.float32, interpret: bool | None = None) -> jax.Array:
    """Pallas version of :func:`merge_splits` (same arguments; the split count NS a power of 2), in one
    launch with one program per row, where XLA runs three passes: ``[..., M, D]`` in ``out_dtype``."""
    *lead, ns, m, d = o.shape
    if not is_power_of_2(ns):
        raise ValueError(f"merge_splits_rows needs a power-of-2 split count, got {ns}")
    p = math.prod(lead)
    out = pl.pallas_call(
        _merge_rows_kernel,
        grid=(p, m),
        in_specs=[pl.BlockSpec((None, ns, None, d), lambda i, r: (i, 0, r, 0)),
                  pl.BlockSpec((None, ns, None), lambda i, r: (i, 0, r))],
        out_specs=pl.BlockSpec((None, None, d), lambda i, r: (i, r, 0)),
        out_shape=jax.ShapeDtypeStruct((p, m, d), out_dtype),
        name="minicpm_merge_splits",
        **launch_options(KernelConfig(block_q=1, block_k=ns, num_warps=4, num_stages=1), interpret),
    )(o.reshape(p, ns, m, d), lse.reshape(p, ns, m))
    return out.reshape(*lead, m, d)
