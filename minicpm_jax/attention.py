"""GQA self-attention with RoPE over the static KV cache.

The attention op is chosen by one setting, ``attention_impl``: ``xla`` is the plain-jnp reference (the
oracle for every kernel, and the fallback where kernels are unsupported). Kernels registered in
``ATTENTION_IMPLS`` share the reference's signature.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from minicpm_jax.cache import KVCache
from minicpm_jax.config import ModelConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.layers import Linear
from minicpm_jax.rope import apply_rope, rope_frequencies


def attention_xla(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *, scale: float
) -> jax.Array:
    """Causal GQA attention of a chunk of queries against a cache (plain-jnp reference).

    q:           ``[B, T, num_heads, head_dim]``; query head ``h`` reads KV head ``h // (num_heads/num_kv_heads)``.
    k, v:        ``[B, num_kv_heads, S, head_dim]`` (the chunk's own keys already written).
    q_positions: ``int32[B, T]`` absolute position of each query; key ``s`` is visible iff
                 ``s <= q_positions`` and ``s < kv_lengths``.
    kv_lengths:  ``int32[B]`` valid cache length after the chunk was written.
    Returns ``[B, T, num_heads, head_dim]`` in q.dtype; softmax in fp32.
    """
    b, t, h, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    key_pos = jnp.arange(s, dtype=jnp.int32)
    visible = (key_pos[None, None, :] <= q_positions[:, :, None]) & (key_pos[None, None, :] < kv_lengths[:, None, None])
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, None, None], probs, 0.0)  # rows with nothing visible give 0, not NaN
    out = jnp.einsum("bkgts,bksd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


AttentionFn = Callable[..., jax.Array]
ATTENTION_IMPLS: dict[str, AttentionFn] = {"xla": attention_xla}


def get_attention_impl(name: str) -> AttentionFn:
    """The attention op registered under ``name``; MiniCPMError for unknown names."""
    if name not in ATTENTION_IMPLS:
        raise MiniCPMError(f"attention_impl {name!r} is not available (choose from {', '.join(sorted(ATTENTION_IMPLS))})")
    return ATTENTION_IMPLS[name]


class Attention(nnx.Module):
    """``o_proj(attn(rope(q), rope(k), v))`` with q/k/v fused into ``qkv_proj``."""

    def __init__(
        self, config: ModelConfig, layer: int, *, max_length: int, attention_impl: str, rngs: nnx.Rngs, dtype
    ):
        self.config = config
        self.layer = layer
        self.max_length = max_length
        self.attention_impl = attention_impl
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, qkv_out, rngs=rngs, dtype=dtype)
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size, rngs=rngs, dtype=dtype)

    def __call__(
        self, x: jax.Array, positions: jax.Array, valid: jax.Array, cache: KVCache, kv_lengths: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """x ``[B, T, hidden]``, positions ``int32[B, T]``, valid ``bool[B, T]``; returns (``[B, T, hidden]``, cache)."""
        cfg = self.config
        b, t, _ = x.shape
        nq, nkv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        qkv = self.qkv_proj(x)
        q = qkv[..., :nq].reshape(b, t, cfg.num_heads, d)
        k = qkv[..., nq : nq + nkv].reshape(b, t, cfg.num_kv_heads, d)
        v = qkv[..., nq + nkv :].reshape(b, t, cfg.num_kv_heads, d)
        inv_freq, rope_scale = rope_frequencies(cfg.rope, d, self.max_length, cfg.max_position_embeddings)
        q = apply_rope(q, positions, inv_freq, rope_scale)
        k = apply_rope(k, positions, inv_freq, rope_scale)
        cache = cache.write(self.layer, k, v, positions, valid)
        attend = get_attention_impl(self.attention_impl)
        out = attend(q, cache.k[self.layer], cache.v[self.layer], positions, kv_lengths, scale=d**-0.5)
        return self.o_proj(out.reshape(b, t, nq)), cache
