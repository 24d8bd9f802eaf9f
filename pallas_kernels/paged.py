"""The jnp references of the paged-KV ops: attention and tree attention reading a paged pool through a page
table (the Pallas kernels are :func:`pallas_kernels.attention.paged_decode_attention`,
:func:`~pallas_kernels.attention.paged_prefill_attention` and
:func:`pallas_kernels.tree_attention.paged_tree_attention`; the paged writer and its reference are in
:mod:`pallas_kernels.cache_write`).

The pool: k_pages, v_pages ``[L, KVH, N, D]``, ``N = num_pages * page_size`` flat slots. Token ``t`` of row
``b`` lives at slot ``page_table[b, t // page_size] * page_size + t % page_size``; page_table ``int32[B, P]``
holds some valid page (0 usually) where a row has no page. Rows may share pages (a common prompt prefix).

Each reference gathers every row's logical keys into a contiguous ``[B, KVH, length, D]`` view and calls the
contiguous reference on it, so the semantics are those of :func:`attention_reference` and
:func:`tree_attention_reference` by construction. Slots that no query of a row sees are zeroed in the view:
the dense references multiply masked probabilities (0) by every value, and 0 * NaN from garbage left in
an unused slot would be NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention import attention_reference
from pallas_kernels.tree_attention import tree_attention_reference


def logical_slots(page_table: jax.Array, page_size: int, length: int) -> jax.Array:
    """``int32[B, length]``: the pool slot of each row's logical keys ``0 .. length - 1`` (positions past the
    page table's ``P * page_size`` capacity read its last slot; callers mask them)."""
    pos = jnp.minimum(jnp.arange(length, dtype=jnp.int32), page_table.shape[1] * page_size - 1)
    return page_table[:, pos // page_size].astype(jnp.int32) * page_size + pos % page_size


def gather_view(pages: jax.Array, layer: int, slots: jax.Array, keep: jax.Array) -> jax.Array:
    """Layer ``layer`` of the pool ``[L, KVH, N, D]`` at ``slots int32[B, S]`` → ``[B, KVH, S, D]``, zero where
    ``keep bool[B, S]`` is False."""
    view = jnp.moveaxis(pages[layer][:, slots], 0, 1)
    return jnp.where(keep[:, None, :, None], view, jnp.zeros((), view.dtype))


def paged_attention_reference(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, q_positions: jax.Array,
    kv_lengths: jax.Array, *, scale: float, page_size: int, layer: int,
) -> jax.Array:
    """Causal GQA attention of ``q [B, T, H, D]`` (positions ``int32[B, T]``) over each row's first
    ``kv_lengths int32[B]`` keys in the pool (at most ``P * page_size``): :func:`attention_reference` on the
    gathered keys. ``[B, T, H, D]`` in q.dtype."""
    capacity = page_table.shape[1] * page_size
    key = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    seen = (key < kv_lengths[:, None]) & (key <= jnp.max(q_positions, axis=1)[:, None])  # by some query of the row
    slots = logical_slots(page_table, page_size, capacity)
    k, v = (gather_view(x, layer, slots, seen) for x in (k_pages, v_pages))
    return attention_reference(q, k, v, q_positions, kv_lengths, scale=scale)


def paged_tree_attention_reference(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, prefix_lengths: jax.Array,
    tree_mask: jax.Array, tree_slots: jax.Array, *, scale: float, page_size: int, layer: int,
    window: int | None = None,
) -> jax.Array:
    """Tree attention of ``q [B, N, H, D]``: each row's committed prefix (``prefix_lengths int32[B]`` keys, at
    most ``P * page_size``, through the page table) plus its ``M`` tree keys at the flat slots
    ``tree_slots[b] + j`` (``tree_mask bool[B, N, M]``): :func:`tree_attention_reference` on a view with
    the tree keys placed right after the prefix. ``[B, N, H, D]`` in q.dtype."""
    capacity = page_table.shape[1] * page_size
    m = tree_mask.shape[2]
    s = jnp.arange(capacity + m, dtype=jnp.int32)[None, :]
    rel = s - prefix_lengths[:, None]  # [B, S]: the tree index of a view slot (negative in the prefix)
    in_prefix = (rel < 0) if window is None else (rel < 0) & (rel >= -window)
    tree_index = jnp.clip(rel, 0, m - 1)
    sees = jnp.take_along_axis(jnp.any(tree_mask, axis=1), tree_index, axis=1)  # some query sees the tree key
    in_tree = (rel >= 0) & (rel < m) & sees
    slots = jnp.where(rel < 0, logical_slots(page_table, page_size, capacity + m), tree_slots[:, None] + tree_index)
    k, v = (gather_view(x, layer, slots, in_prefix | in_tree) for x in (k_pages, v_pages))
    return tree_attention_reference(q, k, v, prefix_lengths, tree_mask, scale=scale, window=window)
