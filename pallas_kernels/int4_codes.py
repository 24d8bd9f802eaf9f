"""How the int4 plane kernels read codes as floats, and x's matching planes (pallas_kernels/int4_planes.py).

A kpacked word (GPTQ's layout, ``int32``) holds 8 consecutive input rows' codes, lowest nibble first; nibble p of
every word of a tile is plane p. The kernels read a plane without unpacking the words:

* float32 planes (:func:`float32_plane`): ``(q_p − zero)·2^e_p``, the nibble masked in place into a float mantissa.
* 16-bit code pairs (:func:`plane_pair`): nibbles p and p + 4 as the two halves of one word, ``offset + q``.
* centred pairs (:func:`centred_pair`): the same, ``q − 8``, one packed subtraction more.

x is cut into the planes the products need: :func:`planes_x` (8 planes) and :func:`joined_x` (4 pair planes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.inline_ptx import and_or, sub_halves

SYM_ZERO = 8  # the zero point of symmetric codes (Marlin's uint4b8)


# Per nibble p of a kpacked word: (right shift, exponent e) such that ``(w >> shift) & (0xF << e)`` holds
# ``q_p·2^e`` with e ≤ 16 (so it fits the float mantissa below); 2^-e is folded into x outside the kernel.
PLANE_BITS = tuple((max(4 * p - 16, 0), 4 * p - max(4 * p - 16, 0)) for p in range(8))


def planes_x(x2: jax.Array, transpose: bool, dtype, scaled: bool = True) -> jax.Array:
    """x ``[M, K]`` → nibble planes ``[8, M, K/8]`` (``[8, K/8, M]`` if transpose): plane p, word row r
    holds ``x[:, 8r + p]·2^-e_p`` (exact: a power of two; ``x[:, 8r + p]`` itself when not ``scaled``)."""
    m, k = x2.shape
    xp = x2.reshape(m, k // 8, 8)
    if scaled:
        e = jnp.asarray([e for _, e in PLANE_BITS], jnp.float32)
        xp = xp.astype(jnp.float32) * jnp.exp2(-e)
    return xp.transpose((2, 1, 0) if transpose else (2, 0, 1)).astype(dtype)


# 16-bit code pairs (16-bit x): ``(w >> 4p) & 0x000F000F | magic·0x00010001`` holds two 16-bit floats,
# ``offset + q_p`` (low half) and ``offset + q_{p+4}`` (high half), exactly (the code is OR-ed into the mantissa
# of ``offset``, whose unit is 1): a shift and one AND-OR for two codes and no float instruction, where the
# float32 planes (:func:`float32_plane`) take an AND-OR and a subtraction for each code and a conversion to x's
# dtype for the tensor cores. In ``planes_t`` and the one-row kernel the offset goes with the zero point:
# ``(z + offset)·s`` times the chunk's sum of x is subtracted once per chunk. Its cancellation costs ~1e-6 relative
# in float32 accumulation, so float32 x (exact tests) keeps the float32 planes. ``planes`` subtracts the offset
# from the pair itself (:func:`centred_pair`).
PAIR_CODES = {jnp.dtype(jnp.bfloat16): (0x4300, 128), jnp.dtype(jnp.float16): (0x6400, 1024)}

# The one-row kernel reads the bfloat16 pair's word as the float32 of its high half unmasked (one instruction
# fewer per two codes): ``128 + q_{p+4} + (0x4300 + q_p)·2^-16``. The low half's mean (codes 0..15) is removed
# with the offset; what stays, ``(q_p − 7.5)·2^-16`` per code, is at most 1.2e-4 of a code step, zero on average
# (a bf16 result rounds at 2^-9 of itself). The one-row kernel takes the bfloat16 pair for any 16-bit x
# (:func:`pairs_for`).
PAIR_LOW_HALF = (PAIR_CODES[jnp.dtype(jnp.bfloat16)][0] + 7.5) / 65536


def pairs_for(dtype, gemv: bool) -> tuple[int, int] | None:
    """(magic half-word, offset) of the code pairs for x in ``dtype``, or None (float32 x). The one-row
    kernel multiplies in float32 and takes bfloat16 pairs, which widen to float32 by a shift."""
    if jnp.dtype(dtype) not in PAIR_CODES:
        return None
    return PAIR_CODES[jnp.dtype(jnp.bfloat16) if gemv else jnp.dtype(dtype)]


def _pair_word(words: jax.Array, p: int, magic: int, asm: bool) -> jax.Array:
    """Nibbles p and p + 4 of each word OR-ed into the mantissas of two 16-bit ``magic`` halves (int32)."""
    return and_or((words >> 4 * p) if p else words, 0x000F000F, magic * 0x10001, asm=asm)


def _halves(t: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """The low and the high 16-bit float of each int32 word of ``t``."""
    return (lax.bitcast_convert_type(t.astype(jnp.int16), dtype),
            lax.bitcast_convert_type((t >> 16).astype(jnp.int16), dtype))


def plane_pair(words: jax.Array, p: int, magic: int, dtype, *, asm: bool = False,
               raw_high: bool = False) -> tuple[jax.Array, jax.Array]:
    """(``offset + q_p``, ``offset + q_{p+4}``) in ``dtype`` for every word of ``words`` (int32), p < 4.
    ``dtype`` float32 takes the bfloat16 pair (``magic`` 0x4300) widened: the low half shifted up 16 bits,
    the high half masked, or with ``raw_high`` not masked (``+ (magic + q_p)·2^-16``, :data:`PAIR_LOW_HALF`).
    ``asm``: the mask and the magic in one instruction (:func:`inline_ptx.and_or`; GPU only)."""
    t = _pair_word(words, p, magic, asm)
    if dtype == jnp.float32:
        high = t if raw_high else t & -65536
        return lax.bitcast_convert_type(t << 16, dtype), lax.bitcast_convert_type(high, dtype)
    return _halves(t, dtype)


def centred_pair(words: jax.Array, p: int, dtype, *, asm: bool = False) -> tuple[jax.Array, jax.Array]:
    """(``q_p − 8``, ``q_{p+4} − 8``) in 16-bit ``dtype`` for every word of ``words`` (int32), p < 4: the pair of
    :func:`plane_pair` with ``offset + 8`` subtracted from both halves in one instruction (exact: small integers),
    so the codes need no offset removed through x's chunk sums. The ``planes`` kernel's dots take it (the default
    for 2..16 rows)."""
    magic, offset = PAIR_CODES[jnp.dtype(dtype)]
    return _halves(sub_halves(_pair_word(words, p, magic, asm), offset + SYM_ZERO, dtype, asm=asm), dtype)


def joined_x(x2: jax.Array, dtype) -> jax.Array:
    """x ``[M, K]`` → pair planes ``[4, M, K/4]``: plane p, column ``2r + h`` holds ``x[:, 8r + p + 4h]``, the
    input row of the code in half h of word row r's pair p (:func:`centred_pair`)."""
    m, k = x2.shape
    return x2.reshape(m, k // 8, 2, 4).transpose(3, 0, 1, 2).reshape(4, m, k // 4).astype(dtype)


def float32_plane(words: jax.Array, p: int, zero: int) -> jax.Array:
    """``(q_p − zero)·2^e_p`` as float32 for every word of ``words`` (int32, any shape): the nibble is
    masked in place and OR-ed into the mantissa of 2²³, then ``2²³ + zero·2^e`` is subtracted (exact), so a
    code costs an AND, an OR and one add (plus a shift for p > 4)."""
    shift, e = PLANE_BITS[p]
    masked = ((words >> shift) if shift else words) & (0xF << e)
    return lax.bitcast_convert_type(masked | 0x4B000000, jnp.float32) - float(2**23 + zero * 2**e)
