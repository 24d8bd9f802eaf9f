"""InfLLM-v2's compressed-key caches: K1 (means of ``kernel_size``-key windows at ``kernel_stride``) and K2
(the coarse windows, 4x both), extended as the KV cache grows.

Keys are post-RoPE (pre-RoPE with ``use_nope``: the cached keys are rotated back, exact up to bf16
rounding). The caches are extended for every completed window even while attention is still dense, so
crossing ``dense_len`` needs no catch-up pass.
"""

from __future__ import annotations

from types import ModuleType

import jax

from minicpm_jax.config import SparseConfig
from minicpm_jax.infllm.policy import geometry
from minicpm_jax.model.cache import KVCache
from minicpm_jax.model.paged_cache import PagedKVCache


def extend_compressed(
    cache: KVCache | PagedKVCache, layer: int | None, old_lengths: jax.Array, new_lengths: jax.Array,
    sparse: SparseConfig, *, max_tokens: int, kernels: ModuleType, unrotate=None,
) -> KVCache | PagedKVCache:
    """Appends to ``layer``'s K1/K2 (None: every layer's, in one update) the windows completed by growing
    each sequence from ``old_lengths`` to ``new_lengths`` (``int32[B]``, at most ``max_tokens`` apart),
    averaging keys already in ``cache.k``.

    unrotate: None, or ``f(keys [B, N, KVH, D], positions int32[B, N]) -> keys`` undoing RoPE
    (``use_nope``). Means are taken in fp32 and stored in the cache dtype. kernels: the backend namespace
    (``pallas_kernels.backend.get``); the cache kind decides where the entries go.
    """
    return cache.extend_compressed(layer, old_lengths, new_lengths, geometry(sparse), max_tokens=max_tokens,
                                   ops=kernels, unrotate=unrotate)
