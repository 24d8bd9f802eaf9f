"""W4A16 matmul ``y = x @ dequant(W)``: a jnp reference and a Pallas dequant-GEMM with its signature.

Weights are unsigned 4-bit codes with per-group scales (and optional zero points), ``w = s·(q − z)``,
``z = 8`` when ``zeros`` is None (symmetric GPTQ, Marlin's ``uint4b8``), stored in the GPTQ-native
("kpacked") layout: ``qweight int32 [K/8, N]``, 8 consecutive input rows per word, lowest nibble first
(checkpoints in other layouts, Marlin's among them, are repacked into it when loaded).

Two kernels (``KERNELS``; :func:`default_kernel` picks one):

* ``planes`` / ``planes_t`` (the default for 1..64 rows), :mod:`pallas_kernels.int4_planes`: a sub-block's
  words handled as 8 nibble planes of codes, each times the matching plane of x. One row: a GEMV with K split over
  many programs, partial sums reduced by their consumer; 2..16 rows: tensor-core dots of x's pair planes and the
  codes' centred pairs (``planes``); 17..64 rows: the transposed dots (``planes_t``).
* ``tile``: unpacks a ``[block_k, block_n]`` tile with shifts and masks into code order, then a GEMV (one
  row) or ``jnp.dot`` on the dequantized tile (rows padded to a multiple of 16). 2..64 rows with scale
  groups under 128 run it (and any row count given an explicit ``config``).

More than ``MAX_KERNEL_ROWS`` rows (prefill chunks, large batches) run :func:`int4_matmul_prefill`: the
weight dequantized whole by :func:`dequantize_kernel` once the layer's input exists (so no layer's
dequantized copy is held early), then XLA's GEMM.

Scales are applied once per group to the partial sum: ``Σ x·s·(q − z) = s·(Σ x·q − z·Σ x)``.

Shared signature::

    f(x, qweight, scales, zeros=None, perm=None, *, group_size, out_dtype=None) -> y

(the Pallas function adds launch overrides: ``config``, ``splits``, ``kernel``, ``interpret``).

x ``[..., K]``; scales/zeros ``[K/group_size, N]``; perm ``int32 [K]`` or None (act-order: ``x[...,
perm]`` is what multiplies the stored rows); y ``[..., N]`` in ``out_dtype`` (default x.dtype; float32
keeps the fp32 accumulation, e.g. for partial sums that are added across devices).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.int4_codes import SYM_ZERO
from pallas_kernels.int4_planes import planes_matmul
from pallas_kernels.launch import KernelConfig, is_power_of_2, launch_options, next_power_of_2, num_cores
from pallas_kernels.matmul import SplitSum


@dataclasses.dataclass(frozen=True)
class Int4Config:
    """Launch parameters: block_m rows (dot path), block_n columns, block_k input rows per step."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Starting points (GemLite-like GEMV tiles; 16..64-row dot tiles); see BENCHMARKS.md for the sweep.
GEMV_CONFIG = Int4Config(block_m=1, block_n=128, block_k=128, num_warps=4, num_stages=2)
DOT_CONFIGS = {
    16: Int4Config(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=3),
    # 17..32 rows run in the 64-row tile (padded): 229 µs for the four MiniCPM4-8B linears at M=32, bf16
    # GEMM parity, vs 297 µs with 32-row tiles (H100 sweep of 22 configs, BENCHMARKS.md 2026-11-23).
    32: Int4Config(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3),
    64: Int4Config(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3),
    128: Int4Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
}


# Above this many rows (prefill chunks, large batches, wide trees) dequantizing the whole weight once
# (dequantize_kernel) and running the XLA (cuBLAS) GEMM beats re-dequantizing every weight tile for each block
# of rows: H200, 2026-11-29, 65..256 rows: gate_up 178-219 us vs the tile kernel's 223-393, down 104-115 vs
# 128-235 (docs/lab_notes/2026-11-29-thirty-fifth-session.md).
MAX_KERNEL_ROWS = 64


KERNELS = ("tile", "planes", "planes_t")

# The nibble-plane kernels for kpacked weights, by rows: each entry the best of its sweep on MiniCPM4-8B's linears,
# group 128 (one row: 8 launches, session 55; 2..16 rows with centred K-adjacent pairs in `planes`, one warp a
# program: 55.6 vs 65.7 µs a layer for 4 warps, the best of 28 launches, session 57; 17..64 rows: `planes_t`, session
# 2, at 2 warps since session 57: 159.6 vs 178.3 µs a layer). The history is in docs/int4.md and the lab notes.
PLANES_CONFIGS = {
    1: ("planes", Int4Config(block_m=1, block_n=64, block_k=128, num_warps=4, num_stages=2)),
    16: ("planes", Int4Config(block_m=16, block_n=64, block_k=128, num_warps=1, num_stages=3)),
    64: ("planes_t", Int4Config(block_m=64, block_n=64, block_k=128, num_warps=2, num_stages=3)),
}
PLANES_MIN_GROUP = 128  # with 2+ rows a plane of one scale group must have >= 16 word rows (the tensor cores' K)
# K is split over programs until there are about this many per core: the one-row GEMV is bound by loads in flight
# (32 beat 4 by 10-20% with 256-row steps; with 128-row steps 16 beat 32, session 55); the 2..16-row `planes`
# programs at 8, which splits MiniCPM4-8B's linears as 4 did with 128 columns (64 columns, 2 warps: 4, 8, 16 per core
# 70.1, 59.6, 66.4 µs a layer, session 57); the other dot tiles at 4.
PROGRAMS_PER_CORE = {"gemv": 16, "planes": 8, "dot": 4}
# One row: 128-column tiles wherever they keep about a wave of programs (>= 7 per core) in at most 32 K-split parts,
# else the entry's 64 (H200, the kernel alone: o 5.70 -> 5.21 µs, gate_up 24.19 -> 23.64; down would need 64 parts
# at 128 columns and took 13.9 against 13.0; docs/lab_notes/2026-12-01-fifty-sixth-session.md).
ONE_ROW_WIDE = {"block_n": 128, "programs_per_core": 7, "max_parts": 32}


def _planes_entry(m: int) -> tuple[str, Int4Config]:
    return PLANES_CONFIGS[1 if m == 1 else 16 if m <= 16 else 64]


def default_kernel(m: int, group_size: int) -> str:
    """The kernel :func:`int4_matmul` runs for ``m`` rows and ``group_size``."""
    if m > max(PLANES_CONFIGS):
        return "tile"
    if m == 1 or group_size % PLANES_MIN_GROUP == 0:
        return _planes_entry(m)[0]
    return "tile"


def _shape_kn(qweight: jax.Array) -> tuple[int, int]:
    return qweight.shape[0] * 8, qweight.shape[1]


def _unpack_codes(words: jax.Array) -> jax.Array:
    """Codes of a word tile ``[BK/8, BN]`` → ``int32 [BK, BN]`` in the kernel's row order: row
    ``p·BK/8 + r`` holds input row ``8r + p`` of the tile."""
    shifts = jnp.arange(0, 32, 4, dtype=jnp.int32)
    nib = (words[None, :, :] >> shifts[:, None, None]) & 0xF  # [8, rows, cols]
    return nib.reshape(8 * words.shape[0], words.shape[1])


def dequantize(qweight, scales, zeros=None, *, group_size: int, dtype=jnp.float32):
    """``[K, N]`` weights in natural row order (rows in stored order, before ``perm``)."""
    k, n = _shape_kn(qweight)
    q = _unpack_codes(qweight.astype(jnp.int32)).reshape(8, k // 8, n).transpose(1, 0, 2).reshape(k, n)
    groups = jnp.arange(k) // group_size
    z = SYM_ZERO if zeros is None else zeros.astype(jnp.float32)[groups]
    w = (q.astype(jnp.float32) - z) * scales.astype(jnp.float32)[groups]
    return w.astype(dtype)


def int4_matmul_reference(x, qweight, scales, zeros=None, perm=None, *, group_size: int, out_dtype=None):
    """``x [..., K] @ dequant(W) → [..., N]`` in plain jnp (fp32 accumulation; the model's xla path)."""
    if perm is not None:
        x = jnp.take(x, perm, axis=-1)
    w = dequantize(qweight, scales, zeros, group_size=group_size, dtype=x.dtype)
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jnp.dot(x, w, preferred_element_type=jnp.float32, precision=precision).astype(out_dtype or x.dtype)


def scales_after_input(x: jax.Array, scales: jax.Array) -> jax.Array:
    """``scales`` plus x's first element times zero (exact; 0 for a non-finite element too): the same
    values, but anything computed from them now waits for x (see :func:`int4_matmul_prefill`)."""
    first = x.reshape(-1)[0]
    return scales + (jnp.where(jnp.isfinite(first), first, 0) * 0).astype(scales.dtype)


def int4_matmul_prefill(x, qweight, scales, zeros=None, perm=None, *, group_size: int, out_dtype=None,
                        interpret: bool | None = None):
    """:func:`int4_matmul_reference` (same signature, plus ``interpret``) for prefill chunks: the whole weight
    dequantized by :func:`dequantize_kernel` (one memory-bound pass), then XLA's GEMM (cuBLAS).

    The dequantization reads x: x's first element times zero is added to the scales (exact; 0 for a
    non-finite element too), so it cannot start before the layer's input exists. From the parameters
    alone XLA's scheduler may start every layer's dequantization early and hold all layers' dequantized
    weights at once (the CPU compiler does; an int4 prefill chunk of MiniCPM4-8B on an H200 once held
    13.4 GB of them); an optimization barrier does not prevent it (XLA removes barriers before scheduling).

    A GEMM that dequantizes in its tiles (Pallas, Triton lowering) was measured and is slower: 1.6× this at
    1,024 rows of gate_up on an H200, though a plain bf16 Pallas GEMM of the same structure matches cuBLAS
    (docs/lab_notes/2026-11-29-thirty-fifth-session.md)."""
    scales = scales_after_input(x, scales)
    if perm is not None:
        x = jnp.take(x, perm, axis=-1)
    n = qweight.shape[1]
    if _dequant_blocks(n, group_size, DEQUANT_TILE) is None:  # tiles Triton cannot take: XLA's fusion
        w = dequantize(qweight, scales, zeros, group_size=group_size, dtype=x.dtype)
    else:
        w = dequantize_kernel(qweight, scales, zeros, group_size=group_size, dtype=x.dtype, interpret=interpret)
    if x.dtype != jnp.float32 and jnp.dtype(out_dtype or x.dtype) == x.dtype:
        # The GEMM writes x's dtype itself (cuBLAS accumulates in fp32 either way): an fp32 result converted
        # after it costs a write and a read of the fp32 output, 48 us a gate_up at 1,024 rows (H200).
        return jnp.dot(x, w)
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jnp.dot(x, w, preferred_element_type=jnp.float32, precision=precision).astype(out_dtype or x.dtype)


def _dequantize_tile(w_ref, s_ref, *rest, has_zeros):
    """One ``[BK/8, BN]`` word tile (one scale group row) → ``[BK, BN]`` weights in natural row order:
    word row r's nibble p goes to row ``8r + p`` (a broadcast over a middle axis and a row-major merge, so
    the stores are whole rows), ``(q − z)·s`` in float32 as :func:`dequantize` computes it, then rounded."""
    z_ref, o_ref = rest if has_zeros else (None, rest[0])
    rows, block_n = w_ref.shape
    shifts = 4 * lax.broadcasted_iota(jnp.int32, (1, 8, 1), 1)
    q = ((w_ref[...][:, None, :] >> shifts) & 0xF).reshape(8 * rows, block_n)
    qf = _codes_to_f32(q)
    z = z_ref[...].astype(jnp.float32) if has_zeros else float(SYM_ZERO)
    o_ref[...] = ((qf - z) * s_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


# The dequantization pass's tile (input rows x columns, warps): H200, 2026-11-29, MiniCPM4-8B linears, g128
# (docs/lab_notes/2026-11-29-thirty-fifth-session.md): gate_up 107 us = 3.1 TB/s of int4 read + bf16 written,
# down 59, qkv 34, o 39 us, against XLA's fusion of dequantize() at 175 / 96 / 54 / 46 us.
DEQUANT_TILE = (64, 512, 4)


def _dequant_blocks(n: int, group_size: int, tile: tuple[int, int, int]) -> tuple[int, int] | None:
    """(input rows, columns) of :func:`dequantize_kernel`'s tile for ``n`` columns and ``group_size``, or None
    where they would not be powers of 2 (Triton's block shapes must be)."""
    block_k = _chunk(tile[0], group_size)
    block_n = _largest_pow2_divisor(n, tile[1], 8)
    return (block_k, block_n) if is_power_of_2(block_k // 8) and is_power_of_2(block_n) else None


def dequantize_kernel(qweight, scales, zeros=None, *, group_size: int, dtype=jnp.float32,
                      tile: tuple[int, int, int] | None = None, interpret: bool | None = None):
    """:func:`dequantize` (same signature, plus the launch ``tile`` and ``interpret``) as one Pallas kernel:
    a ``[block_k, block_n]`` output tile per program, ``block_k`` inside one scale group.

    qweight ``int32 [K/8, N]``; scales / zeros ``[K/group_size, N]``; returns ``[K, N]`` in ``dtype``,
    equal to :func:`dequantize` bit for bit."""
    k, n = _shape_kn(qweight)
    tile = tile or DEQUANT_TILE
    blocks = _dequant_blocks(n, group_size, tile)
    if blocks is None:
        raise ValueError(f"no power-of-2 dequantization tile for N={n}, group_size={group_size}")
    (block_k, block_n), num_warps = blocks, tile[2]
    per_group = group_size // block_k
    group_spec = pl.BlockSpec((1, block_n), lambda i, j: (i // per_group, j))
    in_specs = [pl.BlockSpec((block_k // 8, block_n), lambda i, j: (i, j)), group_spec]
    args = [qweight.astype(jnp.int32), scales]
    if zeros is not None:
        in_specs.append(group_spec)
        args.append(zeros)
    return pl.pallas_call(
        functools.partial(_dequantize_tile, has_zeros=zeros is not None),
        grid=(k // block_k, n // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_k, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((k, n), dtype),
        **launch_options(KernelConfig(block_k, block_n, num_warps, 1), interpret),
    )(*args)


def _codes_to_f32(q: jax.Array) -> jax.Array:
    """int32 codes in [0, 16) → float32, without the slow int→float conversion instruction: OR the code
    into the mantissa of 2²³ (exactly 2²³ + q) and subtract 2²³ (exact)."""
    return lax.bitcast_convert_type(q | 0x4B000000, jnp.float32) - 8388608.0


def _kpacked_x(x: jax.Array) -> jax.Array:
    """Activations ``[..., BK]`` in natural row order → the kpacked code order (row ``8r + p`` at
    position ``p·BK/8 + r``): a transpose of a small tile in registers, so no gather runs outside."""
    lead, bk = x.shape[:-1], x.shape[-1]
    x = x.reshape(*lead, bk // 8, 8)
    x = x.T if not lead else x.transpose(0, 2, 1)
    return x.reshape(*lead, bk)


def _kpacked_scaled_codes(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """kpacked words ``[R, BN]`` → (``q·2^e`` as float32 ``[8R, BN]`` in code order, ``2^-e`` per row ``[8R]``).

    Nibble p is masked in place (no shift for p ≤ 4; shifted down to bit 16 for p > 4) and OR-ed into the
    mantissa of 2²³, so each code costs one AND-OR and one subtraction; the power of two ``2^e`` is
    folded into x instead (exact)."""
    p = lax.broadcasted_iota(jnp.int32, (8, 1, 1), 0)
    shift = jnp.maximum(4 * p - 16, 0)
    e = 4 * p - shift  # 0, 4, 8, 12, 16, 16, 16, 16: q·2^e < 2^20 stays inside the mantissa
    masked = (words[None, :, :] >> shift) & (0xF << e)
    qf = lax.bitcast_convert_type(masked | 0x4B000000, jnp.float32) - 8388608.0
    rows = words.shape[0]
    inv = jnp.broadcast_to(jnp.exp2(-e.astype(jnp.float32)).reshape(8, 1), (8, rows)).reshape(8 * rows)
    return qf.reshape(8 * rows, words.shape[1]), inv


def _chunk_dot(x_ref, words, s0, chunk: int, gemv: bool) -> tuple[jax.Array, jax.Array]:
    """``(Σ_k x·q [rows, BN], Σ_k x [rows, 1])`` in fp32 over input rows ``[s0, s0 + chunk)``."""
    if gemv:
        x = _kpacked_x(x_ref[0, pl.ds(s0, chunk)].astype(jnp.float32))
        q, inv = _kpacked_scaled_codes(words)
        return jnp.sum(q * (x * inv)[:, None], axis=0, keepdims=True), jnp.sum(x).reshape(1, 1)
    q = _codes_to_f32(_unpack_codes(words))
    x = _kpacked_x(x_ref[:, pl.ds(s0, chunk)])
    if x.dtype == jnp.float32:  # exact tests
        dot = jnp.dot(x, q, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    else:
        dot = jnp.dot(x, q.astype(x.dtype), preferred_element_type=jnp.float32)
    return dot, jnp.sum(x.astype(jnp.float32), axis=1, keepdims=True)


def _kernel(x_ref, w_ref, s_ref, *rest, chunk, chunks, steps, group_size, gemv, has_zeros):
    """One program: rows ``block_m`` × columns ``block_n`` × one K split of ``steps`` blocks, each block
    ``chunks`` sub-blocks of ``chunk`` input rows inside one scale group (all weight loads of a block are
    issued before any use, so several are in flight)."""
    z_ref, o_ref = rest if has_zeros else (None, rest[0])
    split = pl.program_id(2)
    block_k = chunk * chunks

    def step(i, acc):
        k0 = pl.multiple_of((split * steps + i) * block_k, block_k)
        starts = [k0 + j * chunk for j in range(chunks)]
        words = [w_ref[pl.ds(pl.multiple_of(s0 // 8, chunk // 8), chunk // 8), :] for s0 in starts]
        for s0, w in zip(starts, words):
            dot, xsum = _chunk_dot(x_ref, w, s0, chunk, gemv)
            g = s0 // group_size
            s = s_ref[pl.ds(g, 1), :].astype(jnp.float32)  # [1, BN]
            z = z_ref[pl.ds(g, 1), :].astype(jnp.float32) if has_zeros else SYM_ZERO
            acc = acc + s * (dot - z * xsum)
        return acc

    rows = 1 if gemv else x_ref.shape[0]
    acc = lax.fori_loop(0, steps, step, jnp.zeros((rows, o_ref.shape[-1]), jnp.float32))
    o_ref[...] = acc


def _largest_divisor(n: int, limit: int, multiple_of: int = 1) -> int:
    best = multiple_of
    for d in range(multiple_of, min(n, limit) + 1, multiple_of):
        if n % d == 0:
            best = d
    return best


def _largest_pow2_divisor(n: int, limit: int, at_least: int) -> int:
    """The largest power of 2 in [at_least, limit] dividing n (Triton tiles are powers of 2), else n."""
    best, d = n, at_least
    while d <= min(n, limit):
        if n % d == 0:
            best = d
        d *= 2
    return best


def _chunk(block_k: int, group_size: int) -> int:
    """Rows of one sub-block: block_k, capped at the scale group (a sub-block never spans two groups)."""
    if group_size % 8:
        raise ValueError(f"group_size {group_size} is not a multiple of 8 (a word holds 8 rows)")
    return _largest_divisor(group_size, min(block_k, group_size), 8)


def choose_config(m: int, k: int, n: int, group_size: int, base: Int4Config | None = None, kernel: str = "tile",
                  splits: int | None = None) -> tuple[Int4Config, int]:
    """(launch config, number of K splits) for an ``[m, k] @ [k, n]`` problem; ``base`` (default: the
    table entry of ``kernel`` for m, one row widened by :data:`ONE_ROW_WIDE`) has its block sizes shrunk to
    divisors of the problem (of K / splits when ``splits`` is given)."""
    default = base is None and kernel != "tile"
    if default:
        base = _planes_entry(m)[1]
    cfg = base or (GEMV_CONFIG if m == 1 else DOT_CONFIGS[min(128, max(16, next_power_of_2(m)))])
    launch = _launch(cfg, m, k, n, group_size, kernel, splits)
    if default and m == 1 and splits is None:
        wide = _launch(dataclasses.replace(cfg, block_n=ONE_ROW_WIDE["block_n"]), m, k, n, group_size, kernel, None)
        programs = n // wide[0].block_n * wide[1]
        if (wide[0].block_n > launch[0].block_n and wide[1] <= ONE_ROW_WIDE["max_parts"]
                and programs >= ONE_ROW_WIDE["programs_per_core"] * num_cores()):
            return wide
    return launch


def _launch(cfg: Int4Config, m: int, k: int, n: int, group_size: int, kernel: str,
            splits: int | None) -> tuple[Int4Config, int]:
    """:func:`choose_config` from one starting config: (config, K splits)."""
    block_n = _largest_pow2_divisor(n, cfg.block_n, 8)
    chunk = _chunk(min(cfg.block_k, max(1, k // splits)) if splits else cfg.block_k, group_size)
    k_split = k // splits if splits and k % (splits * chunk) == 0 else k
    block_k = chunk * _largest_divisor(k_split // chunk, max(1, cfg.block_k // chunk))
    tiles = -(-m // cfg.block_m) * (n // block_n)
    steps = k // block_k
    if splits:
        return dataclasses.replace(cfg, block_n=block_n, block_k=block_k), splits
    # split K until there are PROGRAMS_PER_CORE programs per core (deterministic partial sums, reduced by XLA)
    if kernel == "tile":
        per_core = PROGRAMS_PER_CORE["dot"]
    else:  # the nibble-plane kernels: the one-row GEMV mode, `planes`, or `planes_t` (the dot tiles' count)
        per_core = PROGRAMS_PER_CORE["gemv" if m == 1 else kernel if kernel in PROGRAMS_PER_CORE else "dot"]
    splits = _largest_divisor(steps, max(1, per_core * num_cores() // tiles))
    return dataclasses.replace(cfg, block_n=block_n, block_k=block_k), splits


def int4_matmul(
    x,
    qweight,
    scales,
    zeros=None,
    perm=None,
    *,
    group_size: int,
    out_dtype=None,
    config: Int4Config | None = None,
    splits: int | None = None,
    kernel: str | None = None,
    interpret: bool | None = None,
):
    """Pallas W4A16 matmul with the signature of :func:`int4_matmul_reference`.

    config / splits: override the launch choice of :func:`choose_config` (tuning, tests).
    kernel: "tile" or "planes" / "planes_t" (:mod:`pallas_kernels.int4_planes`); default :func:`default_kernel`.
    """
    if math.prod(x.shape[:-1]) > MAX_KERNEL_ROWS and config is None:  # prefill chunks: dequantize, XLA's GEMM
        return int4_matmul_prefill(x, qweight, scales, zeros, perm, group_size=group_size, out_dtype=out_dtype,
                                   interpret=interpret)
    y = int4_matmul_parts(x, qweight, scales, zeros, perm, group_size=group_size, config=config, splits=splits,
                          kernel=kernel, interpret=interpret)
    return y.total().astype(out_dtype or x.dtype)


def int4_matmul_parts_reference(x, qweight, scales, zeros=None, perm=None, *, group_size: int,
                                max_parts: int | None = None) -> SplitSum:
    """:func:`int4_matmul_reference` in fp32 as one part: ``SplitSum([1, rows, N])`` (one is at most any
    ``max_parts``)."""
    del max_parts
    return SplitSum.whole(int4_matmul_reference(x, qweight, scales, zeros, perm, group_size=group_size,
                                                out_dtype=jnp.float32))


def int4_matmul_parts(x, qweight, scales, zeros=None, perm=None, *, group_size: int, max_parts: int | None = None,
                      config: Int4Config | None = None, splits: int | None = None, kernel: str | None = None,
                      interpret: bool | None = None) -> SplitSum:
    """:func:`int4_matmul` in fp32 with the kernels' K-split partial sums left unreduced, for a consumer that adds
    them as it reads them: a row-parallel linear's all-reduce kernel (``pallas_kernels.residual``), the RoPE
    kernel (``pallas_kernels.rope_write``). Prefill chunks: one part.

    max_parts: the most parts the consumer adds (the fused all-reduce: ``MAX_PARTS``); the kernel's own split is
    cut to a divisor of it (without ``config`` / ``splits``). MiniCPM4-8B's down_proj at TP 2 (K = 8192) in 8
    parts instead of 32 cost its kernel 0.1 µs on an H200 and saves XLA's sum of 32 (1.5 µs a layer, session 50);
    its q/k/v in 8 instead of 16 would cost 2.4 µs, so the RoPE kernel takes them all."""
    k, n = _shape_kn(qweight)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    if k % group_size or scales.shape != (k // group_size, n):
        raise ValueError(f"scales {scales.shape} do not match K={k}, N={n}, group_size={group_size}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > MAX_KERNEL_ROWS and config is None:
        return SplitSum.whole(int4_matmul_prefill(x, qweight, scales, zeros, perm, group_size=group_size,
                                                  out_dtype=jnp.float32, interpret=interpret))
    kernel = kernel or default_kernel(m, group_size)
    if kernel not in KERNELS:
        raise ValueError(f"unknown int4 kernel {kernel!r}; expected one of {KERNELS}")
    cfg, num_splits = choose_config(m, k, n, group_size, config, kernel, splits)
    if splits is None and config is None and max_parts is not None:
        num_splits = _largest_divisor(num_splits, max_parts)  # still divides K's steps; the tiles are kept
    block_k = cfg.block_k
    chunk = _chunk(block_k, group_size)
    if block_k % chunk or k % (block_k * num_splits):
        raise ValueError(f"block_k {block_k} x {num_splits} splits does not tile K={k} in groups of {group_size}")
    if kernel != "tile":
        return SplitSum(planes_matmul(x2, qweight, scales, zeros, perm, cfg, num_splits, chunk, group_size, kernel,
                                      interpret), (*lead, n))
    if perm is not None:
        x2 = jnp.take(x2, perm, axis=1)
    gemv = m == 1
    block_m = 1 if gemv else cfg.block_m
    m_pad = -(-m // block_m) * block_m
    if m_pad != m:
        x2 = jnp.pad(x2, ((0, m_pad - m), (0, 0)))
    block_n = cfg.block_n
    grid = (m_pad // block_m, n // block_n, num_splits)
    has_zeros = zeros is not None
    in_specs = [
        pl.BlockSpec((block_m, k), lambda i, j, s: (i, 0)),
        pl.BlockSpec((qweight.shape[0], block_n), lambda i, j, s: (0, j)),
        pl.BlockSpec((scales.shape[0], block_n), lambda i, j, s: (0, j)),
    ]
    args = [x2, qweight, scales]
    if has_zeros:
        in_specs.append(pl.BlockSpec((scales.shape[0], block_n), lambda i, j, s: (0, j)))
        args.append(zeros)
    kernel = functools.partial(
        _kernel, chunk=chunk, chunks=block_k // chunk, steps=k // block_k // num_splits, group_size=group_size,
        gemv=gemv, has_zeros=has_zeros,
    )
    partial = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((num_splits, m_pad, n), jnp.float32),
        **launch_options(KernelConfig(block_m, chunk, cfg.num_warps, cfg.num_stages), interpret),
    )(*args)
    return SplitSum(partial, (*lead, n))
