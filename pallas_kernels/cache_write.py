"""Writing a few new tokens' keys and values into the stacked KV cache: a jnp reference and a Pallas kernel.

XLA lowers the reference's two dropping scatters to four kernels per layer on a GPU (for each of K and V a
read of the old slot, a select against the drop condition and a dynamic-update-slice), ~2 µs each in a
decode step. The kernel is one launch that stores the valid tokens in place (the caches are aliased to its
outputs) and skips the rest.

Shared signature::

    f(k_cache, v_cache, k_new, v_new, slots, *, layer) -> (k_cache, v_cache)

k_cache / v_cache ``[num_layers, batch, kv_heads, max_length, head_dim]``; k_new / v_new ``[batch, T,
kv_heads, head_dim]`` (cast to the cache dtype); slots ``int32 [batch, T]``: where token ``t`` of row ``b``
goes in ``layer``. Slots outside ``[0, max_length)`` are dropped (padding, finished rows).

Paged signature (the pool of :mod:`pallas_kernels.attention`'s paged kernels)::

    f(k_pages, v_pages, k_new, v_new, slots, *, layer) -> (k_pages, v_pages)

k_pages / v_pages ``[num_layers, kv_heads, N, head_dim]`` (N = num_pages * page_size); slots ``int32
[batch, T]``: the flat pool slot of each token (``page_table[b, pos // page_size] * page_size + pos %
page_size``, computed by the caller); slots outside ``[0, N)`` are dropped. The one kernel body serves both
layouts: a program stores one token's head at a row of the ``[rows, head_dim]`` slice its BlockSpec picks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.launch import KernelConfig, launch_options

# Decode steps and tree verification write a few tokens per row; longer chunks (prefill) keep XLA's scatter,
# which is one pass over the new rows however many there are.
MAX_KERNEL_TOKENS = 64


def cache_write_reference(k_cache, v_cache, k_new, v_new, slots, *, layer: int):
    """The write as two dropping scatters (the oracle, and the path for long chunks)."""
    s = k_cache.shape[3]
    idx = jnp.where((slots >= 0) & (slots < s), slots, s)  # out of bounds -> dropped by the scatter
    rows = jnp.arange(k_cache.shape[1])[:, None]
    k = k_cache.at[layer, rows, :, idx].set(k_new.astype(k_cache.dtype), mode="drop")
    v = v_cache.at[layer, rows, :, idx].set(v_new.astype(v_cache.dtype), mode="drop")
    return k, v


def paged_cache_write_reference(k_pages, v_pages, k_new, v_new, slots, *, layer: int):
    """The paged write as two dropping scatters into ``[L, KVH, N, D]`` (the oracle, and the path for long
    chunks)."""
    n = k_pages.shape[2]
    idx = jnp.where((slots >= 0) & (slots < n), slots, n)  # [B, T]; out of bounds -> dropped by the scatter
    # layer and idx are advanced indices split by a slice: the result is indexed [B, T, KVH, D], as k_new.
    k = k_pages.at[layer, :, idx].set(k_new.astype(k_pages.dtype), mode="drop")
    v = v_pages.at[layer, :, idx].set(v_new.astype(v_pages.dtype), mode="drop")
    return k, v


def _write_kernel(slot_ref, kn_ref, vn_ref, _k_in, _v_in, k_ref, v_ref, *, tokens, max_length):
    """Program (b, t, h): stores token t's head h of row b at its slot (a row of the ``[max_length, D]``
    slice the BlockSpec picked: row b's head h of the stacked cache, or head h of the paged pool), unless
    the slot is out of range."""
    slot = slot_ref[pl.program_id(0) * tokens + pl.program_id(1)]

    @pl.when((slot >= 0) & (slot < max_length))
    def _():
        k_ref[pl.ds(slot, 1), :] = kn_ref[...][None, :]
        v_ref[pl.ds(slot, 1), :] = vn_ref[...][None, :]


def _write_call(k_cache, v_cache, k_new, v_new, slots, cache_spec, name, interpret):
    """One launch over (row, token, KV head) storing in place into the caches (aliased to the outputs);
    ``cache_spec``: the BlockSpec of the ``[rows, D]`` slice a program writes into."""
    b, t, h, d = k_new.shape
    new_spec = pl.BlockSpec((None, None, None, d), lambda i, j, n: (i, j, n, 0))
    return pl.pallas_call(
        functools.partial(_write_kernel, tokens=t, max_length=k_cache.shape[-2]),
        grid=(b, t, h),
        in_specs=[pl.BlockSpec((b * t,), lambda i, j, n: (0,)), new_spec, new_spec, cache_spec, cache_spec],
        out_specs=[cache_spec, cache_spec],
        out_shape=[jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={3: 0, 4: 1},
        name=name,
        **launch_options(KernelConfig(block_q=1, block_k=1, num_warps=1, num_stages=1), interpret),
    )(slots.reshape(b * t).astype(jnp.int32), k_new.astype(k_cache.dtype), v_new.astype(v_cache.dtype),
      k_cache, v_cache)


def check_new(k_new, v_new, slots):
    """ValueError unless values and slots match the new keys' ``[B, T, ...]``."""
    if v_new.shape != k_new.shape or slots.shape != k_new.shape[:2]:
        raise ValueError(f"values {v_new.shape} / slots {slots.shape} do not match keys {k_new.shape}")


def cache_write(k_cache, v_cache, k_new, v_new, slots, *, layer: int, interpret: bool | None = None):
    """Pallas version of :func:`cache_write_reference` (one launch, in place); more than
    ``MAX_KERNEL_TOKENS`` tokens per row go to the reference."""
    b, t, h, d = k_new.shape
    if k_cache.shape[1:3] != (b, h) or k_cache.shape[4] != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"new keys {k_new.shape} do not fit the cache {k_cache.shape}")
    check_new(k_new, v_new, slots)
    if t > MAX_KERNEL_TOKENS:
        return cache_write_reference(k_cache, v_cache, k_new, v_new, slots, layer=layer)
    spec = pl.BlockSpec((None, None, None, k_cache.shape[3], d), lambda i, j, n: (layer, i, n, 0, 0))
    return _write_call(k_cache, v_cache, k_new, v_new, slots, spec, "minicpm_cache_write", interpret)


def paged_cache_write(k_pages, v_pages, k_new, v_new, slots, *, layer: int, interpret: bool | None = None):
    """Pallas version of :func:`paged_cache_write_reference` (one launch, in place); more than
    ``MAX_KERNEL_TOKENS`` tokens per row go to the reference."""
    b, t, h, d = k_new.shape
    if k_pages.ndim != 4 or k_pages.shape[1] != h or k_pages.shape[3] != d or v_pages.shape != k_pages.shape:
        raise ValueError(f"new keys {k_new.shape} do not fit the paged pool {k_pages.shape}")
    check_new(k_new, v_new, slots)
    if t > MAX_KERNEL_TOKENS:
        return paged_cache_write_reference(k_pages, v_pages, k_new, v_new, slots, layer=layer)
    # Program (b, t, h) writes into KV head h's [N, D] slice of the layer, whichever row it serves.
    spec = pl.BlockSpec((None, None, k_pages.shape[2], d), lambda i, j, n: (layer, n, 0, 0))
    return _write_call(k_pages, v_pages, k_new, v_new, slots, spec, "minicpm_paged_cache_write", interpret)
