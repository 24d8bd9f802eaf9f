"""The MiniCPM4 network as a Flax NNX module: (params, cache, tokens) → (logits, hidden, cache).

The same module serves Llama-family checkpoints (neutral scalings). Layers are unrolled (a Python loop)
rather than scanned so XLA streams every weight matrix straight into its GEMV at decode. A model built
with a ``mesh`` is split over its devices (:mod:`minicpm_jax.model.parallel`); its forward then runs
inside the SPMD program the engine builds around each step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh

from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.infllm.policy import resolve_sparse
from minicpm_jax.model.attention import Attention, resolve_attention_impl
from minicpm_jax.model.cache import KVCache, TreeInputs
from minicpm_jax.model.paged_cache import PagedKVCache
from minicpm_jax.model.layers import MLP, Embed, Linear, RMSNorm
from minicpm_jax.model.parallel import (EMBED, VOCAB, TensorParallel, allocate, cache_specs, mesh_size, peer_workspace,
                                        state_specs)
from minicpm_jax.quant import QuantSpec
from pallas_kernels import backend


class DecoderLayer(nnx.Module):
    """``x += s·attn(norm(x)); x += s·mlp(norm(x))`` with ``s = scale_depth/sqrt(num_layers)``.

    The sublayers return partial sums when the model is split (row-parallel ``o_proj`` / ``down_proj``);
    the reduction happens here, at the block boundary, through the backend's ``residual_add_norm`` (reduce,
    add, and the next RMSNorm; ``pallas_kernels.residual``), so a fused collective is one op. The model
    runs the layers through :meth:`forward`, which also takes the input norm from the layer before and
    fuses the MLP's residual add with the next norm (the next layer's input norm, or the final norm):
    every norm of a step is one op with the add before it.
    """

    def __init__(self, config: ModelConfig, layer: int, *, max_length: int, attention_impl: str, rngs, dtype,
                 quant: QuantSpec | None, sparse: SparseConfig | None, tp: TensorParallel):
        self.residual_scale = config.residual_scale
        self.impl = attention_impl
        self.axis_name = tp.reduce_axis  # the mesh axis the sublayers' partial sums are reduced over, or None
        self.peers = tp.peers  # that axis' peer-memory workspace (the pallas backend's all-reduce), or None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(
            config, layer, max_length=max_length, attention_impl=attention_impl, rngs=rngs, dtype=dtype, quant=quant,
            sparse=sparse, tp=tp,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, rngs=rngs, dtype=dtype, quant=quant,
                       impl=attention_impl, tp=tp)

    def __call__(self, x, positions, valid, cache: KVCache, kv_lengths, mode: str = "dense", tree=None):
        """The layer alone: ``(x', cache)``."""
        x, _, cache = self.forward(x, self.input_layernorm(x), positions, valid, cache, kv_lengths, mode, tree)
        return x, cache

    def forward(self, x, h, positions, valid, cache: KVCache, kv_lengths, mode: str = "dense", tree=None,
                next_norm: RMSNorm | None = None, tables=None):
        """The layer in a chain: ``h`` is ``input_layernorm(x)`` (from the layer before); returns ``(x',
        next_norm(x') or None, cache)``, the norm fused with the MLP's residual add. tables: the RoPE tables of
        ``positions`` shared by the chain (:meth:`Attention.rope_tables`), or None."""
        ops = backend.get(self.impl)
        attn, cache = self.self_attn(h, positions, valid, cache, kv_lengths, mode, tree, tables)
        post = self.post_attention_layernorm
        x, h = ops.residual_add_norm(attn, x, self.residual_scale, post.weight[...], eps=post.eps,
                                     axis_name=self.axis_name, peers=self.peers)
        if next_norm is None:
            return (ops.residual_add(self.mlp(h), x, self.residual_scale, axis_name=self.axis_name, peers=self.peers),
                    None, cache)
        x, h = ops.residual_add_norm(self.mlp(h), x, self.residual_scale, next_norm.weight[...], eps=next_norm.eps,
                                     axis_name=self.axis_name, peers=self.peers)
        return x, h, cache


class MiniCPMModel(nnx.Module):
    """Embedding, decoder layers and final norm (the checkpoint's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig, *, max_length: int, attention_impl: str, rngs, dtype, quant, sparse,
                 tp: TensorParallel):
        self.embed_tokens = Embed(tp.vocab_padded, config.hidden_size, rngs=rngs, dtype=dtype, tp=tp)
        self.layers = nnx.List(
            [
                DecoderLayer(config, i, max_length=max_length, attention_impl=attention_impl, rngs=rngs, dtype=dtype,
                             quant=quant, sparse=sparse, tp=tp)
                for i in range(config.num_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class MiniCPMForCausalLM(nnx.Module):
    """MiniCPM4 / MiniCPM4.1 / Llama causal LM over a static :class:`KVCache`.

    Args:
      config: the model's hyper-parameters.
      max_length: static cache length the model will run with (LongRoPE picks its factors from it).
      attention_impl: the kernel backend of every op (attention, KV writes, the int4 matmul, InfLLM-v2):
        ``"auto"`` (Pallas kernels on a GPU, else the references), ``"xla"`` (plain-jnp references) or
        ``"pallas"``.
      dtype: weight and activation dtype (bf16 on GPU; fp32 for exact tests).
      rngs: random initialisation; None gives zeros (weights about to be loaded by ``weights.load_model``).
      quant: int4 decoder linears (:class:`~minicpm_jax.quant.QuantSpec`), or None for dense weights.
      sparse: InfLLM-v2 sparse attention: ``"auto"`` (the checkpoint's ``sparse_config``), ``"on"``,
        ``"off"``/None, or a :class:`~minicpm_jax.config.SparseConfig` (see
        :func:`~minicpm_jax.infllm.policy.resolve_sparse`). Its caches need :meth:`new_cache`.
      mesh: split the model over this mesh's ``tp`` axis (:mod:`minicpm_jax.model.parallel`; parameters in
        the stored layout, placed by :func:`~minicpm_jax.model.loading.load_model` or
        :func:`~minicpm_jax.model.loading.shard_model`), or None for one device.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_length: int = 4096,
        attention_impl: str = "auto",
        dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
        quant: QuantSpec | None = None,
        sparse: str | SparseConfig | None = "auto",
        mesh: Mesh | None = None,
    ):
        attention_impl = resolve_attention_impl(attention_impl, config.head_dim)
        self.mesh = mesh
        # The peer-memory all-reduce is a kernel of the pallas backend; the xla backend reduces through XLA.
        peers = peer_workspace(mesh) if backend.reduces_through_peers(attention_impl) else None
        self.tp = TensorParallel.of(config, mesh_size(mesh), quant, peers=peers, impl=attention_impl)
        sparse = resolve_sparse(config, sparse)
        self.sparse = sparse
        # Sparse attention starts at dense_len tokens; a cache shorter than that never gets there, so such
        # a model runs (and caches) exactly as a dense one.
        self.sparse_active = sparse is not None and max_length >= sparse.dense_len
        self.config = config
        self.attention_impl = attention_impl
        self.max_length = max_length
        self.dtype = jnp.dtype(dtype)
        self.quant = quant
        self.model = MiniCPMModel(config, max_length=max_length, attention_impl=attention_impl, rngs=rngs, dtype=dtype,
                                  quant=quant, sparse=sparse if self.sparse_active else None, tp=self.tp)
        if not config.tied_head:
            self.lm_head = Linear(config.hidden_size, self.tp.vocab_padded, rngs=rngs, dtype=dtype, axes=(EMBED, VOCAB),
                                  tp=self.tp)

    def new_cache(self, batch_size: int, max_length: int | None = None) -> KVCache:
        """An empty :class:`KVCache` for this model (its dtype; compressed keys when sparse; split over the
        mesh by KV heads, ``tp.stored_kv_heads`` of them)."""
        sparse = self.sparse if self.sparse_active else None
        return allocate(self.mesh, lambda: KVCache.create(self.config, batch_size, max_length or self.max_length,
                                                          self.dtype, sparse, kv_heads=self.tp.stored_kv_heads),
                        cache_specs)

    def new_paged_cache(self, *, num_pages: int, page_size: int, batch_size: int) -> PagedKVCache:
        """An empty :class:`~minicpm_jax.model.paged_cache.PagedKVCache`: a pool of ``num_pages`` pages of
        ``page_size`` tokens viewed by ``batch_size`` rows of up to ``max_length`` tokens (split over the
        mesh by KV heads like :meth:`new_cache`), with InfLLM-v2's compressed keys in the pages when sparse
        (MiniCPMError unless a page is one sparse block)."""
        sparse = self.sparse if self.sparse_active else None
        if sparse is not None:
            PagedKVCache.check_sparse(sparse, page_size)  # the one-line error before any allocation
        return allocate(self.mesh, lambda: PagedKVCache.create(
            self.config, num_pages=num_pages, page_size=page_size, batch_size=batch_size, max_length=self.max_length,
            dtype=self.dtype, kv_heads=self.tp.stored_kv_heads, sparse=sparse), cache_specs)

    def param_specs(self, state: nnx.State) -> nnx.State:
        """The PartitionSpecs of this model's ``nnx.split`` state over its mesh (all replicated at size 1)."""
        return state_specs(state, self.tp)

    def cache_specs(self, page_size: int | None = None) -> KVCache | PagedKVCache:
        """The PartitionSpecs of this model's caches: a :class:`KVCache` of specs, or with ``page_size`` a
        :class:`~minicpm_jax.model.paged_cache.PagedKVCache` of specs (of pages of that size)."""
        sparse = self.sparse if self.sparse_active else None
        if page_size is not None:
            shape = jax.eval_shape(lambda: PagedKVCache.create(self.config, num_pages=1, page_size=page_size,
                                                               batch_size=1, max_length=self.max_length,
                                                               dtype=self.dtype, sparse=sparse))
            return cache_specs(shape)
        return cache_specs(jax.eval_shape(lambda: KVCache.create(self.config, 1, 16, self.dtype, sparse)))

    def forward(
        self, tokens: jax.Array, cache: KVCache, num_valid: jax.Array | None = None, mode: str = "auto",
        tree: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, KVCache]:
        hidden, _, cache = self.forward_features(tokens, cache, num_valid, mode, tree)
        return hidden, cache

    def forward_features(
        self, tokens: jax.Array, cache: KVCache, num_valid: jax.Array | None = None, mode: str = "auto",
        tree: tuple[jax.Array, jax.Array] | None = None, capture: tuple[int, ...] = (),
    ) -> tuple[jax.Array, list[jax.Array], KVCache]:
        """Runs ``tokens int32[B, T]`` appended after each sequence's cached tokens.

        num_valid: ``int32[B]``, how many leading tokens of each row are real (default: all T). Padded
        tokens are computed but neither cached nor counted.
        mode (static; sparse models only): ``auto`` picks dense or InfLLM-v2 attention per row on device
        (a row is sparse iff its length after this call reaches ``dense_len``); ``dense``, ``sparse`` or
        ``mixed`` (both, picked per row) fix it at trace time, as the engine does from lengths it knows
        (:func:`~minicpm_jax.infllm.policy.attention_mode`), so the compiled step has no conditional.
        tree: ``(depths int32[B, T], tree_mask bool[B, T, T])`` verifies a speculative token tree: token
        ``i`` goes to cache slot ``length + i`` with RoPE position ``length + depths[:, i]`` and attends to
        the cached tokens and to the tree tokens ``j`` with ``tree_mask[:, i, j]`` (its ancestors and
        itself); the cache length advances by T and is set to the committed length afterwards
        (the cache's ``commit_path``, then :meth:`extend_compressed`). Sparse models
        verify each node as plain decoding of its path would (``auto`` = ``mixed`` for trees).
        Returns the final-normed hidden states ``[B, T, hidden]`` (model dtype) and the updated cache
        (``forward``); ``forward_features`` also returns the residual stream entering each layer of
        ``capture`` (static; EAGLE-3 features), ``[B, T, hidden]`` each: (hidden, features, cache).
        """
        b, t = tokens.shape
        if num_valid is None:
            num_valid = jnp.full((b,), t, jnp.int32)
        if self.sparse_active and getattr(cache, "k1", None) is None:
            raise MiniCPMError("this model uses InfLLM-v2 sparse attention: make its cache with model.new_cache(...)")
        steps = jnp.arange(t, dtype=jnp.int32)
        positions = cache.lengths[:, None] + steps[None, :]
        if tree is not None:
            depths, tree_mask = tree
            positions = cache.lengths[:, None] + depths
            tree = TreeInputs(cache.lengths, tree_mask)
            if mode == "auto":  # per node by its own length (see Attention)
                mode = "mixed" if self.sparse_active else "dense"
        valid = steps[None, :] < num_valid[:, None]
        kv_lengths = cache.lengths + num_valid
        x = self.embed(tokens)

        def run_layers(mode):
            def run(x, cache):
                seen = {}
                layers = self.model.layers
                h = layers[0].input_layernorm(x)
                tables = layers[0].self_attn.rope_tables(positions)  # once for every layer
                for i, layer in enumerate(layers):
                    if i in capture:
                        seen[i] = x
                    next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
                    x, h, cache = layer.forward(x, h, positions, valid, cache, kv_lengths, mode, tree, next_norm,
                                                tables)
                if mode == "dense" and tree is None:
                    # Dense layers leave the compressed keys to here, once every layer's keys are written
                    # (see Attention.__call__); trees leave them to the committed path.
                    cache = self.extend_compressed(cache, positions[:, 0], kv_lengths, t)
                return h, cache, [seen[i] for i in capture]  # h: the final norm of the last layer's output
            return run

        if not self.sparse_active:
            hidden, cache, captured = run_layers("dense")(x, cache)
        elif mode != "auto":
            if mode not in ("dense", "sparse", "mixed"):
                raise ValueError(f"mode must be auto, dense, sparse or mixed, got {mode!r}")
            hidden, cache, captured = run_layers(mode)(x, cache)
        else:
            # One switch for the whole forward: a conditional costs the GPU a host round trip, too much
            # per layer.
            use = kv_lengths >= self.sparse.dense_len
            branch = jnp.where(jnp.all(use), 2, jnp.where(jnp.any(use), 1, 0))
            hidden, cache, captured = lax.switch(branch, [run_layers("dense"), run_layers("mixed"), run_layers("sparse")],
                                                 x, cache)
        cache = dataclasses.replace(cache, lengths=kv_lengths)
        return hidden, captured, cache

    def extend_compressed(self, cache: KVCache, old_lengths: jax.Array, new_lengths: jax.Array,
                          max_tokens: int) -> KVCache:
        """Every layer's compressed keys (sparse models) extended over tokens put in the cache by other
        means than a forward (the accepted path of a speculative tree, a dense prompt chunk), ``old_lengths``
        → ``new_lengths``: one update of the stacked cache (with the Pallas kernels one launch for all layers,
        not gathers, means and scatters per layer: ~190 launches of a 32-layer speculative round)."""
        if not self.sparse_active:
            return cache
        return self.model.layers[0].self_attn.extend_compressed(cache, old_lengths, new_lengths, max_tokens,
                                                                all_layers=True)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """``tokens int32[...]`` → the scaled token embeddings ``E[tokens]·scale_emb`` ``[..., hidden]`` in
        the model dtype: the input of the first layer (and of an EAGLE draft)."""
        return self.model.embed_tokens(tokens).astype(self.dtype) * jnp.asarray(self.config.scale_emb, self.dtype)

    def head_rows(self, ids: jax.Array | None = None) -> jax.Array:
        """The lm_head as ``[V, hidden]`` rows (the embedding when tied), or only the rows ``ids int32[V']``
        (an FR-Spec draft head). Called outside a step: on a split model it reads the global arrays."""
        v = self.config.vocab_size
        w = self.model.embed_tokens.embedding[...] if self.config.tied_head else None
        if ids is None:
            return w[:v] if w is not None else self.lm_head.kernel[...][:, :v].T
        return w[ids] if w is not None else self.lm_head.kernel[...][:, ids].T

    def logits(self, hidden: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """``hidden [..., hidden_size]`` (final-normed) → fp32 logits ``[..., vocab]``: ``lm_head(hidden /
        (hidden_size/dim_model_base))``. ``head``: other lm_head rows ``[V', hidden]`` (:meth:`head_rows`),
        giving ``[..., V']``. A vocab-parallel head's logits are gathered from every shard."""
        h = hidden * jnp.asarray(self.config.logit_scale, hidden.dtype)
        if head is not None:
            return jnp.einsum("...h,vh->...v", h, head.astype(h.dtype), preferred_element_type=jnp.float32)
        if self.config.tied_head:
            w = self.model.embed_tokens.embedding[...]
            local = jnp.einsum("...h,vh->...v", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
        else:
            local = jnp.dot(h, self.lm_head.kernel[...].astype(h.dtype), preferred_element_type=jnp.float32)
        return self.tp.gather_vocab(local)

    def __call__(
        self, tokens: jax.Array, cache: KVCache, num_valid: jax.Array | None = None, mode: str = "auto",
        tree: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """Full forward: returns (fp32 logits ``[B, T, vocab]``, hidden ``[B, T, hidden]``, cache)."""
        hidden, cache = self.forward(tokens, cache, num_valid, mode, tree)
        return self.logits(hidden), hidden, cache
