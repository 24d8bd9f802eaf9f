"""The ``int4`` scenario of ``python -m benchmarks``: the W4A16 dequant-GEMM on a model's linear
shapes, against bf16 ``jnp.dot`` (cuBLAS) and the copy-bandwidth ceiling measured in the same run, and
with ``--peer torch`` against PyTorch's tinygemm int4 kernel on the same shapes (``benchmarks.torch_peer
--linears_ms``, run before JAX takes the GPU).

Each timed call multiplies by several copies of the weight (more bytes than the 50 MB L2), so weights
come from HBM as they do in a decode step. Bandwidth counts int4 codes + scales (+ zeros) + x + y.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys

import jax
import jax.numpy as jnp

from benchmarks.shapes import linear_shapes
from benchmarks.timing import device_loop_time
from minicpm_jax.config import ModelConfig
from pallas_kernels.int4_matmul import (Int4Config, choose_config, default_kernel, dequantize, int4_matmul,
                                       int4_matmul_reference)

L2_BYTES = 50 * 1024**2
MIN_COPIES = 4  # weight copies per timed iteration, at least
ITER_BYTES = 2e10  # int4 weight bytes read per timed run (sets the iteration count)


def _random_int4(key, k: int, n: int, group_size: int, copies: int):
    """``copies`` random symmetric int4 weights: lists of qweight and of scales, each copy its own buffer (a
    slice of a stacked array would be copied before a custom call reads it)."""
    shape = (k // 8, n)
    qws, scs = [], []
    for key_c in jax.random.split(key, copies):
        k1, k2 = jax.random.split(key_c)
        qws.append(jax.random.bits(k1, shape, jnp.uint32).view(jnp.int32))
        scs.append((jax.random.uniform(k2, (k // group_size, n), jnp.float32, 0.5, 1.5) * 1e-2).astype(jnp.bfloat16))
    return qws, scs


def bench_linear(k: int, n: int, m: int, group_size: int, repeats: int,
                 configs: dict[str, Int4Config | None] | None = None, kernels: tuple[str, ...] = ("auto",)) -> dict:
    """Seconds per ``[m, k] @ [k, n]`` call for bf16 ``jnp.dot`` and the int4 kernel.

    kernels: "auto" (the kernel ``int4_matmul`` picks, column ``int4_kpacked``) and/or named kernels of
    ``pallas_kernels.int4_matmul.KERNELS`` (columns ``int4_kpacked_<kernel>``); configs: launch configs to
    time each with (column suffix: the dict key)."""
    int4_bytes = k * n // 2 + (k // group_size) * n * 2
    smoke = jax.default_backend() == "cpu"  # interpret-mode kernels: a few calls prove the harness runs
    # At least 4 weight copies per timed iteration: with 2, the loop's own cost per iteration (10-20 us on
    # an H100) showed in the per-call times of the largest linears (BENCHMARKS.md, 2026-11-23 second session).
    copies = 2 if smoke else max(MIN_COPIES, min(32, -(-2 * L2_BYTES // int4_bytes)))
    key = jax.random.PRNGKey(k * 7 + n)
    x = jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
    out: dict = {"k": k, "n": n, "m": m, "group_size": group_size, "int4_bytes": int4_bytes,
                 "bf16_bytes": k * n * 2, "io_bytes": (m * k + m * n) * 2, "seconds": {}}
    bf16_copies = 2 if smoke else max(MIN_COPIES, min(32, -(-2 * L2_BYTES // (k * n * 2))))
    ws = [(jax.random.normal(c, (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
          for c in jax.random.split(key, bf16_copies)]
    runs = {"bf16": (lambda x_, w_: [jnp.dot(x_, wc) for wc in w_], (x, ws), bf16_copies)}
    qw, sc = _random_int4(key, k, n, group_size, copies)
    for kernel in kernels:
        for name, cfg in (configs or {"": None}).items():
            def kern(x_, q_, s_, cfg=cfg, kernel=None if kernel == "auto" else kernel):
                return [int4_matmul(x_, qc, scc, group_size=group_size, config=cfg, kernel=kernel)
                        for qc, scc in zip(q_, s_)]
            suffix = "" if kernel == "auto" else f"_{kernel}"
            runs[f"int4_kpacked{suffix}{name}"] = (kern, (x, qw, sc), copies)
    if m > 1:
        runs["xla_dequant_kpacked"] = (
            lambda x_, q_, s_: [int4_matmul_reference(x_, qc, scc, group_size=group_size) for qc, scc in zip(q_, s_)],
            (x, qw, sc), copies)
        # The same with the dequantized weight materialised (an optimisation barrier between dequantize and
        # the dot), so XLA cannot fuse the dequantization into its GEMM: what that fusion costs.
        runs["xla_dequant_barrier"] = (
            lambda x_, q_, s_: [jnp.dot(x_, jax.lax.optimization_barrier(dequantize(qc, scc, group_size=group_size,
                                                                                    dtype=x_.dtype)),
                                        preferred_element_type=jnp.float32).astype(x_.dtype)
                                for qc, scc in zip(q_, s_)],
            (x, qw, sc), copies)
    # ~20 GB of weight reads per timed run (several ms): with ~1 GB (a few hundred µs) the fixed cost of
    # launching the jitted loop showed in the per-call times (H200, 2026-11-23: gate_up GEMV 73.5 µs in the
    # table vs 40 µs per kernel in a profile of the same call).
    iters = 2 if smoke else max(10, min(400, int(ITER_BYTES // (int4_bytes * copies))))
    for name, (fn, args, n_copies) in runs.items():
        try:
            times = device_loop_time(fn, args, iters=iters, repeats=repeats, chain=0)  # x: tiny
            out["seconds"][name] = [t / n_copies for t in times]
        except Exception as e:  # a config Triton cannot compile is reported, not fatal
            out["seconds"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print(f"    {name} [{m}x{k}]@[{k}x{n}]: {out['seconds'][name]}", file=sys.stderr, flush=True)
    kernel = default_kernel(m, group_size)
    cfg, splits = choose_config(m, k, n, group_size, kernel=kernel)
    out["config"] = dict(dataclasses.asdict(cfg), splits=splits, kernel=kernel)
    return out


def bench_int4(config: ModelConfig, ms: list[int], group_size: int, repeats: int,
               configs: dict[str, Int4Config | None] | None = None, kernels: tuple[str, ...] = ("auto",)) -> dict:
    """Every linear shape of ``config`` at every ``m`` in ``ms``."""
    rows = []
    for name, (k, n) in linear_shapes(config).items():
        for m in ms:
            print(f"  int4 {name} m={m}", file=sys.stderr, flush=True)
            rows.append(dict(bench_linear(k, n, m, group_size, repeats, configs, kernels), name=name))
    return {"group_size": group_size, "rows": rows}


PEER = "tinygemm"  # the torch peer's column: torch.ops.aten._weight_int4pack_mm


def add_peer(result: dict, linears: list[dict]) -> None:
    """Adds the torch peer's tinygemm times (``benchmarks.torch_peer --linears_ms``, same shapes, rows and
    group size) to :func:`bench_int4`'s rows as ``seconds["tinygemm"]``."""
    peer = {(p["name"], p["m"], p["group_size"]): p["seconds"] for p in linears}
    for row in result["rows"]:
        key = (row["name"], row["m"], result["group_size"])
        if key in peer:
            row["seconds"][PEER] = peer[key]


def int4_markdown(r: dict, bandwidth: float) -> str:
    """Table: µs per call, int4 GB/s and % of copy bandwidth, speed-up over bf16 (and, with the torch peer's
    tinygemm times, the int4 kernel's speed-up over tinygemm)."""
    names = sorted({n for row in r["rows"] for n in row["seconds"]} - {"bf16"})
    peer = PEER in names and "int4_kpacked" in names
    head = ("| linear | M | K×N | bf16 µs (% BW) | " + " | ".join(f"{n} µs (% BW, × bf16)" for n in names)
            + (" | int4_kpacked × tinygemm" if peer else "") + " |")
    # The timed loops run inside XLA's command buffers when they are on, which adds ~1 us to a one-row call of a
    # 4096 x 4608 linear (H200, 2026-11-29), so the title says which.
    on = r.get("xla_command_buffers")
    buffers = "" if on is None else f", XLA command buffers {'on' if on else 'off'}"
    lines = [f"int4 dequant-GEMM, group {r['group_size']}, copy bandwidth {bandwidth / 1e12:.2f} TB/s{buffers} "
             "(% BW counts int4 codes + scales + x + y; bf16 counts its weight + x + y)", "", head,
             "|" + "---|" * (3 + 1 + len(names) + peer)]
    for row in r["rows"]:
        secs = row["seconds"]

        def cell(name, nbytes):
            t = secs.get(name)
            if not isinstance(t, list):
                return "—" if t is None else "error"
            s = statistics.median(t)
            text = f"{s * 1e6:.1f} ({100 * nbytes / s / bandwidth:.0f}%"
            if name != "bf16" and isinstance(secs.get("bf16"), list):
                text += f", {statistics.median(secs['bf16']) / s:.2f}×"
            return text + ")"

        io = row["io_bytes"]
        cells = [cell("bf16", row["bf16_bytes"] + io)] + [cell(n, row["int4_bytes"] + io) for n in names]
        if peer:
            ours, theirs = secs.get("int4_kpacked"), secs.get(PEER)
            both = isinstance(ours, list) and isinstance(theirs, list)
            cells.append(f"{statistics.median(theirs) / statistics.median(ours):.2f}×" if both else "—")
        lines.append(f"| {row['name']} | {row['m']} | {row['k']}×{row['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
