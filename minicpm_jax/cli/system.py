"""Process-wide settings the command-line programs apply before JAX starts: XLA command buffers on GPUs and
the persistent compilation cache."""

from __future__ import annotations

import os
import signal
import sys

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


# --tp_all_reduce nccl. A split model's decode step is bound by the host: XLA records it as one CUDA graph
# per stretch between all-reduces (65 a step for MiniCPM4-8B) and launches each, with the all-reduces
# between them, from the host; XLA's own one-shot all-reduce kernel (its default for small messages) costs
# ~14 us of host time a call, NCCL's ~7. MiniCPM4-8B bf16, batch 1, 1K, TP 2, --decode_block 1 on 2x H200:
# 3.64 ms/token with NCCL against 3.83. Not the default: an int4 model measured slower with both settings
# (docs/parallel.md).
NCCL_ALL_REDUCE_FLAG = "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false"


def use_nccl_all_reduce() -> bool:
    """Adds :data:`NCCL_ALL_REDUCE_FLAG` to ``XLA_FLAGS`` unless they already choose the all-reduce kernel;
    returns whether it did. For tensor parallelism; before the first JAX computation."""
    current = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_unsupported_use_all_reduce_one_shot_kernel" in current:
        return False
    os.environ["XLA_FLAGS"] = f"{current} {NCCL_ALL_REDUCE_FLAG}".strip()
    return True


def start_distributed(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Joins a multi-process run (several hosts, or several processes on one) through
    ``jax.distributed.initialize`` when a coordinator is named (here or in ``$JAX_COORDINATOR_ADDRESS``) or
    a process count above 1 is given; unset values are detected by JAX (SLURM, Open MPI, ...). Must run
    before the first JAX computation. Returns whether it joined one."""
    coordinator = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if coordinator is None and (num_processes or 1) <= 1:
        return False
    import jax

    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    return True


def enable_compilation_cache() -> None:
    """Persistent XLA compilation cache, so a second run starts faster: in ``$JAX_COMPILATION_CACHE_DIR``
    when set (JAX's own variable; processes started together can share one, as the test suite's do), else
    in ``$MINICPM_JAX_CACHE/jax_cache``."""
    import jax

    from minicpm_jax.cli.demo import cache_dir

    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(cache_dir(), "jax_cache")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def _exit_now(signum, frame) -> None:
    sys.stderr.write("\ninterrupted\n")
    sys.stderr.flush()
    os._exit(130)


def exit_on_interrupt() -> None:
    """Ctrl-C ends the process at once (exit 130): for the loading phase, where a KeyboardInterrupt raised
    inside a garbage-collection callback of XLA's would be printed as "Exception ignored" and swallowed.
    Loading writes nothing that an exit could leave half-done (conversions are atomic)."""
    signal.signal(signal.SIGINT, _exit_now)


def raise_on_interrupt() -> None:
    """Ctrl-C raises KeyboardInterrupt again (Python's default), for phases that handle it."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


class ReplyInterrupted(Exception):
    """Raised by :class:`InterruptFlag.check` at a point of our choosing (between prefill chunks)."""


class InterruptFlag:
    """Ctrl-C sets a flag instead of raising, for the duration of a ``with`` block.

    A KeyboardInterrupt raised from the signal handler lands wherever Python happens to be: inside one of
    XLA's garbage-collection callbacks it is printed as "Exception ignored" and lost, and the reply runs
    to its end. The generation loop instead polls :meth:`is_set` between decode blocks (the engine then
    stops the row cleanly) and calls :meth:`check` between prefill chunks."""

    def __init__(self):
        self._set = False
        self._previous = None

    def _handler(self, signum, frame) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def check(self) -> None:
        """Raises :class:`ReplyInterrupted` once Ctrl-C was pressed."""
        if self._set:
            raise ReplyInterrupted

    def __enter__(self) -> "InterruptFlag":
        self._set = False
        self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)
