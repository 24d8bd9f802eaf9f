"""Process-wide XLA settings for GPU runs, applied by the command-line programs before JAX starts."""

from __future__ import annotations

import os

# Kernels XLA may record into CUDA graphs. WHILE and CONDITIONAL put the decode loop's body (and a
# speculative round) into one graph instead of launching each of its hundreds of small kernels from the
# host: MiniCPM4-8B bf16 on an H100 decoded 2% faster, speculative rounds 10% faster (BENCHMARKS.md).
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"


def enable_command_buffers() -> bool:
    """Adds :data:`COMMAND_BUFFER_FLAG` to ``XLA_FLAGS`` unless it already sets command buffers; returns
    whether it did. Must run before the first JAX computation (the backend reads the flags once)."""
    current = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" in current:
        return False
    os.environ["XLA_FLAGS"] = f"{current} {COMMAND_BUFFER_FLAG}".strip()
    return True
