"""Static-shape KV cache: preallocated buffers plus per-sequence lengths, one pytree donated through jit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minicpm_jax.config import ModelConfig, SparseConfig


def compressed_sizes(sparse: SparseConfig, max_length: int) -> tuple[int, int]:
    """Entries of the K1 and K2 buffers for a cache of ``max_length`` tokens (at least 16 each, the
    stage-1 kernel's smallest key block)."""
    n1 = -(-max_length // sparse.kernel_stride)
    n2 = -(-max_length // sparse.kernel_stride2)
    return max(16, n1), max(16, n2)


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

    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, positions: jax.Array, valid: jax.Array,
              writer) -> "KVCache":
        """Stores ``k_new, v_new [B, T, kv_heads, head_dim]`` at ``positions [B, T]`` of ``layer`` with
        ``writer`` (a kernel backend's ``cache_write``, see :mod:`pallas_kernels.cache_write`).

        Tokens with ``valid[B, T] == False`` (chunk padding, finished sequences) are dropped, so they can
        never overwrite live entries, even at the end of the buffer.
        """
        slots = jnp.where(valid, positions, self.max_length)  # out of bounds -> dropped
        k, v = writer(self.k, self.v, k_new, v_new, slots, layer=layer)
        return dataclasses.replace(self, k=k, v=v)

    def reset(self, rows: jax.Array | None = None) -> "KVCache":
        """Marks all sequences (or those where ``rows[B]`` is True) as empty; buffers are not cleared."""
        lengths = jnp.zeros_like(self.lengths) if rows is None else jnp.where(rows, 0, self.lengths)
        return dataclasses.replace(self, lengths=lengths)
