"""The ``collectives`` scenario: the all-reduce the tensor-parallel model runs, alone — its latency at the
decode step's message sizes and its bus bandwidth at large ones (NCCL's definition: ``2 (n - 1) / n ×
bytes / time``), through ``jax.lax.psum`` under ``shard_map`` on the same mesh the engine builds.

It is the ceiling the e2e rows' profiled collective time per layer is read against."""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.timing import device_loop_time
from minicpm_jax.model.parallel import AXIS, make_mesh

# Message sizes in bytes: one decode row's fp32 hidden state (MiniCPM4-8B: 4096 × 4), 16 rows, a
# 1024-token prefill chunk, then sizes where the links, not the latency, bound the time.
DEFAULT_SIZES = (16 << 10, 256 << 10, 16 << 20, 256 << 20, 1 << 30)
CHAIN = 16


def bench_allreduce(size: int, nbytes: list[int], repeats: int) -> list[dict]:
    """Per message size: µs per all-reduce over ``size`` devices (fp32, each iteration feeding the next)
    and the bus bandwidth it implies."""
    mesh = make_mesh(size)
    rows = []
    for n in nbytes:
        elems = max(n // 4, 1)
        x = jax.device_put(jnp.ones((size * elems,), jnp.float32), NamedSharding(mesh, P(AXIS)))
        def chained(v):  # CHAIN dependent all-reduces per loop iteration: the loop's own overhead (a host
            for _ in range(CHAIN):  # round trip per iteration where the loop is not one CUDA graph) is shared
                v = jax.lax.psum(v, AXIS) * (1.0 / size)
            return v

        allreduce = jax.shard_map(chained, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False)
        iters = 20 if n < (16 << 20) else 2
        times = [s / CHAIN for s in device_loop_time(allreduce, (x,), iters=iters, repeats=repeats, chain=0)]
        t = statistics.median(times)
        rows.append({"bytes": elems * 4, "us": [1e6 * s for s in times],
                     "bus_GBps": 2 * (size - 1) / size * elems * 4 / t / 1e9})
    return rows


def collectives_markdown(size: int, rows: list[dict], device: str) -> str:
    lines = [f"all-reduce over {size} × {device} (psum in shard_map, fp32):", "",
             "| bytes | µs (runs) | bus bandwidth GB/s |", "|---|---|---|"]
    for r in rows:
        runs = ", ".join(f"{u:.1f}" for u in r["us"])
        lines.append(f"| {r['bytes']:,} | {statistics.median(r['us']):.1f} ({runs}) | {r['bus_GBps']:.1f} |")
    return "\n".join(lines)
