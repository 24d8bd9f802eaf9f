"""The nibble-plane int4 kernels (``planes`` / ``planes_t``, :mod:`pallas_kernels.int4_matmul` picks them): a
sub-block of ``8·r`` input rows (inside one scale group) of GPTQ's kpacked words ``int32 [K/8, N]`` is read as
``[r, block_n]`` words and handled as 8 nibble planes of ``[r, block_n]`` codes (nibble p of every word is plane p),
each multiplied by the matching plane of x (``x[8r + p]`` in plane p).

* one row (batch-1 decode): elementwise products accumulated in ``[r, block_n]`` and reduced over rows once at the
  end, x's planes split out of x itself in registers; a GEMV with K split over many programs.
* 2..16 rows (``planes``): tensor-core dots of x's pair planes and the codes' centred pairs per sub-block.
* 17..64 rows (``planes_t``): the transposed dots, the codes as the left operand.

How codes become floats and x its planes is :mod:`pallas_kernels.int4_codes`; single PTX instructions for the GPU,
:mod:`pallas_kernels.inline_ptx`. Every kernel returns float32 K-split parts ``[S, m_pad, N]`` that the caller (or
the consumer of ``int4_matmul_parts``) adds; the reference is ``int4_matmul.int4_matmul_reference``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.inline_ptx import fma
from pallas_kernels.int4_codes import (PAIR_LOW_HALF, PLANE_BITS, SYM_ZERO, centred_pair, float32_plane, joined_x,
                                       pairs_for, plane_pair, planes_x)
from pallas_kernels.launch import KernelConfig, interpreted, launch_options


def _chunk_sums_needed(mode: str, has_zeros: bool, pairs) -> bool:
    """Whether a dot mode subtracts (zero point [+ pair offset]) · scale times x's chunk sums: with zero points,
    or with the offset pairs of ``dot_t`` (``dot``'s centred pairs carry no offset)."""
    return mode != "gemv" and (has_zeros or (pairs is not None and mode == "dot_t"))


def _plane_kernel(x_ref, w_ref, s_ref, *rest, rows, chunks, steps, group_size, mode, has_zeros, pairs=None,
                  asm=False):
    """kpacked kernel over nibble planes: a chunk of ``8·rows`` input rows (one scale group) is 8 planes
    of ``[rows, BN]`` codes, each multiplied by its plane of x; nothing is reshaped or reduced across
    threads inside the loop.

    mode "gemv" (one row): accumulates ``Σ_p q_p·x_p`` elementwise in ``[rows, BN]`` and reduces over rows
    once at the end. "dot": ``Σ_p x_p [BM, rows] @ q_p [rows, BN]`` on the tensor cores. "dot_t": the
    transposed product ``q_pᵀ [BN, rows] @ x_p [rows, BM]`` (the codes as the left operand).

    pairs (16-bit x): ``(magic, offset)`` of :data:`PAIR_CODES`. "dot" takes centred pairs (:func:`centred_pair`,
    ``q − 8``) with a pair's two codes K-adjacent: 4 dots of ``x [BM, 2·rows] @ q [2·rows, BN]`` a chunk, x in
    pair planes (:func:`joined_x`), nothing to remove without zero points. "dot_t": the codes enter the products
    as ``offset + q`` (:func:`plane_pair`), and ``(z + offset)·s`` times the chunk sums of x (``xs_ref``) is
    subtracted. The gemv mode removes ``(z + offset)·x`` row by row instead (no ``xs_ref``): minus it is the first
    term of each chunk's sum of products, so every product is one multiply-add (gate_up 26.2 → 24.6 µs on an H200,
    session 55). It reads the high code of a pair unmasked (:data:`PAIR_LOW_HALF`, ``x``'s high planes times it
    removed too). With zero points "dot" subtracts ``(z − 8)·s`` times the chunk sums.

    asm (GPU): multiply-adds, the pairs' mask and magic, and the centring subtraction as one instruction each
    (:mod:`inline_ptx`)."""
    z_ref = rest[0] if has_zeros else None
    # x's chunk sums: an input of the dot modes; the one-row mode adds its planes' rows itself (below).
    xs_ref = rest[-2] if _chunk_sums_needed(mode, has_zeros, pairs) else None
    centred = pairs is not None and mode == "dot"
    o_ref = rest[-1]
    split = pl.program_id(2)
    chunk = 8 * rows
    block_k = chunk * chunks
    zero = 0 if has_zeros else SYM_ZERO
    block_n = w_ref.shape[1]

    def dot(a, b):
        precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
        return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)

    def x_plane(r0, p):
        return x_ref[p, :, pl.ds(r0, rows)] if mode == "dot" else x_ref[p, pl.ds(r0, rows), :]

    def gemv_x(r0) -> list[jax.Array]:
        """One row: x's 8 planes of the chunk at word row r0, ``x[8(r0 + i) + p]`` for i < rows, as float32,
        split out of one contiguous load of the chunk of x itself. Planes cut outside were a launch of their own
        wherever x's producer is not an XLA fusion (105 µs a TP 2 int4 step); in the kernel alone the split beat
        them and stride-8 loads of each plane (lab note of the fifty-first session)."""
        xc = x_ref[pl.ds(8 * r0, 8 * rows)].astype(jnp.float32).reshape(rows, 8)
        return [a.reshape(rows) for a in jnp.split(xc, 8, axis=1)]

    def chunk_product(w, r0, xg, start=None):
        """``Σ_p`` plane products of one chunk: ``[BM, BN]`` (``[BN, BM]`` for dot_t, ``[rows, BN]`` gemv, whose
        x planes are ``xg``). gemv with pairs: ``start`` ``[rows, BN]`` (minus the offsets' share) is the sum's
        first term, so each product is one multiply-add and nothing is subtracted after them."""
        if not pairs:
            t = plane_product(w, r0, 0, xg)
            for p in range(1, 8):
                t = t + plane_product(w, r0, p, xg)
            return t
        t = start
        if centred:
            # A pair's two codes as K-adjacent rows (stacked, then interleaved): 4 dots of K = 2·rows, not 8 of
            # K = rows, and no offset to remove with x's chunk sums (H200, 16 rows: 85.5 vs 95.8 µs a MiniCPM4-8B
            # layer, docs/lab_notes/2026-11-30-forty-fourth-session.md).
            for p in range(4):
                q = jnp.stack(centred_pair(w, p, x_ref.dtype, asm=asm), axis=-1)  # [rows, BN, 2]
                q = q.transpose(0, 2, 1).reshape(2 * rows, block_n)
                d = dot(x_ref[p, :, pl.ds(2 * r0, 2 * rows)], q)
                t = d if t is None else t + d
            return t
        for p in range(4):
            # the one-row mode multiplies in float32 (its x planes are float32, loaded from 16-bit x)
            code_dtype = jnp.float32 if mode == "gemv" else x_ref.dtype
            for plane_p, q in zip((p, p + 4), plane_pair(w, p, pairs[0], code_dtype, asm=asm,
                                                      raw_high=mode == "gemv")):
                if mode == "gemv":
                    xq = xg[plane_p][:, None]
                    t = q * xq if t is None else fma(q, xq, t, asm=asm)
                    continue
                d = dot(q.T, x_plane(r0, plane_p))  # dot_t (dot mode takes the centred pairs above)
                t = d if t is None else t + d
        return t

    def plane_product(w, r0, p, xg):
        q = float32_plane(w, p, zero)
        if mode == "gemv":  # the float32 plane holds q·2^e_p: x's plane takes 2^-e_p (exact)
            return q * (xg[p] * float(2.0 ** -PLANE_BITS[p][1]))[:, None]
        xp = x_plane(r0, p)
        return dot(xp, q.astype(xp.dtype)) if mode == "dot" else dot(q.astype(xp.dtype).T, xp)

    def step(i, carry):
        acc, zacc = carry
        k0 = (split * steps + i) * block_k
        r0s = [pl.multiple_of((k0 + j * chunk) // 8, rows) for j in range(chunks)]
        words = [w_ref[pl.ds(r0, rows), :] for r0 in r0s]  # all loads of the step issued first
        for j, (r0, w) in enumerate(zip(r0s, words)):
            g = (k0 + j * chunk) // group_size
            s = s_ref[pl.ds(g, 1), :].astype(jnp.float32)  # [1, BN]
            if mode == "dot_t":
                s = s.reshape(block_n, 1)
            zo = None  # the zero point plus the pairs' offset, when something is to be removed with x's sums
            if centred:
                zo = z_ref[pl.ds(g, 1), :].astype(jnp.float32) - SYM_ZERO if has_zeros else None
            elif has_zeros or pairs:
                zo = z_ref[pl.ds(g, 1), :].astype(jnp.float32) if has_zeros else float(SYM_ZERO)
                zo = zo + (pairs[1] if pairs else 0)
            xg = gemv_x(r0) if mode == "gemv" else None
            correction = None
            if mode == "gemv" and zo is not None:
                # One row: zo times x, removed row by row from the chunk's [rows, BN] products before the scale:
                # x's rows are the planes' rows summed (unscaled), so no chunk sums are computed outside (an XLA
                # reduction and launch per linear).
                x_high = xg[4] + xg[5] + xg[6] + xg[7]
                xv = xg[0] + xg[1] + xg[2] + xg[3] + x_high  # [rows]
                low = PAIR_LOW_HALF * x_high if pairs else 0.0  # the unmasked high halves' low bits
                if has_zeros:  # zo [1, BN]
                    correction = fma(zo, xv[:, None], low[:, None], asm=asm) if pairs else zo * xv[:, None]
                else:  # zo a constant: one term per row
                    correction = jnp.broadcast_to((zo * xv + low)[:, None], (rows, block_n))
            starts = mode == "gemv" and pairs  # the correction starts the products' sum: no subtraction after it
            t = chunk_product(w, r0, xg, -correction if starts else None)
            t = t - correction if correction is not None and not starts else t
            # One multiply-add in every mode (as acc + t·s Triton emits FMUL + FADD; neutral at 16 rows, session 55).
            acc = fma(t, s, acc, asm=asm)
            if zo is not None and mode != "gemv":
                zs = zo * s_ref[pl.ds(g, 1), :].astype(jnp.float32)
                c = (k0 + j * chunk) // chunk  # x sums are per chunk (a group may span several)
                if mode == "dot":
                    zacc = zacc + zs * xs_ref[:, pl.ds(c, 1)]
                else:
                    zacc = zacc + zs.reshape(block_n, 1) * xs_ref[pl.ds(c, 1), :]
        return acc, zacc

    if mode == "gemv":
        shapes = (rows, block_n), (1, block_n)
    elif mode == "dot":
        shapes = (o_ref.shape[0], block_n), (o_ref.shape[0], block_n)
    else:
        shapes = (block_n, o_ref.shape[0]), (block_n, o_ref.shape[0])
    acc, zacc = lax.fori_loop(0, steps, step, tuple(jnp.zeros(sh, jnp.float32) for sh in shapes))
    if mode == "gemv":
        acc = jnp.sum(acc, axis=0, keepdims=True)
    acc = acc - zacc
    o_ref[...] = acc.T if mode == "dot_t" else acc


def planes_matmul(x2, qweight, scales, zeros, perm, cfg, num_splits: int, chunk: int, group_size: int, kernel: str,
                  interpret):
    """``x2 [m, K] @ dequant(W)`` through :func:`_plane_kernel`: its float32 K-split parts ``[S, m_pad, N]``.

    cfg: the launch (``pallas_kernels.int4_matmul.Int4Config``: block_m, block_n, block_k, warps, stages), chosen
    by ``int4_matmul.choose_config``; ``chunk`` input rows a sub-block (inside one scale group); kernel "planes" or
    "planes_t" (2+ rows; one row runs the GEMV mode of either)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    m = x2.shape[0]
    if perm is not None:
        x2 = jnp.take(x2, perm, axis=1)
    mode = "gemv" if m == 1 else ("dot" if kernel == "planes" else "dot_t")
    block_m = 1 if mode == "gemv" else cfg.block_m
    if mode != "gemv":
        # x2 is materialized before its planes are cut: otherwise XLA fuses the producer (e.g. the tree
        # attention's split combine, a 33-way reduction) into the plane transpose, whose emitter then
        # recomputes it with strided reads (15.6 of 18 us per layer in an int4 12-node verify, H200). The
        # barrier sits before the row padding so that the padding fuses into the transpose (one launch a
        # linear, not two: a 12-node verify pads to 16 rows in every int4 linear).
        x2 = lax.optimization_barrier(x2)
    m_pad = -(-m // block_m) * block_m
    if m_pad != m:
        x2 = jnp.pad(x2, ((0, m_pad - m), (0, 0)))
    rows = chunk // 8
    if mode != "gemv" and rows < 16:
        raise ValueError(f"the {kernel} kernel needs sub-blocks of >= 128 input rows (scale groups of >= 128 and "
                         f"block_k >= 128) for {m} rows; got {chunk} (group_size {group_size})")
    pairs = pairs_for(x2.dtype, mode == "gemv")
    block_n, groups = cfg.block_n, k // group_size
    if mode == "gemv":  # x as it is: the kernel splits its planes out of it (_plane_kernel's gemv_x)
        x_spec, xp = pl.BlockSpec((k,), lambda i, j, s: (0,)), x2.reshape(k)
    elif mode == "dot" and pairs:
        x_spec, xp = pl.BlockSpec((4, block_m, k // 4), lambda i, j, s: (0, i, 0)), joined_x(x2, x2.dtype)
    elif mode == "dot_t":
        x_spec = pl.BlockSpec((8, k // 8, block_m), lambda i, j, s: (0, 0, i))
        xp = planes_x(x2, True, x2.dtype, scaled=pairs is None)
    else:
        x_spec = pl.BlockSpec((8, block_m, k // 8), lambda i, j, s: (0, i, 0))
        xp = planes_x(x2, False, x2.dtype)
    in_specs = [x_spec, pl.BlockSpec((k // 8, block_n), lambda i, j, s: (0, j)),
                pl.BlockSpec((groups, block_n), lambda i, j, s: (0, j))]
    args = [xp, qweight, scales]
    if zeros is not None:
        in_specs.append(pl.BlockSpec((groups, block_n), lambda i, j, s: (0, j)))
        args.append(zeros)
    if _chunk_sums_needed(mode, zeros is not None, pairs):
        xs = x2.astype(jnp.float32).reshape(m_pad, k // chunk, chunk).sum(-1)  # [m, chunks of K]
        if mode == "dot_t":
            xs = xs.T
            in_specs.append(pl.BlockSpec((k // chunk, block_m), lambda i, j, s: (0, i)))
        else:
            in_specs.append(pl.BlockSpec((block_m, k // chunk), lambda i, j, s: (i, 0)))
        args.append(xs)
    body = functools.partial(
        _plane_kernel, rows=rows, chunks=cfg.block_k // chunk, steps=k // cfg.block_k // num_splits,
        group_size=group_size, mode=mode, has_zeros=zeros is not None, pairs=pairs,
        asm=not interpreted(interpret))
    partial = pl.pallas_call(
        body,
        grid=(m_pad // block_m, n // block_n, num_splits),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((num_splits, m_pad, n), jnp.float32),
        **launch_options(KernelConfig(block_m, chunk, cfg.num_warps, cfg.num_stages), interpret),
    )(*args)
    return partial
