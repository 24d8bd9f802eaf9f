"""Rotary position embeddings: default, linear, llama3, YaRN and MiniCPM's LongRoPE (rotate-half convention)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from minicpm_jax.rope_config import RopeConfig
from pallas_kernels.rope_write import rotate


def rope_frequencies(
    rope: RopeConfig, head_dim: int, max_length: int, max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``float32[head_dim/2]`` and the cos/sin amplitude scale.

    ``max_length`` is the engine's static cache length. LongRoPE picks ``long_factor`` iff it exceeds
    ``original_max_position_embeddings`` (as CPM.cu does with its cache size; the HF MiniCPM code makes the
    same choice from the current sequence length), and scales cos/sin by
    ``sqrt(1 + ln(max_position_embeddings/original) / ln(original))`` as the HF ``MiniCPMLongRoPE`` does
    (CPM.cu drops this factor; it is 1 for the shipped MiniCPM4 configs).
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    scale = 1.0
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.kind == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    elif rope.kind == "longrope":
        orig = rope.original_max_position_embeddings
        ext = np.asarray(rope.long_factor if max_length > orig else rope.short_factor, dtype=np.float64)
        inv_freq = inv_freq / ext
        ratio = max_position_embeddings / orig
        scale = math.sqrt(1 + math.log(ratio) / math.log(orig)) if ratio > 1 else 1.0
    elif rope.kind == "yarn":
        inv_freq, scale = yarn_frequencies(rope, head_dim)
    return inv_freq.astype(np.float32), float(scale)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """YaRN (Peng et al. 2023, as transformers' ``_compute_yarn_parameters``): dimensions rotating fewer
    than ``beta_slow`` times over the pre-training context are interpolated by ``factor``, those rotating
    more than ``beta_fast`` times are kept, a linear ramp between; cos/sin are scaled by the attention
    factor (``0.1 ln(factor) + 1`` unless given or set by ``mscale`` / ``mscale_all_dim``)."""
    base, factor, orig = rope.theta, rope.factor, rope.original_max_position_embeddings
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `orig`
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoids a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (divided by factor)
    freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return freq / factor * (1 - keep) + freq * keep, float(attention)


def rope_tables(positions: jnp.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``cos, sin`` float32 ``[B, T, D/2]`` of ``positions[B, T]`` (int32), times the attention ``scale``: what
    :func:`~pallas_kernels.rope_write.rotate` (and the fused RoPE + cache-write kernel) rotate by."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> jnp.ndarray:
    """Rotates ``x[B, T, heads, head_dim]`` by ``positions[B, T]`` (int32); math in fp32, result in x.dtype."""
    return rotate(x, *rope_tables(positions, inv_freq, scale))


def rope_inverse(inv_freq: np.ndarray, scale: float):
    """``f(keys [B, N, KVH, D], positions [B, N])`` undoing :func:`apply_rope` (InfLLM-v2's ``use_nope``
    compresses pre-RoPE keys, recovered from the cached post-RoPE ones)."""
    return lambda keys, positions: apply_rope(keys, -positions, inv_freq, 1.0 / scale)
