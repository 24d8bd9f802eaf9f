"""InfLLM-v2 sparse attention of one layer: for plain tokens (prefill chunks, decode steps) and for the
nodes of a speculative tree, each node as plain sparse decoding of its ancestor path would attend.

Per query and KV group: stage 1 scores the fine compressed keys ``K1`` against the log-sum-exp over the
coarse ones ``K2``, causally by whole windows; blocks of ``block_size`` tokens are max-pooled from those
scores, the init blocks and the local window forced in, the ``topk + window_size/block_size`` best
attended (stage 2), causally. The kernel backend decides how (:mod:`pallas_kernels.xla`,
:mod:`pallas_kernels.triton`); ``docs/infllm_v2.md`` has the formulas and the deviations from HF.
"""

from __future__ import annotations

from types import ModuleType

import jax
import jax.numpy as jnp
from jax import lax

from minicpm_jax.config import SparseConfig
from minicpm_jax.infllm.policy import geometry
from minicpm_jax.model.cache import KVCache
from minicpm_jax.model.paged_cache import PagedKVCache
from pallas_kernels.infllm.common import compressed_count


def sparse_attention(
    q: jax.Array, q_select: jax.Array, cache: KVCache | PagedKVCache, layer: int, q_positions: jax.Array,
    kv_lengths: jax.Array,
    sparse: SparseConfig, *, scale: float, kernels: ModuleType,
) -> jax.Array:
    """InfLLM-v2 attention of ``q [B, T, H, D]`` (post-RoPE) over ``layer`` of the cache: stage-1 scores of
    ``q_select`` (``q``, or pre-RoPE q with ``use_nope``) against K1/K2, block selection, block-sparse
    attention. kernels: the backend namespace. Returns ``[B, T, H, D]``."""
    return cache.attend_sparse(layer, q, q_select, q_positions, kv_lengths, geometry(sparse), kernels, scale=scale)


def tree_sparse_attention(
    q: jax.Array, q_select: jax.Array, tree_k: jax.Array, tree_v: jax.Array, tree_mask: jax.Array,
    cache: KVCache | PagedKVCache,
    layer: int, prefix: jax.Array, depths: jax.Array, sparse: SparseConfig, *, scale: float, kernels: ModuleType,
    unrotate=None,
) -> jax.Array:
    """InfLLM-v2 attention of speculative-tree tokens, equal for every node to plain sparse decoding of its
    ancestor path (:func:`sparse_attention` at position ``prefix + depth`` after the path was committed).

    q ``[B, T, H, D]`` (post-RoPE; ``q_select`` pre-RoPE with ``use_nope``, and under tensor parallelism
    the queries of the whole GQA group, ``[B, T, H', D]``), tree_k / tree_v ``[B, T, KVH,
    D]`` the tree tokens' keys and values (cache dtype; post-RoPE), tree_mask ``bool[B, T, T]`` (ancestors and
    self), prefix ``int32[B]`` committed tokens (in the cache, with their compressed keys), depths
    ``int32[B, T]``. Depths must stay within :func:`~minicpm_jax.infllm.policy.tree_depth_limit`.

    What a path changes compared with the committed prefix: (1) the coarse (K2) window that closes inside
    it joins the stage-1 LSE; the node's copy is built from the prefix keys and its own ancestors' keys
    (``extra_logits``); (2) fine (K1) windows that reach into the path only score blocks inside the forced
    local window, so they can be left out; (3) stage 2 attends the selected blocks of the prefix (the
    block-sparse kernel with ``kv_lengths = prefix``, returning its LSE) and, merged by log-sum-exp, the
    node's ancestors (which plain decoding finds in its forced local blocks).
    """
    b, t, _, d = q.shape
    kvh = tree_k.shape[2]
    positions = prefix[:, None] + depths
    k2_size, k2_stride = sparse.kernel_size2, sparse.kernel_stride2
    # (1) The coarse window that the path closes: the first one not complete at the prefix.
    first = compressed_count(prefix, kernel=k2_size, stride=k2_stride) * k2_stride  # [B] its first key
    end = first + k2_size
    key_pos = jnp.minimum(first[:, None] + jnp.arange(k2_size, dtype=jnp.int32)[None, :], cache.max_length - 1)
    keys = cache.keys_at(layer, key_pos)  # [B, k2, KVH, D]
    path_k = tree_k
    if unrotate is not None:
        keys = unrotate(keys, key_pos)
        path_k = unrotate(tree_k, positions)
    in_prefix = (first[:, None] + jnp.arange(k2_size)[None, :]) < prefix[:, None]
    prefix_sum = jnp.sum(jnp.where(in_prefix[..., None, None], keys.astype(jnp.float32), 0.0), axis=1)  # [B, KVH, D]
    take = tree_mask & (positions[:, None, :] < end[:, None, None])  # ancestors inside the window
    path_sum = jnp.einsum("bij,bjkd->bikd", take.astype(jnp.float32), path_k.astype(jnp.float32),
                          precision=lax.Precision.HIGHEST)
    extra_key = ((prefix_sum[:, None] + path_sum) / k2_size).astype(cache.k.dtype)  # as the cache stores it
    hs = q_select.shape[2]  # the selection queries may be a whole GQA group wider than q (tensor parallelism)
    qg = q_select.reshape(b, t, kvh, hs // kvh, d)
    extra = jnp.einsum("btkgd,btkd->btkg", qg, extra_key, preferred_element_type=jnp.float32).reshape(b, t, hs) * scale
    extra = jnp.where((positions + 1 >= end[:, None])[..., None], extra, -jnp.inf)

    # The cache's slot for that window is stale (the path is not committed): stage 1 runs at a position that
    # cannot see it (fine windows hidden by this are path windows too, scoring forced blocks only).
    score_pos = jnp.minimum(positions, end[:, None] - 2)
    blocks = cache.select_blocks(layer, q_select, positions, prefix, geometry(sparse), kernels, scale=scale,
                                 score_positions=score_pos, extra_logits=extra)
    # (3) The prefix's selected blocks, and the ancestors; merged by their log-sum-exps.
    out_p, lse_p = cache.attend_blocks(layer, q, positions, prefix, blocks, kernels, scale=scale,
                                       block_size=sparse.block_size)
    return kernels.tree_merge_attention(q, tree_k, tree_v, tree_mask, out_p, lse_p, scale=scale)
