"""InfLLM-v2 sparse attention at the model level: settings, the compressed-key caches, block selection,
and the dense/sparse switch of one attention layer.

Semantics follow the Hugging Face MiniCPM4 modeling code (``reference/infllm_v2_and_eagle.md`` §A):

* ``K1[j] = mean(K[s*j : s*j + k])`` (k = ``kernel_size`` 32, s = ``kernel_stride`` 16) and
  ``K2[j]`` the same with 4k, 4s, over post-RoPE keys per KV head (pre-RoPE when ``use_nope``);
  complete windows only.
* stage 1: ``score[j] = sum_{h in group} exp(q_h.K1[j]/sqrt(d) - LSE_h)``, ``LSE_h`` over K2, causal by
  whole windows (see :mod:`pallas_kernels.sparse_attention`).
* block ``b`` (tokens ``[64b, 64b+64)``) scores the max over the fine entries overlapping it
  (``[4b-1, 4b+3]``: kernel 5, stride 4, padding 1); init blocks and the ``window_size/64 + 1`` local
  blocks ending at the query's own block score +inf; the top ``topk + window_size/64`` blocks not past
  the query's block are attended (stage 2), causally.
* attention is dense while the sequence (cache plus this chunk) is shorter than ``dense_len``.

Deviations (documented in README): the compressed caches are extended for every completed window even
while attention is still dense, so crossing ``dense_len`` mid-decode needs no catch-up pass; a prefill
chunk is sparse iff its sequence reaches ``dense_len`` by the chunk's end (HF, which runs the prompt in
one piece, decides by the whole prompt — the two agree except for queries at positions between
``(topk + window_size/64)*64`` and ``dense_len`` of an early chunk of a long prompt); with ``use_nope`` the
pre-RoPE keys are recovered by rotating the cached post-RoPE keys back (exact up to bf16 rounding).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from minicpm_jax.cache import KVCache
from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.rope import apply_rope
from minicpm_jax.topk import top_k
from pallas_kernels.sparse_attention import (
    block_sparse_attention,
    block_sparse_attention_reference,
    compress_step,
    compressed_count,
    compressed_scores,
    compressed_scores_reference,
    compressed_scores_tiled,
    force_blocks,
    local_window_attention,
    merge_attention,
    pool_block_scores,
    pool_select_attention_reference,
    pool_select_attention_tiled,
    pool_select_blocks,
    pool_select_blocks_reference,
    pool_select_blocks_tiled,
    score_tile_rows,
    select_top_blocks,
)

SPARSE_CHOICES = ("auto", "on", "off")


def resolve_sparse(
    config: ModelConfig, mode: str | SparseConfig | None = "auto", *, topk: int | None = None,
    window_size: int | None = None, dense_len: int | None = None,
) -> SparseConfig | None:
    """The InfLLM-v2 settings a model runs with, or None for dense attention.

    mode: ``auto`` = the checkpoint's ``sparse_config`` if it has one, ``on`` = that or MiniCPM4's
    defaults (kernel 32/16, block 64, window 2048, topk 64, dense_len 8192), ``off`` (or None) = dense; a
    :class:`SparseConfig` is used as given. ``topk``, ``window_size`` and ``dense_len`` override fields.
    """
    if isinstance(mode, SparseConfig):
        sparse = mode
    elif mode in (None, "off"):
        return None
    elif mode == "auto":
        sparse = config.sparse
    elif mode == "on":
        sparse = config.sparse or SparseConfig()
    else:
        raise MiniCPMError(f"sparse must be one of {', '.join(SPARSE_CHOICES)}, got {mode!r}")
    if sparse is None:
        return None
    overrides = {k: v for k, v in (("topk", topk), ("window_size", window_size), ("dense_len", dense_len))
                 if v is not None}
    for name, val in overrides.items():
        if val < (0 if name == "window_size" else 1):
            raise MiniCPMError(f"sparse {name} must be >= {0 if name == 'window_size' else 1}, got {val}")
    return dataclasses.replace(sparse, **overrides).check()


def extend_compressed(
    cache: KVCache, layer: int, old_lengths: jax.Array, new_lengths: jax.Array, sparse: SparseConfig, *,
    max_tokens: int, unrotate=None, impl: str = "xla",
) -> KVCache:
    """Appends to ``layer``'s K1/K2 the windows completed by growing each sequence from ``old_lengths`` to
    ``new_lengths`` (``int32[B]``, at most ``max_tokens`` apart), averaging keys already in ``cache.k``.

    unrotate: None, or ``f(keys [B, N, KVH, D], positions int32[B, N]) -> keys`` undoing RoPE
    (``use_nope``). Means are taken in fp32 and stored in the cache dtype. With ``impl="pallas"`` a
    one-token step (decode) runs as one kernel writing in place (:func:`compress_step`).
    """
    pow2 = all(n & (n - 1) == 0 for n in (sparse.kernel_size, sparse.kernel_size2))
    if max_tokens == 1 and unrotate is None and impl == "pallas" and pow2:
        k1, k2 = compress_step(cache.k, cache.k1, cache.k2, old_lengths, new_lengths, layer=layer,
                               kernel1=sparse.kernel_size, stride1=sparse.kernel_stride, kernel2=sparse.kernel_size2,
                               stride2=sparse.kernel_stride2)
        return dataclasses.replace(cache, k1=k1, k2=k2)
    b = cache.batch_size
    rows = jnp.arange(b)[:, None]
    out = {}
    for name, kernel, stride in (("k1", sparse.kernel_size, sparse.kernel_stride),
                                 ("k2", sparse.kernel_size2, sparse.kernel_stride2)):
        comp = getattr(cache, name)
        n_new = -(-max_tokens // stride)  # windows completed by max_tokens new keys, at most
        first = compressed_count(old_lengths, kernel=kernel, stride=stride)
        last = compressed_count(new_lengths, kernel=kernel, stride=stride)
        j = first[:, None] + jnp.arange(n_new, dtype=jnp.int32)[None, :]  # [B, n]
        key_pos = jnp.minimum(j[..., None] * stride + jnp.arange(kernel, dtype=jnp.int32), cache.max_length - 1)
        keys = cache.k[layer, rows[:, :, None], :, key_pos]  # [B, n, kernel, KVH, D]
        if unrotate is not None:
            shape = keys.shape
            keys = unrotate(keys.reshape(b, -1, *shape[3:]), key_pos.reshape(b, -1)).reshape(shape)
        means = jnp.mean(keys.astype(jnp.float32), axis=2).astype(comp.dtype)  # [B, n, KVH, D]
        slot = jnp.where(j < last[:, None], j, comp.shape[3])  # out of range -> dropped
        out[name] = comp.at[layer, rows, :, slot].set(means, mode="drop")
    return dataclasses.replace(cache, **out)


def select_blocks(
    scores: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, sparse: SparseConfig, num_blocks: int,
    *, impl: str = "xla",
) -> jax.Array:
    """Stage-1 scores ``fp32[B, KVH, T, N1]`` → attended blocks ``int32[B, KVH, T, K]``, ascending, padded
    with -1 at the end (``K = min(topk + window_size/block_size, num_blocks)``): max-pooled to blocks,
    init and local blocks forced, the best picked. ``impl="pallas"``: one kernel per row that pools in
    registers and picks without a sort (``pool_select_blocks``); ``"xla"``: pooling in XLA, top-k + sort.

    Entries a query cannot see score 0 (entries that do not exist yet are left out of the pooling), as
    in HF's causal stage 1; ``scores`` may hold anything there.
    """
    if impl == "pallas":
        return pool_select_blocks(scores, q_positions, kv_lengths, **_select_kw(sparse, num_blocks))
    return pool_select_blocks_reference(scores, q_positions, kv_lengths, top_k=top_k, **_select_kw(sparse, num_blocks))


def _select_kw(sparse: SparseConfig, num_blocks: int) -> dict:
    return dict(k=min(sparse.num_selected, num_blocks), kernel1=sparse.kernel_size, stride1=sparse.kernel_stride,
                ratio=sparse.pool_ratio, num_blocks=num_blocks, init_blocks=sparse.init_blocks,
                local_blocks=sparse.local_blocks)


def block_selection(
    q_select: jax.Array, cache: KVCache, layer: int, q_positions: jax.Array, kv_lengths: jax.Array,
    sparse: SparseConfig, *, scale: float, impl: str, score_positions: jax.Array | None = None,
    extra_logits: jax.Array | None = None, pool_in_kernel: bool = True,
) -> jax.Array:
    """Stage 1 and the block selection of ``q_select [B, T, H, D]`` against ``layer``'s compressed keys →
    ``int32[B, KVH, T, K]`` as :func:`select_blocks`. Pallas: the stage-1 kernel's fine scores are read
    in place by the pooling + selection kernel; ``pool_in_kernel=False`` pools them in XLA first (for
    benchmarks). ``score_positions`` (default ``q_positions``) and ``extra_logits``: stage 1's query
    positions and extra coarse logits (:func:`tree_sparse_attention`)."""
    score_pos = q_positions if score_positions is None else score_positions
    num_blocks = -(-cache.max_length // sparse.block_size)
    kw = dict(scale=scale, kernel1=sparse.kernel_size, stride1=sparse.kernel_stride, kernel2=sparse.kernel_size2,
              stride2=sparse.kernel_stride2, layer=layer, extra_logits=extra_logits)
    if impl != "pallas":
        scores = compressed_scores_reference(q_select, cache.k1, cache.k2, score_pos, **kw)
        return select_blocks(scores, q_positions, kv_lengths, sparse, num_blocks, impl="xla")
    if not pool_in_kernel:
        scores = compressed_scores(q_select, cache.k1, cache.k2, score_pos, **kw)
        block_score = pool_block_scores(scores, q_positions, kv_lengths, kernel1=sparse.kernel_size,
                                        stride1=sparse.kernel_stride, ratio=sparse.pool_ratio, num_blocks=num_blocks)
        limit = jnp.broadcast_to((q_positions // sparse.block_size)[:, None, :], block_score.shape[:-1])
        block_score = force_blocks(block_score, limit, (sparse.init_blocks, sparse.local_blocks))
        return select_top_blocks(block_score, limit, k=min(sparse.num_selected, num_blocks))
    scores, tokens = compressed_scores_tiled(q_select, cache.k1, cache.k2, score_pos, **kw)
    return pool_select_blocks_tiled(scores, q_positions, kv_lengths, tokens=tokens, tile_rows=score_tile_rows(tokens),
                                    **_select_kw(sparse, num_blocks))


def sparse_attention(
    q: jax.Array, q_select: jax.Array, cache: KVCache, layer: int, q_positions: jax.Array, kv_lengths: jax.Array,
    sparse: SparseConfig, *, scale: float, impl: str, split_window: bool = True, pool_in_kernel: bool = True,
    fused_decode: bool = True,
) -> jax.Array:
    """InfLLM-v2 attention of ``q [B, T, H, D]`` (post-RoPE) over ``layer`` of the cache: stage-1 scores
    of ``q_select`` (``q``, or pre-RoPE q with ``use_nope``) against K1/K2, block selection, block-sparse
    attention. ``impl``: ``pallas`` kernels or the ``xla`` references. A Pallas decode step (at most
    :data:`FUSED_DECODE_MAX_TOKENS` tokens per row) takes the four-launch decode path
    (:func:`fused_decode_attention`) unless ``fused_decode=False``; ``split_window=False`` keeps a Pallas prefill chunk in one block-sparse pass
    (see :func:`splits_local_window`), and ``pool_in_kernel=False`` pools the stage-1 scores in XLA
    (:func:`block_selection`); these three are for benchmarks. Returns ``[B, T, H, D]``."""
    if impl == "pallas" and fused_decode and q.shape[1] <= FUSED_DECODE_MAX_TOKENS:
        return fused_decode_attention(q, q_select, cache, layer, q_positions, kv_lengths, sparse, scale=scale)
    attend_fn = block_sparse_attention if impl == "pallas" else block_sparse_attention_reference
    blocks = block_selection(q_select, cache, layer, q_positions, kv_lengths, sparse, scale=scale, impl=impl,
                             pool_in_kernel=pool_in_kernel)
    if not (split_window and splits_local_window(sparse, q.shape[1], impl)):
        return attend_fn(q, cache.k, cache.v, q_positions, kv_lengths, blocks, scale=scale,
                         block_size=sparse.block_size, layer=layer)
    # Prefill chunk: the forced local window (the last local_blocks + 1 of each query's ascending selection)
    # runs as flash attention tiled over tokens; the per-token kernel only reads the blocks below it.
    lo_blk = jnp.maximum(q_positions // sparse.block_size - sparse.local_blocks, 0)[:, None, :, None]
    far = jnp.where(blocks < lo_blk, blocks, -1)  # still valid entries first
    parts = [
        block_sparse_attention(q, cache.k, cache.v, q_positions, kv_lengths, far, scale=scale,
                               block_size=sparse.block_size, layer=layer, return_lse=True, whole_blocks=True),
        local_window_attention(q, cache.k, cache.v, q_positions, kv_lengths, scale=scale,
                               block_size=sparse.block_size, local_blocks=sparse.local_blocks, layer=layer),
    ]
    return merge_attention(parts).astype(q.dtype)


# Query tokens per row up to which Pallas sparse attention runs as fused_decode_attention.
FUSED_DECODE_MAX_TOKENS = 1


def fused_decode_attention(
    q: jax.Array, q_select: jax.Array, cache: KVCache, layer: int, q_positions: jax.Array, kv_lengths: jax.Array,
    sparse: SparseConfig, *, scale: float, impl: str = "pallas",
) -> jax.Array:
    """:func:`sparse_attention` for a decode step in four Pallas launches: the two stage-1 passes
    (:func:`~pallas_kernels.sparse_attention.compressed_scores_tiled`), then the pooling, the pick and
    stage 2 in one kernel and the split merge
    (:func:`~pallas_kernels.sparse_attention.pool_select_attention`). ``impl="xla"``: the same steps from
    their jnp references. ``[B, T, H, D]`` in, ``[B, T, H, D]`` out."""
    kw = dict(scale=scale, kernel1=sparse.kernel_size, stride1=sparse.kernel_stride, kernel2=sparse.kernel_size2,
              stride2=sparse.kernel_stride2, layer=layer)
    sel = dict(scale=scale, block_size=sparse.block_size, k_blocks=sparse.num_selected, kernel1=sparse.kernel_size,
               stride1=sparse.kernel_stride, init_blocks=sparse.init_blocks, local_blocks=sparse.local_blocks,
               layer=layer)
    if impl != "pallas":
        scores = compressed_scores_reference(q_select, cache.k1, cache.k2, q_positions, **kw)
        return pool_select_attention_reference(q, cache.k, cache.v, scores, q_positions, kv_lengths, **sel)
    scores, tokens = compressed_scores_tiled(q_select, cache.k1, cache.k2, q_positions, **kw)
    return pool_select_attention_tiled(q, cache.k, cache.v, scores, q_positions, kv_lengths, tokens=tokens,
                                       tile_rows=score_tile_rows(tokens), **sel)


# Query tokens above which a Pallas prefill chunk attends its local windows with the window kernel.
LOCAL_WINDOW_MIN_TOKENS = 16


def splits_local_window(sparse: SparseConfig, tokens: int, impl: str) -> bool:
    """Whether :func:`sparse_attention` splits stage 2 into the local window and the blocks below it:
    Pallas prefill chunks, when every query's window is inside its selection (``topk > init_blocks``;
    the init blocks and the window's ``local_blocks + 1`` blocks all score +inf and ``topk +
    local_blocks`` are kept)."""
    return impl == "pallas" and tokens > LOCAL_WINDOW_MIN_TOKENS and sparse.topk > sparse.init_blocks


def tree_depth_limit(sparse: SparseConfig) -> int:
    """The deepest speculative tree :func:`tree_sparse_attention` verifies exactly: paths shorter than the
    coarse stride (at most one coarse window closes inside a path), whose fine windows only reach blocks
    inside the forced local window (``local_blocks >= ceil((depth + block - stride + kernel) / block)``)."""
    lag = sparse.block_size - sparse.kernel_stride + sparse.kernel_size
    by_window = sparse.local_blocks * sparse.block_size - lag
    return max(-1, min(sparse.kernel_stride2 - 1, by_window))


def tree_sparse_attention(
    q: jax.Array, q_select: jax.Array, tree_k: jax.Array, tree_v: jax.Array, tree_mask: jax.Array, cache: KVCache,
    layer: int, prefix: jax.Array, depths: jax.Array, sparse: SparseConfig, *, scale: float, impl: str,
    unrotate=None,
) -> jax.Array:
    """InfLLM-v2 attention of speculative-tree tokens, equal for every node to plain sparse decoding of its
    ancestor path (:func:`sparse_attention` at position ``prefix + depth`` after the path was committed).

    q ``[B, T, H, D]`` (post-RoPE; ``q_select`` pre-RoPE with ``use_nope``), tree_k / tree_v ``[B, T, KVH,
    D]`` the tree tokens' keys and values (cache dtype; post-RoPE), tree_mask ``bool[B, T, T]`` (ancestors and
    self), prefix ``int32[B]`` committed tokens (in the cache, with their compressed keys), depths
    ``int32[B, T]``. Depths must stay within :func:`tree_depth_limit`.

    What a path changes compared with the committed prefix: (1) the coarse (K2) window that closes inside
    it joins the stage-1 LSE; the node's copy is built from the prefix keys and its own ancestors' keys
    (``extra_logits``); (2) fine (K1) windows that reach into the path only score blocks inside the forced
    local window, so they can be left out; (3) stage 2 attends the selected blocks of the prefix (the
    block-sparse kernel with ``kv_lengths = prefix``, returning its LSE) and, merged by log-sum-exp, the
    node's ancestors (which plain decoding finds in its forced local blocks).
    """
    b, t, h, d = q.shape
    kvh = tree_k.shape[2]
    positions = prefix[:, None] + depths
    k2_size, k2_stride = sparse.kernel_size2, sparse.kernel_stride2
    # (1) The coarse window that the path closes: the first one not complete at the prefix.
    first = compressed_count(prefix, kernel=k2_size, stride=k2_stride) * k2_stride  # [B] its first key
    end = first + k2_size
    key_pos = jnp.minimum(first[:, None] + jnp.arange(k2_size, dtype=jnp.int32)[None, :], cache.max_length - 1)
    keys = cache.k[layer, jnp.arange(b)[:, None], :, key_pos]  # [B, k2, KVH, D]
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
    qg = q_select.reshape(b, t, kvh, h // kvh, d)
    extra = jnp.einsum("btkgd,btkd->btkg", qg, extra_key, preferred_element_type=jnp.float32).reshape(b, t, h) * scale
    extra = jnp.where((positions + 1 >= end[:, None])[..., None], extra, -jnp.inf)

    attend_fn = block_sparse_attention if impl == "pallas" else block_sparse_attention_reference
    # The cache's slot for that window is stale (the path is not committed): stage 1 runs at a position that
    # cannot see it (fine windows hidden by this are path windows too, scoring forced blocks only).
    score_pos = jnp.minimum(positions, end[:, None] - 2)
    blocks = block_selection(q_select, cache, layer, positions, prefix, sparse, scale=scale, impl=impl,
                             score_positions=score_pos, extra_logits=extra)
    # (3) The prefix's selected blocks, and the ancestors; merged by their log-sum-exps.
    out_p, lse_p = attend_fn(q, cache.k, cache.v, positions, prefix, blocks, scale=scale,
                             block_size=sparse.block_size, layer=layer, return_lse=True)
    qg = q.reshape(b, t, kvh, h // kvh, d)
    s = jnp.einsum("btkgd,bjkd->btkgj", qg, tree_k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(tree_mask[:, :, None, None, :], s, -jnp.inf)
    lse_t = jax.nn.logsumexp(s, axis=-1)  # [B, T, KVH, G]; every node sees itself
    out_t = jnp.einsum("btkgj,bjkd->btkgd", jnp.exp(s - lse_t[..., None]).astype(tree_v.dtype), tree_v,
                       preferred_element_type=jnp.float32)
    out = merge_attention([(out_p, lse_p), (out_t.reshape(b, t, h, d), lse_t.reshape(b, t, h))])
    return out.astype(q.dtype)


def attention_mode(dense_len: int, lo: int, hi: int) -> str:
    """The static attention mode for a step whose relevant rows reach between ``lo`` and ``hi`` tokens
    (cache plus the step's tokens): ``dense`` if all stay below ``dense_len``, ``sparse`` if all reach it,
    else ``mixed``. Engines decide on the host, so the compiled step holds no conditional (on a GPU a
    conditional is a host round trip, and one that returns the cache copies it)."""
    if lo >= dense_len:
        return "sparse"
    return "dense" if hi < dense_len else "mixed"


def rope_inverse(inv_freq, scale: float):
    """``f(keys [B, N, KVH, D], positions [B, N])`` undoing :func:`~minicpm_jax.rope.apply_rope`."""
    return lambda keys, positions: apply_rope(keys, -positions, inv_freq, 1.0 / scale)
