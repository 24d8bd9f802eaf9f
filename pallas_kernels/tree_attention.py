"""Tree-verification attention for speculative decoding: a jnp reference and a Pallas kernel with its
signature.

The N tokens of a draft tree are verified in one target forward. Their keys and values were just written
to cache slots ``[P, P + N)`` after the committed prefix of ``P`` tokens (node ``i`` at slot ``P + i``).
Every node sees the whole prefix and, among the tree's own slots, exactly its ancestors and itself
(``tree_mask``); its RoPE position is ``P + depth``, applied before the call.

Signature::

    f(q, k, v, prefix_lengths, tree_mask, *, scale, layer=None, window=None) -> out

q ``[B, N, H, D]``; k, v ``[B, KVH, S, D]`` or the stacked cache ``[L, B, KVH, S, D]`` with ``layer``;
prefix_lengths ``int32[B]``; tree_mask ``bool[B, N, M]`` (``tree_mask[b, i, j]``: query ``i`` sees tree key
``j``, stored at slot ``P_b + j``; M = N when the queries are the tree's own nodes, as in verification;
a draft step has fewer queries than tree keys). Key ``s`` is visible to query ``i`` of row ``b`` iff
``P_b - window <= s < P_b`` (no lower bound without ``window``), or ``0 <= s - P_b < M`` and
``tree_mask[b, i, s - P_b]``. Output in q.dtype; softmax and accumulation in fp32.

Paged signature (:func:`paged_tree_attention`; reference in :mod:`pallas_kernels.paged`)::

    f(q, k_pages, v_pages, page_table, prefix_lengths, tree_mask, tree_slots, *, scale, page_size, layer,
      window=None) -> out

The same semantics, with the prefix keys ``[0, P_b)`` read through the page table of the paged pool
``[L, KVH, N, D]`` (see :mod:`pallas_kernels.attention`) and tree key ``j`` at flat slot ``tree_slots[b] + j``:
a per-row scratch region of at least ``max(16, next_pow2(M))`` slots that does not cross the pool's end.

The kernel is flash-decoding with the rows of a tile being (node, query head of the KV group) pairs: the
prefix is split across programs as in ``decode_attention`` (every key visible, no mask), and one extra
split attends to the tree's own keys under the ancestor mask, passed as two 32-bit words per node (trees
have at most :data:`MAX_TREE_NODES` nodes). The splits are merged by log-sum-exp (one Pallas launch when
they number a power of 2, as by default).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.attention import decode_splits
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
    load_block,
    merge_any_splits,
    page_table_spec,
    paged_length,
    paged_refs,
    split_outputs,
    store_split,
    ungroup_rows,
)
from pallas_kernels.launch import KernelConfig, launch_options, next_power_of_2, tuned_config

MAX_TREE_NODES = 64  # two 32-bit mask words per node


def tree_attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, prefix_lengths: jax.Array, tree_mask: jax.Array, *,
    scale: float, layer: int | None = None, window: int | None = None,
) -> jax.Array:
    """Dense masked attention in plain jnp (reads all S cache slots). Signature: see the module doc."""
    if layer is not None:
        k, v = k[layer], v[layer]
    b, n, h, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    m = tree_mask.shape[2]
    qg = q.reshape(b, n, kvh, h // kvh, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    rel = jnp.arange(s, dtype=jnp.int32)[None, :] - prefix_lengths[:, None]  # [B, S]: tree index of slot
    in_prefix = (rel < 0) if window is None else (rel < 0) & (rel >= -window)
    in_tree = (rel >= 0) & (rel < m)
    ancestor = jnp.take_along_axis(tree_mask, jnp.broadcast_to(jnp.clip(rel, 0, m - 1)[:, None, :], (b, n, s)), axis=2)
    visible = in_prefix[:, None, :] | (in_tree[:, None, :] & ancestor)  # [B, N, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, None, None], probs, 0.0)
    out = attend_values(probs, v)
    return out.reshape(b, n, h, d).astype(q.dtype)


def tree_mask_words(tree_mask: jax.Array) -> jax.Array:
    """``bool[B, N, M]`` (M <= 64) → ``int32[B, N, 2]``: bit ``j % 32`` of word ``j // 32`` is ``mask[.., j]``."""
    b, n, m = tree_mask.shape
    bits = jnp.pad(tree_mask, ((0, 0), (0, 0), (0, MAX_TREE_NODES - m))).reshape(b, n, 2, 32).astype(jnp.uint32)
    words = jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
    return lax.bitcast_convert_type(words, jnp.int32)


def _tree_kernel(*refs, qk_scale, block_k, num_prefix_splits, tree_keys, tree_size, window, page_size=None):
    pages_ref, slots_ref, (len_ref, q_ref, lo_word_ref, hi_word_ref, k_ref, v_ref, o_ref, lse_ref) = paged_refs(
        refs, 2, page_size)
    prefix = len_ref[pl.program_id(0)]
    split = pl.program_id(2)
    q = q_ref[...]
    m_rows = q.shape[0]
    carry = empty_carry(m_rows, q.shape[1])
    # Prefix splits: every key in [lo, prefix) is visible (only the end blocks are masked).
    lo = 0 if window is None else jnp.maximum(prefix - window, 0)
    read = paged_length(prefix, pages_ref, page_size)
    first_block = lo // block_k
    n_blocks = pl.cdiv(read, block_k) - first_block
    per_split = pl.cdiv(n_blocks, num_prefix_splits)
    first = first_block + split * per_split  # past the end for the tree split: an empty loop
    last = jnp.minimum(first + per_split, first_block + n_blocks)
    everything = jnp.full((m_rows,), prefix, jnp.int32)
    tree_row = None if slots_ref is None else slots_ref[pl.program_id(0)]  # read outside the loop below

    def step(j, row, c):
        return attend_block(q, k_ref, v_ref, j * block_k, c, qk_scale=qk_scale, block_k=block_k, pos=everything,
                            kv_len=read, lo=None if window is None else lo, row=row)

    carry = block_loop(first, last, step, carry, block_k=block_k, pages_ref=pages_ref, page_size=page_size)

    # The tree split: the tree's own keys under the ancestor bits, at logical positions [prefix, end).
    # Contiguous: the block starts at the prefix end, clamped into the buffer (keys before the prefix end
    # are masked by `lo`); paged: at the row's scratch slots.
    def tree_step(_, c):
        if pages_ref is None:
            start = jnp.minimum(prefix, k_ref.shape[0] - tree_keys)
            row = start
            end = jnp.minimum(prefix + tree_size, k_ref.shape[0])  # tree keys past the buffer were not stored
        else:
            start, row, end = prefix, tree_row, prefix + tree_size
        idx = start + lax.broadcasted_iota(jnp.int32, (tree_keys,), 0) - prefix  # tree index of each key
        word = jnp.where(idx[None, :] < 32, lo_word_ref[...][:, None], hi_word_ref[...][:, None])
        bit = lax.shift_right_logical(word, jnp.bitwise_and(idx, 31)[None, :]) & 1
        # Tree keys no row sees (a draft step's later nodes) are not read: their slots may hold garbage.
        kv = load_block(k_ref, v_ref, start, block_k=tree_keys, kv_len=end, lo=prefix, row=row,
                        keep=jnp.max(bit, axis=0) != 0)
        return attend_block(q, k_ref, v_ref, start, c, qk_scale=qk_scale, block_k=tree_keys,
                            pos=jnp.full((m_rows,), end, jnp.int32), kv_len=end, lo=prefix, mask=bit != 0, kv=kv)

    store_split(o_ref, lse_ref, lax.fori_loop(0, (split == num_prefix_splits).astype(jnp.int32), tree_step, carry))


def _check_tree(q, tree_mask):
    """Validates the tree mask against q; returns (M, the tree split's power-of-2 key block)."""
    b, n = q.shape[:2]
    m = tree_mask.shape[2]
    if not 1 <= m <= MAX_TREE_NODES:
        raise ValueError(f"tree_attention takes 1..{MAX_TREE_NODES} tree keys, got {m}")
    if tree_mask.shape != (b, n, m):
        raise ValueError(f"tree_mask must be [{b}, {n}, tree keys], got {tree_mask.shape}")
    return m, max(16, next_power_of_2(m))


def tree_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, prefix_lengths: jax.Array, tree_mask: jax.Array, *,
    scale: float, layer: int | None = None, window: int | None = None, config: KernelConfig | None = None,
    num_splits: int | None = None, interpret: bool | None = None,
) -> jax.Array:
    """Tree-verification attention (Pallas). Signature: see the module doc.

    ``num_splits`` overrides how many programs split each prefix (one more attends to the tree keys).
    """
    (k, _), (v, layer) = layer_view(k, layer), layer_view(v, layer)
    b, n = q.shape[:2]
    check_shapes(q, k, v, jnp.zeros((b, n), jnp.int32), prefix_lengths)
    m, tree_keys = _check_tree(q, tree_mask)
    if k.shape[3] < tree_keys:
        raise ValueError(f"tree_attention needs a cache of at least {tree_keys} slots for {m} tree keys, got {k.shape[3]}")
    return _tree_call(q, k, v, None, None, prefix_lengths, tree_mask, scale=scale, layer=layer, window=window,
                      page_size=None, config=config, num_splits=num_splits, interpret=interpret)


def paged_tree_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, prefix_lengths: jax.Array,
    tree_mask: jax.Array, tree_slots: jax.Array, *, scale: float, page_size: int, layer: int,
    window: int | None = None, config: KernelConfig | None = None, num_splits: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """:func:`tree_attention` over the paged pool (the paged signature of the module doc); the prefix splits
    share each row's ``P * page_size`` capacity."""
    check_pool(q, k_pages, v_pages, page_table, page_size, kv_lengths=prefix_lengths)
    _check_tree(q, tree_mask)
    if tree_slots.shape != prefix_lengths.shape:
        raise ValueError(f"tree_slots must be [{q.shape[0]}], got {tree_slots.shape}")
    return _tree_call(q, k_pages, v_pages, page_table, tree_slots, prefix_lengths, tree_mask, scale=scale, layer=layer,
                      window=window, page_size=page_size, config=config, num_splits=num_splits, interpret=interpret)


def _tree_call(q, k, v, page_table, tree_slots, prefix_lengths, tree_mask, *, scale, layer, window, page_size, config,
               num_splits, interpret):
    """The tree launch for the stacked cache (``page_table`` None) or the paged pool."""
    b, n, h, d = q.shape
    m, tree_keys = _check_tree(q, tree_mask)
    paged = page_table is not None
    kvh = k.shape[-3]
    capacity = page_table.shape[1] * page_size if paged else k.shape[-2]
    cfg = config or tuned_config("decode", d)
    qr, _ = group_rows(q, kvh)
    words = tree_mask_words(tree_mask)  # [B, N, 2], the same for every head of a node
    lo_word, _ = group_rows(jnp.broadcast_to(words[:, :, None, 0], (b, n, h)), kvh)
    hi_word, _ = group_rows(jnp.broadcast_to(words[:, :, None, 1], (b, n, h)), kvh)
    rows_pad = qr.shape[2]
    block_m = min(cfg.block_q, rows_pad)
    n_m = rows_pad // block_m
    block_k = min(cfg.block_k, page_size) if paged else key_block(cfg.block_k, capacity)
    # By default the prefix splits and the tree split together are a power of 2, merged in one launch
    # (merge_splits_rows) rather than XLA's passes.
    n_prefix = num_splits or max(1, decode_splits(b, kvh, n_m, capacity, block_k) - 1)
    kernel = functools.partial(_tree_kernel, qk_scale=scale * LOG2E, block_k=block_k, num_prefix_splits=n_prefix,
                               tree_keys=tree_keys, tree_size=m, window=window, page_size=page_size)
    n_split = n_prefix + 1
    out_specs, out_shape = split_outputs(b, kvh, n_split, rows_pad, block_m, d, q.dtype)
    row_spec = pl.BlockSpec((None, None, block_m), lambda i, j, sp, m: (i, j, m))
    lengths_spec = pl.BlockSpec((b,), lambda i, j, sp, m: (0,))
    kv_spec = cache_spec(k.shape, layer, lambda i, j, sp, m: (i, j), paged)
    in_specs = [lengths_spec, pl.BlockSpec((None, None, block_m, d), lambda i, j, sp, m: (i, j, m, 0)), row_spec,
                row_spec, kv_spec, kv_spec]
    args = (prefix_lengths.astype(jnp.int32), qr, lo_word, hi_word, k, v)
    if paged:
        in_specs = [page_table_spec(page_table, lambda i, j, sp, m: i), lengths_spec, *in_specs]
        args = (page_table.astype(jnp.int32), tree_slots.astype(jnp.int32), *args)
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, kvh, n_split, n_m),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        name="minicpm_paged_tree_attention" if paged else "minicpm_tree_attention",
        **launch_options(cfg, interpret),
    )(*args)
    return ungroup_rows(merge_any_splits(o, lse, out_dtype=q.dtype, interpret=interpret), n, h).astype(q.dtype)
