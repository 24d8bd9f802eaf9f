"""Sizing the static KV cache from memory: ``--max_length auto`` (the largest cache that fits a fraction of
the accelerator, as CPM.cu's ``--memory_limit`` and vLLM's ``gpu_memory_utilization`` do) and a one-line
error, before anything is allocated, for a cache that cannot fit.

Budget = the allocator's limit (a GPU's ``bytes_limit``: JAX preallocates ``XLA_PYTHON_CLIENT_MEM_FRACTION``
of the card, which the command-line programs set to ``--memory_limit``; on a CPU the free RAM times the
limit, where free is the kernel's MemAvailable) minus what is already in use, the weights and a workspace for one prefill chunk's activations and
logits. The cache gets the rest, in whole 64-token blocks, up to the positions the model supports.

A paged cache (the server's) reserves nothing per sequence: its pool gets every page that fits what is
left once the weights are loaded (:func:`pool_pages`), and ``max_length`` only bounds one sequence.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model.cache import KVCache
from minicpm_jax.model.paged_cache import PagedKVCache
from minicpm_jax.model.parallel import TensorParallel

CPU_AUTO_LENGTH = 2048  # --max_length auto on a CPU: the interactive default, not a memory question
# Of what is free once the weights are loaded, the share a paged pool leaves to XLA besides the estimated
# workspace: its GEMM autotuner asks for ~1.2 GiB scratch buffers at the 8B shape, and a pool that took all
# but the estimate left it without ("Allocator ran out of memory trying to allocate 1.17GiB", H100,
# 2026-11-26): the programs then compile with whatever algorithm needs no scratch.
XLA_HEADROOM = 0.06
BLOCK = 64  # auto lengths are whole InfLLM-v2 blocks (and tile the attention kernels' key blocks)
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What a cache of ``max_length`` tokens × ``batch_size`` rows costs against the ``budget`` (bytes)."""

    max_length: int
    batch_size: int
    budget: int
    weights: int
    workspace: int
    cache: int

    @property
    def fits(self) -> bool:
        return self.weights + self.workspace + self.cache <= self.budget

    def describe(self) -> str:
        return (f"weights {self.weights / GiB:.2f} GiB + KV cache {self.cache / GiB:.2f} GiB "
                f"({self.max_length} tokens × {self.batch_size} rows) + workspace {self.workspace / GiB:.2f} GiB "
                f"of {self.budget / GiB:.2f} GiB")


def device_budget(memory_limit: float, device: jax.Device | None = None) -> int:
    """Bytes the engine may still take on ``device`` (default: the first local device)."""
    if not 0 < memory_limit <= 1:
        raise MiniCPMError(f"--memory_limit must be in (0, 1], got {memory_limit}")
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return int(host_available_bytes() * memory_limit)


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """Bytes a new allocation can get on this host: the kernel's ``MemAvailable`` (free pages plus the page
    cache it would reclaim). ``SC_AVPHYS_PAGES`` is only MemFree, which a long run's file reads shrink to
    little (a CI machine read 1.3 GiB free of 24), so it is the fallback where ``meminfo`` cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def workspace_bytes(config: ModelConfig, batch_size: int, chunk_length: int, dtype) -> int:
    """Room for a prefill chunk of every row (``[B, chunk]`` tokens: q/k/v, attention output, gate/up and
    the MLP product in ``dtype``, twice over for XLA's temporaries), fp32 last-token logits and sampling,
    and XLA's scratch: an upper estimate."""
    activations = 2 * batch_size * chunk_length * (4 * config.hidden_size + 3 * config.intermediate_size)
    logits = 2 * batch_size * config.vocab_size * 4
    return activations * jnp.dtype(dtype).itemsize + logits + GiB // 2


def plan(config: ModelConfig, *, max_length: int, batch_size: int, dtype, sparse: SparseConfig | None,
         weights: int, budget: int, chunk_length: int, tensor_parallel: int = 1) -> MemoryPlan:
    """The :class:`MemoryPlan` of a cache of ``max_length`` tokens (``sparse``: with compressed keys) on each
    device; ``weights`` and ``budget`` are per device, and a model split over ``tensor_parallel`` devices
    holds its share of the cache (KV heads copied where there are more devices than KV heads)."""
    tp = TensorParallel.of(config, tensor_parallel)
    cache = KVCache.nbytes(config, batch_size, max_length, dtype, sparse, kv_heads=tp.stored_kv_heads) // tp.size
    return MemoryPlan(max_length, batch_size, budget, weights,
                      workspace_bytes(config, batch_size, min(chunk_length, max_length), dtype), cache)


def auto_max_length(config: ModelConfig, *, batch_size: int, dtype, sparse: SparseConfig | None, weights: int,
                    budget: int, chunk_length: int, tensor_parallel: int = 1) -> int:
    """The largest cache length (whole 64-token blocks, at most ``config.context_limit``) whose plan
    fits ``budget``; MiniCPMError when not even one block fits."""
    def fits(n: int) -> bool:
        return plan(config, max_length=n, batch_size=batch_size, dtype=dtype, sparse=sparse, weights=weights,
                    budget=budget, chunk_length=chunk_length, tensor_parallel=tensor_parallel).fits

    if fits(config.context_limit):
        return config.context_limit
    lo, hi = 0, config.context_limit // BLOCK  # the cache's bytes grow with the length: bisect on blocks
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * BLOCK) else (lo, mid - 1)
    if lo == 0:
        need = plan(config, max_length=BLOCK, batch_size=batch_size, dtype=dtype, sparse=sparse, weights=weights,
                    budget=budget, chunk_length=chunk_length, tensor_parallel=tensor_parallel)
        raise MiniCPMError(f"the model does not fit: {need.describe()}; raise --memory_limit, use --quant int4 or "
                           "a smaller batch")
    return lo * BLOCK


def check_fits(config: ModelConfig, *, max_length: int, batch_size: int, dtype, sparse: SparseConfig | None,
               weights: int, budget: int, chunk_length: int, tensor_parallel: int = 1) -> None:
    """MiniCPMError naming the sizes (and the largest length that fits) unless the plan fits ``budget``."""
    p = plan(config, max_length=max_length, batch_size=batch_size, dtype=dtype, sparse=sparse, weights=weights,
             budget=budget, chunk_length=chunk_length, tensor_parallel=tensor_parallel)
    if p.fits:
        return
    try:
        best = auto_max_length(config, batch_size=batch_size, dtype=dtype, sparse=sparse, weights=weights,
                               budget=budget, chunk_length=chunk_length, tensor_parallel=tensor_parallel)
        hint = f"lower --max_length (at most {best} fits; --max_length auto picks it)"
    except MiniCPMError:
        hint = "the weights alone do not fit"
    raise MiniCPMError(f"max_length {max_length} does not fit in memory: {p.describe()}; {hint}")


def pool_pages(config: ModelConfig, *, budget: int, dtype, page_size: int, batch_size: int, prefill_tokens: int,
               tensor_parallel: int = 1, sparse: SparseConfig | None = None) -> int:
    """Pages of a paged KV pool that fit ``budget`` (bytes still free on each device, the weights already
    loaded): what is left after a workspace for a prefill step of ``prefill_tokens`` tokens and a decode
    step of ``batch_size`` rows, :data:`XLA_HEADROOM` of the budget (at least 1 GiB) for XLA's own scratch,
    and the rows' speculative-tree scratch regions. A page of a sparse model (``sparse``: InfLLM-v2's
    settings) also holds its compressed keys. MiniCPMError when not even 16 pages fit."""
    tp = TensorParallel.of(config, tensor_parallel)
    page = PagedKVCache.page_nbytes(config, page_size, dtype, kv_heads=tp.stored_kv_heads, sparse=sparse) // tp.size
    scratch = PagedKVCache.nbytes(config, 0, page_size, batch_size, dtype, kv_heads=tp.stored_kv_heads) // tp.size
    workspace = workspace_bytes(config, 1, prefill_tokens, dtype) + 2 * batch_size * config.vocab_size * 4
    workspace += max(GiB, int(XLA_HEADROOM * budget))
    pages = (budget - workspace - scratch) // page
    if pages < 16:
        raise MiniCPMError(f"no room for the KV pool: {budget / GiB:.2f} GiB free after the weights, a workspace of "
                           f"{workspace / GiB:.2f} GiB and pages of {page / (1 << 20):.1f} MiB; raise --memory_limit, "
                           "use --quant int4 or lower --max_batch_size")
    return int(pages)
