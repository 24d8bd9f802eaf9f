"""The residual stream at the end of a sublayer: the sublayer's partial sums reduced over the
tensor-parallel devices, scaled, added to the residual, and the next RMSNorm of the sum.

A row-parallel linear (``o_proj``, ``down_proj``) leaves each device a partial sum of the sublayer's
output. The reduction sits here, at the block boundary, not inside the linear (as gpt-fast's ``tp.py``
places it): a collective that also adds the residual and normalises (the fused all-reduce + add + RMSNorm
of SGLang's and vLLM's custom all-reduce) is then one op with one signature. The references are
XLA's all-reduce (``lax.psum``, which XLA lowers to NCCL or its one-shot kernel), then the add and the norm
as XLA fuses them. The ``pallas`` namespace's ops (:func:`residual_add`, :func:`residual_add_norm`) reduce
through :func:`~pallas_kernels.peer_all_reduce.peer_all_reduce` when the axis has a peer-memory workspace
(``peers``) and the message fits, so XLA keeps the whole step in one CUDA graph; ``residual_add_norm``
then does the add and the norm in the same kernel
(:func:`~pallas_kernels.peer_all_reduce.peer_all_reduce_add_norm`) for up to 32 rows (decode steps, verify
trees). Without a reduction the add and the norm stay XLA's: a Pallas add + norm was measured slower on one
GPU (docs/lab_notes, twenty-seventh session): XLA fuses the preceding GEMM's split-K reduction into the add,
which a custom call cannot absorb.

**The message's dtype.** Partial sums are added across devices in fp32 up to :data:`WIDE_MESSAGE` elements
(the peer kernel's messages: decode steps, verify trees, up to 64 rows of 4,096). A larger message — a prefill
chunk, or a decode / verify batch of more rows — is rounded to the residual's dtype first and reduced in it, as
vLLM, SGLang and gpt-fast reduce every message: it halves the bytes XLA's all-reduce moves, which was the only
part of a 32K-token prefill that did not scale over 2 GPUs (151 of 896 ms of kernels a GPU; bf16: 84 ms,
prefill 1.62× → 1.73× the one-GPU speed in one call, 2× H200, 2026-11-29; BENCHMARKS.md). The cost is the
roundings (at 2 devices ``round(round(a) + round(b))`` where fp32 gives ``round(a + b)``; with more, NCCL's ring
also rounds each partial sum on its way); fp32 models are unchanged.

Shapes: ``partial [..., H]`` (fp32 when it is a partial sum over devices, else the residual's dtype), or a
row-parallel linear's :class:`~pallas_kernels.matmul.SplitSum` of it (its K-split parts, unreduced: the fused
kernel adds them as it reads them; every other path adds them first); ``residual [..., H]`` (the activation
dtype), ``weight [H]``; results in the residual's dtype.
"""

from __future__ import annotations

from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.collectives import all_reduce
from pallas_kernels.matmul import SplitSum, summed
from pallas_kernels.peer_all_reduce import MAX_ELEMENTS, PeerWorkspace, fits_rows, peer_all_reduce_add_norm

# Elements of a device's message above which it is reduced in the residual's dtype (the module docstring):
# the peer kernel's largest message, so every message the kernel takes stays fp32.
WIDE_MESSAGE = MAX_ELEMENTS


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps) * weight`` with fp32 statistics, as the HF code: normalised in fp32,
    cast to x's dtype, then multiplied by the weight (in x's dtype)."""
    xf = x.astype(jnp.float32)
    normed = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight.astype(x.dtype)


def _add(total: jax.Array, residual: jax.Array, scale: float) -> jax.Array:
    return residual + total.astype(residual.dtype) * jnp.asarray(scale, residual.dtype)


def residual_add_reference(partial: jax.Array | SplitSum, residual: jax.Array, scale: float, *,
                           axis_name: Hashable | None = None, peers: PeerWorkspace | None = None) -> jax.Array:
    """``residual + sum(partial) * scale``: ``partial`` (its parts added, if split) summed over the devices of
    mesh axis ``axis_name`` (None: it is the whole output already; ``lax.psum`` of the message, in fp32 up to
    :data:`WIDE_MESSAGE` elements, else in the residual's dtype), rounded to the residual's dtype, then scaled
    and added. ``peers`` (the axis' peer-memory workspace) does not change the result: the reference ignores it."""
    del peers
    partial = summed(partial)
    return _add(partial if axis_name is None else lax.psum(_message(partial, residual), axis_name), residual, scale)


def _message(partial: jax.Array, residual: jax.Array) -> jax.Array:
    """What a device sends to the all-reduce: ``partial`` itself, or rounded to the residual's dtype when it
    has more than :data:`WIDE_MESSAGE` elements (a prefill chunk's, or a batch's of over 64 rows of 4,096)."""
    return partial.astype(residual.dtype) if partial.size > WIDE_MESSAGE else partial


def residual_add_norm_reference(partial: jax.Array | SplitSum, residual: jax.Array, scale: float, weight: jax.Array, *,
                                eps: float, axis_name: Hashable | None = None,
                                peers: PeerWorkspace | None = None) -> tuple[jax.Array, jax.Array]:
    """:func:`residual_add_reference`, and the RMSNorm (``weight``, ``eps``) of its result: ``(residual',
    rms_norm(residual'))`` — the input of the next sublayer."""
    h = residual_add_reference(partial, residual, scale, axis_name=axis_name, peers=peers)
    return h, rms_norm(h, weight, eps)


def _reduce(partial: jax.Array, residual: jax.Array, axis_name: Hashable | None,
            peers: PeerWorkspace | None) -> jax.Array:
    if axis_name is None:
        return partial
    # The message the reference sends, through the peer kernel when it takes it (an fp32 message: up to
    # WIDE_MESSAGE elements), else XLA's collective (no workspace, or a prefill chunk's wide message).
    return all_reduce(_message(partial, residual), axis_name=axis_name, peers=peers)


def residual_add(partial: jax.Array | SplitSum, residual: jax.Array, scale: float, *,
                 axis_name: Hashable | None = None, peers: PeerWorkspace | None = None) -> jax.Array:
    """:func:`residual_add_reference`, reduced through the peer-memory kernel when ``peers`` is given and the
    message fits it (:func:`~pallas_kernels.collectives.all_reduce`: up to 256K elements), else through ``lax.psum``."""
    return _add(_reduce(summed(partial), residual, axis_name, peers), residual, scale)


def residual_add_norm(partial: jax.Array | SplitSum, residual: jax.Array, scale: float, weight: jax.Array, *,
                      eps: float, axis_name: Hashable | None = None,
                      peers: PeerWorkspace | None = None) -> tuple[jax.Array, jax.Array]:
    """:func:`residual_add_norm_reference`: one kernel for the reduction, the add and the norm
    (:func:`~pallas_kernels.peer_all_reduce.peer_all_reduce_add_norm`, which also adds a ``SplitSum``'s parts)
    when ``peers`` is given and the rows fit (:func:`~pallas_kernels.peer_all_reduce.fits_rows`: up to 32),
    else :func:`residual_add`'s reduction, then XLA's add and norm. Every row count it fits: measured end to
    end on 2x H200 (MiniCPM4-8B shape, TP 2), one row gained (3.398 -> 3.252 ms/token, 2026-11-28), and 16 rows,
    which lost with the first version's 1,024-element tiles (3.867 -> 4.058; 3.467 -> 3.80 on 2026-11-30),
    gained with 512 (3.467 -> 3.37 per step; docs/lab_notes/2026-11-30-fifty-second-session.md) and more with
    256, the tiling of several rows since 2026-12-01 (3.349 -> 3.246; ``peer_all_reduce.row_tiling``)."""
    if axis_name is not None and fits_rows(partial, peers):
        return peer_all_reduce_add_norm(partial, residual, scale, weight, eps=eps, workspace=peers,
                                        axis_name=axis_name)
    h = residual_add(partial, residual, scale, axis_name=axis_name, peers=peers)
    return h, rms_norm(h, weight, eps)
