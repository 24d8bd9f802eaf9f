"""The tail of InfLLM-v2's tree verify: every speculative-tree node's attention over its own ancestor path (the
tree's keys it sees: ancestors and itself), merged by log-sum-exp with its attention over other keys (the
prefix's selected blocks, :func:`pallas_kernels.infllm.stage2.block_sparse_attention` with ``return_lse``);
a jnp reference and a Pallas kernel (one launch where XLA ran seven small fusions per layer: the two tree
products, the softmax pieces, a transpose, the stack and the merge).

Shapes: q ``[B, T, H, D]``; tree_k / tree_v ``[B, T, KVH, D]``; tree_mask ``bool[B, T, T]`` (node ``i`` sees
node ``j``; every node sees itself); out_p ``[B, T, H, D]`` and lse_p fp32 ``[B, T, H]`` (natural log, -inf: no
key) the other attention. Query head ``h`` belongs to KV group ``h // (H / KVH)``. Returns ``[B, T, H, D]`` in
q's dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.flash import LOG2E, MASKED, MIN_ROWS, merge_attention
from pallas_kernels.launch import KernelConfig, is_power_of_2, launch_options, next_power_of_2


def tree_merge_attention_reference(q: jax.Array, tree_k: jax.Array, tree_v: jax.Array, tree_mask: jax.Array,
                                   out_p: jax.Array, lse_p: jax.Array, *, scale: float) -> jax.Array:
    """The tree nodes' attention over the keys ``tree_mask`` gives them, merged with ``(out_p, lse_p)``, in
    plain jnp (see the module doc)."""
    b, t, h, d = q.shape
    kvh = tree_k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    s = jnp.einsum("btkgd,bjkd->btkgj", qg, tree_k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(tree_mask[:, :, None, None, :], s, -jnp.inf)
    lse_t = jax.nn.logsumexp(s, axis=-1)  # [B, T, KVH, G]; every node sees itself
    out_t = jnp.einsum("btkgj,bjkd->btkgd", jnp.exp(s - lse_t[..., None]).astype(tree_v.dtype), tree_v,
                       preferred_element_type=jnp.float32)
    out = merge_attention([(out_p, lse_p), (out_t.reshape(b, t, h, d), lse_t.reshape(b, t, h))])
    return out.astype(q.dtype)


def _tree_merge_kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, lse_ref, out_ref, *, qk_scale, t_pad):
    """One (row, node, KV group): the group's heads ``[G, D]`` against the tree's ``T`` keys, read as ``[Tp,
    D]`` (``t_pad`` rows, those past T zero and masked off; the node's mask row ``[Tp]``), then merged with the
    other attention's ``[G, D]`` and log-sum-exp ``[G]``."""
    q = q_ref[...]
    sees = mask_ref[...] != 0
    tokens = k_ref.shape[0]
    node = lax.broadcasted_iota(jnp.int32, (t_pad,), 0)
    at = (jnp.minimum(node, tokens - 1)[:, None], lax.broadcasted_iota(jnp.int32, (1, k_ref.shape[1]), 1))
    k = plt.load(k_ref.at[at], mask=(node < tokens)[:, None], other=0.0)
    v = plt.load(v_ref.at[at], mask=(node < tokens)[:, None], other=0.0)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * qk_scale  # log2 units
    s = jnp.where(sees[None, :], s, MASKED)
    top = jnp.max(s, axis=1)
    p = jnp.where(sees[None, :], jnp.exp2(s - top[:, None]), 0.0)
    total = jnp.sum(p, axis=1)
    out_t = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32) / total[:, None]
    lse_t = top + jnp.log2(total)
    lse_o = lse_ref[...] * LOG2E  # -inf: the other attention saw no key
    high = jnp.maximum(lse_o, lse_t)
    w_o, w_t = jnp.exp2(lse_o - high), jnp.exp2(lse_t - high)
    out = (w_o[:, None] * o_ref[...].astype(jnp.float32) + w_t[:, None] * out_t) / (w_o + w_t)[:, None]
    out_ref[...] = out.astype(out_ref.dtype)


def tree_merge_supported(q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`tree_merge_attention` takes these heads: a power-of-2 group of at least 16 query heads
    per KV head (one tile's rows) and a power-of-2 head_dim of at least 16."""
    group = q_heads // kv_heads
    return is_power_of_2(group) and group >= MIN_ROWS and is_power_of_2(head_dim) and head_dim >= 16


def tree_merge_attention(q: jax.Array, tree_k: jax.Array, tree_v: jax.Array, tree_mask: jax.Array,
                         out_p: jax.Array, lse_p: jax.Array, *, scale: float,
                         interpret: bool | None = None) -> jax.Array:
    """Pallas version of :func:`tree_merge_attention_reference` (same signature), one program per (row, node,
    KV group); the tree's keys are read as ``max(16, next power of 2)`` nodes (those past T masked off). Needs
    :func:`tree_merge_supported` heads."""
    b, t, h, d = q.shape
    kvh = tree_k.shape[2]
    if not tree_merge_supported(h, kvh, d):
        raise ValueError(f"tree_merge_attention needs a power-of-2 group of >= {MIN_ROWS} query heads per KV head "
                         f"and a power-of-2 head_dim >= 16; got {h} heads, {kvh} KV heads, head_dim {d}")
    group = h // kvh
    t_pad = max(MIN_ROWS, next_power_of_2(t))
    # The mask is the same for every layer (XLA computes it once); the keys and values are read as they are
    # (their padding was two launches a layer).
    mask = jnp.pad(tree_mask, ((0, 0), (0, 0), (0, t_pad - t))).astype(jnp.int32)  # padded nodes: unseen
    heads = pl.BlockSpec((None, None, group, d), lambda i, n, j: (i, n, j, 0))
    tree = pl.BlockSpec((None, t, None, d), lambda i, n, j: (i, 0, j, 0))
    return pl.pallas_call(
        functools.partial(_tree_merge_kernel, qk_scale=scale * LOG2E, t_pad=t_pad),
        grid=(b, t, kvh),
        in_specs=[heads, tree, tree, pl.BlockSpec((None, None, t_pad), lambda i, n, j: (i, n, 0)), heads,
                  pl.BlockSpec((None, None, group), lambda i, n, j: (i, n, j))],
        out_specs=heads,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="minicpm_tree_merge_attention",
        **launch_options(KernelConfig(block_q=group, block_k=t_pad, num_warps=4, num_stages=1), interpret),
    )(q, tree_k, tree_v, mask, out_p, lse_p.astype(jnp.float32))
