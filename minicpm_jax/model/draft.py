"""EAGLE draft models for speculative decoding (the modules; their checkpoints are read by
:mod:`minicpm_jax.io.draft` and loaded by :mod:`minicpm_jax.model.loading`).

Two draft architectures, both one decoder layer over ``x = fc([embedding; target feature])`` whose output
goes through the *target's* lm_head (no final norm):

* ``minicpm`` — MiniCPM4 EAGLE as CPM.cu runs it: ``x = fc([RMSNorm₁(E[tok]·scale_emb); RMSNorm₂(f)])``,
  a pre-norm MiniCPM layer whose residual branches are scaled by ``scale_depth / sqrt(L_target + 1)``
  (CPM.cu's constant), logits ``lm_head(x · dim_model_base / hidden)``. Tensors: ``fc.weight [H, 2H]``
  (embedding half first), ``fc.bias``, ``input_norm1.weight``, ``input_norm2.weight``, ``layers.0.*``.
* ``llama`` — SafeAILab EAGLE-1/2: ``x = fc([E[tok]; f])`` (with bias), a Llama layer *without* its input
  norm, unscaled residuals. Tensors: ``fc.weight``, ``fc.bias``, ``layers.0.{self_attn,mlp}.*``,
  ``layers.0.post_attention_layernorm.weight``.

``f`` is the target's final-normed hidden state at the previous position (and, inside a draft tree, the
draft's own output for its parent). The draft shares the target's embedding, RoPE and lm_head.

* ``eagle3`` — EAGLE-3 (SafeAILab format): the target feature is the residual stream entering target
  layers ``(2, L//2, L-3)``, concatenated (3H); ``g = fc(features)`` (no bias; the draft's own outputs
  inside a tree skip fc); ``midlayer`` attends over ``[input_layernorm(E[tok]); hidden_norm(g)]`` (q/k/v
  take 2H), residual ``g``, then post-attention norm and MLP; logits ``lm_head(norm(h))`` over a draft
  vocabulary of V_d ids, draft id d meaning target id ``d + d2t[d]``. Tensors: ``fc.weight [H, 3H]``,
  ``midlayer.*``, ``norm.weight``, ``lm_head.weight [V_d, H]``, ``d2t``, ``t2d``. Residuals unscaled.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from minicpm_jax.config import DraftSpec
from minicpm_jax.model.attention import Attention, resolve_attention_impl
from minicpm_jax.model.cache import KVCache, TreeInputs
from minicpm_jax.model.layers import MLP, Linear, RMSNorm, make_linear
from minicpm_jax.model.paged_cache import PagedKVCache
from minicpm_jax.quant import QuantSpec


class EagleDraft(nnx.Module):
    """One-layer EAGLE draft (``minicpm`` or ``llama`` kind) over its own one-layer :class:`KVCache`.

    Args:
      spec: the draft's shape (:meth:`DraftSpec.for_target`).
      max_length: the target's cache length (RoPE factors follow it, as in the target).
      attention_impl: the kernel backend (``auto``, ``xla`` or ``pallas``; the target's).
      rngs: random initialisation (tests, benchmarks); None gives zeros, to be loaded.
      quant: int4 ``fc`` and layer linears (CPM.cu's quantized drafts); norms and an EAGLE-3 head stay dense.
    """

    def __init__(self, spec: DraftSpec, *, max_length: int, attention_impl: str, dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None, quant: QuantSpec | None = None):
        cfg = spec.layer
        h = cfg.hidden_size
        attention_impl = resolve_attention_impl(attention_impl, cfg.head_dim)
        self.spec = spec
        self.dtype = jnp.dtype(dtype)
        eps = cfg.rms_norm_eps
        eagle3 = spec.kind == "eagle3"
        self.quant = quant
        linear = dict(impl=attention_impl, rngs=rngs, dtype=dtype)
        self.fc = make_linear(spec.fc_in_features, h, quant, **linear)
        if eagle3:
            self.input_layernorm = RMSNorm(h, eps, dtype=dtype)
            self.hidden_norm = RMSNorm(h, eps, dtype=dtype)
            self.norm = RMSNorm(h, eps, dtype=dtype)
            self.lm_head = Linear(h, spec.draft_vocab, rngs=rngs, dtype=dtype)
            self.d2t = nnx.Variable(jnp.zeros((spec.draft_vocab,), jnp.int32))
        else:
            self.fc_bias = nnx.Param(jnp.zeros((h,), dtype))
        if spec.kind == "minicpm":
            self.input_norm1 = RMSNorm(h, eps, dtype=dtype)
            self.input_norm2 = RMSNorm(h, eps, dtype=dtype)
            self.input_layernorm = RMSNorm(h, eps, dtype=dtype)
        self.self_attn = Attention(cfg, 0, max_length=max_length, attention_impl=attention_impl, rngs=rngs, dtype=dtype,
                                   quant=quant, in_features=spec.attention_in_features)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype=dtype)
        self.mlp = MLP(h, cfg.intermediate_size, rngs=rngs, dtype=dtype, quant=quant, impl=attention_impl)

    @property
    def own_head(self) -> bool:
        """Whether the draft has its own (reduced-vocabulary) head (EAGLE-3) instead of the target's."""
        return self.spec.kind == "eagle3"

    def logits(self, hidden: jax.Array) -> jax.Array:
        """EAGLE-3 draft logits ``f32[..., V_d]`` (draft ids; :meth:`target_ids` maps them)."""
        h = self.norm(hidden)
        return jnp.dot(h, self.lm_head.kernel[...].astype(h.dtype), preferred_element_type=jnp.float32)

    def target_ids(self) -> jax.Array:
        """``int32[V_d]``: the target token of each EAGLE-3 draft id (``d + d2t[d]``)."""
        return jnp.arange(self.spec.draft_vocab, dtype=jnp.int32) + self.d2t[...]

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        """An empty one-layer cache for ``max_length`` draft positions."""
        return KVCache.create(self.spec.layer, batch_size, max_length, self.dtype)

    def new_paged_cache(self, *, num_pages: int, page_size: int, batch_size: int, max_length: int) -> PagedKVCache:
        """An empty one-layer pool beside a paged target's: the same ``num_pages`` pages of ``page_size``
        positions (a step views it through the target's page table), a tree scratch region per row."""
        return PagedKVCache.create(self.spec.layer, num_pages=num_pages, page_size=page_size, batch_size=batch_size,
                                   max_length=max_length, dtype=self.dtype)

    def __call__(self, embedded: jax.Array, features: jax.Array, positions: jax.Array, valid: jax.Array,
                 cache: KVCache, tree: TreeInputs | None = None, from_target: bool = True) -> tuple[jax.Array, KVCache]:
        """One draft step over T tokens.

        embedded ``[B, T, H]``: the target's scaled token embeddings; features: the feature each token
        is paired with — the target's (``[B, T, feature_size]``, ``from_target``) or the draft's own
        output (``[B, T, H]``; EAGLE-3 then skips fc); positions ``int32[B, T]`` (RoPE); valid ``bool[B, T]``.
        Without ``tree`` the tokens are appended causally at the cache length (prefill; the length
        advances by the valid count); with it they are tree tokens (:class:`TreeInputs`; length unchanged).
        Returns the draft hidden states ``[B, T, H]`` (before the lm_head, no final norm) and the cache.
        """
        dt = self.dtype
        e, f = embedded.astype(dt), features.astype(dt)
        if self.spec.kind == "eagle3":
            x = self.fc(f) if from_target else f
            a = jnp.concatenate([self.input_layernorm(e), self.hidden_norm(x)], axis=-1)
        else:
            if self.spec.kind == "minicpm":
                e, f = self.input_norm1(e), self.input_norm2(f)
            x = self.fc(jnp.concatenate([e, f], axis=-1)) + self.fc_bias[...].astype(dt)
            a = self.input_layernorm(x) if self.spec.kind == "minicpm" else x
        kv_lengths = cache.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32)
        attn, cache = self.self_attn(a, positions, valid, cache, kv_lengths, "dense", tree)
        s = jnp.asarray(self.spec.residual_scale, dt)
        x = x + attn * s
        x = x + self.mlp(self.post_attention_layernorm(x)) * s
        if tree is None:
            cache = dataclasses.replace(cache, lengths=kv_lengths)
        return x, cache
