"""The ``kernels`` scenario: attention micro-benchmarks at a shape's attention dims (bf16, batch 1) — causal
prefill of a whole prompt (TFLOP/s against the matmul) and one-token decode against a cache (GB/s of the
K/V bytes read against the copy bandwidth) — for the Pallas kernels, the plain-XLA reference and cuDNN."""

from __future__ import annotations

import statistics
import sys

import jax
import jax.numpy as jnp

from benchmarks.shapes import SHAPES
from benchmarks.timing import device_loop_time
from minicpm_jax.config import ModelConfig
from pallas_kernels.attention import attention_reference, decode_attention, decode_attention_splits, prefill_attention

L2_BYTES = 50 * 1024**2  # H100 L2; decode rows cycle through enough layers of cache to stream past it


def _attention_inputs(config: ModelConfig, t: int, s: int, layers: int, dtype, seed: int):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (1, t, config.num_heads, config.head_dim), jnp.float32).astype(dtype)
    shape = (layers, 1, config.num_kv_heads, s, config.head_dim)
    k = jax.random.normal(keys[1], shape, jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], shape, jnp.float32).astype(dtype)
    return q, k, v


def _cudnn_attention(q, k_bshd, v_bshd, lengths, *, causal: bool):
    return jax.nn.dot_product_attention(q, k_bshd, v_bshd, is_causal=causal, key_value_seq_lengths=lengths,
                                        implementation="cudnn")


def _time_impls(impls: dict, args_for: dict, iters: int, repeats: int) -> dict:
    """{name: seconds per call (runs)} or {name: "error ..."} for each implementation."""
    out = {}
    for name, fn in impls.items():
        try:
            out[name] = device_loop_time(fn, args_for[name], iters=iters, repeats=repeats)
        except Exception as e:  # e.g. cuDNN without a kernel for this shape, or the S^2 reference out of memory
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print(f"    {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def bench_prefill_kernel(config: ModelConfig, ctx: int, dtype, repeats: int) -> dict:
    """Causal attention over a whole ``ctx``-token prompt (one chunk at offset 0)."""
    q, k, v = _attention_inputs(config, ctx, ctx, 1, dtype, seed=ctx)
    positions = jnp.arange(ctx, dtype=jnp.int32)[None]
    lengths = jnp.array([ctx], jnp.int32)
    scale = config.head_dim**-0.5
    bshd = lambda x: x[0].transpose(0, 2, 1, 3)  # cuDNN's [B, S, KVH, D] layout
    impls = {
        "pallas": lambda q_, k_, v_, p_, l_: prefill_attention(q_, k_, v_, p_, l_, scale=scale, layer=0),
        "xla": lambda q_, k_, v_, p_, l_: attention_reference(q_, k_, v_, p_, l_, scale=scale, layer=0),
        "cudnn": lambda q_, k_, v_, l_: _cudnn_attention(q_, k_, v_, l_, causal=True),
    }
    args = {"pallas": (q, k, v, positions, lengths), "xla": (q, k, v, positions, lengths),
            "cudnn": (q, bshd(k), bshd(v), lengths)}
    flop = 4 * config.num_heads * config.head_dim * ctx * (ctx + 1) / 2  # QK^T and PV over visible pairs
    iters = max(2, min(50, int(2e13 // flop)))
    print(f"  prefill attention ctx={ctx} ({iters} calls per timing)", file=sys.stderr, flush=True)
    return {"context": ctx, "flop": flop, "seconds": _time_impls(impls, args, iters, repeats)}


def bench_decode_kernel(config: ModelConfig, ctx: int, dtype, repeats: int, layers: int = 0) -> dict:
    """One query token per sequence against ``ctx`` cached keys; successive calls read different layers'
    caches so the K/V bytes come from HBM, not L2. ``layers``: layers per timed call (0 = enough to stream
    past L2, at most 32; fewer compile faster, for smoke runs)."""
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = 2 * config.num_kv_heads * ctx * config.head_dim * itemsize  # per layer, K and V
    layers = layers or max(1, min(32, -(-4 * L2_BYTES // kv_bytes)))
    q, k, v = _attention_inputs(config, 1, ctx, layers, dtype, seed=ctx)
    positions = jnp.array([[ctx - 1]], jnp.int32)
    lengths = jnp.array([ctx], jnp.int32)
    scale = config.head_dim**-0.5

    def every_layer(kernel):
        def run(q_, k_, v_, p_, l_):
            return [kernel(q_, k_, v_, p_, l_, scale=scale, layer=i) for i in range(layers)]
        return run

    def cudnn_every_layer(q_, k_, v_, l_):
        return [_cudnn_attention(q_, k_[i], v_[i], l_, causal=False) for i in range(layers)]

    bshd = lambda x: x[:, 0].transpose(0, 2, 1, 3)[:, None]  # [layers, 1, S, KVH, D]
    impls = {"pallas": every_layer(decode_attention), "pallas_splits": every_layer(decode_attention_splits),
             "xla": every_layer(attention_reference), "cudnn": cudnn_every_layer}
    args = {"pallas": (q, k, v, positions, lengths), "pallas_splits": (q, k, v, positions, lengths),
            "xla": (q, k, v, positions, lengths), "cudnn": (q, bshd(k), bshd(v), lengths)}
    iters = max(5, min(200, int(2e10 // (kv_bytes * layers))))
    print(f"  decode attention ctx={ctx} ({layers} layers x {iters} calls per timing)", file=sys.stderr, flush=True)
    seconds = _time_impls(impls, args, iters, repeats)
    per_call = {n: [t / layers for t in ts] if isinstance(ts, list) else ts for n, ts in seconds.items()}
    return {"context": ctx, "bytes": kv_bytes, "layers": layers, "seconds": per_call}


def bench_kernels(shape: str, prefill_contexts: list[int], decode_contexts: list[int], dtype, repeats: int,
                  decode_layers: int = 0) -> dict:
    config = ModelConfig.from_dict(SHAPES[shape])
    return {
        "heads": [config.num_heads, config.num_kv_heads, config.head_dim],
        "dtype": jnp.dtype(dtype).name,
        "prefill": [bench_prefill_kernel(config, c, dtype, repeats) for c in prefill_contexts],
        "decode": [bench_decode_kernel(config, c, dtype, repeats, decode_layers) for c in decode_contexts],
    }


def _cell(times, to_rate) -> str:
    if not isinstance(times, list):
        return "n/a"
    return f"{to_rate(statistics.median(times)):,.0f} ({', '.join(f'{to_rate(t):,.0f}' for t in times)})"


def kernels_markdown(r: dict, bandwidth: float, flops: float) -> str:
    h, kvh, d = r["heads"]
    lines = [
        f"Attention kernels, {h} q heads / {kvh} kv heads / head_dim {d}, {r['dtype']}, batch 1. Ceilings measured in this "
        f"run: bf16 matmul {flops / 1e12:.0f} TFLOP/s, copy {bandwidth / 1e12:.2f} TB/s.",
        "",
        "| causal prefill | Pallas TFLOP/s (runs) | % of matmul | XLA TFLOP/s | cuDNN TFLOP/s | Pallas / cuDNN |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["prefill"]:
        sec, tf = row["seconds"], lambda t, f=row["flop"]: f / t / 1e12
        pct = f"{100 * tf(statistics.median(sec['pallas'])) * 1e12 / flops:.0f}%" if isinstance(sec["pallas"], list) else "n/a"
        ratio = (f"{statistics.median(sec['cudnn']) / statistics.median(sec['pallas']):.2f}x"
                 if isinstance(sec["pallas"], list) and isinstance(sec["cudnn"], list) else "n/a")
        lines.append(f"| {row['context']} | {_cell(sec['pallas'], tf)} | {pct} | {_cell(sec['xla'], tf)} | "
                     f"{_cell(sec['cudnn'], tf)} | {ratio} |")
    lines += [
        "",
        "| decode, 1 token | K/V MB read | Pallas µs (runs) | Pallas GB/s | % of copy | kernel w/o merge µs | XLA µs | cuDNN µs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    us = lambda t: 1e6 * t
    for row in r["decode"]:
        sec = row["seconds"]
        if isinstance(sec["pallas"], list):
            gbs = row["bytes"] / statistics.median(sec["pallas"])
            rate, pct = f"{gbs / 1e9:,.0f}", f"{100 * gbs / bandwidth:.0f}%"
        else:
            rate = pct = "n/a"
        fmt = lambda ts: (f"{us(statistics.median(ts)):.1f} ({', '.join(f'{us(t):.1f}' for t in ts)})"
                          if isinstance(ts, list) else "n/a")
        lines.append(f"| {row['context']} | {row['bytes'] / 1e6:.1f} | {fmt(sec['pallas'])} | {rate} | {pct} | "
                     f"{fmt(sec['pallas_splits'])} | {fmt(sec['xla'])} | {fmt(sec['cudnn'])} |")
    return "\n".join(lines)
