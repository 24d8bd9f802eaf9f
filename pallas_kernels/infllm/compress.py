"""InfLLM-v2's compressed keys: ``K1[j] = mean(K[s*j : s*j + k])`` over complete windows (and ``K2`` the
same with the coarse window), appended as a sequence grows; a jnp reference for any number of new
tokens, and a Pallas kernel for one decode step (beside its own reference), for the contiguous cache and
for a paged pool (:mod:`pallas_kernels.infllm.paged`).

k ``[L, B, KVH, S, D]``; k1 / k2 ``[L, B, KVH, N1 | N2, D]`` (stacked caches, ``layer`` names the slice).
Means are taken in fp32 and stored in the cache dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.flash import gather_rows
from pallas_kernels.infllm.common import SPARSE_CONFIG, compressed_count
from pallas_kernels.launch import launch_options


def completed_window_means(keys_at, old_lengths: jax.Array, new_lengths: jax.Array, *, kernel: int, stride: int,
                           capacity: int, max_tokens: int, unrotate, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The windows completed by growing each row from ``old_lengths`` to ``new_lengths`` (``int32[B]``, at
    most ``max_tokens`` apart): ``(j int32[B, n], completed bool[B, n], means [B, n, KVH, D])``, window
    ``j`` averaged in fp32 and cast to ``dtype`` (rows of ``j`` past ``completed`` are not windows yet).
    keys_at: ``f(positions int32[B, n, kernel]) -> keys [B, n, kernel, KVH, D]`` (positions clamped below
    ``capacity``), the cache layout's read; unrotate as in :func:`compress_windows_reference`."""
    n_new = -(-max_tokens // stride)  # windows completed by max_tokens new keys, at most
    first = compressed_count(old_lengths, kernel=kernel, stride=stride)
    last = compressed_count(new_lengths, kernel=kernel, stride=stride)
    j = first[:, None] + jnp.arange(n_new, dtype=jnp.int32)[None, :]  # [B, n]
    key_pos = jnp.minimum(j[..., None] * stride + jnp.arange(kernel, dtype=jnp.int32), capacity - 1)
    keys = keys_at(key_pos)
    if unrotate is not None:
        shape = keys.shape
        keys = unrotate(keys.reshape(shape[0], -1, *shape[3:]), key_pos.reshape(shape[0], -1)).reshape(shape)
    return j, j < last[:, None], jnp.mean(keys.astype(jnp.float32), axis=2).astype(dtype)


def compress_windows_reference(
    k: jax.Array, k1: jax.Array, k2: jax.Array, old_lengths: jax.Array, new_lengths: jax.Array, *, layer: int,
    kernel1: int, stride1: int, kernel2: int, stride2: int, max_tokens: int, unrotate=None,
) -> tuple[jax.Array, jax.Array]:
    """Appends to ``layer``'s k1 / k2 the windows completed by growing each row from ``old_lengths`` to
    ``new_lengths`` (``int32[B]``, at most ``max_tokens`` apart), averaging keys already in ``k``.

    unrotate: None, or ``f(keys [B, N, KVH, D], positions int32[B, N]) -> keys`` undoing RoPE (InfLLM-v2's
    ``use_nope`` compresses pre-RoPE keys). Returns the updated (k1, k2)."""
    rows = jnp.arange(k.shape[1])[:, None]
    out = []
    for comp, kernel, stride in ((k1, kernel1, stride1), (k2, kernel2, stride2)):
        j, done, means = completed_window_means(
            lambda pos: k[layer, rows[:, :, None], :, pos], old_lengths, new_lengths, kernel=kernel, stride=stride,
            capacity=k.shape[3], max_tokens=max_tokens, unrotate=unrotate, dtype=comp.dtype)
        slot = jnp.where(done, j, comp.shape[3])  # out of range -> dropped
        out.append(comp.at[layer, rows, :, slot].set(means, mode="drop"))
    return out[0], out[1]


def compress_step_reference(
    k: jax.Array, k1: jax.Array, k2: jax.Array, old_lengths: jax.Array, new_lengths: jax.Array, *, layer: int,
    kernel1: int, stride1: int, kernel2: int, stride2: int,
) -> tuple[jax.Array, jax.Array]:
    """The compressed-key update of one decode step in plain jnp: for each row that grew
    (``new_lengths[b] > old_lengths[b]``, by one token) and each cache, if the step completed window
    ``j = (new - kernel) / stride``, ``comp[layer, b, :, j] = mean(k[layer, b, :, new-kernel:new])``
    (fp32 mean, stored in the cache dtype). k ``[L, B, KVH, S, D]``, k1/k2 ``[L, B, KVH, N, D]``; returns
    the updated (k1, k2)."""
    b, s = k.shape[1], k.shape[3]
    rows = jnp.arange(b)
    out = []
    for comp, kernel, stride in ((k1, kernel1, stride1), (k2, kernel2, stride2)):
        start = new_lengths - kernel
        ok = (new_lengths > old_lengths) & (start >= 0) & (start % stride == 0)
        pos = jnp.clip(start[:, None] + jnp.arange(kernel, dtype=jnp.int32), 0, s - 1)
        keys = k[layer, rows[:, None], :, pos]  # [B, kernel, KVH, D]
        mean = jnp.mean(keys.astype(jnp.float32), axis=1).astype(comp.dtype)
        slot = jnp.where(ok, start // stride, comp.shape[3])
        out.append(comp.at[layer, rows, :, slot].set(mean, mode="drop"))
    return out[0], out[1]


def _compress_kernel(old_ref, new_ref, k_ref, k1_in, k2_in, k1_ref, k2_ref, *, kernel1, stride1, kernel2,
                     stride2):
    del k1_in, k2_in  # aliased to the outputs: entries not written keep their values
    row = pl.program_id(0)
    old, new = old_ref[row], new_ref[row]
    for ref, kernel, stride in ((k1_ref, kernel1, stride1), (k2_ref, kernel2, stride2)):
        start = new - kernel

        @pl.when((new > old) & (start >= 0) & (start % stride == 0))
        def _(ref=ref, kernel=kernel, stride=stride, start=start):
            keys = k_ref[pl.ds(start, kernel), :].astype(jnp.float32)
            mean = jnp.sum(keys, axis=0) * (1.0 / kernel)
            ref[pl.ds(start // stride, 1), :] = mean[None, :].astype(ref.dtype)


def compress_step(
    k: jax.Array, k1: jax.Array, k2: jax.Array, old_lengths: jax.Array, new_lengths: jax.Array, *, layer: int,
    kernel1: int, stride1: int, kernel2: int, stride2: int, interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The compressed-key update of one decode step (Pallas): one program per (row, KV head) reads the
    last window of keys and writes the new K1/K2 entries in place (k1/k2 are aliased to the outputs), so a
    decode step costs one launch instead of gathers, means and scatters. Signature of
    :func:`compress_step_reference`; window sizes must be powers of 2."""
    b, kvh, s, d = k.shape[1], k.shape[2], k.shape[3], k.shape[4]
    n1, n2 = k1.shape[3], k2.shape[3]
    lengths = pl.BlockSpec((b,), lambda i, j: (0,))
    kernel = functools.partial(_compress_kernel, kernel1=kernel1, stride1=stride1, kernel2=kernel2, stride2=stride2)
    return pl.pallas_call(
        kernel,
        grid=(b, kvh),
        in_specs=[
            lengths, lengths,
            pl.BlockSpec((None, None, None, s, d), lambda i, j: (layer, i, j, 0, 0)),
            pl.BlockSpec((None, None, None, n1, d), lambda i, j: (layer, i, j, 0, 0)),
            pl.BlockSpec((None, None, None, n2, d), lambda i, j: (layer, i, j, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, n1, d), lambda i, j: (layer, i, j, 0, 0)),
            pl.BlockSpec((None, None, None, n2, d), lambda i, j: (layer, i, j, 0, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(k1.shape, k1.dtype), jax.ShapeDtypeStruct(k2.shape, k2.dtype)],
        input_output_aliases={3: 0, 4: 1},
        name="minicpm_infllm_compress",
        **launch_options(SPARSE_CONFIG, interpret),
    )(old_lengths.astype(jnp.int32), new_lengths.astype(jnp.int32), k, k1, k2)


def _paged_compress_kernel(pages_ref, old_ref, new_ref, k_ref, k1_in, k2_in, k1_ref, k2_ref, *, page_size, kernel1,
                           stride1, kernel2, stride2):
    del k1_in, k2_in  # aliased to the outputs: entries not written keep their values
    row = pl.program_id(0)
    old, new = old_ref[row], new_ref[row]
    shift = page_size.bit_length() - 1  # shifts and masks: powers of 2 (Pallas-Triton rejects signed remainders)

    def slot(position):  # the pool slot of one of this row's keys
        page = jnp.minimum(lax.shift_right_logical(position, shift), pages_ref.shape[0] - 1)
        return plt.load(pages_ref.at[page]) * page_size + jnp.bitwise_and(position, page_size - 1)

    for ref, kernel, stride in ((k1_ref, kernel1, stride1), (k2_ref, kernel2, stride2)):
        start = new - kernel

        @pl.when((new > old) & (start >= 0) & (jnp.bitwise_and(start, stride - 1) == 0))
        def _(ref=ref, kernel=kernel, stride=stride, start=start):
            keys = gather_rows(k_ref, slot(start + lax.broadcasted_iota(jnp.int32, (kernel,), 0)))
            mean = jnp.sum(keys.astype(jnp.float32), axis=0) * (1.0 / kernel)
            # The entry lives in the page of the window's last key (pallas_kernels.infllm.paged).
            dst = lax.shift_right_logical(slot(new - 1), stride.bit_length() - 1)
            ref[pl.ds(dst, 1), :] = mean[None, :].astype(ref.dtype)


def paged_compress_step(
    k_pages: jax.Array, k1_pages: jax.Array, k2_pages: jax.Array, page_table: jax.Array, old_lengths: jax.Array,
    new_lengths: jax.Array, *, layer: int, page_size: int, kernel1: int, stride1: int, kernel2: int, stride2: int,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`compress_step` over a paged pool (k_pages ``[L, KVH, N, D]``, the compressed pools ``[L, KVH,
    R1 | R2, D]`` of :mod:`pallas_kernels.infllm.paged`, page_table ``int32[B, P]``): one program per (row,
    KV head) gathers the completed window's keys through the page table and writes its entry in place.
    Its reference is :func:`pallas_kernels.infllm.paged.paged_compress_windows_reference` with
    ``max_tokens=1``; windows, strides and the page size must be powers of 2."""
    b, kvh, n, d = page_table.shape[0], k_pages.shape[1], k_pages.shape[2], k_pages.shape[3]
    r1, r2 = k1_pages.shape[2], k2_pages.shape[2]
    lengths = pl.BlockSpec((b,), lambda i, j: (0,))
    kernel = functools.partial(_paged_compress_kernel, page_size=page_size, kernel1=kernel1, stride1=stride1,
                               kernel2=kernel2, stride2=stride2)
    pool = lambda rows: pl.BlockSpec((None, None, rows, d), lambda i, j: (layer, j, 0, 0))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(b, kvh),
        in_specs=[pl.BlockSpec((None, page_table.shape[1]), lambda i, j: (i, 0)), lengths, lengths, pool(n),
                  pool(r1), pool(r2)],
        out_specs=[pool(r1), pool(r2)],
        out_shape=[jax.ShapeDtypeStruct(k1_pages.shape, k1_pages.dtype),
                   jax.ShapeDtypeStruct(k2_pages.shape, k2_pages.dtype)],
        input_output_aliases={4: 0, 5: 1},
        name="minicpm_infllm_paged_compress",
        **launch_options(SPARSE_CONFIG, interpret),
    )(page_table.astype(jnp.int32), old_lengths.astype(jnp.int32), new_lengths.astype(jnp.int32), k_pages, k1_pages,
      k2_pages)
