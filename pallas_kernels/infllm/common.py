"""What the InfLLM-v2 kernels share: compressed-key visibility, the launch configs, the split count of
stage 2 and the per-split output specs of its kernels."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.flash import MIN_ROWS
from pallas_kernels.launch import KernelConfig, num_cores


@dataclasses.dataclass(frozen=True)
class Geometry:
    """InfLLM-v2's block geometry, as the kernels take it.

    kernel1 / stride1: window and stride of the fine compressed keys (K1); kernel2 / stride2: of the coarse
    ones (K2, the stage-1 LSE); block_size: tokens per attended block; init_blocks / local_blocks: blocks
    always attended at the start and before each query's own block; topk: blocks picked by score besides
    the local window."""

    kernel1: int
    stride1: int
    kernel2: int
    stride2: int
    block_size: int
    init_blocks: int
    local_blocks: int
    topk: int

    @property
    def num_selected(self) -> int:
        """Blocks attended per query and KV head at most: top-k plus the local window (the init and local
        blocks count inside this budget, scored +inf)."""
        return self.topk + self.local_blocks

    @property
    def ratio(self) -> int:
        """Fine compressed keys per block."""
        return self.block_size // self.stride1

    def stage1(self) -> dict:
        """The window arguments of the stage-1 kernels."""
        return dict(kernel1=self.kernel1, stride1=self.stride1, kernel2=self.kernel2, stride2=self.stride2)

    def select(self, num_blocks: int) -> dict:
        """The arguments of the block-selection kernels for a cache of ``num_blocks`` blocks."""
        return dict(k=min(self.num_selected, num_blocks), kernel1=self.kernel1, stride1=self.stride1,
                    ratio=self.ratio, num_blocks=num_blocks, init_blocks=self.init_blocks,
                    local_blocks=self.local_blocks)

    def pool_select(self) -> dict:
        """The selection arguments of the decode path's selection + attention kernel."""
        return dict(block_size=self.block_size, k_blocks=self.num_selected, kernel1=self.kernel1,
                    stride1=self.stride1, init_blocks=self.init_blocks, local_blocks=self.local_blocks)


# Stage 1: block_q = query tokens per tile (times the padded group = rows; the group reduction is a dot
# with a [max(16, tokens), rows] indicator), block_k = compressed keys per step. Measured on an H100, jax
# 0.11.2, a 2048-query chunk at 64K / 128K (BENCHMARKS.md, 2026-11-24 eighth session), once the masks were
# confined to the causal edge: 16 tokens x 64 keys, 4 warps, 1 stage: 0.30 / 0.56 ms; 8 tokens (the
# earlier choice, whose 16-row output tiles are half padding): 0.38 / 0.71; 8 x 128 keys 0.33 / 0.60;
# 8 warps, 2 stages, 32 keys or 32 tokens slower (an fp32 instead of bf16 group reduction: 7x slower).
SCORES_CONFIG = KernelConfig(block_q=16, block_k=64, num_warps=4, num_stages=1)
# Fewer than 16 query tokens (a speculative tree's verify): 4-token tiles. A 12-node verify at 128K (one layer,
# stage 1 + the selection reading its tiles, H200, 2026-11-29): 28.3 us against 36.1 with the 16-token tile,
# whose 256-row tile (16 tokens x 16 heads) leaves 32 programs for the coarse pass; 8 tokens 29.4, 2 31.1, 1 31.2
# (docs/lab_notes/2026-11-29-thirty-sixth-session.md).
FEW_TOKENS_SCORES_CONFIG = KernelConfig(block_q=4, block_k=64, num_warps=4, num_stages=1)
FEW_TOKENS = 16  # queries below this many take FEW_TOKENS_SCORES_CONFIG


def scores_config(tokens: int) -> KernelConfig:
    """The stage-1 launch config for ``tokens`` query tokens per batch row."""
    return FEW_TOKENS_SCORES_CONFIG if tokens < FEW_TOKENS else SCORES_CONFIG


SPARSE_CONFIG = KernelConfig(block_q=MIN_ROWS, block_k=64, num_warps=4, num_stages=2)


def compressed_visible(positions: jax.Array, n: int, *, kernel: int, stride: int) -> jax.Array:
    """``bool[..., n]``: compressed key ``j`` (window ``[stride*j, stride*j + kernel)``) is visible to a
    query at ``positions[...]`` iff ``stride*j + kernel - 1 <= position``."""
    ends = jnp.arange(n, dtype=jnp.int32) * stride + (kernel - 1)
    return ends <= positions[..., None]


def compressed_count(length: jax.Array, *, kernel: int, stride: int) -> jax.Array:
    """Complete compressed windows among the first ``length`` keys: ``max(0, (length - kernel)//stride + 1)``."""
    return jnp.where(length >= kernel, (length - kernel) // stride + 1, 0)


def compressed_entries(capacity: int, stride: int) -> int:
    """Logical compressed entries of a paged row of ``capacity`` keys (:mod:`pallas_kernels.infllm.paged`):
    at least 16, the stage-1 kernels' smallest key block (entries past the row's pages are never complete,
    hence never read)."""
    return max(16, capacity // stride)


def sparse_splits(batch: int, kv_heads: int, tokens: int, max_blocks: int) -> int:
    """Programs sharing one (token, KV group)'s selected blocks: enough for two programs per SM, at least
    two blocks per program; 1 for prefill chunks (tokens x groups already fill the GPU)."""
    return max(1, min(max(1, max_blocks // 2), pl.cdiv(2 * num_cores(), batch * kv_heads * tokens)))


def split_grid_io(b: int, kvh: int, t: int, splits: int, rows: int, s: int, d: int, layer: int,
                   o_dtype=jnp.float32, paged: bool = False):
    """Specs of the stage-2 kernels on grid (batch, KV head, token, split): the K and V inputs (one layer
    of the stacked cache, read in place; ``paged``: the KV head's ``[N, D]`` of the pool ``[L, KVH, N, D]``),
    and the per-split outputs o ``[B, KVH, T, splits, rows, D]`` (in ``o_dtype``, normalised within its
    split) and lse fp32 ``[B, KVH, T, splits, rows]`` (log2 units). Returns (kv_specs, out_specs, out_shape)."""
    if paged:
        kv = pl.BlockSpec((None, None, s, d), lambda i, j, n, sp: (layer, j, 0, 0))
    else:
        kv = pl.BlockSpec((None, None, None, s, d), lambda i, j, n, sp: (layer, i, j, 0, 0))
    out_specs = [pl.BlockSpec((None, None, None, None, rows, d), lambda i, j, n, sp: (i, j, n, sp, 0, 0)),
                 pl.BlockSpec((None, None, None, None, rows), lambda i, j, n, sp: (i, j, n, sp, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, kvh, t, splits, rows, d), o_dtype),
                 jax.ShapeDtypeStruct((b, kvh, t, splits, rows), jnp.float32)]
    return [kv, kv], out_specs, out_shape
