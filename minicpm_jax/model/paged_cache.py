"""The paged KV cache: one static pool of fixed-size pages per layer, shared by every sequence through
page tables (vLLM's PagedAttention layout), so a sequence holds only the pages its tokens fill and a
prompt prefix computed once can be shared by many sequences (the engine's prefix cache).

The pool is storage only. A step is handed a :class:`PagedKVCache` — the pool plus the page table and
lengths of the rows it runs — which the engine composes from its host-side books
(:mod:`minicpm_jax.engine.pages`); every shape is static (pool size, rows, pages per row), so requests
come and go without recompilation. The operations are those of the contiguous
:class:`~minicpm_jax.model.cache.KVCache`, run by the kernel backend's paged ops.

InfLLM-v2's compressed keys live in the pages too (``k1``/``k2``, the layout of
:mod:`pallas_kernels.infllm.paged`: each entry in the page of its window's last key, so a page shared by
prefix carries its compressed keys, and the attended blocks are pages).

Speculative-tree tokens are not written into the sequence's pages: each row has a scratch region of
``tree_slots`` contiguous slots past the pages (its tree is verified there, then the accepted path is
copied into the row's pages by :meth:`PagedKVCache.commit_path`), so a rejected branch never touches a
page, shared or not.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import jax
import jax.numpy as jnp

from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.cache import TreeInputs, cleared_lengths
from pallas_kernels.infllm.common import Geometry
from pallas_kernels.infllm.paged import check_paged_geometry
from pallas_kernels.matmul import SplitSum

# A row's tree scratch region holds a whole tree (MAX_TREE_NODES of pallas_kernels.tree_attention).
TREE_SLOTS = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """A step's view of the paged pool.

    k, v:        ``[num_layers, kv_heads, num_pages * page_size + batch * tree_slots, head_dim]`` (model
                 dtype): the pool's flat slots, keys after RoPE; position ``t`` of row ``b`` is slot
                 ``page_table[b, t // page_size] * page_size + t % page_size``; the last
                 ``batch * tree_slots`` slots are the rows' tree scratch regions.
    page_table:  ``int32[batch, pages_per_row]`` each row's pages in order (entries past a row's pages
                 name any page: the kernels never read past a row's length).
    lengths:     ``int32[batch]`` valid tokens per row.
    tree_base:   ``int32[batch]`` the first slot of each row's tree scratch region.
    k1, k2:      InfLLM-v2's compressed keys ``[num_layers, kv_heads, num_pages * page_size / stride, head_dim]``
                 (fine and coarse; :mod:`pallas_kernels.infllm.paged`), or None when the model attends
                 densely.
    page_size, max_length (static): tokens per page; the most tokens a row holds
                 (``pages_per_row * page_size`` rounded down to the model's cache length).
    """

    k: jax.Array
    v: jax.Array
    page_table: jax.Array
    lengths: jax.Array
    tree_base: jax.Array
    k1: jax.Array | None = None
    k2: jax.Array | None = None
    page_size: int = dataclasses.field(metadata=dict(static=True), default=64)
    max_length: int = dataclasses.field(metadata=dict(static=True), default=0)

    @property
    def batch_size(self) -> int:
        return self.page_table.shape[0]

    @staticmethod
    def pages_per_row(max_length: int, page_size: int) -> int:
        return -(-max_length // page_size)

    @staticmethod
    def check_sparse(sparse: SparseConfig, page_size: int) -> None:
        """MiniCPMError unless InfLLM-v2's geometry maps onto pages of ``page_size`` tokens (a page is one
        attended block; whole compressed entries per page)."""
        try:
            check_paged_geometry(page_size, block_size=sparse.block_size, stride1=sparse.kernel_stride,
                                 stride2=sparse.kernel_stride2)
        except ValueError as e:
            raise MiniCPMError(f"{e} (--page_size {sparse.block_size})") from None

    @staticmethod
    def compressed_per_page(sparse: SparseConfig | None, page_size: int) -> tuple[int, int]:
        """Fine and coarse compressed entries each page holds (0, 0 for dense attention)."""
        if sparse is None:
            return 0, 0
        return page_size // sparse.kernel_stride, page_size // sparse.kernel_stride2

    @classmethod
    def create(cls, config: ModelConfig, *, num_pages: int, page_size: int, batch_size: int, max_length: int,
               dtype=jnp.bfloat16, kv_heads: int | None = None, scratch_rows: int | None = None,
               sparse: SparseConfig | None = None) -> "PagedKVCache":
        """A zero-filled pool of ``num_pages`` pages of ``page_size`` tokens, viewed by ``batch_size`` rows of up
        to ``max_length`` tokens (every row empty, its page table all page 0), with the compressed keys of
        ``sparse`` (InfLLM-v2 settings) when given. kv_heads: the head axis (default the model's; more when
        tensor parallelism replicates KV heads). scratch_rows: tree scratch regions to allocate (default
        ``batch_size``; a view of fewer rows shares them)."""
        scratch_rows = batch_size if scratch_rows is None else scratch_rows
        slots = num_pages * page_size + scratch_rows * TREE_SLOTS
        heads = kv_heads or config.num_kv_heads
        shape = (config.num_layers, heads, slots, config.head_dim)
        compressed = {}
        if sparse is not None:
            cls.check_sparse(sparse, page_size)
            for name, per_page in zip(("k1", "k2"), cls.compressed_per_page(sparse, page_size)):
                compressed[name] = jnp.zeros((config.num_layers, heads, num_pages * per_page, config.head_dim), dtype)
        return cls(
            k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
            page_table=jnp.zeros((batch_size, cls.pages_per_row(max_length, page_size)), jnp.int32),
            lengths=jnp.zeros((batch_size,), jnp.int32),
            tree_base=num_pages * page_size + TREE_SLOTS * jnp.arange(batch_size, dtype=jnp.int32),
            page_size=page_size, max_length=max_length, **compressed,
        )

    @classmethod
    def nbytes(cls, config: ModelConfig, num_pages: int, page_size: int, batch_size: int, dtype=jnp.bfloat16,
               kv_heads: int | None = None, sparse: SparseConfig | None = None) -> int:
        """Bytes of the pools (with ``batch_size`` tree scratch regions, and ``sparse``'s compressed keys)."""
        scratch = 2 * batch_size * TREE_SLOTS * config.num_layers * (kv_heads or config.num_kv_heads) * \
            config.head_dim * jnp.dtype(dtype).itemsize
        return num_pages * cls.page_nbytes(config, page_size, dtype, kv_heads, sparse) + scratch

    @classmethod
    def page_nbytes(cls, config: ModelConfig, page_size: int, dtype=jnp.bfloat16, kv_heads: int | None = None,
                    sparse: SparseConfig | None = None) -> int:
        """Bytes one page takes over every layer: its K and V (and ``sparse``'s compressed keys)."""
        rows = 2 * page_size + sum(cls.compressed_per_page(sparse, page_size))
        return rows * config.num_layers * (kv_heads or config.num_kv_heads) * config.head_dim * \
            jnp.dtype(dtype).itemsize

    def slots_of(self, positions: jax.Array) -> jax.Array:
        """The pool slots of positions ``int32[B, T]`` of each row (positions past the page table are
        clipped to its last entry: callers mask them)."""
        page = jnp.clip(positions // self.page_size, 0, self.page_table.shape[1] - 1)
        pages = jnp.take_along_axis(self.page_table, page, axis=1)
        return pages * self.page_size + positions % self.page_size

    # ------------------------------------------------------------------ what a layer does with it
    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, positions: jax.Array, valid: jax.Array,
              ops: ModuleType) -> "PagedKVCache":
        """Stores ``k_new, v_new [B, T, kv_heads, head_dim]`` at ``positions [B, T]`` of each row (through its
        page table); tokens with ``valid[B, T] == False`` or at or past ``max_length`` are dropped."""
        k, v = ops.paged_cache_write(self.k, self.v, k_new, v_new, self._slots(positions, valid), layer=layer)
        return dataclasses.replace(self, k=k, v=v)

    def _slots(self, positions: jax.Array, valid: jax.Array) -> jax.Array:
        keep = valid & (positions >= 0) & (positions < self.max_length)
        return jnp.where(keep, self.slots_of(positions), self.k.shape[2])  # out of bounds -> dropped

    def write_rotated(self, layer: int, qkv: jax.Array | SplitSum, q_heads: int, cos: jax.Array,
                      sin: jax.Array, positions: jax.Array, valid: jax.Array, ops: ModuleType,
                      dtype=None) -> tuple[jax.Array, "PagedKVCache"]:
        """:meth:`write` of a linear's heads ``qkv [B, T, q_heads + 2·kv_heads, D]`` with q and k rotated
        first (``ops.paged_rope_write``), as :meth:`KVCache.write_rotated`; returns (q rotated, the cache)."""
        q, k, v = ops.paged_rope_write(self.k, self.v, qkv, cos, sin, self._slots(positions, valid), layer=layer,
                                       q_heads=q_heads, dtype=dtype)
        return q, dataclasses.replace(self, k=k, v=v)

    def attend(self, layer: int, q: jax.Array, positions: jax.Array, kv_lengths: jax.Array, ops: ModuleType, *,
               scale: float) -> jax.Array:
        """Causal attention of ``q [B, T, H, D]`` at ``positions int32[B, T]`` over each row's keys below
        ``kv_lengths int32[B]``, read through the page table (``ops.paged_attention``)."""
        return ops.paged_attention(q, self.k, self.v, self.page_table, positions, kv_lengths, scale=scale,
                                   page_size=self.page_size, layer=layer)

    def write_tree(self, layer: int, k_new: jax.Array, v_new: jax.Array, tree: TreeInputs, valid: jax.Array,
                   ops: ModuleType) -> "PagedKVCache":
        """Stores speculative-tree tokens ``[B, T, kv_heads, head_dim]`` in each row's scratch region (token
        ``i`` at ``tree_base + offset + i``); ``tree.committed`` tokens also at their positions in the row's
        pages (in the same scatter: a copy out of the scratch region would read the pool it writes, and XLA
        would copy the whole pool)."""
        t = k_new.shape[1]
        slots = self.tree_base[:, None] + tree.offset + jnp.arange(t, dtype=jnp.int32)[None, :]
        slots = jnp.where(valid, slots, self.k.shape[2])
        if tree.committed:
            positions = tree.slots(t)
            pages = jnp.where(valid & (positions < self.max_length), self.slots_of(positions), self.k.shape[2])
            slots = jnp.concatenate([slots, pages], axis=1)
            k_new, v_new = (jnp.concatenate([x, x], axis=1) for x in (k_new, v_new))
        k, v = ops.paged_cache_write(self.k, self.v, k_new, v_new, slots, layer=layer)
        return dataclasses.replace(self, k=k, v=v)

    def attend_tree(self, layer: int, q: jax.Array, tree: TreeInputs, ops: ModuleType, *, scale: float) -> jax.Array:
        """Attention of tree tokens ``q [B, T, H, D]`` over the committed prefix (through the page table) and
        the tree keys of the scratch region their mask names (``ops.paged_tree_attention``)."""
        return ops.paged_tree_attention(q, self.k, self.v, self.page_table, tree.prefix, tree.mask, self.tree_base,
                                        scale=scale, page_size=self.page_size, layer=layer, window=tree.window)

    # ------------------------------------------------------------------ InfLLM-v2 (sparse models)
    def keys_at(self, layer: int, positions: jax.Array) -> jax.Array:
        """``layer``'s keys at ``positions int32[B, N]`` of each row: ``[B, N, kv_heads, head_dim]``."""
        return jnp.moveaxis(self.k[layer][:, self.slots_of(positions)], 0, 2)

    def extend_compressed(self, layer: int | None, old_lengths: jax.Array, new_lengths: jax.Array,
                          geometry: Geometry, *, max_tokens: int, ops: ModuleType, unrotate=None) -> "PagedKVCache":
        """``layer``'s (None: every layer's) compressed keys extended over the windows completed from ``old_lengths`` to
        ``new_lengths`` (``int32[B]``, at most ``max_tokens`` apart), written into the pages they end in."""
        k1, k2 = ops.paged_compress_windows(self.k, self.k1, self.k2, self.page_table, old_lengths, new_lengths,
                                            geometry=geometry, layer=layer, max_tokens=max_tokens,
                                            page_size=self.page_size, unrotate=unrotate)
        return dataclasses.replace(self, k1=k1, k2=k2)

    def attend_sparse(self, layer: int, q: jax.Array, q_select: jax.Array, positions: jax.Array,
                      kv_lengths: jax.Array, geometry: Geometry, ops: ModuleType, *, scale: float) -> jax.Array:
        """InfLLM-v2 attention of ``q [B, T, H, D]`` over the rows' pages (``ops.paged_sparse_attention``)."""
        return ops.paged_sparse_attention(q, q_select, self.k, self.v, self.k1, self.k2, self.page_table, positions,
                                          kv_lengths, scale=scale, geometry=geometry, layer=layer,
                                          page_size=self.page_size)

    def select_blocks(self, layer: int, q_select: jax.Array, positions: jax.Array, kv_lengths: jax.Array,
                      geometry: Geometry, ops: ModuleType, *, scale: float, score_positions: jax.Array | None = None,
                      extra_logits: jax.Array | None = None) -> jax.Array:
        """InfLLM-v2's selection: the blocks (pages, by index in each row) each query attends
        ``int32[B, KVH, T, K]`` (``ops.paged_select_blocks``)."""
        return ops.paged_select_blocks(q_select, self.k1, self.k2, self.page_table, positions, kv_lengths,
                                       scale=scale, geometry=geometry, layer=layer, page_size=self.page_size,
                                       score_positions=score_positions, extra_logits=extra_logits)

    def attend_blocks(self, layer: int, q: jax.Array, positions: jax.Array, kv_lengths: jax.Array,
                      blocks: jax.Array, ops: ModuleType, *, scale: float,
                      block_size: int) -> tuple[jax.Array, jax.Array]:
        """Attention of ``q`` over the selected ``blocks`` (pages: ``block_size`` is the page size), with its
        fp32 log-sum-exp ``[B, T, H]`` (``ops.paged_block_sparse_attention``)."""
        return ops.paged_block_sparse_attention(q, self.k, self.v, self.page_table, positions, kv_lengths, blocks,
                                                scale=scale, block_size=block_size, layer=layer, return_lse=True)

    # ------------------------------------------------------------------ what the engine does with it
    def take_rows(self, idx: jax.Array) -> "PagedKVCache":
        """The view of the rows ``idx int32[b]`` alone: the same pool (nothing is copied), their page
        tables, lengths and scratch regions."""
        return dataclasses.replace(self, page_table=self.page_table[idx], lengths=self.lengths[idx],
                                   tree_base=self.tree_base[idx])

    def put_rows(self, idx: jax.Array, rows: "PagedKVCache") -> "PagedKVCache":
        """This view with the pool written by ``rows`` (a view of the rows ``idx``, see :meth:`take_rows`) and
        those rows' lengths."""
        return dataclasses.replace(self, k=rows.k, v=rows.v, k1=rows.k1, k2=rows.k2,
                                   lengths=self.lengths.at[idx].set(rows.lengths))

    def commit_path(self, prefix: jax.Array, path: jax.Array, accepted: jax.Array) -> "PagedKVCache":
        """Moves a verified speculative path into place: the tree token ``path[:, j]`` of the scratch region
        (stored by :meth:`write_tree` with offset 0) becomes position ``prefix + j`` of the row's pages for
        ``j < accepted``, in every layer; lengths become ``prefix + accepted``.

        prefix, accepted ``int32[B]``; path ``int32[B, A]`` (tree node of each depth, root first).
        """
        a = path.shape[1]
        src = self.tree_base[:, None] + path  # [B, A]
        j = jnp.arange(a, dtype=jnp.int32)[None, :]
        dst_pos = prefix[:, None] + j
        keep = (j < accepted[:, None]) & (dst_pos < self.max_length)
        dst = jnp.where(keep, self.slots_of(dst_pos), self.k.shape[2])  # out of range: dropped
        return dataclasses.replace(
            self,
            k=self.k.at[:, :, dst].set(self.k[:, :, src], mode="drop"),
            v=self.v.at[:, :, dst].set(self.v[:, :, src], mode="drop"),
            lengths=prefix + accepted,
        )

    def reset(self, rows: jax.Array | None = None) -> "PagedKVCache":
        """Marks all rows (or those where ``rows[B]`` is True) as empty; the pool is not cleared."""
        lengths = jnp.zeros_like(self.lengths) if rows is None else cleared_lengths(self.lengths, rows)
        return dataclasses.replace(self, lengths=lengths)

    def with_lengths(self, lengths: jax.Array) -> "PagedKVCache":
        """This view with each row's valid length set to ``lengths int32[B]``."""
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))

    def with_pages_of(self, cache: "PagedKVCache") -> "PagedKVCache":
        """This pool viewed through ``cache``'s page table: a draft's pool whose pages are its target's
        (page ``p`` of both holds the same positions), taken by the same rows."""
        return dataclasses.replace(self, page_table=cache.page_table)

    def with_page_table(self, page_table) -> "PagedKVCache":
        """This view with the page table ``int32[B, pages_per_row]`` (the engine's host books)."""
        return dataclasses.replace(self, page_table=jnp.asarray(page_table, jnp.int32))

    def is_deleted(self) -> bool:
        """Whether the pool was donated to a step that never returned (an interrupted call)."""
        return self.k.is_deleted()
