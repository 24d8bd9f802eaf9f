"""The tensor-parallel collectives away from the block boundary: a sum over the mesh axis (``all_reduce``: the
vocab-parallel embedding lookup's, a row-parallel linear called whole) and the vocab-parallel gather
(``gather_last``: the shards' blocks of the last axis, concatenated in rank order: the logits).

The references are XLA's ``lax.psum`` and ``lax.all_gather``, which XLA's GPU runtime runs as thunks between CUDA
graphs: with them a split decode step was several graphs launched by the host. The ``pallas`` namespace's ops go
through the peer-memory kernel (:mod:`pallas_kernels.peer_all_reduce`) when the axis has a workspace (``peers``)
and the message fits it, so nothing splits the step's graph (2× H200, 2026-11-30, same process, TP 2 decode
at 1K: bf16 3.308 → 3.254 ms/token, int4 2.349 → 2.177). The sublayers' reductions at the block boundary are
:mod:`pallas_kernels.residual`'s.

Shapes: ``all_reduce``: any ``x``, the result in its shape and dtype; ``gather_last``: ``x [..., n]`` →
``[..., n · axis size]`` in x's dtype. Call inside ``shard_map`` over ``axis_name``.
"""

from __future__ import annotations

from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.peer_all_reduce import MAX_ELEMENTS, PeerWorkspace, peer_all_reduce


def all_reduce_reference(x: jax.Array, *, axis_name: Hashable, peers: PeerWorkspace | None = None) -> jax.Array:
    """``lax.psum(x, axis_name)``; ``peers`` (the axis' peer-memory workspace) is ignored."""
    del peers
    return lax.psum(x, axis_name)


def gather_last_reference(x: jax.Array, *, axis_name: Hashable, peers: PeerWorkspace | None = None) -> jax.Array:
    """The shards' ``x`` concatenated along the last axis in rank order (``lax.all_gather``, tiled); ``peers``
    is ignored."""
    del peers
    return lax.all_gather(x, axis_name, axis=x.ndim - 1, tiled=True)


def all_reduce(x: jax.Array, *, axis_name: Hashable, peers: PeerWorkspace | None = None) -> jax.Array:
    """:func:`all_reduce_reference` through :func:`~pallas_kernels.peer_all_reduce.peer_all_reduce` when ``peers``
    is given and ``x`` is a float array of at most :data:`~pallas_kernels.peer_all_reduce.MAX_ELEMENTS` elements:
    summed in fp32 and cast back to x's dtype (at 2 ranks ``psum``'s result; exact wherever one rank holds each
    nonzero, as in a vocab-parallel lookup), else XLA's."""
    if peers is None or not jnp.issubdtype(x.dtype, jnp.floating) or x.size > MAX_ELEMENTS:
        return lax.psum(x, axis_name)
    return peer_all_reduce(x.astype(jnp.float32), peers, axis_name).astype(x.dtype)


def gather_last(x: jax.Array, *, axis_name: Hashable, peers: PeerWorkspace | None = None) -> jax.Array:
    """:func:`gather_last_reference`; with ``peers`` and a result of at most ``MAX_ELEMENTS`` elements, written as
    a sum: each shard's block placed in zeros at its rank's offset, then :func:`all_reduce` (exact up to the sign
    of zero: ``-0.0`` comes back as ``0.0``). It moves the zeros too (``size`` times the gather's bytes), which at a
    decode step's few rows costs less than the graph split of XLA's all-gather."""
    size = lax.axis_size(axis_name)
    if peers is None or not jnp.issubdtype(x.dtype, jnp.floating) or x.size * size > MAX_ELEMENTS:
        return gather_last_reference(x, axis_name=axis_name)
    n = x.shape[-1]
    placed = lax.dynamic_update_slice_in_dim(jnp.zeros((*x.shape[:-1], n * size), x.dtype), x,
                                             lax.axis_index(axis_name) * n, axis=x.ndim - 1)
    return all_reduce(placed, axis_name=axis_name, peers=peers)
