"""InfLLM-v2's settings and policy: which settings a model runs with, when attention is dense or sparse,
and how deep a speculative tree can be verified exactly.

Semantics follow the Hugging Face MiniCPM4 modeling code (``reference/infllm_v2_and_eagle.md`` §A); see
``docs/infllm_v2.md`` for the formulas and the documented deviations.
"""

from __future__ import annotations

import dataclasses

from minicpm_jax.config import ModelConfig, SparseConfig
from minicpm_jax.errors import MiniCPMError
from pallas_kernels.infllm.common import Geometry

SPARSE_CHOICES = ("auto", "on", "off")


def resolve_sparse(
    config: ModelConfig, mode: str | SparseConfig | None = "auto", *, topk: int | None = None,
    window_size: int | None = None, dense_len: int | None = None,
) -> SparseConfig | None:
    """The InfLLM-v2 settings a model runs with, or None for dense attention.

    mode: ``auto`` = the checkpoint's ``sparse_config`` if it has one, ``on`` = that or MiniCPM4's
    defaults (kernel 32/16, block 64, window 2048, topk 64, dense_len 8192), ``off`` (or None) = dense; a
    :class:`SparseConfig` is used as given. ``topk``, ``window_size`` and ``dense_len`` (-1 or 0: always
    sparse) override fields.
    """
    if isinstance(mode, SparseConfig):
        sparse = mode
    elif mode in (None, "off"):
        return None
    elif mode == "auto":
        sparse = config.sparse
    elif mode == "on":
        sparse = config.sparse or SparseConfig()
    else:
        raise MiniCPMError(f"sparse must be one of {', '.join(SPARSE_CHOICES)}, got {mode!r}")
    if sparse is None:
        return None
    overrides = {k: v for k, v in (("topk", topk), ("window_size", window_size), ("dense_len", dense_len))
                 if v is not None}
    lowest = {"topk": 1, "window_size": 0, "dense_len": -1}  # dense_len <= 0: always sparse
    for name, val in overrides.items():
        if val < lowest[name]:
            raise MiniCPMError(f"sparse {name} must be >= {lowest[name]}, got {val}")
    return dataclasses.replace(sparse, **overrides).check()


def geometry(sparse: SparseConfig) -> Geometry:
    """The block geometry the kernels take (``pallas_kernels.infllm.common.Geometry``)."""
    return Geometry(kernel1=sparse.kernel_size, stride1=sparse.kernel_stride, kernel2=sparse.kernel_size2,
                    stride2=sparse.kernel_stride2, block_size=sparse.block_size, init_blocks=sparse.init_blocks,
                    local_blocks=sparse.local_blocks, topk=sparse.topk)


def attention_mode(dense_len: int, lo: int, hi: int) -> str:
    """The static attention mode for a step whose relevant rows reach between ``lo`` and ``hi`` tokens
    (cache plus the step's tokens): ``dense`` if all stay below ``dense_len``, ``sparse`` if all reach it,
    else ``mixed``. Engines decide on the host, so the compiled step holds no conditional (on a GPU a
    conditional is a host round trip, and one that returns the cache copies it)."""
    if lo >= dense_len:
        return "sparse"
    return "dense" if hi < dense_len else "mixed"


def tree_depth_limit(sparse: SparseConfig) -> int:
    """The deepest speculative tree :func:`~minicpm_jax.infllm.attention.tree_sparse_attention` verifies
    exactly: paths shorter than the coarse stride (at most one coarse window closes inside a path), whose
    fine windows only reach blocks inside the forced local window (``local_blocks >= ceil((depth + block -
    stride + kernel) / block)``)."""
    lag = sparse.block_size - sparse.kernel_stride + sparse.kernel_size
    by_window = sparse.local_blocks * sparse.block_size - lag
    return max(-1, min(sparse.kernel_stride2 - 1, by_window))
