"""Launch-config sweep for the attention kernels: ``python -m benchmarks.tune --out tune.json``.

Times every candidate :class:`~pallas_kernels.launch.KernelConfig` on MiniCPM4 attention shapes (bf16,
batch 1, 2 KV heads; head_dim 128 with 32 query heads as in MiniCPM4-8B, head_dim 64 with 16 as in
MiniCPM4-0.5B): causal prefill of an 8K prompt, and one-token decode against a 32K cache. Each candidate
is first checked against the jnp reference. The winners go into ``pallas_kernels.launch.TUNED`` by hand,
with the sweep recorded in the lab notes. GPU only.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import attention_reference, decode_attention, decode_attention_splits, prefill_attention
from pallas_kernels.launch import KernelConfig
from benchmarks.timing import device_loop_time

SHAPES = {128: (32, 2), 64: (16, 2)}  # head_dim -> (q heads, kv heads)


def _inputs(kernel: str, head_dim: int, context: int):
    h, kvh = SHAPES[head_dim]
    t = context if kernel == "prefill" else 1
    keys = jax.random.split(jax.random.PRNGKey(head_dim), 3)
    q = jax.random.normal(keys[0], (1, t, h, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, kvh, context, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, kvh, context, head_dim), jnp.bfloat16)
    positions = (context - t + jnp.arange(t, dtype=jnp.int32))[None]
    return q, k, v, positions, jnp.array([context], jnp.int32)


def candidates(kernel: str) -> list[KernelConfig]:
    if kernel == "prefill":
        grid = itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
    else:
        grid = itertools.product((64,), (32, 64, 128, 256), (2, 4, 8), (2, 3, 4))
    return [KernelConfig(*c) for c in grid]


def sweep(kernel: str, head_dim: int, context: int, iters: int) -> list[dict]:
    fn = prefill_attention if kernel == "prefill" else decode_attention
    args = _inputs(kernel, head_dim, context)
    scale = head_dim**-0.5
    check_args = args if kernel == "decode" else _inputs(kernel, head_dim, 1024)
    ref = attention_reference(*(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in check_args), scale=scale)
    rows = []
    for cfg in candidates(kernel):
        call = functools.partial(fn, scale=scale, config=cfg)
        try:
            out = jax.jit(call)(*check_args)
            err = float(jnp.linalg.norm((out.astype(jnp.float32) - ref).ravel()) / jnp.linalg.norm(ref.ravel()))
            times = device_loop_time(call, args, iters=iters)
        except Exception as e:  # a config Triton cannot compile (e.g. out of shared memory) is skipped
            rows.append({"config": cfg.__dict__, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        q_heads, _ = SHAPES[head_dim]
        row = {"config": cfg.__dict__, "rel_err": err, "seconds": times}
        if kernel == "prefill":
            row["tflops"] = 4 * q_heads * head_dim * context * (context + 1) / 2 / statistics.median(times) / 1e12
        else:
            row["gb_s"] = 2 * args[1].nbytes / statistics.median(times) / 1e9
        rows.append(row)
        print(kernel, head_dim, cfg, f"err {err:.1e}", [f"{1e6 * t:.1f}us" for t in times], flush=True)
    return rows


def split_sweep(head_dim: int, context: int, splits: list[int]) -> list[dict]:
    """Decode with the tuned config at several split counts: whole op and kernel alone."""
    args = _inputs("decode", head_dim, context)
    rows = []
    for n in splits:
        row = {"context": context, "num_splits": n}
        for name, fn in (("full", decode_attention), ("kernel", decode_attention_splits)):
            call = functools.partial(fn, scale=head_dim**-0.5, num_splits=n)
            row[name] = device_loop_time(call, args, iters=200)
        row["gb_s"] = 2 * args[1].nbytes / statistics.median(row["full"]) / 1e9
        print("splits", head_dim, context, n, {k: [f"{1e6 * t:.1f}us" for t in row[k]] for k in ("full", "kernel")},
              f"{row['gb_s']:.0f} GB/s", flush=True)
        rows.append(row)
    return rows


def decode_grid(head_dim: int, context: int, splits: list[int]) -> list[dict]:
    """Every decode candidate config x split count, whole op (kernel + merge), cycling through enough
    layers of cache that K/V come from HBM rather than L2."""
    h, kvh = SHAPES[head_dim]
    per_layer = 2 * kvh * context * head_dim * 2
    layers = max(1, min(32, -(-200 * 2**20 // per_layer)))
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(keys[0], (1, 1, h, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (layers, 1, kvh, context, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (layers, 1, kvh, context, head_dim), jnp.bfloat16)
    args = (q, k, v, jnp.array([[context - 1]], jnp.int32), jnp.array([context], jnp.int32))
    rows = []
    configs = [c for c in candidates("decode") if c.block_k <= 128 and c.num_stages <= 3]
    for cfg, n in itertools.product(configs, splits):
        def run(q_, k_, v_, p_, l_, cfg=cfg, n=n):
            return [decode_attention(q_, k_, v_, p_, l_, scale=head_dim**-0.5, layer=i, config=cfg, num_splits=n)
                    for i in range(layers)]
        try:
            times = [t / layers for t in device_loop_time(run, args, iters=max(5, 2000 // layers))]
        except Exception as e:
            rows.append({"config": cfg.__dict__, "num_splits": n, "error": str(e)[:200]})
            continue
        row = {"config": cfg.__dict__, "num_splits": n, "seconds": times, "gb_s": per_layer / statistics.median(times) / 1e9}
        print("grid", head_dim, context, n, cfg, [f"{1e6 * t:.1f}us" for t in times], f"{row['gb_s']:.0f} GB/s", flush=True)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="prefill,decode")
    parser.add_argument("--head_dims", default="128,64")
    parser.add_argument("--prefill_context", type=int, default=8192)
    parser.add_argument("--decode_context", type=int, default=32768)
    parser.add_argument("--split_contexts", default="", help="also sweep decode split counts at these contexts")
    parser.add_argument("--splits", default="8,16,32,64,128,256")
    parser.add_argument("--grid_contexts", default="", help="sweep decode configs x --splits at these contexts")
    parser.add_argument("--out", default=None, help="write every row as JSON here")
    a = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("benchmarks.tune times Triton kernels: run it on a GPU")
    results = {}
    for ctx in (int(c) for c in a.grid_contexts.split(",") if c):
        results[f"grid/{ctx}"] = decode_grid(128, ctx, [int(n) for n in a.splits.split(",")])
    for ctx in (int(c) for c in a.split_contexts.split(",") if c):
        results[f"splits/{ctx}"] = split_sweep(128, ctx, [int(n) for n in a.splits.split(",")])
    for kernel, d in itertools.product((k for k in a.kernels.split(",") if k), (int(x) for x in a.head_dims.split(","))):
        ctx = a.prefill_context if kernel == "prefill" else a.decode_context
        results[f"{kernel}/{d}"] = sweep(kernel, d, ctx, iters=10 if kernel == "prefill" else 200)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "results": results}, f, indent=1)
    print("\n| kernel | head_dim | best config | time µs (runs) | rate | rel err | 2nd best |\n|---|---|---|---|---|---|---|")
    for key, rows in results.items():
        if key.startswith(("splits/", "grid/")):
            best = sorted((r for r in rows if "seconds" in r or "full" in r),
                          key=lambda r: statistics.median(r.get("seconds") or r["full"]))[:5]
            for r in best:
                print(f"| {key} | best | {r.get('config', '-')} splits={r['num_splits']} | "
                      f"{1e6 * statistics.median(r.get('seconds') or r['full']):.1f} | {r['gb_s']:.0f} GB/s | | |")
            continue
        ok = sorted((r for r in rows if "seconds" in r and r["rel_err"] < 2e-2), key=lambda r: statistics.median(r["seconds"]))
        if not ok:
            print(f"| {key} | no config ran |")
            continue
        best = ok[0]
        rate = f"{best['tflops']:.0f} TFLOP/s" if "tflops" in best else f"{best['gb_s']:.0f} GB/s"
        second = f"{ok[1]['config']} {1e6 * statistics.median(ok[1]['seconds']):.1f}" if len(ok) > 1 else "-"
        kernel, d = key.split("/")
        print(f"| {kernel} | {d} | {best['config']} | {', '.join(f'{1e6 * t:.1f}' for t in best['seconds'])} | {rate} | "
              f"{best['rel_err']:.1e} | {second} |")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
