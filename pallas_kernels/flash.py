"""Pieces shared by every attention kernel: the online-softmax step, its start and end, cache views, row
tiling of query-head groups, and the log-sum-exp merge of per-split results (in jnp and as one launch).

The kernels read either a contiguous cache (``[L, B, KVH, S, D]``: row ``b``'s key ``s`` at slot ``s``) or
a paged pool (``[L, KVH, N, D]``, ``N = num_pages * page_size`` flat slots; key ``s`` of row ``b`` at slot
``page_table[b, s // page_size] * page_size + s % page_size``). One kernel body serves both: masks work on
logical key positions, and only the buffer row a key block is loaded from goes through the page table
(:func:`page_row`; key blocks never cross a page). A paged kernel's extra refs come first among its
inputs (:func:`paged_refs`).

The online softmax works in log2 units (scores scaled by ``LOG2E``, ``exp2``), with a finite ``MASKED``
score so a fully masked row never computes ``inf - inf``. A split's result is ``(o, lse)``: ``o``
normalised within the split, ``lse`` the log2-sum-exp of its scores (-inf when it saw no key).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.launch import KernelConfig, is_power_of_2, launch_options, next_power_of_2, tuned_config

LOG2E = math.log2(math.e)
MASKED = -1e30  # finite, so fully masked rows never produce inf - inf
# Row tiles are at least this tall (Triton's dot needs M >= 16).
MIN_ROWS = 16


def layer_view(k: jax.Array, layer: int | None) -> tuple[jax.Array, int]:
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


def check_shapes(q, k, v, q_positions, kv_lengths):
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


def key_block(block_k: int, cache_length: int) -> int:
    """The configured key block, shrunk to a power of 2 that fits in the cache (blocks are sliced from it)."""
    return min(block_k, 1 << (cache_length.bit_length() - 1))


def check_pool(q, k_pages, v_pages, page_table, page_size: int, q_positions=None, kv_lengths=None):
    """Validates q ``[B, T, H, D]`` against the paged pool ``[L, KVH, N, D]`` and its page table ``int32[B,
    P]`` (and the positions ``[B, T]`` / lengths ``[B]`` when given)."""
    b, t, h, d = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.shape[3] != d or h % k_pages.shape[1]:
        raise ValueError(f"incompatible q {q.shape} and paged k/v {k_pages.shape}/{v_pages.shape} "
                         "(the pool is [layers, kv_heads, num_pages * page_size, head_dim])")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table must be [{b}, pages per sequence], got {page_table.shape}")
    if not (is_power_of_2(page_size) and page_size >= 16 and k_pages.shape[2] % page_size == 0):
        raise ValueError(f"page_size must be a power of 2 >= 16 dividing the pool's {k_pages.shape[2]} slots, "
                         f"got {page_size}")
    if (q_positions is not None and q_positions.shape != (b, t)) or (kv_lengths is not None and kv_lengths.shape != (b,)):
        raise ValueError(f"q_positions must be [{b}, {t}] and lengths [{b}], got {q_positions.shape}, {kv_lengths.shape}")
    if not kernels_support(d):
        raise ValueError(f"the Pallas attention kernels need a power-of-2 head_dim >= 16, got {d}")


def cache_spec(cache_shape: tuple[int, ...], layer: int, row_head, paged: bool) -> pl.BlockSpec:
    """BlockSpec of the keys (or values) a program reads: row ``b``'s KV head ``g`` ``[S, D]`` of the stacked
    cache ``[L, B, KVH, S, D]``, or KV head ``g``'s ``[N, D]`` of the paged pool ``[L, KVH, N, D]`` (all
    rows' pages; the page table picks them). ``row_head(*grid indices) -> (b, g)``.

    Offsets: the kernels' own indices stay below ``N`` rows (int32 is plenty); Pallas-Triton adds the
    block's start and multiplies by the strides in 64 bits whenever the whole array exceeds 4 GiB
    (``_compute_offsets_from_indices``, since jax 0.4.32), so a bf16/fp32 pool past 2**31 elements is
    addressed correctly (``tests/kernels/test_gpu_paged_attention.py`` reads one of 3.3e9 elements)."""
    s, d = cache_shape[-2:]
    if paged:
        return pl.BlockSpec((None, None, s, d), lambda *g: (layer, row_head(*g)[1], 0, 0))
    return pl.BlockSpec((None, None, None, s, d), lambda *g: (layer, *row_head(*g), 0, 0))


def page_table_spec(page_table: jax.Array, row) -> pl.BlockSpec:
    """BlockSpec of row ``row(*grid indices)``'s page table ``[P]`` (read one scalar at a time, so P need
    not be a power of 2)."""
    return pl.BlockSpec((None, page_table.shape[1]), lambda *g: (row(*g), 0))


def paged_refs(refs, count: int, page_size: int | None):
    """Splits a kernel's refs into its ``count`` paged-only refs (None each for a contiguous cache, which
    has none) and the rest."""
    if page_size is None:
        return (None,) * count + (refs,)
    return (*refs[:count], refs[count:])


def page_row(pages_ref, start, page_size: int | None):
    """The buffer row holding logical key ``start`` (the first of a block that does not cross a page):
    ``start`` itself for a contiguous cache, else looked up in the row's page table ``pages_ref [P]``
    (its index clamped into the table: :func:`block_loop` looks one block past the last)."""
    if pages_ref is None:
        return start
    # Shifts and masks (page_size is a power of 2): jnp's floor division and remainder lower to signed
    # fix-ups, and Pallas-Triton's lowering of the remainder rejects them.
    index = jnp.minimum(lax.shift_right_logical(start, page_size.bit_length() - 1), pages_ref.shape[0] - 1)
    return pages_ref[index] * page_size + jnp.bitwise_and(start, page_size - 1)


def block_loop(lo, hi, body, carry, *, block_k: int, pages_ref=None, page_size: int | None = None):
    """``lax.fori_loop`` over key blocks ``j`` in ``[lo, hi)`` of ``block_k`` keys: ``carry = body(j, row,
    carry)``, ``row`` the buffer row of the block's first key (:func:`page_row`).

    Paged, the next block's page-table entry is loaded one iteration ahead and carried: looked up in the
    iteration that uses it, the scalar load stalls the block's K/V loads, which Triton cannot issue early
    (decode at 32K context, batch 8, MiniCPM4-8B heads, on an H200: 94 µs that way, 66 µs prefetched,
    63 µs for the contiguous cache)."""
    if pages_ref is None:
        return lax.fori_loop(lo, hi, lambda j, c: body(j, j * block_k, c), carry)

    def step(j, state):
        c, row = state
        upcoming = page_row(pages_ref, (j + 1) * block_k, page_size)  # issued before this block's loads
        return body(j, row, c), upcoming

    return lax.fori_loop(lo, hi, step, (carry, page_row(pages_ref, lo * block_k, page_size)))[0]


def gather_rows(ref, rows: jax.Array) -> jax.Array:
    """``ref[rows]`` for a ``[N, D]`` ref and ``int32[n]`` row indices: ``[n, D]``, one pointer per element
    (both indexers arrays: Pallas' interpret mode takes no mix of array and slice indexers)."""
    cols = lax.broadcasted_iota(jnp.int32, (1, ref.shape[-1]), 1)
    return plt.load(ref.at[rows[:, None], cols])


def paged_length(length, pages_ref, page_size: int | None):
    """A row's key count, capped at its page table's capacity when paged (a longer length would index the
    page table past its end; the references see only ``P * page_size`` keys too)."""
    if pages_ref is None:
        return length
    return jnp.minimum(length, pages_ref.shape[0] * page_size)


def load_block(k_ref, v_ref, start, *, block_k, kv_len=None, lo=None, row=None, keep=None):
    """Keys and values ``[start, start + block_k)``: ``(k, v)``, unmasked if ``kv_len`` is None, else only
    the rows below ``kv_len`` (and at or above ``lo`` if given, and where ``keep bool[block_k]`` if given)
    read, the others 0. ``row``: the buffer row of key ``start`` when it is not ``start`` (paged pools)."""
    rows = pl.ds(start if row is None else row, block_k)
    if kv_len is None:
        return k_ref[rows, :], v_ref[rows, :]
    key = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    in_range = key < kv_len
    if lo is not None:
        in_range = in_range & (key >= lo)
    if keep is not None:
        in_range = in_range & keep
    return (plt.load(k_ref.at[rows, :], mask=in_range[:, None], other=0.0),
            plt.load(v_ref.at[rows, :], mask=in_range[:, None], other=0.0))


def empty_carry(rows: int, d: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The online-softmax carry of :func:`attend_block` before any key: (acc 0, max ``MASKED``, sum 0)."""
    return jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32)


def store_split(o_ref, lse_ref, carry):
    """Writes a finished carry: o = acc / sum (0 for a row that saw no key) and its log2-sum-exp (-inf then)."""
    acc, m, l = carry
    empty = l == 0.0
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


def attend_block(q, k_ref, v_ref, start, carry, *, qk_scale, block_k, pos=None, kv_len=None, lo=None, mask=None,
                  kv=None, row=None):
    """One online-softmax step over keys ``[start, start + block_k)``; masked iff ``pos`` is given (keys
    past ``pos`` per row, at or past ``kv_len``, below ``lo`` if given, and where ``mask bool[M, block_k]``
    is False if given, are invisible). ``kv``: that block's ``(k, v)`` already loaded by
    :func:`load_block` with the same ``kv_len`` and ``lo`` (to issue several blocks' loads first).
    ``row``: the buffer row holding key ``start`` (:func:`page_row`; default ``start``).

    q ``[M, D]``; carry = (acc fp32 ``[M, D]``, running max ``[M]`` (log2 units), running sum ``[M]``).
    """
    acc, m, l = carry
    if kv is None:
        kv = load_block(k_ref, v_ref, start, block_k=block_k, kv_len=None if pos is None else kv_len, lo=lo, row=row)
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
        s = jnp.where(visible, s, MASKED)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp2(s - m_new[:, None])
    if pos is not None:
        p = jnp.where(visible, p, 0.0)
    alpha = jnp.exp2(m - m_new)
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
    return acc, m_new, l


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


def attend_values(probs: jax.Array, v: jax.Array) -> jax.Array:
    """The jnp references' ``probs [B, KVH, G, T, S] @ v [B, KVH, S, D]`` → fp32 ``[B, T, KVH, G, D]``.

    The product is taken in ``[B, KVH, G, T, D]`` order and transposed after: asked for the ``[B, T, KVH,
    G, D]`` output directly, XLA's CPU runtime rejects a bf16 x bf16 = f32 dot with two batch dimensions
    of size > 1 (``Unsupported element type for DotThunk``: every bf16 batch of 2+ on CPU)."""
    out = jnp.einsum("bkgts,bksd->bkgtd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.transpose(0, 3, 1, 2, 4)


def prefill_tiles(q, k, v, q_positions, kv_lengths, *, layer: int | None, config: KernelConfig | None):
    """The common start of the kernels on the prefill grid (batch, query head, query block): the stacked
    caches and the layer to read (:func:`layer_view`), checked shapes, the launch config (default: the tuned
    prefill entry for the head_dim), and q / positions padded to whole query blocks
    (:func:`pad_query_blocks`). Returns (k, v, layer, config, q, q_positions, block_q)."""
    (k, _), (v, layer) = layer_view(k, layer), layer_view(v, layer)
    check_shapes(q, k, v, q_positions, kv_lengths)
    cfg = config or tuned_config("prefill", q.shape[3])
    q, q_positions, block_q = pad_query_blocks(q, q_positions, cfg.block_q)
    return k, v, layer, cfg, q, q_positions, block_q


def group_rows(x: jax.Array, kv_heads: int) -> tuple[jax.Array, int]:
    """``[B, T, H, ...]`` → ``[B, KVH, R_pad, ...]``: the rows of each KV group, token major and query head
    minor (R = T·H/KVH), zero-padded to a power of 2 ≥ 16 (Triton's smallest dot). Returns (rows, R)."""
    b, t, h = x.shape[:3]
    group = h // kv_heads
    rows = t * group
    out = x.reshape(b, t, kv_heads, group, *x.shape[3:]).swapaxes(1, 2).reshape(b, kv_heads, rows, *x.shape[3:])
    pad = max(MIN_ROWS, next_power_of_2(rows)) - rows
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


def group_tiles(q: jax.Array, kv_heads: int, rows: int) -> jax.Array:
    """``[B, T, H, D]`` → ``[B, T, KVH * rows, D]``: each KV group's query heads padded to ``rows`` (a view
    when the group already has ``rows`` heads)."""
    b, t, h, d = q.shape
    group = h // kv_heads
    if group == rows:
        return q
    qg = jnp.pad(q.reshape(b, t, kv_heads, group, d), ((0, 0), (0, 0), (0, 0), (0, rows - group), (0, 0)))
    return qg.reshape(b, t, kv_heads * rows, d)


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


def merge_attention(parts: list[tuple[jax.Array, jax.Array]]) -> jax.Array:
    """Attention over disjoint key sets, each ``(out [..., M, D], lse fp32 [..., M])`` (natural log; -inf =
    no key), combined into attention over their union (:func:`merge_splits` over the parts). fp32."""
    o = jnp.stack([o for o, _ in parts], axis=-3)
    lse = jnp.stack([lse for _, lse in parts], axis=-2) * LOG2E
    return merge_splits(o, lse)
