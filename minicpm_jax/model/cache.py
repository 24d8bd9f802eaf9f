"""The contiguous KV cache: one static-shape row of ``max_length`` tokens per sequence, one pytree donated
through jit.

A cache kind owns its layout: the model and the engine reach K/V only through the operations below
(write a layer's new keys and values, attend over them, take and put rows, commit a speculative path, its
byte size), so another kind (the paged pool of :mod:`minicpm_jax.model.paged_cache`) is a second
implementation of the same operations. Its sharding is decided in :mod:`minicpm_jax.model.parallel`.

What a step reads besides the stored keys travels with the cache it is handed: ``lengths``, the valid
tokens of each row (a paged cache adds its page table). The engine composes that view per step; the
buffers themselves hold only storage.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import NamedTuple

import jax
import jax.numpy as jnp

from minicpm_jax.config import ModelConfig, SparseConfig
from pallas_kernels.infllm.common import Geometry
from pallas_kernels.matmul import SplitSum


def compressed_sizes(sparse: SparseConfig, max_length: int) -> tuple[int, int]:
    """Entries of the K1 and K2 buffers for a cache of ``max_length`` tokens (at least 16 each, the
    stage-1 kernel's smallest key block)."""
    n1 = -(-max_length // sparse.kernel_stride)
    n2 = -(-max_length // sparse.kernel_stride2)
    return max(16, n1), max(16, n2)


@jax.jit
def cleared_lengths(lengths: jax.Array, rows: jax.Array) -> jax.Array:
    """``lengths int32[B]`` with the rows where ``rows bool[B]`` is True set to 0. Jitted: an eager op on
    lengths a step is still computing blocks the host on the CPU backend until the device queue drains (a
    server ending one request would wait for the decode block in flight)."""
    return jnp.where(rows, 0, lengths)


class TreeInputs(NamedTuple):
    """How a chunk of speculative-tree tokens is stored and what it sees (``pallas_kernels.tree_attention``).

    prefix ``int32[B]``: committed tokens before the tree; mask ``bool[B, T, M]``: token ``i`` sees tree
    slot ``j`` (slot ``prefix + j``); offset: tree slot of the chunk's first token (``int32`` scalar; a
    draft step writes after the nodes drafted before it); window (static): committed keys visible, None =
    all; committed (static): the tokens are a chain already accepted (a draft's pending pairs, read as a
    tree for the window): a cache whose tree slots are not their positions (the paged one) stores them at
    their positions too.
    """

    prefix: jax.Array
    mask: jax.Array
    offset: jax.Array | int = 0
    window: int | None = None
    committed: bool = False

    def slots(self, tokens: int) -> jax.Array:
        """``int32[B, tokens]``: the tree slot of each of a chunk's tokens, as a position after the
        committed prefix (``prefix + offset + i``)."""
        return self.prefix[:, None] + self.offset + jnp.arange(tokens, dtype=jnp.int32)[None, :]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer, in the layout the decode kernels read.

    k, v:     ``[num_layers, batch, num_kv_heads, max_length, head_dim]`` (model dtype). Keys are
              stored after RoPE.
    lengths:  ``int32[batch]`` valid tokens per sequence; slots at or past it hold stale data.
    k1, k2:   InfLLM-v2 compressed keys ``[num_layers, batch, num_kv_heads, N1 | N2, head_dim]`` (means of
              32-key windows at stride 16, and of 128-key windows at stride 64, for MiniCPM4), or None
              when the model attends densely. Entry ``j`` is valid once its window is complete.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    k1: jax.Array | None = None
    k2: jax.Array | None = None

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_length(self) -> int:
        return self.k.shape[3]

    @classmethod
    def create(cls, config: ModelConfig, batch_size: int, max_length: int, dtype=jnp.bfloat16,
               sparse: SparseConfig | None = None, kv_heads: int | None = None) -> "KVCache":
        """Zero-filled buffers for ``batch_size`` sequences of up to ``max_length`` tokens, with the
        compressed-key buffers of ``sparse`` (InfLLM-v2 settings) when given. kv_heads: the head axis
        (default the model's; more when tensor parallelism replicates KV heads)."""
        shape = (config.num_layers, batch_size, kv_heads or config.num_kv_heads, max_length, config.head_dim)
        compressed = {}
        if sparse is not None:
            for name, n in zip(("k1", "k2"), compressed_sizes(sparse, max_length)):
                compressed[name] = jnp.zeros((*shape[:3], n, config.head_dim), dtype)
        return cls(
            k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch_size,), jnp.int32),
            **compressed,
        )

    @staticmethod
    def nbytes(config: ModelConfig, batch_size: int, max_length: int, dtype=jnp.bfloat16,
               sparse: SparseConfig | None = None, kv_heads: int | None = None) -> int:
        """Bytes the K and V buffers (and the compressed keys of ``sparse``) take (with ``kv_heads`` as
        :meth:`create`)."""
        rows = 2 * max_length + (sum(compressed_sizes(sparse, max_length)) if sparse is not None else 0)
        per_row = config.num_layers * batch_size * (kv_heads or config.num_kv_heads) * config.head_dim
        return rows * per_row * jnp.dtype(dtype).itemsize

    # ------------------------------------------------------------------ what a layer does with it
    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, positions: jax.Array, valid: jax.Array,
              ops: ModuleType) -> "KVCache":
        """Stores ``k_new, v_new [B, T, kv_heads, head_dim]`` at ``positions [B, T]`` of ``layer`` with the
        kernel backend ``ops``'s ``cache_write`` (see :mod:`pallas_kernels.cache_write`).

        Tokens with ``valid[B, T] == False`` (chunk padding, finished sequences) are dropped, so they can
        never overwrite live entries, even at the end of the buffer.
        """
        k, v = ops.cache_write(self.k, self.v, k_new, v_new, self._slots(positions, valid), layer=layer)
        return dataclasses.replace(self, k=k, v=v)

    def _slots(self, positions: jax.Array, valid: jax.Array) -> jax.Array:
        return jnp.where(valid, positions, self.max_length)  # out of bounds -> dropped

    def write_rotated(self, layer: int, qkv: jax.Array | SplitSum, q_heads: int, cos: jax.Array,
                      sin: jax.Array, positions: jax.Array, valid: jax.Array, ops: ModuleType,
                      dtype=None) -> tuple[jax.Array, "KVCache"]:
        """:meth:`write` of the keys and values of a linear's heads ``qkv [B, T, q_heads + 2·kv_heads, D]``
        (q, k, v), q and k rotated by the RoPE tables ``cos, sin [B, T, D/2]`` first (``ops.rope_write``: one
        launch for decode steps); returns (q rotated ``[B, T, q_heads, D]``, the cache). ``qkv`` may be the
        linear's fp32 K-split parts (``[B, T, heads·D]``), which the op sums and rounds to ``dtype``."""
        q, k, v = ops.rope_write(self.k, self.v, qkv, cos, sin, self._slots(positions, valid), layer=layer,
                                 q_heads=q_heads, dtype=dtype)
        return q, dataclasses.replace(self, k=k, v=v)

    def attend(self, layer: int, q: jax.Array, positions: jax.Array, kv_lengths: jax.Array, ops: ModuleType, *,
               scale: float) -> jax.Array:
        """Causal attention of ``q [B, T, H, D]`` at ``positions int32[B, T]`` over ``layer``'s keys below
        ``kv_lengths int32[B]`` (``ops.attention``); ``[B, T, H, D]``."""
        # The stacked cache goes in whole: kernels read this layer's slice in place.
        return ops.attention(q, self.k, self.v, positions, kv_lengths, scale=scale, layer=layer)

    def write_tree(self, layer: int, k_new: jax.Array, v_new: jax.Array, tree: TreeInputs, valid: jax.Array,
                   ops: ModuleType) -> "KVCache":
        """Stores speculative-tree tokens ``[B, T, kv_heads, head_dim]`` after each row's committed prefix
        (token ``i`` at ``prefix + offset + i``, see :class:`TreeInputs`)."""
        return self.write(layer, k_new, v_new, tree.slots(k_new.shape[1]), valid, ops)

    def attend_tree(self, layer: int, q: jax.Array, tree: TreeInputs, ops: ModuleType, *, scale: float) -> jax.Array:
        """Attention of tree tokens ``q [B, T, H, D]`` over the committed prefix and the tree keys their mask
        names (``ops.tree_attention``); ``[B, T, H, D]``."""
        return ops.tree_attention(q, self.k, self.v, tree.prefix, tree.mask, scale=scale, layer=layer,
                                  window=tree.window)

    # ------------------------------------------------------------------ InfLLM-v2 (sparse models)
    def keys_at(self, layer: int, positions: jax.Array) -> jax.Array:
        """``layer``'s keys at ``positions int32[B, N]`` of each row: ``[B, N, kv_heads, head_dim]``."""
        return self.k[layer, jnp.arange(self.batch_size)[:, None], :, positions]

    def extend_compressed(self, layer: int | None, old_lengths: jax.Array, new_lengths: jax.Array,
                          geometry: Geometry, *, max_tokens: int, ops: ModuleType, unrotate=None) -> "KVCache":
        """``layer``'s (None: every layer's) K1/K2 extended over the windows completed from ``old_lengths``
        to ``new_lengths`` (``int32[B]``, at most ``max_tokens`` apart), averaging keys already in the cache
        (``ops.compress_windows``)."""
        k1, k2 = ops.compress_windows(self.k, self.k1, self.k2, old_lengths, new_lengths, geometry=geometry,
                                      layer=layer, max_tokens=max_tokens, unrotate=unrotate)
        return dataclasses.replace(self, k1=k1, k2=k2)

    def attend_sparse(self, layer: int, q: jax.Array, q_select: jax.Array, positions: jax.Array,
                      kv_lengths: jax.Array, geometry: Geometry, ops: ModuleType, *, scale: float) -> jax.Array:
        """InfLLM-v2 attention of ``q [B, T, H, D]`` (post-RoPE; selection by ``q_select``) over ``layer``
        (``ops.sparse_attention``); ``[B, T, H, D]``."""
        return ops.sparse_attention(q, q_select, self.k, self.v, self.k1, self.k2, positions, kv_lengths, scale=scale,
                                    geometry=geometry, layer=layer)

    def select_blocks(self, layer: int, q_select: jax.Array, positions: jax.Array, kv_lengths: jax.Array,
                      geometry: Geometry, ops: ModuleType, *, scale: float, score_positions: jax.Array | None = None,
                      extra_logits: jax.Array | None = None) -> jax.Array:
        """InfLLM-v2's selection: the blocks each query attends ``int32[B, KVH, T, K]`` (``ops.select_blocks``
        over the cache's ``ceil(max_length / block_size)`` blocks)."""
        return ops.select_blocks(q_select, self.k1, self.k2, positions, kv_lengths, scale=scale, geometry=geometry,
                                 num_blocks=-(-self.max_length // geometry.block_size), layer=layer,
                                 score_positions=score_positions, extra_logits=extra_logits)

    def attend_blocks(self, layer: int, q: jax.Array, positions: jax.Array, kv_lengths: jax.Array,
                      blocks: jax.Array, ops: ModuleType, *, scale: float,
                      block_size: int) -> tuple[jax.Array, jax.Array]:
        """Attention of ``q`` over the selected ``blocks`` of ``block_size`` tokens, with its fp32 log-sum-exp
        ``[B, T, H]`` (``ops.block_sparse_attention``)."""
        return ops.block_sparse_attention(q, self.k, self.v, positions, kv_lengths, blocks, scale=scale,
                                          block_size=block_size, layer=layer, return_lse=True)

    # ------------------------------------------------------------------ what the engine does with it
    def take_rows(self, idx: jax.Array) -> "KVCache":
        """The cache of the rows ``idx int32[b]`` alone (a ``b``-row cache: a copy of those rows)."""
        return jax.tree.map(lambda x: jnp.take(x, idx, axis=0 if x.ndim == 1 else 1), self)

    def put_rows(self, idx: jax.Array, rows: "KVCache") -> "KVCache":
        """This cache with the rows ``idx int32[b]`` replaced by ``rows`` (a ``b``-row cache, see
        :meth:`take_rows`)."""
        return jax.tree.map(lambda x, r: x.at[idx].set(r) if x.ndim == 1 else x.at[:, idx].set(r), self, rows)

    def commit_path(self, prefix: jax.Array, path: jax.Array, accepted: jax.Array) -> "KVCache":
        """Moves a verified speculative path into place: the tree token ``path[:, j]`` (stored by
        :meth:`write_tree` with offset 0) becomes position ``prefix + j`` for ``j < accepted`` in every
        layer; lengths become ``prefix + accepted``.

        prefix, accepted ``int32[B]``; path ``int32[B, A]`` (tree node of each depth, root first).
        """
        b, a = path.shape
        rows = jnp.arange(b)[:, None]
        src = jnp.minimum(prefix[:, None] + path, self.max_length - 1)
        k = self.k[:, rows, :, src]  # [B, A, L, KVH, D] (advanced indices first)
        v = self.v[:, rows, :, src]
        j = jnp.arange(a, dtype=jnp.int32)[None, :]
        dst = jnp.where(j < accepted[:, None], prefix[:, None] + j, self.max_length)  # out of range: dropped
        return dataclasses.replace(
            self,
            k=self.k.at[:, rows, :, dst].set(k, mode="drop"),
            v=self.v.at[:, rows, :, dst].set(v, mode="drop"),
            lengths=prefix + accepted,
        )

    def reset(self, rows: jax.Array | None = None) -> "KVCache":
        """Marks all sequences (or those where ``rows[B]`` is True) as empty; buffers are not cleared."""
        lengths = jnp.zeros_like(self.lengths) if rows is None else cleared_lengths(self.lengths, rows)
        return dataclasses.replace(self, lengths=lengths)

    def with_pages_of(self, cache) -> "KVCache":
        """This cache viewing the pages of ``cache`` (a draft's cache beside its target's); a contiguous
        cache has no pages: itself."""
        return self

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        """This cache with each row's valid length set to ``lengths int32[B]`` (stale entries past it are
        ignored and later overwritten)."""
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))

    def is_deleted(self) -> bool:
        """Whether the buffers were donated to a step that never returned (an interrupted call)."""
        return self.k.is_deleted()
