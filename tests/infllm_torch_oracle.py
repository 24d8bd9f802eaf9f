"""An independent InfLLM-v2 oracle in plain torch, re-derived from the Hugging Face MiniCPM4 modeling code and
the InfLLM-v2 CUDA package it calls, with every CUDA call replaced by dense torch that follows that call's
own semantics. Written from reading those sources (no code copied); each step cites what it follows.

Sources read:

* ``modeling_minicpm.py`` of openbmb/MiniCPM4-8B (the Hub's remote code), through its public mirror
  github.com/ProudAurora/SparseMiniCpm ``finetune/models/minicpm4/modeling_minicpm.py`` @294ead4 (a copy
  with debug prints added), cross-checked against the OpenBMB MiniCPM-SALA copy of the same classes:
  ``compressed_attention``, ``calc_chunks_with_stride``, ``CompressK``, ``InfLLMv2CacheLayer``,
  ``MiniCPMInfLLMv2Attention.{__init__, forward, get_compress_k, sparse_forward}``.
* github.com/OpenBMB/infllmv2_cuda_impl @f908e73: ``infllm_v2/max_pooling_1d.py`` and
  ``csrc/max_pooling_1d.cuh`` (``max_pooling_1d_varlen_kernel``); ``infllm_v2/infllmv2_sparse_attention.py``
  (``infllmv2_attn_stage1``, ``infllmv2_attn_varlen_func``); ``csrc/flash_attn/src/mask.h``
  (``Mask::apply_mask_stage1``, ``apply_mask_local``); ``csrc/flash_attn/src/flash_fwd_kernel.h``
  (``compute_attn_1rowblock_splitkv_stage1``: pass 1 = LSE over the coarse keys, pass 2 = scores over the
  fine keys); the torch references ``tests/stage1/naive_softmax.py`` and
  ``tests/stage1/complse_online_softmax.py``.

Layout is HF's varlen one for a single sequence: queries ``[T, H, D]``, keys/values ``[S, KVH, D]``; query
head ``h`` belongs to KV head ``h // (H // KVH)`` (the ``reshape(total_q, nheads_k, group, d)`` of
``infllmv2_attn_stage1`` / ``_infllmv2_attn_varlen_forward``).
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class HFSparse:
    """``config.sparse_config`` as ``MiniCPMInfLLMv2Attention.__init__`` reads it (same defaults)."""

    kernel_size: int = 32
    kernel_stride: int = 16
    init_blocks: int = 1
    block_size: int = 64
    window_size: int = 2048
    topk: int = 64
    dense_len: int = 8192

    @property
    def local_blocks(self) -> int:  # __init__: window_size // block_size
        return self.window_size // self.block_size

    @property
    def total_topk(self) -> int:  # __init__: topk + window_size // block_size (forced blocks count inside)
        return self.topk + self.local_blocks

    @property
    def coarse(self) -> tuple[int, int]:  # __init__: compress_k2 = CompressK(kernel_size*4, kernel_stride*4)
        return 4 * self.kernel_size, 4 * self.kernel_stride


# ------------------------------------------------------------------ compressed keys
def mean_pool_keys(k: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """``CompressK.forward`` with ``calc_chunks_with_stride``: the mean of every *complete* window
    ``[stride*j, stride*j + kernel)`` of ``k [S, KVH, D]`` (no padding), in k's dtype. ``[N, KVH, D]``."""
    s = k.shape[0]
    n = (s - kernel) // stride + 1 if s >= kernel else 0
    starts = torch.arange(n) * stride
    rows = starts[:, None] + torch.arange(kernel)[None, :]  # [N, kernel]
    return k[rows].mean(dim=1)


class CompressedCache:
    """HF's per-layer compressed-key state (``InfLLMv2CacheLayer``), driven as
    ``MiniCPMInfLLMv2Attention.get_compress_k`` drives it: the first sparse call ("is_prefilling": the
    key count reaches ``dense_len`` and nothing is compressed yet) pools all keys and keeps the
    uncompressed tails ``K[n*stride:]``; each later call (a decode step) appends its one key to the tails
    and, once a tail holds ``kernel`` keys, appends their mean and drops the first ``stride``
    (``update_no_compress_k`` / ``update_no_compress_k2``)."""

    def __init__(self, cfg: HFSparse):
        self.levels = [(cfg.kernel_size, cfg.kernel_stride), cfg.coarse]
        self.comp: list[torch.Tensor] | None = None
        self.tails: list[torch.Tensor] = []

    @property
    def empty(self) -> bool:
        return self.comp is None

    def prefill(self, k_all: torch.Tensor) -> None:
        self.comp, self.tails = [], []
        for kernel, stride in self.levels:
            c = mean_pool_keys(k_all, kernel, stride)
            self.comp.append(c)
            self.tails.append(k_all[c.shape[0] * stride:].clone())  # get_compress_k: no_compress_k_start

    def append(self, k_new: torch.Tensor) -> None:
        """One decode step's key ``[KVH, D]``."""
        for i, (kernel, stride) in enumerate(self.levels):
            tail = torch.cat([self.tails[i], k_new[None]], dim=0)
            if tail.shape[0] >= kernel:
                self.comp[i] = torch.cat([self.comp[i], tail[:kernel].mean(dim=0, keepdim=True)], dim=0)
                tail = tail[stride:]
            self.tails[i] = tail

    @property
    def k1(self) -> torch.Tensor:
        return self.comp[0]

    @property
    def k2(self) -> torch.Tensor:
        return self.comp[1]


# ------------------------------------------------------------------ stage 1
def visible_counts(q_len: int, n_comp: int, stride: int, causal: bool) -> torch.Tensor:
    """How many compressed keys each query row of a chunk sees in the stage-1 kernel: ``int64[q_len]``.

    Causal (HF prefill): ``mask.h`` ``apply_mask_stage1`` keeps columns below
    ``(row + 1)//stride - 1 + n_comp - (q_len - stride + 1)//stride`` (bottom-right aligned; the torch
    reference ``tests/stage1/naive_softmax.py`` has the same count ``(row - 15)//16 + k_len - (q_len -
    15)//16`` for stride 16). For a chunk starting at a multiple of 64 (of 16 for K1) whose length is
    not ``-1 mod stride`` this is "the whole window lies at or before the query". Not causal (HF decode):
    every compressed key."""
    if not causal:
        return torch.full((q_len,), n_comp, dtype=torch.int64)
    rows = torch.arange(q_len)
    c = (rows + 1) // stride - 1 + n_comp - (q_len - stride + 1) // stride
    return c.clamp(0, n_comp)


def stage1_scores(q: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, *, causal: bool, scale: float,
                  fine_stride: int = 16, coarse_stride: int = 64,
                  out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``infllmv2_attn_stage1(q, k1, k2, causal=...)``: ``score[g, t, j] = sum_{h in g} exp(q_h.k1_j*scale
    - LSE_h)``, LSE_h over the visible coarse keys (pass 1 of ``compute_attn_1rowblock_splitkv_stage1``,
    ``complse_online_softmax.py``), invisible fine keys 0. fp32 math; the kernel stores the input dtype
    (``out_dtype``). Rows that see no coarse key: the kernel exits early writing 0 (and the torch
    reference zeroes NaN) -> 0. Returns (scores ``[KVH, T, N1]``, bool ``[T]`` rows that saw a coarse key)."""
    t, h, d = q.shape
    kvh = k1.shape[1]
    g = h // kvh
    qf = q.float().reshape(t, kvh, g, d).permute(1, 2, 0, 3)  # [KVH, G, T, D]
    s1 = qf @ k1.float().permute(1, 2, 0)[:, None] * scale  # [KVH, G, T, N1]
    s2 = qf @ k2.float().permute(1, 2, 0)[:, None] * scale
    c1 = visible_counts(t, k1.shape[0], fine_stride, causal)
    c2 = visible_counts(t, k2.shape[0], coarse_stride, causal)
    vis1 = torch.arange(k1.shape[0])[None, :] < c1[:, None]  # [T, N1]
    vis2 = torch.arange(k2.shape[0])[None, :] < c2[:, None]
    lse = torch.logsumexp(s2.masked_fill(~vis2, -math.inf), dim=-1, keepdim=True)  # [KVH, G, T, 1]
    seen = c2 > 0
    p = torch.exp(s1 - torch.where(seen[:, None], lse, torch.zeros_like(lse)))
    p = p.masked_fill(~(vis1 & seen[:, None]), 0.0)
    return p.sum(dim=1).to(out_dtype), seen


# ------------------------------------------------------------------ block scores and selection
def max_pool_blocks(score: torch.Tensor, cache_len: int, q_len: int, n_comp: int, cfg: HFSparse) -> torch.Tensor:
    """``max_pooling_1d_varlen`` (``csrc/max_pooling_1d.cuh``): ``[KVH, T, N1]`` -> ``[KVH, T, out_len]``,
    ``out_len = ceil((q_len + cache_len)/block)``. Pool stride ``block // kernel_stride``, window one more,
    padding 1, clipped to the ``n_comp`` existing entries (empty -> -inf). Block ``b`` of query row ``i``
    (``q_blk = (i + cache_len)//block``) scores +inf if ``b < init_blocks`` or ``q_blk - local_blocks <= b
    <= q_blk``. Kept in the scores' dtype."""
    kvh, t, _ = score.shape
    stride = cfg.block_size // cfg.kernel_stride
    width = stride + 1
    out_len = (q_len + cache_len + cfg.block_size - 1) // cfg.block_size
    out = torch.empty(kvh, t, out_len, dtype=score.dtype)
    q_blk = (torch.arange(t) + cache_len) // cfg.block_size
    for b in range(out_len):
        lo, hi = max(b * stride - 1, 0), min(b * stride - 1 + width, n_comp)
        out[:, :, b] = score[:, :, lo:hi].amax(dim=-1) if hi > lo else -math.inf
        forced = (b < cfg.init_blocks) | ((q_blk >= b) & (q_blk <= b + cfg.local_blocks))  # [T]
        out[:, forced, b] = math.inf
    return out


def select_blocks(block_score: torch.Tensor, q_blk: torch.Tensor, cfg: HFSparse, *,
                  drop_own_block: bool = False) -> torch.Tensor:
    """``compressed_attention``'s tail: ``topk(min(total_topk, out_len))`` indices, sorted ascending, those
    past the query's block set to -1 (``topk_idx[topk_idx > q_idx] = -1``). ``drop_own_block``: the
    ``>=`` variant of the MiniCPM4-0.5B copy (the query's own block dropped too). int32 ``[KVH, T, K]``."""
    k = min(cfg.total_topk, block_score.shape[-1])
    idx = block_score.topk(k, dim=-1).indices.sort(dim=-1).values
    past = idx >= q_blk[None, :, None] if drop_own_block else idx > q_blk[None, :, None]
    return idx.masked_fill(past, -1).to(torch.int32)


# ------------------------------------------------------------------ stage 2
def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk_idx: torch.Tensor, *,
                           causal: bool, block_size: int, scale: float) -> torch.Tensor:
    """``infllmv2_attn_varlen_func(..., topk_idx=..., causal=...)``: softmax attention of each query head
    over the keys of the 64-token blocks its KV group selected (``topk_to_uint64``; -1 ignored), with
    flash-attn's bottom-right causal mask (``apply_mask_local``: key ``j <= i + S - T``) when causal (HF:
    prefill). fp32 math, output in q's dtype. ``[T, H, D]``."""
    t, h, d = q.shape
    s, kvh = k.shape[0], k.shape[1]
    g = h // kvh
    n_blocks = -(-s // block_size)
    chosen = torch.zeros(kvh, t, n_blocks + 1, dtype=torch.bool)
    idx = torch.where(topk_idx < 0, n_blocks, topk_idx).long()
    chosen.scatter_(-1, idx, True)
    allowed = chosen[..., :n_blocks][..., torch.arange(s) // block_size]  # [KVH, T, S]
    if causal:
        allowed = allowed & (torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t))[None]
    qf = q.float().reshape(t, kvh, g, d).permute(1, 2, 0, 3)  # [KVH, G, T, D]
    logits = qf @ k.float().permute(1, 2, 0)[:, None] * scale  # [KVH, G, T, S]
    logits = logits.masked_fill(~allowed[:, None], -math.inf)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    out = probs @ v.float().permute(1, 0, 2)[:, None]  # [KVH, G, T, D]
    return out.permute(2, 0, 1, 3).reshape(t, h, d).to(q.dtype)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """``_flash_attention_forward_dense``: plain causal attention (bottom-right aligned), the path HF takes
    while ``kv_len < dense_len``."""
    t, s = q.shape[0], k.shape[0]
    all_blocks = torch.arange(-(-s // 64), dtype=torch.int32).expand(k.shape[1], t, -1)
    return block_sparse_attention(q, k, v, all_blocks, causal=True, block_size=64, scale=scale)


# ------------------------------------------------------------------ one layer's sparse attention
@dataclasses.dataclass
class SparseResult:
    scores: torch.Tensor  # stage 1, [KVH, T, N1]
    saw_coarse: torch.Tensor  # bool [T]
    block_scores: torch.Tensor  # [KVH, T, out_len], forced blocks +inf
    q_blk: torch.Tensor  # int64 [T]
    topk_idx: torch.Tensor  # int32 [KVH, T, K], -1 padded
    out: torch.Tensor  # [T, H, D]


def uses_sparse(kv_len: int, cfg: HFSparse) -> bool:
    """``MiniCPMInfLLMv2Attention.forward``: sparse iff ``kv_seq_len = max(position_ids) + 1 >= dense_len``."""
    return kv_len >= cfg.dense_len


def sparse_forward(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor,
                   cfg: HFSparse, *, cache_len: int, decoding: bool, score_dtype: torch.dtype = torch.float32,
                   drop_own_block: bool = False) -> SparseResult:
    """``MiniCPMInfLLMv2Attention.sparse_forward`` -> ``compressed_attention`` -> stage 2 for one sequence:
    ``q [T, H, D]`` at positions ``cache_len .. cache_len + T - 1`` over ``k_all / v_all [cache_len + T,
    KVH, D]`` and the compressed keys. ``decoding`` (T == 1, HF's ``cache_lens = seq_len_k - 1``): stage 1
    not causal, stage 2 not causal. Otherwise causal; HF's own wrapper then always passes ``cache_lens =
    0`` (it assumes the chunk starts at position 0, true of the prompt prefill it runs); ``cache_len > 0``
    here is the kernels' semantics for a chunk over history (``max_pooling_1d_varlen``'s ``cache_lens``,
    the kernels' bottom-right causal alignment), which HF's generate loop never reaches."""
    t = q.shape[0]
    scale = q.shape[-1] ** -0.5  # softmax_scale=None in both kernels
    if decoding:
        assert t == 1 and cache_len == k_all.shape[0] - 1
    scores, seen = stage1_scores(q, k1, k2, causal=not decoding, scale=scale, fine_stride=cfg.kernel_stride,
                                 coarse_stride=cfg.coarse[1], out_dtype=score_dtype)
    block_scores = max_pool_blocks(scores, cache_len, t, k1.shape[0], cfg)
    q_blk = (torch.arange(t) + cache_len) // cfg.block_size  # q_idx
    topk_idx = select_blocks(block_scores, q_blk, cfg, drop_own_block=drop_own_block)
    out = block_sparse_attention(q, k_all, v_all, topk_idx, causal=not decoding, block_size=cfg.block_size,
                                 scale=scale)
    return SparseResult(scores, seen, block_scores, q_blk, topk_idx, out)
