"""InfLLM-v2's compressed-key caches: K1 (means of ``kernel_size``-key windows at ``kernel_stride``) and K2
(the coarse windows, 4x both), extended as the KV cache grows.

Keys are post-RoPE (pre-RoPE with ``use_nope``: the cached keys are rotated back, exact up to bf16
rounding). The caches are extended for every completed window even while attention is still dense, so
crossing ``dense_len`` needs no catch-up pass.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import jax

from minicpm_jax.config import SparseConfig
from minicpm_jax.infllm.policy import geometry
from minicpm_jax.model.cache import KVCache


def extend_compressed(
    cache: KVCache, layer: int, old_lengths: jax.Array, new_lengths: jax.Array, sparse: SparseConfig, *,
    max_tokens: int, kernels: ModuleType, unrotate=None,
) -> KVCache:
    """Appends to ``layer``'s K1/K2 the windows completed by growing each sequence from ``old_lengths`` to
    ``new_lengths`` (``int32[B]``, at most ``max_tokens`` apart), averaging keys already in ``cache.k``.

    unrotate: None, or ``f(keys [B, N, KVH, D], positions int32[B, N]) -> keys`` undoing RoPE
    (``use_nope``). Means are taken in fp32 and stored in the cache dtype. kernels: the backend namespace
    (``pallas_kernels.backend.get``).
    """
    k1, k2 = kernels.compress_windows(cache.k, cache.k1, cache.k2, old_lengths, new_lengths, geometry=geometry(sparse),
                                      layer=layer, max_tokens=max_tokens, unrotate=unrotate)
    return dataclasses.replace(cache, k1=k1, k2=k2)
