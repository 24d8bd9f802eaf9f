"""Static-shape KV cache: preallocated buffers plus per-sequence lengths, one pytree donated through jit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minicpm_jax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer, in the layout the decode kernels read.

    k, v:     ``[num_layers, batch, num_kv_heads, max_length, head_dim]`` (model dtype). Keys are
              stored after RoPE.
    lengths:  ``int32[batch]`` valid tokens per sequence; slots at or past it hold stale data.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_length(self) -> int:
        return self.k.shape[3]

    @classmethod
    def create(cls, config: ModelConfig, batch_size: int, max_length: int, dtype=jnp.bfloat16) -> "KVCache":
        """Zero-filled buffers for ``batch_size`` sequences of up to ``max_length`` tokens."""
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_length, config.head_dim)
        return cls(
            k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch_size,), jnp.int32)
        )

    @staticmethod
    def nbytes(config: ModelConfig, batch_size: int, max_length: int, dtype=jnp.bfloat16) -> int:
        """Bytes the K and V buffers take."""
        per = config.num_layers * batch_size * config.num_kv_heads * max_length * config.head_dim
        return 2 * per * jnp.dtype(dtype).itemsize

    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, positions: jax.Array, valid: jax.Array) -> "KVCache":
        """Stores ``k_new, v_new [B, T, kv_heads, head_dim]`` at ``positions [B, T]`` of ``layer``.

        Tokens with ``valid[B, T] == False`` (chunk padding, finished sequences) are dropped, so they can
        never overwrite live entries, even at the end of the buffer.
        """
        idx = jnp.where(valid, positions, self.max_length)  # out of bounds -> dropped by the scatter
        rows = jnp.arange(self.batch_size)[:, None]
        k = self.k.at[layer, rows, :, idx].set(k_new.astype(self.k.dtype), mode="drop")
        v = self.v.at[layer, rows, :, idx].set(v_new.astype(self.v.dtype), mode="drop")
        return dataclasses.replace(self, k=k, v=v)

    def reset(self, rows: jax.Array | None = None) -> "KVCache":
        """Marks all sequences (or those where ``rows[B]`` is True) as empty; buffers are not cleared."""
        lengths = jnp.zeros_like(self.lengths) if rows is None else jnp.where(rows, 0, self.lengths)
        return dataclasses.replace(self, lengths=lengths)
