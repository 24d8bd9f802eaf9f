"""GQA self-attention with RoPE over the static KV cache.

The attention op is chosen by one setting, ``attention_impl``: ``xla`` is the plain-jnp reference (the
oracle for every kernel, and the fallback where kernels are unsupported), ``pallas`` the kernels of
``pallas_kernels.attention``, ``auto`` the kernels on a GPU and the reference elsewhere. All share the
reference's signature.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from minicpm_jax.cache import KVCache
from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.layers import make_linear
from minicpm_jax.quant import QuantSpec
from minicpm_jax.rope import apply_rope, rope_frequencies
from minicpm_jax.sparse import extend_compressed, rope_inverse, sparse_attention, tree_sparse_attention
from pallas_kernels.attention import (
    MAX_DECODE_QUERIES,
    attention_reference,
    decode_attention,
    kernels_support,
    prefill_attention,
)
from pallas_kernels.cache_write import cache_write, cache_write_reference
from pallas_kernels.tree_attention import tree_attention, tree_attention_reference



def attention_pallas(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *,
    scale: float, layer: int | None = None,
) -> jax.Array:
    """The Pallas kernels: flash-decoding for up to 16 query tokens per sequence (decode, tree
    verification), flash attention for longer chunks (prefill). Signature of ``attention_reference``."""
    kernel = decode_attention if q.shape[1] <= MAX_DECODE_QUERIES else prefill_attention
    return kernel(q, k, v, q_positions, kv_lengths, scale=scale, layer=layer)


AttentionFn = Callable[..., jax.Array]
ATTENTION_IMPLS: dict[str, AttentionFn] = {"xla": attention_reference, "pallas": attention_pallas}
# Tree-verification attention (speculative decoding), by the same names.
TREE_ATTENTION_IMPLS: dict[str, AttentionFn] = {"xla": tree_attention_reference, "pallas": tree_attention}
# Storing the new tokens' K/V in the cache (``KVCache.write``'s writer), by the same names.
CACHE_WRITERS: dict[str, Callable] = {"xla": cache_write_reference, "pallas": cache_write}


class TreeInputs(NamedTuple):
    """How a chunk of speculative-tree tokens is stored and what it sees (``pallas_kernels.tree_attention``).

    prefix ``int32[B]``: committed tokens before the tree; mask ``bool[B, T, M]``: token ``i`` sees tree
    slot ``j`` (slot ``prefix + j``); offset: tree slot of the chunk's first token (``int32`` scalar; a
    draft step writes after the nodes drafted before it); window (static): committed keys visible, None =
    all.
    """

    prefix: jax.Array
    mask: jax.Array
    offset: jax.Array | int = 0
    window: int | None = None
ATTENTION_CHOICES = ("auto", "xla", "pallas")


def resolve_attention_impl(name: str, head_dim: int) -> str:
    """``auto`` → ``pallas`` on a GPU when the kernels support ``head_dim`` (a power of 2 ≥ 16), else
    ``xla``; other names are checked and returned."""
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" and kernels_support(head_dim) else "xla"
    get_attention_impl(name)
    if name == "pallas" and not kernels_support(head_dim):
        raise MiniCPMError(f"attention_impl 'pallas' needs a power-of-2 head_dim >= 16, this model has {head_dim} (use xla)")
    return name


def get_attention_impl(name: str) -> AttentionFn:
    """The attention op registered under ``name``; MiniCPMError for unknown names."""
    if name not in ATTENTION_IMPLS:
        raise MiniCPMError(f"attention_impl {name!r} is not available (choose from {', '.join(ATTENTION_CHOICES)})")
    return ATTENTION_IMPLS[name]


class Attention(nnx.Module):
    """``o_proj(attn(rope(q), rope(k), v))`` with q/k/v fused into ``qkv_proj``."""

    def __init__(
        self, config: ModelConfig, layer: int, *, max_length: int, attention_impl: str, rngs: nnx.Rngs, dtype,
        quant: QuantSpec | None = None, sparse: SparseConfig | None = None, in_features: int | None = None,
    ):
        """in_features: width of the input to ``qkv_proj`` (default hidden_size; an EAGLE-3 draft layer
        reads ``[embedding; hidden]``, twice that)."""
        self.config = config
        self.layer = layer
        self.max_length = max_length
        self.attention_impl = attention_impl
        self.sparse = sparse
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        linear = dict(impl=attention_impl, rngs=rngs, dtype=dtype)
        self.qkv_proj = make_linear(in_features or config.hidden_size, qkv_out, quant, **linear)
        self.o_proj = make_linear(config.num_heads * config.head_dim, config.hidden_size, quant, **linear)

    def extend_compressed(self, cache: KVCache, old_lengths: jax.Array, new_lengths: jax.Array,
                          max_tokens: int) -> KVCache:
        """This layer's K1/K2 extended over keys already in the cache (``old_lengths`` → ``new_lengths``,
        ``int32[B]``, at most ``max_tokens`` apart): what a forward over those tokens would have added."""
        sp = self.sparse
        unrotate = None
        if sp.use_nope:
            inv_freq, rope_scale = rope_frequencies(self.config.rope, self.config.head_dim, self.max_length,
                                                    self.config.max_position_embeddings)
            unrotate = rope_inverse(inv_freq, rope_scale)
        return extend_compressed(cache, self.layer, old_lengths, new_lengths, sp, max_tokens=max_tokens,
                                 unrotate=unrotate, impl=self.attention_impl)

    def __call__(
        self, x: jax.Array, positions: jax.Array, valid: jax.Array, cache: KVCache, kv_lengths: jax.Array,
        mode: str = "dense", tree: TreeInputs | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """x ``[B, T, hidden]``, positions ``int32[B, T]``, valid ``bool[B, T]``; returns (``[B, T, hidden]``, cache).

        mode (static): ``dense``; ``sparse`` (InfLLM-v2 for every row); ``mixed`` (both, each row taking
        sparse iff ``kv_lengths >= dense_len``). With sparse settings the compressed caches are extended
        in every mode.
        tree: speculative-tree tokens (:class:`TreeInputs`): token ``i`` is stored at slot
        ``prefix + offset + i`` (``positions`` are then only its RoPE positions) and attends to the prefix
        and to the tree slots its mask names; with sparse settings and mode ``sparse`` (or ``mixed``, by
        each node's length) as plain InfLLM-v2 decoding of its ancestor path would
        (:func:`~minicpm_jax.sparse.tree_sparse_attention`). The compressed caches are left to the committed
        tokens (:meth:`extend_compressed` after the accepted path is in place).
        """
        cfg = self.config
        b, t, _ = x.shape
        nq, nkv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        qkv = self.qkv_proj(x)
        q = qkv[..., :nq].reshape(b, t, cfg.num_heads, d)
        k = qkv[..., nq : nq + nkv].reshape(b, t, cfg.num_kv_heads, d)
        v = qkv[..., nq + nkv :].reshape(b, t, cfg.num_kv_heads, d)
        inv_freq, rope_scale = rope_frequencies(cfg.rope, d, self.max_length, cfg.max_position_embeddings)
        q_nope = q
        q = apply_rope(q, positions, inv_freq, rope_scale)
        k = apply_rope(k, positions, inv_freq, rope_scale)
        if tree is not None:
            slots = tree.prefix[:, None] + tree.offset + jnp.arange(t, dtype=jnp.int32)[None, :]
            cache = cache.write(self.layer, k, v, slots, valid, CACHE_WRITERS[self.attention_impl])
            dense_tree = lambda: TREE_ATTENTION_IMPLS[self.attention_impl](  # noqa: E731
                q, cache.k, cache.v, tree.prefix, tree.mask, scale=d**-0.5, layer=self.layer, window=tree.window)
            if self.sparse is None or mode == "dense":
                out = dense_tree()
            else:
                sp = self.sparse
                if tree.window is not None or tree.mask.shape[2] != t:
                    raise ValueError("sparse tree attention verifies a whole tree at once (no offset or window)")
                dtype = cache.k.dtype
                sparse_out = tree_sparse_attention(
                    q, q_nope if sp.use_nope else q, k.astype(dtype), v.astype(dtype), tree.mask, cache, self.layer,
                    tree.prefix, positions - tree.prefix[:, None], sp, scale=d**-0.5, impl=self.attention_impl,
                    unrotate=rope_inverse(inv_freq, rope_scale) if sp.use_nope else None)
                if mode == "sparse":
                    out = sparse_out
                else:  # mixed: each node as plain decoding would run it, by its own length
                    use = positions + 1 >= sp.dense_len
                    out = jnp.where(use[:, :, None, None], sparse_out, dense_tree())
            return self.o_proj(out.reshape(b, t, nq)), cache
        cache = cache.write(self.layer, k, v, positions, valid, CACHE_WRITERS[self.attention_impl])
        attend = get_attention_impl(self.attention_impl)
        # The stacked cache goes in whole: kernels read this layer's slice in place.
        dense = lambda: attend(q, cache.k, cache.v, positions, kv_lengths, scale=d**-0.5, layer=self.layer)  # noqa: E731
        if self.sparse is None:
            out = dense()
        else:
            sp = self.sparse
            unrotate = rope_inverse(inv_freq, rope_scale) if sp.use_nope else None
            cache = extend_compressed(cache, self.layer, positions[:, 0], kv_lengths, sp, max_tokens=t,
                                      unrotate=unrotate, impl=self.attention_impl)
            sparse_fn = lambda: sparse_attention(  # noqa: E731
                q, q_nope if sp.use_nope else q, cache, self.layer, positions, kv_lengths, sp, scale=d**-0.5,
                impl=self.attention_impl)
            if mode == "dense":
                out = dense()
            elif mode == "sparse":
                out = sparse_fn()
            else:
                use = kv_lengths >= sp.dense_len
                out = jnp.where(use[:, None, None, None], sparse_fn(), dense())
        return self.o_proj(out.reshape(b, t, nq)), cache
