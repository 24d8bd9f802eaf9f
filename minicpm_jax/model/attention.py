"""GQA self-attention with RoPE over the static KV cache, dense or InfLLM-v2 sparse, for plain tokens and
for speculative-tree tokens.

Every op (the attention itself, the KV write, the int4 matmul of the projections, InfLLM-v2's kernels)
comes from the kernel backend the model was built with (``attention_impl``: ``xla`` = the plain-jnp
references, ``pallas`` = the Pallas kernels; chosen in :mod:`pallas_kernels.backend` only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.infllm.attention import sparse_attention, tree_sparse_attention
from minicpm_jax.infllm.compressed import extend_compressed
from minicpm_jax.model.cache import KVCache, TreeInputs
from minicpm_jax.model.layers import make_linear
from minicpm_jax.model.parallel import EMBED, HEADS, QKV, TensorParallel
from minicpm_jax.model.rope import rope_frequencies, rope_inverse, rope_tables
from minicpm_jax.quant import QuantSpec
from pallas_kernels import backend
from pallas_kernels.matmul import SplitSum, summed
from pallas_kernels.rope_write import rotate


ATTENTION_CHOICES = backend.CHOICES


def resolve_attention_impl(name: str, head_dim: int) -> str:
    """The kernel backend ``name`` resolves to for a model of ``head_dim`` (``auto`` → ``pallas`` on a GPU
    when the kernels support it, else ``xla``); MiniCPMError for unknown or unsupported names."""
    try:
        return backend.resolve(name, head_dim)
    except (backend.UnknownBackend, backend.UnsupportedShape) as e:
        raise MiniCPMError(str(e).replace("kernel backend", "attention_impl")) from None


class Attention(nnx.Module):
    """``o_proj(attn(rope(q), rope(k), v))`` with q/k/v fused into ``qkv_proj``.

    Under tensor parallelism (``tp``) a shard runs its ``tp.q_heads`` query heads and ``tp.kv_heads`` KV
    heads (its block of ``qkv_proj`` is ``[q | k | v]`` of those) against its heads of the cache, and
    ``o_proj`` is row-parallel: the result is this shard's partial sum (:meth:`Linear.partial`; fp32),
    which the decoder layer reduces at the block boundary.
    """

    def __init__(
        self, config: ModelConfig, layer: int, *, max_length: int, attention_impl: str, rngs: nnx.Rngs, dtype,
        quant: QuantSpec | None = None, sparse: SparseConfig | None = None, in_features: int | None = None,
        tp: TensorParallel | None = None,
    ):
        """in_features: width of the input to ``qkv_proj`` (default hidden_size; an EAGLE-3 draft layer
        reads ``[embedding; hidden]``, twice that). attention_impl: a resolved kernel backend name.
        tp: the model's tensor-parallel layout (None: one device)."""
        self.config = config
        self.layer = layer
        self.max_length = max_length
        self.attention_impl = attention_impl
        self.sparse = sparse
        self.tp = tp
        self.q_heads = config.num_heads if tp is None else tp.q_heads  # per shard
        self.kv_heads = config.num_kv_heads if tp is None else tp.kv_heads
        shards = 1 if tp is None else tp.size
        qkv_out = shards * (self.q_heads + 2 * self.kv_heads) * config.head_dim
        linear = dict(impl=attention_impl, rngs=rngs, dtype=dtype, tp=tp)
        self.qkv_proj = make_linear(in_features or config.hidden_size, qkv_out, quant, axes=(EMBED, QKV), **linear)
        self.o_proj = make_linear(config.num_heads * config.head_dim, config.hidden_size, quant, axes=(HEADS, EMBED),
                                  **linear)

    @property
    def kernels(self):
        """The kernel backend namespace every op of this layer runs on."""
        return backend.get(self.attention_impl)

    def _rope(self) -> tuple:
        cfg = self.config
        return rope_frequencies(cfg.rope, cfg.head_dim, self.max_length, cfg.max_position_embeddings)

    def rope_tables(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE's ``cos, sin`` float32 ``[B, T, D/2]`` of ``positions int32[B, T]``: the same in every layer of a
        model, so the model computes them once a forward and passes them to each layer (``tables``)."""
        return rope_tables(positions, *self._rope())

    def _unrotate(self, inv_freq, rope_scale):
        return rope_inverse(inv_freq, rope_scale) if self.sparse.use_nope else None

    def extend_compressed(self, cache: KVCache, old_lengths: jax.Array, new_lengths: jax.Array,
                          max_tokens: int, *, all_layers: bool = False) -> KVCache:
        """This layer's K1/K2 (``all_layers``: every layer's, which share this layer's geometry, RoPE and
        kernels) extended over keys already in the cache (``old_lengths`` → ``new_lengths``, ``int32[B]``, at
        most ``max_tokens`` apart): what a forward over those tokens would have added."""
        layer = None if all_layers else self.layer
        return extend_compressed(cache, layer, old_lengths, new_lengths, self.sparse, max_tokens=max_tokens,
                                 kernels=self.kernels, unrotate=self._unrotate(*self._rope()))

    def __call__(
        self, x: jax.Array, positions: jax.Array, valid: jax.Array, cache: KVCache, kv_lengths: jax.Array,
        mode: str = "dense", tree: TreeInputs | None = None, tables: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """x ``[B, T, hidden]``, positions ``int32[B, T]``, valid ``bool[B, T]``; returns (``[B, T, hidden]``: the output, or
        this shard's fp32 partial sum of it when split, a ``SplitSum``; cache).

        mode (static): ``dense``; ``sparse`` (InfLLM-v2 for every row); ``mixed`` (both, each row taking
        sparse iff ``kv_lengths >= dense_len``). With sparse settings the compressed caches are extended
        here in modes ``sparse`` and ``mixed``, which read them; in mode ``dense`` the caller extends them
        after the last layer (:meth:`extend_compressed`, as ``MiniCPMForCausalLM.forward`` does), since
        reading a layer's keys while later layers write into the same buffer makes XLA copy the whole K
        cache once per layer.
        tree: speculative-tree tokens (:class:`TreeInputs`): token ``i`` is stored at slot
        ``prefix + offset + i`` (``positions`` are then only its RoPE positions) and attends to the prefix
        and to the tree slots its mask names; with sparse settings and mode ``sparse`` (or ``mixed``, by
        each node's length) as plain InfLLM-v2 decoding of its ancestor path would
        (:func:`~minicpm_jax.infllm.attention.tree_sparse_attention`). The compressed caches are left to the
        committed tokens (:meth:`extend_compressed` after the accepted path is in place).
        tables: :meth:`rope_tables` of ``positions`` when the caller has them (None: computed here). Each
        layer's own would be a kernel a layer under tensor parallelism: inside ``shard_map`` every layer's
        frequencies become a separate operand of the decode loop, which XLA does not merge (2× H200: 36 µs a
        step at TP 2).
        """
        cfg = self.config
        ops = self.kernels
        b, t, _ = x.shape
        d = cfg.head_dim
        nq = self.q_heads * d
        # One token a row (decode): the projection's K-split parts go to the RoPE kernel unsummed; it adds them as
        # it reads each head, where the split-K GEMM's own sum was a launch a layer (2x H200, MiniCPM4-8B: 0.03-0.05
        # ms a step faster but at int4 TP 2, which did not move; session 51). Prefill chunks and trees take the
        # product (``heads``; where nothing reads it, XLA drops it).
        projected = self.qkv_proj.parts(x) if t == 1 and tree is None else self.qkv_proj(x)
        heads = summed(projected).astype(x.dtype).reshape(b, t, self.q_heads + 2 * self.kv_heads, d)  # q, k, v
        inv_freq, rope_scale = self._rope()
        cos, sin = rope_tables(positions, inv_freq, rope_scale) if tables is None else tables
        q_nope = heads[:, :, : self.q_heads]
        sp = self.sparse

        def select(q):  # InfLLM-v2's selection queries: scores are summed over a KV head's whole group
            qs = q_nope if sp.use_nope else q
            return qs if self.tp is None else self.tp.group_queries(qs)
        if tree is not None:
            q = rotate(q_nope, cos, sin)
            k = rotate(heads[:, :, self.q_heads : self.q_heads + self.kv_heads], cos, sin)
            v = heads[:, :, self.q_heads + self.kv_heads :]
            cache = cache.write_tree(self.layer, k, v, tree, valid, ops)
            dense_tree = lambda: cache.attend_tree(self.layer, q, tree, ops, scale=d**-0.5)  # noqa: E731
            if sp is None or mode == "dense":
                out = dense_tree()
            else:
                if tree.window is not None or tree.mask.shape[2] != t:
                    raise ValueError("sparse tree attention verifies a whole tree at once (no offset or window)")
                dtype = cache.k.dtype
                sparse_out = tree_sparse_attention(
                    q, select(q), k.astype(dtype), v.astype(dtype), tree.mask, cache, self.layer,
                    tree.prefix, positions - tree.prefix[:, None], sp, scale=d**-0.5, kernels=ops,
                    unrotate=self._unrotate(inv_freq, rope_scale))
                if mode == "sparse":
                    out = sparse_out
                else:  # mixed: each node as plain decoding would run it, by its own length
                    use = positions + 1 >= sp.dense_len
                    out = jnp.where(use[:, :, None, None], sparse_out, dense_tree())
            return self.o_proj.partial(out.reshape(b, t, nq)), cache
        # Rotation and the cache write in one op: one launch a decode step (pallas_kernels.rope_write).
        q, cache = cache.write_rotated(self.layer, projected if isinstance(projected, SplitSum) else heads,
                                       self.q_heads, cos, sin, positions, valid, ops, dtype=x.dtype)
        dense = lambda: cache.attend(self.layer, q, positions, kv_lengths, ops, scale=d**-0.5)  # noqa: E731
        if sp is None or mode == "dense":
            out = dense()
        else:
            cache = extend_compressed(cache, self.layer, positions[:, 0], kv_lengths, sp, max_tokens=t, kernels=ops,
                                      unrotate=self._unrotate(inv_freq, rope_scale))
            sparse_fn = lambda: sparse_attention(  # noqa: E731
                q, select(q), cache, self.layer, positions, kv_lengths, sp, scale=d**-0.5, kernels=ops)
            if mode == "sparse":
                out = sparse_fn()
            else:
                use = kv_lengths >= sp.dense_len
                out = jnp.where(use[:, None, None, None], sparse_fn(), dense())
        return self.o_proj.partial(out.reshape(b, t, nq)), cache
