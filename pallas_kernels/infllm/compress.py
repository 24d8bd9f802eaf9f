"""InfLLM-v2's compressed keys: ``K1[j] = mean(K[s*j : s*j + k])`` over complete windows (and ``K2`` the
same with the coarse window), appended as a sequence grows; a jnp reference for any number of new
tokens, and a Pallas kernel for a few new tokens (a decode step, a
speculative round's accepted path; one layer or all of them in one launch), for the contiguous cache and
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
    k: jax.Array, k1: jax.Array, k2: jax.Array, old_lengths: jax.Array, new_lengths: jax.Array, *, layer: int | None,
    kernel1: int, stride1: int, kernel2: int, stride2: int, max_tokens: int, unrotate=None,
) -> tuple[jax.Array, jax.Array]:
    """Appends to ``layer``'s k1 / k2 (None: every layer's) the windows completed by growing each row from
    ``old_lengths`` to ``new_lengths`` (``int32[B]``, at most ``max_tokens`` apart), averaging keys already
    in ``k``.

    unrotate: None, or ``f(keys [B, N, KVH, D], positions int32[B, N]) -> keys`` undoing RoPE (InfLLM-v2's
    ``use_nope`` compresses pre-RoPE keys). Returns the updated (k1, k2)."""
    if layer is None:
        for each in range(k.shape[0]):
            k1, k2 = compress_windows_reference(k, k1, k2, old_lengths, new_lengths, layer=each, kernel1=kernel1,
                                                stride1=stride1, kernel2=kernel2, stride2=stride2,
                                                max_tokens=max_tokens, unrotate=unrotate)
        return k1, k2
    rows = jnp.arange(k.shape[1])[:, None]
    out = []
    for comp, kernel, stride in ((k1, kernel1, stride1), (k2, kernel2, stride2)):
        j, done, means = completed_window_means(
            lambda pos: k[layer, rows[:, :, None], :, pos], old_lengths, new_lengths, kernel=kernel, stride=stride,
            capacity=k.shape[3], max_tokens=max_tokens, unrotate=unrotate, dtype=comp.dtype)
        slot = jnp.where(done, j, comp.shape[3])  # out of range -> dropped
        out.append(comp.at[layer, rows, :, slot].set(means, mode="drop"))
    return out[0], out[1]


# The most windows of one size a program of :func:`compress_new_windows` computes for a row (a static loop):
# a speculative round's path is a few tokens, a window stride 16 (MiniCPM4's fine windows).
NEW_WINDOWS_MAX = 4


def _window_count(length, kernel: int, stride: int):
    """:func:`~pallas_kernels.infllm.common.compressed_count` in a kernel: a shift for the power-of-2 stride
    (Pallas-Triton rejects signed division and remainders)."""
    full = lax.shift_right_logical(jnp.maximum(length - kernel, 0), stride.bit_length() - 1) + 1
    return jnp.where(length >= kernel, full, 0)


def _each_new_window(old, new, kernel: int, stride: int, max_tokens: int, write) -> None:
    """Calls ``write(j)`` for each window ``j`` completed by growing a row from ``old`` to ``new`` keys (at
    most ``max_tokens`` apart, so at most ``ceil(max_tokens / stride)`` windows: a static loop of guarded
    bodies)."""
    first, last = _window_count(old, kernel, stride), _window_count(new, kernel, stride)
    for i in range(-(-max_tokens // stride)):
        pl.when(first + i < last)(functools.partial(write, first + i))


def _layer_grid(layer: int | None, num_layers: int) -> tuple[int, int]:
    """(grid size, first layer) of an update of ``layer`` (None: every layer, one program row each)."""
    return (num_layers, 0) if layer is None else (1, layer)


def _compress_kernel(old_ref, new_ref, k_ref, k1_in, k2_in, k1_ref, k2_ref, *, levels, max_tokens):
    del k1_in, k2_in  # aliased to the outputs: entries not written keep their values
    row = pl.program_id(1)
    old, new = old_ref[row], new_ref[row]
    for ref, (kernel, stride) in zip((k1_ref, k2_ref), levels):
        def write(j, ref=ref, kernel=kernel, stride=stride):
            keys = k_ref[pl.ds(j * stride, kernel), :].astype(jnp.float32)
            ref[pl.ds(j, 1), :] = (jnp.sum(keys, axis=0) * (1.0 / kernel))[None, :].astype(ref.dtype)

        _each_new_window(old, new, kernel, stride, max_tokens, write)


def compress_new_windows(
    k: jax.Array, k1: jax.Array, k2: jax.Array, old_lengths: jax.Array, new_lengths: jax.Array, *, layer: int | None,
    kernel1: int, stride1: int, kernel2: int, stride2: int, max_tokens: int, interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The compressed keys of the windows completed from ``old_lengths`` to ``new_lengths`` (Pallas; a decode
    step, or a speculative round's accepted path): one program per (layer, row, KV head) reads each new
    window's keys and writes its entry in place (k1/k2 are aliased to the outputs), one launch instead of
    gathers, means and scatters per layer and window size. ``layer`` None updates every layer of the stacked
    cache in that one launch. Signature of :func:`compress_windows_reference` (without ``unrotate``);
    strides must be powers of 2, and each row completes at most ``ceil(max_tokens / stride)`` windows (a
    static loop per program: meant for a few tokens, not for prompt chunks)."""
    num_layers, b, kvh, s, d = k.shape
    n1, n2 = k1.shape[3], k2.shape[3]
    grid_l, base = _layer_grid(layer, num_layers)
    lengths = pl.BlockSpec((b,), lambda l_, i, j: (0,))
    per_head = lambda n: pl.BlockSpec((None, None, None, n, d), lambda l_, i, j: (base + l_, i, j, 0, 0))  # noqa: E731
    kernel = functools.partial(_compress_kernel, levels=((kernel1, stride1), (kernel2, stride2)), max_tokens=max_tokens)
    return pl.pallas_call(
        kernel,
        grid=(grid_l, b, kvh),
        in_specs=[lengths, lengths, per_head(s), per_head(n1), per_head(n2)],
        out_specs=[per_head(n1), per_head(n2)],
        out_shape=[jax.ShapeDtypeStruct(k1.shape, k1.dtype), jax.ShapeDtypeStruct(k2.shape, k2.dtype)],
        input_output_aliases={3: 0, 4: 1},
        name="minicpm_infllm_compress",
        **launch_options(SPARSE_CONFIG, interpret),
    )(old_lengths.astype(jnp.int32), new_lengths.astype(jnp.int32), k, k1, k2)


def _paged_compress_kernel(pages_ref, old_ref, new_ref, k_ref, k1_in, k2_in, k1_ref, k2_ref, *, page_size, levels,
                           max_tokens):
    del k1_in, k2_in  # aliased to the outputs: entries not written keep their values
    row = pl.program_id(1)
    old, new = old_ref[row], new_ref[row]
    shift = page_size.bit_length() - 1  # shifts and masks: powers of 2 (Pallas-Triton rejects signed remainders)

    def slot(position):  # the pool slot of one of this row's keys
        page = jnp.minimum(lax.shift_right_logical(position, shift), pages_ref.shape[0] - 1)
        return plt.load(pages_ref.at[page]) * page_size + jnp.bitwise_and(position, page_size - 1)

    for ref, (kernel, stride) in zip((k1_ref, k2_ref), levels):
        def write(j, ref=ref, kernel=kernel, stride=stride):
            start = j * stride
            keys = gather_rows(k_ref, slot(start + lax.broadcasted_iota(jnp.int32, (kernel,), 0)))
            mean = jnp.sum(keys.astype(jnp.float32), axis=0) * (1.0 / kernel)
            # The entry lives in the page of the window's last key (pallas_kernels.infllm.paged).
            dst = lax.shift_right_logical(slot(start + kernel - 1), stride.bit_length() - 1)
            ref[pl.ds(dst, 1), :] = mean[None, :].astype(ref.dtype)

        _each_new_window(old, new, kernel, stride, max_tokens, write)


def paged_compress_new_windows(
    k_pages: jax.Array, k1_pages: jax.Array, k2_pages: jax.Array, page_table: jax.Array, old_lengths: jax.Array,
    new_lengths: jax.Array, *, layer: int | None, page_size: int, kernel1: int, stride1: int, kernel2: int,
    stride2: int, max_tokens: int, interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`compress_new_windows` over a paged pool (k_pages ``[L, KVH, N, D]``, the compressed pools ``[L,
    KVH, R1 | R2, D]`` of :mod:`pallas_kernels.infllm.paged`, page_table ``int32[B, P]``): one program per
    (layer, row, KV head) gathers each new window's keys through the page table and writes its entry in
    place. Its reference is :func:`pallas_kernels.infllm.paged.paged_compress_windows_reference`; windows,
    strides and the page size must be powers of 2."""
    num_layers, kvh, n, d = k_pages.shape
    b, r1, r2 = page_table.shape[0], k1_pages.shape[2], k2_pages.shape[2]
    grid_l, base = _layer_grid(layer, num_layers)
    lengths = pl.BlockSpec((b,), lambda l_, i, j: (0,))
    kernel = functools.partial(_paged_compress_kernel, page_size=page_size,
                               levels=((kernel1, stride1), (kernel2, stride2)), max_tokens=max_tokens)
    pool = lambda rows: pl.BlockSpec((None, None, rows, d), lambda l_, i, j: (base + l_, j, 0, 0))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(grid_l, b, kvh),
        in_specs=[pl.BlockSpec((None, page_table.shape[1]), lambda l_, i, j: (i, 0)), lengths, lengths, pool(n),
                  pool(r1), pool(r2)],
        out_specs=[pool(r1), pool(r2)],
        out_shape=[jax.ShapeDtypeStruct(k1_pages.shape, k1_pages.dtype),
                   jax.ShapeDtypeStruct(k2_pages.shape, k2_pages.dtype)],
        input_output_aliases={4: 0, 5: 1},
        name="minicpm_infllm_paged_compress",
        **launch_options(SPARSE_CONFIG, interpret),
    )(page_table.astype(jnp.int32), old_lengths.astype(jnp.int32), new_lengths.astype(jnp.int32), k_pages, k1_pages,
      k2_pages)
