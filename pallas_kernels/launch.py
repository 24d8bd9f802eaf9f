"""How a Pallas kernel is launched: interpret mode on CPU, Triton compiler parameters on NVIDIA GPUs.

Every ``pallas_call`` of this package takes its options from :func:`launch_options`. Block sizes, warps
and pipeline stages of the attention kernels come from :data:`TUNED`, a table measured on an H100 with
``python -m benchmarks.tune``; shapes not in the table use the nearest measured head_dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.experimental.pallas import triton as plt


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one kernel.

    block_q: query rows per program (prefill) or rows of the padded query-head group (decode, upper bound).
    block_k: keys per inner-loop step.
    num_warps, num_stages: Triton launch settings (warps per program, software-pipeline depth).
    """

    block_q: int
    block_k: int
    num_warps: int
    num_stages: int


# Measured on an NVIDIA H100 80GB HBM3, jax 0.11.2, 2026-11-22: `python -m benchmarks.tune` (bf16,
# batch 1, 2 KV heads; head_dim 128 with 32 q heads = MiniCPM4-8B, head_dim 64 with 16 q heads =
# MiniCPM4-0.5B; prefill = 8K causal prompt, decode = 1 token against 32K keys). Sweep in BENCHMARKS.md;
# for decode most configs with block_k <= 64 are within 0.5 us of the best, and a configs x split-count
# grid at 32K (`--grid_contexts`) put all 18 configs within 6% of each other.
TUNED: dict[tuple[str, int], KernelConfig] = {
    ("prefill", 64): KernelConfig(block_q=128, block_k=128, num_warps=4, num_stages=3),  # 443 us, 308 TFLOP/s
    ("prefill", 128): KernelConfig(block_q=128, block_k=64, num_warps=4, num_stages=2),  # 1415 us, 388 TFLOP/s
    ("decode", 64): KernelConfig(block_q=64, block_k=64, num_warps=4, num_stages=3),  # 16.1 us
    # 4 warps, not the sweep's 2 (18.8 us at 32K, H100): on an H200 (2026-12-01) equal at 32K (15.7 us a layer) and
    # 128K (41.4 against 41.8), 3% faster at 1K, and the tree kernel (12 nodes) 1.6x faster: 78.4 -> 48.9 us at 32K.
    ("decode", 128): KernelConfig(block_q=64, block_k=32, num_warps=4, num_stages=3),
}


def tuned_config(kernel: str, head_dim: int) -> KernelConfig:
    """The measured launch config of ``kernel`` ("prefill" or "decode") for ``head_dim``."""
    dims = sorted(d for k, d in TUNED if k == kernel)
    nearest = min(dims, key=lambda d: (abs(d - head_dim), d))
    return TUNED[(kernel, nearest)]


def default_interpret() -> bool:
    """Kernels run in interpret mode unless the default backend is a GPU."""
    return jax.default_backend() != "gpu"


def interpreted(interpret: bool | None) -> bool:
    """Whether a kernel given ``interpret`` (None: :func:`default_interpret`) runs in interpret mode."""
    return default_interpret() if interpret is None else bool(interpret)


def launch_options(config: KernelConfig, interpret: bool | None) -> dict:
    """Keyword arguments for ``pl.pallas_call``: interpret mode on CPU, Triton compiler params on GPU."""
    if interpreted(interpret):
        return {"interpret": True}
    return {"compiler_params": plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)}


@functools.cache
def num_cores() -> int:
    """Streaming multiprocessors of the default GPU (132 on an H100 SXM); 132 where it cannot be read."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


@functools.cache
def compute_capability() -> tuple[int, int]:
    """(major, minor) of the default GPU (9.0 on an H100); (9, 0) where it cannot be read."""
    major, _, minor = str(getattr(jax.devices()[0], "compute_capability", "9.0")).partition(".")
    return int(major), int(minor or 0)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
