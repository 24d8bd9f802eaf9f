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
    check_shapes,
    empty_carry,
    group_rows,
    key_block,
    layer_view,
    merge_any_splits,
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


def _tree_kernel(len_ref, q_ref, lo_word_ref, hi_word_ref, k_ref, v_ref, o_ref, lse_ref, *, qk_scale, block_k, num_prefix_splits,
                 tree_keys, tree_size, window):
    prefix = len_ref[pl.program_id(0)]
    split = pl.program_id(2)
    q = q_ref[...]
    m_rows = q.shape[0]
    carry = empty_carry(m_rows, q.shape[1])
    # Prefix splits: every key in [lo, prefix) is visible (only the end blocks are masked).
    lo = 0 if window is None else jnp.maximum(prefix - window, 0)
    first_block = lo // block_k
    n_blocks = pl.cdiv(prefix, block_k) - first_block
    per_split = pl.cdiv(n_blocks, num_prefix_splits)
    first = first_block + split * per_split  # past the end for the tree split: an empty loop
    last = jnp.minimum(first + per_split, first_block + n_blocks)
    everything = jnp.full((m_rows,), prefix, jnp.int32)
    step = functools.partial(attend_block, q, k_ref, v_ref, qk_scale=qk_scale, block_k=block_k, pos=everything,
                             kv_len=prefix, lo=None if window is None else lo)
    carry = lax.fori_loop(first, last, lambda j, c: step(j * block_k, c), carry)

    # The tree split: the tree's own keys under the ancestor bits. The block start is clamped into the
    # buffer (the keys before the prefix end are masked by `lo`).
    def tree_step(_, c):
        start = jnp.minimum(prefix, k_ref.shape[0] - tree_keys)
        idx = start + lax.broadcasted_iota(jnp.int32, (tree_keys,), 0) - prefix  # tree index of each key
        word = jnp.where(idx[None, :] < 32, lo_word_ref[...][:, None], hi_word_ref[...][:, None])
        bit = lax.shift_right_logical(word, jnp.bitwise_and(idx, 31)[None, :]) & 1
        end = jnp.minimum(prefix + tree_size, k_ref.shape[0])  # tree keys past the buffer were not stored
        return attend_block(q, k_ref, v_ref, start, c, qk_scale=qk_scale, block_k=tree_keys,
                             pos=jnp.full((m_rows,), end, jnp.int32), kv_len=end, lo=prefix, mask=bit != 0)

    store_split(o_ref, lse_ref, lax.fori_loop(0, (split == num_prefix_splits).astype(jnp.int32), tree_step, carry))


def tree_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, prefix_lengths: jax.Array, tree_mask: jax.Array, *,
    scale: float, layer: int | None = None, window: int | None = None, config: KernelConfig | None = None,
    num_splits: int | None = None, interpret: bool | None = None,
) -> jax.Array:
    """Tree-verification attention (Pallas). Signature: see the module doc.

    ``num_splits`` overrides how many programs split each prefix (one more attends to the tree keys).
    """
    (k, _), (v, layer) = layer_view(k, layer), layer_view(v, layer)
    b, n, h, d = q.shape
    check_shapes(q, k, v, jnp.zeros((b, n), jnp.int32), prefix_lengths)
    m = tree_mask.shape[2]
    if not 1 <= m <= MAX_TREE_NODES:
        raise ValueError(f"tree_attention takes 1..{MAX_TREE_NODES} tree keys, got {m}")
    if tree_mask.shape != (b, n, m):
        raise ValueError(f"tree_mask must be [{b}, {n}, tree keys], got {tree_mask.shape}")
    kvh, s = k.shape[2], k.shape[3]
    tree_keys = max(16, next_power_of_2(m))
    if s < tree_keys:
        raise ValueError(f"tree_attention needs a cache of at least {tree_keys} slots for {m} tree keys, got {s}")
    cfg = config or tuned_config("decode", d)
    qr, _ = group_rows(q, kvh)
    words = tree_mask_words(tree_mask)  # [B, N, 2], the same for every head of a node
    lo_word, _ = group_rows(jnp.broadcast_to(words[:, :, None, 0], (b, n, h)), kvh)
    hi_word, _ = group_rows(jnp.broadcast_to(words[:, :, None, 1], (b, n, h)), kvh)
    rows_pad = qr.shape[2]
    block_m = min(cfg.block_q, rows_pad)
    n_m = rows_pad // block_m
    block_k = key_block(cfg.block_k, s)
    # By default the prefix splits and the tree split together are a power of 2, merged in one launch
    # (merge_splits_rows) rather than XLA's passes.
    n_prefix = num_splits or max(1, decode_splits(b, kvh, n_m, s, block_k) - 1)
    kernel = functools.partial(_tree_kernel, qk_scale=scale * LOG2E, block_k=block_k, num_prefix_splits=n_prefix,
                               tree_keys=tree_keys, tree_size=m, window=window)
    n_split = n_prefix + 1
    out_specs, out_shape = split_outputs(b, kvh, n_split, rows_pad, block_m, d, q.dtype)
    row_spec = pl.BlockSpec((None, None, block_m), lambda i, j, sp, m: (i, j, m))
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, kvh, n_split, n_m),
        in_specs=[
            pl.BlockSpec((b,), lambda i, j, sp, m: (0,)),
            pl.BlockSpec((None, None, block_m, d), lambda i, j, sp, m: (i, j, m, 0)),
            row_spec,
            row_spec,
            pl.BlockSpec((None, None, None, s, d), lambda i, j, sp, m: (layer, i, j, 0, 0)),
            pl.BlockSpec((None, None, None, s, d), lambda i, j, sp, m: (layer, i, j, 0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        name="minicpm_tree_attention",
        **launch_options(cfg, interpret),
    )(prefix_lengths.astype(jnp.int32), qr, lo_word, hi_word, k, v)
    return ungroup_rows(merge_any_splits(o, lse, out_dtype=q.dtype, interpret=interpret), n, h).astype(q.dtype)
