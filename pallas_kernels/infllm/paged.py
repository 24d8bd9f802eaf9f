"""InfLLM-v2 over a paged KV pool: where a paged cache keeps the compressed keys, and the jnp references of
the paged ops (the kernels are this package's stage-1, stage-2, decode and compress kernels run with a
page table; :mod:`pallas_kernels.triton` chooses among them).

Layout. Beside the pool's K/V (``[L, KVH, N, D]``, :mod:`pallas_kernels.paged`) every page holds the
compressed keys that complete inside it: k1_pages ``[L, KVH, num_pages * page_size / stride1, D]`` and
k2_pages ``[L, KVH, num_pages * page_size / stride2, D]``. Compressed key ``j`` (the mean of the window
``[stride*j, stride*j + kernel)``) lives in the page of its window's last key ``e = stride*j + kernel - 1``,
entry ``(e % page_size) // stride`` of that page's ``page_size / stride``. An entry so depends only on keys
of its own page and the pages before it: a page shared by prefix (every token up to its end the same)
shares its compressed keys, complete, and a row writes entries only into the pages it writes keys into.
The attended blocks are pages (``block_size == page_size``), so a selected block is one page-table entry.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.infllm.common import compressed_entries
from pallas_kernels.infllm.compress import completed_window_means
from pallas_kernels.infllm.stage1 import compressed_scores_reference
from pallas_kernels.infllm.stage2 import block_sparse_attention_reference
from pallas_kernels.launch import is_power_of_2
from pallas_kernels.paged import gather_view, logical_slots


def check_paged_geometry(page_size: int, *, block_size: int, stride1: int, stride2: int) -> None:
    """ValueError unless InfLLM-v2's geometry maps onto pages: blocks of one page, and power-of-2 strides
    that divide it (whole compressed entries per page)."""
    if block_size != page_size:
        raise ValueError(f"InfLLM-v2 over a paged cache needs pages of one sparse block ({block_size} tokens), "
                         f"got {page_size}")
    for stride in (stride1, stride2):
        if not (is_power_of_2(stride) and page_size % stride == 0):
            raise ValueError(f"InfLLM-v2 over a paged cache needs power-of-2 compression strides dividing the page "
                             f"({page_size}), got {stride}")


def compressed_rows(page_table: jax.Array, n: int, *, kernel: int, stride: int, page_size: int) -> jax.Array:
    """``int32[B, n]``: the pool row of each row's compressed keys ``0 .. n - 1`` (page-table indices
    clamped into the table)."""
    end = jnp.arange(n, dtype=jnp.int32) * stride + (kernel - 1)
    page = jnp.minimum(end // page_size, page_table.shape[1] - 1)
    return page_table[:, page].astype(jnp.int32) * (page_size // stride) + (end % page_size) // stride


def key_slots(page_table: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """The pool slots of key ``positions int32[B, ...]`` of each row (clamped into the page table)."""
    b = page_table.shape[0]
    page = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
    pages = jnp.take_along_axis(page_table, page.reshape(b, -1), axis=1).reshape(positions.shape)
    return pages * page_size + positions % page_size


def compressed_view(pages: jax.Array, layer: int, page_table: jax.Array, n: int, *, kernel: int, stride: int,
                    page_size: int) -> jax.Array:
    """Layer ``layer`` of a compressed pool ``[L, KVH, R, D]`` as each row's contiguous entries ``[B, KVH, n,
    D]`` (what the contiguous cache stores)."""
    rows = compressed_rows(page_table, n, kernel=kernel, stride=stride, page_size=page_size)
    return jnp.moveaxis(pages[layer][:, rows], 0, 1)


def paged_compress_windows_reference(
    k_pages: jax.Array, k1_pages: jax.Array, k2_pages: jax.Array, page_table: jax.Array, old_lengths: jax.Array,
    new_lengths: jax.Array, *, layer: int | None, page_size: int, kernel1: int, stride1: int, kernel2: int,
    stride2: int, max_tokens: int, unrotate=None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`~pallas_kernels.infllm.compress.compress_windows_reference` over the pool: the windows
    completed by growing each row from ``old_lengths`` to ``new_lengths`` (at most ``max_tokens`` apart)
    averaged from keys read through the page table, stored in the pages their last keys are in; ``layer``
    None: every layer. Returns the updated (k1_pages, k2_pages)."""
    if layer is None:
        for each in range(k_pages.shape[0]):
            k1_pages, k2_pages = paged_compress_windows_reference(
                k_pages, k1_pages, k2_pages, page_table, old_lengths, new_lengths, layer=each, page_size=page_size,
                kernel1=kernel1, stride1=stride1, kernel2=kernel2, stride2=stride2, max_tokens=max_tokens,
                unrotate=unrotate)
        return k1_pages, k2_pages

    def keys_at(pos):  # [B, n, kernel] -> [B, n, kernel, KVH, D], through the page table
        return jnp.moveaxis(k_pages[layer][:, key_slots(page_table, pos, page_size)], 0, 3)

    out = []
    for comp, kernel, stride in ((k1_pages, kernel1, stride1), (k2_pages, kernel2, stride2)):
        j, done, means = completed_window_means(
            keys_at, old_lengths, new_lengths, kernel=kernel, stride=stride, capacity=page_table.shape[1] * page_size,
            max_tokens=max_tokens, unrotate=unrotate, dtype=comp.dtype)
        end = j * stride + (kernel - 1)
        row = key_slots(page_table, end, page_size) // stride  # the entry's row: page * (page_size/stride) + ...
        row = jnp.where(done, row, comp.shape[2])  # not completed -> dropped
        out.append(comp.at[layer, :, row].set(means, mode="drop"))
    return out[0], out[1]


def paged_compressed_scores_reference(
    q: jax.Array, k1_pages: jax.Array, k2_pages: jax.Array, page_table: jax.Array, q_positions: jax.Array, *,
    scale: float, page_size: int, kernel1: int, stride1: int, kernel2: int, stride2: int, layer: int,
    extra_logits: jax.Array | None = None,
) -> jax.Array:
    """Stage-1 scores over the pool: :func:`~pallas_kernels.infllm.stage1.compressed_scores_reference` on
    each row's compressed keys gathered through the page table. fp32 ``[B, KVH, T, N1]``, ``N1 =
    compressed_entries(P * page_size, stride1)``."""
    capacity = page_table.shape[1] * page_size
    geo = dict(page_size=page_size)
    k1 = compressed_view(k1_pages, layer, page_table, compressed_entries(capacity, stride1), kernel=kernel1,
                         stride=stride1, **geo)
    k2 = compressed_view(k2_pages, layer, page_table, compressed_entries(capacity, stride2), kernel=kernel2,
                         stride=stride2, **geo)
    return compressed_scores_reference(q, k1, k2, q_positions, scale=scale, kernel1=kernel1, stride1=stride1,
                                       kernel2=kernel2, stride2=stride2, extra_logits=extra_logits)


def paged_block_sparse_attention_reference(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, q_positions: jax.Array,
    kv_lengths: jax.Array, block_indices: jax.Array, *, scale: float, block_size: int, layer: int,
    return_lse: bool = False, whole_blocks: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`~pallas_kernels.infllm.stage2.block_sparse_attention_reference` over the pool (blocks are
    pages: ``block_size`` is the page size): each row's keys gathered through the page table, those at or
    past ``kv_lengths`` zeroed (unused slots may hold anything)."""
    capacity = page_table.shape[1] * block_size
    seen = jnp.arange(capacity, dtype=jnp.int32)[None, :] < kv_lengths[:, None]
    slots = logical_slots(page_table, block_size, capacity)
    k, v = (gather_view(x, layer, slots, seen) for x in (k_pages, v_pages))
    return block_sparse_attention_reference(q, k, v, q_positions, kv_lengths, block_indices, scale=scale,
                                            block_size=block_size, return_lse=return_lse, whole_blocks=whole_blocks)

